//! Attention over a paged KV cache (`Op::PagedAttention`): the serving
//! engine's attention, where each sequence's keys and values live in
//! fixed-size blocks of a shared pool and a block table says which.

// Note [Paged attention]
// ~~~~~~~~~~~~~~~~~~~~~~
// The new tokens of every sequence in a step are packed into one query
// tensor `q [N, H, D]`: sequence `s` owns rows `query_start[s] ..
// query_start[s + 1]` (`n_s` rows, a prefill chunk or one decoded token).
// Its keys and values, the new ones included (they are written to the pool
// before attention), are positions `0 .. context_lens[s]` of the sequence:
// position `p` is row `p % block_size` of pool block `block_tables[s][p /
// block_size]`. Query `i` of the sequence sits at position `context_lens[s] -
// n_s + i` and sees keys `0 ..= context_lens[s] - n_s + i` (causal). Rows
// are computed as `Op::Attention` computes one query row of a causal
// attention over the same keys, so with batch invariance on (see
// `invariance.rs`) the CPU result of a row is bit for bit the fused kernel's
// for that query, whatever else is in the step.
//
// The metadata is validated where it is read: the CPU kernel returns an
// error naming the bad value, the PJRT lowering computes a check that the
// backend turns into the same kind of error. Inference only: no gradient.
use crate::{is_grad_enabled, DType, Error, Meta, Op, Result, Tensor};
use smallvec::{smallvec, SmallVec};

const OP: &str = "paged_attention";

impl Tensor {
    /// Attention of packed queries `self: [N, H, D]` over a paged KV cache
    /// (Note [Paged attention]): `k_cache [blocks, block_size, Hk, D]`,
    /// `v_cache [blocks, block_size, Hk, Dv]` (one floating dtype with the
    /// queries, `H` a multiple of `Hk`), `block_tables [S, max_blocks]`,
    /// `context_lens [S]` and `query_start [S + 1]` (int64). Returns `[N, H,
    /// Dv]`. `scale` defaults to `1 / sqrt(D)`.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// // One sequence of 3 tokens in blocks 1 and 0 of a pool of 2 blocks of 2.
    /// let (k, v) = (Tensor::randn(&[3, 1, 1, 4], DType::F32)?, Tensor::randn(&[3, 1, 1, 4], DType::F32)?);
    /// let pool = |x: &Tensor| -> kiln::Result<Tensor> {
    ///     let p = Tensor::zeros(&[2, 2, 1, 4], DType::F32)?;
    ///     p.select(0, 1)?.copy_(&x.narrow(0, 0, 2)?.squeeze_dim(1)?)?;
    ///     p.select(0, 0)?.narrow(0, 0, 1)?.copy_(&x.narrow(0, 2, 1)?.squeeze_dim(1)?)?;
    ///     Ok(p)
    /// };
    /// let q = Tensor::randn(&[3, 1, 4], DType::F32)?;
    /// let tables = Tensor::new([[1i64, 0]])?;
    /// let out = q.paged_attention(&pool(&k)?, &pool(&v)?, &tables, &Tensor::new([3i64])?, &Tensor::new([0i64, 3])?, None)?;
    /// // The same as causal attention over the contiguous keys.
    /// let (q4, k4, v4) = (q.transpose(0, 1)?.unsqueeze(0)?, k.permute(&[1, 2, 0, 3])?, v.permute(&[1, 2, 0, 3])?);
    /// let want = q4.scaled_dot_product_attention(&k4, &v4, true, None)?.squeeze_dim(0)?.transpose(0, 1)?;
    /// assert!(out.sub(&want)?.abs()?.amax(vec![0, 1, 2], false)?.item::<f32>()? < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn paged_attention(
        &self,
        k_cache: &Tensor,
        v_cache: &Tensor,
        block_tables: &Tensor,
        context_lens: &Tensor,
        query_start: &Tensor,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        if is_grad_enabled() && [self, k_cache, v_cache].iter().any(|t| t.requires_grad()) {
            return Err(Error::invalid(
                OP,
                "paged attention has no gradient (it serves inference); train with scaled_dot_product_attention or run under no_grad",
            ));
        }
        let d = self.shape().get(2).copied().unwrap_or(0);
        let scale = scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
        if !scale.is_finite() {
            return Err(Error::invalid(OP, format!("scale must be finite, got {scale}")));
        }
        Tensor::apply1(Op::PagedAttention { scale }, &[self, k_cache, v_cache, block_tables, context_lens, query_start])
    }
}

/// The typing rule of `Op::PagedAttention`.
pub(crate) fn paged_attention_meta(inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
    let [q, k, v, tables, lens, starts] = inputs else {
        return Err(Error::invalid(OP, format!("expects 6 inputs, got {}", inputs.len())));
    };
    let bad = |what: String| Err(Error::shape(OP, what));
    if !q.dtype.is_float() || k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(Error::dtype(
            OP,
            format!("expected queries and caches of one floating dtype, got {}, {} and {}", q.dtype, k.dtype, v.dtype),
        ));
    }
    if q.shape.len() != 3 || k.shape.len() != 4 || v.shape.len() != 4 {
        return bad(format!(
            "expected q [N, H, D], k_cache [blocks, block_size, Hk, D], v_cache [blocks, block_size, Hk, Dv], got {:?}, {:?} and {:?}",
            q.shape.as_slice(),
            k.shape.as_slice(),
            v.shape.as_slice()
        ));
    }
    let (n, h, d) = (q.shape[0], q.shape[1], q.shape[2]);
    let (hk, dv) = (k.shape[2], v.shape[3]);
    if k.shape[..3] != v.shape[..3] || k.shape[3] != d || hk == 0 || h % hk != 0 || k.shape[1] == 0 {
        return bad(format!(
            "k_cache {:?} and v_cache {:?} do not fit queries {:?} (equal blocks, block size and heads; key dim {d}; query heads a multiple of key heads; block size > 0)",
            k.shape.as_slice(),
            v.shape.as_slice(),
            q.shape.as_slice()
        ));
    }
    for (what, m) in [("block_tables", tables), ("context_lens", lens), ("query_start", starts)] {
        if m.dtype != DType::I64 {
            return Err(Error::dtype(OP, format!("expected {what} of dtype int64, got {}", m.dtype)));
        }
    }
    let s = lens.shape.first().copied().unwrap_or(0);
    if tables.shape.len() != 2 || tables.shape[0] != s || lens.shape.len() != 1 || starts.shape.as_slice() != [s + 1] {
        return bad(format!(
            "expected block_tables [S, max_blocks], context_lens [S] and query_start [S + 1], got {:?}, {:?} and {:?}",
            tables.shape.as_slice(),
            lens.shape.as_slice(),
            starts.shape.as_slice()
        ));
    }
    Ok(smallvec![Meta { shape: [n, h, dv].as_slice().into(), dtype: q.dtype }])
}

/// The per-sequence metadata of a paged attention call, read from the host and
/// checked against the shapes (Note [Paged attention]): for each sequence its
/// query rows, its context length and its block table row.
#[derive(Debug, Clone)]
pub struct PagedLayout {
    /// `query_start` (S + 1 entries, from 0 to N, non-decreasing).
    pub starts: Vec<usize>,
    /// `context_lens` (each at least the sequence's query rows, at most
    /// `max_blocks * block_size`).
    pub lens: Vec<usize>,
    /// `block_tables`, row-major `[S, max_blocks]`; every entry a block of the pool.
    pub tables: Vec<usize>,
    /// Entries per block table row.
    pub max_blocks: usize,
}

impl PagedLayout {
    /// Checks the metadata values for `n` query rows and a pool of `blocks`
    /// blocks of `block_size`: the error names the first bad value. Only the
    /// table entries a sequence's context reaches must be valid blocks.
    pub fn new(
        starts: &[i64],
        lens: &[i64],
        tables: &[i64],
        n: usize,
        blocks: usize,
        block_size: usize,
    ) -> Result<PagedLayout> {
        let s = lens.len();
        let max_blocks = tables.len().checked_div(s).unwrap_or(0);
        let err = |m: String| Err(Error::index(OP, m));
        if block_size == 0 {
            return Err(Error::invalid(OP, "the block size must be positive"));
        }
        if starts.first() != Some(&0) || starts.last() != Some(&(n as i64)) {
            return err(format!("query_start must run from 0 to the {n} query rows, got {starts:?}"));
        }
        let mut st = Vec::with_capacity(s + 1);
        let mut ls = Vec::with_capacity(s);
        let mut tb = vec![0usize; tables.len()];
        for i in 0..s {
            let (a, b) = (starts[i], starts[i + 1]);
            if b < a {
                return err(format!("query_start must not decrease, got {a} then {b} at sequence {i}"));
            }
            let rows = (b - a) as usize;
            let len = lens[i];
            if len < rows as i64 || len as u64 > (max_blocks as u64).saturating_mul(block_size as u64) {
                return err(format!(
                    "context length {len} of sequence {i} must cover its {rows} new tokens and fit its {max_blocks} blocks of {block_size}"
                ));
            }
            let used = (len as usize).div_ceil(block_size);
            for j in 0..used {
                let blk = tables[i * max_blocks + j];
                if blk < 0 || blk >= blocks as i64 {
                    return err(format!(
                        "block {blk} in the table of sequence {i} is out of bounds for a pool of {blocks} blocks"
                    ));
                }
                tb[i * max_blocks + j] = blk as usize;
            }
            st.push(a as usize);
            ls.push(len as usize);
        }
        st.push(n);
        Ok(PagedLayout { starts: st, lens: ls, tables: tb, max_blocks })
    }
}
