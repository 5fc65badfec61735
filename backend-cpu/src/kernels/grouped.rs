//! `Op::GroupedMatMul` (Note [Grouped products] in kiln-tensor): one product
//! per group of consecutive rows, each run by the matmul kernel on views of
//! the operands, groups in parallel.
use super::copy::{contiguous, copy_into};
use super::elem::Elem;
use super::iter::fork_map;
use super::matmul::matmul;
use super::{buf, Input};
use kiln_tensor::grouped::{group_offsets, grouped_dim};
use kiln_tensor::{numel, with_dtype, HostBuffer, Layout, Meta, Result};

/// `a [M, K]` with `b [G, K, N]` (output `[M, N]`), or `a [K, M]` with `b [M,
/// N]` (output `[G, K, N]`), grouped by `sizes [G]`.
pub(crate) fn grouped_mm(a: &Input<'_>, b: &Input<'_>, sizes: &Input<'_>, out: &Meta) -> Result<HostBuffer> {
    let rows_mode = b.layout.ndim() == 3;
    let rows = grouped_dim(a.layout.shape(), b.layout.shape());
    let groups = group_offsets(&contiguous::<i64>(sizes)?, rows)?;
    let full = Layout::contiguous(&out.shape);
    // Each non-empty group's product and where it goes in the output.
    let parts: Vec<Option<(Layout, HostBuffer)>> = fork_map(groups.len(), &|g| {
        let (start, len) = groups[g];
        if len == 0 {
            return Ok(None);
        }
        let (la, lb, dst) = if rows_mode {
            (a.layout.slice(0, start, start + len, 1), b.layout.select(0, g), full.slice(0, start, start + len, 1))
        } else {
            (a.layout.slice(1, start, start + len, 1), b.layout.slice(0, start, start + len, 1), full.select(0, g))
        };
        let meta = Meta { shape: dst.shape().into(), dtype: out.dtype };
        let p = matmul(&Input { buf: a.buf, layout: &la }, &Input { buf: b.buf, layout: &lb }, &meta)?;
        Ok(Some((dst, p)))
    })
    .into_iter()
    .collect::<Result<_>>()?;
    with_dtype!(out.dtype, T => {
        let mut o = T::zeros(numel(&out.shape));
        for (dst, p) in parts.iter().flatten() {
            let src = Layout::contiguous(dst.shape());
            copy_into(&mut o, dst, Input { buf: p, layout: &src }.slice::<T>()?, &src)?;
        }
        Ok(buf(o))
    })
}
