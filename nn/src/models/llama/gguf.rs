//! Llama and Qwen3 models in GGUF files (Note [GGUF models]):
//! [`LlamaForCausalLM::from_gguf`] and [`LlamaForCausalLM::save_gguf`].
//!
// Note [GGUF models]
// ~~~~~~~~~~~~~~~~~~
// llama.cpp's files name the architecture (`general.architecture`: `llama`,
// `qwen3`) and prefix its settings with it:
//
// | GGUF key ({arch}.)                    | config.json            |
// |---------------------------------------|------------------------|
// | block_count                           | num_hidden_layers      |
// | embedding_length                      | hidden_size            |
// | feed_forward_length                   | intermediate_size      |
// | attention.head_count / head_count_kv  | num_attention_heads / num_key_value_heads |
// | attention.key_length                  | head_dim (= value_length = rope.dimension_count) |
// | attention.layer_norm_rms_epsilon      | rms_norm_eps           |
// | rope.freq_base                        | rope_theta             |
// | rope.scaling.type / .factor (linear)  | rope_scaling           |
// | context_length                        | max_position_embeddings |
// | tokenizer.ggml.bos/eos_token_id       | bos/eos_token_id       |
//
// and its tensors `token_embd`, `output_norm`, `output` (absent when the
// embedding is tied) and `blk.{i}.{attn_norm, attn_q, attn_k, attn_v,
// attn_output, attn_q_norm, attn_k_norm, ffn_norm, ffn_gate, ffn_up,
// ffn_down}` (`LAYER_NAMES` below).
//
// RoPE: transformers rotates the halves of a head (`rotate_half`, llama.cpp's
// NEOX mode), llama.cpp's `llama` architecture rotates adjacent pairs, so its
// converter permutes the rows of `q_proj` and `k_proj` (weight and bias) in
// each head: HF row `j·d/2 + i` becomes GGUF row `2i + j`. kiln undoes that
// on load and does it on save for `llama`; `qwen3` uses NEOX mode and is
// stored as is. The float32 settings (eps, theta) are read as the decimal
// they print as (1e-5, not 9.99999974e-6), which is what the converter wrote.
// Not read (a clear error): Llama 3.1's `rope_freqs` scaling factors, YaRN,
// partial rotary dimensions, Qwen3-MoE's stacked expert tensors.
use super::{LlamaForCausalLM, PretrainedOptions, QuantizedLoad};
use crate::io::gguf::{save_gguf, GgmlType, GgufFile, GgufTensor, GgufValue};
use crate::io::QuantizedWeight;
use crate::models::{LlamaConfig, ModelType};
use crate::module::Module;
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// GGUF name → Hugging Face name of a decoder layer's tensors.
const LAYER_NAMES: [(&str, &str); 17] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_output.bias", "self_attn.o_proj.bias"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("ffn_gate.bias", "mlp.gate_proj.bias"),
    ("ffn_up.bias", "mlp.up_proj.bias"),
];

/// GGUF name → Hugging Face name of the tensors outside the layers.
const GLOBAL_NAMES: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

fn err(msg: impl Into<String>) -> Error {
    Error::invalid("gguf model", msg)
}

/// Tensor `name` in the other naming, GGUF to Hugging Face (`to_hf`) or
/// back, if it is one kiln maps.
fn rename(name: &str, to_hf: bool) -> Option<String> {
    let pick = |&(g, hf): &(&'static str, &'static str)| if to_hf { (g, hf) } else { (hf, g) };
    if let Some((_, to)) = GLOBAL_NAMES.iter().map(pick).find(|(from, _)| *from == name) {
        return Some(to.to_string());
    }
    let (prefix, out_prefix) = if to_hf { ("blk.", "model.layers.") } else { ("model.layers.", "blk.") };
    let (layer, field) = name.strip_prefix(prefix)?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, to) = LAYER_NAMES.iter().map(pick).find(|(from, _)| *from == field)?;
    Some(format!("{out_prefix}{layer}.{to}"))
}

/// The architecture name llama.cpp gives a model type.
fn arch_name(t: ModelType) -> Result<&'static str> {
    match t {
        ModelType::Llama => Ok("llama"),
        ModelType::Qwen3 => Ok("qwen3"),
        ModelType::Qwen3Moe => Err(err("Qwen3-MoE models are not read from or written to GGUF yet")),
    }
}

/// A float32 setting as the decimal it prints as (Note [GGUF models]).
fn decimal(v: &GgufValue) -> Option<f64> {
    match v {
        GgufValue::F32(x) => x.to_string().parse().ok(),
        other => other.as_f64(),
    }
}

/// Whether the rows of `q_proj` / `k_proj` are permuted for pairwise RoPE
/// in this architecture's files (Note [GGUF models]).
fn permutes_qk(t: ModelType) -> bool {
    match t {
        ModelType::Llama => true,
        ModelType::Qwen3 | ModelType::Qwen3Moe => false,
    }
}

/// `w` (`[heads·d, ...]`) with each head's rows reordered: `to_gguf`, HF row
/// `j·d/2 + i` to row `2i + j`; otherwise back.
fn permute_heads(w: &Tensor, heads: usize, to_gguf: bool) -> Result<Tensor> {
    let shape = w.shape().to_vec();
    let d = shape[0] / heads;
    if d * heads != shape[0] || !d.is_multiple_of(2) {
        return Err(err(format!("cannot split {} rows into {heads} heads of an even size", shape[0])));
    }
    let rest: Vec<isize> = shape[1..].iter().map(|&s| s as isize).collect();
    let (a, b) = if to_gguf { (2, d / 2) } else { (d / 2, 2) };
    let split: Vec<isize> = [heads as isize, a as isize, b as isize].into_iter().chain(rest.iter().copied()).collect();
    let whole: Vec<isize> = shape.iter().map(|&s| s as isize).collect();
    w.reshape(&split)?.transpose(1, 2)?.contiguous()?.reshape(&whole)
}

impl LlamaConfig {
    /// The configuration of the model in GGUF file `f` (Note [GGUF models]).
    pub fn from_gguf(f: &GgufFile) -> Result<LlamaConfig> {
        let arch = f
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| err(format!("{}: no general.architecture", f.path().display())))?;
        let model_type = match arch {
            "llama" => "llama",
            "qwen3" => "qwen3",
            other => {
                return Err(err(format!(
                    "{}: architecture {other:?} is not supported (kiln reads llama and qwen3)",
                    f.path().display()
                )))
            }
        };
        let key = |k: &str| f.get(&format!("{arch}.{k}"));
        let need = |k: &str| {
            key(k).and_then(|v| v.as_usize()).ok_or_else(|| err(format!("{}: no {arch}.{k}", f.path().display())))
        };
        if f.info("rope_freqs.weight").is_some() {
            return Err(err("rope_freqs.weight (Llama 3.1's RoPE scaling factors) is not read yet"));
        }
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let head_dim = key("attention.key_length").and_then(|v| v.as_usize()).unwrap_or(hidden / heads.max(1));
        for k in ["attention.value_length", "rope.dimension_count"] {
            if let Some(v) = key(k).and_then(|v| v.as_usize()).filter(|&v| v != head_dim) {
                return Err(err(format!("{arch}.{k} = {v} differs from the head size {head_dim}; not supported")));
            }
        }
        let vocab = match key("vocab_size").and_then(|v| v.as_usize()) {
            Some(v) => v,
            None => f
                .info("token_embd.weight")
                .map(|i| i.shape[0])
                .ok_or_else(|| err("no token_embd.weight and no vocab_size"))?,
        };
        let rope_scaling = match key("rope.scaling.type").and_then(|v| v.as_str()) {
            None | Some("none") => Value::Null,
            Some("linear") => json!({"rope_type": "linear", "factor": key("rope.scaling.factor").and_then(decimal)}),
            Some(other) => return Err(err(format!("RoPE scaling {other:?} is not supported (none, linear)"))),
        };
        let token = |k: &str| f.get(&format!("tokenizer.ggml.{k}")).and_then(|v| v.as_usize());
        let v = json!({
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": need("feed_forward_length")?,
            "num_hidden_layers": need("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": key("attention.head_count_kv").and_then(|v| v.as_usize()).unwrap_or(heads),
            "head_dim": head_dim,
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon").and_then(decimal)
                .ok_or_else(|| err(format!("no {arch}.attention.layer_norm_rms_epsilon")))?,
            "rope_theta": key("rope.freq_base").and_then(decimal).unwrap_or(10000.0),
            "rope_scaling": rope_scaling,
            "max_position_embeddings": key("context_length").and_then(|v| v.as_usize()).unwrap_or(2048),
            "tie_word_embeddings": f.info("output.weight").is_none(),
            "attention_bias": f.info("blk.0.attn_q.bias").is_some(),
            "mlp_bias": f.info("blk.0.ffn_up.bias").is_some(),
            "bos_token_id": token("bos_token_id"),
            "eos_token_id": token("eos_token_id"),
        });
        LlamaConfig::from_json(&v)
    }

    /// The GGUF metadata of this configuration (Note [GGUF models]).
    fn gguf_metadata(&self) -> Result<Vec<(String, GgufValue)>> {
        let arch = arch_name(self.model_type)?;
        let u32v = |n: usize| -> Result<GgufValue> {
            u32::try_from(n).map(GgufValue::U32).map_err(|_| err(format!("{n} does not fit GGUF's u32")))
        };
        let mut m: Vec<(String, GgufValue)> = vec![("general.architecture".into(), GgufValue::String(arch.into()))];
        let mut put = |k: &str, v: GgufValue| m.push((format!("{arch}.{k}"), v));
        put("context_length", u32v(self.max_position_embeddings)?);
        put("embedding_length", u32v(self.hidden_size)?);
        put("block_count", u32v(self.num_hidden_layers)?);
        put("feed_forward_length", u32v(self.intermediate_size)?);
        put("attention.head_count", u32v(self.num_attention_heads)?);
        put("attention.head_count_kv", u32v(self.num_key_value_heads)?);
        put("attention.key_length", u32v(self.head_dim)?);
        put("attention.value_length", u32v(self.head_dim)?);
        put("rope.dimension_count", u32v(self.head_dim)?);
        put("rope.freq_base", GgufValue::F32(self.rope_theta as f32));
        put("attention.layer_norm_rms_epsilon", GgufValue::F32(self.rms_norm_eps as f32));
        put("vocab_size", u32v(self.vocab_size)?);
        match &self.rope_scaling {
            crate::layers::RopeScaling::Default => {}
            crate::layers::RopeScaling::Linear { factor } => {
                put("rope.scaling.type", GgufValue::String("linear".into()));
                put("rope.scaling.factor", GgufValue::F32(*factor as f32));
            }
            crate::layers::RopeScaling::Llama3 { .. } => {
                return Err(err("Llama 3.1's RoPE scaling is not written to GGUF yet"));
            }
        }
        Ok(m)
    }
}

impl LlamaForCausalLM {
    /// Loads a Llama or Qwen3 model from a GGUF file (llama.cpp's format:
    /// Note [GGUF models]), every tensor dequantized exactly (Note [GGUF
    /// blocks]) and converted to `dtype` on `device`. The file's tokenizer
    /// is not part of the model; see `kiln::nn::data::HfTokenizer::from_gguf`.
    ///
    /// ```no_run
    /// use kiln::prelude::*;
    /// use kiln::nn::models::LlamaForCausalLM;
    /// let model = LlamaForCausalLM::from_gguf("qwen3-0.6b-q8_0.gguf", DType::F32, Device::Cpu)?;
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn from_gguf(path: impl AsRef<Path>, dtype: DType, device: Device) -> Result<LlamaForCausalLM> {
        LlamaForCausalLM::from_gguf_with(path, &PretrainedOptions::new(dtype, device))
    }

    /// [`LlamaForCausalLM::from_gguf`] with `opts.quantized`:
    /// `QuantizedLoad::Keep` keeps the matrices of the Linear layers packed
    /// when their type is an integer one (Q8_0, Q5_0, Q6_K, Q3_K as int8
    /// codes, Q4_0 as int4: exactly the weights llama.cpp computes with; the
    /// products decode them in the registers), the LM head included, which a
    /// tied model takes from the embedding table as llama.cpp does (the
    /// lookup keeps a dense copy). Types with a per-block minimum (Q4_K,
    /// Q5_K, Q2_K, Q4_1, Q5_1) and the float types are dequantized.
    /// `QuantizedLoad::Dequantize { round_to }` rounds the dequantized values
    /// of quantized types to `round_to` before the dtype, as for
    /// safetensors checkpoints; `weights_only` has nothing to permit (GGUF
    /// files quantize no activations).
    pub fn from_gguf_with(path: impl AsRef<Path>, opts: &PretrainedOptions) -> Result<LlamaForCausalLM> {
        let (dtype, device) = (opts.dtype, opts.device);
        let f = GgufFile::open(path)?;
        let config = LlamaConfig::from_gguf(&f)?;
        let keep = opts.quantized == QuantizedLoad::Keep;
        let heads = |name: &str| -> Option<usize> {
            if !permutes_qk(config.model_type) {
                None
            } else if name.contains(".self_attn.q_proj.") {
                Some(config.num_attention_heads)
            } else if name.contains(".self_attn.k_proj.") {
                Some(config.num_key_value_heads)
            } else {
                None
            }
        };
        let mut weights = BTreeMap::new();
        let mut packed = BTreeMap::new();
        let mut unknown = vec![];
        for info in f.tensor_infos() {
            let Some(name) = rename(&info.name, true) else {
                unknown.push(info.name.clone());
                continue;
            };
            let linear = name.strip_suffix(".weight").filter(|m| *m == "lm_head" || m.ends_with("_proj"));
            if let (true, Some(module)) = (keep, linear) {
                if let Some(mut q) = f.packed_weight(&info.name)? {
                    if let Some(h) = heads(&name) {
                        q = QuantizedWeight::new(
                            q.spec.clone(),
                            permute_heads(&q.codes, h, false)?,
                            permute_heads(&q.scales, h, false)?,
                        )?;
                    }
                    // A placeholder of the weight's shape, never materialised.
                    let dims: Vec<isize> = q.shape.iter().map(|&d| d as isize).collect();
                    weights.insert(name.clone(), Tensor::zeros(&[], (dtype, device))?.expand(&dims)?);
                    packed.insert(module.to_string(), q);
                    continue;
                }
            }
            let mut t = match (opts.quantized, info.ggml_type.is_quantized()) {
                // A quantized type dequantized exactly, rounded to `round_to`, then to the dtype.
                (QuantizedLoad::Dequantize { round_to: Some(r) }, true) => {
                    f.tensor(&info.name, Some(r), Device::Cpu)?.to_dtype(dtype)?
                }
                _ => f.tensor(&info.name, Some(dtype), Device::Cpu)?,
            };
            if let Some(h) = heads(&name) {
                t = permute_heads(&t, h, false)?;
            }
            weights.insert(name, t.to_device(device)?);
        }
        if !unknown.is_empty() {
            return Err(err(format!("{}: tensors kiln does not map: {unknown:?}", f.path().display())));
        }
        let mut model = LlamaForCausalLM::from_weights(&config, &weights, dtype, device)?;
        if keep && config.tie_word_embeddings {
            if let Some(q) = f.packed_weight("token_embd.weight")? {
                let table = model.output_weight().ok_or_else(|| err("a tied model without its table"))?.clone();
                model.lm_head = Some(crate::layers::Linear::from_weights(table.detach(), None)?);
                packed.insert("lm_head".to_string(), q);
            }
        }
        model.keep_quantized(&packed, device)?;
        model.eval();
        Ok(model)
    }

    /// Writes the model as a GGUF file that llama.cpp runs (Note [GGUF
    /// models]): its settings, `metadata` after them (e.g. a tokenizer's
    /// `tokenizer.ggml.*` keys; without a `tokenizer.ggml.model`, `"none"`
    /// is written and callers feed token ids), the matrices stored as
    /// `weight_type` (F32, F16, BF16, Q8_0 or Q4_0) and the norms in F32, as
    /// llama.cpp's converter does. Atomic; a model that keeps weights
    /// quantized is an error (load it dequantized).
    pub fn save_gguf(
        &self,
        path: impl AsRef<Path>,
        weight_type: GgmlType,
        metadata: &[(String, GgufValue)],
    ) -> Result<()> {
        if self.has_quantized_weights() {
            return Err(err("the model keeps some weights quantized; load it dequantized to write GGUF"));
        }
        let config = self.config();
        let mut meta = config.gguf_metadata()?;
        let file_type = match weight_type {
            GgmlType::F32 => 0u32,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q8_0 => 7,
            GgmlType::BF16 => 32,
            other => return Err(err(format!("kiln writes F32, F16, BF16, Q8_0 and Q4_0 weights, not {other}"))),
        };
        meta.push(("general.file_type".into(), GgufValue::U32(file_type)));
        if let Some(id) = config.bos_token_id.and_then(|i| u32::try_from(i).ok()) {
            meta.push(("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(id)));
        }
        if let Some(id) = config.eos_token_ids.first().and_then(|&i| u32::try_from(i).ok()) {
            meta.push(("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(id)));
        }
        if !metadata.iter().any(|(k, _)| k == "tokenizer.ggml.model") {
            meta.push(("tokenizer.ggml.model".into(), GgufValue::String("none".into())));
        }
        meta.retain(|(k, _)| !metadata.iter().any(|(k2, _)| k2 == k));
        meta.extend(metadata.iter().cloned());
        let mut tensors = vec![];
        for (name, t) in self.state_dict() {
            if config.tie_word_embeddings && name == "lm_head.weight" {
                continue;
            }
            let g = rename(&name, false).ok_or_else(|| err(format!("{name} has no GGUF name")))?;
            let mut t = t.detach();
            if permutes_qk(config.model_type) {
                if name.contains(".self_attn.q_proj.") {
                    t = permute_heads(&t, config.num_attention_heads, true)?;
                } else if name.contains(".self_attn.k_proj.") {
                    t = permute_heads(&t, config.num_key_value_heads, true)?;
                }
            }
            let ty = if t.ndim() == 2 { weight_type } else { GgmlType::F32 };
            tensors.push((g, t, ty));
        }
        // llama.cpp's order: the embedding, the layers in order, the rest.
        let key = |g: &str| -> (usize, usize, String) {
            match g.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
                Some((i, rest)) => (1, i.parse().unwrap_or(0), rest.to_string()),
                None => (if g == "token_embd.weight" { 0 } else { 2 }, 0, g.to_string()),
            }
        };
        tensors.sort_by_key(|(g, _, _)| key(g));
        let tensors: Vec<GgufTensor> = tensors.into_iter().map(|(g, t, ty)| GgufTensor::new(g, t, ty)).collect();
        save_gguf(path, &meta, &tensors)
    }
}
