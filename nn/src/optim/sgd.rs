//! Stochastic gradient descent with the semantics of `torch.optim.SGD`:
//! momentum, dampening, Nesterov momentum and (coupled) weight decay.
use super::{check_grad, check_hyper, resolve_groups, IntoParamGroups, Optimizer, ParamGroup};
use kiln_autograd::no_grad;
use kiln_tensor::trace::{ConstantScope, Watch};
use kiln_tensor::{Error, Result, Tensor};

/// Hyperparameters of [`SGD`]; the defaults are PyTorch's except `lr`, which
/// PyTorch also defaults to 1e-3.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate (default 1e-3).
    pub lr: f64,
    /// Momentum factor (default 0: plain SGD).
    pub momentum: f64,
    /// Dampening of the momentum (default 0).
    pub dampening: f64,
    /// L2 penalty added to the gradient: `g += weight_decay * p` (default 0).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

/// SGD, exactly as `torch.optim.SGD` computes it, per parameter with a gradient:
///
/// ```text
/// g = g + weight_decay * p
/// b = g                                    (first step)
/// b = momentum * b + (1 - dampening) * g   (later steps)
/// g = g + momentum * b  (Nesterov)  or  g = b
/// p -= lr * g
/// ```
///
/// The momentum buffer exists only when `momentum != 0`; it starts as a copy of
/// the first gradient (no dampening on that step), as in PyTorch.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::optim::{Optimizer, SgdConfig, SGD};
/// let w = Tensor::new([1.0f32, 2.0])?;
/// w.requires_grad_(true)?;
/// let mut opt = SGD::new(vec![w.clone()], SgdConfig { lr: 0.5, ..Default::default() })?;
/// w.sum()?.backward()?; // g = [1, 1]
/// opt.step()?;
/// assert_eq!(w.to_vec::<f32>()?, vec![0.5, 1.5]);
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct SGD {
    groups: Vec<ParamGroup>,
    initial_lrs: Vec<f64>,
    config: SgdConfig,
    /// Momentum buffers, per group, per parameter.
    buffers: Vec<Vec<Option<Tensor>>>,
    /// Moves whenever a host value a traced step reads may have changed (see
    /// Note [Host values]): the groups handed out mutably, a learning rate set,
    /// a loaded state.
    settings: Watch,
}

impl SGD {
    /// An SGD over `params` (groups, named parameters or tensors).
    pub fn new(params: impl IntoParamGroups, config: SgdConfig) -> Result<SGD> {
        const OP: &str = "SGD";
        check_hyper(OP, "momentum value", config.momentum, config.momentum >= 0.0)?;
        check_hyper(OP, "dampening value", config.dampening, true)?;
        if config.nesterov && (config.momentum <= 0.0 || config.dampening != 0.0) {
            return Err(Error::invalid(OP, "Nesterov momentum requires a momentum and zero dampening"));
        }
        let (groups, initial_lrs) = resolve_groups(OP, params.into_param_groups(), config.lr, config.weight_decay)?;
        let buffers = groups.iter().map(|g| vec![None; g.params.len()]).collect();
        Ok(SGD { groups, initial_lrs, config, buffers, settings: Watch::new("SGD settings", 0) })
    }

    /// The hyperparameters it was built with (per-group `lr` / `weight_decay` live in the groups).
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The momentum buffer of a parameter (by name), once it has one.
    pub fn momentum_buffer(&self, name: &str) -> Option<&Tensor> {
        self.groups.iter().zip(&self.buffers).find_map(|(g, b)| {
            let i = g.names.iter().position(|n| n == name)?;
            b[i].as_ref()
        })
    }
}

impl SGD {
    /// Sets group `i`'s learning rate to `lr(i)`; a traced step sees the change
    /// (its learning rates are host values, see Note [Host values]).
    fn set_group_lrs(&mut self, lr: impl Fn(usize) -> f64) {
        for (i, g) in self.groups.iter_mut().enumerate() {
            let v = lr(i);
            if g.lr != Some(v) {
                g.lr = Some(v);
                self.settings.bump();
            }
        }
    }
}

impl Optimizer for SGD {
    fn step(&mut self) -> Result<()> {
        let _guard = no_grad();
        let _c = ConstantScope::enter();
        self.settings.get();
        let c = self.config;
        for (g, bufs) in self.groups.iter().zip(self.buffers.iter_mut()) {
            let (lr, wd) = (g.lr(), g.weight_decay());
            for ((name, p), buf) in g.names.iter().zip(&g.params).zip(bufs.iter_mut()) {
                let Some(grad) = p.grad() else { continue };
                check_grad("SGD.step", name, p, &grad)?;
                let mut d_p = if grad.dtype() == p.dtype() { grad } else { grad.to_dtype(p.dtype())? };
                if wd != 0.0 {
                    d_p = d_p.add(&p.mul(wd)?)?;
                }
                if c.momentum != 0.0 {
                    let b = match buf.take() {
                        None => d_p.deep_clone()?.detach(),
                        Some(b) => {
                            let scaled = if c.dampening == 0.0 { d_p.clone() } else { d_p.mul(1.0 - c.dampening)? };
                            b.mul(c.momentum)?.add(&scaled)?
                        }
                    };
                    d_p = if c.nesterov { d_p.add(&b.mul(c.momentum)?)? } else { b.clone() };
                    *buf = Some(b);
                }
                p.add_(&d_p.mul(-lr)?)?;
            }
        }
        Ok(())
    }

    fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    fn param_groups_mut(&mut self) -> &mut [ParamGroup] {
        // Anything may change through it.
        self.settings.bump();
        &mut self.groups
    }

    fn set_lr(&mut self, lr: f64) {
        self.set_group_lrs(|_| lr);
    }

    fn set_lr_factor(&mut self, factor: f64) {
        let init = self.initial_lrs.clone();
        self.set_group_lrs(|i| init[i] * factor);
    }

    fn initial_lrs(&self) -> &[f64] {
        &self.initial_lrs
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![];
        for (g, bufs) in self.groups.iter().zip(&self.buffers) {
            for (name, b) in g.names.iter().zip(bufs) {
                if let Some(b) = b {
                    out.push((format!("{name}.momentum_buffer"), b.clone()));
                }
            }
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        const OP: &str = "SGD.load_state_dict";
        self.settings.bump();
        let mut by_param = super::group_state_entries(OP, &self.groups, &["momentum_buffer"], state)?;
        let mut buffers = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let mut bufs = Vec::with_capacity(g.params.len());
            for (name, p) in g.names.iter().zip(&g.params) {
                let b = match by_param.get_mut(name) {
                    Some(e) => super::take_like(OP, name, "momentum_buffer", p, e)?,
                    None => None,
                };
                bufs.push(b);
            }
            buffers.push(bufs);
        }
        self.buffers = buffers;
        Ok(())
    }
}
