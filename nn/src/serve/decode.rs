//! The decode step and prompt chunks as captured programs, on backends that
//! capture (PJRT): one program per bucket (Note [Step programs]).
use super::kv::{DecodeBatch, PagedKvCache};
use crate::models::LlamaForCausalLM;
use kiln_tensor::{Captured, Device, Error, Result, Tensor};
use std::sync::Arc;

// Note [Step programs]
// ~~~~~~~~~~~~~~~~~~~~
// On a backend that compiles programs (PJRT), a step whose shapes change
// every iteration would compile its ops again and again. So the engine runs
// the sequences that decode one token through a captured program of
// `LlamaForCausalLM::forward_decode`, whose inputs are all tensors (tokens,
// positions, cache slots, block tables, context lengths) and whose shapes
// depend only on the number of rows: the rows are padded up to a bucket
// (1, 2, 4, .. up to `max_num_seqs`) and every block table to the width the
// longest context needs, so each bucket is one program, traced on its first
// two calls (`kiln::compile`'s warm-up) and replayed after. The KV pools are
// state of the program: read and written in place (donated). A padded row
// decodes token 0 at position 0 of a scratch block that no sequence owns
// (the pool's last block, kept out of the allocator), so its writes touch
// nothing another row reads.
//
// A prompt chunk runs the same way through a captured program of
// `LlamaForCausalLM::forward_chunk`, one call per sequence: its tokens are
// padded up to a bucket (16, 32, .. up to `max_batched_tokens` rounded up to
// a power of two), its block table to the program's width (which leaves
// room for the largest bucket past the longest context), and the row whose
// logits are wanted is an input. Padded rows sit after the real ones (no
// real row attends to them), write to the scratch block and read it through
// the padded table. So serving on such a backend runs no model op outside a
// program. Rows with an adapter and chunks verifying proposed tokens (Note
// [Speculative decoding]) run eagerly (`forward_paged`).

/// One decoding sequence of a step.
pub(crate) struct DecodeRow<'a> {
    pub token: i64,
    pub position: usize,
    pub blocks: &'a [usize],
}

/// The captured decode step of one engine.
pub(crate) struct DecodeProgram {
    captured: Box<dyn Captured>,
    device: Device,
    block_size: usize,
    width: usize,
    scratch: usize,
    max_rows: usize,
}

impl DecodeProgram {
    /// The program for `model` over `cache`, reading and writing at most
    /// `width` blocks per sequence with block `scratch` for padded rows, or
    /// `None` when the model's backend runs op by op.
    pub fn new(
        model: &LlamaForCausalLM,
        cache: &Arc<PagedKvCache>,
        width: usize,
        scratch: usize,
        max_rows: usize,
    ) -> Result<Option<DecodeProgram>> {
        let device = model.device();
        let positions = width * cache.block_size();
        let rope = model.model.rotary().tables(0, positions, model.dtype(), device)?;
        let (m, c) = (model.clone(), Arc::clone(cache));
        let f = move |x: &[Tensor]| -> Result<Vec<Tensor>> {
            Ok(vec![m.forward_decode(&DecodeBatch::from_inputs(x)?, &rope, &c)?])
        };
        let Some(captured) = kiln_tensor::capture(device, Box::new(f)) else { return Ok(None) };
        let block_size = cache.block_size();
        Ok(Some(DecodeProgram { captured, device, block_size, width, scratch, max_rows }))
    }

    /// The rows' bucket: the next power of two, at most `max_rows` rounded up.
    fn bucket(&self, n: usize) -> usize {
        n.next_power_of_two().min(self.max_rows.next_power_of_two())
    }

    /// Runs `rows` (at most `max_rows`), returning their logits `[rows, vocab]`.
    pub fn run(&mut self, rows: &[DecodeRow<'_>]) -> Result<Tensor> {
        let n = rows.len();
        if n == 0 || n > self.max_rows {
            return Err(Error::invalid("decode", format!("{n} rows for a program of 1 to {}", self.max_rows)));
        }
        let (b, w, bs) = (self.bucket(n), self.width, self.block_size);
        let (mut ids, mut pos, mut slots, mut tables, mut lens) =
            (vec![0i64; b], vec![0i64; b], vec![0i64; b], vec![self.scratch as i64; b * w], vec![1i64; b]);
        slots[n..].fill((self.scratch * bs) as i64);
        for (i, r) in rows.iter().enumerate() {
            if r.blocks.len() > w || r.position / bs >= r.blocks.len() {
                return Err(Error::invalid(
                    "decode",
                    format!(
                        "position {} with {} blocks exceeds the program's {w} blocks of {bs}",
                        r.position,
                        r.blocks.len()
                    ),
                ));
            }
            ids[i] = r.token;
            pos[i] = r.position as i64;
            slots[i] = (r.blocks[r.position / bs] * bs + r.position % bs) as i64;
            for (t, &blk) in tables[i * w..].iter_mut().zip(r.blocks) {
                *t = blk as i64;
            }
            lens[i] = r.position as i64 + 1;
        }
        let t = |v: Vec<i64>, shape: &[usize]| -> Result<Tensor> { Tensor::from_vec(v, shape)?.to_device(self.device) };
        let inputs = [t(ids, &[b])?, t(pos, &[b])?, t(slots, &[b])?, t(tables, &[b, w])?, t(lens, &[b])?];
        let out = self.captured.call(&inputs)?;
        let logits = out.into_iter().next().ok_or_else(|| Error::invalid("decode", "the program returned nothing"))?;
        if b == n {
            Ok(logits)
        } else {
            logits.narrow(0, 0, n)
        }
    }

    /// `(traces, replays)` of the captured step so far.
    pub fn counts(&self) -> (u64, u64) {
        self.captured.counts()
    }
}

/// The captured prompt-chunk step of one engine (Note [Step programs]).
pub(crate) struct ChunkProgram {
    captured: Box<dyn Captured>,
    device: Device,
    block_size: usize,
    width: usize,
    scratch: usize,
    max_rows: usize,
}

/// The smallest chunk bucket.
const MIN_CHUNK: usize = 16;

impl ChunkProgram {
    /// The program for `model` over `cache`, for chunks of at most
    /// `max_rows` tokens of sequences of at most `max_context` positions,
    /// padded rows written to block `scratch`; `None` when the model's
    /// backend runs op by op.
    pub fn new(
        model: &LlamaForCausalLM,
        cache: &Arc<PagedKvCache>,
        max_context: usize,
        scratch: usize,
        max_rows: usize,
    ) -> Result<Option<ChunkProgram>> {
        let device = model.device();
        let bs = cache.block_size();
        let max_rows = max_rows.next_power_of_two().max(MIN_CHUNK);
        // Room for the largest bucket past the longest context.
        let width = (max_context + max_rows).div_ceil(bs);
        let rope = model.model.rotary().tables(0, width * bs, model.dtype(), device)?;
        let (m, c) = (model.clone(), Arc::clone(cache));
        let f = move |x: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![m.forward_chunk(x, &rope, &c)?]) };
        let Some(captured) = kiln_tensor::capture(device, Box::new(f)) else { return Ok(None) };
        Ok(Some(ChunkProgram { captured, device, block_size: bs, width, scratch, max_rows }))
    }

    /// Runs `tokens` at positions `start..` of a sequence holding `blocks`,
    /// returning the logits `[1, vocab]` of its last token.
    pub fn run(&mut self, tokens: &[i64], start: usize, blocks: &[usize]) -> Result<Tensor> {
        let (n, bs, w) = (tokens.len(), self.block_size, self.width);
        let b = n.next_power_of_two().max(MIN_CHUNK);
        if n == 0 || b > self.max_rows || blocks.len() > w || (start + n).div_ceil(bs) > blocks.len() {
            return Err(Error::invalid(
                "prefill",
                format!(
                    "{n} tokens at {start} with {} blocks for a program of 1 to {} rows",
                    blocks.len(),
                    self.max_rows
                ),
            ));
        }
        let scratch = (self.scratch * bs) as i64;
        let mut ids = vec![0i64; b];
        let (mut pos, mut slots) = (vec![0i64; b], vec![scratch; b]);
        for i in 0..b {
            let p = start + i;
            pos[i] = p as i64;
            if i < n {
                ids[i] = tokens[i];
                slots[i] = (blocks[p / bs] * bs + p % bs) as i64;
            }
        }
        let mut table = vec![self.scratch as i64; w];
        for (t, &blk) in table.iter_mut().zip(blocks) {
            *t = blk as i64;
        }
        let t = |v: Vec<i64>, shape: &[usize]| -> Result<Tensor> { Tensor::from_vec(v, shape)?.to_device(self.device) };
        let len = (start + b) as i64;
        let inputs = [
            t(ids, &[b])?,
            t(pos, &[b])?,
            t(slots, &[b])?,
            t(table, &[1, w])?,
            t(vec![len], &[1])?,
            t(vec![n as i64 - 1], &[1])?,
        ];
        let out = self.captured.call(&inputs)?;
        out.into_iter().next().ok_or_else(|| Error::invalid("prefill", "the program returned nothing"))
    }

    /// `(traces, replays)` of the captured chunk step so far.
    pub fn counts(&self) -> (u64, u64) {
        self.captured.counts()
    }
}
