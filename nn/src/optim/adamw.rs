//! AdamW with the semantics of `torch.optim.AdamW` (default single-tensor
//! implementation): decoupled weight decay, bias correction, optional AMSGrad.
use super::fused::{self, AdamWScalars};
use super::{check_grad, check_hyper, resolve_groups, IntoParamGroups, Optimizer, ParamGroup};
use kiln_autograd::no_grad;
use kiln_tensor::trace::{ConstantScope, Watch};
use kiln_tensor::{DType, Result, Tensor};
use std::collections::HashMap;

/// Hyperparameters of [`AdamW`]; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// `(beta1, beta2)`: decay rates of the first and second moments (default `(0.9, 0.999)`).
    pub betas: (f64, f64),
    /// Added to the denominator for stability (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 1e-2): `p *= 1 - lr * weight_decay` before the update.
    pub weight_decay: f64,
    /// Normalise by the running maximum of the second moment (default false).
    pub amsgrad: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 1e-2, amsgrad: false }
    }
}

/// The state AdamW keeps for one parameter (PyTorch's `optimizer.state[p]`).
#[derive(Debug, Clone)]
pub struct AdamWParamState {
    /// Number of updates this parameter has had.
    pub step: u64,
    /// First moment `m`, in the parameter's dtype.
    pub exp_avg: Tensor,
    /// Second moment `v`, in the parameter's dtype.
    pub exp_avg_sq: Tensor,
    /// Running maximum of `v` (AMSGrad only).
    pub max_exp_avg_sq: Option<Tensor>,
}

impl AdamWParamState {
    /// A fresh state for `p`: step 0, zero moments shaped like `p`.
    fn zeros(p: &Tensor, amsgrad: bool) -> Result<AdamWParamState> {
        Ok(AdamWParamState {
            step: 0,
            exp_avg: super::zeros_like(p)?,
            exp_avg_sq: super::zeros_like(p)?,
            max_exp_avg_sq: if amsgrad { Some(super::zeros_like(p)?) } else { None },
        })
    }
}

/// AdamW (Loshchilov & Hutter), exactly as `torch.optim.AdamW` computes it, per
/// parameter with a gradient, with `t` its step count:
///
/// ```text
/// p *= 1 - lr * weight_decay
/// m  = lerp(m, g, 1 - beta1)                 // m + (1 - beta1) * (g - m)
/// v  = beta2 * v + (1 - beta2) * g * g
/// p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
///
/// (With AMSGrad, `v` in the last line is the running maximum of `v`.) The
/// scalar factors are computed in f64 and applied in the parameter's dtype, like
/// PyTorch. State tensors have the parameter's dtype and device.
///
/// For contiguous CPU parameters the update is one fused pass over `p`, `g`, `m`
/// and `v` that allocates nothing; elsewhere it is a short sequence of tensor ops
/// (any backend). Both give bit-identical results.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
/// let w = Tensor::new([0.5f32])?;
/// w.requires_grad_(true)?;
/// let mut opt = AdamW::new(vec![w.clone()], AdamWConfig { lr: 0.1, weight_decay: 0.0, ..Default::default() })?;
/// w.mul(3.0)?.sum()?.backward()?; // g = 3
/// opt.step()?;
/// // The first step moves by lr * g / |g| = 0.1.
/// assert!((w.item::<f32>()? - 0.4).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct AdamW {
    groups: Vec<ParamGroup>,
    initial_lrs: Vec<f64>,
    config: AdamWConfig,
    /// Per group, per parameter.
    state: Vec<Vec<Option<AdamWParamState>>>,
    /// Capturable mode (see [`AdamW::set_capturable`]): per group, the learning
    /// rate on the parameters' device and the host value it holds.
    capturable: bool,
    device_lr: Vec<Option<(f64, Tensor)>>,
    /// Capturable mode: per group, per parameter, the step count on the device.
    device_step: Vec<Vec<Option<Tensor>>>,
    /// Moves whenever a host value a traced step reads may have changed (see
    /// Note [Host values]): the groups handed out mutably, a learning rate set
    /// on the host (not in capturable mode, whose learning rates live on the
    /// device), a loaded state.
    settings: Watch,
}

impl AdamW {
    /// An AdamW over `params` (groups, named parameters or tensors). Groups
    /// without their own `lr` / `weight_decay` take the config's.
    pub fn new(params: impl IntoParamGroups, config: AdamWConfig) -> Result<AdamW> {
        const OP: &str = "AdamW";
        check_hyper(OP, "epsilon value", config.eps, config.eps >= 0.0)?;
        let (b1, b2) = config.betas;
        check_hyper(OP, "beta parameter at index 0", b1, (0.0..1.0).contains(&b1))?;
        check_hyper(OP, "beta parameter at index 1", b2, (0.0..1.0).contains(&b2))?;
        let (groups, initial_lrs) = resolve_groups(OP, params.into_param_groups(), config.lr, config.weight_decay)?;
        let state = groups.iter().map(|g| vec![None; g.params.len()]).collect();
        let device_step = groups.iter().map(|g| vec![None; g.params.len()]).collect();
        let device_lr = vec![None; groups.len()];
        Ok(AdamW {
            groups,
            initial_lrs,
            config,
            state,
            capturable: false,
            device_lr,
            device_step,
            settings: Watch::new("AdamW settings", 0),
        })
    }

    /// Capturable mode (PyTorch's `capturable=True`), for steps traced by
    /// `kiln::compile`: the step count, the bias corrections and the learning
    /// rate live on the parameters' device and the state is updated in place,
    /// so a captured step reads them instead of baking host values into the
    /// program. `set_lr` / `set_lr_factor` (what schedules call) write the
    /// device learning rate; call them outside the compiled function. The
    /// bias corrections are then computed in the parameters' dtype on the
    /// device, as PyTorch's capturable AdamW does, instead of in f64 on the host.
    ///
    /// Turning it on also creates, right away, the state of every parameter
    /// that requires a gradient and has none yet (zero moments, step 0: the
    /// same as a fresh state) and the device step counts and learning rates,
    /// which a host optimizer makes on a parameter's first step. A traced
    /// step then finds its state already there, so its first trace is the
    /// same program as every later one (one compile instead of two). Such
    /// state appears in `state` and `state_dict` with step 0 before any step.
    pub fn set_capturable(&mut self, on: bool) -> Result<()> {
        self.capturable = on;
        self.settings.bump();
        if on {
            self.make_capturable_state()?;
        }
        Ok(())
    }

    /// Capturable mode: the missing state, device step counts and device
    /// learning rates, made outside any traced function.
    fn make_capturable_state(&mut self) -> Result<()> {
        let _ng = no_grad();
        for (gi, g) in self.groups.iter().enumerate() {
            for (pi, p) in g.params.iter().enumerate() {
                if !p.requires_grad() {
                    continue;
                }
                let s = match &mut self.state[gi][pi] {
                    Some(s) => s,
                    slot => slot.insert(AdamWParamState::zeros(p, self.config.amsgrad)?),
                };
                if self.device_step[gi][pi].is_none() {
                    self.device_step[gi][pi] = Some(Tensor::full(&[], s.step as f64, (p.dtype(), p.device()))?);
                }
                if self.device_lr[gi].is_none() {
                    self.device_lr[gi] = Some((g.lr(), Tensor::full(&[], g.lr(), (p.dtype(), p.device()))?));
                }
            }
        }
        Ok(())
    }

    /// Whether capturable mode is on.
    pub fn is_capturable(&self) -> bool {
        self.capturable
    }

    /// Writes the groups' learning rates into their device copies (capturable mode).
    fn sync_device_lr(&mut self) -> Result<()> {
        for (g, d) in self.groups.iter().zip(self.device_lr.iter_mut()) {
            if let Some((v, t)) = d {
                if *v != g.lr() {
                    let _ng = no_grad();
                    t.fill_(g.lr())?;
                    *v = g.lr();
                }
            }
        }
        Ok(())
    }

    /// The capturable update: the same arithmetic with the step count, bias
    /// corrections and learning rate as device tensors, and the state updated in place.
    #[allow(clippy::too_many_arguments)]
    fn update_capturable(
        &self,
        p: &Tensor,
        grad: &Tensor,
        st: &mut AdamWParamState,
        step_t: &Tensor,
        lr_t: &Tensor,
        wd: f64,
    ) -> Result<()> {
        st.step += 1;
        let (b1, b2) = self.config.betas;
        let opts = (p.dtype(), p.device());
        step_t.add_(1.0)?;
        // bias_correction = 1 - beta^step, on the device.
        let bc1 = Tensor::full(&[], b1, opts)?.pow(step_t)?.neg()?.add(1.0)?;
        let bc2 = Tensor::full(&[], b2, opts)?.pow(step_t)?.neg()?.add(1.0)?;
        if wd != 0.0 {
            p.mul_(&lr_t.mul(-wd)?.add(1.0)?)?;
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        st.exp_avg.add_(&grad.sub(&st.exp_avg)?.mul(1.0 - b1)?)?;
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        st.exp_avg_sq.mul_(b2)?;
        st.exp_avg_sq.add_(&grad.mul(1.0 - b2)?.mul(grad)?)?;
        let second = match &st.max_exp_avg_sq {
            Some(mx) => {
                mx.copy_(&mx.maximum(&st.exp_avg_sq)?)?;
                mx.clone()
            }
            None => st.exp_avg_sq.clone(),
        };
        let denom = second.sqrt()?.div(&bc2.sqrt()?)?.add(self.config.eps)?;
        let neg_step_size = lr_t.div(&bc1)?.neg()?;
        p.add_(&st.exp_avg.mul(&neg_step_size)?.div(&denom)?)?;
        Ok(())
    }

    /// Sets group `i`'s learning rate to `lr(i)`, telling `lr_changed` only when one moved.
    fn set_group_lrs(&mut self, lr: impl Fn(usize) -> f64) {
        let mut moved = false;
        for (i, g) in self.groups.iter_mut().enumerate() {
            let v = lr(i);
            if g.lr != Some(v) {
                g.lr = Some(v);
                moved = true;
            }
        }
        if moved {
            self.lr_changed();
        }
    }

    /// The hyperparameters it was built with (per-group `lr` / `weight_decay` live in the groups).
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The state of a parameter (by its name), once it has had a step.
    pub fn state(&self, name: &str) -> Option<&AdamWParamState> {
        self.groups.iter().zip(&self.state).find_map(|(g, st)| {
            let i = g.names.iter().position(|n| n == name)?;
            st[i].as_ref()
        })
    }

    /// The update of one parameter with gradient `grad`.
    fn update(&self, p: &Tensor, grad: &Tensor, st: &mut AdamWParamState, lr: f64, wd: f64) -> Result<()> {
        st.step += 1;
        let (b1, b2) = self.config.betas;
        let t = st.step as i32;
        let bias_correction1 = 1.0 - b1.powi(t);
        let bias_correction2 = 1.0 - b2.powi(t);
        let s = AdamWScalars {
            decay: 1.0 - lr * wd,
            apply_decay: wd != 0.0,
            weight1: 1.0 - b1,
            beta2: b2,
            one_minus_beta2: 1.0 - b2,
            bias_correction2_sqrt: bias_correction2.sqrt(),
            eps: self.config.eps,
            neg_step_size: -(lr / bias_correction1),
        };
        if fused::adamw_host(p, grad, st, &s)? {
            return Ok(());
        }
        // The same arithmetic, op by op, for any backend. Each line matches one
        // statement of torch's `_single_tensor_adam`.
        if s.apply_decay {
            p.mul_(s.decay)?;
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        let diff = grad.sub(&st.exp_avg)?;
        st.exp_avg = if fused::lerp_weight_is_small(s.weight1) {
            st.exp_avg.add(&diff.mul(s.weight1)?)?
        } else {
            grad.sub(&diff.mul(fused::lerp_complement(s.weight1, p.dtype()))?)?
        };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        st.exp_avg_sq = st.exp_avg_sq.mul(s.beta2)?.add(&grad.mul(s.one_minus_beta2)?.mul(grad)?)?;
        let second = match &mut st.max_exp_avg_sq {
            Some(mx) => {
                *mx = mx.maximum(&st.exp_avg_sq)?;
                mx.clone()
            }
            None => st.exp_avg_sq.clone(),
        };
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = second.sqrt()?.div(s.bias_correction2_sqrt)?.add(s.eps)?;
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        p.add_(&st.exp_avg.mul(s.neg_step_size)?.div(&denom)?)?;
        Ok(())
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        let _guard = no_grad();
        let _c = ConstantScope::enter();
        self.settings.get();
        if self.capturable {
            self.sync_device_lr()?;
        }
        let mut state = std::mem::take(&mut self.state);
        let mut device_lr = std::mem::take(&mut self.device_lr);
        let mut device_step = std::mem::take(&mut self.device_step);
        let r = (|| {
            for (gi, (g, st)) in self.groups.iter().zip(state.iter_mut()).enumerate() {
                let (lr, wd) = (g.lr(), g.weight_decay());
                for (pi, ((name, p), slot)) in g.names.iter().zip(&g.params).zip(st.iter_mut()).enumerate() {
                    let Some(grad) = p.grad() else { continue };
                    check_grad("AdamW.step", name, p, &grad)?;
                    let grad = if grad.dtype() == p.dtype() { grad } else { grad.to_dtype(p.dtype())? };
                    let s = match slot {
                        Some(s) => s,
                        None => slot.insert(AdamWParamState::zeros(p, self.config.amsgrad)?),
                    };
                    if self.capturable {
                        // The group's learning rate and the parameter's step count on the
                        // device, made on their first use.
                        let lr_t = match &device_lr[gi] {
                            Some((_, t)) => t.clone(),
                            None => {
                                let t = Tensor::full(&[], lr, (p.dtype(), p.device()))?;
                                device_lr[gi] = Some((lr, t.clone()));
                                t
                            }
                        };
                        let step_t = match &device_step[gi][pi] {
                            Some(t) => t.clone(),
                            None => {
                                let t = Tensor::full(&[], s.step as f64, (p.dtype(), p.device()))?;
                                device_step[gi][pi] = Some(t.clone());
                                t
                            }
                        };
                        self.update_capturable(p, &grad, s, &step_t, &lr_t, wd)?;
                    } else {
                        self.update(p, &grad, s, lr, wd)?;
                    }
                }
            }
            Ok(())
        })();
        self.state = state;
        self.device_lr = device_lr;
        self.device_step = device_step;
        r
    }

    fn lr_changed(&mut self) {
        if self.capturable {
            // A failed write is retried (and reported) by the next `step`.
            let _ = self.sync_device_lr();
        } else {
            self.settings.bump();
        }
    }

    fn set_lr(&mut self, lr: f64) {
        self.set_group_lrs(|_| lr);
    }

    fn set_lr_factor(&mut self, factor: f64) {
        let init = self.initial_lrs.clone();
        self.set_group_lrs(|i| init[i] * factor);
    }

    fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        // Anything may change through it.
        self.settings.bump();
        &mut self.groups
    }

    fn initial_lrs(&self) -> &[f64] {
        &self.initial_lrs
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![];
        for (g, st) in self.groups.iter().zip(&self.state) {
            for (name, s) in g.names.iter().zip(st) {
                let Some(s) = s else { continue };
                out.push((format!("{name}.step"), Tensor::scalar(s.step as i64, DType::I64)?));
                out.push((format!("{name}.exp_avg"), s.exp_avg.clone()));
                out.push((format!("{name}.exp_avg_sq"), s.exp_avg_sq.clone()));
                if let Some(m) = &s.max_exp_avg_sq {
                    out.push((format!("{name}.max_exp_avg_sq"), m.clone()));
                }
            }
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        const OP: &str = "AdamW.load_state_dict";
        let fields = ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"];
        let mut by_param: HashMap<String, HashMap<String, Tensor>> =
            super::group_state_entries(OP, &self.groups, &fields, state)?;
        let mut new_state = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let mut st = Vec::with_capacity(g.params.len());
            for (name, p) in g.names.iter().zip(&g.params) {
                let Some(mut e) = by_param.remove(name) else {
                    st.push(None);
                    continue;
                };
                let step = super::take_step(OP, name, &mut e)?;
                let missing = |f: &str| kiln_tensor::Error::invalid(OP, format!("the state of {name} has no {f}"));
                let exp_avg = super::take_like(OP, name, "exp_avg", p, &mut e)?.ok_or_else(|| missing("exp_avg"))?;
                let exp_avg_sq =
                    super::take_like(OP, name, "exp_avg_sq", p, &mut e)?.ok_or_else(|| missing("exp_avg_sq"))?;
                let max_exp_avg_sq = super::take_like(OP, name, "max_exp_avg_sq", p, &mut e)?;
                let max_exp_avg_sq = match (self.config.amsgrad, max_exp_avg_sq) {
                    (true, None) => return Err(missing("max_exp_avg_sq (the optimizer uses AMSGrad)")),
                    (false, Some(_)) => {
                        return Err(kiln_tensor::Error::invalid(
                            OP,
                            format!("the state of {name} has max_exp_avg_sq, but the optimizer does not use AMSGrad"),
                        ))
                    }
                    (_, m) => m,
                };
                st.push(Some(AdamWParamState { step, exp_avg, exp_avg_sq, max_exp_avg_sq }));
            }
            new_state.push(st);
        }
        self.state = new_state;
        self.settings.bump();
        // The device step counts restart from the loaded host counts.
        self.device_step = self.groups.iter().map(|g| vec![None; g.params.len()]).collect();
        if self.capturable {
            self.make_capturable_state()?;
        }
        Ok(())
    }
}
