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
use crate::error::fmt_shape;
use crate::{DType, Error, Meta, Op, Result, Tensor};
use smallvec::{smallvec, SmallVec};

const OP: &str = "grouped_mm";
const SHAPES: &str = "expected a [M, K] with mat2 [G, K, N], or a [K, M] with mat2 [M, N]";

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

/// The typing rule of `Op::GroupedMatMul`.
pub(crate) fn grouped_mm_meta(inputs: &[Meta]) -> Result<SmallVec<[Meta; 2]>> {
    let [a, b, sizes] = inputs else {
        return Err(Error::invalid(OP, format!("expects 3 inputs, got {}", inputs.len())));
    };
    if a.dtype != b.dtype {
        return Err(Error::dtype(
            OP,
            format!("expected both matrices to have the same dtype, but got {} and {}", a.dtype, b.dtype),
        ));
    }
    if a.dtype == DType::Bool {
        return Err(Error::unsupported_dtype(OP, a.dtype));
    }
    if sizes.dtype != DType::I64 || sizes.shape.len() != 1 {
        return Err(Error::dtype(
            OP,
            format!(
                "expected group_sizes of dtype int64 and shape [G], got {} {}",
                sizes.dtype,
                fmt_shape(&sizes.shape)
            ),
        ));
    }
    let g = sizes.shape[0];
    let (sa, sb) = (&a.shape, &b.shape);
    let shape: crate::Shape = match (sa.len(), sb.len()) {
        // [M, K] x [G, K, N] -> [M, N]
        (2, 3) if sb[0] == g && sb[1] == sa[1] => [sa[0], sb[2]].as_slice().into(),
        // [K, M] x [M, N] -> [G, K, N]
        (2, 2) if sa[1] == sb[0] => [g, sa[0], sb[1]].as_slice().into(),
        _ => {
            return Err(Error::shape(
                OP,
                format!("{SHAPES}, for {g} groups; got {} and {}", fmt_shape(sa), fmt_shape(sb)),
            ))
        }
    };
    Ok(smallvec![Meta { shape, dtype: a.dtype }])
}

/// The length of the grouped dimension of checked operands of shapes `a`
/// and `b`: `a`'s rows when `b` is `[G, K, N]`, its columns when `b` is
/// `[M, N]`.
pub fn grouped_dim(a: &[usize], b: &[usize]) -> usize {
    if b.len() == 3 {
        a[0]
    } else {
        a[1]
    }
}

/// The rows `(start, len)` of each group, from the sizes read on the host,
/// checked against the `rows` of the ragged dimension (Note [Grouped
/// products]).
pub fn group_offsets(sizes: &[i64], rows: usize) -> Result<Vec<(usize, usize)>> {
    let mut start = 0usize;
    let mut out = Vec::with_capacity(sizes.len());
    for (g, &s) in sizes.iter().enumerate() {
        let len = usize::try_from(s)
            .map_err(|_| Error::invalid(OP, format!("group_sizes[{g}] is {s}; group sizes must be non-negative")))?;
        let end = start.checked_add(len).filter(|&e| e <= rows).ok_or_else(|| {
            Error::invalid(OP, format!("group sizes sum past the {rows} rows of the grouped dimension (at group {g})"))
        })?;
        out.push((start, len));
        start = end;
    }
    Ok(out)
}
