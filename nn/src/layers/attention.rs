//! Grouped-query causal self-attention (Llama, Qwen3) with an optional KV cache,
//! and the additive causal/padding mask it takes.
use super::{Dropout, Linear, RmsNorm, RopeTables};
use crate::module::Module;
use kiln_tensor::half::{bf16, f16};
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, Device, Error, Result, Tensor, TensorOptions};

/// The shape of an attention block.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionConfig {
    /// Model width (input and output features).
    pub hidden_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (query head `j` uses kv head `j / (num_heads / num_kv_heads)`).
    pub num_kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Biases on q/k/v/o projections (`attention_bias`).
    pub bias: bool,
    /// Per-head RMSNorm of queries and keys with this eps (Qwen3), applied after
    /// the projection and before RoPE.
    pub qk_norm_eps: Option<f64>,
    /// Dropout on the attention probabilities in training mode.
    pub dropout: f64,
}

/// The keys and values of one attention layer seen so far, for incremental
/// decoding. Buffers `[B, kv_heads, capacity, head_dim]` grow by doubling;
/// attention reads the filled prefix (as a view when the cache holds the
/// keys' dtype, widened from a narrower cache dtype otherwise: Note [KV cache
/// dtypes] in kiln-tensor).
#[derive(Debug, Clone, Default)]
pub struct LayerKvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    /// Float8 caches: the rows' scales, `[B, kv_heads, capacity]`.
    scales: Option<(Tensor, Tensor)>,
    /// The dtype stored (none: the keys' own).
    dtype: Option<DType>,
    len: usize,
    capacity_hint: usize,
}

impl LayerKvCache {
    /// An empty cache that allocates room for `capacity` positions on first use.
    pub fn with_capacity(capacity: usize) -> LayerKvCache {
        LayerKvCache { capacity_hint: capacity, ..Default::default() }
    }

    /// An empty cache storing keys and values in `dtype` (checked against the
    /// keys' dtype at the first append by [`super::check_kv_dtype`]).
    pub fn with_dtype(capacity: usize, dtype: DType) -> LayerKvCache {
        LayerKvCache { capacity_hint: capacity, dtype: Some(dtype), ..Default::default() }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before anything was cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `k`, `v` (`[B, kv_heads, T, head_dim]`) and returns all cached
    /// keys and values (`[B, kv_heads, len, head_dim]`) in the keys' dtype.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let dt = k.dtype();
        let kv = self.dtype.unwrap_or(dt);
        super::check_kv_dtype(dt, kv)?;
        let need = self.len + k.shape()[2];
        let cap = self.k.as_ref().map_or(0, |b| b.shape()[2]);
        if let Some(kb) = &self.k {
            let (s, n) = (kb.shape(), k.shape());
            if s[0] != n[0] || s[1] != n[1] || s[3] != n[3] || v.dtype() != dt || v.shape() != n || kb.dtype() != kv {
                return Err(Error::shape(
                    "LayerKvCache::append",
                    format!("keys {n:?} and values {:?} ({dt}) do not fit a cache of shape {s:?} ({kv})", v.shape()),
                ));
            }
        }
        let new_cap = if need > cap { need.max(2 * cap).max(self.capacity_hint) } else { cap };
        let (ks, kscale) = super::store_rows(k, kv)?;
        let (vs, vscale) = super::store_rows(v, kv)?;
        let len = self.len;
        let kb = put(&mut self.k, &ks, len, new_cap)?;
        let vb = put(&mut self.v, &vs, len, new_cap)?;
        let scales = match (kscale, vscale) {
            (Some(a), Some(b)) => {
                let (mut sk, mut sv) = self.scales.take().map_or((None, None), |(a, b)| (Some(a), Some(b)));
                let views = (put(&mut sk, &a, len, new_cap)?, put(&mut sv, &b, len, new_cap)?);
                self.scales = sk.zip(sv);
                Some(views)
            }
            _ => None,
        };
        self.len = need;
        if kv == dt {
            return Ok((kb, vb));
        }
        let (sk, sv) = scales.map_or((None, None), |(a, b)| (Some(a), Some(b)));
        Ok((super::load_rows(&kb, sk.as_ref(), dt)?, super::load_rows(&vb, sv.as_ref(), dt)?))
    }
}

/// Writes `x` (time along dim 2) at positions `len..` of `buf`, reallocated
/// first with room for `cap` positions when it has less, and returns the
/// view of positions `0 .. len + T`.
fn put(buf: &mut Option<Tensor>, x: &Tensor, len: usize, cap: usize) -> Result<Tensor> {
    let t = x.shape()[2];
    if buf.as_ref().map_or(0, |b| b.shape()[2]) < cap {
        let mut shape = x.shape().to_vec();
        shape[2] = cap;
        let grown = Tensor::zeros(&shape, (x.dtype(), x.device()))?;
        if let Some(old) = buf.as_ref() {
            grown.narrow(2, 0, len)?.copy_(&old.narrow(2, 0, len)?)?;
        }
        *buf = Some(grown);
    }
    let b = buf.as_ref().expect("allocated above");
    b.narrow(2, len as isize, t)?.copy_(x)?;
    b.narrow(2, 0, len + t)
}

/// The value an additive mask of `dtype` gives a hidden key: the dtype's lowest.
pub fn mask_min(dtype: DType) -> Result<f64> {
    match dtype {
        DType::F32 => Ok(f32::MIN as f64),
        DType::F64 => Ok(f64::MIN),
        DType::BF16 => Ok(bf16::MIN.to_f64()),
        DType::F16 => Ok(f16::MIN.to_f64()),
        d => Err(Error::dtype("causal_mask", format!("expected a floating point dtype, got {d}"))),
    }
}

/// The additive attention mask for `t` new queries at positions `past .. past + t`
/// over `past + t` keys: 0 where a query may attend, the dtype's lowest value
/// where it may not (as transformers builds it, so a fully masked row gives a
/// uniform distribution rather than NaN).
///
/// Without `padding` the mask is `[t, past + t]` (shared by the batch) and
/// `None` when nothing is masked (a single new query). With `padding`
/// (`[B, past + t]`, 1 for real tokens and 0 for padding) it is
/// `[B, 1, t, past + t]` and also hides padded keys.
pub fn causal_mask(
    t: usize,
    past: usize,
    padding: Option<&Tensor>,
    dtype: DType,
    device: Device,
) -> Result<Option<Tensor>> {
    let s = past + t;
    let min = mask_min(dtype)?;
    let causal = |i: usize, j: usize| j <= past + i;
    let (values, shape) = match padding {
        None if t <= 1 => return Ok(None),
        None => {
            let v: Vec<f64> = (0..t).flat_map(|i| (0..s).map(move |j| if causal(i, j) { 0.0 } else { min })).collect();
            (v, vec![t, s])
        }
        Some(p) => {
            if p.ndim() != 2 || p.shape()[1] != s {
                return Err(Error::shape(
                    "causal_mask",
                    format!(
                        "expected an attention mask of shape [B, {s}] (past {past} + new {t}), got {:?}",
                        p.shape()
                    ),
                ));
            }
            let b = p.shape()[0];
            let keep = p.to_vec_f64()?;
            let mut v = Vec::with_capacity(b * t * s);
            for bi in 0..b {
                for i in 0..t {
                    for j in 0..s {
                        v.push(if causal(i, j) && keep[bi * s + j] != 0.0 { 0.0 } else { min });
                    }
                }
            }
            (v, vec![b, 1, t, s])
        }
    };
    // The lowest value of every half or single dtype is exact in f32: build in f32 unless f64.
    let host = if dtype == DType::F64 {
        Tensor::from_vec(values, &shape)?
    } else {
        Tensor::from_vec(values.into_iter().map(|x| x as f32).collect::<Vec<f32>>(), &shape)?
    };
    Ok(Some(host.to_dtype(dtype)?.to_device(device)?))
}

/// Which keys each query of [`Attention::forward`] may see.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every key.
    None,
    /// The causal mask: with `past` cached positions, query `i` sees keys
    /// `j <= past + i`.
    Causal,
    /// An additive mask broadcastable to the scores `[B, H, T, S]`: 0 keeps a
    /// key, the dtype's lowest value drops it (see [`causal_mask`], which adds
    /// padding to the causal mask).
    Additive(&'a Tensor),
    /// Causal over a sequence split along a context-parallel axis: ring
    /// attention ([`crate::parallel::ring_attention`]), each token's position
    /// in `positions` (int64 `[T]`, split like the sequence).
    Ring(&'a crate::parallel::ContextParallel, &'a Tensor),
}

/// Grouped-query causal self-attention (`LlamaAttention`, `Qwen3Attention`):
/// `o_proj(softmax(q k^T / sqrt(d) + mask) v)` with RoPE on `q` and `k`.
///
/// Heads are never looped over nor copied for the grouping: the fused kernel
/// reads key/value head `h / (H/KV)` for query head `h`, and the step-by-step
/// path views queries `[B, H, T, d]` as `[B, KV, (H/KV)*T, d]`, so one batched
/// matmul against keys `[B, KV, S, d]` serves every query head of a group.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct Attention {
    /// `[heads * head_dim, hidden]`.
    pub q_proj: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub k_proj: Linear,
    /// `[kv_heads * head_dim, hidden]`.
    pub v_proj: Linear,
    /// `[hidden, heads * head_dim]`.
    pub o_proj: Linear,
    /// Qwen3's per-head query norm (`[head_dim]`).
    pub q_norm: Option<RmsNorm>,
    /// Qwen3's per-head key norm (`[head_dim]`).
    pub k_norm: Option<RmsNorm>,
    #[module(skip)]
    num_heads: usize,
    #[module(skip)]
    num_kv_heads: usize,
    #[module(skip)]
    head_dim: usize,
    #[module(skip)]
    scaling: f64,
    dropout: Dropout,
}

impl Attention {
    /// A block with `N(0, std²)` projection weights and unit norms.
    pub fn new(cfg: &AttentionConfig, std: f64, opts: impl Into<TensorOptions>) -> Result<Attention> {
        let opts = opts.into();
        if cfg.num_kv_heads == 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            return Err(Error::invalid(
                "Attention",
                format!(
                    "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                    cfg.num_heads, cfg.num_kv_heads
                ),
            ));
        }
        let (h, kv, d, c) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size);
        let norm = |on: Option<f64>| on.map(|eps| RmsNorm::new(d, eps, opts)).transpose();
        Ok(Attention {
            q_proj: Linear::new_normal(c, h * d, cfg.bias, std, opts)?,
            k_proj: Linear::new_normal(c, kv * d, cfg.bias, std, opts)?,
            v_proj: Linear::new_normal(c, kv * d, cfg.bias, std, opts)?,
            o_proj: Linear::new_normal(h * d, c, cfg.bias, std, opts)?,
            q_norm: norm(cfg.qk_norm_eps)?,
            k_norm: norm(cfg.qk_norm_eps)?,
            num_heads: h,
            num_kv_heads: kv,
            head_dim: d,
            scaling: 1.0 / (d as f64).sqrt(),
            dropout: Dropout::new(cfg.dropout)?,
        })
    }

    /// A block around existing layers (shapes checked against `cfg`; `cfg.bias`
    /// and `cfg.qk_norm_eps` are taken from the layers given).
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        cfg: &AttentionConfig,
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        q_norm: Option<RmsNorm>,
        k_norm: Option<RmsNorm>,
    ) -> Result<Attention> {
        let (h, kv, d, c) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size);
        if kv == 0 || h % kv != 0 {
            return Err(Error::invalid(
                "Attention",
                format!("num_attention_heads ({h}) must be a multiple of num_key_value_heads ({kv})"),
            ));
        }
        for (name, l, want) in [
            ("q_proj", &q_proj, [h * d, c]),
            ("k_proj", &k_proj, [kv * d, c]),
            ("v_proj", &v_proj, [kv * d, c]),
            ("o_proj", &o_proj, [c, h * d]),
        ] {
            if l.weight.shape() != want {
                return Err(Error::shape(
                    "Attention",
                    format!("{name}.weight has shape {:?}, expected {:?}", l.weight.shape(), want),
                ));
            }
        }
        for (name, n) in [("q_norm", &q_norm), ("k_norm", &k_norm)] {
            if let Some(n) = n {
                if n.weight.shape() != [d] {
                    return Err(Error::shape(
                        "Attention",
                        format!("{name}.weight has shape {:?}, expected [{d}]", n.weight.shape()),
                    ));
                }
            }
        }
        Ok(Attention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            num_heads: h,
            num_kv_heads: kv,
            head_dim: d,
            scaling: 1.0 / (d as f64).sqrt(),
            dropout: Dropout::new(cfg.dropout)?,
        })
    }

    /// Attention over `x: [B, T, hidden]` with RoPE tables for the `T` new
    /// positions, a mask (see [`AttentionMask`]), and optionally a cache holding
    /// earlier keys and values (updated in place). Returns `[B, T, hidden]`
    /// (after `o_proj`).
    ///
    /// In float32 and float64, without an additive mask and without active
    /// dropout, the attention itself runs as one fused kernel
    /// ([`Tensor::scaled_dot_product_attention`]); otherwise (padding masks,
    /// dropout, half precision) it is computed step by step as transformers'
    /// eager attention does: scores, mask, softmax in float32, product with the
    /// values, so half-precision results round exactly as transformers' do.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &RopeTables,
        mask: AttentionMask<'_>,
        cache: Option<&mut LayerKvCache>,
    ) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        if x.ndim() != 3 {
            return Err(Error::shape("Attention", format!("expected input [B, T, hidden], got {:?}", x.shape())));
        }
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let g = h / kv;
        // [B, T, H*d] -> [B, T, H, d] (-> per-head norm) -> [B, H, T, d] -> RoPE (contiguous result).
        let heads = |proj: &Linear, n: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let y = proj.forward(x)?.reshape_to(&[b, t, n, d])?;
            let y = match norm {
                Some(nm) => nm.forward(&y)?,
                None => y,
            };
            rope.apply(&y.transpose(1, 2)?)
        };
        let q = heads(&self.q_proj, h, &self.q_norm)?;
        let k = heads(&self.k_proj, kv, &self.k_norm)?;
        let v = self.v_proj.forward(x)?.reshape_to(&[b, t, kv, d])?.transpose(1, 2)?; // [B, KV, T, d]
        let (k, v) = match cache {
            Some(c) => c.append(&k, &v)?,
            None => (k, v),
        };
        let s = k.shape()[2];
        let dropout = self.dropout.is_active();
        let fused = matches!(q.dtype(), DType::F32 | DType::F64) && !dropout;
        let out = match mask {
            AttentionMask::Ring(cp, positions) => {
                if self.dropout.is_active() || s != t {
                    return Err(Error::invalid(
                        "Attention",
                        "ring attention (context parallelism) runs without attention dropout and without a KV cache",
                    ));
                }
                crate::parallel::ring_attention(&q, &k, &v, positions, cp, self.scaling)?
            }
            AttentionMask::None | AttentionMask::Causal if fused => {
                let causal = matches!(mask, AttentionMask::Causal);
                q.scaled_dot_product_attention(&k, &v, causal, Some(self.scaling))?
            }
            _ => {
                let built;
                let additive = match mask {
                    AttentionMask::None | AttentionMask::Ring(..) => None,
                    AttentionMask::Causal => {
                        built = causal_mask(t, s - t, None, q.dtype(), q.device())?;
                        built.as_ref()
                    }
                    AttentionMask::Additive(m) => Some(m),
                };
                // scores: [B, KV, G*T, d] @ [B, KV, d, S] -> [B, KV, G*T, S], seen as [B, H, T, S].
                // The scaling is applied to q ([.., T, d]) rather than to the scores ([.., T, S]):
                // a smaller pass, and exact when the scale is a power of two (head_dim 64, 256).
                let qg = q.mul(self.scaling)?.reshape_to(&[b, kv, g * t, d])?;
                let scores = qg.matmul(&k.transpose(-1, -2)?)?.reshape_to(&[b, h, t, s])?;
                let scores = match additive {
                    Some(m) => scores.add(m)?,
                    None => scores,
                };
                let probs = softmax_f32(&scores)?;
                let probs = self.dropout.forward(&probs)?;
                // [B, KV, G*T, S] @ [B, KV, S, d] -> [B, KV, G*T, d] = [B, H, T, d].
                probs.reshape_to(&[b, kv, g * t, s])?.matmul(&v)?.reshape_to(&[b, h, t, d])?
            }
        };
        // [B, H, T, d] -> [B, T, H*d].
        let out = out.transpose(1, 2)?.reshape_to(&[b, t, h * d])?;
        self.o_proj.forward(&out)
    }

    /// Whether `forward` draws random numbers (attention dropout in training mode).
    pub fn dropout_is_active(&self) -> bool {
        self.dropout.is_active()
    }

    /// Query heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Features per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// Softmax over the last dim computed in float32 and cast back (transformers'
/// `softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)`).
fn softmax_f32(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => x.softmax(-1),
        dt => x.to_dtype(DType::F32)?.softmax(-1)?.to_dtype(dt),
    }
}
