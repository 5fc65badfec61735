//! Kernel tests through the public `Tensor` API, against hand-computed values.
//! Ops whose high-level API lives elsewhere run through `Tensor::apply`.
mod elementwise;
mod fused;
mod index;
mod matmul;
mod quant;
mod quant_int8;
mod reduce;
mod sort;

use half::{bf16, f16};
use kiln_tensor::{HostElement, Op, Tensor};

/// Held by a test whose kernels depend on batch invariance (one switch for
/// the process, and this binary's tests run on threads of one process): one
/// such test at a time, with the switch as it asks, turned off again on drop.
/// The product tests hold it off, so that they check the kernels a product
/// picks by default whatever ran before them.
pub(super) struct BatchInvariance {
    _one: std::sync::MutexGuard<'static, ()>,
}

/// Waits for the other holders, then sets batch invariance `on` (or off).
pub(super) fn batch_invariance(on: bool) -> BatchInvariance {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    kiln_tensor::set_batch_invariant(on);
    BatchInvariance { _one: one }
}

impl Drop for BatchInvariance {
    fn drop(&mut self) {
        kiln_tensor::set_batch_invariant(false);
    }
}

pub(super) fn t<T: HostElement>(v: Vec<T>, shape: &[usize]) -> Tensor {
    crate::register();
    Tensor::from_vec(v, shape).unwrap()
}

pub(super) fn f32s(v: &[f32], shape: &[usize]) -> Tensor {
    t(v.to_vec(), shape)
}

pub(super) fn run(op: Op, ins: &[&Tensor]) -> Tensor {
    Tensor::apply1(op, ins).unwrap()
}

pub(super) fn run2(op: Op, ins: &[&Tensor]) -> (Tensor, Tensor) {
    let mut r = Tensor::apply(op, ins).unwrap();
    let b = r.pop().unwrap();
    let a = r.pop().unwrap();
    (a, b)
}

pub(super) fn vals<T: HostElement>(x: &Tensor) -> Vec<T> {
    x.to_vec::<T>().unwrap()
}

/// A strided view of `x`'s storage.
pub(super) fn strided(x: &Tensor, shape: &[usize], strides: &[usize], offset: usize) -> Tensor {
    x.as_strided(shape, strides, Some(offset)).unwrap()
}

/// Deterministic pseudo-random floats in [-1, 1).
pub(super) fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub(super) fn bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub(super) fn hf(v: &[f32]) -> Vec<f16> {
    v.iter().map(|&x| f16::from_f32(x)).collect()
}

/// Bitwise equality that treats all NaNs as equal.
pub(super) fn same_f32(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x.is_nan() && y.is_nan()) || x.to_bits() == y.to_bits())
}

/// Note [Loops on the compute threads]: a loop handed to the CPU backend runs
/// on a thread of its pool, with the caller's grad mode, autocast and
/// constant scope, and the caller's own state is untouched afterwards.
#[test]
fn loops_run_on_the_pool_with_the_callers_thread_state() {
    use kiln_tensor::{autocast, autocast_dtype, is_grad_enabled, on_compute_threads, DType, Device, GradModeGuard};
    crate::register();
    assert_eq!(rayon::current_thread_index(), None, "the test itself runs outside the pool");
    let _ng = GradModeGuard::set(false);
    let _ac = autocast(DType::BF16).unwrap();
    let _cs = kiln_tensor::trace::ConstantScope::enter();
    let seen = on_compute_threads(Device::Cpu, || {
        (rayon::current_thread_index(), is_grad_enabled(), autocast_dtype(), kiln_tensor::trace::in_constant_scope())
    });
    assert!(seen.0.is_some(), "the loop ran outside the pool");
    assert_eq!((seen.1, seen.2, seen.3), (false, Some(DType::BF16), true), "the caller's state did not go with it");
    // The pool thread's own state is back as it was: a plain loop sees the defaults.
    drop((_ng, _ac, _cs));
    let plain = on_compute_threads(Device::Cpu, || (is_grad_enabled(), autocast_dtype()));
    assert_eq!(plain, (true, None));
}
