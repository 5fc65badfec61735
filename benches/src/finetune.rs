//! `kiln-bench train --finetune lora|qlora`: the train benchmark's model
//! adapted before its steps. LoRA puts PEFT-default adapters (rank `r`,
//! `lora_alpha = 2r`, `"all-linear"`) on every decoder Linear and freezes the
//! rest; QLoRA first keeps the decoder Linear layers quantized in memory
//! (`kiln::nn::quantize::quantize_model`, codes and block scales only), so
//! the adapters train over a low-bit base. The line then reports the
//! trainable parameters, the optimizer state they need, and the resident
//! memory after the steps beside the peak.
use crate::report::{sig4, Line};
use kiln::nn::lora::{inject_adapter, LoraConfig, TargetModules};
use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::module::Module;
use kiln::nn::quantize::{quantize_model, QuantScheme};
use kiln::Result;

/// How the benchmark's model is fine-tuned.
#[derive(Debug, Clone, PartialEq)]
pub enum Finetune {
    /// Every parameter trains.
    Full,
    /// LoRA adapters of rank `r`.
    Lora { r: usize },
    /// LoRA adapters of rank `r` over decoder weights kept in `scheme`.
    Qlora { r: usize, scheme: String },
}

impl Finetune {
    /// `full`, `lora` or `qlora` (with `--lora-r` and `--qlora-scheme`).
    pub fn parse(method: &str, r: usize, scheme: &str) -> std::result::Result<Finetune, String> {
        match method {
            "full" => Ok(Finetune::Full),
            "lora" => Ok(Finetune::Lora { r }),
            "qlora" => Ok(Finetune::Qlora { r, scheme: scheme.to_string() }),
            other => Err(format!("--finetune {other}: expected full, lora or qlora")),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Finetune::Full => "full",
            Finetune::Lora { .. } => "lora",
            Finetune::Qlora { .. } => "qlora",
        }
    }
}

/// Quantizes (QLoRA) and adapts (LoRA, QLoRA) `model` in place.
pub fn prepare(model: &mut LlamaForCausalLM, how: &Finetune) -> Result<()> {
    let r = match how {
        Finetune::Full => return Ok(()),
        Finetune::Lora { r } => *r,
        Finetune::Qlora { r, scheme } => {
            quantize_model(model, QuantScheme::parse(scheme)?)?;
            *r
        }
    };
    let mut c = LoraConfig::new(r, TargetModules::AllLinear);
    c.lora_alpha = 2.0 * r as f64;
    inject_adapter(model, &c)?;
    Ok(())
}

/// The fine-tuning fields of a train line: the method, trainable and total
/// parameters, AdamW's state for the trainable ones (two float32 moments
/// each), the bytes of the model's tensors (quantized codes and scales
/// included), and the resident memory now.
pub fn fields(l: Line, model: &mut LlamaForCausalLM, how: &Finetune) -> Result<Line> {
    let trainable: usize = model.named_trainable_parameters().iter().map(|(_, t)| t.numel()).sum();
    let mut weight_bytes = 0usize;
    model.visit_params("", &mut |_, t| weight_bytes += t.numel() * t.dtype().size_in_bytes());
    model.visit_linears_mut("", &mut |_, lin| {
        if let Some((_, codes, scales)) = lin.quantized_weight() {
            weight_bytes += [codes, scales].iter().map(|t| t.numel() * t.dtype().size_in_bytes()).sum::<usize>();
        }
        Ok(())
    })?;
    let l = l
        .set("finetune", how.name())
        .set("trainable_params", trainable)
        .set("total_params", model.num_parameters())
        .set("optimizer_state_mb", sig4((trainable * 8) as f64 / 1048576.0))
        .set("weights_mb", sig4(weight_bytes as f64 / 1048576.0))
        .set("rss_mb", sig4(crate::llm::proc_status_mb("VmRSS:")));
    Ok(match how {
        Finetune::Full => l,
        Finetune::Lora { r } => l.set("lora_r", *r),
        Finetune::Qlora { r, scheme } => l.set("lora_r", *r).set("qlora_scheme", scheme.as_str()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::tests::tiny;

    fn line(how: Finetune) -> Line {
        crate::llm::train(&crate::llm::LlmArgs { finetune: how, ..tiny() }).unwrap()
    }

    #[test]
    fn lora_trains_rank_r_adapters_and_qlora_shrinks_the_base() {
        let _g = crate::llm::tests::rng_lock();
        let full = line(Finetune::Full);
        let lora = line(Finetune::Lora { r: 16 });
        let qlora = line(Finetune::Qlora { r: 16, scheme: "nvfp4".into() });
        let n = |l: &Line, k: &str| l.get(k).and_then(|v| v.as_f64()).unwrap();
        assert_eq!(n(&full, "trainable_params"), n(&full, "total_params"));
        // llama-tiny: r * (in + out) for q, k, v, o (64 -> 64, 32, 32, 64) and gate, up, down (64 <-> 128), two layers.
        let per_layer = 16 * (128 + 96 + 96 + 128 + 192 * 3);
        assert_eq!(n(&lora, "trainable_params"), (2 * per_layer) as f64);
        assert_eq!(n(&qlora, "trainable_params"), (2 * per_layer) as f64);
        assert!(n(&lora, "optimizer_state_mb") < n(&full, "optimizer_state_mb"));
        assert!(n(&qlora, "weights_mb") < n(&lora, "weights_mb"));
    }
}
