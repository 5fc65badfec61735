//! `LlamaForCausalLM`: one implementation of the Llama 2/3 and Qwen3 decoder
//! (pre-norm residual blocks of grouped-query attention with RoPE and a
//! SwiGLU MLP), with Hugging Face parameter names, loading and saving.
use super::config::LlamaConfig;
use crate::io::{save_checkpoint_dir, write_atomic};
use crate::layers::{
    causal_mask, normal_param, parameter, Attention, AttentionConfig, AttentionMask, Embedding, FeedForward,
    LayerKvCache, Linear, RmsNorm, RotaryEmbedding, SparseMoeBlock, SwiGluMlp,
};
use crate::module::{join_name, Module};
use crate::precision::MixedPrecisionPolicy;
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, Device, Error, Result, Tensor, TensorOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

/// How a parameter starts when a model is built from scratch.
#[derive(Debug, Clone, Copy)]
enum Init {
    Normal,
    Ones,
    Zeros,
}

/// Supplies each parameter by name and shape while a model is built.
type Source<'a> = dyn FnMut(&str, &[usize], Init) -> Result<Tensor> + 'a;

fn linear(src: &mut Source<'_>, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
    let w = src(&join_name(name, "weight"), &[out, inp], Init::Normal)?;
    let b = if bias { Some(src(&join_name(name, "bias"), &[out], Init::Zeros)?) } else { None };
    Linear::from_weights(w, b)
}

fn rms(src: &mut Source<'_>, name: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
    Ok(RmsNorm { weight: src(&join_name(name, "weight"), &[dim], Init::Ones)?, eps })
}

/// The keys and values of every layer, for incremental decoding (see
/// [`LlamaForCausalLM::forward_cached`]).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerKvCache>,
}

impl KvCache {
    /// An empty cache for `num_layers` layers, with room for `capacity`
    /// positions allocated on first use (it grows past that when needed).
    pub fn new(num_layers: usize, capacity: usize) -> KvCache {
        KvCache { layers: (0..num_layers).map(|_| LayerKvCache::with_capacity(capacity)).collect() }
    }

    /// [`KvCache::new`] storing keys and values in `dtype` (Note [KV cache
    /// dtypes] in kiln-tensor).
    pub fn with_dtype(num_layers: usize, capacity: usize, dtype: DType) -> KvCache {
        KvCache { layers: (0..num_layers).map(|_| LayerKvCache::with_dtype(capacity, dtype)).collect() }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len())
    }

    /// True before anything was cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

mod gguf;
mod moe;
mod paged;
mod pretrained;

pub use moe::load_balancing_loss;
pub use pretrained::{PretrainedOptions, QuantizedLoad};

/// One pre-norm residual block: `x += attn(norm1(x))`, `x += mlp(norm2(x))`.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct DecoderLayer {
    /// The norm before attention.
    pub input_layernorm: RmsNorm,
    /// Grouped-query causal self-attention.
    pub self_attn: Attention,
    /// The norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// The MLP: dense SwiGLU, or sparse experts in Qwen3-MoE's sparse layers.
    pub mlp: FeedForward,
    /// A fused residual add and post-attention norm replacing the block's two
    /// ops (none: the built-in ones).
    #[module(skip)]
    pub residual_norm: Option<ResidualNorm>,
}

/// A fused residual add and RMS normalisation for the decoder block, such as
/// a custom op ([`kiln_tensor::CustomOp`]): given the block's input `x`, the
/// attention's output `a` and the post-attention norm, returns `(x + a,
/// norm(x + a))`. Set it on every layer with
/// [`LlamaForCausalLM::set_residual_norm`].
#[derive(Clone)]
pub struct ResidualNorm(pub ResidualNormFn);

/// The function a [`ResidualNorm`] holds.
pub type ResidualNormFn = Arc<dyn Fn(&Tensor, &Tensor, &RmsNorm) -> Result<(Tensor, Tensor)> + Send + Sync>;

impl std::fmt::Debug for ResidualNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResidualNorm(..)")
    }
}

impl DecoderLayer {
    fn build(cfg: &LlamaConfig, index: usize, prefix: &str, src: &mut Source<'_>) -> Result<DecoderLayer> {
        let (c, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (h, kv, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let at = join_name(prefix, "self_attn");
        let ab = cfg.attention_bias;
        let acfg = AttentionConfig {
            hidden_size: c,
            num_heads: h,
            num_kv_heads: kv,
            head_dim: d,
            bias: ab,
            qk_norm_eps: cfg.qk_norm().then_some(cfg.rms_norm_eps),
            dropout: cfg.attention_dropout,
        };
        let q = linear(src, &join_name(&at, "q_proj"), h * d, c, ab)?;
        let k = linear(src, &join_name(&at, "k_proj"), kv * d, c, ab)?;
        let v = linear(src, &join_name(&at, "v_proj"), kv * d, c, ab)?;
        let o = linear(src, &join_name(&at, "o_proj"), c, h * d, ab)?;
        let (qn, kn) = if cfg.qk_norm() {
            (
                Some(rms(src, &join_name(&at, "q_norm"), d, cfg.rms_norm_eps)?),
                Some(rms(src, &join_name(&at, "k_norm"), d, cfg.rms_norm_eps)?),
            )
        } else {
            (None, None)
        };
        let self_attn = Attention::from_parts(&acfg, q, k, v, o, qn, kn)?;
        let mp = join_name(prefix, "mlp");
        let input_layernorm = rms(src, &join_name(prefix, "input_layernorm"), c, cfg.rms_norm_eps)?;
        let post_attention_layernorm = rms(src, &join_name(prefix, "post_attention_layernorm"), c, cfg.rms_norm_eps)?;
        let swiglu = |src: &mut Source<'_>, p: &str, i: usize, bias: bool| -> Result<SwiGluMlp> {
            Ok(SwiGluMlp {
                gate_proj: linear(src, &join_name(p, "gate_proj"), i, c, bias)?,
                up_proj: linear(src, &join_name(p, "up_proj"), i, c, bias)?,
                down_proj: linear(src, &join_name(p, "down_proj"), c, i, bias)?,
            })
        };
        let mlp = match cfg.moe.as_ref().filter(|_| cfg.is_sparse_layer(index)) {
            Some(m) => {
                let gate = linear(src, &join_name(&mp, "gate"), m.num_experts, c, false)?;
                let experts = (0..m.num_experts)
                    .map(|e| swiglu(src, &join_name(&mp, &format!("experts.{e}")), m.moe_intermediate_size, false))
                    .collect::<Result<Vec<_>>>()?;
                FeedForward::Sparse(SparseMoeBlock::from_parts(gate, experts, m.num_experts_per_tok, m.norm_topk_prob)?)
            }
            None => FeedForward::Dense(swiglu(src, &mp, i, cfg.mlp_bias)?),
        };
        Ok(DecoderLayer { input_layernorm, self_attn, post_attention_layernorm, mlp, residual_norm: None })
    }

    /// The block on `x: [B, T, hidden]` (see [`Attention::forward`] for the rest);
    /// with `acts`, records the activations of layer `index` under their fixture names.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &crate::layers::RopeTables,
        mask: AttentionMask<'_>,
        cache: Option<&mut LayerKvCache>,
        acts: Option<(&mut BTreeMap<String, Tensor>, usize)>,
    ) -> Result<Tensor> {
        self.forward_taps(x, rope, mask, cache, acts, None)
    }

    /// `(x + a, post_attention_layernorm(x + a))`, through the layer's
    /// [`ResidualNorm`] when it has one.
    pub(crate) fn add_and_norm(&self, x: &Tensor, a: &Tensor) -> Result<(Tensor, Tensor)> {
        if let Some(f) = &self.residual_norm {
            return (f.0)(x, a, &self.post_attention_layernorm);
        }
        let x1 = x.add(a)?;
        let h2 = self.post_attention_layernorm.forward(&x1)?;
        Ok((x1, h2))
    }

    /// [`DecoderLayer::forward`], also appending a sparse MLP's router
    /// logits (`[B * T, experts]`) to `router`.
    pub(crate) fn forward_taps(
        &self,
        x: &Tensor,
        rope: &crate::layers::RopeTables,
        mask: AttentionMask<'_>,
        cache: Option<&mut LayerKvCache>,
        acts: Option<(&mut BTreeMap<String, Tensor>, usize)>,
        router: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let h = self.input_layernorm.forward(x)?;
        let a = self.self_attn.forward(&h, rope, mask, cache)?;
        let (x1, h2) = self.add_and_norm(x, &a)?;
        let m = match (&self.mlp, router) {
            (FeedForward::Sparse(b), Some(r)) => {
                let (m, logits) = b.forward_with_router_logits(&h2)?;
                r.push(logits);
                m
            }
            (mlp, _) => mlp.forward(&h2)?,
        };
        let out = x1.add(&m)?;
        if let Some((acts, i)) = acts {
            acts.insert(format!("act.layer.{i}.input_layernorm"), h);
            acts.insert(format!("act.layer.{i}.self_attn"), a);
            acts.insert(format!("act.layer.{i}.mlp"), m);
            acts.insert(format!("act.layer.{i}"), out.clone());
        }
        Ok(out)
    }
}

/// The decoder stack (`LlamaModel`, parameters under `model.`): token
/// embeddings, the layers and the final norm.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct LlamaModel {
    /// `[vocab, hidden]`.
    pub embed_tokens: Embedding,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// The final norm.
    pub norm: RmsNorm,
    #[module(skip)]
    rotary: RotaryEmbedding,
    /// The sequence split over a mesh axis, attention as ring attention.
    #[module(skip)]
    context_parallel: Option<crate::parallel::ContextParallel>,
}

impl LlamaModel {
    fn build(cfg: &LlamaConfig, prefix: &str, src: &mut Source<'_>) -> Result<LlamaModel> {
        let embed = src(&join_name(prefix, "embed_tokens.weight"), &[cfg.vocab_size, cfg.hidden_size], Init::Normal)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::build(cfg, i, &join_name(prefix, &format!("layers.{i}")), src))
            .collect::<Result<Vec<_>>>()?;
        Ok(LlamaModel {
            embed_tokens: Embedding::from_weight(embed)?,
            layers,
            norm: rms(src, &join_name(prefix, "norm"), cfg.hidden_size, cfg.rms_norm_eps)?,
            rotary: RotaryEmbedding::new(cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling)?,
            context_parallel: None,
        })
    }

    /// The rotary embedding shared by the layers.
    pub fn rotary(&self) -> &RotaryEmbedding {
        &self.rotary
    }

    /// Mutable access to the rotary embedding (e.g. [`RotaryEmbedding::round_inv_freq`]).
    pub fn rotary_mut(&mut self) -> &mut RotaryEmbedding {
        &mut self.rotary
    }

    /// The final hidden states `[B, T, hidden]` (after `norm`) for token ids
    /// `[B, T]`. `attention_mask` is `[B, past + T]` (1 = token, 0 = padding);
    /// with a cache, the new tokens follow the cached ones.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
        acts: Option<&mut BTreeMap<String, Tensor>>,
    ) -> Result<Tensor> {
        self.forward_taps(input_ids, attention_mask, cache, acts, None, None)
    }

    /// [`LlamaModel::forward`], also collecting the sparse layers' router
    /// logits in `router`, in layer order.
    pub(crate) fn forward_taps(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
        mut acts: Option<&mut BTreeMap<String, Tensor>>,
        mut router: Option<&mut Vec<Tensor>>,
        packed: Option<&[usize]>,
    ) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        if input_ids.ndim() != 2 || !input_ids.dtype().is_int() {
            return Err(Error::shape(
                "LlamaModel",
                format!(
                    "expected input_ids of shape [B, T] and an integer dtype, got {:?} {}",
                    input_ids.shape(),
                    input_ids.dtype()
                ),
            ));
        }
        if let Some(c) = &cache {
            if c.layers.len() != self.layers.len() {
                return Err(Error::invalid(
                    "LlamaModel",
                    format!("the KV cache has {} layers, the model {}", c.layers.len(), self.layers.len()),
                ));
            }
        }
        let t = input_ids.shape()[1];
        let past = cache.as_ref().map_or(0, |c| c.len());
        let mut x = self.embed_tokens.forward(input_ids)?;
        if let Some(a) = acts.as_deref_mut() {
            a.insert("act.embed".into(), x.clone());
        }
        let (dt, dev) = (x.dtype(), x.device());
        // Context parallelism: the sequence in the order the devices hold it,
        // attention over the ring (Note [Ring attention]).
        let ring = match &self.context_parallel {
            Some(cp) if attention_mask.is_some() || cache.is_some() => {
                return Err(Error::invalid(
                    "LlamaModel",
                    "context parallelism runs causal attention over whole sequences: no padding mask, no KV cache",
                ))
            }
            Some(cp) => Some((cp, cp.positions(t)?, cp.order(t)?)),
            None => None,
        };
        if packed.is_some() && (ring.is_some() || attention_mask.is_some() || cache.is_some()) {
            return Err(Error::invalid(
                "LlamaModel",
                "packed sequences take no padding mask, KV cache or context parallelism",
            ));
        }
        // Built once per forward and shared by every layer.
        let rope = match (&ring, packed) {
            (Some((_, _, order)), _) => self.rotary.tables_at(order.iter().copied(), dt, dev)?,
            (None, Some(p)) => self.rotary.tables_at(p.iter().copied(), dt, dev)?,
            (None, None) => self.rotary.tables(past, t, dt, dev)?,
        };
        // Padding and packing need an explicit mask; the plain causal mask is the fused kernel's own.
        let padded = match (attention_mask, packed) {
            (_, Some(p)) => Some(packed_causal_mask(p, dt, dev)?),
            (Some(_), None) => causal_mask(t, past, attention_mask, dt, dev)?,
            (None, None) => None,
        };
        let mask = match (&padded, &ring) {
            (_, Some((cp, positions, _))) => AttentionMask::Ring(cp, positions),
            (Some(m), None) => AttentionMask::Additive(m),
            (None, None) => AttentionMask::Causal,
        };
        let mut cache = cache;
        for (i, layer) in self.layers.iter().enumerate() {
            let lc = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward_taps(&x, &rope, mask, lc, acts.as_deref_mut().map(|a| (a, i)), router.as_deref_mut())?;
        }
        let x = self.norm.forward(&x)?;
        if let Some(a) = acts {
            a.insert("act.final_norm".into(), x.clone());
        }
        Ok(x)
    }
}

/// The additive mask `[1, 1, T, T]` of sequences packed in one row, each
/// starting where its position restarts (`positions[i] != positions[i - 1] + 1`):
/// a query sees the keys at or before it in its own sequence.
fn packed_causal_mask(positions: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    let mut segment = Vec::with_capacity(positions.len());
    for (i, &p) in positions.iter().enumerate() {
        let s = match i {
            0 => 0,
            _ if p == positions[i - 1] + 1 => segment[i - 1],
            _ => segment[i - 1] + 1,
        };
        segment.push(s);
    }
    let t = positions.len();
    let min = crate::layers::mask_min(dtype)?;
    let segment = &segment;
    let v: Vec<f64> =
        (0..t).flat_map(|i| (0..t).map(move |j| if j <= i && segment[j] == segment[i] { 0.0 } else { min })).collect();
    Tensor::from_vec(v, &[1, 1, t, t])?.to_dtype(dtype)?.to_device(device)
}

/// The first items of a list of problems, then how many more there are.
fn capped(items: &[String], sep: &str) -> String {
    const SHOWN: usize = 8;
    let mut s = items.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(sep);
    if items.len() > SHOWN {
        s += &format!("{sep}... and {} more", items.len() - SHOWN);
    }
    s
}

/// The number of decoder layers in the checkpoint must be the configuration's,
/// checked before any layer is built (a config with a huge layer count would
/// otherwise build a placeholder per layer first).
fn check_layer_count(config: &LlamaConfig, weights: &BTreeMap<String, Tensor>) -> Result<()> {
    let layers = weights
        .keys()
        .filter_map(|k| k.strip_prefix("model.layers.")?.split('.').next()?.parse::<usize>().ok())
        .max()
        .map_or(0, |m| m + 1);
    if layers != config.num_hidden_layers {
        return Err(Error::invalid(
            "from_weights",
            format!(
                "Error(s) in loading state_dict for {}: the configuration has num_hidden_layers = {}, the checkpoint holds {layers} decoder layers",
                config.class_name(),
                config.num_hidden_layers
            ),
        ));
    }
    Ok(())
}

/// The shapes the configuration gives the embeddings, the final norm, the
/// output projection and the first layer's projections must be the
/// checkpoint's, checked before anything is built from the configuration.
fn check_key_shapes(config: &LlamaConfig, weights: &BTreeMap<String, Tensor>) -> Result<()> {
    let (c, i, v) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let q = config.num_attention_heads.saturating_mul(config.head_dim);
    let kv = config.num_key_value_heads.saturating_mul(config.head_dim);
    let mut expected = vec![
        ("model.embed_tokens.weight", vec![v, c]),
        ("model.norm.weight", vec![c]),
        ("model.layers.0.self_attn.q_proj.weight", vec![q, c]),
        ("model.layers.0.self_attn.k_proj.weight", vec![kv, c]),
        ("model.layers.0.self_attn.v_proj.weight", vec![kv, c]),
        ("model.layers.0.self_attn.o_proj.weight", vec![c, q]),
    ];
    match config.moe.as_ref().filter(|_| config.is_sparse_layer(0)) {
        Some(m) => expected.extend([
            ("model.layers.0.mlp.gate.weight", vec![m.num_experts, c]),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", vec![m.moe_intermediate_size, c]),
            ("model.layers.0.mlp.experts.0.down_proj.weight", vec![c, m.moe_intermediate_size]),
        ]),
        None => expected.extend([
            ("model.layers.0.mlp.gate_proj.weight", vec![i, c]),
            ("model.layers.0.mlp.down_proj.weight", vec![c, i]),
        ]),
    }
    if !config.tie_word_embeddings {
        expected.push(("lm_head.weight", vec![v, c]));
    }
    let bad: Vec<String> = expected
        .iter()
        .filter_map(|(name, shape)| {
            let t = weights.get(*name)?;
            (t.shape() != shape.as_slice()).then(|| {
                format!(
                    "size mismatch for {name}: copying a param with shape {:?} from checkpoint, the shape in current model is {shape:?}.",
                    t.shape()
                )
            })
        })
        .collect();
    if !bad.is_empty() {
        return Err(Error::invalid(
            "from_weights",
            format!("Error(s) in loading state_dict for {}:\n\t{}", config.class_name(), bad.join("\n\t")),
        ));
    }
    Ok(())
}

/// A Llama 2/3 or Qwen3 causal language model (`LlamaForCausalLM`,
/// `Qwen3ForCausalLM`) with Hugging Face parameter names.
///
/// With `tie_word_embeddings` the output projection is
/// `model.embed_tokens.weight` itself: there is no `lm_head` parameter, so
/// `state_dict` and `save_pretrained` hold the tensor once, like transformers.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
/// use kiln::nn::module::Module;
/// let cfg = LlamaConfig::from_json_str(r#"{"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16,
///     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
///     "head_dim": 4, "tie_word_embeddings": true}"#)?;
/// kiln::manual_seed(0);
/// let model = LlamaForCausalLM::new(&cfg, DType::F32)?;
/// let logits = model.forward(&Tensor::new([[1i64, 2, 3]])?, None)?;
/// assert_eq!(logits.shape(), &[1, 3, 32]);
/// assert!(!model.state_dict().contains_key("lm_head.weight"));
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone, Module)]
#[module(crate = "crate", mixed_precision = "Self::set_mixed_precision")]
pub struct LlamaForCausalLM {
    /// The decoder stack (`model.*`).
    pub model: LlamaModel,
    /// The output projection `[vocab, hidden]`; `None` when tied to the embeddings.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    config: LlamaConfig,
    /// How `forward` mixes precisions (`None`: everything in the parameters' dtype).
    #[module(skip)]
    mixed_precision: Option<MixedPrecisionPolicy>,
}

impl LlamaForCausalLM {
    fn build(cfg: &LlamaConfig, src: &mut Source<'_>) -> Result<LlamaForCausalLM> {
        cfg.validate()?;
        let model = LlamaModel::build(cfg, "model", src)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(linear(src, "lm_head", cfg.vocab_size, cfg.hidden_size, false)?)
        };
        Ok(LlamaForCausalLM { model, lm_head, config: cfg.clone(), mixed_precision: None })
    }

    /// Every decoder layer adds its residual and applies its post-attention
    /// norm through `f` (a fused op, such as a custom op); `None` restores
    /// the built-in ops. `f` must compute what they compute: the fixtures'
    /// and checkpoints' numbers rest on it.
    pub fn set_residual_norm(&mut self, f: Option<ResidualNorm>) {
        for layer in &mut self.model.layers {
            layer.residual_norm = f.clone();
        }
    }

    /// A randomly initialised model for training from scratch, drawn from the
    /// global generator (`kiln::manual_seed`) like transformers' init: weights
    /// of linear layers and embeddings from `N(0, initializer_range²)`, biases
    /// zero, norms one. Parameters require grad.
    pub fn new(config: &LlamaConfig, opts: impl Into<TensorOptions>) -> Result<LlamaForCausalLM> {
        let opts = opts.into();
        config.validate()?;
        if opts.device == Device::Cpu {
            // The whole model, before the first of its many allocations.
            let n = config.num_parameters().unwrap_or(usize::MAX);
            kiln_tensor::alloc::reserve(config.class_name(), &[n], opts.dtype)?;
        }
        let std = config.initializer_range;
        let mut src = |_: &str, shape: &[usize], init: Init| match init {
            Init::Normal => normal_param(shape, std, opts),
            Init::Ones => parameter(Tensor::ones(shape, DType::F32)?, opts),
            Init::Zeros => parameter(Tensor::zeros(shape, DType::F32)?, opts),
        };
        LlamaForCausalLM::build(config, &mut src)
    }

    /// Builds the model from `config` and tensors named as Hugging Face names
    /// them (any dtype: floats are converted to `dtype`). Every parameter must
    /// be present with its shape; names that are not parameters are an error,
    /// except `lm_head.weight` of a tied model and RoPE `inv_freq` buffers
    /// (both ignored, as transformers does). All problems are reported at once.
    pub fn from_weights(
        config: &LlamaConfig,
        weights: &BTreeMap<String, Tensor>,
        dtype: DType,
        device: Device,
    ) -> Result<LlamaForCausalLM> {
        config.validate()?;
        let class = config.class_name();
        check_layer_count(config, weights)?;
        check_key_shapes(config, weights)?;
        let opts = TensorOptions { dtype, device };
        let mut used = BTreeSet::new();
        let mut missing = vec![];
        let mut mis_shaped = vec![];
        let model = {
            let mut src = |name: &str, shape: &[usize], _: Init| -> Result<Tensor> {
                let placeholder =
                    || Tensor::zeros(&[], dtype)?.expand(&shape.iter().map(|&s| s as isize).collect::<Vec<_>>());
                match weights.get(name) {
                    None => {
                        missing.push(format!("\"{name}\""));
                        placeholder()
                    }
                    Some(t) => {
                        used.insert(name.to_string());
                        if t.shape() != shape {
                            mis_shaped.push(format!(
                                "size mismatch for {name}: copying a param with shape {:?} from checkpoint, the shape in current model is {:?}.",
                                t.shape(),
                                shape
                            ));
                            return placeholder();
                        }
                        if !t.dtype().is_float() {
                            return Err(Error::dtype(
                                "from_weights",
                                format!("{name} has dtype {}, expected a float", t.dtype()),
                            ));
                        }
                        parameter(t.clone(), opts)
                    }
                }
            };
            LlamaForCausalLM::build(config, &mut src)?
        };
        let ignored =
            |k: &str| k.ends_with("rotary_emb.inv_freq") || (config.tie_word_embeddings && k == "lm_head.weight");
        let unexpected: Vec<String> =
            weights.keys().filter(|k| !used.contains(*k) && !ignored(k)).map(|k| format!("\"{k}\"")).collect();
        let mut problems = vec![];
        if !missing.is_empty() {
            problems.push(format!("Missing key(s) in state_dict: {}.", capped(&missing, ", ")));
        }
        if !unexpected.is_empty() {
            problems.push(format!("Unexpected key(s) in state_dict: {}.", capped(&unexpected, ", ")));
        }
        if !mis_shaped.is_empty() {
            problems.push(capped(&mis_shaped, "\n\t"));
        }
        if !problems.is_empty() {
            return Err(Error::invalid(
                "from_weights",
                format!("Error(s) in loading state_dict for {class}:\n\t{}", problems.join("\n\t")),
            ));
        }
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The dtype of the parameters (the compute dtype).
    pub fn dtype(&self) -> DType {
        self.model.embed_tokens.weight.dtype()
    }

    /// The device of the parameters.
    pub fn device(&self) -> Device {
        self.model.embed_tokens.weight.device()
    }

    /// The dense `[vocab, hidden]` matrix that maps hidden states to logits;
    /// `None` when `lm_head` keeps its weight quantized (its codes and scales
    /// are `lm_head.quantized_weight()`).
    pub fn output_weight(&self) -> Option<&Tensor> {
        match &self.lm_head {
            Some(l) if l.is_quantized() => None,
            Some(l) => Some(&l.weight),
            None => Some(&self.model.embed_tokens.weight),
        }
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        match &self.lm_head {
            // Through the Linear, which multiplies a weight kept quantized by its codes.
            Some(head) => head.forward(hidden),
            None => hidden.linear(&self.model.embed_tokens.weight, None),
        }
    }

    /// Logits `[B, T, vocab]` for token ids `[B, T]` (int64 or another integer
    /// dtype), with an optional `[B, T]` attention mask (1 = token, 0 = padding).
    pub fn forward(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        self.with_policy(|| {
            let h = self.model.forward(input_ids, attention_mask, None, None)?;
            self.logits(&h)
        })
    }

    /// Logits `[B, T, vocab]` for rows that each pack several sequences one
    /// after another (supervised fine-tuning's packing, `data::sft`):
    /// `position_ids` (`[B, T]`, integers) restart at each sequence, and a
    /// position that does not follow the one before it starts a new sequence.
    /// Each token attends only within its own sequence, at its own positions,
    /// so each sequence gets the logits it has alone. The rows run one after
    /// another (their layouts differ).
    pub fn forward_packed(&self, input_ids: &Tensor, position_ids: &Tensor) -> Result<Tensor> {
        if input_ids.ndim() != 2 || position_ids.shape() != input_ids.shape() || !position_ids.dtype().is_int() {
            return Err(Error::shape(
                "forward_packed",
                format!(
                    "expected input_ids [B, T] and integer position_ids of the same shape, got {:?} and {:?} {}",
                    input_ids.shape(),
                    position_ids.shape(),
                    position_ids.dtype()
                ),
            ));
        }
        let (b, t) = (input_ids.shape()[0], input_ids.shape()[1]);
        let pos = position_ids.to_dtype(DType::I64)?.to_device(Device::Cpu)?.to_vec::<i64>()?;
        if let Some(p) = pos.iter().find(|&&p| p < 0) {
            return Err(Error::invalid("forward_packed", format!("position ids must be non-negative, got {p}")));
        }
        let pos: Vec<usize> = pos.into_iter().map(|p| p as usize).collect();
        self.with_policy(|| {
            let rows = (0..b)
                .map(|r| {
                    let ids = input_ids.narrow(0, r as isize, 1)?;
                    let h = self.model.forward_taps(&ids, None, None, None, None, Some(&pos[r * t..(r + 1) * t]))?;
                    self.logits(&h)
                })
                .collect::<Result<Vec<Tensor>>>()?;
            match rows.as_slice() {
                [one] => Ok(one.clone()),
                _ => Tensor::cat(&rows.iter().collect::<Vec<_>>(), 0),
            }
        })
    }

    /// Sets how [`LlamaForCausalLM::forward`] and
    /// [`LlamaForCausalLM::forward_with_activations`] mix precisions (see
    /// [`MixedPrecisionPolicy`]); parameters keep their dtype. `None` turns
    /// it off. Cached decoding (`forward_cached`, `generate`) computes in the
    /// parameters' dtype.
    pub fn set_mixed_precision(&mut self, policy: Option<MixedPrecisionPolicy>) -> Result<()> {
        if let Some(p) = &policy {
            p.validate()?;
        }
        self.mixed_precision = policy;
        Ok(())
    }

    /// Splits every sequence of [`LlamaForCausalLM::forward`] over the mesh
    /// of `cp` (context parallelism; `None` turns it off): the token ids
    /// come from [`ContextParallel::shard_sequence`](crate::parallel::ContextParallel::shard_sequence),
    /// the logits leave split the same way
    /// ([`ContextParallel::unshard_sequence`](crate::parallel::ContextParallel::unshard_sequence),
    /// [`ContextParallel::causal_lm_loss`](crate::parallel::ContextParallel::causal_lm_loss)),
    /// and attention is ring attention. The parameters must be on (or
    /// replicated over) the same mesh.
    pub fn set_context_parallel(&mut self, cp: Option<crate::parallel::ContextParallel>) {
        self.model.context_parallel = cp;
    }

    /// The mixed-precision policy, if one is set.
    pub fn mixed_precision(&self) -> Option<MixedPrecisionPolicy> {
        self.mixed_precision
    }

    fn with_policy(&self, f: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
        match &self.mixed_precision {
            Some(p) => p.run(f),
            None => f(),
        }
    }

    /// [`LlamaForCausalLM::forward`], also returning the intermediate
    /// activations named as in the golden fixtures: `act.embed`,
    /// `act.layer.{i}.input_layernorm`, `act.layer.{i}.self_attn`,
    /// `act.layer.{i}.mlp`, `act.layer.{i}` and `act.final_norm`.
    pub fn forward_with_activations(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<(Tensor, BTreeMap<String, Tensor>)> {
        let mut acts = BTreeMap::new();
        let logits = self.with_policy(|| {
            let h = self.model.forward(input_ids, attention_mask, None, Some(&mut acts))?;
            self.logits(&h)
        })?;
        Ok((logits, acts))
    }

    /// Logits for new tokens `[B, T]` that follow the ones held in `cache`
    /// (which is extended with them). `attention_mask`, if any, covers the
    /// cached and the new positions: `[B, cache.len() + T]`. With
    /// `last_only`, only the last position's logits are computed (`[B, 1, vocab]`).
    pub fn forward_cached(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        cache: &mut KvCache,
        last_only: bool,
    ) -> Result<Tensor> {
        let h = self.model.forward(input_ids, attention_mask, Some(cache), None)?;
        let h = if last_only { h.narrow(1, h.shape()[1] as isize - 1, 1)? } else { h };
        self.logits(&h)
    }

    /// An empty KV cache for this model with room for `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(self.model.layers.len(), capacity)
    }

    /// An empty KV cache storing keys and values in `dtype`: the model's,
    /// bfloat16 or float16 under float32, or float8 with a scale per row
    /// (Note [KV cache dtypes] in kiln-tensor; [`crate::layers::check_kv_dtype`]).
    pub fn new_cache_with_dtype(&self, capacity: usize, dtype: DType) -> Result<KvCache> {
        crate::layers::check_kv_dtype(self.dtype(), dtype)?;
        Ok(KvCache::with_dtype(self.model.layers.len(), capacity, dtype))
    }

    /// Writes `config.json` and `model.safetensors` into `dir` (created if
    /// needed), tied weights once, in the parameters' dtype; both files are
    /// written atomically.
    pub fn save_pretrained(&self, dir: impl AsRef<Path>) -> Result<()> {
        self.save_impl(dir.as_ref(), None)
    }

    /// Like [`LlamaForCausalLM::save_pretrained`], in shards of at most
    /// `max_shard_bytes` with a `model.safetensors.index.json`.
    pub fn save_pretrained_sharded(&self, dir: impl AsRef<Path>, max_shard_bytes: usize) -> Result<()> {
        self.save_impl(dir.as_ref(), Some(max_shard_bytes))
    }

    /// Whether some Linear keeps its weight quantized (`QuantizedLoad::Keep`).
    fn has_quantized_weights(&self) -> bool {
        self.model.layers.iter().any(|l| {
            let a = &l.self_attn;
            [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj].iter().any(|lin| lin.is_quantized()) || l.mlp.is_quantized()
        }) || self.lm_head.as_ref().is_some_and(|h| h.is_quantized())
    }

    fn save_impl(&self, dir: &Path, shard: Option<usize>) -> Result<()> {
        if self.has_quantized_weights() {
            return Err(Error::invalid(
                "save_pretrained",
                "the model keeps some weights quantized; load it dequantized (QuantizedLoad::Dequantize) to save \
                 a dense checkpoint",
            ));
        }
        if let Some(n) = self.state_dict().keys().find(|n| crate::lora::is_adapter_parameter(n)) {
            return Err(Error::invalid(
                "save_pretrained",
                format!(
                    "the model has LoRA adapters ({n}): save them with lora::save_adapter, or fold them into the \
                     weights with lora::merge_and_unload first"
                ),
            ));
        }
        // The Hub's per-expert names, whatever the experts' layout (Note [Stacked experts]).
        save_checkpoint_dir(dir, &crate::layers::to_hub_layout(self.state_dict())?, shard)?;
        let text = serde_json::to_string_pretty(&self.config.to_json(self.dtype()))
            .map_err(|e| Error::invalid("save_pretrained", e.to_string()))?;
        write_atomic(&dir.join("config.json"), |w| w.write_all(text.as_bytes()))
    }
}

/// The causal language-modelling loss of transformers (`labels = input_ids`):
/// the mean cross entropy of `logits[:, :-1]` (`[B, T, V]`, computed in
/// float32 for half-precision logits) against `labels[:, 1:]` (`[B, T]`), skipping targets equal to
/// `ignore_index` (transformers uses -100).
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::models::causal_lm_loss;
/// let logits = Tensor::zeros(&[1, 3, 4], DType::F32)?;
/// let ids = Tensor::new([[0i64, 1, 2]])?;
/// let loss = causal_lm_loss(&logits, &ids, Some(-100))?;
/// assert!((loss.item::<f32>()? - 4f32.ln()).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn causal_lm_loss(logits: &Tensor, labels: &Tensor, ignore_index: Option<i64>) -> Result<Tensor> {
    let _c = ConstantScope::enter();
    if logits.ndim() != 3 || labels.ndim() != 2 || logits.shape()[..2] != *labels.shape() || logits.shape()[1] < 2 {
        return Err(Error::shape(
            "causal_lm_loss",
            format!(
                "expected logits [B, T, V] and labels [B, T] with T >= 2, got {:?} and {:?}",
                logits.shape(),
                labels.shape()
            ),
        ));
    }
    let (b, t, v) = (logits.shape()[0], logits.shape()[1], logits.shape()[2]);
    // Rather than slicing off the last position of the logits (a copy of the
    // largest tensor of the step in forward and a zero-padded one in backward),
    // the labels are shifted and the last position gets an ignored target: the
    // same terms, the same mean over the `B * (T - 1)` counted targets.
    let pad = ignore_index.unwrap_or(i64::MIN);
    // Half-precision logits are upcast like transformers' `logits.float()`; f64 stays f64.
    let ct = if matches!(logits.dtype(), DType::BF16 | DType::F16) { DType::F32 } else { logits.dtype() };
    let x = logits.to_dtype(ct)?.reshape_to(&[b * t, v])?;
    let last = Tensor::full(&[b, 1], pad, (DType::I64, labels.device()))?;
    let y = Tensor::cat(&[&labels.narrow(1, 1, t - 1)?.to_dtype(DType::I64)?, &last], 1)?.reshape_to(&[b * t])?;
    x.cross_entropy(&y, Some(pad), kiln_tensor::Reduction::Mean)
}
