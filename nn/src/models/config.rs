//! `LlamaConfig`: the fields of a Hugging Face Llama / Qwen3 / Qwen3-MoE
//! `config.json`, read from either RoPE layout (transformers 5's
//! `rope_parameters`, or the top-level `rope_theta` / `rope_scaling` of most
//! Hub checkpoints).
use crate::layers::RopeScaling;
use kiln_tensor::{DType, Error, Result};
use serde_json::{json, Value};
use std::path::Path;

/// The architecture family named by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelType {
    /// Llama 2 / 3 (`"llama"`).
    Llama,
    /// Qwen3 (`"qwen3"`): per-head RMSNorm of queries and keys.
    Qwen3,
    /// Qwen3-MoE (`"qwen3_moe"`): Qwen3's attention, and sparse
    /// mixture-of-experts MLPs (see [`MoeConfig`]).
    Qwen3Moe,
}

impl ModelType {
    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        match self {
            ModelType::Llama => "llama",
            ModelType::Qwen3 => "qwen3",
            ModelType::Qwen3Moe => "qwen3_moe",
        }
    }
}

/// The mixture-of-experts fields of a Qwen3-MoE `config.json`, with
/// transformers' defaults (`Qwen3MoeConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_experts`, or `num_local_experts` as
    /// transformers 5 writes it).
    pub num_experts: usize,
    /// Experts each token is routed to (the router's top-k).
    pub num_experts_per_tok: usize,
    /// Each expert's SwiGLU width.
    pub moe_intermediate_size: usize,
    /// Whether the top-k routing weights are renormalised to sum to 1.
    pub norm_topk_prob: bool,
    /// Layer `i` is sparse when `(i + 1) % decoder_sparse_step == 0` (and not
    /// in `mlp_only_layers`); the others are dense with `intermediate_size`.
    pub decoder_sparse_step: usize,
    /// Layers that stay dense.
    pub mlp_only_layers: Vec<usize>,
    /// Whether the training loss adds the router's load-balancing loss.
    pub output_router_logits: bool,
    /// The load-balancing loss's weight.
    pub router_aux_loss_coef: f64,
}

impl MoeConfig {
    fn from_json(v: &Value) -> Result<MoeConfig> {
        let num_experts = match (get_usize(v, "num_experts")?, get_usize(v, "num_local_experts")?) {
            (Some(a), Some(b)) if a != b => {
                return Err(cfg_err(format!("num_experts ({a}) and num_local_experts ({b}) disagree")))
            }
            (a, b) => a.or(b).unwrap_or(128),
        };
        let mlp_only_layers = match v.get("mlp_only_layers") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| cfg_err(format!("mlp_only_layers must hold layer indices, got {x}")))
                })
                .collect::<Result<_>>()?,
            Some(x) => return Err(cfg_err(format!("mlp_only_layers must be a list of layer indices, got {x}"))),
        };
        Ok(MoeConfig {
            num_experts,
            num_experts_per_tok: get_usize(v, "num_experts_per_tok")?.unwrap_or(8),
            moe_intermediate_size: get_usize(v, "moe_intermediate_size")?.unwrap_or(768),
            norm_topk_prob: get_bool(v, "norm_topk_prob")?.unwrap_or(false),
            decoder_sparse_step: get_usize(v, "decoder_sparse_step")?.unwrap_or(1),
            mlp_only_layers,
            output_router_logits: get_bool(v, "output_router_logits")?.unwrap_or(false),
            router_aux_loss_coef: get_f64(v, "router_aux_loss_coef")?.unwrap_or(0.001),
        })
    }
}

/// A Llama-family configuration (one type for Llama 2/3, Qwen3 and Qwen3-MoE).
///
/// ```
/// use kiln::nn::models::{LlamaConfig, ModelType};
/// let cfg = LlamaConfig::from_json_str(r#"{
///     "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
///     "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
///     "rms_norm_eps": 1e-5, "rope_theta": 500000.0
/// }"#)?;
/// assert_eq!(cfg.head_dim, 8);
/// assert_eq!(cfg.model_type, ModelType::Llama);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// `llama`, `qwen3` or `qwen3_moe`.
    pub model_type: ModelType,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (defaults to `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Features per head (defaults to `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scheme.
    pub rope_scaling: RopeScaling,
    /// Whether `lm_head` reuses `model.embed_tokens.weight`.
    pub tie_word_embeddings: bool,
    /// Longest sequence the model was configured for.
    pub max_position_embeddings: usize,
    /// Biases on the attention projections.
    pub attention_bias: bool,
    /// Biases on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// Dropout on attention probabilities (training only).
    pub attention_dropout: f64,
    /// Standard deviation of the random initialisation.
    pub initializer_range: f64,
    /// Beginning-of-sequence token, if any.
    pub bos_token_id: Option<i64>,
    /// End-of-sequence tokens (generation stops on any of them).
    pub eos_token_ids: Vec<i64>,
    /// The mixture-of-experts settings (Qwen3-MoE only).
    pub moe: Option<MoeConfig>,
    /// The dtype the checkpoint was saved in (`dtype` or `torch_dtype`), if given.
    pub torch_dtype: Option<DType>,
    /// The parsed JSON, kept so that saving preserves fields kiln does not use.
    pub raw: Option<Value>,
}

fn cfg_err(msg: impl Into<String>) -> Error {
    Error::invalid("LlamaConfig", msg)
}

fn get_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| cfg_err(format!("{key} must be a non-negative integer, got {x}"))),
    }
}

fn need_usize(v: &Value, key: &str) -> Result<usize> {
    get_usize(v, key)?.ok_or_else(|| cfg_err(format!("config.json has no {key}")))
}

fn get_f64(v: &Value, key: &str) -> Result<Option<f64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| cfg_err(format!("{key} must be a number, got {x}"))),
    }
}

fn get_bool(v: &Value, key: &str) -> Result<Option<bool>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_bool().map(Some).ok_or_else(|| cfg_err(format!("{key} must be true or false, got {x}"))),
    }
}

fn token_ids(v: &Value, key: &str) -> Result<Vec<i64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => {
            a.iter().map(|x| x.as_i64().ok_or_else(|| cfg_err(format!("{key} must hold integers, got {x}")))).collect()
        }
        Some(x) => x.as_i64().map(|i| vec![i]).ok_or_else(|| cfg_err(format!("{key} must be an integer, got {x}"))),
    }
}

/// The RoPE scheme from a `rope_parameters` or `rope_scaling` object.
fn parse_rope(obj: &Value, max_pos: usize) -> Result<RopeScaling> {
    let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
    let factor = || get_f64(obj, "factor")?.ok_or_else(|| cfg_err(format!("rope type {kind:?} needs a factor")));
    match kind {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: get_f64(obj, "low_freq_factor")?
                .ok_or_else(|| cfg_err("llama3 rope needs low_freq_factor"))?,
            high_freq_factor: get_f64(obj, "high_freq_factor")?
                .ok_or_else(|| cfg_err("llama3 rope needs high_freq_factor"))?,
            original_max_position_embeddings: get_usize(obj, "original_max_position_embeddings")?.unwrap_or(max_pos),
        }),
        other => Err(cfg_err(format!("rope type {other:?} is not supported (supported: default, linear, llama3)"))),
    }
}

impl LlamaConfig {
    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<LlamaConfig> {
        let v: Value = serde_json::from_str(text).map_err(|e| cfg_err(format!("invalid JSON: {e}")))?;
        LlamaConfig::from_json(&v)
    }

    /// Reads `path` (a `config.json`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<LlamaConfig> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|e| cfg_err(format!("cannot read {}: {e}", path.display())))?;
        LlamaConfig::from_json_str(&text).map_err(|e| cfg_err(format!("{}: {e}", path.display())))
    }

    /// Reads the fields from a parsed `config.json`.
    pub fn from_json(v: &Value) -> Result<LlamaConfig> {
        if !v.is_object() {
            return Err(cfg_err("config.json must hold a JSON object"));
        }
        let model_type = match v.get("model_type").and_then(|m| m.as_str()) {
            Some("llama") => ModelType::Llama,
            Some("qwen3") => ModelType::Qwen3,
            Some("qwen3_moe") => ModelType::Qwen3Moe,
            Some(other) => {
                return Err(cfg_err(format!(
                    "model_type {other:?} is not supported (supported: llama, qwen3, qwen3_moe)"
                )))
            }
            None => return Err(cfg_err("config.json has no model_type")),
        };
        if let Some(act) = v.get("hidden_act").and_then(|a| a.as_str()) {
            if act != "silu" {
                return Err(cfg_err(format!("hidden_act {act:?} is not supported (only silu)")));
            }
        }
        if get_bool(v, "use_sliding_window")?.unwrap_or(false) {
            return Err(cfg_err("sliding-window attention (use_sliding_window: true) is not supported"));
        }
        let hidden_size = need_usize(v, "hidden_size")?;
        let num_attention_heads = need_usize(v, "num_attention_heads")?;
        if num_attention_heads == 0 {
            return Err(cfg_err("num_attention_heads must be positive"));
        }
        let num_key_value_heads = get_usize(v, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(cfg_err(format!(
                "num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})"
            )));
        }
        let head_dim = get_usize(v, "head_dim")?.unwrap_or(hidden_size / num_attention_heads);
        let default_max = if model_type == ModelType::Llama { 2048 } else { 32768 };
        let max_position_embeddings = get_usize(v, "max_position_embeddings")?.unwrap_or(default_max);
        // transformers 5: "rope_parameters": {"rope_theta", "rope_type", ...};
        // transformers 4 / most Hub files: top-level "rope_theta" and "rope_scaling" (or null).
        let (rope_theta, rope_scaling) = match v.get("rope_parameters") {
            Some(p) if p.is_object() => {
                let theta = get_f64(p, "rope_theta")?.or(get_f64(v, "rope_theta")?).unwrap_or(10000.0);
                (theta, parse_rope(p, max_position_embeddings)?)
            }
            _ => {
                let theta = get_f64(v, "rope_theta")?.unwrap_or(10000.0);
                let scaling = match v.get("rope_scaling") {
                    Some(s) if s.is_object() => parse_rope(s, max_position_embeddings)?,
                    _ => RopeScaling::Default,
                };
                (theta, scaling)
            }
        };
        if let Some(f) = get_f64(v, "partial_rotary_factor")? {
            if f != 1.0 {
                return Err(cfg_err(format!("partial_rotary_factor {f} is not supported (only 1.0)")));
            }
        }
        let torch_dtype =
            v.get("dtype").or_else(|| v.get("torch_dtype")).and_then(|d| d.as_str()).and_then(DType::from_name);
        LlamaConfig {
            model_type,
            vocab_size: need_usize(v, "vocab_size")?,
            hidden_size,
            intermediate_size: need_usize(v, "intermediate_size")?,
            num_hidden_layers: need_usize(v, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: get_f64(v, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: get_bool(v, "tie_word_embeddings")?.unwrap_or(false),
            max_position_embeddings,
            attention_bias: get_bool(v, "attention_bias")?.unwrap_or(false),
            mlp_bias: get_bool(v, "mlp_bias")?.unwrap_or(false),
            attention_dropout: get_f64(v, "attention_dropout")?.unwrap_or(0.0),
            initializer_range: get_f64(v, "initializer_range")?.unwrap_or(0.02),
            bos_token_id: token_ids(v, "bos_token_id")?.first().copied(),
            eos_token_ids: token_ids(v, "eos_token_id")?,
            moe: if model_type == ModelType::Qwen3Moe { Some(MoeConfig::from_json(v)?) } else { None },
            torch_dtype,
            raw: Some(v.clone()),
        }
        .validated()
    }

    fn validated(self) -> Result<LlamaConfig> {
        self.validate()?;
        Ok(self)
    }

    /// The model class this configuration builds (`LlamaForCausalLM`, `Qwen3ForCausalLM`).
    pub fn class_name(&self) -> &'static str {
        match self.model_type {
            ModelType::Llama => "LlamaForCausalLM",
            ModelType::Qwen3 => "Qwen3ForCausalLM",
            ModelType::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// Whether decoder layer `layer` has a sparse mixture-of-experts MLP
    /// (transformers' `Qwen3MoeDecoderLayer` rule).
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| {
            !m.mlp_only_layers.contains(&layer)
                && m.num_experts > 0
                && m.decoder_sparse_step > 0
                && (layer + 1).is_multiple_of(m.decoder_sparse_step)
        })
    }

    /// How many decoder layers are sparse (counted without visiting each
    /// layer, so a hostile layer count cannot stall validation).
    pub fn num_sparse_layers(&self) -> usize {
        let Some(m) = self.moe.as_ref().filter(|m| m.num_experts > 0 && m.decoder_sparse_step > 0) else {
            return 0;
        };
        let mut dense: Vec<usize> = m
            .mlp_only_layers
            .iter()
            .copied()
            .filter(|&l| l < self.num_hidden_layers && (l + 1) % m.decoder_sparse_step == 0)
            .collect();
        dense.sort_unstable();
        dense.dedup();
        self.num_hidden_layers / m.decoder_sparse_step - dense.len()
    }

    /// Checks the configuration on its own, before anything is built from it:
    /// positive sizes, heads that divide, an even head size, finite positive
    /// RoPE base and factors, a finite non-negative norm epsilon, a dropout
    /// probability in `[0, 1]`, and a parameter count that fits the address
    /// space. [`from_json`](LlamaConfig::from_json) and the model constructors call it.
    pub fn validate(&self) -> Result<()> {
        let class = self.class_name();
        let bad = |msg: String| Err(Error::invalid("LlamaConfig", format!("{class}: {msg}")));
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("{key} must be positive, got 0"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim must be even for rotary embeddings, got {}", self.head_dim));
        }
        let positive = |key: &str, v: f64| -> Result<()> {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bad(format!("{key} must be a finite positive number, got {v}"))
            }
        };
        positive("rope_theta", self.rope_theta)?;
        match &self.rope_scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } => positive("the rope factor", *factor)?,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                positive("the rope factor", *factor)?;
                positive("low_freq_factor", *low_freq_factor)?;
                positive("high_freq_factor", *high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return bad(format!(
                        "llama3 rope scaling needs high_freq_factor ({high_freq_factor}) > low_freq_factor ({low_freq_factor})"
                    ));
                }
                if *original_max_position_embeddings == 0 {
                    return bad("original_max_position_embeddings must be positive, got 0".into());
                }
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return bad(format!("rms_norm_eps must be finite and non-negative, got {}", self.rms_norm_eps));
        }
        if !(0.0..=1.0).contains(&self.attention_dropout) {
            return bad(format!("attention_dropout must be in [0, 1], got {}", self.attention_dropout));
        }
        if let Some(m) = &self.moe {
            if m.decoder_sparse_step == 0 {
                return bad("decoder_sparse_step must be positive, got 0".into());
            }
            if m.num_experts > 0 && (m.num_experts_per_tok == 0 || m.num_experts_per_tok > m.num_experts) {
                return bad(format!(
                    "num_experts_per_tok must be in 1..={} (num_experts), got {}",
                    m.num_experts, m.num_experts_per_tok
                ));
            }
            if m.moe_intermediate_size == 0 && m.num_experts > 0 {
                return bad("moe_intermediate_size must be positive, got 0".into());
            }
            if !(m.router_aux_loss_coef.is_finite()) {
                return bad(format!("router_aux_loss_coef must be finite, got {}", m.router_aux_loss_coef));
            }
        }
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return bad(format!("initializer_range must be finite and non-negative, got {}", self.initializer_range));
        }
        match self.num_parameters() {
            Some(n) if n.checked_mul(2).is_some_and(|b| b <= isize::MAX as usize) => Ok(()),
            _ => bad("the sizes describe more parameters than fit in memory".into()),
        }
    }

    /// The number of parameters the configuration describes (`None` when it
    /// does not fit a `usize`).
    pub fn num_parameters(&self) -> Option<usize> {
        let (c, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads.checked_mul(self.head_dim)?,
            self.num_key_value_heads.checked_mul(self.head_dim)?,
        );
        let bias = |n: Option<usize>, on: bool| if on { n } else { Some(0) };
        let attn = [c.checked_mul(q)?, c.checked_mul(kv)?, c.checked_mul(kv)?, q.checked_mul(c)?]
            .into_iter()
            .try_fold(0usize, |a, n| a.checked_add(n))?
            .checked_add(bias(q.checked_add(kv.checked_mul(2)?)?.checked_add(c), self.attention_bias)?)?;
        let dense =
            c.checked_mul(i)?.checked_mul(3)?.checked_add(bias(i.checked_mul(2)?.checked_add(c), self.mlp_bias)?)?;
        // A sparse layer: the router [E, hidden] and E SwiGLU experts of moe_intermediate_size.
        let sparse = match &self.moe {
            Some(m) => m
                .num_experts
                .checked_mul(c)?
                .checked_add(m.num_experts.checked_mul(c.checked_mul(m.moe_intermediate_size)?.checked_mul(3)?)?)?,
            None => 0,
        };
        let norms = c.checked_mul(2)?.checked_add(if self.qk_norm() { self.head_dim.checked_mul(2)? } else { 0 })?;
        let layer = attn.checked_add(norms)?;
        let sparse_layers = self.num_sparse_layers();
        let layers = layer
            .checked_mul(self.num_hidden_layers)?
            .checked_add(dense.checked_mul(self.num_hidden_layers - sparse_layers)?)?
            .checked_add(sparse.checked_mul(sparse_layers)?)?;
        let embed = self.vocab_size.checked_mul(c)?;
        let heads = if self.tie_word_embeddings { 1 } else { 2 };
        embed.checked_mul(heads)?.checked_add(layers)?.checked_add(c)
    }

    /// Whether queries and keys get a per-head RMSNorm (Qwen3, Qwen3-MoE).
    pub fn qk_norm(&self) -> bool {
        matches!(self.model_type, ModelType::Qwen3 | ModelType::Qwen3Moe)
    }

    /// The `config.json` to save with weights of `dtype`: the parsed JSON with
    /// kiln's fields written over it (so unknown fields survive), or a fresh
    /// object in the widely read transformers 4 layout (top-level
    /// `rope_theta` / `rope_scaling`).
    pub fn to_json(&self, dtype: DType) -> Value {
        let mut v = match &self.raw {
            Some(Value::Object(o)) => {
                let mut o = o.clone();
                // What this writes describes dense weights, whatever was read.
                o.remove("quantization_config");
                Value::Object(o)
            }
            _ => json!({}),
        };
        let arch = self.class_name();
        let rope = match &self.rope_scaling {
            RopeScaling::Default => Value::Null,
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                })
            }
        };
        let o = v.as_object_mut().expect("an object");
        let mut set = |k: &str, x: Value| {
            o.insert(k.to_string(), x);
        };
        set("architectures", json!([arch]));
        set("model_type", json!(self.model_type.name()));
        set("vocab_size", json!(self.vocab_size));
        set("hidden_size", json!(self.hidden_size));
        set("intermediate_size", json!(self.intermediate_size));
        set("num_hidden_layers", json!(self.num_hidden_layers));
        set("num_attention_heads", json!(self.num_attention_heads));
        set("num_key_value_heads", json!(self.num_key_value_heads));
        set("head_dim", json!(self.head_dim));
        set("rms_norm_eps", json!(self.rms_norm_eps));
        set("tie_word_embeddings", json!(self.tie_word_embeddings));
        set("max_position_embeddings", json!(self.max_position_embeddings));
        set("attention_bias", json!(self.attention_bias));
        set("attention_dropout", json!(self.attention_dropout));
        set("initializer_range", json!(self.initializer_range));
        set("hidden_act", json!("silu"));
        if self.model_type == ModelType::Llama {
            set("mlp_bias", json!(self.mlp_bias));
        }
        if let Some(m) = &self.moe {
            // transformers 5 writes num_local_experts, the Hub's files num_experts: keep the file's spelling.
            let experts_key = if o_has(&self.raw, "num_local_experts") { "num_local_experts" } else { "num_experts" };
            set(experts_key, json!(m.num_experts));
            set("num_experts_per_tok", json!(m.num_experts_per_tok));
            set("moe_intermediate_size", json!(m.moe_intermediate_size));
            set("norm_topk_prob", json!(m.norm_topk_prob));
            set("decoder_sparse_step", json!(m.decoder_sparse_step));
            set("mlp_only_layers", json!(m.mlp_only_layers));
            set("output_router_logits", json!(m.output_router_logits));
            set("router_aux_loss_coef", json!(m.router_aux_loss_coef));
        }
        let dtype_key = if o_has(&self.raw, "dtype") { "dtype" } else { "torch_dtype" };
        if o_has(&self.raw, "rope_parameters") {
            let mut p = match &rope {
                Value::Object(m) => m.clone(),
                _ => serde_json::Map::from_iter([("rope_type".to_string(), json!("default"))]),
            };
            p.insert("rope_theta".into(), json!(self.rope_theta));
            set("rope_parameters", Value::Object(p));
        } else {
            set("rope_theta", json!(self.rope_theta));
            set("rope_scaling", rope);
        }
        set(dtype_key, json!(dtype.name()));
        v
    }
}

fn o_has(raw: &Option<Value>, key: &str) -> bool {
    raw.as_ref().and_then(|r| r.get(key)).is_some()
}
