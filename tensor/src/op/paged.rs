//! The typing rule of `Op::PagedAttention` and the paged metadata every
//! backend checks (Note [Paged attention] in `paged.rs`).
use crate::{DType, Error, Meta, Result};
use smallvec::{smallvec, SmallVec};

const OP: &str = "paged_attention";

/// The typing rule of `Op::PagedAttention` (Note [KV cache dtypes] in
/// `paged.rs` for the caches' dtypes).
pub(crate) fn paged_attention_meta(inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
    let (q, k, v, tables, lens, starts, scales) = match inputs {
        [q, k, v, t, l, s] => (q, k, v, t, l, s, None),
        [q, k, v, t, l, s, ks, vs] => (q, k, v, t, l, s, Some((ks, vs))),
        _ => return Err(Error::invalid(OP, format!("expects 6 inputs, or 8 with scales, got {}", inputs.len()))),
    };
    let bad = |what: String| Err(Error::shape(OP, what));
    let fits = match (q.dtype, k.dtype) {
        _ if k.dtype != v.dtype || !q.dtype.is_float() || q.dtype.is_float8() => false,
        (DType::F32 | DType::BF16 | DType::F16, c) if c.is_float8() => scales.is_some(),
        (DType::F32, DType::BF16 | DType::F16) => scales.is_none(),
        (a, b) => a == b && scales.is_none(),
    };
    if !fits {
        return Err(Error::dtype(
            OP,
            format!(
                "expected caches of the queries' floating dtype, bfloat16 or float16 caches for float32 queries, or float8 caches with scales for float32, bfloat16 or float16 queries; got queries {}, caches {} and {}, {}",
                q.dtype,
                k.dtype,
                v.dtype,
                if scales.is_some() { "with scales" } else { "without scales" }
            ),
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
    if let Some((ks, vs)) = scales {
        for (what, m) in [("k_scales", ks), ("v_scales", vs)] {
            if m.dtype != DType::F32 || m.shape.as_slice() != &k.shape[..3] {
                return Err(Error::shape(
                    OP,
                    format!(
                        "expected {what} float32 [blocks, block_size, Hk] = {:?} (one per cached row), got {:?} {}",
                        &k.shape[..3],
                        m.shape.as_slice(),
                        m.dtype
                    ),
                ));
            }
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
