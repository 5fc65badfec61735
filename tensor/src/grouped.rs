//! The grouped matrix product (`Op::GroupedMatMul`, PyTorch's
//! `torch._grouped_mm`, JAX's `lax.ragged_dot`): one product per group of
//! consecutive rows, each with its own matrix, group sizes given as a tensor.
//! Mixture-of-experts blocks run every expert at once with it.

// Note [Grouped products]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The rows `0 .. M` of the ragged dimension are split into `G` consecutive
// groups by `group_sizes [G]` (int64): group `g` holds rows `off[g] ..
// off[g] + group_sizes[g]`, `off` the exclusive prefix sum. Two forms, as
// `torch._grouped_mm` has them:
//
// - `a [M, K]`, `b [G, K, N]`: output `[M, N]`, rows of group `g` are
//   `a[rows_g] @ b[g]`; rows past the last group (`off[G] <= M`) are zero.
// - `a [K, M]`, `b [M, N]`: the ragged dimension is contracted; output
//   `[G, K, N]`, slice `g` is `a[:, rows_g] @ b[rows_g]`, zero for an empty
//   group.
//
// Each form's gradient is a product of the two forms (`autograd`'s rule), so
// differentiating never leaves the primitive and a group no row chose gets a
// zero gradient. The sizes are data, not shapes: a traced or compiled
// program keeps static shapes while the grouping changes from step to step
// (a mixture-of-experts router's choices). A negative size, or sizes that
// sum past `M`, is an error: the CPU kernel names it, the PJRT lowering
// computes a check that the backend turns into the same error. Half
// precision multiplies in float32 and rounds once, as `Op::MatMul` does.
use crate::{Op, Result, Tensor};

pub use crate::op::grouped::{group_offsets, grouped_dim};

impl Tensor {
    /// A product per group of consecutive rows (Note [Grouped products],
    /// PyTorch's `torch._grouped_mm` with `offs` given as sizes): `self [M,
    /// K]` with `mat2 [G, K, N]` gives `[M, N]`, group `g`'s rows multiplied
    /// by `mat2[g]`; `self [K, M]` with `mat2 [M, N]` gives `[G, K, N]`, the
    /// ragged dimension contracted group by group. `group_sizes` is int64
    /// `[G]`, non-negative, summing to at most `M`.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::randn(&[5, 3], DType::F32)?;
    /// let w = Tensor::randn(&[2, 3, 4], DType::F32)?;
    /// let y = x.grouped_mm(&w, &Tensor::new([2i64, 3])?)?;
    /// // Rows 0..2 use w[0], rows 2..5 use w[1].
    /// let want = Tensor::cat(&[
    ///     &x.narrow(0, 0, 2)?.mm(&w.select(0, 0)?)?,
    ///     &x.narrow(0, 2, 3)?.mm(&w.select(0, 1)?)?,
    /// ], 0)?;
    /// assert!(y.sub(&want)?.abs()?.amax(vec![0, 1], false)?.item::<f32>()? < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn grouped_mm(&self, mat2: &Tensor, group_sizes: &Tensor) -> Result<Tensor> {
        if let Some((a, b)) = crate::autocast::lowered(self, mat2)? {
            return a.grouped_mm(&b, group_sizes);
        }
        Tensor::apply1(Op::GroupedMatMul, &[self, mat2, group_sizes])
    }
}
