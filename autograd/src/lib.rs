//! kiln-autograd: reverse-mode automatic differentiation for kiln tensors.
//!
//! The tensor crate records, for every op whose input requires grad, a `Node`
//! (the primitive and its input edges). This crate holds the one gradient rule
//! per primitive (`rules.rs`), the backward engine (`engine.rs`), `no_grad`,
//! activation checkpointing and a finite-difference gradient checker.
//!
//! ```
//! use kiln::prelude::*;
//! let x = Tensor::new([1.0f32, 2.0, 3.0])?;
//! x.requires_grad_(true)?;
//! let y = x.mul(&x)?.sum()?; // y = sum(x^2)
//! y.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//! # Ok::<(), kiln::Error>(())
//! ```

mod checkpoint;
mod engine;
pub mod gradcheck;
mod local;
mod rules;

pub use checkpoint::checkpoint;
pub use gradcheck::{gradcheck, GradcheckOptions};
pub use local::local_map;

use engine::Sink;
use kiln_tensor::{is_grad_enabled, Error, Result, Tensor};

/// While alive, ops record no graph on this thread (PyTorch's `torch.no_grad()`).
/// Guards nest: dropping one restores the mode that was current when it was made.
pub type NoGradGuard = kiln_tensor::GradModeGuard;

/// Turns recording off until the returned guard is dropped.
///
/// ```
/// use kiln::prelude::*;
/// let w = Tensor::ones(&[2], DType::F32)?;
/// w.requires_grad_(true)?;
/// {
///     let _g = kiln::autograd::no_grad();
///     w.sub_(0.5)?; // an optimizer-style update: allowed, not recorded
/// }
/// assert!(w.is_leaf());
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn no_grad() -> NoGradGuard {
    NoGradGuard::set(false)
}

/// Turns recording back on (inside a `no_grad` region) until the guard is dropped.
pub fn enable_grad() -> NoGradGuard {
    NoGradGuard::set(true)
}

/// Runs `f` with recording off.
pub fn with_no_grad<T>(f: impl FnOnce() -> T) -> T {
    let _g = no_grad();
    f()
}

/// Whether recording is on for this thread.
pub fn grad_enabled() -> bool {
    is_grad_enabled()
}

fn default_grad(t: &Tensor) -> Result<Tensor> {
    if t.numel() != 1 {
        return Err(Error::invalid(
            "backward",
            format!("grad can be implicitly created only for scalar outputs; the output has shape {:?}", t.shape()),
        ));
    }
    Tensor::ones(t.shape(), t)
}

/// Computes the gradient of `output` (a one-element tensor) with respect to every
/// leaf that requires grad, accumulating into their `.grad()`. Frees the graph.
pub fn backward(output: &Tensor) -> Result<()> {
    let g = default_grad(output)?;
    backward_with(output, &g, false)
}

/// Backward from `output` with an explicit output gradient (`grad_output`, same shape).
pub fn backward_with(output: &Tensor, grad_output: &Tensor, retain_graph: bool) -> Result<()> {
    engine::run(&[(output.clone(), grad_output.clone())], retain_graph, false, &mut Sink::Accumulate)
}

/// Gradients of `outputs` with respect to `inputs`, returned instead of
/// accumulated (`torch.autograd.grad`). `grad_outputs` default to ones for
/// one-element outputs. An input that the outputs do not depend on gets `None`.
/// With `create_graph`, the returned gradients are themselves differentiable.
pub fn grad(
    outputs: &[&Tensor],
    inputs: &[&Tensor],
    grad_outputs: Option<&[&Tensor]>,
    retain_graph: bool,
    create_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    let roots: Vec<(Tensor, Tensor)> = match grad_outputs {
        Some(gs) => {
            if gs.len() != outputs.len() {
                return Err(Error::invalid(
                    "grad",
                    format!("got {} grad_outputs for {} outputs", gs.len(), outputs.len()),
                ));
            }
            outputs.iter().zip(gs).map(|(o, g)| ((*o).clone(), (*g).clone())).collect()
        }
        None => outputs.iter().map(|o| Ok(((*o).clone(), default_grad(o)?))).collect::<Result<_>>()?,
    };
    for t in inputs {
        if !t.requires_grad() {
            return Err(Error::invalid("grad", "one of the differentiated tensors does not require grad"));
        }
    }
    let inputs: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    let mut sink = Sink::Capture { inputs: &inputs, found: vec![None; inputs.len()] };
    engine::run(&roots, retain_graph || create_graph, create_graph, &mut sink)?;
    match sink {
        Sink::Capture { found, .. } => Ok(found),
        Sink::Accumulate => unreachable!("the sink is a capture"),
    }
}

/// `loss.backward()` and friends as methods (brought in by `kiln::prelude`).
pub trait TensorAutograd {
    /// Backward from a one-element tensor; gradients accumulate into leaves' `.grad()`.
    fn backward(&self) -> Result<()>;
    /// Backward with an explicit output gradient.
    fn backward_with(&self, grad_output: &Tensor) -> Result<()>;
    /// Sets `.grad` to `None` (like `zero_grad(set_to_none=True)`).
    fn zero_grad(&self);
}

impl TensorAutograd for Tensor {
    fn backward(&self) -> Result<()> {
        backward(self)
    }
    fn backward_with(&self, grad_output: &Tensor) -> Result<()> {
        backward_with(self, grad_output, false)
    }
    fn zero_grad(&self) {
        self.set_grad(None);
    }
}
