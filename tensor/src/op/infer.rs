//! Shape and dtype inference of the primitives (`Op::infer`): the single place
//! where their typing rules live.
use super::*;

/// Checks the `q, k, v` inputs of the attention primitives (see [`Op::Attention`]).
fn attention_shapes<'a>(
    name: &'static str,
    q: &'a Meta,
    k: &'a Meta,
    v: &'a Meta,
    causal: bool,
) -> Result<(&'a Meta, &'a Meta, &'a Meta)> {
    for (what, m) in [("query", q), ("key", k), ("value", v)] {
        if !m.dtype.is_float() {
            return Err(Error::dtype(name, format!("expected a floating point {what}, got {}", m.dtype)));
        }
        if m.dtype != q.dtype {
            return Err(Error::dtype(
                name,
                format!(
                    "expected query, key and value to have the same dtype, but got {}, {} and {}",
                    q.dtype, k.dtype, v.dtype
                ),
            ));
        }
    }
    let (qs, ks, vs) = (&q.shape, &k.shape, &v.shape);
    let ok = qs.len() == 4
        && ks.len() == 4
        && vs.len() == 4
        && ks[0] == qs[0]
        && vs[0] == qs[0]
        && vs[1] == ks[1]
        && ks[1] > 0
        && qs[1] % ks[1] == 0
        && ks[3] == qs[3]
        && vs[2] == ks[2];
    if !ok {
        return Err(Error::shape(
            name,
            format!(
                "expected query [B, H, T, D], key [B, Hk, S, D] and value [B, Hk, S, Dv] with H a multiple of Hk, got {}, {} and {}",
                fmt_shape(qs),
                fmt_shape(ks),
                fmt_shape(vs)
            ),
        ));
    }
    if causal && ks[2] < qs[2] {
        return Err(Error::shape(
            name,
            format!(
                "a causal mask needs at least as many keys as queries (query i sees keys j <= i + S - T), got T = {} and S = {}",
                qs[2], ks[2]
            ),
        ));
    }
    Ok((q, k, v))
}

/// `[B, H, T, D, Hk, S, Dv]` of checked attention inputs.
fn attention_dims(q: &Meta, k: &Meta, v: &Meta) -> [usize; 7] {
    [q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1], k.shape[2], v.shape[3]]
}

fn meta(shape: &[usize], dtype: DType) -> Meta {
    Meta { shape: shape.into(), dtype }
}

fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Shape {
    let mut out = Shape::new();
    for (i, &d) in shape.iter().enumerate() {
        if dims.contains(&i) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(d);
        }
    }
    out
}

impl Op {
    /// Shapes and dtypes of the outputs for inputs of the given shapes and dtypes.
    /// This is the single place where primitives' typing rules live. Every
    /// output's size is checked to fit the address space (`alloc::bytes`).
    pub fn infer(&self, inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
        let outs = self.infer_types(inputs)?;
        for m in &outs {
            crate::alloc::bytes(self.name(), &m.shape, m.dtype)?;
        }
        Ok(outs)
    }

    fn infer_types(&self, inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
        let name = self.name();
        if let Some(n) = self.arity() {
            if inputs.len() != n {
                return Err(Error::invalid(name, format!("expects {n} inputs, got {}", inputs.len())));
            }
        }
        let same_shape = |a: &Meta, b: &Meta| -> Result<()> {
            if a.shape != b.shape {
                return Err(Error::shape(
                    name,
                    format!("primitive needs equal shapes, got {} and {}", fmt_shape(&a.shape), fmt_shape(&b.shape)),
                ));
            }
            Ok(())
        };
        let same_dtype = |a: &Meta, b: &Meta| -> Result<()> {
            if a.dtype != b.dtype {
                return Err(Error::dtype(
                    name,
                    format!("expected both inputs to have the same dtype, but got {} and {}", a.dtype, b.dtype),
                ));
            }
            Ok(())
        };
        let check_dim = |dim: usize, ndim: usize| -> Result<()> {
            if dim >= ndim.max(1) {
                return Err(Error::dim_out_of_range(name, dim as isize, ndim));
            }
            Ok(())
        };
        let index_dtype = |m: &Meta| -> Result<()> {
            if m.dtype != DType::I64 {
                return Err(Error::dtype(name, format!("expected index to be of dtype int64, got {}", m.dtype)));
            }
            Ok(())
        };
        if let Some(m) = inputs.iter().find(|m| m.dtype.is_float8()) {
            if !self.moves_float8() {
                return Err(Error::dtype(
                    name,
                    format!(
                        "not implemented for dtype {}: float8 tensors support casts and data movement only, \
                         as in PyTorch; convert with to_dtype first",
                        m.dtype
                    ),
                ));
            }
        }
        Ok(match self {
            Op::Full { shape, dtype, .. } => smallvec![meta(shape, *dtype)],
            Op::Arange { dtype, .. } if dtype.is_float8() => return Err(Error::unsupported_dtype(name, *dtype)),
            Op::Arange { len, dtype, .. } => smallvec![meta(&[*len], *dtype)],
            Op::RandomBits { shape } => {
                let st = &inputs[0];
                if st.dtype != DType::I64 || st.shape.as_slice() != [2] {
                    return Err(Error::invalid(
                        name,
                        format!(
                            "expected a generator state of shape [2] and dtype int64, got {} {}",
                            fmt_shape(&st.shape),
                            st.dtype
                        ),
                    ));
                }
                smallvec![meta(shape, DType::I64), meta(&[2], DType::I64)]
            }
            Op::Unary(u) => {
                let x = &inputs[0];
                if u.is_float_only() && !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                let dt = match u {
                    UnaryOp::Not | UnaryOp::IsNan | UnaryOp::IsInf => DType::Bool,
                    UnaryOp::Neg if x.dtype == DType::Bool => {
                        return Err(Error::dtype(
                            name,
                            "negation, the `-` operator, on a bool tensor is not supported; use the `!` operator or logical_not() instead",
                        ))
                    }
                    _ => x.dtype,
                };
                smallvec![meta(&x.shape, dt)]
            }
            Op::Binary(b) => {
                let (x, y) = (&inputs[0], &inputs[1]);
                same_shape(x, y)?;
                same_dtype(x, y)?;
                if *b == BinaryOp::Sub && x.dtype == DType::Bool {
                    return Err(Error::dtype(
                        name,
                        "subtraction, the `-` operator, with two bool tensors is not supported; use the `^` operator or logical_xor() instead",
                    ));
                }
                if matches!(b, BinaryOp::Atan2 | BinaryOp::SiluMul | BinaryOp::SiluGradMul) && !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                let shift = matches!(b, BinaryOp::LeftShift | BinaryOp::RightShift);
                if b.is_bitwise() && (x.dtype.is_float() || (shift && x.dtype == DType::Bool)) {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                let dt = if b.is_logical() { DType::Bool } else { x.dtype };
                smallvec![meta(&x.shape, dt)]
            }
            Op::Compare(_) => {
                same_shape(&inputs[0], &inputs[1])?;
                same_dtype(&inputs[0], &inputs[1])?;
                smallvec![meta(&inputs[0].shape, DType::Bool)]
            }
            Op::Where => {
                let (c, a, b) = (&inputs[0], &inputs[1], &inputs[2]);
                if c.dtype != DType::Bool {
                    return Err(Error::dtype(
                        name,
                        format!(
                            "where expected condition to be a boolean tensor, but got a tensor with dtype {}",
                            c.dtype
                        ),
                    ));
                }
                same_shape(c, a)?;
                same_shape(a, b)?;
                same_dtype(a, b)?;
                smallvec![meta(&a.shape, a.dtype)]
            }
            Op::Cast(dt) => smallvec![meta(&inputs[0].shape, *dt)],
            Op::Copy => smallvec![inputs[0].clone()],
            Op::Reduce { op, dims, keepdim } => {
                let x = &inputs[0];
                for &d in dims {
                    check_dim(d, x.shape.len())?;
                }
                let dt = match op {
                    ReduceOp::Sum | ReduceOp::Prod if !x.dtype.is_float() => DType::I64,
                    ReduceOp::Mean if !x.dtype.is_float() => {
                        return Err(Error::dtype(
                            name,
                            format!("could not infer output dtype. Input dtype must be either a floating point or complex dtype. Got: {}", x.dtype),
                        ))
                    }
                    ReduceOp::Any | ReduceOp::All => DType::Bool,
                    _ => x.dtype,
                };
                if matches!(op, ReduceOp::Max | ReduceOp::Min) {
                    for &d in dims {
                        if x.shape.get(d) == Some(&0) {
                            return Err(Error::shape(
                                name,
                                format!(
                                    "expected reduction dim {d} to have non-zero size; input shape {}",
                                    fmt_shape(&x.shape)
                                ),
                            ));
                        }
                    }
                }
                smallvec![Meta { shape: reduced_shape(&x.shape, dims, *keepdim), dtype: dt }]
            }
            Op::ArgReduce { dim, keepdim, .. } => {
                let x = &inputs[0];
                let shape = match dim {
                    Some(d) => {
                        check_dim(*d, x.shape.len())?;
                        if x.shape.get(*d) == Some(&0) {
                            return Err(Error::shape(
                                name,
                                format!("expected reduction dim {d} to have non-zero size"),
                            ));
                        }
                        if x.shape.is_empty() {
                            Shape::new()
                        } else {
                            reduced_shape(&x.shape, &[*d], *keepdim)
                        }
                    }
                    None => {
                        if x.shape.iter().product::<usize>() == 0 {
                            return Err(Error::shape(
                                name,
                                "expected a non-empty tensor: cannot take the arg of an empty sequence",
                            ));
                        }
                        if *keepdim {
                            smallvec![1; x.shape.len()]
                        } else {
                            Shape::new()
                        }
                    }
                };
                smallvec![Meta { shape, dtype: DType::I64 }]
            }
            Op::Softmax { dim, .. } => {
                let x = &inputs[0];
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                check_dim(*dim, x.shape.len().max(1))?;
                smallvec![meta(&x.shape, x.dtype)]
            }
            Op::RmsNorm { .. } | Op::RmsNormBackward { .. } => {
                let (x, w) = (&inputs[0], &inputs[1]);
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                same_dtype(x, w)?;
                let n = x.shape.len();
                if n == 0 || w.shape.as_slice() != [x.shape[n - 1]] {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected x [..., D] and weight [D], got {} and {}",
                            fmt_shape(&x.shape),
                            fmt_shape(&w.shape)
                        ),
                    ));
                }
                let rdt = if x.dtype == DType::F64 { DType::F64 } else { DType::F32 };
                let rows = meta(&x.shape[..n - 1], rdt);
                if matches!(self, Op::RmsNorm { .. }) {
                    smallvec![x.clone(), rows]
                } else {
                    let (r, g) = (&inputs[2], &inputs[3]);
                    if *r != rows || g != x {
                        return Err(Error::shape(
                            name,
                            format!(
                                "expected rstd {} ({rdt}) and a gradient like x {} ({}), got {} ({}) and {} ({})",
                                fmt_shape(&rows.shape),
                                fmt_shape(&x.shape),
                                x.dtype,
                                fmt_shape(&r.shape),
                                r.dtype,
                                fmt_shape(&g.shape),
                                g.dtype
                            ),
                        ));
                    }
                    smallvec![x.clone(), w.clone()]
                }
            }
            Op::CrossEntropyBackward { .. } => {
                let (x, t, w) = (&inputs[0], &inputs[1], &inputs[2]);
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                index_dtype(t)?;
                let wdt = match x.dtype {
                    DType::BF16 | DType::F16 => DType::F32,
                    d => d,
                };
                let mut want = x.shape.clone();
                let ok = want.len() >= 2 && {
                    want.remove(1);
                    t.shape == want && w.shape == want
                };
                if !ok || w.dtype != wdt {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected logits [N, C, ...], targets and weights [N, ...] ({wdt} weights), got {}, {} and {} ({})",
                            fmt_shape(&x.shape),
                            fmt_shape(&t.shape),
                            fmt_shape(&w.shape),
                            w.dtype
                        ),
                    ));
                }
                smallvec![x.clone()]
            }
            Op::Rotary => {
                let (x, cos, sin) = (&inputs[0], &inputs[1], &inputs[2]);
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                same_dtype(x, cos)?;
                same_dtype(x, sin)?;
                let n = x.shape.len();
                let ok = n >= 2
                    && x.shape[n - 1] % 2 == 0
                    && cos.shape.as_slice() == &x.shape[n - 2..]
                    && sin.shape == cos.shape;
                if !ok {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected x [..., T, d] with d even and cos, sin [T, d], got {}, {} and {}",
                            fmt_shape(&x.shape),
                            fmt_shape(&cos.shape),
                            fmt_shape(&sin.shape)
                        ),
                    ));
                }
                smallvec![x.clone()]
            }
            Op::Attention { causal, .. } => {
                let (q, k, v) = attention_shapes(name, &inputs[0], &inputs[1], &inputs[2], *causal)?;
                let [b, h, t, _, _, _, dv] = attention_dims(q, k, v);
                let lse = if q.dtype == DType::F64 { DType::F64 } else { DType::F32 };
                smallvec![meta(&[b, h, t, dv], q.dtype), meta(&[b, h, t], lse)]
            }
            Op::AttentionBackward { causal, .. } => {
                let (q, k, v) = attention_shapes(name, &inputs[0], &inputs[1], &inputs[2], *causal)?;
                let [b, h, t, _, _, _, dv] = attention_dims(q, k, v);
                let lse_dt = if q.dtype == DType::F64 { DType::F64 } else { DType::F32 };
                let (out, lse, g) = (&inputs[3], &inputs[4], &inputs[5]);
                if out.shape.as_slice() != [b, h, t, dv]
                    || g.shape != out.shape
                    || lse.shape.as_slice() != [b, h, t]
                    || out.dtype != q.dtype
                    || g.dtype != q.dtype
                    || lse.dtype != lse_dt
                {
                    return Err(Error::shape(
                        name,
                        format!(
                            "expected out and grad [{b}, {h}, {t}, {dv}] ({}) and lse [{b}, {h}, {t}] ({lse_dt}), got {} ({}), {} ({}) and {} ({})",
                            q.dtype,
                            fmt_shape(&out.shape),
                            out.dtype,
                            fmt_shape(&g.shape),
                            g.dtype,
                            fmt_shape(&lse.shape),
                            lse.dtype
                        ),
                    ));
                }
                smallvec![q.clone(), k.clone(), v.clone()]
            }
            Op::LogSumExp { dim } => {
                let x = &inputs[0];
                if !x.dtype.is_float() {
                    return Err(Error::unsupported_dtype(name, x.dtype));
                }
                check_dim(*dim, x.shape.len())?;
                smallvec![Meta { shape: reduced_shape(&x.shape, &[*dim], false), dtype: x.dtype }]
            }
            Op::Cumsum { dim } => {
                let x = &inputs[0];
                check_dim(*dim, x.shape.len())?;
                let dt = if x.dtype.is_float() { x.dtype } else { DType::I64 };
                smallvec![meta(&x.shape, dt)]
            }
            Op::PagedAttention { .. } => super::paged::paged_attention_meta(inputs)?,
            Op::Custom(c) => c.infer(inputs)?.into_iter().collect(),
            Op::GroupedMatMul => super::grouped::grouped_mm_meta(inputs)?,
            Op::Dequantize(spec) => {
                let [out, inp] =
                    spec.check(name, (inputs[0].dtype, &inputs[0].shape), (inputs[1].dtype, &inputs[1].shape))?;
                smallvec![meta(&[out, inp], DType::F32)]
            }
            Op::QuantMatMul(spec) => {
                let x = &inputs[0];
                let [out, inp] =
                    spec.check(name, (inputs[1].dtype, &inputs[1].shape), (inputs[2].dtype, &inputs[2].shape))?;
                if !matches!(x.dtype, DType::F32 | DType::BF16 | DType::F16) {
                    return Err(Error::dtype(
                        name,
                        format!("expected a float32, bfloat16 or float16 input, got {}", x.dtype),
                    ));
                }
                if x.shape.last() != Some(&inp) {
                    return Err(Error::shape(
                        name,
                        format!(
                            "mat1 and mat2 shapes cannot be multiplied ({} and [{inp}, {out}])",
                            fmt_shape(&x.shape)
                        ),
                    ));
                }
                let mut s: Shape = x.shape.clone();
                *s.last_mut().expect("checked above") = out;
                smallvec![Meta { shape: s, dtype: x.dtype }]
            }
            Op::MatMul => {
                let (a, b) = (&inputs[0], &inputs[1]);
                same_dtype(a, b)?;
                let (ra, rb) = (a.shape.len(), b.shape.len());
                if ra < 2 || ra != rb || a.shape[..ra - 2] != b.shape[..rb - 2] || a.shape[ra - 1] != b.shape[rb - 2] {
                    return Err(Error::shape(
                        name,
                        format!(
                            "mat1 and mat2 shapes cannot be multiplied ({} and {})",
                            fmt_shape(&a.shape),
                            fmt_shape(&b.shape)
                        ),
                    ));
                }
                let mut s: Shape = a.shape[..ra - 1].into();
                s.push(b.shape[rb - 1]);
                smallvec![Meta { shape: s, dtype: a.dtype }]
            }
            Op::View(v) => {
                let l = v.apply(&Layout::contiguous(&inputs[0].shape))?;
                smallvec![meta(l.shape(), inputs[0].dtype)]
            }
            Op::Cat { dim } => {
                let first =
                    inputs.first().ok_or_else(|| Error::invalid(name, "expected a non-empty list of tensors"))?;
                check_dim(*dim, first.shape.len())?;
                let mut shape = first.shape.clone();
                shape[*dim] = 0;
                for m in inputs {
                    same_dtype(first, m)?;
                    let ok = m.shape.len() == first.shape.len()
                        && m.shape.iter().zip(&first.shape).enumerate().all(|(i, (a, b))| i == *dim || a == b);
                    if !ok {
                        return Err(Error::shape(
                            name,
                            format!(
                                "sizes of tensors must match except in dimension {dim}; got {} and {}",
                                fmt_shape(&first.shape),
                                fmt_shape(&m.shape)
                            ),
                        ));
                    }
                    shape[*dim] += m.shape[*dim];
                }
                smallvec![Meta { shape, dtype: first.dtype }]
            }
            Op::Gather { dim } => {
                let (x, idx) = (&inputs[0], &inputs[1]);
                index_dtype(idx)?;
                check_dim(*dim, x.shape.len())?;
                if idx.shape.len() != x.shape.len() {
                    return Err(Error::shape(
                        name,
                        "index tensor must have the same number of dimensions as input tensor",
                    ));
                }
                for i in 0..x.shape.len() {
                    if i != *dim && idx.shape[i] > x.shape[i] {
                        return Err(Error::shape(
                            name,
                            format!(
                                "size of index {} does not fit input {} at dimension {i}",
                                fmt_shape(&idx.shape),
                                fmt_shape(&x.shape)
                            ),
                        ));
                    }
                }
                smallvec![meta(&idx.shape, x.dtype)]
            }
            Op::Scatter { dim, .. } => {
                let (base, idx, src) = (&inputs[0], &inputs[1], &inputs[2]);
                index_dtype(idx)?;
                same_dtype(base, src)?;
                check_dim(*dim, base.shape.len())?;
                if idx.shape.len() != base.shape.len() || src.shape.len() != base.shape.len() {
                    return Err(Error::shape(
                        name,
                        "index tensor must have the same number of dimensions as self tensor",
                    ));
                }
                for i in 0..base.shape.len() {
                    if idx.shape[i] > src.shape[i] || (i != *dim && idx.shape[i] > base.shape[i]) {
                        return Err(Error::shape(
                            name,
                            format!(
                                "expected index {} to be smaller than self {} apart from dimension {dim} and to be smaller than src {}",
                                fmt_shape(&idx.shape),
                                fmt_shape(&base.shape),
                                fmt_shape(&src.shape)
                            ),
                        ));
                    }
                }
                smallvec![base.clone()]
            }
            Op::IndexSelect { dim } => {
                let (x, idx) = (&inputs[0], &inputs[1]);
                index_dtype(idx)?;
                check_dim(*dim, x.shape.len())?;
                if idx.shape.len() > 1 {
                    return Err(Error::shape(name, "index_select(): index should be a vector (0-d or 1-d)"));
                }
                let mut s = x.shape.clone();
                if !s.is_empty() {
                    s[*dim] = idx.shape.iter().product();
                }
                smallvec![meta(&s, x.dtype)]
            }
            Op::IndexAdd { dim } => {
                let (base, idx, src) = (&inputs[0], &inputs[1], &inputs[2]);
                index_dtype(idx)?;
                same_dtype(base, src)?;
                check_dim(*dim, base.shape.len())?;
                let n: usize = idx.shape.iter().product();
                let mut want = base.shape.clone();
                if !want.is_empty() {
                    want[*dim] = n;
                }
                if idx.shape.len() > 1 || src.shape != want {
                    return Err(Error::shape(
                        name,
                        format!(
                            "source {} must have shape {} (self with dim {dim} of the index's length)",
                            fmt_shape(&src.shape),
                            fmt_shape(&want)
                        ),
                    ));
                }
                smallvec![base.clone()]
            }
            Op::Sort { dim, .. } => {
                let x = &inputs[0];
                check_dim(*dim, x.shape.len())?;
                smallvec![x.clone(), meta(&x.shape, DType::I64)]
            }
            Op::TopK { k, dim, .. } => {
                let x = &inputs[0];
                check_dim(*dim, x.shape.len())?;
                let n = x.shape.get(*dim).copied().unwrap_or(1);
                if *k > n {
                    return Err(Error::index(
                        name,
                        format!("selected index k = {k} out of range for a dimension of size {n}"),
                    ));
                }
                let mut s = x.shape.clone();
                if !s.is_empty() {
                    s[*dim] = *k;
                }
                smallvec![meta(&s, x.dtype), meta(&s, DType::I64)]
            }
            Op::Assign { shape, strides, offset } => {
                let (base, src) = (&inputs[0], &inputs[1]);
                same_dtype(base, src)?;
                if src.shape != *shape {
                    return Err(Error::shape(
                        name,
                        format!(
                            "source shape {} does not match the destination {}",
                            fmt_shape(&src.shape),
                            fmt_shape(shape)
                        ),
                    ));
                }
                let l = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
                l.check_bounds(name, base.shape.iter().product())?;
                smallvec![base.clone()]
            }
            Op::Collective(c) => c.infer(&inputs[0])?,
        })
    }
}
