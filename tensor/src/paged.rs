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
// Note [KV cache dtypes]
// ~~~~~~~~~~~~~~~~~~~~~~
// A cache may be stored narrower than the queries, to hold more tokens:
//
// - bfloat16 or float16 caches under float32 queries: each element read is
//   widened (exactly) to float32;
// - float8 caches (e4m3fn, e5m2) under float32, bfloat16 or float16
//   queries, with one float32 scale per cached row (a position's `D` keys,
//   or `Dv` values, of one key/value head): the value read is the element
//   widened to float32 times its row's scale, one float32 product.
//
// The attention then runs in float32 on those values, as `Op::Attention`
// runs on the same keys and values given in float32: a row of a float32
// model over a narrow cache is bit for bit the fused kernel's over the
// widened (dequantized) cache, with batch invariance on. Writing a cache
// (rounding, and for float8 choosing each row's scale) is the caller's:
// kiln-nn's KV caches divide a row by `amax(|row|) / 448` (e4m3fn's largest
// finite value) before rounding, so no row overflows and each keeps the
// format's full relative precision.
//
// The metadata is validated where it is read: the CPU kernel returns an
// error naming the bad value, the PJRT lowering computes a check that the
// backend turns into the same kind of error. Inference only: no gradient.
use crate::{is_grad_enabled, Error, Op, Result, Tensor};

const OP: &str = "paged_attention";

impl Tensor {
    /// Attention of packed queries `self: [N, H, D]` over a paged KV cache
    /// (Note [Paged attention]): `k_cache [blocks, block_size, Hk, D]`,
    /// `v_cache [blocks, block_size, Hk, Dv]` (of the queries' floating
    /// dtype, or bfloat16 / float16 under float32 queries: Note [KV cache
    /// dtypes]; `H` a multiple of `Hk`), `block_tables [S, max_blocks]`,
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
        let op = Op::PagedAttention { scale: check_scale(self, [k_cache, v_cache], scale)?, kv_scales: false };
        Tensor::apply1(op, &[self, k_cache, v_cache, block_tables, context_lens, query_start])
    }

    /// [`Tensor::paged_attention`] over float8 caches with their float32
    /// scales, one per cached row (Note [KV cache dtypes]): `(k_cache [blocks,
    /// block_size, Hk, D], k_scales [blocks, block_size, Hk])` and the values
    /// alike. The queries are float32, bfloat16 or float16.
    pub fn paged_attention_scaled(
        &self,
        (k_cache, k_scales): (&Tensor, &Tensor),
        (v_cache, v_scales): (&Tensor, &Tensor),
        block_tables: &Tensor,
        context_lens: &Tensor,
        query_start: &Tensor,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        let op = Op::PagedAttention { scale: check_scale(self, [k_cache, v_cache], scale)?, kv_scales: true };
        let ins = [self, k_cache, v_cache, block_tables, context_lens, query_start, k_scales, v_scales];
        Tensor::apply1(op, &ins)
    }
}

/// The softmax scale of queries `q` (default `1 / sqrt(D)`), refusing
/// queries or caches that need a gradient (paged attention has none).
fn check_scale(q: &Tensor, caches: [&Tensor; 2], scale: Option<f64>) -> Result<f64> {
    if is_grad_enabled() && [q, caches[0], caches[1]].iter().any(|t| t.requires_grad()) {
        return Err(Error::invalid(
            OP,
            "paged attention has no gradient (it serves inference); train with scaled_dot_product_attention or run under no_grad",
        ));
    }
    let d = q.shape().get(2).copied().unwrap_or(0);
    let scale = scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
    if !scale.is_finite() {
        return Err(Error::invalid(OP, format!("scale must be finite, got {scale}")));
    }
    Ok(scale)
}

pub use crate::op::paged::PagedLayout;
