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
use crate::{is_grad_enabled, Error, Op, Result, Tensor};

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

pub use crate::op::paged::PagedLayout;
