//! `PipelineSchedule` and PyTorch's schedule names: one controller runs every
//! stage's forward and backward over the microbatches in the schedule's
//! order, moving activations and their gradients between the stages'
//! devices, then brings tied parameters' gradients together.
use super::order::{rank_orders, simulate, Action, Phase, ScheduleKind};
use super::stage::{LossFn, PipelineStage};
use kiln_autograd::no_grad;
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use std::collections::{BTreeMap, HashMap};

/// A pipeline's stages run by one schedule: [`ScheduleGPipe`],
/// [`Schedule1F1B`] or [`ScheduleInterleaved1F1B`] make one.
pub struct PipelineSchedule {
    kind: ScheduleKind,
    stages: Vec<PipelineStage>,
    microbatches: usize,
    loss_fn: LossFn,
    ranks: usize,
    /// The actions in the order the controller issues them: by start time in
    /// the schedule's timeline (forward 1, backward 2), so devices that run
    /// asynchronously overlap as the schedule intends.
    dispatch: Vec<Action>,
    /// Parameters held by several stages (tied weights): name -> stages.
    tied: BTreeMap<String, Vec<usize>>,
    bytes_sent: u64,
    /// With profiling on, each action of the last step and its seconds.
    profile: Option<Vec<(Action, f64)>>,
}

impl std::fmt::Debug for PipelineSchedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineSchedule")
            .field("kind", &self.kind)
            .field("stages", &self.stages)
            .field("microbatches", &self.microbatches)
            .field("ranks", &self.ranks)
            .finish_non_exhaustive()
    }
}

/// PyTorch's `ScheduleGPipe`: every microbatch's forward through the
/// pipeline, then every backward. One stage per rank.
#[derive(Debug)]
pub struct ScheduleGPipe;

/// PyTorch's `Schedule1F1B`: after `p - 1 - r` warm-up forwards, rank `r`
/// alternates a forward and a backward, so a stage holds at most `p`
/// microbatches' activations. One stage per rank.
#[derive(Debug)]
pub struct Schedule1F1B;

/// PyTorch's `ScheduleInterleaved1F1B` (Megatron-LM's order): several stages
/// per rank, stage `s` on rank `s % p`; the microbatches must be a multiple
/// of the ranks.
#[derive(Debug)]
pub struct ScheduleInterleaved1F1B;

impl ScheduleGPipe {
    /// The GPipe schedule over `stages` (one per device, in model order).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(stages: Vec<PipelineStage>, n_microbatches: usize, loss_fn: LossFn) -> Result<PipelineSchedule> {
        PipelineSchedule::new(ScheduleKind::GPipe, stages, n_microbatches, loss_fn)
    }
}

impl Schedule1F1B {
    /// The 1F1B schedule over `stages` (one per device, in model order).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(stages: Vec<PipelineStage>, n_microbatches: usize, loss_fn: LossFn) -> Result<PipelineSchedule> {
        PipelineSchedule::new(ScheduleKind::OneFOneB, stages, n_microbatches, loss_fn)
    }
}

impl ScheduleInterleaved1F1B {
    /// The interleaved schedule over `stages` in model order, stage `s` on
    /// the device of stage `s % p`, `p` being the number of devices.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(stages: Vec<PipelineStage>, n_microbatches: usize, loss_fn: LossFn) -> Result<PipelineSchedule> {
        PipelineSchedule::new(ScheduleKind::Interleaved1F1B, stages, n_microbatches, loss_fn)
    }
}

/// The number of ranks (distinct devices, in order of first use) of
/// `stages`, checking that stage `s` sits on the device of rank `s % p` and
/// that the stages are numbered in order.
fn ranks_of(kind: ScheduleKind, stages: &[PipelineStage]) -> Result<usize> {
    let err = |m: String| Error::invalid("pipeline", m);
    if stages.is_empty() {
        return Err(err("a pipeline needs at least one stage".into()));
    }
    for (i, s) in stages.iter().enumerate() {
        if s.stage_index() != i || s.num_stages() != stages.len() {
            return Err(err(format!(
                "stage {i} of {} says it is stage {} of {}",
                stages.len(),
                s.stage_index(),
                s.num_stages()
            )));
        }
    }
    let mut devices: Vec<Device> = vec![];
    for s in stages {
        if !devices.contains(&s.device()) {
            devices.push(s.device());
        }
    }
    let p = match kind {
        ScheduleKind::Interleaved1F1B => devices.len(),
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => stages.len(),
    };
    if !stages.len().is_multiple_of(p) {
        return Err(err(format!("{} stages do not spread evenly over {p} devices", stages.len())));
    }
    for (i, s) in stages.iter().enumerate() {
        if s.device() != stages[i % p].device() {
            return Err(err(format!(
                "the {kind:?} schedule runs stage {i} on rank {}, whose device is {}, but the stage is on {}",
                i % p,
                stages[i % p].device(),
                s.device()
            )));
        }
    }
    Ok(p)
}

impl PipelineSchedule {
    /// A `kind` schedule over `stages` (in model order) with `n_microbatches`
    /// microbatches per step and `loss_fn` on the last stage's output.
    pub fn new(
        kind: ScheduleKind,
        stages: Vec<PipelineStage>,
        n_microbatches: usize,
        loss_fn: LossFn,
    ) -> Result<PipelineSchedule> {
        let ranks = ranks_of(kind, &stages)?;
        let orders = rank_orders(kind, ranks, stages.len() / ranks, n_microbatches)?;
        let dispatch = simulate(&orders, stages.len(), 1.0, 2.0)?.runs.into_iter().map(|r| r.3).collect();
        let mut tied: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, s) in stages.iter().enumerate() {
            s.module().visit_params("", &mut |n, _| tied.entry(n.to_string()).or_default().push(i));
        }
        tied.retain(|_, v| v.len() > 1);
        Ok(PipelineSchedule {
            kind,
            stages,
            microbatches: n_microbatches,
            loss_fn,
            ranks,
            dispatch,
            tied,
            bytes_sent: 0,
            profile: None,
        })
    }

    /// The schedule's kind.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// The stages, in model order.
    pub fn stages(&self) -> &[PipelineStage] {
        &self.stages
    }

    /// The stages, mutably (e.g. [`PipelineStage::set_compiled`]).
    pub fn stages_mut(&mut self) -> &mut [PipelineStage] {
        &mut self.stages
    }

    /// Microbatches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The number of ranks (devices) the stages sit on.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Each rank's actions, in its order.
    pub fn orders(&self) -> Result<Vec<Vec<Action>>> {
        rank_orders(self.kind, self.ranks, self.stages.len() / self.ranks, self.microbatches)
    }

    /// The names of parameters held by several stages (tied weights), whose
    /// gradients a step sums and whose values stay equal when every stage's
    /// optimizer steps them alike.
    pub fn tied_parameters(&self) -> Vec<String> {
        self.tied.keys().cloned().collect()
    }

    /// Every stage's parameters by name, in model order; a tied parameter
    /// once (its first stage's copy): the model's `named_parameters`.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut seen = std::collections::HashSet::new();
        self.stages.iter().flat_map(|s| s.module().named_parameters()).filter(|(n, _)| seen.insert(n.clone())).collect()
    }

    /// Profiling: each action waits for its device to finish and is timed
    /// ([`PipelineSchedule::action_times`]), which serialises the devices;
    /// for measuring stage costs, not for training.
    pub fn set_profile(&mut self, on: bool) {
        self.profile = on.then(Vec::new);
    }

    /// With profiling on, each action of the last step and its seconds
    /// (the transfer of its result included).
    pub fn action_times(&self) -> &[(Action, f64)] {
        self.profile.as_deref().unwrap_or(&[])
    }

    /// Bytes of activations and gradients the last step moved between stages on different devices.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// The pipeline's output on the whole of `input` (no microbatches, no
    /// gradients): each stage's forward in turn, e.g. the logits for
    /// evaluation.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let _g = no_grad();
        let mut x = input.clone();
        for s in &self.stages {
            x = s.module().forward(&x.to_device(s.device())?)?;
        }
        Ok(x)
    }

    /// One training step's forward and backward (PyTorch's `step(x,
    /// target=y)`): `input` and `target` are split along dimension 0 into the
    /// microbatches, run through the stages in the schedule's order, and the
    /// parameters' gradients accumulate in `.grad`: those of the mean of the
    /// microbatches' losses. Returns the microbatches' losses in order (on
    /// the last stage's device); the optimizers step afterwards.
    pub fn step(&mut self, input: &Tensor, target: &Tensor) -> Result<Vec<Tensor>> {
        let m = self.microbatches;
        let inputs = microbatches(input, m, "input")?;
        let targets = microbatches(target, m, "target")?;
        let last = self.stages.len() - 1;
        let (first_dev, last_dev) = (self.stages[0].device(), self.stages[last].device());
        let inputs = inputs.iter().map(|t| t.to_device(first_dev)).collect::<Result<Vec<_>>>()?;
        let targets = targets.iter().map(|t| t.to_device(last_dev)).collect::<Result<Vec<_>>>()?;
        // Stage inputs and output gradients that have arrived, by (stage, microbatch).
        let mut arrived: HashMap<(usize, usize), Tensor> = HashMap::new();
        let mut grads: HashMap<(usize, usize), Tensor> = HashMap::new();
        self.bytes_sent = 0;
        let before = self.tied_grads_before()?;
        let result = self.run_actions(&inputs, &targets, &mut arrived, &mut grads);
        let finished: Result<Vec<()>> = self.stages.iter_mut().map(PipelineStage::finish).collect();
        result?;
        finished?;
        self.sum_tied_grads(&before)?;
        let mut losses = self.stages[last].take_losses();
        if losses.len() != m {
            return Err(Error::invalid(
                "pipeline",
                format!("the step made {} losses for {m} microbatches", losses.len()),
            ));
        }
        losses.sort_by_key(|(i, _)| *i);
        Ok(losses.into_iter().map(|(_, l)| l).collect())
    }

    fn run_actions(
        &mut self,
        inputs: &[Tensor],
        targets: &[Tensor],
        arrived: &mut HashMap<(usize, usize), Tensor>,
        grads: &mut HashMap<(usize, usize), Tensor>,
    ) -> Result<()> {
        let (m, last) = (self.microbatches, self.stages.len() - 1);
        if let Some(p) = &mut self.profile {
            p.clear();
        }
        for a in self.dispatch.clone() {
            let (s, mb) = (a.stage, a.microbatch);
            let t0 = std::time::Instant::now();
            match a.phase {
                Phase::Forward => {
                    let x = if s == 0 { inputs[mb].clone() } else { take(arrived, (s, mb), "input")? };
                    let target = (s == last).then(|| &targets[mb]);
                    if let Some(y) = self.stages[s].forward(mb, &x, target, &self.loss_fn, m)? {
                        let y = self.send(&y, s + 1)?;
                        arrived.insert((s + 1, mb), y);
                    }
                }
                Phase::Backward => {
                    let g = if s == last { targets[mb].clone() } else { take(grads, (s, mb), "output gradient")? };
                    if let Some(dx) = self.stages[s].backward(mb, &g)? {
                        let dx = self.send(&dx, s - 1)?;
                        grads.insert((s - 1, mb), dx);
                    }
                }
            }
            if let Some(p) = &mut self.profile {
                let dev = self.stages[s].device();
                dev.backend()?.synchronize(dev)?;
                p.push((a, t0.elapsed().as_secs_f64()));
            }
        }
        Ok(())
    }

    /// `t` on the device of stage `to`, counting the bytes when it moves.
    fn send(&mut self, t: &Tensor, to: usize) -> Result<Tensor> {
        let dev = self.stages[to].device();
        if t.device() != dev {
            self.bytes_sent += (t.numel() * t.dtype().size_in_bytes()) as u64;
        }
        t.to_device(dev)
    }

    /// Each tied parameter's gradient as a step starts (its copies hold the
    /// same one after a step), copied: gradients accumulate across steps
    /// until zeroed, and the step's sum must count it once.
    fn tied_grads_before(&self) -> Result<BTreeMap<String, Tensor>> {
        let _g = no_grad();
        let mut out = BTreeMap::new();
        for (name, stages) in &self.tied {
            if let Some(g) = param(&self.stages[stages[0]], name)?.grad() {
                out.insert(name.clone(), g.detach().deep_clone()?);
            }
        }
        Ok(out)
    }

    /// Every tied parameter's gradient becomes the sum of its stages'
    /// gradients, on each of them (Megatron-LM's embedding all-reduce); the
    /// gradient it had before the step (`before`, held by every copy) is
    /// counted once.
    fn sum_tied_grads(&mut self, before: &BTreeMap<String, Tensor>) -> Result<()> {
        let _g = no_grad();
        for (name, stages) in &self.tied {
            let params: Vec<Tensor> = stages.iter().map(|&s| param(&self.stages[s], name)).collect::<Result<_>>()?;
            let Some(first) = params.iter().find_map(Tensor::grad) else { continue };
            let mut sum = first.zeros_like()?;
            for p in &params {
                if let Some(g) = p.grad() {
                    sum = sum.add(&g.to_device(sum.device())?)?;
                }
            }
            if let Some(b) = before.get(name) {
                sum = sum.sub(&b.to_device(sum.device())?.mul((params.len() - 1) as f64)?)?;
            }
            for p in &params {
                p.set_grad(Some(sum.to_device(p.device())?));
            }
        }
        Ok(())
    }

    /// Clips every stage's gradients by their global L2 norm (PyTorch's
    /// `clip_grad_norm_` over the whole model: a tied parameter counts once)
    /// to at most `max_norm`; returns the norm before clipping.
    pub fn clip_grad_norm_(&self, max_norm: f64) -> Result<f64> {
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(Error::invalid("clip_grad_norm_", format!("max_norm must be >= 0, got {max_norm}")));
        }
        let _g = no_grad();
        let mut seen = std::collections::HashSet::new();
        let mut sq = 0.0f64;
        for s in &self.stages {
            let mut own = vec![];
            s.module().visit_params("", &mut |n, p| {
                if seen.insert(n.to_string()) {
                    own.push(p.clone());
                }
            });
            let n = crate::clip::grad_norm(&own)?.to_dtype(DType::F64)?.item_f64()?;
            sq += n * n;
        }
        let norm = sq.sqrt();
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        for s in &self.stages {
            for p in s.module().parameters() {
                if let Some(g) = p.grad() {
                    g.mul_(&Tensor::scalar(coef, (DType::F32, g.device()))?.to_dtype(g.dtype())?)?;
                }
            }
        }
        Ok(norm)
    }
}

/// The parameter `name` of `stage`.
pub(super) fn param(stage: &PipelineStage, name: &str) -> Result<Tensor> {
    let mut found = None;
    stage.module().visit_params("", &mut |n, p| {
        if n == name {
            found = Some(p.clone());
        }
    });
    found.ok_or_else(|| Error::invalid("pipeline", format!("stage {} has no parameter {name}", stage.stage_index())))
}

fn take(map: &mut HashMap<(usize, usize), Tensor>, key: (usize, usize), what: &str) -> Result<Tensor> {
    map.remove(&key).ok_or_else(|| {
        Error::invalid("pipeline", format!("stage {}'s {what} for microbatch {} has not arrived", key.0, key.1))
    })
}

/// `t` split along dimension 0 into `m` equal microbatches, each in storage
/// of its own (so every microbatch meets a captured stage with the same
/// layout, offset 0).
pub(super) fn microbatches(t: &Tensor, m: usize, what: &str) -> Result<Vec<Tensor>> {
    let b = t.shape().first().copied().unwrap_or(0);
    if t.ndim() == 0 || b == 0 || !b.is_multiple_of(m) {
        return Err(Error::shape(
            "pipeline",
            format!("the {what} of shape {:?} does not split into {m} equal microbatches along dimension 0", t.shape()),
        ));
    }
    let _g = no_grad();
    (0..m).map(|i| t.narrow(0, (i * (b / m)) as isize, b / m)?.deep_clone()).collect()
}
