//! Batch invariance: whether a row's result may depend on the other rows
//! computed with it (Note [Row-invariant products] in kiln-cpu's matmul).
//!
//! Off by default: kernels then pick the fastest algorithm for each shape (a
//! matrix-vector product for a single row, for one). On, every backend kernel
//! that honours it computes each row of a product, and each query of an
//! attention, in an order fixed by that row alone, so that the same request
//! gives the same bits alone or batched with others, prompt in one piece or in
//! chunks. PyTorch's `torch.use_deterministic_algorithms` is the model;
//! vLLM's and SGLang's batch-invariant modes are the use. The CPU backend
//! honours it; compiled PJRT programs do not (XLA picks its own algorithms).
use std::sync::atomic::{AtomicBool, Ordering};

static BATCH_INVARIANT: AtomicBool = AtomicBool::new(false);

/// Turns batch-invariant kernels on or off for the whole process and returns
/// the previous setting. The cost: products of one to a few rows give up
/// their matrix-vector kernels (decoding one sequence runs about half as
/// fast on the CPU); batched decoding and prefill are affected little.
pub fn set_batch_invariant(on: bool) -> bool {
    BATCH_INVARIANT.swap(on, Ordering::SeqCst)
}

/// Whether batch-invariant kernels are on (see [`set_batch_invariant`]).
pub fn is_batch_invariant() -> bool {
    BATCH_INVARIANT.load(Ordering::Relaxed)
}
