//! Scaled dot-product attention: the fused primitive `Op::Attention` behind a
//! PyTorch-like method, with its own autograd node.
use crate::graph::Edge;
use crate::{is_grad_enabled, DType, Error, GradModeGuard, Op, Result, Tensor};
use std::sync::Arc;

const OP: &str = "scaled_dot_product_attention";

impl Tensor {
    /// PyTorch's `F.scaled_dot_product_attention(q, k, v, is_causal=causal,
    /// scale=scale, enable_gqa=True)` with `self` the query: `softmax(scale * q
    /// k^T + mask) v`, computed by one fused kernel that never materialises the
    /// `[.., T, S]` scores (flash-attention style; see [`Op::Attention`]).
    ///
    /// Shapes: query `[B, H, T, D]`, key `[B, Hk, S, D]`, value `[B, Hk, S, Dv]`
    /// with `H` a multiple of `Hk` (grouped-query attention: query head `h` uses
    /// key/value head `h / (H / Hk)`); 3-D inputs `[H, T, D]` are accepted too.
    /// The result is `[B, H, T, Dv]`. `scale` defaults to `1 / sqrt(D)`.
    ///
    /// With `causal`, query `i` attends to keys `j <= i + S - T`: the causal mask
    /// aligned to the bottom right, so that `T` new queries after `S - T` cached
    /// positions see exactly their past (this needs `S >= T`). PyTorch's
    /// `is_causal` aligns the mask to the top left instead; the two agree when
    /// `T == S`, the training case.
    ///
    /// Gradients flow to all three inputs through a fused backward kernel that
    /// recomputes the probabilities from the saved row log-sum-exps; with
    /// `create_graph` the gradients are built from differentiable ops instead,
    /// so double backward works.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let q = Tensor::randn(&[1, 2, 3, 4], DType::F32)?;
    /// let k = Tensor::randn(&[1, 2, 3, 4], DType::F32)?;
    /// let v = Tensor::randn(&[1, 2, 3, 4], DType::F32)?;
    /// let out = q.scaled_dot_product_attention(&k, &v, true, None)?;
    /// // The first query sees only the first key: its output is the first value.
    /// let first = out.narrow(2, 0, 1)?.sub(&v.narrow(2, 0, 1)?)?.abs()?.amax(vec![0, 1, 2, 3], false)?;
    /// assert!(first.item::<f32>()? < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn scaled_dot_product_attention(
        &self,
        key: &Tensor,
        value: &Tensor,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        if crate::autocast::autocast_dtype().is_some() {
            let (q, k, v) =
                (crate::autocast::lower(self)?, crate::autocast::lower(key)?, crate::autocast::lower(value)?);
            if q.dtype() != self.dtype() || k.dtype() != key.dtype() || v.dtype() != value.dtype() {
                return q.scaled_dot_product_attention(&k, &v, causal, scale);
            }
        }
        let n = self.ndim();
        if n == 3 && key.ndim() == 3 && value.ndim() == 3 {
            let out = self.unsqueeze(0)?.scaled_dot_product_attention(
                &key.unsqueeze(0)?,
                &value.unsqueeze(0)?,
                causal,
                scale,
            )?;
            return out.squeeze_dim(0);
        }
        let d = if n == 4 { self.shape()[3] } else { 0 };
        let scale = scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
        if !scale.is_finite() {
            return Err(Error::invalid(OP, format!("scale must be finite, got {scale}")));
        }
        let outs = {
            let _off = GradModeGuard::set(false);
            Tensor::apply(Op::Attention { scale, causal }, &[self, key, value])?
        };
        let (out, lse) = (outs[0].clone(), outs[1].clone());
        let saved_out = Edge::of(&out);
        let backward: crate::CustomBackward = Arc::new(move |grads, edges| {
            let Some(g) = &grads[0] else { return Ok(vec![None, None, None]) };
            let [q, k, v] = [0, 1, 2].map(|i| edges[i].saved(OP, i));
            let o = saved_out.saved(OP, 3)?;
            let grads = attention_grads([q?, k?, v?, o, &lse], g, None, scale, causal)?;
            Ok(grads.into_iter().zip(edges).map(|(g, e)| e.requires_grad.then_some(g)).collect())
        });
        Tensor::record_custom(OP, &[self, key, value], &[&out], backward);
        Ok(out)
    }
}

/// The gradients `[dq, dk, dv]` of `Op::Attention` given its inputs and outputs
/// `[q, k, v, out, lse]`, the gradient `g` of `out` and optionally `g_lse` of
/// `lse`. Uses the fused `Op::AttentionBackward` unless grad mode is on (a
/// backward with `create_graph`) or `g_lse` is given: then the gradients are
/// composed of differentiable primitives.
pub fn attention_grads(
    saved: [&Tensor; 5],
    g: &Tensor,
    g_lse: Option<&Tensor>,
    scale: f64,
    causal: bool,
) -> Result<[Tensor; 3]> {
    let [q, k, v, out, lse] = saved;
    if !is_grad_enabled() && g_lse.is_none() {
        let r = Tensor::apply(Op::AttentionBackward { scale, causal }, &[q, k, v, out, lse, g])?;
        return Ok([r[0].clone(), r[1].clone(), r[2].clone()]);
    }
    let (b, h, t) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (hk, s) = (k.shape()[1], k.shape()[2]);
    let group = h / hk;
    // Key/value heads repeated for their query heads, and the sum back over them.
    let expand = |x: &Tensor| -> Result<Tensor> {
        if group == 1 {
            return Ok(x.clone());
        }
        let c = x.shape()[3];
        x.unsqueeze(2)?.broadcast_to(&[b, hk, group, s, c])?.reshape_to(&[b, h, s, c])
    };
    let group_sum = |x: Tensor| -> Result<Tensor> {
        if group == 1 {
            return Ok(x);
        }
        let c = x.shape()[3];
        x.reshape_to(&[b, hk, group, s, c])?.sum_dim(2, false)
    };
    let (ke, ve) = (expand(k)?, expand(v)?);
    let z = q.matmul(&ke.transpose(-1, -2)?)?.mul(scale)?;
    let z = if causal {
        let hide: Vec<bool> = (0..t).flat_map(|i| (0..s).map(move |j| j > i + s - t)).collect();
        let hide = Tensor::from_vec(hide, &[t, s])?.to_device(q.device())?;
        z.masked_fill(&hide, f64::NEG_INFINITY)?
    } else {
        z
    };
    let p = match z.dtype() {
        DType::BF16 | DType::F16 => z.to_dtype(DType::F32)?.softmax(-1)?.to_dtype(z.dtype())?,
        _ => z.softmax(-1)?,
    };
    let dv = group_sum(p.transpose(-1, -2)?.matmul(g)?)?;
    let dp = g.matmul(&ve.transpose(-1, -2)?)?;
    let mut ds = p.mul(&dp.sub(&dp.mul(&p)?.sum_dim(-1, true)?)?)?;
    if let Some(gl) = g_lse {
        ds = ds.add(&p.mul(&gl.to_dtype(p.dtype())?.unsqueeze(-1)?)?)?;
    }
    let dq = ds.matmul(&ke)?.mul(scale)?;
    let dk = group_sum(ds.transpose(-1, -2)?.matmul(q)?.mul(scale)?)?;
    Ok([dq, dk, dv])
}
