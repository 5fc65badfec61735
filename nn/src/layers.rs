//! Layers: Linear, Embedding, RMSNorm, LayerNorm, Dropout, rotary position
//! embeddings (with Llama 3 scaling), grouped-query causal attention with a KV
//! cache, the SwiGLU MLP and Qwen3-MoE's sparse experts. Each is a [`Module`](crate::module::Module) whose
//! parameters carry Hugging Face names.

mod attention;
mod dropout;
mod embedding;
mod kv_dtype;
mod linear;
mod mlp;
mod moe;
mod norm;
mod rotary;

pub use attention::{causal_mask, mask_min, Attention, AttentionConfig, AttentionMask, LayerKvCache};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use kv_dtype::{check_kv_dtype, load_rows, parse_kv_cache_dtype, row_bytes, store_rows};
pub use linear::Linear;
pub use mlp::SwiGluMlp;
pub(crate) use moe::is_stacked_expert;
pub use moe::{from_hub_layout, to_hub_layout, Experts, FeedForward, SparseMoeBlock, StackedExperts};
pub use norm::{LayerNorm, RmsNorm};
pub use rotary::{rotate_half, RopeScaling, RopeTables, RotaryEmbedding};

use kiln_tensor::{DType, Result, Tensor, TensorOptions};

/// A fresh parameter: `t` cast to the options' dtype and moved to their
/// device, detached, with `requires_grad` on (like `torch.nn.Parameter`).
pub fn parameter(t: Tensor, opts: TensorOptions) -> Result<Tensor> {
    let t = {
        let _g = kiln_autograd::no_grad();
        t.to_dtype(opts.dtype)?.to_device(opts.device)?.detach()
    };
    if t.dtype().is_float() {
        t.requires_grad_(true)?;
    }
    Ok(t)
}

/// Samples from `U(-bound, bound)` (in f32, from the global generator), as a parameter.
pub fn uniform_param(shape: &[usize], bound: f64, opts: TensorOptions) -> Result<Tensor> {
    let _g = kiln_autograd::no_grad();
    let u = Tensor::rand(shape, DType::F32)?.mul(2.0 * bound)?.sub(bound)?;
    parameter(u, opts)
}

/// Samples from `N(0, std²)` (in f32, from the global generator), as a parameter.
pub fn normal_param(shape: &[usize], std: f64, opts: TensorOptions) -> Result<Tensor> {
    let _g = kiln_autograd::no_grad();
    let n = Tensor::randn(shape, DType::F32)?.mul(std)?;
    parameter(n, opts)
}
