//! `PipelineRank`: one process's part of a pipeline launched as one process
//! per rank: its stages, its rank's order of the schedule, and a transport
//! carrying activations, gradients and the few scalars ranks share (Note
//! [Pipelines across processes]).
use super::order::{rank_orders, Action, Phase, ScheduleKind};
use super::stage::{LossFn, PipelineStage};
use kiln_autograd::no_grad;
use kiln_tensor::{DType, Device, Error, HostBuffer, Result, Tensor};
use std::collections::BTreeMap;
use std::time::Duration;

// Note [Pipelines across processes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With one process per rank, no controller sees every stage: each process
// runs its own rank's order of the schedule (`rank_orders`), and a stage's
// output, or its input's gradient, leaves as a message to the rank of the
// stage that needs it, keyed by step, phase, stage and microbatch. Waits for
// messages are bounded (`PipelineRank::set_timeout`): a rank that died is an
// error naming the message, never a hang. Messages are a small header (dtype,
// shape) and the elements' little-endian bytes.
// The transport is the caller's (`StageTransport`: a send and a blocking,
// bounded receive that removes the message). With kiln's process group it is
// the group's `TcpStore` (`put` / `take`): every message goes through rank
// 0's store server, one hop more than a direct link between the two ranks.
// That is a choice of this machine's means: the XLA:CPU plugin refuses
// programs and transfers across processes, so no PJRT path exists here;
// on GPUs or TPUs the activations would move by the plugin's collectives.
// Tied parameters held by several ranks (an output projection tied to the
// embeddings) exchange their gradients the same way and sum them in stage
// order, so every copy gets the same sum; clipping exchanges each rank's
// squared norm.

/// Sends a message: `(key, bytes)`.
type SendFn = Box<dyn Fn(&str, &[u8]) -> Result<()> + Send + Sync>;
/// Takes the message `key`, waiting at most the timeout.
type RecvFn = Box<dyn Fn(&str, Duration) -> Result<Vec<u8>> + Send + Sync>;

/// How one rank's messages reach another rank's process.
pub struct StageTransport {
    send: SendFn,
    recv: RecvFn,
}

impl std::fmt::Debug for StageTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StageTransport(..)")
    }
}

impl StageTransport {
    /// A transport from `send(key, bytes)` and `recv(key, timeout)`, which
    /// waits at most `timeout` for the message `key` and removes it (e.g.
    /// a process group's store: `put` and `take`).
    pub fn new(
        send: impl Fn(&str, &[u8]) -> Result<()> + Send + Sync + 'static,
        recv: impl Fn(&str, Duration) -> Result<Vec<u8>> + Send + Sync + 'static,
    ) -> StageTransport {
        StageTransport { send: Box::new(send), recv: Box::new(recv) }
    }
}

/// `t` as a message: dtype name, shape, then its elements (little-endian).
fn encode(t: &Tensor) -> Result<Vec<u8>> {
    let name = t.dtype().name();
    let mut out = vec![name.len() as u8];
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(t.ndim() as u32).to_le_bytes());
    for &d in t.shape() {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    out.extend_from_slice(&t.to_host()?.to_le_bytes());
    Ok(out)
}

/// The tensor of a message made by [`encode`], on `device`.
fn decode(bytes: &[u8], device: Device, key: &str) -> Result<Tensor> {
    let bad = || Error::invalid("PipelineRank", format!("message {key:?} is not a tensor ({} bytes)", bytes.len()));
    let n = *bytes.first().ok_or_else(bad)? as usize;
    let name = std::str::from_utf8(bytes.get(1..1 + n).ok_or_else(bad)?).map_err(|_| bad())?;
    let dtype = DType::from_name(name).ok_or_else(bad)?;
    let mut at = 1 + n;
    let ndim = u32::from_le_bytes(bytes.get(at..at + 4).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
    at += 4;
    let mut shape = Vec::with_capacity(ndim.min(16));
    for _ in 0..ndim {
        let d = u64::from_le_bytes(bytes.get(at..at + 8).ok_or_else(bad)?.try_into().map_err(|_| bad())?);
        shape.push(usize::try_from(d).map_err(|_| bad())?);
        at += 8;
    }
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(bad)?;
    let body = &bytes[at..];
    if Some(body.len()) != numel.checked_mul(dtype.size_in_bytes()) {
        return Err(bad());
    }
    Tensor::from_host(HostBuffer::from_le_bytes(dtype, body)?, &shape, device)
}

/// One process's part of a pipeline run as one process per rank: the stages
/// of rank `rank` (stage `s` belongs to rank `s % ranks`), stepped in the
/// rank's order of the schedule, exchanging activations and gradients with
/// the other ranks' processes through a [`StageTransport`].
pub struct PipelineRank {
    kind: ScheduleKind,
    rank: usize,
    ranks: usize,
    num_stages: usize,
    /// This rank's stages by stage index.
    stages: BTreeMap<usize, PipelineStage>,
    microbatches: usize,
    loss_fn: LossFn,
    order: Vec<Action>,
    transport: StageTransport,
    /// Parameter name -> the stages that hold it, for names held by several.
    tied: BTreeMap<String, Vec<usize>>,
    timeout: Duration,
    steps: u64,
    bytes_sent: u64,
}

impl std::fmt::Debug for PipelineRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineRank")
            .field("kind", &self.kind)
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .field("stages", &self.stages.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl PipelineRank {
    /// Rank `rank` of `ranks` running `stages` (its own, stage `s` with `s %
    /// ranks == rank`, of `num_stages` in all) by schedule `kind` over
    /// `microbatches` microbatches; `tied` names the parameters several
    /// stages hold with the stages holding each (every rank passes the same).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: ScheduleKind,
        rank: usize,
        ranks: usize,
        stages: Vec<PipelineStage>,
        microbatches: usize,
        loss_fn: LossFn,
        tied: BTreeMap<String, Vec<usize>>,
        transport: StageTransport,
    ) -> Result<PipelineRank> {
        let bad = |m: String| Error::invalid("PipelineRank", m);
        if rank >= ranks {
            return Err(bad(format!("rank {rank} is not below the {ranks} ranks")));
        }
        let num_stages = stages.first().map(PipelineStage::num_stages).ok_or_else(|| bad("no stages".into()))?;
        if !num_stages.is_multiple_of(ranks) {
            return Err(bad(format!("{num_stages} stages do not spread evenly over {ranks} ranks")));
        }
        let mut own = BTreeMap::new();
        for s in stages {
            if s.stage_index() % ranks != rank || s.num_stages() != num_stages {
                return Err(bad(format!(
                    "stage {} of {} is not rank {rank}'s (stage s runs on rank s % {ranks})",
                    s.stage_index(),
                    s.num_stages()
                )));
            }
            own.insert(s.stage_index(), s);
        }
        if own.len() != num_stages / ranks {
            return Err(bad(format!("rank {rank} holds {} of its {} stages", own.len(), num_stages / ranks)));
        }
        let order = rank_orders(kind, ranks, num_stages / ranks, microbatches)?.swap_remove(rank);
        Ok(PipelineRank {
            kind,
            rank,
            ranks,
            num_stages,
            stages: own,
            microbatches,
            loss_fn,
            order,
            transport,
            tied,
            timeout: Duration::from_secs(600),
            steps: 0,
            bytes_sent: 0,
        })
    }

    /// How long a receive waits for another rank (default 600 s).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// This rank's stages, in model order.
    pub fn stages(&self) -> impl Iterator<Item = &PipelineStage> {
        self.stages.values()
    }

    /// This rank's stages, mutably.
    pub fn stages_mut(&mut self) -> impl Iterator<Item = &mut PipelineStage> {
        self.stages.values_mut()
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes of activations and gradients this rank sent in its last step.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    fn send(&mut self, key: &str, t: &Tensor) -> Result<()> {
        let bytes = encode(t)?;
        self.bytes_sent += (t.numel() * t.dtype().size_in_bytes()) as u64;
        (self.transport.send)(key, &bytes)
    }

    fn recv(&self, key: &str, device: Device) -> Result<Tensor> {
        let bytes = (self.transport.recv)(key, self.timeout)
            .map_err(|e| Error::invalid("PipelineRank", format!("rank {} waiting for {key:?}: {e}", self.rank)))?;
        decode(&bytes, device, key)
    }

    /// One step of this rank (every rank calls it with the same step
    /// count): `input` on the rank of the first stage and `target` on the
    /// rank of the last are the whole batch, split along dimension 0 into
    /// the microbatches; gradients accumulate in this rank's parameters'
    /// `.grad` as in [`super::PipelineSchedule::step`]. Returns the
    /// microbatches' losses on the last stage's rank, nothing elsewhere.
    pub fn step(&mut self, input: Option<&Tensor>, target: Option<&Tensor>) -> Result<Vec<Tensor>> {
        let (m, last) = (self.microbatches, self.num_stages - 1);
        let split = |t: Option<&Tensor>, what: &str, stage: usize| -> Result<Vec<Tensor>> {
            match (t, self.stages.get(&stage)) {
                (Some(t), Some(s)) => {
                    super::schedule::microbatches(t, m, what)?.iter().map(|x| x.to_device(s.device())).collect()
                }
                (None, Some(_)) => Err(Error::invalid(
                    "PipelineRank::step",
                    format!("rank {} runs stage {stage} and needs the {what}", self.rank),
                )),
                (_, None) => Ok(vec![]),
            }
        };
        let inputs = split(input, "input", 0)?;
        let targets = split(target, "target", last)?;
        let step = self.steps;
        self.steps += 1;
        self.bytes_sent = 0;
        // Tied gradients as the step starts (equal on every copy), counted once in the step's sum.
        let mut before = BTreeMap::new();
        for (name, holders) in &self.tied {
            if let Some(&s) = holders.iter().find(|s| self.stages.contains_key(s)) {
                if let Some(g) = super::schedule::param(&self.stages[&s], name)?.grad() {
                    let _g = no_grad();
                    before.insert(name.clone(), g.detach().deep_clone()?);
                }
            }
        }
        let result = self.run(step, &inputs, &targets);
        let finished: Result<Vec<()>> = self.stages.values_mut().map(PipelineStage::finish).collect();
        result?;
        finished?;
        self.sum_tied_grads(step, &before)?;
        match self.stages.get_mut(&last) {
            Some(s) => Ok(s.take_losses().into_iter().map(|(_, l)| l).collect()),
            None => Ok(vec![]),
        }
    }

    fn run(&mut self, step: u64, inputs: &[Tensor], targets: &[Tensor]) -> Result<()> {
        let (m, last) = (self.microbatches, self.num_stages - 1);
        for a in self.order.clone() {
            let (s, mb) = (a.stage, a.microbatch);
            let dev = self.stages[&s].device();
            match a.phase {
                Phase::Forward => {
                    let x =
                        if s == 0 { inputs[mb].clone() } else { self.recv(&format!("pp/{step}/act/{s}/{mb}"), dev)? };
                    let target = (s == last).then(|| &targets[mb]);
                    let loss_fn = self.loss_fn.clone();
                    let stage = self.stages.get_mut(&s).expect("own stage");
                    if let Some(y) = stage.forward(mb, &x, target, &loss_fn, m)? {
                        self.send(&format!("pp/{step}/act/{}/{mb}", s + 1), &y)?;
                    }
                }
                Phase::Backward => {
                    let g = if s == last {
                        targets[mb].clone()
                    } else {
                        self.recv(&format!("pp/{step}/grad/{s}/{mb}"), dev)?
                    };
                    let stage = self.stages.get_mut(&s).expect("own stage");
                    if let Some(dx) = stage.backward(mb, &g)? {
                        self.send(&format!("pp/{step}/grad/{}/{mb}", s - 1), &dx)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Every tied parameter's gradient becomes the sum over the stages that
    /// hold it, added in stage order on every holder; the gradient it had
    /// before the step (`before`, on every copy) counts once.
    fn sum_tied_grads(&mut self, step: u64, before: &BTreeMap<String, Tensor>) -> Result<()> {
        let _g = no_grad();
        for (name, holders) in self.tied.clone() {
            let mine: Vec<usize> = holders.iter().copied().filter(|s| self.stages.contains_key(s)).collect();
            if mine.is_empty() {
                continue;
            }
            // Each holder here sends its gradient to the holders on other ranks.
            for &s in &mine {
                let g = self.grad_of(s, &name)?;
                let (ranks, rank) = (self.ranks, self.rank);
                for &other in holders.iter().filter(|&&o| o % ranks != rank) {
                    self.send(&format!("pp/{step}/tied/{name}/{s}/{other}"), &g)?;
                }
            }
            for &s in &mine {
                let dev = self.stages[&s].device();
                let mut sum: Option<Tensor> = None;
                for &h in &holders {
                    let g = if self.stages.contains_key(&h) {
                        self.grad_of(h, &name)?.to_device(dev)?
                    } else {
                        self.recv(&format!("pp/{step}/tied/{name}/{h}/{s}"), dev)?
                    };
                    sum = Some(match sum {
                        None => g,
                        Some(a) => a.add(&g)?,
                    });
                }
                let sum = match (sum, before.get(&name)) {
                    (Some(a), Some(b)) => Some(a.sub(&b.to_device(dev)?.mul((holders.len() - 1) as f64)?)?),
                    (sum, _) => sum,
                };
                let p = super::schedule::param(&self.stages[&s], &name)?;
                p.set_grad(sum);
            }
        }
        Ok(())
    }

    /// The gradient of parameter `name` of own stage `s` (zeros when it got none).
    fn grad_of(&self, s: usize, name: &str) -> Result<Tensor> {
        let p = super::schedule::param(&self.stages[&s], name)?;
        match p.grad() {
            Some(g) => Ok(g),
            None => p.zeros_like(),
        }
    }

    /// Clips the gradients of every rank's parameters by their global L2
    /// norm (every rank calls it after the same step; a tied parameter
    /// counts once), and returns the norm before clipping.
    pub fn clip_grad_norm_(&mut self, max_norm: f64) -> Result<f64> {
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(Error::invalid("clip_grad_norm_", format!("max_norm must be >= 0, got {max_norm}")));
        }
        let _g = no_grad();
        let step = self.steps;
        let mut own = vec![];
        for (i, s) in &self.stages {
            s.module().visit_params("", &mut |n, p| {
                // A tied parameter counts on the first stage holding it.
                if self.tied.get(n).is_none_or(|h| h.first() == Some(i)) {
                    own.push(p.clone());
                }
            });
        }
        let n = crate::clip::grad_norm(&own)?.to_dtype(DType::F64)?.item_f64()?;
        let mine = Tensor::scalar(n * n, DType::F64)?;
        let (ranks, rank) = (self.ranks, self.rank);
        for r in (0..ranks).filter(|&r| r != rank) {
            self.send(&format!("pp/{step}/norm/{rank}/{r}"), &mine)?;
        }
        let mut sq = 0.0;
        for r in 0..self.ranks {
            sq += if r == self.rank {
                n * n
            } else {
                self.recv(&format!("pp/{step}/norm/{r}/{}", self.rank), Device::Cpu)?.item_f64()?
            };
        }
        let norm = sq.sqrt();
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        for s in self.stages.values() {
            for p in s.module().parameters() {
                if let Some(g) = p.grad() {
                    g.mul_(&Tensor::scalar(coef, (DType::F32, g.device()))?.to_dtype(g.dtype())?)?;
                }
            }
        }
        Ok(norm)
    }
}
