//! The `Module` trait: parameters are plain `Tensor`s held in struct fields,
//! reached through one visitor per module, and named like Hugging Face names
//! them (`model.layers.0.self_attn.q_proj.weight`), so checkpoints load and save
//! without renaming tables.
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use std::collections::{BTreeMap, BTreeSet};

mod field;
pub use field::ModuleField;
/// Derives [`Module`](trait@Module) from a struct's fields (see the trait).
pub use kiln_derive::Module;

/// What `#[derive(Module)]`'s expansion names, at one path that does not
/// depend on how the user's crate imports kiln.
#[doc(hidden)]
pub mod __derive {
    pub use super::{join_name, ModuleField};
    pub use crate::layers::Linear;
    pub use kiln_tensor::{Result, Tensor};
}

/// Joins a parameter or submodule name onto a prefix with a dot
/// (`join_name("model", "norm") == "model.norm"`, `join_name("", "norm") == "norm"`).
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else if name.is_empty() {
        prefix.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// What [`Module::load_state_dict`] found that did not line up with the module
/// (always empty after a successful strict load).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IncompatibleKeys {
    /// Parameters of the module that the state dict does not hold.
    pub missing_keys: Vec<String>,
    /// Entries of the state dict that are not parameters of the module.
    pub unexpected_keys: Vec<String>,
}

impl IncompatibleKeys {
    /// True when nothing is missing and nothing is unexpected.
    pub fn is_empty(&self) -> bool {
        self.missing_keys.is_empty() && self.unexpected_keys.is_empty()
    }
}

/// A neural-network module, like `torch.nn.Module`.
///
/// A module holds its parameters as plain [`Tensor`] fields and implements two
/// visitors that hand each one, with its full dotted name, to a callback;
/// every other method is provided on top of them.
///
/// # Deriving
///
/// `#[derive(Module)]` writes the visitors from the struct's fields, in
/// declaration order, each named after its field: a [`Tensor`] is a
/// parameter, a `Module` is a submodule whose parameters go under the
/// field's name, `Option`s hold one or nothing, and `Vec`s and arrays name
/// their items by index (`layers.0.mlp.up_proj.weight`), as PyTorch's
/// `ModuleList` does (see [`ModuleField`]). `train` and `is_training` are
/// derived too: `train` reaches every submodule, and a module is in training
/// mode when one of its submodules is.
///
/// - `#[module(skip)]` on a field leaves it out (configuration, caches,
///   anything that is not a parameter); a field of another type than those
///   above is a compile error until it is skipped, so no parameter is left
///   out by accident.
/// - `#[module(rename = "name")]` names a field's parameters as a checkpoint
///   does when the Rust name cannot (`rename = "type"`, or a dotted
///   `rename = "model.norm"`); two fields with one name are a compile error.
/// - On the struct, `#[module(crate = "kiln_nn")]` says where `kiln::nn` is
///   for a crate that depends on `kiln-nn` directly (the default is
///   `::kiln::nn`), and `#[module(mixed_precision = "Self::method")]`
///   implements [`Module::set_mixed_precision_policy`] with that method, for
///   a model whose forward applies a policy it holds.
///
/// A generic struct is a module whenever its visited fields are. Each field
/// is visited: a weight tied between two places is held in one field (as
/// `LlamaForCausalLM` holds no `lm_head` when it is tied to the embedding).
///
/// ```
/// use kiln::nn::layers::Linear;
/// use kiln::nn::module::Module;
/// use kiln::prelude::*;
///
/// #[derive(Module)]
/// struct Block {
///     proj: Linear,
///     #[module(rename = "scale")]
///     gain: Tensor,
///     norm_bias: Option<Tensor>,
///     experts: Vec<Linear>,
///     #[module(skip)]
///     eps: f64,
/// }
///
/// let lin = || Linear::new(4, 4, false, DType::F32);
/// let b = Block {
///     proj: lin()?,
///     gain: Tensor::ones(&[4], DType::F32)?,
///     norm_bias: None,
///     experts: vec![lin()?, lin()?],
///     eps: 1e-6,
/// };
/// let names: Vec<String> = b.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["proj.weight", "scale", "experts.0.weight", "experts.1.weight"]);
/// # Ok::<(), kiln::Error>(())
/// ```
///
/// A field that is neither a parameter nor a module does not compile
/// (`` `f64` is neither a parameter nor a module``) until it is skipped:
///
/// ```compile_fail
/// use kiln::nn::module::Module;
/// use kiln::prelude::*;
///
/// #[derive(Module)]
/// struct Norm {
///     weight: Tensor,
///     eps: f64,
/// }
/// ```
///
/// # Writing the visitors by hand
///
/// A module whose parameters depend on its state (a [`Linear`] whose weight
/// is kept quantized holds no weight parameter) or that keeps a mode flag of
/// its own (`Dropout`) implements the trait itself. Submodules are visited by
/// calling their visitors with `join_name(prefix, "field")`; a parameter
/// shared by two places (tied weights) is visited once.
///
/// [`Linear`]: crate::layers::Linear
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::module::{join_name, Module};
///
/// struct Affine { weight: Tensor, bias: Tensor }
///
/// impl Module for Affine {
///     fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
///         f(&join_name(prefix, "weight"), &self.weight);
///         f(&join_name(prefix, "bias"), &self.bias);
///     }
///     fn visit_params_mut(
///         &mut self,
///         prefix: &str,
///         f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>,
///     ) -> Result<()> {
///         f(&join_name(prefix, "weight"), &mut self.weight)?;
///         f(&join_name(prefix, "bias"), &mut self.bias)
///     }
/// }
///
/// let mut m = Affine { weight: Tensor::ones(&[3], DType::F32)?, bias: Tensor::zeros(&[3], DType::F32)? };
/// assert_eq!(m.num_parameters(), 6);
/// assert_eq!(m.state_dict().keys().collect::<Vec<_>>(), ["bias", "weight"]);
/// m.to_dtype(DType::BF16)?;
/// assert_eq!(m.weight.dtype(), DType::BF16);
/// # Ok::<(), kiln::Error>(())
/// ```
pub trait Module {
    /// Calls `f(name, param)` for every parameter, names prefixed by `prefix`.
    /// A parameter shared by two places (tied weights) is visited once.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor));

    /// Like [`Module::visit_params`], with mutable access so that a parameter
    /// can be replaced (dtype or device moves, loading); stops at the first error.
    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()>;

    /// Sets training mode (PyTorch's `module.train(mode)`). Modules whose
    /// behaviour depends on it (dropout, models) override this and pass it on
    /// to their submodules; the default does nothing.
    fn train(&mut self, on: bool) {
        let _ = on;
    }

    /// Whether the module is in training mode. Modules that do not depend on
    /// it report `false`.
    fn is_training(&self) -> bool {
        false
    }

    /// Evaluation mode: `train(false)`.
    fn eval(&mut self) {
        self.train(false)
    }

    /// Calls `f(name, linear)` for every [`Linear`](crate::layers::Linear)
    /// the module holds (itself, when it is one), with its full dotted name
    /// (`model.layers.0.self_attn.q_proj`): the walk by which adapters
    /// ([`crate::lora`]) reach their target layers. `#[derive(Module)]`
    /// writes it from the fields; a hand-written module holding `Linear`s
    /// implements it (where it does not, [`crate::lora::inject_adapter`]
    /// reports the targets it names as layers it cannot adapt); stops at the
    /// first error.
    fn visit_linears_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut crate::layers::Linear) -> Result<()>,
    ) -> Result<()> {
        let _ = (prefix, f);
        Ok(())
    }

    /// Sets the module's mixed-precision policy (see
    /// [`crate::precision::MixedPrecisionPolicy`]). Modules whose forward
    /// takes no policy refuse one.
    fn set_mixed_precision_policy(&mut self, policy: Option<crate::precision::MixedPrecisionPolicy>) -> Result<()> {
        match policy {
            None => Ok(()),
            Some(_) => Err(kiln_tensor::Error::invalid(
                "set_mixed_precision_policy",
                "this module's forward takes no mixed-precision policy; run it under kiln::tensor::autocast",
            )),
        }
    }

    /// `(name, parameter)` for every parameter, in visiting order. The tensors
    /// are the parameters themselves (cheap handles), so an optimizer holding
    /// them sees in-place updates.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![];
        self.visit_params("", &mut |n, t| out.push((n.to_string(), t.clone())));
        out
    }

    /// `(name, parameter)` for every parameter that requires grad: what an
    /// optimizer steps when part of the model is frozen (adapters over a
    /// frozen base, [`crate::lora`]).
    fn named_trainable_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![];
        self.visit_params("", &mut |n, t| {
            if t.requires_grad() {
                out.push((n.to_string(), t.clone()))
            }
        });
        out
    }

    /// Every parameter, in visiting order.
    fn parameters(&self) -> Vec<Tensor> {
        let mut out = vec![];
        self.visit_params("", &mut |_, t| out.push(t.clone()));
        out
    }

    /// The total number of parameter elements.
    fn num_parameters(&self) -> usize {
        let mut n = 0;
        self.visit_params("", &mut |_, t| n += t.numel());
        n
    }

    /// The parameters by name, detached from the autograd graph but sharing
    /// their data (PyTorch's `state_dict()`).
    fn state_dict(&self) -> BTreeMap<String, Tensor> {
        let mut out = BTreeMap::new();
        self.visit_params("", &mut |n, t| {
            out.insert(n.to_string(), t.detach());
        });
        out
    }

    /// Copies the tensors of `state` into the parameters of the same name
    /// (converting dtype and device to the parameter's; the parameters keep
    /// their identity, so an optimizer holding them stays valid).
    ///
    /// Shapes must match. With `strict`, missing and unexpected names are an
    /// error too; without, they are returned. Nothing is written unless every
    /// check passes. The error lists every problem, PyTorch-style.
    fn load_state_dict(&mut self, state: &BTreeMap<String, Tensor>, strict: bool) -> Result<IncompatibleKeys> {
        load_impl(self, state, strict, false)
    }

    /// Like [`Module::load_state_dict`], but the parameters *become* the given
    /// tensors (converted to the parameter's dtype and device when they
    /// differ; PyTorch's `assign=True`): no copy, which suits loading a fresh
    /// model from a checkpoint. `requires_grad` is kept from the old parameter.
    fn load_state_dict_assign(&mut self, state: &BTreeMap<String, Tensor>, strict: bool) -> Result<IncompatibleKeys> {
        load_impl(self, state, strict, true)
    }

    /// Moves every parameter to `device` (the field tensors are replaced; each
    /// keeps its `requires_grad`). Gradients are dropped.
    fn to_device(&mut self, device: Device) -> Result<()> {
        let _g = kiln_autograd::no_grad();
        self.visit_params_mut("", &mut |_, p| {
            if p.device() != device {
                let rg = p.requires_grad();
                *p = fresh_leaf(p.to_device(device)?, rg)?;
            }
            Ok(())
        })
    }

    /// Casts every floating-point parameter to `dtype` (the field tensors are
    /// replaced; each keeps its `requires_grad`). Gradients are dropped.
    fn to_dtype(&mut self, dtype: DType) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::dtype("Module::to_dtype", format!("expected a floating point dtype, got {dtype}")));
        }
        let _g = kiln_autograd::no_grad();
        self.visit_params_mut("", &mut |_, p| {
            if p.dtype() != dtype && p.dtype().is_float() {
                let rg = p.requires_grad();
                *p = fresh_leaf(p.to_dtype(dtype)?, rg)?;
            }
            Ok(())
        })
    }

    /// Clears the gradient of every parameter (`zero_grad(set_to_none=True)`).
    fn zero_grad(&self) {
        self.visit_params("", &mut |_, p| p.set_grad(None));
    }

    /// Marks every floating-point parameter as requiring grad (or not).
    fn requires_grad_(&self, on: bool) -> Result<()> {
        let mut err = None;
        self.visit_params("", &mut |n, p| {
            if err.is_none() && p.dtype().is_float() {
                if let Err(e) = p.requires_grad_(on) {
                    err = Some(Error::invalid("Module::requires_grad_", format!("parameter {n}: {e}")));
                }
            }
        });
        err.map_or(Ok(()), Err)
    }
}

/// `t` as a leaf with `requires_grad` set to `rg` (detached from any graph).
fn fresh_leaf(t: Tensor, rg: bool) -> Result<Tensor> {
    let t = t.detach();
    if rg {
        t.requires_grad_(true)?;
    }
    Ok(t)
}

fn load_impl<M: Module + ?Sized>(
    m: &mut M,
    state: &BTreeMap<String, Tensor>,
    strict: bool,
    assign: bool,
) -> Result<IncompatibleKeys> {
    // Check everything first, so that a failed load leaves the module untouched.
    let mut seen = BTreeSet::new();
    let mut missing = vec![];
    let mut mis_shaped = vec![];
    m.visit_params("", &mut |name, p| match state.get(name) {
        Some(src) => {
            seen.insert(name.to_string());
            if src.shape() != p.shape() {
                mis_shaped.push(format!(
                    "size mismatch for {name}: copying a param with shape {:?} from checkpoint, the shape in current model is {:?}.",
                    src.shape(),
                    p.shape()
                ));
            }
        }
        None => missing.push(name.to_string()),
    });
    let unexpected: Vec<String> = state.keys().filter(|k| !seen.contains(*k)).cloned().collect();
    let mut problems = vec![];
    if strict && !missing.is_empty() {
        problems.push(format!("Missing key(s) in state_dict: {}.", quoted(&missing)));
    }
    if strict && !unexpected.is_empty() {
        problems.push(format!("Unexpected key(s) in state_dict: {}.", quoted(&unexpected)));
    }
    problems.extend(mis_shaped);
    if !problems.is_empty() {
        return Err(Error::invalid(
            "load_state_dict",
            format!("Error(s) in loading state_dict:\n\t{}", problems.join("\n\t")),
        ));
    }
    let _g = kiln_autograd::no_grad();
    m.visit_params_mut("", &mut |name, p| {
        let Some(src) = state.get(name) else { return Ok(()) };
        if assign {
            let rg = p.requires_grad();
            // A parameter on a mesh keeps its placements: the source is cut into its shards.
            let t = src.placed_like(p)?;
            let t = if p.dtype().is_float() && t.dtype().is_float() { t.to_dtype(p.dtype())? } else { t };
            *p = fresh_leaf(t, rg)?;
        } else {
            // Into a parameter on a mesh, the source goes shard by shard.
            let src = if p.is_distributed() && src.device() != p.device() { src.placed_like(p)? } else { src.clone() };
            p.copy_(&src).map_err(|e| Error::invalid("load_state_dict", format!("copying {name}: {e}")))?;
        }
        Ok(())
    })?;
    Ok(IncompatibleKeys { missing_keys: missing, unexpected_keys: unexpected })
}

/// `"a", "b"`: the names as PyTorch lists them in load errors.
fn quoted(names: &[String]) -> String {
    names.iter().map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(", ")
}
