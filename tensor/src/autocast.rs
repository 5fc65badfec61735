//! Autocast: per-op precision rules for mixed-precision compute, PyTorch's
//! `torch.autocast` (see [`autocast`]).
//!
// Note [Autocast]
// ~~~~~~~~~~~~~~~
// Inside an autocast scope (thread-local, like PyTorch's), the ops that gain
// from low precision cast their float32 inputs to the scope's dtype (bfloat16
// or float16) and compute in it: `matmul`, `mm`, `bmm`, `linear` and
// `scaled_dot_product_attention`. The ops that need range or accurate
// accumulation cast low-precision inputs up to float32 and compute there:
// `softmax`, `log_softmax`, `logsumexp`, `rms_norm`, `layer_norm`,
// `cross_entropy`, `sum`, `mean` and `cumsum`. Every other op runs in the
// dtype its inputs promote to, as outside the scope (a float32 residual
// stream plus a bfloat16 projection is float32). float64 is never cast.
// A product rounds once: its operands rounded to the scope's dtype, the
// accumulation in float32. `linear`'s bias, rounded too, is added to the
// rounded product (a second rounding; PyTorch's CPU addmm adds it before its
// one), so near cancellation a result may be one ulp of the product apart.
//
// The casts are ordinary differentiable `Cast` ops, so parameters stay
// float32 (master weights) and their gradients arrive in float32, while the
// products ran in bfloat16. The backward pass runs outside the scope (the
// engine suspends it), as PyTorch's does: gradient ops take the dtypes the
// forward recorded. Traced functions (`kiln::compile`) see the scope like any
// other call, so a captured step holds the casts. Parameter reads are not
// cached: each use casts again (under `kiln::compile` XLA shares and fuses
// the converts).
use crate::{DType, Error, Result, Tensor};
use std::cell::Cell;

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// The scope returned by [`autocast`]: the previous state comes back when it drops.
#[must_use = "autocast lasts as long as the guard"]
pub struct AutocastGuard {
    prev: Option<DType>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|a| a.set(self.prev));
    }
}

/// Runs the ops of this thread under autocast to `dtype` (bfloat16 or
/// float16) until the guard drops (Note \[Autocast\]).
///
/// ```
/// use kiln::prelude::*;
/// let w = Tensor::ones(&[4, 4], DType::F32)?;
/// let x = Tensor::ones(&[2, 4], DType::F32)?;
/// {
///     let _amp = kiln::tensor::autocast(DType::BF16)?;
///     let y = x.matmul(&w)?;               // computed in bfloat16
///     assert_eq!(y.dtype(), DType::BF16);
///     assert_eq!(y.softmax(-1)?.dtype(), DType::F32); // softmax in float32
/// }
/// assert_eq!(x.matmul(&w)?.dtype(), DType::F32);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn autocast(dtype: DType) -> Result<AutocastGuard> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Err(Error::dtype("autocast", format!("expected bfloat16 or float16, got {dtype}")));
    }
    Ok(AutocastGuard { prev: AUTOCAST.with(|a| a.replace(Some(dtype))) })
}

/// Suspends autocast on this thread until the guard drops (the autograd
/// engine runs the backward pass under it).
pub fn suspend_autocast() -> AutocastGuard {
    AutocastGuard { prev: AUTOCAST.with(|a| a.replace(None)) }
}

/// The dtype of this thread's autocast scope, if one is active.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|a| a.get())
}

/// For an op that computes in low precision: `x` cast to the scope's dtype
/// when it is float32 and a scope is active, else `x` itself.
pub(crate) fn lower(x: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(dt) if x.dtype() == DType::F32 => x.to_dtype(dt),
        _ => Ok(x.clone()),
    }
}

/// For an op that computes in float32: `x` cast up when it is bfloat16 or
/// float16 and a scope is active, else `x` itself.
pub(crate) fn widen(x: &Tensor) -> Result<Tensor> {
    match autocast_dtype() {
        Some(_) if matches!(x.dtype(), DType::BF16 | DType::F16) => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// `Some(x widened)` when autocast casts this float32 op's input up (the
/// caller reruns the op on it), else `None`.
pub(crate) fn widened(x: &Tensor) -> Result<Option<Tensor>> {
    let w = widen(x)?;
    Ok((w.dtype() != x.dtype()).then_some(w))
}

/// `Some((a, b) lowered)` when autocast casts this low-precision op's inputs
/// (the caller reruns the op on them), else `None`.
pub(crate) fn lowered(a: &Tensor, b: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    if autocast_dtype().is_none() {
        return Ok(None);
    }
    let (la, lb) = (lower(a)?, lower(b)?);
    Ok((la.dtype() != a.dtype() || lb.dtype() != b.dtype()).then_some((la, lb)))
}
