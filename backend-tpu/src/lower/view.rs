//! Views over immutable device buffers: every storage is a flat 1-D buffer,
//! and a view (any `Layout`: offset, strides, broadcast dims) is read or
//! written by a few StableHLO ops (see Note [Views of flat buffers]).
use super::{gather_attrs, scatter_attrs, Builder, Lit, Ty, Val};
use kiln_tensor::{DType, Error, Layout, Result};

// Note [Views of flat buffers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PJRT buffers are immutable, so kiln keeps each storage as one flat buffer and
// reads a view of it inside the program that consumes it. Most layouts are a
// strided window of the storage: drop the size-1 and broadcast (stride 0)
// dims, order the others by decreasing stride s_0 > ... > s_{m-1}; when each
// stride divides the previous one and each dim fits inside its outer stride
// (n_{j+1} s_{j+1} <= s_j), the elements are exactly
//     flat  reshaped to  [len / s_0, s_0/s_1, ..., s_{m-2}/s_{m-1}, s_{m-1}]
// sliced at the offset's coordinates on that grid to n_0, n_1, ..., n_{m-1}, 1
// elements, then transposed back to the view's dim order and broadcast over
// the dropped dims. Cutting on the storage's grid rather than from the flat
// offset keeps a window of a storage split by rows on its devices over a
// mesh. A window that leaves rows of the grid out, a storage that is not
// whole rows of it, or a window that wraps around a row (a diagonal) is cut
// from flat[offset .. offset + n_0 s_0] instead (padded where that runs past
// the end). That covers
// contiguous tensors, narrow/slice with steps, select, transpose/permute,
// expand and diagonal (whose window may run past the end of the storage: the
// buffer is padded first; the padding is never selected). Any other layout
// (overlapping as_strided views) becomes a gather of computed flat indices.
// Writes use dynamic_update_slice for a contiguous run and a scatter of the
// computed flat indices otherwise; writes never target broadcast dims (the
// tensor layer refuses writes through overlapping views).

/// The flat element index of every position of `layout`, as int64 `[*shape, 1]`.
fn flat_indices(b: &mut Builder, layout: &Layout) -> Val {
    let shape = layout.shape().to_vec();
    let mut idx = b.splat(Lit::I(layout.offset() as i64), DType::I64, &shape);
    for (d, (&n, &s)) in shape.iter().zip(layout.strides()).enumerate() {
        if n > 1 && s != 0 {
            let io = b.iota(&shape, d, DType::I64);
            let st = b.splat(Lit::I(s as i64), DType::I64, &shape);
            let term = b.mul(&io, &st);
            idx = b.add(&idx, &term);
        }
    }
    let mut with_vec = shape.clone();
    with_vec.push(1);
    b.reshape(&idx, &with_vec)
}

/// The strided-window decomposition of a layout (see the Note): the kept dims
/// in decreasing stride order, or `None` when the layout is not a window.
fn window(layout: &Layout) -> Option<Vec<usize>> {
    let (shape, strides) = (layout.shape(), layout.strides());
    let mut kept: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] > 1 && strides[d] != 0).collect();
    kept.sort_by(|&a, &b| strides[b].cmp(&strides[a]));
    for w in kept.windows(2) {
        let (outer, inner) = (w[0], w[1]);
        let (so, si) = (strides[outer], strides[inner]);
        if so == si || so % si != 0 || shape[inner] * si > so {
            return None;
        }
    }
    Some(kept)
}

/// Reads the view `layout` of the flat buffer `flat` as a value of `layout`'s shape.
pub fn read_view(b: &mut Builder, flat: &Val, layout: &Layout) -> Result<Val> {
    let len = flat.ty.numel();
    let shape = layout.shape().to_vec();
    let numel = layout.numel();
    if numel == 0 {
        return Ok(b.splat(Lit::I(0), flat.dtype(), &shape));
    }
    if layout.storage_extent().is_none_or(|e| e > len) {
        return Err(Error::backend(
            "pjrt",
            format!(
                "a view {:?} / {:?} + {} runs past its storage of {len} elements",
                shape,
                layout.strides(),
                layout.offset()
            ),
        ));
    }
    if layout.is_contiguous() && layout.offset() == 0 && numel == len {
        return Ok(b.reshape(flat, &shape));
    }
    let Some(kept) = window(layout) else {
        let idx = flat_indices(b, layout);
        return Ok(gather_flat(b, flat, &idx, &shape));
    };
    let strides = layout.strides();
    let off = layout.offset();
    let m = kept.len();
    // The window's reshape dims and extent.
    let (dims, extent) = if m == 0 {
        (vec![1], 1)
    } else {
        let mut dims = vec![shape[kept[0]]];
        for j in 1..m {
            dims.push(strides[kept[j - 1]] / strides[kept[j]]);
        }
        dims.push(strides[kept[m - 1]]);
        (dims, shape[kept[0]] * strides[kept[0]])
    };
    let v = if m == 0 {
        let run = b.slice(flat, &[off], &[off + 1], &[1]);
        b.reshape(&run, &[])
    } else {
        let mut limit: Vec<usize> = kept.iter().map(|&d| shape[d]).collect();
        limit.push(1);
        let sl = match grid_window(b, flat, &dims, &limit, off) {
            Some(sl) => sl,
            None => {
                let mut src = flat.clone();
                if off + extent > len {
                    src = b.pad(&src, Lit::I(0), &[0], &[off + extent - len]);
                }
                let run = b.slice(&src, &[off], &[off + extent], &[1]);
                let r = b.reshape(&run, &dims);
                b.slice(&r, &vec![0; m + 1], &limit, &vec![1; m + 1])
            }
        };
        let sorted_shape: Vec<usize> = kept.iter().map(|&d| shape[d]).collect();
        let v = b.reshape(&sl, &sorted_shape);
        // Back to the view's dim order: output j is the kept dim that comes j-th in the view.
        let mut in_order = kept.clone();
        in_order.sort();
        let perm: Vec<usize> = in_order.iter().map(|d| kept.iter().position(|k| k == d).expect("kept")).collect();
        b.transpose(&v, &perm)
    };
    let mut in_order = kept;
    in_order.sort();
    Ok(b.broadcast(&v, &shape, &in_order))
}

/// The window `dims` / `limit` at `off` cut from the storage's own grid (see
/// the Note): `flat` reshaped to `[rows, dims[1..]]` and sliced at the
/// offset's coordinates, so that the window of a storage split by rows over
/// devices is cut on each device (`x[:, 1:]` reads no neighbour's elements).
/// `None` when the storage is not whole rows of the grid, the window leaves
/// rows out, or it wraps around a row (a diagonal): the caller slices the
/// flat run.
fn grid_window(b: &mut Builder, flat: &Val, dims: &[usize], limit: &[usize], off: usize) -> Option<Val> {
    let len = flat.ty.numel();
    let outer: usize = dims[1..].iter().product();
    let mut rem = off % outer;
    let mut starts = vec![off / outer];
    for j in 1..dims.len() {
        let inner: usize = dims[j + 1..].iter().product();
        starts.push(rem / inner);
        rem %= inner;
    }
    let rows = len / outer;
    // Every row, whole: a split of the rows stays as it is (XLA's partitioner
    // aborts on some scatters of a slice of split rows, which the flat run avoids).
    let inner_only = starts[0] == 0 && limit[0] == rows;
    if !len.is_multiple_of(outer) || !inner_only || (1..dims.len()).any(|j| starts[j] + limit[j] > dims[j]) {
        return None;
    }
    let mut grid = vec![rows];
    grid.extend_from_slice(&dims[1..]);
    let r = b.reshape(flat, &grid);
    let ends: Vec<usize> = starts.iter().zip(limit).map(|(s, l)| s + l).collect();
    Some(b.slice(&r, &starts, &ends, &vec![1; dims.len()]))
}

/// `flat[idx]` for int64 indices `[*shape, 1]` into a 1-D buffer.
fn gather_flat(b: &mut Builder, flat: &Val, idx: &Val, shape: &[usize]) -> Val {
    let rank = shape.len();
    let attrs = gather_attrs(&[], &[0], &[0], rank, &[1]);
    b.op("stablehlo.gather", &[flat, idx], attrs, Ty::new(shape, flat.dtype()))
}

/// Writes `src` (the view's shape) at the positions `layout` views of the flat
/// buffer `base`; returns the new flat buffer.
pub fn write_view(b: &mut Builder, base: &Val, layout: &Layout, src: &Val) -> Result<Val> {
    let len = base.ty.numel();
    let numel = layout.numel();
    if src.shape() != layout.shape() || src.dtype() != base.dtype() {
        return Err(Error::backend(
            "pjrt",
            format!(
                "write_view: value {:?} {} for a view {:?} of {}",
                src.shape(),
                src.dtype(),
                layout.shape(),
                base.dtype()
            ),
        ));
    }
    if numel == 0 {
        return Ok(base.clone());
    }
    if layout.storage_extent().is_none_or(|e| e > len) {
        return Err(Error::backend("pjrt", format!("a written view runs past its storage of {len} elements")));
    }
    if layout.is_contiguous() {
        let flat_src = b.reshape(src, &[numel]);
        if layout.offset() == 0 && numel == len {
            return Ok(flat_src);
        }
        let start = b.constant(Lit::I(layout.offset() as i64), DType::I64);
        return Ok(b.op("stablehlo.dynamic_update_slice", &[base, &flat_src, &start], vec![], base.ty.clone()));
    }
    let idx = flat_indices(b, layout);
    let rank = layout.ndim();
    let st = Ty::new(&[], base.dtype());
    let region = b.region(&[st.clone(), st], |_, a| vec![a[1].clone()]);
    let attrs = scatter_attrs(&[], &[0], &[0], rank);
    Ok(b.op_region("stablehlo.scatter", &[base, &idx, src], region, attrs, base.ty.clone()))
}
