//! Sorting along a dim: sort (stable, NaN largest) and topk (sorted, ties by
//! lowest index).
use super::copy::copy_into;
use super::elem::Elem;
use super::iter::{par_chunks_by, Nest};
use super::{buf, Input};
use kiln_tensor::{numel, with_dtype, HostBuffer, Layout, Result, Shape};
use std::cmp::Ordering;

/// Ascending order with NaN after everything (torch.sort's order); NaNs are equal.
#[inline]
fn asc<T: Elem>(a: T, b: T) -> Ordering {
    match (a.is_nan_(), b.is_nan_()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        _ => a.partial_cmp(&b).unwrap_or(Ordering::Equal),
    }
}

/// Runs `select` on the `(value, index)` pairs of every line along `dim`; the first
/// `k` pairs it leaves are that line's output. Returns values and indices shaped
/// like `x` with `dim` of size `k`.
fn by_lines<T: Elem>(
    x: &Input<'_>,
    dim: usize,
    k: usize,
    select: impl Fn(&mut Vec<(T, i64)>) + Sync,
) -> Result<(Vec<T>, Vec<i64>)> {
    let xv = x.slice::<T>()?;
    let l = x.layout;
    if l.ndim() == 0 {
        let mut pairs = vec![(xv[l.offset()], 0i64)];
        select(&mut pairs);
        pairs.truncate(k);
        return Ok((pairs.iter().map(|p| p.0).collect(), pairs.iter().map(|p| p.1).collect()));
    }
    let nd = l.ndim();
    let (n, s) = (l.shape()[dim], l.strides()[dim]);
    // Other dims in order, then `dim` last.
    let perm: Vec<usize> = (0..nd).filter(|&d| d != dim).chain([dim]).collect();
    let oshape: Shape = perm[..nd - 1].iter().map(|&d| l.shape()[d]).collect();
    let ostr: Shape = perm[..nd - 1].iter().map(|&d| l.strides()[d]).collect();
    let lines = numel(&oshape);
    let nest = Nest::new(&oshape, [&ostr[..]], [l.offset()]);
    let [sb] = nest.inner_strides();
    let mut bases = Vec::with_capacity(lines);
    nest.for_each_run(0, lines, |[b], len| bases.extend((0..len).map(|j| b + j * sb)));

    let mut vals = T::zeros(lines * k);
    let mut idxs = vec![0i64; lines * k];
    if k > 0 {
        let one = |scratch: &mut Vec<(T, i64)>, base: usize, v: &mut [T], ix: &mut [i64]| {
            scratch.clear();
            scratch.extend((0..n).map(|j| (xv[base + j * s], j as i64)));
            select(scratch);
            for ((dv, di), p) in v.iter_mut().zip(ix.iter_mut()).zip(scratch.iter()) {
                *dv = p.0;
                *di = p.1;
            }
        };
        let mut lines: Vec<(&mut [T], &mut [i64], usize)> =
            vals.chunks_mut(k).zip(idxs.chunks_mut(k)).zip(&bases).map(|((v, ix), &b)| (v, ix, b)).collect();
        // Tasks of many lines each (one on this thread when small), one scratch buffer per task.
        par_chunks_by(&mut lines, n.max(1) * 8, 1, &|_, lines| {
            let mut scratch = Vec::with_capacity(n);
            for (v, ix, b) in lines {
                one(&mut scratch, *b, v, ix);
            }
        });
    }
    if dim == nd - 1 {
        return Ok((vals, idxs));
    }
    // Results are laid out (others..., k): move `dim` back into place.
    let mut shape: Shape = l.shape().into();
    shape[dim] = k;
    let out_view = Layout::contiguous(&shape).permute("sort", &perm)?;
    let mut lshape = oshape.clone();
    lshape.push(k);
    let lines_layout = Layout::contiguous(&lshape);
    let mut v2 = T::zeros(vals.len());
    let mut i2 = vec![0i64; idxs.len()];
    copy_into(&mut v2, &out_view, &vals, &lines_layout)?;
    copy_into(&mut i2, &out_view, &idxs, &lines_layout)?;
    Ok((v2, i2))
}

/// Values and indices sorted along `dim`; equal values keep their order.
pub(crate) fn sort(x: &Input<'_>, dim: usize, descending: bool) -> Result<(HostBuffer, HostBuffer)> {
    let n = x.layout.shape().get(dim).copied().unwrap_or(1);
    with_dtype!(x.dtype(), T => {
        let (v, i) = by_lines::<T>(x, dim, n, |p| {
            p.sort_by(|a, b| if descending { asc(b.0, a.0) } else { asc(a.0, b.0) });
        })?;
        Ok((buf(v), buf(i)))
    })
}

/// The `k` largest (or smallest) values along `dim`, sorted, with their indices;
/// equal values are taken lowest index first.
pub(crate) fn topk(x: &Input<'_>, k: usize, dim: usize, largest: bool) -> Result<(HostBuffer, HostBuffer)> {
    with_dtype!(x.dtype(), T => {
        let cmp = move |a: &(T, i64), b: &(T, i64)| {
            let o = if largest { asc(b.0, a.0) } else { asc(a.0, b.0) };
            o.then(a.1.cmp(&b.1))
        };
        let (v, i) = by_lines::<T>(x, dim, k, |p| {
            if k < p.len() {
                p.select_nth_unstable_by(k - 1, cmp);
                p.truncate(k);
            }
            p.sort_unstable_by(cmp);
        })?;
        Ok((buf(v), buf(i)))
    })
}
