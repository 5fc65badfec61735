//! One lowering per primitive: `lower_op` reads like a dictionary from `Op`
//! to StableHLO. Inputs arrive as values of the op's input shapes (views
//! already read); outputs must have the shapes and dtypes `Op::infer` gave.
//!
//! Numerics follow the CPU backend (and PyTorch): bf16/f16 math computes in
//! float32 and rounds once; integer ops wrap; PyTorch's floor division,
//! remainder, sign, NaN-propagating max/min and NaN-largest sort order are
//! spelled out where StableHLO's own ops differ.
use super::{arr, list, Builder, Lit, Ty, Val};
use kiln_tensor::{
    ArgReduceOp, BinaryOp, CmpOp, DType, Error, Meta, Op, ReduceOp, Result, Scalar, ScatterReduce, UnaryOp,
};

/// A condition a program computes as one bool output, which must hold for its
/// result to be valid (XLA clamps bad indices and returns garbage for integer
/// division by zero; kiln raises the CPU backend's errors instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Every element of input `input` lies in `[0, size)` (an index along `dim`).
    Index { input: usize, dim: usize, size: usize },
    /// No divisor is zero (integer division and remainder).
    ZeroDivision,
    /// No exponent is negative (integer `pow`).
    NegativePower,
    /// The block tables, context lengths and query starts of a paged attention
    /// are consistent (Note [Paged attention]).
    PagedMetadata,
    /// The group sizes of a grouped product are non-negative and sum to at
    /// most the grouped dimension (Note [Grouped products]).
    GroupSizes,
}

/// The type float math runs in: float32 for bf16/f16, else the type itself.
fn compute(d: DType) -> DType {
    match d {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

fn up(b: &mut Builder, x: &Val) -> Val {
    let c = compute(x.dtype());
    b.convert_raw(x, c)
}

fn unsupported(op: &'static str, d: DType) -> Error {
    Error::unsupported_dtype(op, d)
}

/// Outputs of a lowering, and the checks (a bool scalar each) on its inputs.
pub type Lowered = (Vec<Val>, Vec<(Val, Check)>);

/// The lowering of `op`: its outputs, and the bool scalars that must be true
/// for the result to be valid, checked by the caller.
pub fn lower_op(b: &mut Builder, op: &Op, x: &[Val], outs: &[Meta]) -> Result<Lowered> {
    let out = |i: usize| -> Ty { Ty::new(&outs[i].shape, outs[i].dtype) };
    let one = |v: Val| -> Result<Lowered> { Ok((vec![v], vec![])) };
    match op {
        Op::Custom(c) => super::custom::lower(b, c, x, outs),
        Op::Full { shape, value, dtype } => {
            let lit = match *value {
                Scalar::Bool(v) => Lit::B(v),
                Scalar::Int(v) => Lit::I(v),
                Scalar::Float(v) => Lit::F(v),
            };
            one(b.splat(lit, *dtype, shape))
        }
        Op::Arange { start, step, len, dtype } => {
            let i = b.iota(&[*len], 0, DType::F64);
            let st = b.splat(Lit::F(*step), DType::F64, &[*len]);
            let s0 = b.splat(Lit::F(*start), DType::F64, &[*len]);
            let p = b.mul(&st, &i);
            let v = b.add(&s0, &p);
            one(b.cast(&v, *dtype))
        }
        Op::RandomBits { shape } => {
            let (bits, state) = super::random::random_bits(b, &x[0], shape);
            Ok((vec![bits, state], vec![]))
        }
        Op::Unary(u) => one(unary(b, *u, &x[0])?),
        Op::Binary(o) => {
            let v = binary(b, *o, &x[0], &x[1])?;
            let dt = x[0].dtype();
            let checks = match o {
                BinaryOp::Div | BinaryOp::FloorDiv | BinaryOp::Remainder | BinaryOp::Fmod if !dt.is_float() => {
                    vec![(all_true(b, &x[1], "NE", 0), Check::ZeroDivision)]
                }
                BinaryOp::Pow if dt.is_int() && dt != DType::U8 => {
                    vec![(all_true(b, &x[1], "GE", 0), Check::NegativePower)]
                }
                _ => vec![],
            };
            Ok((vec![v], checks))
        }
        Op::Compare(c) => {
            let dir = match c {
                CmpOp::Eq => "EQ",
                CmpOp::Ne => "NE",
                CmpOp::Lt => "LT",
                CmpOp::Le => "LE",
                CmpOp::Gt => "GT",
                CmpOp::Ge => "GE",
            };
            one(b.compare(dir, &x[0], &x[1]))
        }
        Op::Where => one(b.select(&x[0], &x[1], &x[2])),
        Op::Cast(to) => one(b.cast(&x[0], *to)),
        Op::Copy => one(x[0].clone()),
        Op::Reduce { op: r, dims, keepdim: _ } => {
            let v = reduce(b, *r, &x[0], dims, outs[0].dtype)?;
            one(b.reshape(&v, &outs[0].shape))
        }
        Op::ArgReduce { op: r, dim, keepdim: _ } => {
            let (v, d) = match dim {
                Some(d) => (x[0].clone(), *d),
                None => {
                    let n = x[0].ty.numel();
                    (b.reshape(&x[0], &[n]), 0)
                }
            };
            let i = arg_reduce(b, *r, &v, d);
            one(b.reshape(&i, &outs[0].shape))
        }
        Op::Softmax { dim, log } => {
            let xf = up(b, &x[0]);
            let m = max_keep(b, &xf, *dim);
            let z = b.sub(&xf, &m);
            let e = b.unary("exponential", &z);
            let s = sum_keep(b, &e, *dim);
            let y = if *log {
                let l = b.unary("log", &s);
                b.sub(&z, &l)
            } else {
                b.div(&e, &s)
            };
            one(b.convert_raw(&y, outs[0].dtype))
        }
        Op::LogSumExp { dim } => {
            let xf = up(b, &x[0]);
            let l = logsumexp(b, &xf, *dim);
            one(b.convert_raw(&l, outs[0].dtype))
        }
        Op::Cumsum { dim } => {
            // Accumulate in float32 for bf16/f16 (each prefix rounded once), int64 for integers.
            let v = b.cast(&x[0], compute(outs[0].dtype));
            if v.ty.rank() == 0 || v.ty.numel() == 0 {
                return one(b.convert_raw(&v, outs[0].dtype));
            }
            let n = v.shape()[*dim];
            let r = v.ty.rank();
            let mut win = vec![1; r];
            win[*dim] = n.max(1);
            let mut pad = vec!["0, 0".to_string(); r];
            pad[*dim] = format!("{}, 0", n.saturating_sub(1));
            let dt = v.dtype();
            let init = b.constant(Lit::I(0), dt);
            let st = Ty::new(&[], dt);
            let region = b.region(&[st.clone(), st], |b, a| vec![b.add(&a[0], &a[1])]);
            let rows: Vec<String> = pad.iter().map(|p| format!("[{p}]")).collect();
            let attrs = format!(
                "window_dimensions = {}, window_strides = {}, padding = dense<[{}]> : tensor<{r}x2xi64>",
                arr(&win),
                arr(&vec![1; r]),
                rows.join(", ")
            );
            let ty = v.ty.clone();
            let c = b.op_region("stablehlo.reduce_window", &[&v, &init], &region, &attrs, ty);
            one(b.convert_raw(&c, outs[0].dtype))
        }
        Op::MatMul => {
            let r = x[0].ty.rank();
            let batch: Vec<usize> = (0..r - 2).collect();
            let (l, rr) = (up(b, &x[0]), up(b, &x[1]));
            let p = b.dot_general(&l, &rr, &batch, &batch, &[r - 1], &[r - 2]);
            one(b.convert_raw(&p, outs[0].dtype))
        }
        Op::Cat { dim } => {
            let parts: Vec<&Val> = x.iter().filter(|v| v.ty.numel() > 0 || x.len() == 1).collect();
            if parts.is_empty() {
                return one(b.splat(Lit::I(0), outs[0].dtype, &outs[0].shape));
            }
            one(b.concat(&parts, *dim))
        }
        Op::Gather { dim } => {
            let (src, idx) = (&x[0], &x[1]);
            let ok = index_check(b, idx, src, *dim);
            let coords = coordinates(b, idx, *dim);
            let r = src.ty.rank();
            let all: Vec<usize> = (0..r).collect();
            let attrs = format!(
                "dimension_numbers = #stablehlo.gather<collapsed_slice_dims = {}, start_index_map = {}, index_vector_dim = {r}>, indices_are_sorted = false, slice_sizes = {}",
                list(&all),
                list(&all),
                arr(&vec![1; r])
            );
            let g = if idx.ty.numel() == 0 || r == 0 {
                gather0(b, src, idx)
            } else {
                b.op("stablehlo.gather", &[src, &coords], &attrs, out(0))
            };
            Ok((vec![g], vec![ok]))
        }
        Op::Scatter { dim, reduce } => {
            let (base, idx, src) = (&x[0], &x[1], &x[2]);
            let ok = index_check(b, idx, base, *dim);
            if idx.ty.numel() == 0 || base.ty.rank() == 0 {
                return Ok((vec![base.clone()], vec![ok]));
            }
            let upd = b.slice(src, &vec![0; src.ty.rank()], idx.shape(), &vec![1; src.ty.rank()]);
            let coords = coordinates(b, idx, *dim);
            let r = base.ty.rank();
            let all: Vec<usize> = (0..r).collect();
            let add = *reduce == ScatterReduce::Add;
            let v = scatter(b, base, &coords, &upd, &[], &all, &all, r, add);
            Ok((vec![v], vec![ok]))
        }
        Op::IndexSelect { dim } => {
            let (src, idx) = (&x[0], &x[1]);
            let ok = index_check(b, idx, src, *dim);
            if idx.ty.numel() == 0 || outs[0].shape.iter().product::<usize>() == 0 {
                return Ok((vec![b.splat(Lit::I(0), outs[0].dtype, &outs[0].shape)], vec![ok]));
            }
            let r = src.ty.rank();
            if r == 0 {
                // A 0-d source: every index must be 0; the result repeats the value.
                return Ok((vec![b.broadcast(src, &outs[0].shape, &[])], vec![ok]));
            }
            let i2 = b.reshape(idx, &[idx.ty.numel(), 1]);
            let offset: Vec<usize> = (0..r).filter(|&d| d != *dim).collect();
            let mut sizes = src.shape().to_vec();
            sizes[*dim] = 1;
            // Gather puts the index dim first among batch dims: output [n, rest...]; then move it to `dim`.
            let offset_dims: Vec<usize> = (1..r).collect();
            let attrs = format!(
                "dimension_numbers = #stablehlo.gather<offset_dims = {}, collapsed_slice_dims = [{dim}], start_index_map = [{dim}], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = {}",
                list(&offset_dims),
                arr(&sizes)
            );
            let mut gshape = vec![idx.ty.numel()];
            gshape.extend(offset.iter().map(|&d| src.shape()[d]));
            let g = b.op("stablehlo.gather", &[src, &i2], &attrs, Ty::new(&gshape, src.dtype()));
            // g: [n, dims except `dim`] -> put n at `dim`.
            let mut perm: Vec<usize> = (1..r).collect();
            perm.insert(*dim, 0);
            let v = b.transpose(&g, &perm);
            let v = b.reshape(&v, &outs[0].shape);
            Ok((vec![v], vec![ok]))
        }
        Op::IndexAdd { dim } => {
            let (base, idx, src) = (&x[0], &x[1], &x[2]);
            let ok = index_check(b, idx, base, *dim);
            if idx.ty.numel() == 0 || base.ty.numel() == 0 {
                return Ok((vec![base.clone()], vec![ok]));
            }
            let r = base.ty.rank();
            let n = idx.ty.numel();
            let i2 = b.reshape(idx, &[n, 1]);
            // Updates with the index dim first: [n, rest...].
            let mut perm = vec![*dim];
            perm.extend((0..r).filter(|&d| d != *dim));
            let upd = b.transpose(src, &perm);
            let window: Vec<usize> = (1..r).collect();
            let v = scatter(b, base, &i2, &upd, &window, &[*dim], &[*dim], 1, true);
            Ok((vec![v], vec![ok]))
        }
        Op::Sort { dim, descending, stable: _ } => {
            let (v, i) = sort(b, &x[0], *dim, *descending);
            Ok((vec![v, i], vec![]))
        }
        Op::TopK { k, dim, largest } => {
            let (v, i) = sort(b, &x[0], *dim, *largest);
            let v = b.slice_dim(&v, *dim, 0, *k);
            let i = b.slice_dim(&i, *dim, 0, *k);
            Ok((vec![v, i], vec![]))
        }
        Op::Assign { shape, strides, offset } => {
            let layout = kiln_tensor::Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
            let n = x[0].ty.numel();
            let flat = b.reshape(&x[0], &[n]);
            let w = super::write_view(b, &flat, &layout, &x[1])?;
            one(b.reshape(&w, &outs[0].shape))
        }
        Op::Collective(c) => one(super::collective::lower(b, c, &x[0], &outs[0])),
        Op::Dequantize(spec) => one(super::quant::dequantize(b, spec, &x[0], &x[1])),
        Op::QuantMatMul(spec) => one(super::quant::quant_matmul(b, spec, &x[0], &x[1], &x[2], outs[0].dtype)),
        Op::Rotary => one(rotary(b, &x[0], &x[1], &x[2])),
        Op::GroupedMatMul => {
            let (o, ok) = super::grouped::grouped_mm(b, x, &outs[0])?;
            Ok((vec![o], vec![ok]))
        }
        Op::PagedAttention { scale } => {
            let (o, ok) = super::paged::paged_attention(b, x, *scale, &outs[0]);
            Ok((vec![o], vec![ok]))
        }
        Op::Attention { scale, causal } => {
            let (o, lse) = attention(b, &x[0], &x[1], &x[2], *scale, *causal, outs);
            Ok((vec![o, lse], vec![]))
        }
        Op::AttentionBackward { scale, causal } => Ok((attention_backward(b, x, *scale, *causal, outs), vec![])),
        Op::CrossEntropyBackward { smoothing } => {
            let ok = index_check(b, &x[1], &x[0], 1);
            Ok((vec![cross_entropy_backward(b, x, *smoothing, outs)], vec![ok]))
        }
        Op::RmsNorm { eps } => {
            let (xf, wf) = (up(b, &x[0]), up(b, &x[1]));
            let r = xf.ty.rank();
            let d = xf.shape()[r - 1];
            let acc = outs[1].dtype;
            let xa = b.convert_raw(&xf, acc);
            let sq = b.mul(&xa, &xa);
            let ss = b.reduce(&sq, Lit::F(0.0), &[r - 1], "add");
            let rows = ss.shape().to_vec();
            let dn = b.splat(Lit::F(d as f64), acc, &rows);
            let ms = b.div(&ss, &dn);
            let e = b.splat(Lit::F(*eps), acc, &rows);
            let t = b.add(&ms, &e);
            let sq = b.unary("sqrt", &t);
            let o = b.splat_like(Lit::F(1.0), &sq);
            let rstd = b.div(&o, &sq);
            let rb = b.broadcast(&rstd, xa.shape(), &(0..r - 1).collect::<Vec<_>>());
            let rb = b.convert_raw(&rb, xf.dtype());
            let xn = b.mul(&xf, &rb);
            let wb = b.broadcast(&wf, xf.shape(), &[r - 1]);
            let y = b.mul(&xn, &wb);
            Ok((vec![b.convert_raw(&y, outs[0].dtype), rstd], vec![]))
        }
        Op::RmsNormBackward { eps: _ } => {
            let (xf, wf, rstd, g) = (up(b, &x[0]), up(b, &x[1]), &x[2], up(b, &x[3]));
            let ct = xf.dtype();
            let r = xf.ty.rank();
            let d = xf.shape()[r - 1];
            let lead: Vec<usize> = (0..r - 1).collect();
            let rs = b.convert_raw(rstd, ct);
            let rb = b.broadcast(&rs, xf.shape(), &lead);
            let wb = b.broadcast(&wf, xf.shape(), &[r - 1]);
            let gw = b.mul(&g, &wb);
            // dx = rstd * gw - x * rstd^3 * sum(gw * x) / D
            let gx = b.mul(&gw, &xf);
            let s = b.reduce(&gx, Lit::F(0.0), &[r - 1], "add");
            let dn = b.splat(Lit::F(d as f64), ct, s.shape());
            let s = b.div(&s, &dn);
            let sb = b.broadcast(&s, xf.shape(), &lead);
            let r2 = b.mul(&rb, &rb);
            let r3 = b.mul(&r2, &rb);
            let t1 = b.mul(&rb, &gw);
            let t2 = b.mul(&xf, &r3);
            let t2 = b.mul(&t2, &sb);
            let dx = b.sub(&t1, &t2);
            let xn = b.mul(&xf, &rb);
            let gxn = b.mul(&g, &xn);
            let dw = b.reduce(&gxn, Lit::F(0.0), &lead, "add");
            Ok((vec![b.convert_raw(&dx, outs[0].dtype), b.convert_raw(&dw, outs[1].dtype)], vec![]))
        }
        Op::View(v) => {
            Err(Error::backend("pjrt", format!("view op {} reached the backend (views are layouts)", v.name())))
        }
    }
}

// ---- elementwise ---------------------------------------------------------------------

fn unary(b: &mut Builder, op: UnaryOp, x: &Val) -> Result<Val> {
    use UnaryOp as U;
    let dt = x.dtype();
    match op {
        U::Not => return Ok(if dt == DType::Bool { b.not(x) } else { b.compare_lit("EQ", x, Lit::I(0)) }),
        U::IsNan => {
            return Ok(if dt.is_float() { b.is_nan(x) } else { b.splat(Lit::B(false), DType::Bool, x.shape()) });
        }
        U::IsInf => {
            if !dt.is_float() {
                return Ok(b.splat(Lit::B(false), DType::Bool, x.shape()));
            }
            let a = b.unary("abs", x);
            return Ok(b.compare_lit("EQ", &a, Lit::F(f64::INFINITY)));
        }
        _ => {}
    }
    if dt == DType::Bool {
        return match op {
            U::Abs | U::Sign | U::Floor | U::Ceil | U::Round | U::Trunc => Ok(x.clone()),
            _ => Err(unsupported(op.name(), dt)),
        };
    }
    if !dt.is_float() {
        return match op {
            U::Neg => Ok(b.unary("negate", x)),
            U::Abs => Ok(b.unary("abs", x)),
            U::Sign => Ok(b.unary("sign", x)),
            U::Floor | U::Ceil | U::Round | U::Trunc => Ok(x.clone()),
            _ => Err(unsupported(op.name(), dt)),
        };
    }
    let f = up(b, x);
    let y = match op {
        U::Neg => b.unary("negate", &f),
        U::Abs => b.unary("abs", &f),
        U::Sign => {
            // (0 < x) - (x < 0): NaN and -0.0 give 0.
            let z = b.splat_like(Lit::F(0.0), &f);
            let p = b.compare("GT", &f, &z);
            let n = b.compare("LT", &f, &z);
            let (pf, nf) = (b.convert_raw(&p, f.dtype()), b.convert_raw(&n, f.dtype()));
            b.sub(&pf, &nf)
        }
        U::Exp => b.unary("exponential", &f),
        U::Log => b.unary("log", &f),
        U::Log1p => b.unary("log_plus_one", &f),
        U::Expm1 => b.unary("exponential_minus_one", &f),
        U::Sqrt => b.unary("sqrt", &f),
        U::Rsqrt => {
            let s = b.unary("sqrt", &f);
            let o = b.splat_like(Lit::F(1.0), &f);
            b.div(&o, &s)
        }
        U::Recip => {
            let o = b.splat_like(Lit::F(1.0), &f);
            b.div(&o, &f)
        }
        U::Tanh => b.unary("tanh", &f),
        U::Sigmoid => b.unary("logistic", &f),
        U::Silu => {
            let s = b.unary("logistic", &f);
            b.mul(&f, &s)
        }
        U::SiluGrad => silu_grad(b, &f),
        U::Sin => b.unary("sine", &f),
        U::Cos => b.unary("cosine", &f),
        U::Erf => b.op("chlo.erf", &[&f], "", f.ty.clone()),
        U::Floor => b.unary("floor", &f),
        U::Ceil => b.unary("ceil", &f),
        U::Round => b.unary("round_nearest_even", &f),
        U::Trunc => {
            let z = b.splat_like(Lit::F(0.0), &f);
            let neg = b.compare("LT", &f, &z);
            let (c, fl) = (b.unary("ceil", &f), b.unary("floor", &f));
            b.select(&neg, &c, &fl)
        }
        U::Not | U::IsNan | U::IsInf => unreachable!("handled above"),
    };
    Ok(b.convert_raw(&y, dt))
}

/// `s (1 + x (1 - s))`, `s = sigmoid(x)`.
fn silu_grad(b: &mut Builder, f: &Val) -> Val {
    let s = b.unary("logistic", f);
    let o = b.splat_like(Lit::F(1.0), f);
    let oms = b.sub(&o, &s);
    let t = b.mul(f, &oms);
    let t = b.add(&o, &t);
    b.mul(&s, &t)
}

/// PyTorch's truth value (`!= 0`) of any dtype.
fn truth(b: &mut Builder, x: &Val) -> Val {
    if x.dtype() == DType::Bool {
        x.clone()
    } else {
        b.compare_lit("NE", x, Lit::I(0))
    }
}

/// `m != 0 && (m < 0) != (d < 0)`: the remainder needs the divisor's sign.
fn sign_fix(b: &mut Builder, m: &Val, d: &Val) -> Val {
    let nz = b.compare_lit("NE", m, Lit::I(0));
    let mn = b.compare_lit("LT", m, Lit::I(0));
    let dn = b.compare_lit("LT", d, Lit::I(0));
    let differ = b.compare("NE", &mn, &dn);
    b.and(&nz, &differ)
}

/// PyTorch's shifts, with its rule for amounts outside `[0, width)` spelled
/// out (left: 0; right: the shift by `width - 1`), so no backend's own
/// convention leaks in. Right shifts are arithmetic, logical for uint8.
fn shift(b: &mut Builder, left: bool, a0: &Val, b0: &Val) -> Val {
    let width = (a0.dtype().size_in_bytes() * 8) as i64;
    let nonneg = b.compare_lit("GE", b0, Lit::I(0));
    let below = b.compare_lit("LT", b0, Lit::I(width));
    let in_range = b.and(&nonneg, &below);
    if left {
        let s = b.binary("shift_left", a0, b0);
        let zero = b.splat_like(Lit::I(0), a0);
        return b.select(&in_range, &s, &zero);
    }
    let name = if a0.dtype() == DType::U8 { "shift_right_logical" } else { "shift_right_arithmetic" };
    let s = b.binary(name, a0, b0);
    let most = b.splat_like(Lit::I(width - 1), a0);
    let far = b.binary(name, a0, &most);
    b.select(&in_range, &s, &far)
}

fn binary(b: &mut Builder, op: BinaryOp, a0: &Val, b0: &Val) -> Result<Val> {
    use BinaryOp as B;
    let dt = a0.dtype();
    if op.is_logical() {
        let (ta, tb) = (truth(b, a0), truth(b, b0));
        return Ok(match op {
            B::And => b.and(&ta, &tb),
            B::Or => b.or(&ta, &tb),
            _ => b.binary("xor", &ta, &tb),
        });
    }
    if dt == DType::Bool {
        return Ok(match op {
            B::Add | B::Maximum | B::Fmax => b.or(a0, b0),
            B::Mul | B::Minimum | B::Fmin => b.and(a0, b0),
            B::Div | B::FloorDiv => a0.clone(),
            B::Remainder | B::Fmod => b.splat_like(Lit::B(false), a0),
            B::Pow => {
                let nb = b.not(b0);
                b.or(a0, &nb)
            }
            B::BitwiseAnd => b.and(a0, b0),
            B::BitwiseOr => b.or(a0, b0),
            B::BitwiseXor => b.binary("xor", a0, b0),
            _ => return Err(unsupported(op.name(), dt)),
        });
    }
    if !dt.is_float() {
        return Ok(match op {
            B::Add => b.add(a0, b0),
            B::Sub => b.sub(a0, b0),
            B::Mul => b.mul(a0, b0),
            B::Div => b.div(a0, b0),
            B::FloorDiv => {
                let q = b.div(a0, b0);
                let r = b.binary("remainder", a0, b0);
                let nz = b.compare_lit("NE", &r, Lit::I(0));
                let an = b.compare_lit("LT", a0, Lit::I(0));
                let bn = b.compare_lit("LT", b0, Lit::I(0));
                let differ = b.compare("NE", &an, &bn);
                let fix = b.and(&nz, &differ);
                let one = b.splat_like(Lit::I(1), a0);
                let q1 = b.sub(&q, &one);
                b.select(&fix, &q1, &q)
            }
            B::Remainder => {
                let m = b.binary("remainder", a0, b0);
                let fix = sign_fix(b, &m, b0);
                let mb = b.add(&m, b0);
                b.select(&fix, &mb, &m)
            }
            B::Fmod => b.binary("remainder", a0, b0),
            B::Pow => b.binary("power", a0, b0),
            B::Maximum | B::Fmax => b.binary("maximum", a0, b0),
            B::Minimum | B::Fmin => b.binary("minimum", a0, b0),
            B::BitwiseAnd => b.and(a0, b0),
            B::BitwiseOr => b.or(a0, b0),
            B::BitwiseXor => b.binary("xor", a0, b0),
            B::LeftShift | B::RightShift => shift(b, op == B::LeftShift, a0, b0),
            _ => return Err(unsupported(op.name(), dt)),
        });
    }
    let (a, c) = (up(b, a0), up(b, b0));
    let y = match op {
        B::Add => b.add(&a, &c),
        B::Sub => b.sub(&a, &c),
        B::Mul => b.mul(&a, &c),
        B::Div => b.div(&a, &c),
        B::FloorDiv => floor_div(b, &a, &c),
        B::Remainder => {
            let m = b.binary("remainder", &a, &c);
            let fix = sign_fix(b, &m, &c);
            let mb = b.add(&m, &c);
            b.select(&fix, &mb, &m)
        }
        B::Fmod => b.binary("remainder", &a, &c),
        B::Pow => b.binary("power", &a, &c),
        B::Maximum => nan_max(b, &a, &c, true),
        B::Minimum => nan_max(b, &a, &c, false),
        B::Fmax | B::Fmin => {
            // NaN-ignoring: a when a wins or b is NaN.
            let dir = if op == B::Fmax { "GT" } else { "LT" };
            let wins = b.compare(dir, &a, &c);
            let bn = b.is_nan(&c);
            let pick = b.or(&wins, &bn);
            b.select(&pick, &a, &c)
        }
        B::Atan2 => b.binary("atan2", &a, &c),
        B::SiluMul => {
            let s = b.unary("logistic", &a);
            let t = b.mul(&a, &s);
            b.mul(&t, &c)
        }
        B::SiluGradMul => {
            let g = silu_grad(b, &a);
            b.mul(&g, &c)
        }
        B::And | B::Or | B::Xor => unreachable!("handled above"),
        B::BitwiseAnd | B::BitwiseOr | B::BitwiseXor | B::LeftShift | B::RightShift => {
            return Err(unsupported(op.name(), dt))
        }
    };
    Ok(b.convert_raw(&y, dt))
}

/// NaN-propagating maximum (or minimum): `a + b` when either is NaN.
pub(super) fn nan_max(b: &mut Builder, a: &Val, c: &Val, max: bool) -> Val {
    let m = b.binary(if max { "maximum" } else { "minimum" }, a, c);
    if !a.dtype().is_float() {
        return m;
    }
    let (an, cn) = (b.is_nan(a), b.is_nan(c));
    let any = b.or(&an, &cn);
    let s = b.add(a, c);
    b.select(&any, &s, &m)
}

/// PyTorch's `div_floor_floating` (Python's `//`, with the sign of an exact zero).
fn floor_div(b: &mut Builder, a: &Val, c: &Val) -> Val {
    let m = b.binary("remainder", a, c);
    let am = b.sub(a, &m);
    let div = b.div(&am, c);
    let fix = sign_fix(b, &m, c);
    let one = b.splat_like(Lit::F(1.0), a);
    let d1 = b.sub(&div, &one);
    let div = b.select(&fix, &d1, &div);
    let fl = b.unary("floor", &div);
    let frac = b.sub(&div, &fl);
    let half = b.splat_like(Lit::F(0.5), a);
    let up_ = b.compare("GT", &frac, &half);
    let fl1 = b.add(&fl, &one);
    let rounded = b.select(&up_, &fl1, &fl);
    // An exact zero quotient takes the sign of a / b.
    let q = b.div(a, c);
    let zero = b.splat_like(Lit::F(0.0), a);
    let signed_zero = {
        let qn = b.compare("LT", &q, &zero);
        // -0.0 < 0 is false, so also look at the sign bit through 1/q (-inf for -0.0).
        let inv = b.div(&one, &q);
        let inv_neg = b.compare("LT", &inv, &zero);
        let neg_q = b.or(&qn, &inv_neg);
        let neg_zero = b.splat_like(Lit::F(-0.0), a);
        b.select(&neg_q, &neg_zero, &zero)
    };
    let is_zero = b.compare("EQ", &div, &zero);
    let r = b.select(&is_zero, &signed_zero, &rounded);
    // b == 0: a / b (inf or nan).
    let bz = b.compare("EQ", c, &zero);
    b.select(&bz, &q, &r)
}

// ---- reductions ----------------------------------------------------------------------

fn sum_keep(b: &mut Builder, x: &Val, dim: usize) -> Val {
    let s = b.reduce(x, Lit::F(0.0), &[dim], "add");
    let kept: Vec<usize> = (0..x.ty.rank()).filter(|&d| d != dim).collect();
    b.broadcast(&s, x.shape(), &kept)
}

fn max_keep(b: &mut Builder, x: &Val, dim: usize) -> Val {
    let s = b.reduce(x, Lit::F(f64::NEG_INFINITY), &[dim], "nan_maximum");
    let kept: Vec<usize> = (0..x.ty.rank()).filter(|&d| d != dim).collect();
    b.broadcast(&s, x.shape(), &kept)
}

/// Stable `log(sum(exp(x)))` along `dim` (removed); an infinite max stands in as 0.
fn logsumexp(b: &mut Builder, x: &Val, dim: usize) -> Val {
    let m = b.reduce(x, Lit::F(f64::NEG_INFINITY), &[dim], "nan_maximum");
    let a = b.unary("abs", &m);
    let inf = b.compare_lit("EQ", &a, Lit::F(f64::INFINITY));
    let z = b.splat_like(Lit::F(0.0), &m);
    let m = b.select(&inf, &z, &m);
    let kept: Vec<usize> = (0..x.ty.rank()).filter(|&d| d != dim).collect();
    let mb = b.broadcast(&m, x.shape(), &kept);
    let d = b.sub(x, &mb);
    let e = b.unary("exponential", &d);
    let s = b.reduce(&e, Lit::F(0.0), &[dim], "add");
    let l = b.unary("log", &s);
    b.add(&l, &m)
}

fn reduce(b: &mut Builder, op: ReduceOp, x: &Val, dims: &[usize], out: DType) -> Result<Val> {
    let dt = x.dtype();
    Ok(match op {
        ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod => {
            let acc = if dt.is_float() { compute(dt) } else { DType::I64 };
            let v = b.cast(x, acc);
            let (init, body) = if op == ReduceOp::Prod { (Lit::I(1), "multiply") } else { (Lit::I(0), "add") };
            let mut s = b.reduce(&v, init, dims, body);
            if op == ReduceOp::Mean {
                let n: usize = dims.iter().map(|&d| x.shape()[d]).product();
                let c = b.splat(Lit::F(n as f64), acc, s.shape());
                s = b.div(&s, &c);
            }
            b.cast(&s, out)
        }
        ReduceOp::Max | ReduceOp::Min => {
            let max = op == ReduceOp::Max;
            let init = match (dt.is_float(), max) {
                (true, true) => Lit::F(f64::NEG_INFINITY),
                (true, false) => Lit::F(f64::INFINITY),
                (false, _) => extreme_int(dt, max),
            };
            let v = up(b, x);
            let r = b.reduce(&v, init, dims, if max { "nan_maximum" } else { "nan_minimum" });
            b.convert_raw(&r, out)
        }
        ReduceOp::Any | ReduceOp::All => {
            let t = truth(b, x);
            if op == ReduceOp::Any {
                b.reduce(&t, Lit::B(false), dims, "or")
            } else {
                b.reduce(&t, Lit::B(true), dims, "and")
            }
        }
    })
}

/// The smallest (`lowest`) or largest value of an integer dtype.
fn extreme_int(d: DType, lowest: bool) -> Lit {
    let (lo, hi): (i64, i64) = match d {
        DType::U8 => (0, 255),
        DType::I8 => (i8::MIN as i64, i8::MAX as i64),
        DType::I16 => (i16::MIN as i64, i16::MAX as i64),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        DType::Bool => (0, 1),
        _ => (i64::MIN, i64::MAX),
    };
    if d == DType::Bool {
        return Lit::B(!lowest);
    }
    Lit::I(if lowest { lo } else { hi })
}

/// Index (int64) of the max/min along `dim`: ties give the first index, NaN counts as the extreme.
fn arg_reduce(b: &mut Builder, op: ArgReduceOp, x: &Val, dim: usize) -> Val {
    let v = up(b, x);
    let dt = v.dtype();
    let max = op == ArgReduceOp::ArgMax;
    let idx = b.iota(v.shape(), dim, DType::I64);
    let init_v = if dt.is_float() {
        b.constant(Lit::F(if max { f64::NEG_INFINITY } else { f64::INFINITY }), dt)
    } else {
        b.constant(extreme_int(dt, max), dt)
    };
    let init_i = b.constant(Lit::I(i64::MAX), DType::I64);
    let (st, si) = (Ty::new(&[], dt), Ty::new(&[], DType::I64));
    let float = dt.is_float();
    let region = b.region(&[st.clone(), si.clone(), st, si], |b, a| {
        let (av, ai, bv, bi) = (&a[0], &a[1], &a[2], &a[3]);
        let better = b.compare(if max { "GT" } else { "LT" }, av, bv);
        let eq = b.compare("EQ", av, bv);
        let (better, eq) = if float {
            let (an, bn) = (b.is_nan(av), b.is_nan(bv));
            let nbn = b.not(&bn);
            let nan_wins = b.and(&an, &nbn);
            let both = b.and(&an, &bn);
            (b.or(&better, &nan_wins), b.or(&eq, &both))
        } else {
            (better, eq)
        };
        let first = b.compare("LT", ai, bi);
        let tie = b.and(&eq, &first);
        let pick = b.or(&better, &tie);
        vec![b.select(&pick, av, bv), b.select(&pick, ai, bi)]
    });
    let shape: Vec<usize> = (0..v.ty.rank()).filter(|&d| d != dim).map(|d| v.shape()[d]).collect();
    let outs = b.op_n(
        "stablehlo.reduce",
        &[&v, &idx, &init_v, &init_i],
        &region,
        &format!("dimensions = {}", arr(&[dim])),
        &[Ty::new(&shape, dt), Ty::new(&shape, DType::I64)],
    );
    outs[1].clone()
}

// ---- sorting ------------------------------------------------------------------------

/// Stable sort along `dim` with NaN largest; returns values and int64 indices.
fn sort(b: &mut Builder, x: &Val, dim: usize, descending: bool) -> (Val, Val) {
    if x.ty.rank() == 0 {
        return (x.clone(), b.splat(Lit::I(0), DType::I64, &[]));
    }
    let idx = b.iota(x.shape(), dim, DType::I64);
    let dt = x.dtype();
    let float = dt.is_float();
    let (st, si) = (Ty::new(&[], dt), Ty::new(&[], DType::I64));
    let region = b.region(&[st.clone(), st, si.clone(), si], |b, a| {
        let (p, q) = (&a[0], &a[1]);
        let (p, q) = if float { (up(b, p), up(b, q)) } else { (p.clone(), q.clone()) };
        // Ascending "p before q": p < q, with NaN after everything.
        let (first, second) = if descending { (&q, &p) } else { (&p, &q) };
        let lt = b.compare("LT", first, second);
        let r = if float {
            let (fnan, snan) = (b.is_nan(first), b.is_nan(second));
            let nf = b.not(&fnan);
            let nan_after = b.and(&nf, &snan);
            b.or(&lt, &nan_after)
        } else {
            lt
        };
        vec![r]
    });
    let attrs = format!("dimension = {dim} : i64, is_stable = true");
    let outs = b.op_n("stablehlo.sort", &[x, &idx], &region, &attrs, &[x.ty.clone(), idx.ty.clone()]);
    (outs[0].clone(), outs[1].clone())
}

// ---- indexing -----------------------------------------------------------------------

/// The check that every index (input 1) lies in `[0, size)` of `src`'s `dim`.
fn index_check(b: &mut Builder, idx: &Val, src: &Val, dim: usize) -> (Val, Check) {
    let size = src.shape().get(dim).copied().unwrap_or(1);
    let ok = if idx.ty.numel() == 0 {
        b.constant(Lit::B(true), DType::Bool)
    } else {
        let lo = b.compare_lit("GE", idx, Lit::I(0));
        let hi = b.compare_lit("LT", idx, Lit::I(size as i64));
        let ok = b.and(&lo, &hi);
        let all: Vec<usize> = (0..idx.ty.rank()).collect();
        b.reduce(&ok, Lit::B(true), &all, "and")
    };
    (ok, Check::Index { input: 1, dim, size })
}

/// True when `compare(x, v, dir)` holds for every element.
fn all_true(b: &mut Builder, x: &Val, dir: &str, v: i64) -> Val {
    let c = b.compare_lit(dir, x, Lit::I(v));
    all(b, &c)
}

/// True when every element of the bool `x` is (true when it has none).
pub(super) fn all(b: &mut Builder, x: &Val) -> Val {
    if x.ty.numel() == 0 {
        return b.constant(Lit::B(true), DType::Bool);
    }
    let dims: Vec<usize> = (0..x.ty.rank()).collect();
    b.reduce(x, Lit::B(true), &dims, "and")
}

/// Full coordinates `[*idx.shape, rank]` for gather/scatter along `dim`: the
/// index along `dim`, the position itself along the other dims.
fn coordinates(b: &mut Builder, idx: &Val, dim: usize) -> Val {
    let shape = idx.shape().to_vec();
    let r = shape.len();
    let mut with1 = shape.clone();
    with1.push(1);
    let parts: Vec<Val> = (0..r)
        .map(|d| {
            let v = if d == dim { idx.clone() } else { b.iota(&shape, d, DType::I64) };
            b.reshape(&v, &with1)
        })
        .collect();
    let refs: Vec<&Val> = parts.iter().collect();
    b.concat(&refs, r)
}

/// Gather from a 0-d source or with no indices: the source value broadcast (or an empty result).
fn gather0(b: &mut Builder, src: &Val, idx: &Val) -> Val {
    if idx.ty.numel() == 0 {
        return b.splat(Lit::I(0), src.dtype(), idx.shape());
    }
    let n = src.ty.numel();
    let flat = b.reshape(src, &[n]);
    let s = b.slice(&flat, &[0], &[1], &[1]);
    let s = b.reshape(&s, &[]);
    b.broadcast(&s, idx.shape(), &[])
}

#[allow(clippy::too_many_arguments)]
fn scatter(
    b: &mut Builder,
    base: &Val,
    idx: &Val,
    upd: &Val,
    window: &[usize],
    inserted: &[usize],
    to_operand: &[usize],
    index_vector_dim: usize,
    add: bool,
) -> Val {
    let dt = base.dtype();
    let st = Ty::new(&[], dt);
    let region = b.region(&[st.clone(), st], |b, a| {
        if add {
            if dt == DType::Bool {
                vec![b.or(&a[0], &a[1])]
            } else {
                vec![b.add(&a[0], &a[1])]
            }
        } else {
            vec![a[1].clone()]
        }
    });
    let win = if window.is_empty() { String::new() } else { format!("update_window_dims = {}, ", list(window)) };
    let attrs = format!(
        "scatter_dimension_numbers = #stablehlo.scatter<{win}inserted_window_dims = {}, scatter_dims_to_operand_dims = {}, index_vector_dim = {index_vector_dim}>, indices_are_sorted = false, unique_indices = false",
        list(inserted),
        list(to_operand)
    );
    b.op_region("stablehlo.scatter", &[base, idx, upd], &region, &attrs, base.ty.clone())
}

// ---- fused model ops ----------------------------------------------------------------

/// `x * cos + rotate_half(x) * sin`, each product and the sum rounded in the element type.
fn rotary(b: &mut Builder, x: &Val, cos: &Val, sin: &Val) -> Val {
    let r = x.ty.rank();
    let d = x.shape()[r - 1];
    let h = d / 2;
    let x1 = b.slice_dim(x, r - 1, 0, h);
    let x2 = b.slice_dim(x, r - 1, h, d);
    let nx2 = {
        let f = up(b, &x2);
        let n = b.unary("negate", &f);
        b.convert_raw(&n, x.dtype())
    };
    let rot = b.concat(&[&nx2, &x1], r - 1);
    let dims = [r - 2, r - 1];
    let cb = b.broadcast(cos, x.shape(), &dims);
    let sb = b.broadcast(sin, x.shape(), &dims);
    let rounded_mul = |b: &mut Builder, p: &Val, q: &Val| {
        let (pf, qf) = (up(b, p), up(b, q));
        let m = b.mul(&pf, &qf);
        b.convert_raw(&m, p.dtype())
    };
    let a = rounded_mul(b, x, &cb);
    let c = rounded_mul(b, &rot, &sb);
    // Materialise both products so the compiler cannot contract `a + c` into
    // fused multiply-adds: the result must round like the unfused ops.
    let barrier = b.op_n("stablehlo.optimization_barrier", &[&a, &c], "", "", &[a.ty.clone(), c.ty.clone()]);
    let (af, cf) = (up(b, &barrier[0]), up(b, &barrier[1]));
    let s = b.add(&af, &cf);
    b.convert_raw(&s, x.dtype())
}

/// Query heads grouped by their key/value head: `[B, H, T, D] -> [B, Hk, G, T, D]`.
fn group(b: &mut Builder, q: &Val, hk: usize) -> Val {
    let s = q.shape();
    b.reshape(q, &[s[0], hk, s[1] / hk, s[2], s[3]])
}

/// Scaled, masked scores `[B, Hk, G, T, S]` (in the compute type).
fn scores(b: &mut Builder, qg: &Val, k: &Val, scale: f64, causal: bool) -> Val {
    let s = b.dot_general(qg, k, &[0, 1], &[0, 1], &[4], &[3]);
    let sc = b.splat_like(Lit::F(scale), &s);
    let s = b.mul(&s, &sc);
    if !causal {
        return s;
    }
    let sh = s.shape().to_vec();
    let (t, kv) = (sh[3], sh[4]);
    let i = b.iota(&sh, 3, DType::I64);
    let j = b.iota(&sh, 4, DType::I64);
    let off = b.splat(Lit::I(kv as i64 - t as i64), DType::I64, &sh);
    let lim = b.add(&i, &off);
    let keep = b.compare("LE", &j, &lim);
    let ninf = b.splat_like(Lit::F(f64::NEG_INFINITY), &s);
    b.select(&keep, &s, &ninf)
}

fn attention(b: &mut Builder, q: &Val, k: &Val, v: &Val, scale: f64, causal: bool, outs: &[Meta]) -> (Val, Val) {
    let ct = outs[1].dtype;
    let (q, k, v) = (b.convert_raw(q, ct), b.convert_raw(k, ct), b.convert_raw(v, ct));
    let hk = k.shape()[1];
    let qg = group(b, &q, hk);
    let s = scores(b, &qg, &k, scale, causal);
    let lse = logsumexp(b, &s, 4);
    let lb = b.broadcast(&lse, s.shape(), &[0, 1, 2, 3]);
    let d = b.sub(&s, &lb);
    let p = b.unary("exponential", &d);
    // [B, Hk, G, T, S] x [B, Hk, S, Dv] -> [B, Hk, G, T, Dv]
    let o = b.dot_general(&p, &v, &[0, 1], &[0, 1], &[4], &[2]);
    let o = b.reshape(&o, &outs[0].shape);
    let lse = b.reshape(&lse, &outs[1].shape);
    (b.convert_raw(&o, outs[0].dtype), lse)
}

fn attention_backward(b: &mut Builder, x: &[Val], scale: f64, causal: bool, outs: &[Meta]) -> Vec<Val> {
    let ct = compute(x[0].dtype());
    let c: Vec<Val> = x.iter().map(|v| b.convert_raw(v, ct)).collect();
    let (q, k, v, o, lse, g) = (&c[0], &c[1], &c[2], &c[3], &c[4], &c[5]);
    let hk = k.shape()[1];
    let qg = group(b, q, hk);
    let gg = group(b, g, hk);
    let og = group(b, o, hk);
    let s = scores(b, &qg, k, scale, causal);
    let ls = lse.shape().to_vec();
    let lg = b.reshape(lse, &[ls[0], hk, ls[1] / hk, ls[2]]);
    let lb = b.broadcast(&lg, s.shape(), &[0, 1, 2, 3]);
    let d = b.sub(&s, &lb);
    let p = b.unary("exponential", &d);
    // dv [B, Hk, S, Dv] = sum over G, T of p * g
    let dv = b.dot_general(&p, &gg, &[0, 1], &[0, 1], &[2, 3], &[2, 3]);
    // dp [B, Hk, G, T, S] = g v^T
    let dp = b.dot_general(&gg, v, &[0, 1], &[0, 1], &[4], &[3]);
    // delta [B, Hk, G, T] = rowsum(g * out)
    let go = b.mul(&gg, &og);
    let delta = b.reduce(&go, Lit::F(0.0), &[4], "add");
    let db = b.broadcast(&delta, s.shape(), &[0, 1, 2, 3]);
    let t = b.sub(&dp, &db);
    let ds = b.mul(&p, &t);
    let sc = b.splat_like(Lit::F(scale), &ds);
    let ds = b.mul(&ds, &sc);
    // dq [B, Hk, G, T, D] = ds k
    let dq = b.dot_general(&ds, k, &[0, 1], &[0, 1], &[4], &[2]);
    // dk [B, Hk, S, D] = sum over G, T of ds * q
    let dk = b.dot_general(&ds, &qg, &[0, 1], &[0, 1], &[2, 3], &[2, 3]);
    let dq = b.reshape(&dq, &outs[0].shape);
    vec![b.convert_raw(&dq, outs[0].dtype), b.convert_raw(&dk, outs[1].dtype), b.convert_raw(&dv, outs[2].dtype)]
}

/// `(softmax(x) - (1 - eps) onehot(t) - eps / C) * w` along dim 1.
fn cross_entropy_backward(b: &mut Builder, x: &[Val], eps: f64, outs: &[Meta]) -> Val {
    let (xv, t, w) = (&x[0], &x[1], &x[2]);
    let ct = compute(xv.dtype());
    let xf = b.convert_raw(xv, ct);
    let r = xf.ty.rank();
    let cdim = xf.shape()[1];
    let m = max_keep(b, &xf, 1);
    let z = b.sub(&xf, &m);
    let e = b.unary("exponential", &z);
    let s = sum_keep(b, &e, 1);
    let p = b.div(&e, &s);
    let other: Vec<usize> = (0..r).filter(|&d| d != 1).collect();
    let tb = b.broadcast(t, xf.shape(), &other);
    let cls = b.iota(xf.shape(), 1, DType::I64);
    let hot = b.compare("EQ", &cls, &tb);
    let hot = b.convert_raw(&hot, ct);
    let a = b.splat_like(Lit::F(1.0 - eps), &p);
    let ha = b.mul(&hot, &a);
    let d = b.sub(&p, &ha);
    let d = if eps != 0.0 {
        let u = b.splat_like(Lit::F(eps / cdim as f64), &p);
        b.sub(&d, &u)
    } else {
        d
    };
    let wf = b.convert_raw(w, ct);
    let wb = b.broadcast(&wf, xf.shape(), &other);
    let y = b.mul(&d, &wb);
    b.convert_raw(&y, outs[0].dtype)
}
