//! Running a loop of ops on the threads a backend computes on
//! (Note [Loops on the compute threads]).
use crate::{DType, Device};

// Note [Loops on the compute threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The CPU backend runs the parts of a large op on its thread pool. Called from
// a thread outside the pool, every such op hands its work to the pool and
// sleeps until the pool is done: two cross-thread wake-ups per op (a futex
// call and a trip through the scheduler each way), and a decoding step is a
// hundred and more ops. Called from a thread of the pool, the op keeps a part
// for its own thread and the pool's other threads, still awake from the
// previous op, take the rest without being woken: 64 bf16 products of one row
// by a [256, 1024] weight took 18 µs each from outside the pool and 9 µs from
// inside (EPYC Zen 5, two threads). How long the other threads stay awake is
// the backend's business: the CPU's keep them spinning for the whole loop
// (Note [Teams of compute threads] in kiln-cpu).
//
// `on_compute_threads(device, f)` therefore runs `f` (a decoding loop, a
// serving engine's step) on such a thread where the device's backend has one
// (`Backend::run_on_compute_threads`; the default, and every device but the
// CPU, runs `f` where it was called). What ops read from the calling thread
// goes with `f`: grad mode, autocast, the default device and the constant
// scope. A thread in the middle of something that lives on it (a trace or a
// capture recording, a local region, a deferred program running, an
// in-place lock held, a scalar or a read being materialised) keeps `f`.
//
// It is safe because nothing kiln holds across an op waits for the pool:
// the generator's lock, the one lock taken around kernels, is released
// before its kernel runs (Note [Generators] in `generator.rs`).

/// Runs `f` on the threads `device`'s backend computes on, carrying this
/// thread's grad mode, autocast, default device and constant scope (Note
/// [Loops on the compute threads]); where the backend has no such threads, or
/// this thread is tracing or recording, `f` runs here. Panics in `f` reach
/// the caller.
///
/// ```
/// use kiln::prelude::*;
/// let x = Tensor::randn(&[4, 256], DType::F32)?;
/// let w = Tensor::randn(&[512, 256], DType::F32)?;
/// let y = kiln::tensor::on_compute_threads(Device::Cpu, || -> Result<Tensor> {
///     let mut h = x.clone();
///     for _ in 0..3 {
///         h = h.matmul(&w.t()?)?.narrow(1, 0, 256)?;
///     }
///     Ok(h)
/// })?;
/// assert_eq!(y.shape(), &[4, 256]);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn on_compute_threads<R: Send>(device: Device, f: impl FnOnce() -> R + Send) -> R {
    let backend = match device.backend() {
        Ok(b) if stays_here().is_none() => b,
        _ => return f(),
    };
    let carried = Carried::now();
    let mut f = Some(f);
    let mut out = None;
    backend.run_on_compute_threads(&mut || {
        let _guards = carried.enter();
        if let Some(f) = f.take() {
            out = Some(f());
        }
    });
    match (out, f) {
        (Some(r), _) => r,
        // A backend that did not call `f`: it runs here.
        (None, Some(f)) => f(),
        (None, None) => unreachable!("`f` ran and returned"),
    }
}

/// What about this thread keeps a loop on it, if anything.
fn stays_here() -> Option<&'static str> {
    if crate::trace::is_tracing() {
        return Some("tracing");
    }
    if crate::capture::record::any_recording() {
        return Some("recording");
    }
    if crate::collective::local_region_mesh().is_some() {
        return Some("a local region");
    }
    if crate::defer::running_program() {
        return Some("a deferred program");
    }
    if crate::storage::holds_exclusive() {
        return Some("an in-place lock");
    }
    if crate::trace::current_scalar_use().is_some() || crate::convert::reading_via().is_some() {
        return Some("a value being materialised");
    }
    None
}

/// The thread state ops read, taken from the calling thread.
#[derive(Clone, Copy)]
struct Carried {
    grad: bool,
    autocast: Option<DType>,
    device: Device,
    constant: bool,
}

impl Carried {
    fn now() -> Carried {
        Carried {
            grad: crate::is_grad_enabled(),
            autocast: crate::autocast_dtype(),
            device: crate::default_device(),
            constant: crate::trace::in_constant_scope(),
        }
    }

    /// Sets this thread's state to the carried one until the guards drop.
    fn enter(self) -> Guards {
        Guards(
            crate::GradModeGuard::set(self.grad),
            match self.autocast {
                // The dtype was accepted by `autocast` on the calling thread.
                Some(d) => crate::autocast(d).ok(),
                None => Some(crate::autocast::suspend_autocast()),
            },
            crate::set_default_device(self.device),
            self.constant.then(crate::trace::ConstantScope::enter),
        )
    }
}

/// The guards of a carried state; dropping them restores the thread's own.
struct Guards(
    #[allow(dead_code)] crate::GradModeGuard,
    #[allow(dead_code)] Option<crate::AutocastGuard>,
    #[allow(dead_code)] crate::DefaultDeviceGuard,
    #[allow(dead_code)] Option<crate::trace::ConstantScope>,
);
