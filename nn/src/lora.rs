//! LoRA adapters as Hugging Face PEFT makes, trains, saves and merges them:
//! [`inject_adapter`] puts an adapter on every `Linear` a [`LoraConfig`]
//! selects and freezes the rest of the model; [`save_adapter`] and
//! [`load_adapter`] read and write PEFT's `adapter_config.json` +
//! `adapter_model.safetensors`; [`merge_adapter`], [`unmerge_adapter`] and
//! [`merge_and_unload`] fold the adapters into the weights and back.
//!
//! ```
//! use kiln::nn::lora::{inject_adapter, LoraConfig, TargetModules};
//! use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
//! use kiln::nn::module::Module;
//! use kiln::prelude::*;
//! kiln::manual_seed(0);
//! let cfg = LlamaConfig::from_json_str(r#"{"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
//!     "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#)?;
//! let mut model = LlamaForCausalLM::new(&cfg, DType::F32)?;
//! let config = LoraConfig::new(4, TargetModules::Names(vec!["q_proj".into(), "v_proj".into()]));
//! let adapted = inject_adapter(&mut model, &config)?;
//! assert_eq!(adapted[0], "model.layers.0.self_attn.q_proj");
//! // Only the adapters train: A [4, hidden] and B [out, 4] on q_proj and v_proj of every layer.
//! let trainable = model.named_trainable_parameters();
//! assert!(trainable.iter().all(|(n, _)| n.contains(".lora_A.") || n.contains(".lora_B.")));
//! # Ok::<(), kiln::Error>(())
//! ```

// Note [LoRA adapters]
// ~~~~~~~~~~~~~~~~~~~~
// An adapter lives in the `Linear` it adapts (`Linear::set_adapter`), so
// every model built from `Linear`s takes adapters without knowing about
// them, in every mode (eager, `kiln::compile`, PJRT) and with a kept-
// quantized base (QLoRA: the base product dequantizes block by block and
// the input still gets its gradient, so the adapters train through it).
// The layer computes `W x + b + scaling * B(A(dropout(x)))` as PEFT does:
// the input is cast to the adapter's dtype and the sum taken in the wider
// dtype and cast back. PEFT multiplies `B`'s output by the scaling; kiln
// multiplies `A`'s rank-r output, which is bit-equal for a power-of-two
// scaling (alpha / r = 2, the common choice) and otherwise differs by a
// rounding, and keeps one full-width tensor fewer for backward (every op's
// inputs are kept until backward). Adapters
// are kept in f32 over a bf16/f16 base (PEFT's `autocast_adapter_dtype`).
// The adapter's parameters are named inside the layer's, `….q_proj.lora_A
// .weight`; PEFT's files put `base_model.model.` in front (the adapter
// name `default` is never written), and the base weight keeps its plain
// name in kiln (PEFT's `base_layer` exists only in its module tree).
// Merging adds `scaling * B @ A` (computed in f32) into the weight in
// place and marks the adapter merged, so the forward does not add it
// twice; unmerging subtracts the same product.
use crate::io::{load_safetensors, save_safetensors, write_atomic};
use crate::layers::Linear;
use crate::module::Module;
use kiln_tensor::{DType, Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

mod adapter;
mod config;
pub(crate) mod serve;

pub use adapter::{LoraAdapter, LoraInit, MAGNITUDE};
pub use config::{LoraConfig, TargetModules};
pub use serve::{load_served_adapter, with_routing, AdapterRouting};

/// PEFT's adapter configuration file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The prefix PEFT's files put in front of the model's parameter names.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The names of every `Linear` of `model` (see [`Module::visit_linears_mut`]).
fn linear_names(model: &mut dyn Module) -> Result<Vec<String>> {
    let mut names = vec![];
    model.visit_linears_mut("", &mut |n, _| {
        names.push(n.to_string());
        Ok(())
    })?;
    Ok(names)
}

/// The module names of `model`'s parameters: every dotted prefix of a
/// parameter's name.
fn module_names(model: &dyn Module) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    model.visit_params("", &mut |n, _| {
        let mut rest = n;
        while let Some((m, _)) = rest.rsplit_once('.') {
            out.insert(m.to_string());
            rest = m;
        }
    });
    out
}

/// The `Linear` layers of `model` that `config` selects (PEFT's rules), and
/// the problems that make the selection impossible to honour: a selected
/// module that is not a `Linear` kiln can adapt, or nothing selected.
fn select(model: &mut dyn Module, config: &LoraConfig) -> Result<(Vec<String>, Vec<String>)> {
    config.validate()?;
    let linears = linear_names(model)?;
    let linear_set: BTreeSet<&str> = linears.iter().map(String::as_str).collect();
    // "all-linear": the last name of every Linear but the output layer.
    let mut all_linear: Vec<String> =
        linears.iter().map(|n| n.rsplit('.').next().unwrap_or(n).to_string()).filter(|n| n != "lm_head").collect();
    all_linear.sort();
    all_linear.dedup();
    let selector = config.selector(&all_linear)?;
    let selected: Vec<String> = linears.iter().filter(|n| selector.selects(n)).cloned().collect();
    let mut problems = vec![];
    // A selected module that is not a Linear reached by the walk (a norm, a
    // block, an expert of a stacked layer, a hand-written module's layer).
    for m in module_names(model) {
        let inside_linear = linears.iter().any(|l| m.starts_with(&format!("{l}.")));
        if !inside_linear && !linear_set.contains(m.as_str()) && selector.selects(&m) {
            problems.push(format!("{m} matches target_modules but is not a Linear layer kiln can adapt"));
        }
    }
    if selected.is_empty() && problems.is_empty() {
        problems.push(format!("target_modules {:?} matched no module of the model", config.target_modules));
    }
    Ok((selected, problems))
}

/// Puts a fresh adapter (drawn as `config.init_lora_weights` says, from the
/// global generator) on every `Linear` of `model` that `config` selects
/// (PEFT's rules: [`TargetModules`], `exclude_modules`, `rank_pattern`,
/// `alpha_pattern`), and freezes every other parameter but those of
/// `modules_to_save` (PEFT's `get_peft_model`). Returns the adapted layers'
/// names, in the model's order.
///
/// Errors, with nothing changed: a selected module that is not a `Linear`
/// kiln can adapt, a selection that matches nothing, a layer that already
/// has an adapter, a `modules_to_save` entry that names no module.
pub fn inject_adapter(model: &mut dyn Module, config: &LoraConfig) -> Result<Vec<String>> {
    inject(model, config, Some(config.init_lora_weights))
}

/// [`inject_adapter`]; with `init` `None` the adapters are zero (about to
/// be overwritten by a load).
fn inject(model: &mut dyn Module, config: &LoraConfig, init: Option<LoraInit>) -> Result<Vec<String>> {
    let err = |m: String| Error::invalid("inject_adapter", m);
    let (selected, mut problems) = select(model, config)?;
    problems.extend(selected.iter().filter_map(|n| config.rank_and_scaling(n).err().map(|e| e.to_string())));
    let saved: Vec<String> = module_names(model).into_iter().filter(|m| config.saves_module(m)).collect();
    for want in &config.modules_to_save {
        if !saved.iter().any(|m| m == want || m.ends_with(&format!(".{want}"))) {
            problems.push(format!("modules_to_save names {want:?}, which is no module of the model"));
        }
    }
    model.visit_linears_mut("", &mut |n, l| {
        if selected.iter().any(|s| s == n) && l.adapter().is_some() {
            problems.push(format!("{n} already has an adapter"));
        }
        if selected.iter().any(|s| s == n) && config.use_dora && l.is_quantized() {
            problems.push(format!("{n}: DoRA needs the dense weight, which is kept quantized"));
        }
        Ok(())
    })?;
    if !problems.is_empty() {
        return Err(err(problems.join("; ")));
    }
    let training = model.is_training();
    model.requires_grad_(false)?;
    let is_saved = |n: &str| saved.iter().any(|m| n.starts_with(&format!("{m}.")));
    let mut unfreeze = Ok(());
    model.visit_params("", &mut |n, p| {
        if unfreeze.is_ok() && is_saved(n) && p.dtype().is_float() {
            unfreeze = p.requires_grad_(true).map(|_| ());
        }
    });
    unfreeze?;
    model.visit_linears_mut("", &mut |n, l| {
        if !selected.iter().any(|s| s == n) {
            return Ok(());
        }
        let (r, scaling) = config.rank_and_scaling(n)?;
        let dtype = if l.weight.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let opts = (dtype, l.weight.device());
        let mut a = match init {
            Some(init) => {
                LoraAdapter::new(l.in_features(), l.out_features(), r, scaling, config.lora_dropout, init, opts)?
            }
            None => {
                let zeros = |s: &[usize]| crate::layers::parameter(Tensor::zeros(s, dtype)?, opts.into());
                let (a, b) = (zeros(&[r, l.in_features()])?, zeros(&[l.out_features(), r])?);
                LoraAdapter::from_weights(a, b, scaling, config.lora_dropout)?
            }
        };
        if config.use_dora {
            // m starts at the row norms of the adapted weight (of W itself when B = 0).
            let m = match init {
                Some(_) => a.row_norms(&l.weight)?,
                None => Tensor::zeros(&[l.out_features()], dtype)?.to_device(l.weight.device())?,
            };
            a = a.with_magnitude(crate::layers::parameter(m, opts.into())?)?;
        }
        a.train(training);
        l.set_adapter(a)?;
        Ok(())
    })?;
    tracing::info!(target: "kiln::lora", layers = selected.len(), r = config.r, "injected LoRA adapters");
    Ok(selected)
}

/// Whether `name` is an adapter's parameter (`….lora_A.weight`, `….lora_B.weight`).
pub fn is_adapter_parameter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight") || name.ends_with(&format!(".{MAGNITUDE}"))
}

/// Every adapter parameter, and every parameter of `modules_to_save`, under
/// PEFT's names (`base_model.model.<name>`): what `adapter_model.safetensors`
/// holds (PEFT's `get_peft_model_state_dict`), detached.
pub fn adapter_state_dict(model: &dyn Module, config: &LoraConfig) -> BTreeMap<String, Tensor> {
    let saved: Vec<String> = module_names(model).into_iter().filter(|m| config.saves_module(m)).collect();
    let mut out = BTreeMap::new();
    model.visit_params("", &mut |n, p| {
        if is_adapter_parameter(n) || saved.iter().any(|m| n.starts_with(&format!("{m}."))) {
            out.insert(format!("{PEFT_PREFIX}{n}"), p.detach());
        }
    });
    out
}

/// Copies `state` (PEFT's names, as [`adapter_state_dict`] gives them) into
/// the model's adapters and `modules_to_save`, in place. Strict: every such
/// parameter must be in `state` with its shape, and `state` must hold
/// nothing else; nothing is written unless every check passes.
pub fn load_adapter_state_dict(
    model: &mut dyn Module,
    config: &LoraConfig,
    state: &BTreeMap<String, Tensor>,
) -> Result<()> {
    let own = adapter_state_dict(model, config);
    let mut problems = vec![];
    for (k, t) in &own {
        match state.get(k) {
            None => problems.push(format!("missing {k}")),
            Some(s) if s.shape() != t.shape() => {
                problems.push(format!("{k}: shape {:?} in the file, {:?} in the model", s.shape(), t.shape()))
            }
            Some(_) => {}
        }
    }
    problems.extend(state.keys().filter(|k| !own.contains_key(*k)).map(|k| format!("unexpected {k}")));
    if !problems.is_empty() {
        return Err(Error::invalid("load_adapter_state_dict", problems.join("; ")));
    }
    let _g = kiln_autograd::no_grad();
    let mut result = Ok(());
    model.visit_params("", &mut |n, p| {
        if let (Ok(()), Some(src)) = (&result, state.get(&format!("{PEFT_PREFIX}{n}"))) {
            result =
                p.copy_(src).map(|_| ()).map_err(|e| Error::invalid("load_adapter_state_dict", format!("{n}: {e}")));
        }
    });
    result
}

/// Writes PEFT's adapter files into `dir` (created if needed):
/// `adapter_config.json` (`config`) and `adapter_model.safetensors`
/// ([`adapter_state_dict`]), each atomically. PEFT's `PeftModel.from_pretrained`
/// loads them onto the transformers model.
pub fn save_adapter(dir: impl AsRef<Path>, model: &dyn Module, config: &LoraConfig) -> Result<()> {
    let dir = dir.as_ref();
    let io = |e: std::io::Error| Error::invalid("save_adapter", format!("{}: {e}", dir.display()));
    let state = adapter_state_dict(model, config);
    if state.is_empty() {
        return Err(Error::invalid("save_adapter", "the model has no adapter (inject_adapter or load_adapter first)"));
    }
    std::fs::create_dir_all(dir).map_err(io)?;
    let text = serde_json::to_string_pretty(&config.to_json())
        .map_err(|e| Error::invalid("save_adapter", format!("cannot write the config: {e}")))?;
    write_atomic(&dir.join(ADAPTER_CONFIG_FILE), |w| w.write_all(text.as_bytes()))?;
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    save_safetensors(dir.join(ADAPTER_WEIGHTS_FILE), &state, Some(&meta))
}

/// Reads `adapter_config.json` from a PEFT adapter directory.
pub fn load_adapter_config(dir: impl AsRef<Path>) -> Result<LoraConfig> {
    let path = dir.as_ref().join(ADAPTER_CONFIG_FILE);
    let err = |m: String| Error::invalid("load_adapter_config", format!("{}: {m}", path.display()));
    let text = std::fs::read_to_string(&path).map_err(|e| err(format!("cannot read: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))?;
    LoraConfig::from_json(&v).map_err(|e| err(e.to_string()))
}

/// Loads a PEFT adapter directory onto `model` (PEFT's
/// `PeftModel.from_pretrained`): its configuration selects the layers, its
/// weights fill the adapters (strictly: every adapter parameter must be in
/// the file and nothing else), and the rest of the model is frozen. With
/// `is_trainable` the adapters (and `modules_to_save`) train; without, they
/// are frozen too, for inference. Returns the configuration.
pub fn load_adapter(model: &mut dyn Module, dir: impl AsRef<Path>, is_trainable: bool) -> Result<LoraConfig> {
    let dir = dir.as_ref();
    let config = load_adapter_config(dir)?;
    let state = load_safetensors(dir.join(ADAPTER_WEIGHTS_FILE))?;
    // A file that does not fit the selection leaves the model as it was:
    // the adapters taken off again, the parameters that trained train again.
    let trained: BTreeSet<String> = model.named_trainable_parameters().into_iter().map(|(n, _)| n).collect();
    inject(model, &config, None)?;
    if let Err(e) = load_adapter_state_dict(model, &config, &state) {
        remove_adapters(model)?;
        let mut restore = Ok(());
        model.visit_params("", &mut |n, p| {
            if restore.is_ok() && trained.contains(n) {
                restore = p.requires_grad_(true).map(|_| ());
            }
        });
        restore?;
        return Err(e);
    }
    if !is_trainable {
        model.requires_grad_(false)?;
    }
    Ok(config)
}

fn remove_adapters(model: &mut dyn Module) -> Result<()> {
    model.visit_linears_mut("", &mut |_, l| {
        l.take_adapter();
        Ok(())
    })
}

/// The adapted layers, checked first: `f` runs on none unless `check`
/// accepts every one.
fn for_each_adapted(
    model: &mut dyn Module,
    what: &'static str,
    check: impl Fn(&Linear) -> Option<String>,
    mut f: impl FnMut(&mut Linear) -> Result<()>,
) -> Result<usize> {
    let mut problems = vec![];
    let mut n = 0;
    model.visit_linears_mut("", &mut |name, l| {
        if l.adapter().is_some() {
            n += 1;
            if let Some(p) = check(l) {
                problems.push(format!("{name}: {p}"));
            }
        }
        Ok(())
    })?;
    if n == 0 {
        return Err(Error::invalid(what, "the model has no adapter"));
    }
    if !problems.is_empty() {
        return Err(Error::invalid(what, problems.join("; ")));
    }
    let _g = kiln_autograd::no_grad();
    model.visit_linears_mut("", &mut |_, l| if l.adapter().is_some() { f(l) } else { Ok(()) })?;
    Ok(n)
}

/// Writes `l`'s adapter into its weight: `W + delta`, or DoRA's
/// `(m / n) (W + delta)` with `n` the row norms of `W + delta` (kept to unmerge).
fn merge_one(l: &mut Linear) -> Result<()> {
    let a = l.adapter().expect("adapted");
    let delta = a.delta_weight(l.weight.dtype())?;
    let norm = match a.magnitude() {
        Some(m) => {
            let norm = a.row_norms(&l.weight)?;
            let factor = m.div(&norm)?.to_dtype(l.weight.dtype())?.unsqueeze(1)?;
            l.weight.copy_(&l.weight.add(&delta)?.mul(&factor)?)?;
            Some(norm)
        }
        None => {
            l.weight.add_(&delta)?;
            None
        }
    };
    let a = l.adapter_mut().expect("adapted");
    a.set_merged(true);
    a.set_merged_norm(norm);
    Ok(())
}

fn dense_check(l: &Linear) -> Option<String> {
    l.is_quantized().then(|| {
        "the weight is kept quantized: merging would requantize it (load the base dequantized to merge)".to_string()
    })
}

/// Adds each adapter's `scaling * B @ A` into its layer's weight in place
/// (PEFT's `merge_adapter`); the forward then skips the adapter. Returns the
/// number of layers merged. Refused (nothing merged) when an adapter is
/// merged already or a base weight is kept quantized.
pub fn merge_adapter(model: &mut dyn Module) -> Result<usize> {
    let check = |l: &Linear| {
        dense_check(l).or_else(|| l.adapter().filter(|a| a.is_merged()).map(|_| "already merged".to_string()))
    };
    for_each_adapted(model, "merge_adapter", check, merge_one)
}

/// Subtracts each merged adapter's product from its layer's weight again
/// (PEFT's `unmerge_adapter`). Refused (nothing changed) when an adapter is
/// not merged.
pub fn unmerge_adapter(model: &mut dyn Module) -> Result<usize> {
    let check = |l: &Linear| l.adapter().filter(|a| !a.is_merged()).map(|_| "not merged".to_string());
    for_each_adapted(model, "unmerge_adapter", check, |l| {
        let a = l.adapter().expect("adapted");
        let delta = a.delta_weight(l.weight.dtype())?;
        if let (Some(m), Some(norm)) = (a.magnitude(), a.merged_norm()) {
            // DoRA: W' = (m / n) (W + delta), so W = W' / (m / n) - delta.
            let factor = m.div(norm)?.to_dtype(l.weight.dtype())?.unsqueeze(1)?;
            l.weight.copy_(&l.weight.div(&factor)?.sub(&delta)?)?;
        } else {
            l.weight.sub_(&delta)?;
        }
        let a = l.adapter_mut().expect("adapted");
        a.set_merged(false);
        a.set_merged_norm(None);
        Ok(())
    })
}

/// Merges every adapter not yet merged into its weight and takes the
/// adapters off (PEFT's `merge_and_unload`): the model is then a plain
/// model again, whose `save_pretrained` writes the merged weights.
pub fn merge_and_unload(model: &mut dyn Module) -> Result<usize> {
    let check = |l: &Linear| match l.adapter() {
        Some(a) if !a.is_merged() => dense_check(l),
        _ => None,
    };
    for_each_adapted(model, "merge_and_unload", check, |l| {
        if !l.adapter().expect("adapted").is_merged() {
            merge_one(l)?;
        }
        l.take_adapter();
        Ok(())
    })
}
