//! Models: Llama (2, 3) and Qwen3 decoder-only transformers built from Hugging
//! Face `config.json` files and safetensors checkpoints.

mod config;
mod llama;

pub use config::{LlamaConfig, ModelType, MoeConfig};
pub use llama::{
    causal_lm_loss, load_balancing_loss, DecoderLayer, KvCache, LlamaForCausalLM, LlamaModel, PretrainedOptions,
    QuantizedLoad, ResidualNorm, ResidualNormFn,
};
