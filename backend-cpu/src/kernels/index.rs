//! Indexing: gather, scatter (replace / add), index_select, index_add, nonzero.
//!
//! Indices are validated before anything is written: an index outside
//! `[0, size)` (negative ones included) is an `Error::index`, never a panic.
use super::copy::materialize_vec;
use super::elem::Elem;
use super::iter::{par_chunks, Nest};
use super::map::map1;
use super::{buf, Input};
use kiln_tensor::{
    contiguous_strides, numel, with_dtype, Error, HostBuffer, Layout, Meta, Result, ScatterReduce, Shape, Strides,
};

/// A 0-d layout as the 1-d layout of its one element (index ops treat a scalar as size 1).
fn at_least_1d(l: &Layout) -> Layout {
    if l.ndim() == 0 {
        Layout::new(Shape::from_elem(1, 1), Strides::from_elem(1, 1), l.offset())
    } else {
        l.clone()
    }
}

/// Checks that every index is in `[0, size)`.
fn check_indices(op: &'static str, idx: &[i64], il: &Layout, dim: usize, size: usize) -> Result<()> {
    let nest = Nest::new(il.shape(), [il.strides()], [il.offset()]);
    let [s] = nest.inner_strides();
    let mut bad = None;
    nest.for_each_run(0, nest.numel(), |[o], len| {
        if bad.is_none() {
            bad = (0..len).map(|j| idx[o + j * s]).find(|&v| v < 0 || v as u64 >= size as u64);
        }
    });
    match bad {
        Some(v) => Err(Error::index(op, format!("index {v} is out of bounds for dimension {dim} with size {size}"))),
        None => Ok(()),
    }
}

/// `strides` with the entry of `dim` set to 0.
fn zero_dim(strides: &[usize], dim: usize) -> Strides {
    let mut s: Strides = strides.into();
    s[dim] = 0;
    s
}

/// Strides of a 1-d index laid along `dim` of an `ndim`-d iteration space.
fn index_along(ndim: usize, dim: usize, idx: &Layout) -> Strides {
    let mut s: Strides = Strides::from_elem(0, ndim);
    s[dim] = idx.strides().first().copied().unwrap_or(0);
    s
}

/// A strided view: data, strides (one per dim of the iteration space) and offset.
struct View<'a, T> {
    v: &'a [T],
    strides: &'a [usize],
    offset: usize,
}

/// `out[p] = x[x(p) + idx[idx(p)] * dim_stride]` over `shape` (contiguous out), where
/// `x`'s strides have the gathered dim zeroed. Indices were validated.
fn gather_engine<T: Elem>(x: View<'_, T>, dim_stride: usize, idx: View<'_, i64>, shape: &[usize]) -> Vec<T> {
    let (xv, iv) = (x.v, idx.v);
    let cs = contiguous_strides(shape);
    let nest = Nest::new(shape, [&cs, x.strides, idx.strides], [0, x.offset, idx.offset]);
    let [_, sx, si] = nest.inner_strides();
    let mut out = T::zeros(nest.numel());
    par_chunks(&mut out, 2, &|start, chunk| {
        nest.for_each_run(start, start + chunk.len(), |[o, xb, ib], len| {
            let dst = &mut chunk[o - start..o - start + len];
            if si == 0 {
                // One index for the whole run: a strided (often contiguous) row copy.
                let base = xb + iv[ib] as usize * dim_stride;
                if sx == 1 {
                    dst.copy_from_slice(&xv[base..base + len]);
                } else {
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = xv[base + j * sx];
                    }
                }
            } else {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = xv[xb + j * sx + iv[ib + j * si] as usize * dim_stride];
                }
            }
        });
    });
    out
}

/// `out[i][j] = x[i][index[i][j]]` (for dim 1); the output has the index's shape.
pub(crate) fn gather(x: &Input<'_>, index: &Input<'_>, dim: usize) -> Result<HostBuffer> {
    let (xl, il) = (at_least_1d(x.layout), at_least_1d(index.layout));
    let iv = index.slice::<i64>()?;
    let size = xl.shape()[dim];
    check_indices("gather", iv, &il, dim, size)?;
    let xs = zero_dim(xl.strides(), dim);
    let ds = xl.strides()[dim];
    with_dtype!(x.dtype(), T => {
        let xv = View { v: x.slice::<T>()?, strides: &xs, offset: xl.offset() };
        let out = gather_engine(xv, ds, View { v: iv, strides: il.strides(), offset: il.offset() }, il.shape());
        Ok(buf(out))
    })
}

/// Slices of `x` along `dim` picked by a 1-d (or 0-d) index.
pub(crate) fn index_select(x: &Input<'_>, index: &Input<'_>, dim: usize, out: &Meta) -> Result<HostBuffer> {
    let xl = at_least_1d(x.layout);
    let il = index.layout;
    let iv = index.slice::<i64>()?;
    check_indices("index_select", iv, il, dim, xl.shape()[dim])?;
    let mut shape: Shape = xl.shape().into();
    shape[dim] = il.numel();
    let xs = zero_dim(xl.strides(), dim);
    let is = index_along(shape.len(), dim, il);
    with_dtype!(x.dtype(), T => {
        let xv = View { v: x.slice::<T>()?, strides: &xs, offset: xl.offset() };
        let v = gather_engine(xv, xl.strides()[dim], View { v: iv, strides: &is, offset: il.offset() }, &shape);
        debug_assert_eq!(v.len(), numel(&out.shape));
        Ok(buf(v))
    })
}

/// `out[o(p) + idx[idx(p)] * dim_stride] (op)= src[src(p)]` over `shape`, where `os`
/// are out's strides with the scattered dim zeroed. Sequential, so later writes win.
fn scatter_engine<T: Elem>(
    out: &mut [T],
    os: &[usize],
    dim_stride: usize,
    src: View<'_, T>,
    idx: View<'_, i64>,
    shape: &[usize],
    add: bool,
) {
    let (sv, iv) = (src.v, idx.v);
    let nest = Nest::new(shape, [os, src.strides, idx.strides], [0, src.offset, idx.offset]);
    let [so, ss, si] = nest.inner_strides();
    nest.for_each_run(0, nest.numel(), |[ob, sb, ib], len| {
        for j in 0..len {
            let o = ob + j * so + iv[ib + j * si] as usize * dim_stride;
            let v = sv[sb + j * ss];
            out[o] = if add { out[o].add_(v) } else { v };
        }
    });
}

/// A copy of `base` with `src` written (or added) at the indexed positions along `dim`.
pub(crate) fn scatter(
    base: &Input<'_>,
    index: &Input<'_>,
    src: &Input<'_>,
    dim: usize,
    reduce: ScatterReduce,
) -> Result<HostBuffer> {
    let name = match reduce {
        ScatterReduce::Replace => "scatter",
        ScatterReduce::Add => "scatter_add",
    };
    let (bl, il, sl) = (at_least_1d(base.layout), at_least_1d(index.layout), at_least_1d(src.layout));
    let iv = index.slice::<i64>()?;
    check_indices(name, iv, &il, dim, bl.shape()[dim])?;
    let cs = contiguous_strides(bl.shape());
    let os = zero_dim(&cs, dim);
    let add = reduce == ScatterReduce::Add;
    with_dtype!(base.dtype(), T => {
        let mut out = materialize_vec::<T>(base)?;
        let sv = View { v: src.slice::<T>()?, strides: sl.strides(), offset: sl.offset() };
        let iview = View { v: iv, strides: il.strides(), offset: il.offset() };
        scatter_engine(&mut out, &os, cs[dim], sv, iview, il.shape(), add);
        Ok(buf(out))
    })
}

/// A copy of `base` with the slices of `src` along `dim` added at `index`.
pub(crate) fn index_add(base: &Input<'_>, index: &Input<'_>, src: &Input<'_>, dim: usize) -> Result<HostBuffer> {
    let (bl, sl) = (at_least_1d(base.layout), at_least_1d(src.layout));
    let il = index.layout;
    let iv = index.slice::<i64>()?;
    check_indices("index_add", iv, il, dim, bl.shape()[dim])?;
    let cs = contiguous_strides(bl.shape());
    let os = zero_dim(&cs, dim);
    let is = index_along(sl.ndim(), dim, il);
    with_dtype!(base.dtype(), T => {
        let mut out = materialize_vec::<T>(base)?;
        let sv = View { v: src.slice::<T>()?, strides: sl.strides(), offset: sl.offset() };
        let iview = View { v: iv, strides: &is, offset: il.offset() };
        scatter_engine(&mut out, &os, cs[dim], sv, iview, sl.shape(), true);
        Ok(buf(out))
    })
}

/// Coordinates of the non-zero elements in row-major order, flattened `[n, ndim]`, and `n`.
pub(crate) fn nonzero(x: &Input<'_>) -> Result<(Vec<i64>, usize)> {
    let flags: Vec<bool> = with_dtype!(x.dtype(), T => map1::<T, bool>(x, 1, |v| v.truthy())?);
    let shape = x.layout.shape();
    let nd = shape.len();
    let n = flags.iter().filter(|&&f| f).count();
    let mut out = Vec::with_capacity(n * nd);
    let mut coord: Shape = Shape::from_elem(0, nd);
    for &f in &flags {
        if f {
            out.extend(coord.iter().map(|&c| c as i64));
        }
        for d in (0..nd).rev() {
            coord[d] += 1;
            if coord[d] < shape[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    Ok((out, n))
}
