//! Serving: a continuous-batching generation engine over a paged KV cache.
//!
//! [`Engine`] queues [`Request`]s and runs one model step per iteration over
//! every running sequence (Note [Iteration-level scheduling]); keys and values
//! live in fixed-size blocks of a preallocated pool ([`PagedKvCache`]), with
//! identical prompt prefixes stored once (Note [Prefix sharing]).
//!
//! Note [Batch invariance]
//! ~~~~~~~~~~~~~~~~~~~~~~~
//! A request's tokens are what [`crate::generate::generate`] gives it alone,
//! whatever else runs beside it, however its prompt is chunked and whether or
//! not it was preempted and recomputed, when batch-invariant kernels are on
//! (`kiln::tensor::set_batch_invariant(true)`, on the CPU backend, for
//! float32 models): every row of every product and attention is then
//! computed in an order fixed by that row alone (Note [Row-invariant
//! products] in kiln-cpu), the paged attention computes each query as the
//! fused attention of incremental decoding does, and each sequence samples
//! from its own generator, seeded as `generate` seeds it. With the switch
//! off, results agree to rounding and greedy tokens almost always agree.
pub mod blocks;
pub mod engine;
pub mod kv;
pub mod request;

pub use engine::{Detokenizer, Engine, EngineConfig, EngineStats, StepOutput};
pub use kv::{PagedBatch, PagedKvCache, SeqChunk};
pub use request::{Event, FinishReason, Request};
