//! The decoder over a paged KV cache: the packed sequences of a serving step
//! (Note [Paged attention] in kiln-tensor) through the same layers as
//! [`LlamaForCausalLM::forward_cached`], so a token's logits are the ones
//! incremental decoding gives it (bit for bit on the CPU with batch
//! invariance on).
use super::{DecoderLayer, LlamaForCausalLM};
use crate::layers::{Attention, RmsNorm, RopeTables};
use crate::serve::kv::{PagedBatch, PagedKvCache};
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{Error, Result, Tensor};

impl LlamaForCausalLM {
    /// Runs the new tokens of `batch` (packed, `[N]`), writing their keys and
    /// values into `cache` at the batch's slots, and returns the logits `[R,
    /// vocab]` of the rows the batch asks for (the last token of each sequence
    /// that is due a next token). Runs without recording gradients.
    pub fn forward_paged(&self, batch: &PagedBatch, cache: &PagedKvCache) -> Result<Tensor> {
        let _g = kiln_autograd::no_grad();
        let _c = ConstantScope::enter();
        if cache.num_layers() != self.model.layers.len() {
            return Err(Error::invalid(
                "forward_paged",
                format!("the KV cache has {} layers, the model {}", cache.num_layers(), self.model.layers.len()),
            ));
        }
        let ids = batch.input_ids.unsqueeze(0)?;
        let x = self.model.embed_tokens.forward(&ids)?.squeeze_dim(0)?; // [N, C]
        let rope = self.model.rotary().tables_at(batch.positions.iter().copied(), x.dtype(), x.device())?;
        let mut x = x;
        for (i, layer) in self.model.layers.iter().enumerate() {
            x = layer_paged(layer, &x, &rope, batch, cache, i)?;
        }
        let last = x.index_select(0, &batch.logits_rows)?;
        let h = self.model.norm.forward(&last)?;
        self.logits(&h)
    }
}

fn layer_paged(
    layer: &DecoderLayer,
    x: &Tensor,
    rope: &RopeTables,
    batch: &PagedBatch,
    cache: &PagedKvCache,
    i: usize,
) -> Result<Tensor> {
    let h = layer.input_layernorm.forward(x)?;
    let a = attention_paged(&layer.self_attn, &h, rope, batch, cache, i)?;
    let x1 = x.add(&a)?;
    let h2 = layer.post_attention_layernorm.forward(&x1)?;
    x1.add(&layer.mlp.forward(&h2)?)
}

/// [`Attention::forward`] for packed rows `x [N, hidden]`.
fn attention_paged(
    attn: &Attention,
    x: &Tensor,
    rope: &RopeTables,
    batch: &PagedBatch,
    cache: &PagedKvCache,
    layer: usize,
) -> Result<Tensor> {
    let n = x.shape()[0];
    let (h, kv, d) = (attn.num_heads(), attn.num_kv_heads(), attn.head_dim());
    // [N, H*d] -> [N, H, d] (-> per-head norm) -> [H, N, d] -> RoPE -> [N, H, d].
    let heads = |proj: &crate::layers::Linear, heads: usize, norm: &Option<RmsNorm>| -> Result<Tensor> {
        let y = proj.forward(x)?.reshape_to(&[n, heads, d])?;
        let y = match norm {
            Some(nm) => nm.forward(&y)?,
            None => y,
        };
        rope.apply(&y.transpose(0, 1)?)?.transpose(0, 1)
    };
    let q = heads(&attn.q_proj, h, &attn.q_norm)?;
    let k = heads(&attn.k_proj, kv, &attn.k_norm)?;
    let v = attn.v_proj.forward(x)?.reshape_to(&[n, kv, d])?;
    let (kc, vc) = cache.layer(layer);
    cache.write(kc, batch, &k)?;
    cache.write(vc, batch, &v)?;
    let scale = 1.0 / (d as f64).sqrt();
    let o = q.paged_attention(kc, vc, &batch.block_tables, &batch.context_lens, &batch.query_start, Some(scale))?;
    attn.o_proj.forward(&o.reshape_to(&[n, h * d])?)
}
