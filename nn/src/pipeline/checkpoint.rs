//! Checkpoints of pipelined runs: each stage's weights in files of its own
//! (a tied parameter once, in the first stage holding it) under one Hugging
//! Face index with Hub names, and the stages' optimizer states merged by
//! parameter name, so the directory loads as one model: a run resumes on
//! another number of stages, another schedule, or without a pipeline, and
//! an unpipelined run's checkpoint resumes as a pipeline.
use super::schedule::PipelineSchedule;
use crate::checkpoint::{save_checkpoint_parts, Checkpoint, TrainerState};
use crate::optim::Optimizer;
use kiln_autograd::no_grad;
use kiln_tensor::{Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

impl PipelineSchedule {
    /// The whole model's parameters by name, detached (a tied parameter
    /// once): the unpipelined model's `state_dict`.
    pub fn state_dict(&self) -> BTreeMap<String, Tensor> {
        self.named_parameters().into_iter().map(|(n, t)| (n, t.detach())).collect()
    }

    /// Copies the whole model's `state` into every stage's parameters
    /// (a tied parameter into each copy; a parameter on a mesh shard by
    /// shard), in place. Strict: every parameter must be in `state` with its
    /// shape, and `state` must hold nothing else; nothing is written unless
    /// every check passes.
    pub fn load_state_dict(&self, state: &BTreeMap<String, Tensor>) -> Result<()> {
        let params: Vec<(String, Tensor)> = self.stages().iter().flat_map(|s| s.module().named_parameters()).collect();
        let names: BTreeSet<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        let mut problems = vec![];
        for (n, p) in &params {
            match state.get(n) {
                None => problems.push(format!("missing {n}")),
                Some(t) if t.shape() != p.shape() => {
                    problems.push(format!("{n}: shape {:?} in the state, {:?} in the model", t.shape(), p.shape()))
                }
                Some(_) => {}
            }
        }
        problems.extend(state.keys().filter(|k| !names.contains(k.as_str())).map(|k| format!("unexpected {k}")));
        if !problems.is_empty() {
            problems.dedup();
            return Err(Error::invalid("PipelineSchedule::load_state_dict", problems.join("; ")));
        }
        let _g = no_grad();
        for (n, p) in &params {
            let src = &state[n];
            let src = if p.is_distributed() && src.device() != p.device() { src.placed_like(p)? } else { src.clone() };
            p.copy_(&src)
                .map_err(|e| Error::invalid("PipelineSchedule::load_state_dict", format!("copying {n}: {e}")))?;
        }
        Ok(())
    }
}

/// The stages' optimizer states merged by parameter name: a tied
/// parameter's state (equal on every copy, whose gradients are equal) once,
/// from the first stage holding it.
pub fn merged_optimizer_state(optimizers: &[&dyn Optimizer]) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    for o in optimizers {
        for (k, v) in o.state_dict()? {
            out.entry(k).or_insert(v);
        }
    }
    Ok(out)
}

/// Saves a pipelined run as [`crate::checkpoint::save_checkpoint`] saves an
/// unpipelined one, but with each stage's weights in files of its own
/// (`model-0000k-of-0000n.safetensors`, listed per stage in the index's
/// `kiln_pieces`; a stage on a mesh written shard by shard), the optimizer
/// state by parameter name (one optimizer per stage, in stage order),
/// `config.json` and the trainer state.
pub fn save_pipeline_checkpoint(
    dir: impl AsRef<Path>,
    pipeline: &PipelineSchedule,
    model_config: Option<&str>,
    optimizers: &[&dyn Optimizer],
    state: &TrainerState,
) -> Result<()> {
    if optimizers.len() != pipeline.stages().len() {
        return Err(Error::invalid(
            "save_pipeline_checkpoint",
            format!("{} optimizers for {} stages: one per stage", optimizers.len(), pipeline.stages().len()),
        ));
    }
    let mut seen = BTreeSet::new();
    let pieces = pipeline
        .stages()
        .iter()
        .map(|s| {
            let own = s.module().named_parameters().into_iter().filter(|(n, _)| seen.insert(n.clone()));
            crate::layers::to_hub_layout(own.map(|(n, t)| (n, t.detach())).collect())
        })
        .collect::<Result<Vec<_>>>()?;
    save_checkpoint_parts(dir.as_ref(), &pieces, model_config, &merged_optimizer_state(optimizers)?, state)
}

/// Restores a checkpoint (of a pipelined run with any number of stages, or
/// of an unpipelined one) into `pipeline` and its stages' optimizers (one
/// per stage, in stage order, each over its stage's parameters by name):
/// the weights into every stage, each optimizer the state of its stage's
/// parameters, and the default generators.
pub fn restore_pipeline(
    checkpoint: &Checkpoint,
    pipeline: &PipelineSchedule,
    optimizers: &mut [&mut dyn Optimizer],
) -> Result<()> {
    if optimizers.len() != pipeline.stages().len() {
        return Err(Error::invalid(
            "restore_pipeline",
            format!("{} optimizers for {} stages: one per stage", optimizers.len(), pipeline.stages().len()),
        ));
    }
    let weights = crate::layers::from_hub_layout(checkpoint.model_state()?, &pipeline.state_dict())?;
    pipeline.load_state_dict(&weights)?;
    let all = checkpoint.optimizer_state()?;
    for (stage, opt) in pipeline.stages().iter().zip(optimizers.iter_mut()) {
        let names: BTreeSet<String> = stage.module().named_parameters().into_iter().map(|(n, _)| n).collect();
        let own: Vec<(String, Tensor)> = all
            .iter()
            .filter(|(k, _)| k.rsplit_once('.').is_some_and(|(param, _)| names.contains(param)))
            .cloned()
            .collect();
        opt.load_state_dict(own)?;
    }
    checkpoint.state.restore_rng()
}
