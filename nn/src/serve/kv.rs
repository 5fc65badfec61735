//! The paged KV cache: one pool of fixed-size blocks per layer for keys and
//! one for values, preallocated, and the packed batch a step runs.
use crate::models::LlamaForCausalLM;
use kiln_tensor::{DType, Device, Error, Result, Tensor};

/// Keys and values of every layer in blocks: `[blocks, block_size, kv_heads,
/// head_dim]` per layer and kind, in the cache's dtype (the model's, or a
/// narrower one: Note [KV cache dtypes] in kiln-tensor) on the model's
/// device, with `[blocks, block_size, kv_heads]` float32 scales per layer and
/// kind for float8.
#[derive(Debug)]
pub struct PagedKvCache {
    layers: Vec<LayerPool>,
    num_blocks: usize,
    block_size: usize,
    dtype: DType,
}

/// One layer's pools.
#[derive(Debug)]
struct LayerPool {
    k: Tensor,
    v: Tensor,
    /// Float8: the rows' scales (keys, values).
    scales: Option<(Tensor, Tensor)>,
}

impl PagedKvCache {
    /// The bytes one block takes over all layers, keys and values, in `dtype`
    /// (`usize::MAX` when that does not fit a `usize`).
    pub fn bytes_per_block(model: &LlamaForCausalLM, block_size: usize, dtype: DType) -> usize {
        let c = model.config();
        let row = crate::layers::row_bytes(dtype, c.head_dim);
        [c.num_hidden_layers, block_size, c.num_key_value_heads, row].iter().fold(2usize, |a, &b| a.saturating_mul(b))
    }

    /// A pool of `num_blocks` blocks of `block_size` positions in `dtype`,
    /// zeroed ([`crate::layers::check_kv_dtype`] says which dtypes serve the model).
    pub fn new(model: &LlamaForCausalLM, num_blocks: usize, block_size: usize, dtype: DType) -> Result<PagedKvCache> {
        crate::layers::check_kv_dtype(model.dtype(), dtype)?;
        if num_blocks == 0 || block_size == 0 {
            return Err(Error::invalid(
                "PagedKvCache",
                format!("needs at least one block of at least one position, got {num_blocks} of {block_size}"),
            ));
        }
        let c = model.config();
        let shape = [num_blocks, block_size, c.num_key_value_heads, c.head_dim];
        let dev: Device = model.device();
        let zeros = |shape: &[usize], dt: DType| Tensor::zeros(shape, (dt, dev));
        let layers = (0..c.num_hidden_layers)
            .map(|_| {
                let scales = match dtype.is_float8() {
                    true => Some((zeros(&shape[..3], DType::F32)?, zeros(&shape[..3], DType::F32)?)),
                    false => None,
                };
                Ok(LayerPool { k: zeros(&shape, dtype)?, v: zeros(&shape, dtype)?, scales })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedKvCache { layers, num_blocks, block_size, dtype })
    }

    /// As many blocks as fit in `bytes`.
    pub fn with_budget(
        model: &LlamaForCausalLM,
        bytes: usize,
        block_size: usize,
        dtype: DType,
    ) -> Result<PagedKvCache> {
        let per = Self::bytes_per_block(model, block_size, dtype).max(1);
        PagedKvCache::new(model, bytes / per, block_size, dtype)
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Layers held.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The dtype keys and values are stored in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Writes the rows `k`, `v` (`[N, kv_heads, head_dim]`) of `layer` at
    /// `runs` of consecutive slots (`PagedBatch::write_runs`), in place: one
    /// copy per run (a decoded token, or the part of a prompt chunk within
    /// one block), so a step touches only the positions it adds (an indexed
    /// write copies the whole pool on the CPU).
    pub fn write(&self, layer: usize, runs: &[(usize, usize, usize)], k: &Tensor, v: &Tensor) -> Result<()> {
        for (pool, scales, x) in self.pools(layer, k, v)? {
            let (x, sx) = crate::layers::store_rows(x, self.dtype)?;
            for (dst, src) in [(Some(pool), Some(x)), (scales, sx)] {
                let (Some(dst), Some(src)) = (dst, src) else { continue };
                let flat = Self::flat(dst)?;
                for &(slot, row, len) in runs {
                    flat.narrow(0, slot as isize, len)?.copy_(&src.narrow(0, row as isize, len)?)?;
                }
            }
        }
        Ok(())
    }

    /// Writes the rows `k`, `v` (`[N, kv_heads, head_dim]`) of `layer` at
    /// `slots [N]` (int64 on the pool's device) with one scatter each: what a
    /// captured program does (the scatter checks its indices on the device,
    /// where advanced indexing would read them on the host), writing the
    /// donated pools in place.
    pub fn write_slots(&self, layer: usize, slots: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        for (pool, scales, x) in self.pools(layer, k, v)? {
            let s = x.shape();
            if slots.shape() != [s[0]] {
                return Err(Error::shape(
                    "PagedKvCache::write_slots",
                    format!("needs slots [N] for rows {s:?}, got {:?}", slots.shape()),
                ));
            }
            let (x, sx) = crate::layers::store_rows(x, self.dtype)?;
            let idx = slots.reshape_to(&[s[0], 1, 1])?.broadcast_to(s)?;
            Self::flat(pool)?.scatter_(0, &idx, &x)?;
            if let (Some(sp), Some(sx)) = (scales, sx) {
                let idx = slots.reshape_to(&[s[0], 1])?.broadcast_to(&s[..2])?;
                Self::flat(sp)?.scatter_(0, &idx, &sx)?;
            }
        }
        Ok(())
    }

    /// Paged attention of queries `q [N, H, D]` over `layer`'s pools
    /// ([`Tensor::paged_attention`], or its scaled form for float8).
    pub fn attention(
        &self,
        layer: usize,
        q: &Tensor,
        (block_tables, context_lens, query_start): (&Tensor, &Tensor, &Tensor),
        scale: f64,
    ) -> Result<Tensor> {
        let p = self.layer_pool(layer)?;
        match &p.scales {
            None => q.paged_attention(&p.k, &p.v, block_tables, context_lens, query_start, Some(scale)),
            Some((ks, vs)) => {
                q.paged_attention_scaled((&p.k, ks), (&p.v, vs), block_tables, context_lens, query_start, Some(scale))
            }
        }
    }

    fn layer_pool(&self, layer: usize) -> Result<&LayerPool> {
        self.layers.get(layer).ok_or_else(|| {
            Error::index("PagedKvCache", format!("layer {layer} of a cache of {} layers", self.layers.len()))
        })
    }

    /// `(pool, its scales, rows)` for the keys and the values of `layer`,
    /// the rows checked to be `[N, kv_heads, head_dim]`.
    #[allow(clippy::type_complexity)]
    fn pools<'a>(
        &'a self,
        layer: usize,
        k: &'a Tensor,
        v: &'a Tensor,
    ) -> Result<[(&'a Tensor, Option<&'a Tensor>, &'a Tensor); 2]> {
        let p = self.layer_pool(layer)?;
        for x in [k, v] {
            let (s, ps) = (x.shape(), p.k.shape());
            if s.len() != 3 || s[1..] != ps[2..] {
                return Err(Error::shape(
                    "PagedKvCache::write",
                    format!("needs rows [N, {}, {}], got {s:?}", ps[2], ps[3]),
                ));
            }
        }
        let (sk, sv) = p.scales.as_ref().map_or((None, None), |(a, b)| (Some(a), Some(b)));
        Ok([(&p.k, sk, k), (&p.v, sv, v)])
    }

    /// `pool` as `[blocks * block_size, ..]`, aliasing it.
    fn flat(pool: &Tensor) -> Result<Tensor> {
        let s = pool.shape();
        let mut shape = vec![s[0] * s[1]];
        shape.extend_from_slice(&s[2..]);
        pool.reshape_to(&shape)
    }
}

/// One sequence's part of a step: its new tokens, where they start, its
/// block table (covering them) and how many of its last rows' logits are
/// wanted (1 when it is due a next token; more to verify proposed tokens).
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// The tokens run this step.
    pub tokens: &'a [i64],
    /// The position of the first of them (the tokens before are cached).
    pub start: usize,
    /// The blocks of the sequence, in order.
    pub blocks: &'a [usize],
    /// The logits of this many of the last tokens are wanted (at most all).
    pub logits: usize,
}

/// The packed inputs of one step (Note [Paged attention] in kiln-tensor).
#[derive(Debug, Clone)]
pub struct PagedBatch {
    /// The new tokens of every sequence, `[N]` int64.
    pub input_ids: Tensor,
    /// Their positions.
    pub positions: Vec<usize>,
    /// Their cache slots as runs of consecutive slots: `(first slot, first
    /// row, length)`.
    pub write_runs: Vec<(usize, usize, usize)>,
    /// `[S, max_blocks]` int64.
    pub block_tables: Tensor,
    /// `[S]` int64: positions cached after the step.
    pub context_lens: Tensor,
    /// `[S + 1]` int64.
    pub query_start: Tensor,
    /// The rows whose logits are returned, `[R]` int64, sequence by sequence.
    pub logits_rows: Tensor,
}

impl PagedBatch {
    /// Packs `seqs` for a cache of blocks of `block_size`, on `device`.
    pub fn new(seqs: &[SeqChunk<'_>], block_size: usize, device: Device) -> Result<PagedBatch> {
        if block_size == 0 {
            return Err(Error::invalid("PagedBatch", "the block size must be positive"));
        }
        let mb = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0).max(1);
        let (mut ids, mut pos, mut tables, mut lens, mut starts, mut rows) =
            (vec![], vec![], vec![], vec![], vec![0i64], vec![]);
        let mut runs: Vec<(usize, usize, usize)> = vec![];
        for s in seqs {
            let Some(end) = s.start.checked_add(s.tokens.len()) else {
                return Err(Error::invalid(
                    "PagedBatch",
                    format!("a chunk starting at position {} overflows", s.start),
                ));
            };
            if end.div_ceil(block_size) > s.blocks.len() {
                return Err(Error::invalid(
                    "PagedBatch",
                    format!("{} blocks of {block_size} cannot hold {end} positions", s.blocks.len()),
                ));
            }
            for (i, &t) in s.tokens.iter().enumerate() {
                let p = s.start + i;
                let slot = s.blocks[p / block_size] * block_size + p % block_size;
                match runs.last_mut() {
                    Some((first, row, len)) if *first + *len == slot && *row + *len == ids.len() => *len += 1,
                    _ => runs.push((slot, ids.len(), 1)),
                }
                ids.push(t);
                pos.push(p);
            }
            tables.extend((0..mb).map(|j| s.blocks.get(j).copied().unwrap_or(0) as i64));
            lens.push(end as i64);
            starts.push(ids.len() as i64);
            let n = ids.len() as i64;
            rows.extend(n - s.logits.min(s.tokens.len()) as i64..n);
        }
        let t = |v: Vec<i64>, shape: &[usize]| -> Result<Tensor> { Tensor::from_vec(v, shape)?.to_device(device) };
        let (n, s, r) = (ids.len(), seqs.len(), rows.len());
        Ok(PagedBatch {
            input_ids: t(ids, &[n])?,
            positions: pos,
            write_runs: runs,
            block_tables: t(tables, &[s, mb])?,
            context_lens: t(lens, &[s])?,
            query_start: t(starts, &[s + 1])?,
            logits_rows: t(rows, &[r])?,
        })
    }
}

/// The inputs of a decoding step with one token per sequence, all tensors
/// (int64, on the model's device): the form a captured program takes
/// (`LlamaForCausalLM::forward_decode`).
#[derive(Debug, Clone)]
pub struct DecodeBatch {
    /// The tokens, `[B]`.
    pub input_ids: Tensor,
    /// Their positions, `[B]`.
    pub positions: Tensor,
    /// Their cache slots (`block * block_size + offset`), `[B]`.
    pub slots: Tensor,
    /// `[B, W]`.
    pub block_tables: Tensor,
    /// Positions cached after the step (each position + 1), `[B]`.
    pub context_lens: Tensor,
}

impl DecodeBatch {
    /// The batch from the five tensors a captured step takes, in the fields'
    /// order (`input_ids`, `positions`, `slots`, `block_tables`, `context_lens`).
    pub fn from_inputs(x: &[Tensor]) -> Result<DecodeBatch> {
        let [input_ids, positions, slots, block_tables, context_lens] = x else {
            return Err(Error::invalid("decode", format!("5 inputs expected, got {}", x.len())));
        };
        Ok(DecodeBatch {
            input_ids: input_ids.clone(),
            positions: positions.clone(),
            slots: slots.clone(),
            block_tables: block_tables.clone(),
            context_lens: context_lens.clone(),
        })
    }
}
