//! Llama and Qwen3 split into pipeline stages: `LlamaStage` (the embedding
//! on the first stage, a run of decoder layers, the final norm and the
//! output projection on the last; Hugging Face names), split points given
//! or balanced by compute.
use super::order::ScheduleKind;
use super::rank::{PipelineRank, StageTransport};
use super::schedule::PipelineSchedule;
use super::stage::{LossFn, PipelineStage, StageModule};
use crate::layers::{AttentionMask, Embedding, Linear, RmsNorm, RotaryEmbedding};
use crate::models::{DecoderLayer, LlamaConfig, LlamaForCausalLM};
use crate::module::{join_name, Module};
use crate::parallel::Recipe;
use crate::precision::MixedPrecisionPolicy;
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{autocast, DType, Device, DeviceMesh, Error, Result, Tensor};
use std::collections::BTreeMap;

/// The part of a [`LlamaForCausalLM`] one pipeline stage runs, with the
/// model's parameter names (`model.layers.{i}.…` keep their layer index),
/// so a stage's `state_dict` is a slice of the model's.
///
/// A model with tied embeddings whose embedding and output projection land
/// on different stages gives the last stage its own copy of
/// `model.embed_tokens.weight`; a schedule sums the two copies' gradients
/// ([`super::PipelineSchedule::tied_parameters`]), so optimizers stepping
/// each stage keep them equal.
#[derive(Debug, Clone)]
pub struct LlamaStage {
    /// The token embeddings (first stage only).
    pub embed_tokens: Option<Embedding>,
    /// The decoder layers, with their index in the model.
    pub layers: Vec<(usize, DecoderLayer)>,
    /// The final norm (last stage only).
    pub norm: Option<RmsNorm>,
    /// The output projection (last stage of an untied model).
    pub lm_head: Option<Linear>,
    /// The output projection of a tied model: the embedding table itself when
    /// the stage holds it, else a copy.
    tied_head: Option<Tensor>,
    rotary: RotaryEmbedding,
    /// The dtype of the residual stream's first value (the embeddings').
    dtype: DType,
    mixed_precision: Option<MixedPrecisionPolicy>,
}

impl LlamaForCausalLM {
    /// The model cut into pipeline stages: stage `k + 1` starts at decoder
    /// layer `split_points[k]` (strictly increasing, at most the layer
    /// count); the first stage also holds the embeddings, the last the final
    /// norm and output projection. The stages share the model's parameters
    /// (move each with [`Module::to_device`]); a tied output projection
    /// away from the embeddings is a copy.
    pub fn pipeline_stages(&self, split_points: &[usize]) -> Result<Vec<LlamaStage>> {
        let n = self.model.layers.len();
        if !split_points.windows(2).all(|w| w[0] < w[1]) || split_points.last().is_some_and(|&p| p > n) {
            return Err(Error::invalid(
                "pipeline_stages",
                format!("split points must increase and lie in 0..={n}, got {split_points:?}"),
            ));
        }
        let mut bounds = vec![0];
        bounds.extend_from_slice(split_points);
        bounds.push(n);
        let k = bounds.len() - 1;
        (0..k)
            .map(|s| {
                let (first, last) = (s == 0, s + 1 == k);
                let tied = self.lm_head.is_none();
                let tied_head = match (last, tied, first) {
                    (true, true, true) => Some(self.model.embed_tokens.weight.clone()),
                    (true, true, false) => Some(fresh_copy(&self.model.embed_tokens.weight)?),
                    _ => None,
                };
                Ok(LlamaStage {
                    embed_tokens: first.then(|| self.model.embed_tokens.clone()),
                    layers: (bounds[s]..bounds[s + 1]).map(|i| (i, self.model.layers[i].clone())).collect(),
                    norm: last.then(|| self.model.norm.clone()),
                    lm_head: if last { self.lm_head.clone() } else { None },
                    tied_head,
                    rotary: self.model.rotary().clone(),
                    dtype: self.dtype(),
                    mixed_precision: self.mixed_precision(),
                })
            })
            .collect()
    }
}

/// How [`LlamaForCausalLM::pipeline`] pipelines a model: the schedule, one
/// device per rank, the stages per rank (1, or more for the interleaved
/// schedule), the microbatches per step and whether stages are captured.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelinePlan {
    /// The schedule.
    pub kind: ScheduleKind,
    /// Rank `r`'s device; stage `s` runs on `devices[s % devices.len()]`.
    pub devices: Vec<Device>,
    /// Stages per rank: 1 for GPipe and 1F1B, usually 2 for the interleaved schedule.
    pub stages_per_rank: usize,
    /// Microbatches per step.
    pub microbatches: usize,
    /// Each stage as captured programs ([`PipelineStage::set_compiled`]).
    pub compiled: bool,
    /// With each rank's device a mesh (`Device::Mesh`), how the rank's
    /// stages are split over it: PP x DDP, FSDP, TP or FSDP x TP
    /// ([`Recipe::apply_to_module`]); `None` moves stages whole.
    pub recipe: Option<Recipe>,
}

/// Puts `stage` on `device`: moved whole, or split over the mesh `device`
/// is by `recipe`.
fn place_stage(stage: &mut LlamaStage, device: Device, recipe: Option<Recipe>) -> Result<()> {
    match (recipe, device) {
        (Some(r), Device::Mesh(_)) => r.apply_to_module(stage, &DeviceMesh::of_device(device)?),
        (Some(r), d) => Err(Error::invalid(
            "pipeline",
            format!("{r:?} splits a stage over a mesh, but the stage's device is {d}, not a mesh"),
        )),
        (None, d) => stage.to_device(d),
    }
}

impl LlamaForCausalLM {
    /// The model as a pipeline: `plan.devices.len() * plan.stages_per_rank`
    /// stages split by [`balanced_split_points`], stage `s` moved to rank
    /// `s % p`'s device, run by `plan.kind` with `loss_fn` (usually
    /// [`crate::models::causal_lm_loss`]). The stages' parameters are fresh
    /// leaves wherever a stage moves, so optimizers are made per stage.
    /// A mixture of experts whose loss adds the routers' load-balancing term
    /// (over every layer at once) cannot be cut into stages and is refused.
    pub fn pipeline(&self, plan: &PipelinePlan, loss_fn: LossFn) -> Result<PipelineSchedule> {
        if self.config().moe.as_ref().is_some_and(|m| m.output_router_logits && m.num_experts > 0) {
            return Err(Error::invalid(
                "pipeline",
                "the model's loss adds the routers' load-balancing loss over every layer (output_router_logits), \
                 which no stage sees whole; turn it off to pipeline the model",
            ));
        }
        let n = plan.devices.len() * plan.stages_per_rank;
        let points = balanced_split_points(self.config(), n)?;
        let stages = self
            .pipeline_stages(&points)?
            .into_iter()
            .enumerate()
            .map(|(i, mut s)| {
                let d = plan.devices[i % plan.devices.len()];
                place_stage(&mut s, d, plan.recipe)?;
                let mut stage = PipelineStage::new(s, i, n, d)?;
                stage.set_compiled(plan.compiled);
                Ok(stage)
            })
            .collect::<Result<Vec<_>>>()?;
        PipelineSchedule::new(plan.kind, stages, plan.microbatches, loss_fn)
    }
}

impl LlamaForCausalLM {
    /// Rank `rank`'s part of [`LlamaForCausalLM::pipeline`] for a pipeline
    /// launched as one process per rank: the same split, this rank's stages
    /// (stage `s` on rank `s % p`) moved to `plan.devices[rank]` (the
    /// device as this process numbers it), exchanging with the other ranks
    /// through `transport` (Note [Pipelines across processes]).
    pub fn pipeline_rank(
        &self,
        plan: &PipelinePlan,
        rank: usize,
        loss_fn: LossFn,
        transport: StageTransport,
    ) -> Result<PipelineRank> {
        let p = plan.devices.len();
        let n = p * plan.stages_per_rank;
        let stages = self.pipeline_stages(&balanced_split_points(self.config(), n)?)?;
        let mut holders: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, s) in stages.iter().enumerate() {
            s.visit_params("", &mut |name, _| holders.entry(name.to_string()).or_default().push(i));
        }
        holders.retain(|_, v| v.len() > 1);
        let device = *plan.devices.get(rank).ok_or_else(|| {
            Error::invalid("pipeline_rank", format!("rank {rank} has no device in {:?}", plan.devices))
        })?;
        let own = stages
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % p == rank)
            .map(|(i, mut s)| {
                place_stage(&mut s, device, plan.recipe)?;
                let mut stage = PipelineStage::new(s, i, n, device)?;
                stage.set_compiled(plan.compiled);
                Ok(stage)
            })
            .collect::<Result<Vec<_>>>()?;
        PipelineRank::new(plan.kind, rank, p, own, plan.microbatches, loss_fn, holders, transport)
    }
}

/// A new leaf holding a copy of `t`'s values, requiring grad as `t` does.
fn fresh_copy(t: &Tensor) -> Result<Tensor> {
    let c = t.detach().deep_clone()?;
    if t.requires_grad() {
        c.requires_grad_(true)?;
    }
    Ok(c)
}

/// Split points for `stages` stages of a model with `config`, balancing each
/// stage's multiply-adds per token (decoder layers by their projections, the
/// output projection on the last stage; the embedding lookup costs none):
/// the split whose most expensive stage is cheapest.
pub fn balanced_split_points(config: &LlamaConfig, stages: usize) -> Result<Vec<usize>> {
    let n = config.num_hidden_layers;
    if stages == 0 || stages > n + 1 {
        return Err(Error::invalid(
            "balanced_split_points",
            format!("cannot split {n} decoder layers into {stages} stages"),
        ));
    }
    let (c, i) = (config.hidden_size as f64, config.intermediate_size as f64);
    let (h, kv, d) = (config.num_attention_heads as f64, config.num_key_value_heads as f64, config.head_dim as f64);
    let layer = |l: usize| {
        let attn = 2.0 * c * h * d + 2.0 * c * kv * d;
        let mlp = match config.moe.as_ref().filter(|_| config.is_sparse_layer(l)) {
            Some(m) => {
                c * m.num_experts as f64 + 3.0 * c * m.moe_intermediate_size as f64 * m.num_experts_per_tok as f64
            }
            None => 3.0 * c * i,
        };
        attn + mlp
    };
    let head = config.vocab_size as f64 * c;
    let mut prefix = vec![0.0f64];
    for l in 0..n {
        prefix.push(prefix[l] + layer(l));
    }
    // best[k][j]: the cheapest most expensive stage putting layers 0..j in k stages.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for j in 0..=n {
            for s in 0..=j {
                let extra = if k == stages && j == n { head } else { 0.0 };
                let cost = best[k - 1][s].max(prefix[j] - prefix[s] + extra);
                // The first stage starts at layer 0; later ones may hold no layer only at the ends.
                if (k == 1 && s != 0) || (k > 1 && s == j && j != 0 && j != n) {
                    continue;
                }
                if cost < best[k][j] {
                    best[k][j] = cost;
                    cut[k][j] = s;
                }
            }
        }
    }
    let mut points = vec![];
    let mut j = n;
    for k in (2..=stages).rev() {
        j = cut[k][j];
        points.push(j);
    }
    points.reverse();
    Ok(points)
}

impl LlamaStage {
    /// Whether the stage is the first (holds the embeddings).
    pub fn is_first(&self) -> bool {
        self.embed_tokens.is_some()
    }

    /// Whether the stage is the last (holds the norm and output projection).
    pub fn is_last(&self) -> bool {
        self.norm.is_some()
    }

    fn run(&self, input: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let x = match &self.embed_tokens {
            Some(e) => {
                if input.ndim() != 2 || !input.dtype().is_int() {
                    return Err(Error::shape(
                        "LlamaStage",
                        format!("the first stage takes token ids [B, T], got {:?} {}", input.shape(), input.dtype()),
                    ));
                }
                e.forward(input)?
            }
            None => input.clone(),
        };
        if x.ndim() != 3 {
            return Err(Error::shape(
                "LlamaStage",
                format!("expected hidden states [B, T, hidden], got {:?}", x.shape()),
            ));
        }
        let rope = self.rotary.tables(0, x.shape()[1], self.dtype, x.device())?;
        let mut x = x;
        for (_, layer) in &self.layers {
            x = layer.forward(&x, &rope, AttentionMask::Causal, None, None)?;
        }
        let Some(norm) = &self.norm else { return Ok(x) };
        let h = norm.forward(&x)?;
        match (&self.lm_head, &self.tied_head) {
            (Some(head), _) => head.forward(&h),
            (None, Some(w)) => h.linear(w, None),
            (None, None) => Err(Error::invalid("LlamaStage", "the last stage has no output projection")),
        }
    }
}

impl StageModule for LlamaStage {
    /// Under a mixed-precision policy the stage computes in its
    /// `param_dtype` (autocast) like the whole model, and only the last
    /// stage's logits take its `output_dtype`: the values passed between
    /// stages are the ones the unsplit model passes between those layers.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let Some(p) = &self.mixed_precision else { return self.run(input) };
        p.validate()?;
        let y = match p.param_dtype {
            Some(d) => {
                let _amp = autocast(d)?;
                self.run(input)?
            }
            None => self.run(input)?,
        };
        match p.output_dtype {
            Some(d) if self.is_last() => y.to_dtype(d),
            _ => Ok(y),
        }
    }

    fn draws_random_numbers(&self) -> bool {
        self.layers.iter().any(|(_, l)| l.self_attn.dropout_is_active())
    }
}

impl Module for LlamaStage {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        if let Some(e) = &self.embed_tokens {
            e.visit_params(&join_name(prefix, "model.embed_tokens"), f);
        }
        for (i, l) in &self.layers {
            l.visit_params(&join_name(prefix, &format!("model.layers.{i}")), f);
        }
        if let Some(n) = &self.norm {
            n.visit_params(&join_name(prefix, "model.norm"), f);
        }
        if let Some(h) = &self.lm_head {
            h.visit_params(&join_name(prefix, "lm_head"), f);
        }
        // The stage's own copy; the table itself was visited with the embeddings.
        if let (Some(w), None) = (&self.tied_head, &self.embed_tokens) {
            f(&join_name(prefix, "model.embed_tokens.weight"), w);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        if let Some(e) = &mut self.embed_tokens {
            e.visit_params_mut(&join_name(prefix, "model.embed_tokens"), f)?;
            // A tied head on the same stage stays the table itself.
            if self.tied_head.is_some() {
                self.tied_head = Some(e.weight.clone());
            }
        }
        for (i, l) in &mut self.layers {
            l.visit_params_mut(&join_name(prefix, &format!("model.layers.{i}")), f)?;
        }
        if let Some(n) = &mut self.norm {
            n.visit_params_mut(&join_name(prefix, "model.norm"), f)?;
        }
        if let Some(h) = &mut self.lm_head {
            h.visit_params_mut(&join_name(prefix, "lm_head"), f)?;
        }
        if let (Some(w), None) = (&mut self.tied_head, &self.embed_tokens) {
            f(&join_name(prefix, "model.embed_tokens.weight"), w)?;
        }
        Ok(())
    }

    fn visit_linears_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Linear) -> Result<()>) -> Result<()> {
        for (i, l) in &mut self.layers {
            l.visit_linears_mut(&join_name(prefix, &format!("model.layers.{i}")), f)?;
        }
        if let Some(h) = &mut self.lm_head {
            h.visit_linears_mut(&join_name(prefix, "lm_head"), f)?;
        }
        Ok(())
    }

    fn train(&mut self, on: bool) {
        for (_, l) in &mut self.layers {
            l.train(on);
        }
    }

    fn is_training(&self) -> bool {
        self.layers.iter().any(|(_, l)| l.is_training())
    }
}
