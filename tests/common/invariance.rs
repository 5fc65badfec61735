//! Batch invariance (`kiln::tensor::set_batch_invariant`) is one switch for
//! the whole process, and a test binary runs its tests on threads of one
//! process: the tests that depend on the switch hold this guard, one at a
//! time, and leave it off when they end. One file, included by path by the
//! test crates that use it.

/// Held while a test depends on batch invariance; turns it off again on drop.
pub struct BatchInvariance {
    _one: std::sync::MutexGuard<'static, ()>,
}

/// Waits for the other tests of this binary that hold the guard, then turns
/// batch-invariant kernels `on` (or off) until the guard drops.
pub fn batch_invariance(on: bool) -> BatchInvariance {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    kiln::tensor::set_batch_invariant(on);
    BatchInvariance { _one: one }
}

impl Drop for BatchInvariance {
    fn drop(&mut self) {
        kiln::tensor::set_batch_invariant(false);
    }
}
