//! `PipelineStage`: one stage of a pipeline on its device, running its
//! forward and backward on one microbatch at a time, op by op or as two
//! captured programs of its own (Note [Pipeline stages]).
use crate::module::Module;
use kiln_autograd::{backward_with, enable_grad, grad, no_grad};
use kiln_tensor::capture::{compile, CaptureStats, Compiled};
use kiln_tensor::ir::Program;
use kiln_tensor::{constant, CaptureFn, Device, Error, Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// What a pipeline stage computes: the part of a model between two split
/// points.
pub trait StageModule: Module + Send + Sync {
    /// The stage's forward: the model's input (token ids) on the first
    /// stage, the previous stage's output on the others; the last stage's
    /// output goes to the loss function.
    fn forward(&self, input: &Tensor) -> Result<Tensor>;

    /// Whether `forward` draws random numbers now (dropout in training
    /// mode): a captured stage recomputes its forward in backward, which
    /// would draw other numbers than the forward did, so such a stage runs
    /// op by op only.
    fn draws_random_numbers(&self) -> bool;
}

/// A pipeline's loss: `(last stage's output, target) -> scalar loss` of one
/// microbatch (PyTorch's `loss_fn`).
pub type LossFn = Arc<dyn Fn(&Tensor, &Tensor) -> Result<Tensor> + Send + Sync>;

/// What a stage keeps of a microbatch between its forward and its backward.
enum Held {
    /// Run op by op: the input (a leaf requiring grad, after the first stage)
    /// and the root of the backward: the output, or on the last stage the
    /// microbatch's loss divided by the microbatches.
    Graph { input: Tensor, root: Tensor },
    /// Captured: the input only; the backward program recomputes the forward.
    Input(Tensor),
}

/// The two programs of a captured stage, and what they were made for.
struct Programs {
    forward: Compiled<CaptureFn>,
    backward: Compiled<CaptureFn>,
    microbatches: usize,
}

/// One stage of a pipeline (PyTorch's `PipelineStage`): a [`StageModule`]
/// whose parameters sit on `device`, its index among `num_stages`.
///
/// A schedule ([`super::PipelineSchedule`]) calls [`PipelineStage::forward`]
/// and [`PipelineStage::backward`] per microbatch. Run op by op (the
/// default), a forward keeps its autograd graph until the microbatch's
/// backward; captured ([`PipelineStage::set_compiled`]), the stage is two
/// programs made by `kiln::compile` on its device, traced once and replayed
/// for every microbatch: the forward, and a backward that recomputes the
/// forward from the kept input (so a stage holds one input per microbatch
/// in flight, as activation checkpointing does) and returns the input's
/// gradient and the parameters' gradient sums.
pub struct PipelineStage {
    module: Arc<dyn StageModule>,
    stage_index: usize,
    num_stages: usize,
    device: Device,
    compiled: bool,
    programs: Option<Programs>,
    held: HashMap<usize, Held>,
    /// Captured stages: the gradient sums of the step so far, one per trainable parameter.
    sums: Option<Vec<Tensor>>,
    peak_held: usize,
    losses: HashMap<usize, Tensor>,
}

impl std::fmt::Debug for PipelineStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineStage")
            .field("stage_index", &self.stage_index)
            .field("num_stages", &self.num_stages)
            .field("device", &self.device)
            .field("compiled", &self.compiled)
            .finish_non_exhaustive()
    }
}

impl PipelineStage {
    /// Stage `stage_index` of `num_stages`, running `module` on `device`,
    /// where every parameter of `module` must already be.
    pub fn new(
        module: impl StageModule + 'static,
        stage_index: usize,
        num_stages: usize,
        device: Device,
    ) -> Result<PipelineStage> {
        if stage_index >= num_stages {
            return Err(Error::invalid(
                "PipelineStage",
                format!("stage_index {stage_index} is not below num_stages {num_stages}"),
            ));
        }
        let mut stray = vec![];
        module.visit_params("", &mut |n, p| {
            if p.device() != device {
                stray.push(format!("{n} on {}", p.device()));
            }
        });
        if !stray.is_empty() {
            return Err(Error::device(
                "PipelineStage",
                format!("stage {stage_index} runs on {device}, but its parameters {} are not", stray.join(", ")),
            ));
        }
        Ok(PipelineStage {
            module: Arc::new(module),
            stage_index,
            num_stages,
            device,
            compiled: false,
            programs: None,
            held: HashMap::new(),
            sums: None,
            peak_held: 0,
            losses: HashMap::new(),
        })
    }

    /// Runs the stage as two captured programs (forward, and backward with
    /// the forward recomputed) instead of op by op.
    pub fn set_compiled(&mut self, on: bool) {
        self.compiled = on;
        self.programs = None;
    }

    /// The stage's module.
    pub fn module(&self) -> &dyn StageModule {
        &*self.module
    }

    /// The stage's index (0 is the first).
    pub fn stage_index(&self) -> usize {
        self.stage_index
    }

    /// How many stages the pipeline has.
    pub fn num_stages(&self) -> usize {
        self.num_stages
    }

    /// The device the stage runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    fn is_first(&self) -> bool {
        self.stage_index == 0
    }

    fn is_last(&self) -> bool {
        self.stage_index + 1 == self.num_stages
    }

    /// The most microbatches the stage held at once (forward run, backward
    /// not yet) since it was made.
    pub fn peak_held_microbatches(&self) -> usize {
        self.peak_held
    }

    /// The counts of the captured forward and backward programs, once they exist.
    pub fn capture_stats(&self) -> Option<(CaptureStats, CaptureStats)> {
        self.programs.as_ref().map(|p| (p.forward.stats().clone(), p.backward.stats().clone()))
    }

    /// The programs of a captured stage that have been traced: forward
    /// (none on the last stage, whose forward is its backward program's) and
    /// backward.
    pub fn programs(&self) -> Result<(Option<Program>, Program)> {
        let p = self.programs.as_ref().ok_or_else(|| {
            Error::invalid("PipelineStage::programs", "the stage is not captured or has not run a microbatch yet")
        })?;
        let forward = if self.is_last() { None } else { Some(p.forward.program()?) };
        Ok((forward, p.backward.program()?))
    }

    /// The parameters the stage trains, in visiting order.
    fn trainable(&self) -> Vec<Tensor> {
        self.module.parameters().into_iter().filter(Tensor::requires_grad).collect()
    }

    /// The forward of `microbatch` on `input` (on the stage's device): the
    /// output to send to the next stage, or `None` on the last stage, whose
    /// output goes to `loss_fn` with `target` (the microbatch's loss is then
    /// kept for [`PipelineStage::take_losses`]). Each microbatch's loss
    /// counts `1 / microbatches` in the gradients, so a step's gradients are
    /// those of the microbatches' mean loss.
    pub fn forward(
        &mut self,
        microbatch: usize,
        input: &Tensor,
        target: Option<&Tensor>,
        loss_fn: &LossFn,
        microbatches: usize,
    ) -> Result<Option<Tensor>> {
        if self.held.contains_key(&microbatch) {
            return Err(Error::invalid(
                "PipelineStage::forward",
                format!("stage {} already holds microbatch {microbatch}", self.stage_index),
            ));
        }
        let out = if self.compiled {
            if self.module.draws_random_numbers() {
                return Err(Error::invalid(
                    "PipelineStage::forward",
                    format!(
                        "stage {} draws random numbers (dropout in training mode); a captured stage recomputes its \
                         forward in backward and would draw others: run it op by op (set_compiled(false)) or in eval mode",
                        self.stage_index
                    ),
                ));
            }
            self.ensure_programs(loss_fn, microbatches);
            self.held.insert(microbatch, Held::Input(input.clone()));
            if self.is_last() {
                None
            } else {
                Some(self.captured()?.forward.call(std::slice::from_ref(input))?.remove(0))
            }
        } else {
            let _g = enable_grad();
            let x = self.leaf_input(input)?;
            let y = self.module.forward(&x)?;
            if self.is_last() {
                let target = target.ok_or_else(|| self.no_target())?;
                let loss = loss_fn(&y, target)?;
                let root = constant(|| loss.div(microbatches as f64))?;
                self.losses.insert(microbatch, loss.detach());
                self.held.insert(microbatch, Held::Graph { input: x, root });
                None
            } else {
                self.held.insert(microbatch, Held::Graph { input: x, root: y.clone() });
                Some(y.detach())
            }
        };
        self.peak_held = self.peak_held.max(self.held.len());
        Ok(out)
    }

    /// The backward of `microbatch`: `grad_output` is the gradient of the
    /// stage's output (from the next stage), or on the last stage the
    /// target. Parameters' gradients accumulate (op by op into `.grad`;
    /// captured, into sums that [`PipelineStage::finish`] adds to `.grad`);
    /// returns the input's gradient to send back, `None` on the first stage.
    pub fn backward(&mut self, microbatch: usize, grad_output: &Tensor) -> Result<Option<Tensor>> {
        let held = self.held.remove(&microbatch).ok_or_else(|| {
            Error::invalid(
                "PipelineStage::backward",
                format!("stage {} has not run the forward of microbatch {microbatch}", self.stage_index),
            )
        })?;
        match held {
            Held::Graph { input, root } => {
                let g = if self.is_last() { Tensor::ones_like(&root)? } else { grad_output.clone() };
                backward_with(&root, &g, false)?;
                if self.is_first() {
                    return Ok(None);
                }
                let dx = input.grad().ok_or_else(|| {
                    Error::invalid(
                        "PipelineStage::backward",
                        format!("stage {}'s output does not depend on its input", self.stage_index),
                    )
                })?;
                Ok(Some(dx))
            }
            Held::Input(x) => {
                let sums = match self.sums.take() {
                    Some(s) => s,
                    None => self.trainable().iter().map(Tensor::zeros_like).collect::<Result<Vec<_>>>()?,
                };
                let mut args = vec![x, grad_output.clone()];
                args.extend(sums);
                let mut out = self.captured()?.backward.call(&args)?.into_iter();
                if self.stage_index + 1 == self.num_stages {
                    self.losses.insert(microbatch, out.next().expect("the program returns the loss"));
                }
                let dx = if self.stage_index == 0 { None } else { out.next() };
                self.sums = Some(out.collect());
                Ok(dx)
            }
        }
    }

    /// Ends a step: a captured stage adds its gradient sums to its
    /// parameters' `.grad` (as backward would have accumulated them).
    /// Microbatches still held are an error (and are dropped).
    pub fn finish(&mut self) -> Result<()> {
        if !self.held.is_empty() {
            let mut left: Vec<usize> = self.held.keys().copied().collect();
            left.sort();
            self.held.clear();
            self.sums = None;
            return Err(Error::invalid(
                "PipelineStage::finish",
                format!("stage {} still holds microbatches {left:?} without their backward", self.stage_index),
            ));
        }
        let Some(sums) = self.sums.take() else { return Ok(()) };
        let _g = no_grad();
        for (p, s) in self.trainable().iter().zip(sums) {
            p.set_grad(Some(match p.grad() {
                Some(g) => g.add(&s)?,
                None => s,
            }));
        }
        Ok(())
    }

    /// The losses of the microbatches the last stage has finished, by
    /// microbatch (empty on other stages); they are removed.
    pub fn take_losses(&mut self) -> Vec<(usize, Tensor)> {
        let mut out: Vec<(usize, Tensor)> = self.losses.drain().collect();
        out.sort_by_key(|(i, _)| *i);
        out
    }

    /// The captured programs, which a captured forward makes.
    fn captured(&mut self) -> Result<&mut Programs> {
        let i = self.stage_index;
        self.programs.as_mut().ok_or_else(|| {
            Error::invalid("PipelineStage", format!("stage {i}'s programs were dropped (set_compiled) mid-step"))
        })
    }

    fn no_target(&self) -> Error {
        Error::invalid("PipelineStage::forward", format!("the last stage ({}) needs a target", self.stage_index))
    }

    /// Makes the captured programs for `microbatches` microbatches, unless
    /// they exist for that count.
    fn ensure_programs(&mut self, loss_fn: &LossFn, microbatches: usize) {
        if self.programs.as_ref().is_some_and(|p| p.microbatches == microbatches) {
            return;
        }
        let (first, last) = (self.is_first(), self.is_last());
        let m = self.module.clone();
        let forward: CaptureFn = Box::new(move |x: &[Tensor]| {
            let _g = no_grad();
            Ok(vec![m.forward(&x[0])?])
        });
        let (m, loss_fn) = (self.module.clone(), loss_fn.clone());
        let backward: CaptureFn = Box::new(move |args: &[Tensor]| {
            let _g = enable_grad();
            let params: Vec<Tensor> = m.parameters().into_iter().filter(Tensor::requires_grad).collect();
            let (x, g_or_target, sums) = (&args[0], &args[1], &args[2..]);
            let x = if first {
                x.clone()
            } else {
                let x = x.detach();
                x.requires_grad_(true)?;
                x
            };
            let y = m.forward(&x)?;
            let mut out = vec![];
            let grads = if last {
                let loss = loss_fn(&y, g_or_target)?;
                let root = constant(|| loss.div(microbatches as f64))?;
                out.push(loss.detach());
                grad(&[&root], &with_input(first, &x, &params), None, false, false)?
            } else {
                grad(&[&y], &with_input(first, &x, &params), Some(&[g_or_target]), false, false)?
            };
            let mut grads = grads.into_iter();
            if !first {
                out.push(grads.next().flatten().ok_or_else(|| {
                    Error::invalid("PipelineStage::backward", "the stage's output does not depend on its input")
                })?);
            }
            let _g = no_grad();
            for (s, g) in sums.iter().zip(grads) {
                out.push(match g {
                    Some(g) => s.add(&g)?,
                    None => s.clone(),
                });
            }
            Ok(out)
        });
        self.programs = Some(Programs {
            forward: compile(self.device, forward),
            backward: compile(self.device, backward),
            microbatches,
        });
    }

    /// The input as the stage's graph starts from it: a leaf requiring grad
    /// after the first stage (its gradient goes back), the ids themselves on it.
    fn leaf_input(&self, input: &Tensor) -> Result<Tensor> {
        if self.is_first() {
            return Ok(input.clone());
        }
        let x = input.detach();
        x.requires_grad_(true)?;
        Ok(x)
    }
}

/// `x` (unless it is the first stage's ids) followed by `params`: what a
/// backward differentiates.
fn with_input<'a>(first: bool, x: &'a Tensor, params: &'a [Tensor]) -> Vec<&'a Tensor> {
    let mut v: Vec<&Tensor> = if first { vec![] } else { vec![x] };
    v.extend(params.iter());
    v
}
