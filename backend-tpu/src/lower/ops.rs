//! One lowering per primitive: `lower_op` reads like a dictionary from `Op`
//! to StableHLO. Inputs arrive as values of the op's input shapes (views
//! already read); outputs must have the shapes and dtypes `Op::infer` gave.
//!
//! Numerics follow the CPU backend (and PyTorch): bf16/f16 math computes in
//! float32 and rounds once; integer ops wrap; PyTorch's floor division,
//! remainder, sign, NaN-propagating max/min and NaN-largest sort order are
//! spelled out where StableHLO's own ops differ.
use super::elementwise::*;
use super::fused::*;
use super::index::*;
use super::reduce::*;
use super::{Builder, Lit, Ty, Val};
use kiln_tensor::{BinaryOp, CmpOp, DType, Error, Meta, Op, Result, Scalar};

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
pub(super) fn compute(d: DType) -> DType {
    match d {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

pub(super) fn up(b: &mut Builder, x: &Val) -> Val {
    let c = compute(x.dtype());
    b.convert_raw(x, c)
}

pub(super) fn unsupported(op: &'static str, d: DType) -> Error {
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
        Op::Softmax { dim, log } => one(softmax(b, x, dim, log, outs)),
        Op::LogSumExp { dim } => {
            let xf = up(b, &x[0]);
            let l = logsumexp(b, &xf, *dim);
            one(b.convert_raw(&l, outs[0].dtype))
        }
        Op::Cumsum { dim } => one(cumsum(b, x, dim, outs)),
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
        Op::Gather { dim } => Ok(gather(b, x, dim, out(0))),
        Op::Scatter { dim, reduce } => Ok(scatter_op(b, x, dim, reduce)),
        Op::IndexSelect { dim } => Ok(index_select(b, x, dim, outs)),
        Op::IndexAdd { dim } => Ok(index_add(b, x, dim)),
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
        // The value is unchanged; over a mesh its result sharding moves it (`lower/mesh.rs`).
        Op::Redistribute(_) => one(x[0].clone()),
        // A region exists only over a mesh, where the program's lowering builds it (`lower/region.rs`).
        Op::LocalMap(_) => {
            Err(kiln_tensor::Error::backend("pjrt", "a local region is lowered only inside a program over a mesh"))
        }
        Op::Dequantize(spec) => one(super::quant::dequantize(b, spec, &x[0], &x[1])),
        Op::QuantMatMul(spec) => one(super::quant::quant_matmul(b, spec, &x[0], &x[1], &x[2], outs[0].dtype)),
        Op::Rotary => one(rotary(b, &x[0], &x[1], &x[2])),
        Op::GroupedMatMul => {
            let (o, ok) = super::grouped::grouped_mm(b, x, &outs[0])?;
            Ok((vec![o], vec![ok]))
        }
        Op::PagedAttention { scale, .. } => {
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
        Op::RmsNorm { eps } => Ok((rms_norm(b, x, eps, outs), vec![])),
        Op::RmsNormBackward { eps: _ } => Ok((rms_norm_backward(b, x, outs), vec![])),
        Op::View(v) => {
            Err(Error::backend("pjrt", format!("view op {} reached the backend (views are layouts)", v.name())))
        }
    }
}
