//! Gradient clipping (`clip_grad_norm_`, `clip_grad_value_`) and gradient
//! accumulation over micro-batches.
//!
//! Gradient accumulation needs no special support: `backward()` adds into
//! `.grad()`, so a program runs `k` micro-batches, each `(loss / k).backward()`,
//! then clips and steps once. [`GradAccumulation`] keeps that count:
//!
//! ```
//! use kiln::prelude::*;
//! use kiln::nn::clip::{clip_grad_norm_, GradAccumulation};
//! use kiln::nn::optim::{Optimizer, SgdConfig, SGD};
//! let w = Tensor::new([1.0f32, 1.0])?;
//! w.requires_grad_(true)?;
//! let mut opt = SGD::new(vec![w.clone()], SgdConfig { lr: 0.1, ..Default::default() })?;
//! let mut acc = GradAccumulation::new(4);
//! for micro in 0..8 {
//!     let x = Tensor::new([micro as f32, 1.0])?;
//!     let loss = w.mul(&x)?.sum()?;
//!     if acc.backward(&loss)? {
//!         // 4 micro-batches accumulated: the gradient is their mean.
//!         clip_grad_norm_(&opt.params(), 1.0)?;
//!         opt.step()?;
//!         opt.zero_grad();
//!     }
//! }
//! # Ok::<(), kiln::Error>(())
//! ```
use kiln_autograd::{backward, no_grad};
use kiln_tensor::{DType, Error, Result, Tensor};

/// Clips the gradients of `params` so that their global L2 norm (the norm of
/// all gradients concatenated) is at most `max_norm`, in place, and returns
/// that norm before clipping (a 0-d f32 tensor on the gradients' device).
///
/// PyTorch's semantics (`torch.nn.utils.clip_grad_norm_`): every gradient is
/// multiplied by `min(max_norm / (total_norm + 1e-6), 1)`; parameters without
/// a gradient are ignored; with no gradients at all the norm is 0. A NaN or
/// infinite norm is not an error (the gradients become NaN); use
/// [`clip_grad_norm_checked_`] to refuse it.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::clip::clip_grad_norm_;
/// let w = Tensor::new([1.0f32, 1.0])?;
/// w.requires_grad_(true)?;
/// w.mul(&Tensor::new([3.0f32, 4.0])?)?.sum()?.backward()?; // grad [3, 4], norm 5
/// let norm = clip_grad_norm_(&[w.clone()], 1.0)?;
/// assert_eq!(norm.item::<f32>()?, 5.0);
/// let g = w.grad().unwrap().to_vec::<f32>()?;
/// assert!((g[0] - 0.6).abs() < 1e-6 && (g[1] - 0.8).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn clip_grad_norm_(params: &[Tensor], max_norm: f64) -> Result<Tensor> {
    clip_impl(params, max_norm, false)
}

/// [`clip_grad_norm_`] that fails (leaving the gradients unchanged) when the
/// total norm is NaN or infinite (PyTorch's `error_if_nonfinite=True`).
pub fn clip_grad_norm_checked_(params: &[Tensor], max_norm: f64) -> Result<Tensor> {
    clip_impl(params, max_norm, true)
}

/// The global L2 norm of the gradients of `params` (no clipping): a 0-d f32 tensor.
pub fn grad_norm(params: &[Tensor]) -> Result<Tensor> {
    let _g = no_grad();
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    total_norm(&grads)
}

fn total_norm(grads: &[Tensor]) -> Result<Tensor> {
    let Some(first) = grads.first() else { return Tensor::scalar(0.0, DType::F32) };
    // Sum of squares per gradient (accumulated in f32 at least), then one sqrt:
    // the same value as the L2 norm of the L2 norms, which PyTorch computes.
    let mut sq: Option<Tensor> = None;
    for g in grads {
        if g.device() != first.device() {
            return Err(Error::device_mismatch("clip_grad_norm_", first.device(), g.device()));
        }
        let g = if g.dtype() == DType::F64 { g.clone() } else { g.to_dtype(DType::F32)? };
        let s = g.mul(&g)?.sum()?;
        sq = Some(match sq {
            None => s,
            Some(acc) => acc.add(&s)?,
        });
    }
    let sq = sq.unwrap_or(Tensor::scalar(0.0, DType::F32)?);
    sq.sqrt()?.to_dtype(DType::F32)
}

fn clip_impl(params: &[Tensor], max_norm: f64, error_if_nonfinite: bool) -> Result<Tensor> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(Error::invalid("clip_grad_norm_", format!("max_norm must be >= 0, got {max_norm}")));
    }
    let _g = no_grad();
    let grads: Vec<Tensor> = params.iter().filter_map(Tensor::grad).collect();
    let norm = total_norm(&grads)?;
    if grads.is_empty() {
        return Ok(norm);
    }
    if error_if_nonfinite {
        let n = norm.item_f64()?;
        if !n.is_finite() {
            return Err(Error::invalid(
                "clip_grad_norm_",
                format!("the total norm of order 2 for the gradients is non-finite ({n}), so it cannot be clipped"),
            ));
        }
    }
    // clip_coef = max_norm / (total_norm + 1e-6), clamped to 1; stays on the device.
    let coef = Tensor::scalar(max_norm, (DType::F32, norm.device()))?.div(&norm.add(1e-6)?)?.clamp(None, Some(1.0))?;
    for g in &grads {
        g.mul_(&coef.to_dtype(g.dtype())?)?;
    }
    Ok(norm)
}

/// Clips every gradient element of `params` into `[-clip_value, clip_value]`, in place
/// (`torch.nn.utils.clip_grad_value_`).
pub fn clip_grad_value_(params: &[Tensor], clip_value: f64) -> Result<()> {
    if clip_value.is_nan() || clip_value < 0.0 {
        return Err(Error::invalid("clip_grad_value_", format!("clip_value must be >= 0, got {clip_value}")));
    }
    let _g = no_grad();
    for g in params.iter().filter_map(Tensor::grad) {
        g.clamp_(Some(-clip_value), Some(clip_value))?;
    }
    Ok(())
}

/// Counts micro-batches for gradient accumulation: [`GradAccumulation::backward`]
/// runs `(loss / steps).backward()` and says when `steps` micro-batches have
/// accumulated, i.e. when to clip, step and zero the gradients. Dividing each
/// micro-batch loss by `steps` makes the accumulated gradient the gradient of
/// the mean loss, as one big batch would give.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradAccumulation {
    steps: usize,
    done: usize,
}

impl GradAccumulation {
    /// Accumulates over `steps` micro-batches (1 = no accumulation; 0 is taken as 1).
    pub fn new(steps: usize) -> GradAccumulation {
        GradAccumulation { steps: steps.max(1), done: 0 }
    }
    /// The number of micro-batches per optimizer step.
    pub fn steps(&self) -> usize {
        self.steps
    }
    /// How many micro-batches have been accumulated since the last optimizer step.
    pub fn pending(&self) -> usize {
        self.done
    }
    /// `loss / steps`: the loss whose gradient to accumulate.
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if self.steps == 1 {
            Ok(loss.clone())
        } else {
            loss.div(self.steps as f64)
        }
    }
    /// Backward of `loss / steps`; returns true when this micro-batch completes a
    /// group of `steps` (time for the optimizer step).
    pub fn backward(&mut self, loss: &Tensor) -> Result<bool> {
        backward(&self.scale(loss)?)?;
        self.done += 1;
        if self.done == self.steps {
            self.done = 0;
            Ok(true)
        } else {
            Ok(false)
        }
    }
}
