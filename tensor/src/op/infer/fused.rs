//! Typing of the fused model primitives: RMSNorm, cross-entropy's gradient, rotary embeddings, attention.
use super::{meta, Typing};
use crate::error::fmt_shape;
use crate::op::Op;
use crate::{DType, Error, Meta, Result};
use smallvec::{smallvec, SmallVec};

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

/// `Op::RmsNorm { .. } | Op::RmsNormBackward { .. }`.
pub(super) fn rms_norm(c: &Typing<'_>) -> Result<SmallVec<[Meta; 2]>> {
    let (x, w) = (&c.inputs[0], &c.inputs[1]);
    if !x.dtype.is_float() {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    c.same_dtype(x, w)?;
    let n = x.shape.len();
    if n == 0 || w.shape.as_slice() != [x.shape[n - 1]] {
        return Err(Error::shape(
            c.name,
            format!("expected x [..., D] and weight [D], got {} and {}", fmt_shape(&x.shape), fmt_shape(&w.shape)),
        ));
    }
    let rdt = if x.dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let rows = meta(&x.shape[..n - 1], rdt);
    if matches!(c.op, Op::RmsNorm { .. }) {
        Ok(smallvec![x.clone(), rows])
    } else {
        let (r, g) = (&c.inputs[2], &c.inputs[3]);
        if *r != rows || g != x {
            return Err(Error::shape(
                c.name,
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
        Ok(smallvec![x.clone(), w.clone()])
    }
}

/// `Op::CrossEntropyBackward { .. }`.
pub(super) fn cross_entropy_backward(c: &Typing<'_>) -> Result<SmallVec<[Meta; 2]>> {
    let (x, t, w) = (&c.inputs[0], &c.inputs[1], &c.inputs[2]);
    if !x.dtype.is_float() {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    c.index_dtype(t)?;
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
            c.name,
            format!(
                "expected logits [N, C, ...], targets and weights [N, ...] ({wdt} weights), got {}, {} and {} ({})",
                fmt_shape(&x.shape),
                fmt_shape(&t.shape),
                fmt_shape(&w.shape),
                w.dtype
            ),
        ));
    }
    Ok(smallvec![x.clone()])
}

/// `Op::Rotary`.
pub(super) fn rotary(c: &Typing<'_>) -> Result<SmallVec<[Meta; 2]>> {
    let (x, cos, sin) = (&c.inputs[0], &c.inputs[1], &c.inputs[2]);
    if !x.dtype.is_float() {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    c.same_dtype(x, cos)?;
    c.same_dtype(x, sin)?;
    let n = x.shape.len();
    let ok = n >= 2 && x.shape[n - 1] % 2 == 0 && cos.shape.as_slice() == &x.shape[n - 2..] && sin.shape == cos.shape;
    if !ok {
        return Err(Error::shape(
            c.name,
            format!(
                "expected x [..., T, d] with d even and cos, sin [T, d], got {}, {} and {}",
                fmt_shape(&x.shape),
                fmt_shape(&cos.shape),
                fmt_shape(&sin.shape)
            ),
        ));
    }
    Ok(smallvec![x.clone()])
}

/// `Op::Attention { causal, .. }`.
pub(super) fn attention(c: &Typing<'_>, causal: &bool) -> Result<SmallVec<[Meta; 2]>> {
    let (q, k, v) = attention_shapes(c.name, &c.inputs[0], &c.inputs[1], &c.inputs[2], *causal)?;
    let [b, h, t, _, _, _, dv] = attention_dims(q, k, v);
    let lse = if q.dtype == DType::F64 { DType::F64 } else { DType::F32 };
    Ok(smallvec![meta(&[b, h, t, dv], q.dtype), meta(&[b, h, t], lse)])
}

/// `Op::AttentionBackward { causal, .. }`.
pub(super) fn attention_backward(c: &Typing<'_>, causal: &bool) -> Result<SmallVec<[Meta; 2]>> {
    let (q, k, v) = attention_shapes(c.name, &c.inputs[0], &c.inputs[1], &c.inputs[2], *causal)?;
    let [b, h, t, _, _, _, dv] = attention_dims(q, k, v);
    let lse_dt = if q.dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let (out, lse, g) = (&c.inputs[3], &c.inputs[4], &c.inputs[5]);
    if out.shape.as_slice() != [b, h, t, dv]
        || g.shape != out.shape
        || lse.shape.as_slice() != [b, h, t]
        || out.dtype != q.dtype
        || g.dtype != q.dtype
        || lse.dtype != lse_dt
    {
        return Err(Error::shape(
            c.name,
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
    Ok(smallvec![q.clone(), k.clone(), v.clone()])
}
