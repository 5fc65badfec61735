//! Serving: a continuous-batching generation engine over a paged KV cache.
//!
//! [`Engine`] queues [`Request`]s and runs one model step per iteration over
//! every running sequence (Note [Iteration-level scheduling]); keys and values
//! live in fixed-size blocks of a preallocated pool ([`PagedKvCache`]), with
//! identical prompt prefixes stored once (Note [Prefix sharing]).
//! [`EngineHandle`] runs it on its own thread for services: `submit` a
//! request from any thread or task, read its [`TokenStream`] (Note [Engine
//! thread]).
//!
//! ```
//! use kiln::prelude::*;
//! use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
//! use kiln::nn::serve::{Engine, EngineConfig, EngineHandle, Event, Request};
//! let cfg = LlamaConfig::from_json_str(r#"{"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
//!     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}"#)?;
//! let model = LlamaForCausalLM::new(&cfg, DType::F32)?;
//! let engine = EngineHandle::spawn(Engine::new(model, EngineConfig::default())?).unwrap();
//! let stream = engine.submit(Request::new(vec![1, 2, 3], 5)).unwrap();
//! let events: Vec<Event> = stream.collect(); // blocking; `next_event().await` in async code
//! assert_eq!(events.len(), 6); // five tokens, then the end
//! # Ok::<(), kiln::Error>(())
//! ```

// Note [Batch invariance]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A request's tokens are what `generate()` gives it alone,
// whatever else runs beside it, however its prompt is chunked and whether or
// not it was preempted and recomputed, when batch-invariant kernels are on
// (`kiln::tensor::set_batch_invariant(true)`, on the CPU backend, for
// float32 models): every row of every product and attention is then
// computed in an order fixed by that row alone (Note [Row-invariant
// products] in kiln-cpu), the paged attention computes each query as the
// fused attention of incremental decoding does, and each sequence samples
// from its own generator, seeded as `generate` seeds it. With the switch
// off, results agree to rounding and greedy tokens almost always agree.
pub mod blocks;
mod decode;
pub mod engine;
mod forward;
pub mod grammar;
pub mod handle;
pub mod kv;
mod logits;
#[cfg(feature = "server")]
pub mod openai;
pub mod request;
pub mod speculative;
mod stats;
#[cfg(feature = "server")]
pub mod structured;

pub use engine::{Detokenizer, Engine, EngineConfig, EngineStats, StepOutput};
pub use grammar::{Constraint, Grammar, GrammarCompiler};
pub use handle::{EngineHandle, Metrics, SubmitError, TokenStream};
pub use kv::{DecodeBatch, PagedBatch, PagedKvCache, SeqChunk};
pub use logits::process_logits;
pub use request::{Event, FinishReason, Penalties, Request, TokenLogprobs};
pub use speculative::Speculation;
