//! Loading a pretrained `LlamaForCausalLM` from a Hugging Face directory,
//! dense or quantized ([`PretrainedOptions`], [`QuantizedLoad`]), and keeping
//! quantized weights resident in its Linear layers.
use super::{LlamaConfig, LlamaForCausalLM};
use crate::io::{load_checkpoint_dir, load_quantized, QuantizationConfig, QuantizedWeight};
use crate::layers::Linear;
use crate::module::Module;
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// How [`LlamaForCausalLM::from_pretrained_with`] loads a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PretrainedOptions {
    /// The dtype of the parameters (and of the computation).
    pub dtype: DType,
    pub device: Device,
    /// What happens to the weights of a quantized checkpoint.
    pub quantized: QuantizedLoad,
    /// Accept a checkpoint that quantizes activations too (W8A8, W4A4:
    /// compressed-tensors `input_activations`, ModelOpt NVFP4 / FP8) and run
    /// its quantized weights on float activations. That is not the forward
    /// transformers runs for it (which rounds every Linear's input through
    /// the activation quantizer), so such a checkpoint is an error unless
    /// this is set: "dequantize weights only", explicitly.
    pub weights_only: bool,
}

impl PretrainedOptions {
    /// `dtype` on `device`, quantized weights dequantized exactly, activation
    /// quantization refused.
    pub fn new(dtype: DType, device: Device) -> PretrainedOptions {
        PretrainedOptions {
            dtype,
            device,
            quantized: QuantizedLoad::Dequantize { round_to: None },
            weights_only: false,
        }
    }

    /// With [`PretrainedOptions::quantized`] set.
    pub fn with_quantized(mut self, quantized: QuantizedLoad) -> PretrainedOptions {
        self.quantized = quantized;
        self
    }

    /// With [`PretrainedOptions::weights_only`] set.
    pub fn with_weights_only(mut self, on: bool) -> PretrainedOptions {
        self.weights_only = on;
        self
    }
}

/// The two ways to load a quantized checkpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QuantizedLoad {
    /// Dequantize every quantized weight on load (exactly, in float32; then
    /// rounded to `round_to` when given, e.g. bfloat16 as compressed-tensors
    /// decompresses; then converted to the model's dtype): a dense model, for
    /// fine-tuning from a quantized checkpoint.
    Dequantize { round_to: Option<DType> },
    /// Keep the weights quantized (codes and block scales resident, see
    /// [`Linear::quantize_weight`]); their layers multiply with a
    /// dequantizing matmul and are frozen.
    Keep,
}

impl LlamaForCausalLM {
    /// Loads a Hugging Face model directory: `config.json` plus
    /// `model.safetensors` or a sharded `model.safetensors.index.json`.
    /// `dir` may also be a repo id (`"Qwen/Qwen3-0.6B"`) that is not a
    /// directory: its `main` snapshot in the Hugging Face cache is loaded,
    /// with no network (Note [The Hugging Face cache]; for another revision,
    /// pass the directory from [`crate::io::hub::resolve_in`]).
    /// Floating-point weights are converted to `dtype` and placed on `device`.
    /// A quantized checkpoint (FP8, MXFP4, NVFP4: Note [Reading quantized
    /// checkpoints]) is dequantized exactly into `dtype`; see
    /// [`LlamaForCausalLM::from_pretrained_with`] to keep it quantized.
    /// Like transformers, the model starts in evaluation mode (call
    /// `train(true)` before fine-tuning with dropout); parameters require grad.
    pub fn from_pretrained(dir: impl AsRef<Path>, dtype: DType, device: Device) -> Result<LlamaForCausalLM> {
        LlamaForCausalLM::from_pretrained_with(dir, &PretrainedOptions::new(dtype, device))
    }

    /// [`LlamaForCausalLM::from_pretrained`] with the options for quantized
    /// checkpoints.
    pub fn from_pretrained_with(dir: impl AsRef<Path>, opts: &PretrainedOptions) -> Result<LlamaForCausalLM> {
        let t = std::time::Instant::now();
        let dir = &crate::io::hub::resolve_model(dir.as_ref(), "main")?;
        let (dtype, device) = (opts.dtype, opts.device);
        if !dtype.is_float() || dtype.is_float8() {
            return Err(Error::dtype(
                "from_pretrained",
                format!("a model computes in float16, bfloat16, float32 or float64, not {dtype} (float8 weights load through a quantized checkpoint)"),
            ));
        }
        let config = LlamaConfig::from_file(dir.join("config.json"))?;
        let at = |e: Error| Error::invalid("from_pretrained", format!("{}: {e}", dir.display()));
        let mut model = match QuantizationConfig::from_dir(dir)? {
            None => {
                let weights = load_checkpoint_dir(dir, Some(dtype), device)?;
                LlamaForCausalLM::from_weights(&config, &weights, dtype, device).map_err(at)?
            }
            Some(q) => {
                if let (Some(a), false) = (&q.activations, opts.weights_only) {
                    return Err(Error::invalid(
                        "from_pretrained",
                        format!(
                            "{}: the checkpoint quantizes activations too ({a}); kiln runs quantized weights on float activations, which is not the forward transformers runs for it. Load it with PretrainedOptions::weights_only (hf_check --weights-only) to dequantize the weights only",
                            dir.display()
                        ),
                    ));
                }
                let ck = load_quantized(dir, &q, None)?;
                match opts.quantized {
                    QuantizedLoad::Dequantize { round_to } => {
                        let weights = ck.dequantized(round_to)?;
                        LlamaForCausalLM::from_weights(&config, &weights, dtype, device).map_err(at)?
                    }
                    QuantizedLoad::Keep => {
                        // The quantized weights enter as one-element placeholders of their
                        // shape (never materialised), then become codes and scales.
                        let mut weights = ck.plain.clone();
                        for (module, q) in &ck.quantized {
                            let dims: Vec<isize> = q.shape.iter().map(|&d| d as isize).collect();
                            let p = Tensor::zeros(&[], (dtype, device))?.expand(&dims)?;
                            weights.insert(format!("{module}.weight"), p);
                        }
                        let mut m = LlamaForCausalLM::from_weights(&config, &weights, dtype, device).map_err(at)?;
                        m.keep_quantized(&ck.quantized, device).map_err(at)?;
                        m
                    }
                }
            }
        };
        model.eval();
        tracing::info!(
            target: "kiln::load",
            dir = %dir.display(),
            parameters = model.num_parameters(),
            dtype = %dtype,
            device = %device,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "loaded a pretrained model"
        );
        Ok(model)
    }

    /// Every Linear layer with its Hugging Face module name.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = vec![];
        for (i, l) in self.model.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            let a = &mut l.self_attn;
            for (n, lin) in [
                ("self_attn.q_proj", &mut a.q_proj),
                ("self_attn.k_proj", &mut a.k_proj),
                ("self_attn.v_proj", &mut a.v_proj),
                ("self_attn.o_proj", &mut a.o_proj),
            ] {
                out.push((format!("{p}.{n}"), lin));
            }
            for (n, lin) in l.mlp.linears_mut() {
                out.push((format!("{p}.mlp.{n}"), lin));
            }
        }
        if let Some(h) = self.lm_head.as_mut() {
            out.push(("lm_head".to_string(), h));
        }
        out
    }

    /// Keeps the given weights quantized (module name -> codes and scales):
    /// each named Linear's weight is replaced by its quantized form on
    /// `device` (see [`Linear::quantize_weight`]). A name the model has no
    /// Linear for is an error.
    pub fn keep_quantized(&mut self, weights: &BTreeMap<String, QuantizedWeight>, device: Device) -> Result<()> {
        let mut left: BTreeSet<&str> = weights.keys().map(|k| k.as_str()).collect();
        for (name, lin) in self.linears_mut() {
            if let Some(q) = weights.get(&name) {
                lin.quantize_weight(q.spec.clone(), q.codes.clone(), q.scales.clone(), device)?;
                left.remove(name.as_str());
            }
        }
        if !left.is_empty() {
            let names: Vec<&str> = left.into_iter().collect();
            return Err(Error::invalid(
                "keep_quantized",
                format!("quantized weights for modules that are not Linear layers of the model: {}", names.join(", ")),
            ));
        }
        Ok(())
    }
}
