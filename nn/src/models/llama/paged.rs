//! The decoder over a paged KV cache: the packed sequences of a serving step
//! (Note [Paged attention] in kiln-tensor) through the same layers as
//! [`LlamaForCausalLM::forward_cached`], so a token's logits are the ones
//! incremental decoding gives it (bit for bit on the CPU with batch
//! invariance on). [`LlamaForCausalLM::forward_decode`] is the same step with
//! every input a tensor, the form a captured program takes.
use super::{DecoderLayer, LlamaForCausalLM};
use crate::layers::{Attention, RmsNorm, RopeTables};
use crate::serve::kv::{DecodeBatch, PagedBatch, PagedKvCache};
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{Error, Result, Tensor};

/// Where a step's new keys and values go.
enum Writes<'a> {
    /// Runs of consecutive slots, `(first slot, first row, length)`.
    Runs(&'a [(usize, usize, usize)]),
    /// One slot per row, `[N]` int64 on the cache's device.
    Slots(&'a Tensor),
}

/// The metadata of a step besides its tokens.
struct Step<'a> {
    rope: RopeTables,
    writes: Writes<'a>,
    block_tables: &'a Tensor,
    context_lens: &'a Tensor,
    query_start: &'a Tensor,
}

impl LlamaForCausalLM {
    /// Runs the new tokens of `batch` (packed, `[N]`), writing their keys and
    /// values into `cache` at the batch's slots, and returns the logits `[R,
    /// vocab]` of the rows the batch asks for (the last token of each sequence
    /// that is due a next token). Runs without recording gradients.
    pub fn forward_paged(&self, batch: &PagedBatch, cache: &PagedKvCache) -> Result<Tensor> {
        let _g = kiln_autograd::no_grad();
        let _c = ConstantScope::enter();
        let rope = self.model.rotary().tables_at(batch.positions.iter().copied(), self.dtype(), self.device())?;
        let step = Step {
            rope,
            writes: Writes::Runs(&batch.write_runs),
            block_tables: &batch.block_tables,
            context_lens: &batch.context_lens,
            query_start: &batch.query_start,
        };
        let x = self.paged_layers(&batch.input_ids, &step, cache)?;
        let last = x.index_select(0, &batch.logits_rows)?;
        self.logits(&self.model.norm.forward(&last)?)
    }

    /// One decoding token for each of the `B` sequences of `batch`, every
    /// input a tensor (Note [Step programs]). `rope` holds the rotary
    /// tables of every position (`RotaryEmbedding::tables(0, max, ..)`), read
    /// at the batch's positions. Returns the logits `[B, vocab]`: those
    /// [`Self::forward_paged`] gives these tokens, with nothing taken from the
    /// host, so one captured program of it serves any sequences of `B` rows.
    pub fn forward_decode(&self, batch: &DecodeBatch, rope: &RopeTables, cache: &PagedKvCache) -> Result<Tensor> {
        let _g = kiln_autograd::no_grad();
        let DecodeBatch { input_ids, positions, slots, block_tables, context_lens } = batch;
        let b = input_ids.shape().first().copied().unwrap_or(0);
        for (name, t) in [("positions", positions), ("slots", slots), ("context_lens", context_lens)] {
            if t.shape() != [b] {
                return Err(Error::shape(
                    "forward_decode",
                    format!("{name} must be [{b}] like input_ids, got {:?}", t.shape()),
                ));
            }
        }
        let rope = RopeTables { cos: rope.cos.index_select(0, positions)?, sin: rope.sin.index_select(0, positions)? };
        // Each sequence has one row: query starts 0, 1, .., B.
        let starts = {
            let _c = ConstantScope::enter();
            Tensor::arange(0.0, (b + 1) as f64, 1.0, (kiln_tensor::DType::I64, self.device()))?
        };
        let step = Step { rope, writes: Writes::Slots(slots), block_tables, context_lens, query_start: &starts };
        let x = self.paged_layers(input_ids, &step, cache)?;
        let _c = ConstantScope::enter();
        self.logits(&self.model.norm.forward(&x)?)
    }

    /// A prompt chunk of one sequence, every input a tensor (Note [Step
    /// programs]): `input_ids`, `positions` and `slots` `[T]`, the block
    /// table `[1, W]`, `context_len` `[1]` (the position after the chunk's
    /// last row) and `logits_row` `[1]` (the row whose logits are returned).
    /// Rows past the chunk's real tokens (padding up to a bucket) write to
    /// slots nobody reads and are never attended to by the real ones
    /// (causality). Returns the logits `[1, vocab]` of that row.
    pub fn forward_chunk(&self, x: &[Tensor], rope: &RopeTables, cache: &PagedKvCache) -> Result<Tensor> {
        let _g = kiln_autograd::no_grad();
        let [input_ids, positions, slots, block_tables, context_lens, logits_row] = x else {
            return Err(Error::invalid("forward_chunk", format!("6 inputs expected, got {}", x.len())));
        };
        let t = input_ids.shape().first().copied().unwrap_or(0);
        if positions.shape() != [t] || slots.shape() != [t] || context_lens.shape() != [1] || logits_row.shape() != [1]
        {
            return Err(Error::shape(
                "forward_chunk",
                format!(
                    "expected positions and slots [{t}] like input_ids, context_len and logits_row [1], got {:?}, {:?}, {:?} and {:?}",
                    positions.shape(),
                    slots.shape(),
                    context_lens.shape(),
                    logits_row.shape()
                ),
            ));
        }
        let rope = RopeTables { cos: rope.cos.index_select(0, positions)?, sin: rope.sin.index_select(0, positions)? };
        let starts = {
            let _c = ConstantScope::enter();
            Tensor::arange(0.0, 2.0 * t as f64, t.max(1) as f64, (kiln_tensor::DType::I64, self.device()))?
        };
        let step = Step { rope, writes: Writes::Slots(slots), block_tables, context_lens, query_start: &starts };
        let h = self.paged_layers(input_ids, &step, cache)?;
        let _c = ConstantScope::enter();
        let last = h.index_select(0, logits_row)?;
        self.logits(&self.model.norm.forward(&last)?)
    }

    /// The embedding and decoder layers over packed tokens `[N]`: `[N, hidden]`.
    fn paged_layers(&self, ids: &Tensor, step: &Step<'_>, cache: &PagedKvCache) -> Result<Tensor> {
        if cache.num_layers() != self.model.layers.len() {
            return Err(Error::invalid(
                "forward_paged",
                format!("the KV cache has {} layers, the model {}", cache.num_layers(), self.model.layers.len()),
            ));
        }
        let _c = ConstantScope::enter();
        let mut x = self.model.embed_tokens.forward(&ids.unsqueeze(0)?)?.squeeze_dim(0)?; // [N, C]
        for (i, layer) in self.model.layers.iter().enumerate() {
            x = layer_paged(layer, &x, step, cache, i)?;
        }
        Ok(x)
    }
}

fn layer_paged(layer: &DecoderLayer, x: &Tensor, step: &Step<'_>, cache: &PagedKvCache, i: usize) -> Result<Tensor> {
    let h = layer.input_layernorm.forward(x)?;
    let a = attention_paged(&layer.self_attn, &h, step, cache, i)?;
    let (x1, h2) = layer.add_and_norm(x, &a)?;
    x1.add(&layer.mlp.forward(&h2)?)
}

/// [`Attention::forward`] for packed rows `x [N, hidden]`.
fn attention_paged(
    attn: &Attention,
    x: &Tensor,
    step: &Step<'_>,
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
        step.rope.apply(&y.transpose(0, 1)?)?.transpose(0, 1)
    };
    let q = heads(&attn.q_proj, h, &attn.q_norm)?;
    let k = heads(&attn.k_proj, kv, &attn.k_norm)?;
    let v = attn.v_proj.forward(x)?.reshape_to(&[n, kv, d])?;
    match step.writes {
        Writes::Runs(runs) => cache.write(layer, runs, &k, &v)?,
        Writes::Slots(slots) => cache.write_slots(layer, slots, &k, &v)?,
    }
    let scale = 1.0 / (d as f64).sqrt();
    let o = cache.attention(layer, &q, (step.block_tables, step.context_lens, step.query_start), scale)?;
    attn.o_proj.forward(&o.reshape_to(&[n, h * d])?)
}
