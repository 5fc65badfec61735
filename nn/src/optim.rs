//! Optimizers: the [`Optimizer`] trait, parameter groups with per-group learning
//! rate and weight decay, [`SGD`] and [`AdamW`] with `torch.optim` semantics,
//! and the state (`exp_avg`, `step`, ...) that training checkpoints save.
//!
//! ```
//! use kiln::prelude::*;
//! use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
//! let w = Tensor::new([1.0f32, -2.0])?;
//! w.requires_grad_(true)?;
//! let mut opt = AdamW::new(vec![("w".to_string(), w.clone())], AdamWConfig { lr: 0.1, ..Default::default() })?;
//! for _ in 0..3 {
//!     opt.zero_grad();
//!     w.mul(&w)?.sum()?.backward()?; // minimise |w|^2
//!     opt.step()?;
//! }
//! let v = w.to_vec::<f32>()?;
//! assert!(v[0] < 1.0 && v[1] > -2.0);
//! # Ok::<(), kiln::Error>(())
//! ```
//!
//! Updates run under `no_grad` and write into the parameter tensors in place, so
//! every view or alias of a parameter sees the new values (PyTorch's rule).

mod adamw;
mod fused;
mod sgd;

pub use adamw::{AdamW, AdamWConfig, AdamWParamState};
pub use sgd::{SgdConfig, SGD};

use kiln_tensor::{Error, Result, Tensor};
use std::collections::{HashMap, HashSet};

/// A set of parameters that share a learning rate and a weight decay
/// (PyTorch's `param_groups` entry). `lr` / `weight_decay` left `None` take
/// the optimizer's defaults when the optimizer is built; afterwards they are
/// always `Some`, and a program may change them between steps.
///
/// Each parameter has a name (usually its Hugging Face name from
/// `named_parameters()`); the names key the optimizer state in checkpoints.
#[derive(Debug, Clone, Default)]
pub struct ParamGroup {
    /// One name per parameter (empty: names `param_groups.{g}.{i}` are assigned).
    pub names: Vec<String>,
    /// The parameters, updated in place by `step()`.
    pub params: Vec<Tensor>,
    /// Learning rate of this group (`None`: the optimizer's).
    pub lr: Option<f64>,
    /// Weight decay of this group (`None`: the optimizer's).
    pub weight_decay: Option<f64>,
}

impl ParamGroup {
    /// A group of named parameters with the optimizer's default hyperparameters.
    pub fn new(named: impl IntoIterator<Item = (String, Tensor)>) -> ParamGroup {
        let (names, params) = named.into_iter().unzip();
        ParamGroup { names, params, lr: None, weight_decay: None }
    }
    /// A group of unnamed parameters (they are named `param_groups.{g}.{i}`).
    pub fn from_tensors(params: impl IntoIterator<Item = Tensor>) -> ParamGroup {
        ParamGroup { names: vec![], params: params.into_iter().collect(), lr: None, weight_decay: None }
    }
    /// Sets this group's learning rate.
    pub fn with_lr(mut self, lr: f64) -> ParamGroup {
        self.lr = Some(lr);
        self
    }
    /// Sets this group's weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> ParamGroup {
        self.weight_decay = Some(weight_decay);
        self
    }
    /// The group's learning rate (the optimizer's once the group belongs to one).
    pub fn lr(&self) -> f64 {
        self.lr.unwrap_or(0.0)
    }
    /// The group's weight decay (the optimizer's once the group belongs to one).
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay.unwrap_or(0.0)
    }
    /// Number of parameter elements in the group.
    pub fn numel(&self) -> usize {
        self.params.iter().map(Tensor::numel).sum()
    }
}

/// What an optimizer accepts as its parameters: groups, one group, named
/// parameters (`named_parameters()`), or bare tensors.
pub trait IntoParamGroups {
    /// The parameter groups.
    fn into_param_groups(self) -> Vec<ParamGroup>;
}
impl IntoParamGroups for Vec<ParamGroup> {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        self
    }
}
impl IntoParamGroups for ParamGroup {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        vec![self]
    }
}
impl IntoParamGroups for Vec<(String, Tensor)> {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        vec![ParamGroup::new(self)]
    }
}
impl IntoParamGroups for Vec<Tensor> {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        vec![ParamGroup::from_tensors(self)]
    }
}
impl IntoParamGroups for &[Tensor] {
    fn into_param_groups(self) -> Vec<ParamGroup> {
        vec![ParamGroup::from_tensors(self.iter().cloned())]
    }
}

/// Whether a parameter is exempt from weight decay by the usual rule (GPT-2,
/// nanoGPT, Hugging Face `Trainer`): biases and norm weights, i.e. tensors with
/// fewer than 2 dims or a name containing `bias` or `norm`. Embeddings and
/// linear weights decay.
pub fn is_no_decay(name: &str, param: &Tensor) -> bool {
    param.ndim() < 2 || name.contains("bias") || name.contains("norm")
}

/// Splits named parameters into a group with `weight_decay` (matrices and
/// embeddings) and a group with weight decay 0 (biases and norms, see
/// [`is_no_decay`]). Empty groups are left out.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::optim::decay_groups;
/// let named = vec![
///     ("model.layers.0.mlp.up_proj.weight".to_string(), Tensor::zeros(&[4, 2], DType::F32)?),
///     ("model.norm.weight".to_string(), Tensor::ones(&[2], DType::F32)?),
/// ];
/// let groups = decay_groups(named, 0.1);
/// assert_eq!(groups[0].names, ["model.layers.0.mlp.up_proj.weight"]);
/// assert_eq!((groups[1].names[0].as_str(), groups[1].weight_decay), ("model.norm.weight", Some(0.0)));
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn decay_groups(named: impl IntoIterator<Item = (String, Tensor)>, weight_decay: f64) -> Vec<ParamGroup> {
    split_groups(named, |n, p| !is_no_decay(n, p), weight_decay)
}

/// Splits named parameters by a predicate: those for which `decays(name, param)`
/// holds get `weight_decay`, the others weight decay 0. Empty groups are left out.
pub fn split_groups(
    named: impl IntoIterator<Item = (String, Tensor)>,
    decays: impl Fn(&str, &Tensor) -> bool,
    weight_decay: f64,
) -> Vec<ParamGroup> {
    let (decay, no_decay): (Vec<_>, Vec<_>) = named.into_iter().partition(|(n, p)| decays(n, p));
    [ParamGroup::new(decay).with_weight_decay(weight_decay), ParamGroup::new(no_decay).with_weight_decay(0.0)]
        .into_iter()
        .filter(|g| !g.params.is_empty())
        .collect()
}

/// An optimizer: updates its parameters in place from their `.grad()`.
///
/// Parameters without a gradient are skipped by `step()` (no weight decay, no
/// state change), as in PyTorch.
pub trait Optimizer {
    /// One update of every parameter that has a gradient (under `no_grad`, in place).
    fn step(&mut self) -> Result<()>;

    /// The parameter groups (hyperparameters resolved).
    fn param_groups(&self) -> &[ParamGroup];

    /// The parameter groups, to change `lr` or `weight_decay` between steps.
    fn param_groups_mut(&mut self) -> &mut [ParamGroup];

    /// The learning rate each group was built with: what [`Optimizer::set_lr_factor`] scales.
    fn initial_lrs(&self) -> &[f64];

    /// The optimizer state as named tensors, for checkpoints: `{param}.{field}`
    /// (for example `model.norm.weight.exp_avg`, `model.norm.weight.step`).
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>>;

    /// Restores a [`Optimizer::state_dict`]. Parameters absent from it start fresh;
    /// an entry naming no parameter, or of the wrong shape, is an error.
    fn load_state_dict(&mut self, state: Vec<(String, Tensor)>) -> Result<()>;

    /// Sets every parameter's `.grad` to `None` (PyTorch's `zero_grad(set_to_none=True)`).
    fn zero_grad(&mut self) {
        for g in self.param_groups() {
            for p in &g.params {
                p.set_grad(None);
            }
        }
    }

    /// The learning rate of the first group.
    fn lr(&self) -> f64 {
        self.param_groups().first().map_or(0.0, ParamGroup::lr)
    }

    /// Sets the learning rate of every group.
    fn set_lr(&mut self, lr: f64) {
        for g in self.param_groups_mut() {
            g.lr = Some(lr);
        }
        self.lr_changed();
    }

    /// Sets each group's learning rate to its initial one times `factor`: what an
    /// LR schedule does every step (PyTorch's `LambdaLR`).
    fn set_lr_factor(&mut self, factor: f64) {
        let init = self.initial_lrs().to_vec();
        for (g, lr) in self.param_groups_mut().iter_mut().zip(init) {
            g.lr = Some(lr * factor);
        }
        self.lr_changed();
    }

    /// Called after [`Optimizer::set_lr`] and [`Optimizer::set_lr_factor`] changed the
    /// groups' learning rates (an optimizer keeping copies of them, such as a
    /// capturable AdamW's device tensors, updates them here). Does nothing by default.
    fn lr_changed(&mut self) {}

    /// Every parameter, group after group.
    fn params(&self) -> Vec<Tensor> {
        self.param_groups().iter().flat_map(|g| g.params.iter().cloned()).collect()
    }
}

/// Checks a hyperparameter the way `torch.optim` does (`Invalid learning rate: -1`).
pub(crate) fn check_hyper(op: &'static str, what: &str, v: f64, ok: bool) -> Result<()> {
    if ok && v.is_finite() {
        Ok(())
    } else {
        Err(Error::invalid(op, format!("invalid {what}: {v}")))
    }
}

/// Resolves the groups of a new optimizer: fills in default hyperparameters and
/// names, and refuses duplicate parameters, duplicate names and non-float tensors.
/// Returns the groups and their initial learning rates.
pub(crate) fn resolve_groups(
    op: &'static str,
    groups: Vec<ParamGroup>,
    lr: f64,
    weight_decay: f64,
) -> Result<(Vec<ParamGroup>, Vec<f64>)> {
    let mut seen_ids = HashSet::new();
    let mut seen_names = HashSet::new();
    let mut out = Vec::with_capacity(groups.len());
    for (gi, mut g) in groups.into_iter().enumerate() {
        if g.names.is_empty() {
            g.names = (0..g.params.len()).map(|i| format!("param_groups.{gi}.{i}")).collect();
        }
        if g.names.len() != g.params.len() {
            return Err(Error::invalid(
                op,
                format!("parameter group {gi} has {} names for {} parameters", g.names.len(), g.params.len()),
            ));
        }
        for (n, p) in g.names.iter().zip(&g.params) {
            if !p.dtype().is_float() {
                return Err(Error::dtype(op, format!("parameter {n} has dtype {}; optimizers need floats", p.dtype())));
            }
            if !seen_ids.insert(p.id()) {
                return Err(Error::invalid(
                    op,
                    format!("parameter {n} appears more than once in the parameter groups"),
                ));
            }
            if !seen_names.insert(n.clone()) {
                return Err(Error::invalid(op, format!("two parameters are named {n}")));
            }
        }
        let glr = g.lr.unwrap_or(lr);
        let gwd = g.weight_decay.unwrap_or(weight_decay);
        check_hyper(op, "learning rate", glr, glr >= 0.0)?;
        check_hyper(op, "weight_decay value", gwd, gwd >= 0.0)?;
        g.lr = Some(glr);
        g.weight_decay = Some(gwd);
        out.push(g);
    }
    let init = out.iter().map(ParamGroup::lr).collect();
    Ok((out, init))
}

/// Splits `{param}.{field}` state entries by parameter, checking that every
/// entry names a parameter of `groups` and a known field.
pub(crate) fn group_state_entries(
    op: &'static str,
    groups: &[ParamGroup],
    fields: &[&str],
    state: Vec<(String, Tensor)>,
) -> Result<HashMap<String, HashMap<String, Tensor>>> {
    let names: HashSet<&str> = groups.iter().flat_map(|g| g.names.iter().map(String::as_str)).collect();
    let mut out: HashMap<String, HashMap<String, Tensor>> = HashMap::new();
    for (key, t) in state {
        let split = fields.iter().find_map(|f| {
            key.strip_suffix(f).and_then(|k| k.strip_suffix('.')).filter(|k| names.contains(k)).map(|k| (k, *f))
        });
        let Some((param, field)) = split else {
            return Err(Error::invalid(
                op,
                format!("state entry {key:?} names no parameter of this optimizer (fields: {})", fields.join(", ")),
            ));
        };
        out.entry(param.to_string()).or_default().insert(field.to_string(), t);
    }
    Ok(out)
}

/// Reads the `step` entry of one parameter's state (an int64 scalar).
pub(crate) fn take_step(op: &'static str, param: &str, entry: &mut HashMap<String, Tensor>) -> Result<u64> {
    let t = entry
        .remove("step")
        .ok_or_else(|| Error::invalid(op, format!("the state of parameter {param} has no step entry")))?;
    if t.numel() != 1 {
        return Err(Error::shape(op, format!("{param}.step must hold one value, got shape {:?}", t.shape())));
    }
    let s = t.item_f64()?;
    if s < 0.0 || s.fract() != 0.0 {
        return Err(Error::invalid(op, format!("{param}.step must be a non-negative integer, got {s}")));
    }
    Ok(s as u64)
}

/// Takes a state tensor of one parameter, checking its shape against the parameter
/// and copying it into fresh memory of the parameter's dtype and device.
pub(crate) fn take_like(
    op: &'static str,
    param_name: &str,
    field: &str,
    param: &Tensor,
    entry: &mut HashMap<String, Tensor>,
) -> Result<Option<Tensor>> {
    let Some(t) = entry.remove(field) else { return Ok(None) };
    if t.shape() != param.shape() {
        return Err(Error::shape(
            op,
            format!(
                "state {param_name}.{field} has shape {:?}, but the parameter has shape {:?}",
                t.shape(),
                param.shape()
            ),
        ));
    }
    // On a mesh, the state takes the parameter's placements (see `Tensor::placed_like`).
    let t = t.detach().placed_like(param)?.to_dtype(param.dtype())?;
    Ok(Some(if t.is_contiguous() { t.deep_clone()?.detach() } else { t.contiguous()?.detach() }))
}

/// Fails when a parameter's gradient does not fit it.
pub(crate) fn check_grad(op: &'static str, name: &str, p: &Tensor, g: &Tensor) -> Result<()> {
    if g.shape() != p.shape() {
        return Err(Error::shape(
            op,
            format!("the gradient of {name} has shape {:?}, but the parameter has shape {:?}", g.shape(), p.shape()),
        ));
    }
    if g.device() != p.device() {
        return Err(Error::device_mismatch(op, p.device(), g.device()));
    }
    Ok(())
}

/// A fresh zero tensor like `p` (contiguous, same dtype and device, no grad);
/// for a distributed parameter, with its placements, so optimizer state is
/// split as its parameter is (FSDP's promise, Note [Parallelism recipes]).
pub(crate) fn zeros_like(p: &Tensor) -> Result<Tensor> {
    let z = Tensor::zeros(p.shape(), (p.dtype(), p.device()))?;
    if p.is_distributed() {
        return z.redistribute(&p.device_mesh()?, &p.placements()?);
    }
    Ok(z)
}
