//! kiln-nn: modules with Hugging Face parameter names, Llama and Qwen3 models
//! from `config.json` + safetensors, generation, losses, optimizers, LR
//! schedules, data loading and training checkpoints.

#[cfg(feature = "chat")]
pub mod chat;
pub mod checkpoint;
pub mod clip;
pub mod data;
pub mod generate;
pub mod io;
pub mod layers;
pub mod lora;
pub mod models;
pub mod module;
pub mod optim;
pub mod parallel;
pub mod pipeline;
pub mod precision;
pub mod quantize;
pub mod schedule;
pub mod serve;

pub use models::{LlamaConfig, LlamaForCausalLM};
pub use module::Module;
