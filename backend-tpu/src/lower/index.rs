//! Lowerings of the indexing primitives, with the device-side checks of
//! their indices (Note [Checks on the device]).
use super::ops::*;
use super::{gather_attrs, scatter_attrs, Builder, Lit, Ty, Val};
use kiln_tensor::{DType, Meta, ScatterReduce};

/// The check that every index (input 1) lies in `[0, size)` of `src`'s `dim`.
pub(super) fn index_check(b: &mut Builder, idx: &Val, src: &Val, dim: usize) -> (Val, Check) {
    let size = src.shape().get(dim).copied().unwrap_or(1);
    let ok = if idx.ty.numel() == 0 {
        b.constant(Lit::B(true), DType::Bool)
    } else {
        let lo = b.compare_lit("GE", idx, Lit::I(0));
        let hi = b.compare_lit("LT", idx, Lit::I(size as i64));
        let ok = b.and(&lo, &hi);
        let all: Vec<usize> = (0..idx.ty.rank()).collect();
        b.reduce(&ok, Lit::B(true), &all, "and")
    };
    (ok, Check::Index { input: 1, dim, size })
}

/// True when `compare(x, v, dir)` holds for every element.
pub(super) fn all_true(b: &mut Builder, x: &Val, dir: &str, v: i64) -> Val {
    let c = b.compare_lit(dir, x, Lit::I(v));
    all(b, &c)
}

/// True when every element of the bool `x` is (true when it has none).
pub(super) fn all(b: &mut Builder, x: &Val) -> Val {
    if x.ty.numel() == 0 {
        return b.constant(Lit::B(true), DType::Bool);
    }
    let dims: Vec<usize> = (0..x.ty.rank()).collect();
    b.reduce(x, Lit::B(true), &dims, "and")
}

/// Full coordinates `[*idx.shape, rank]` for gather/scatter along `dim`: the
/// index along `dim`, the position itself along the other dims.
pub(super) fn coordinates(b: &mut Builder, idx: &Val, dim: usize) -> Val {
    let shape = idx.shape().to_vec();
    let r = shape.len();
    let mut with1 = shape.clone();
    with1.push(1);
    let parts: Vec<Val> = (0..r)
        .map(|d| {
            let v = if d == dim { idx.clone() } else { b.iota(&shape, d, DType::I64) };
            b.reshape(&v, &with1)
        })
        .collect();
    let refs: Vec<&Val> = parts.iter().collect();
    b.concat(&refs, r)
}

/// Gather from a 0-d source or with no indices: the source value broadcast (or an empty result).
pub(super) fn gather0(b: &mut Builder, src: &Val, idx: &Val) -> Val {
    if idx.ty.numel() == 0 {
        return b.splat(Lit::I(0), src.dtype(), idx.shape());
    }
    let n = src.ty.numel();
    let flat = b.reshape(src, &[n]);
    let s = b.slice(&flat, &[0], &[1], &[1]);
    let s = b.reshape(&s, &[]);
    b.broadcast(&s, idx.shape(), &[])
}

#[allow(clippy::too_many_arguments)]
pub(super) fn scatter(
    b: &mut Builder,
    base: &Val,
    idx: &Val,
    upd: &Val,
    window: &[usize],
    inserted: &[usize],
    to_operand: &[usize],
    index_vector_dim: usize,
    add: bool,
) -> Val {
    let dt = base.dtype();
    let st = Ty::new(&[], dt);
    let region = b.region(&[st.clone(), st], |b, a| {
        if add {
            if dt == DType::Bool {
                vec![b.or(&a[0], &a[1])]
            } else {
                vec![b.add(&a[0], &a[1])]
            }
        } else {
            vec![a[1].clone()]
        }
    });
    let attrs = scatter_attrs(window, inserted, to_operand, index_vector_dim);
    b.op_region("stablehlo.scatter", &[base, idx, upd], region, attrs, base.ty.clone())
}

/// `Op::Gather` along `dim`, with its index check.
pub(super) fn gather(b: &mut Builder, x: &[Val], dim: &usize, out: Ty) -> Lowered {
    let (src, idx) = (&x[0], &x[1]);
    let ok = index_check(b, idx, src, *dim);
    let r = src.ty.rank();
    let all: Vec<usize> = (0..r).collect();
    let attrs = gather_attrs(&[], &all, &all, r, &vec![1; r]);
    let g = if idx.ty.numel() == 0 || r == 0 {
        gather0(b, src, idx)
    } else if let Some(attrs) = batched_gather_attrs(b, src, idx, *dim) {
        let mut with1 = idx.shape().to_vec();
        with1.push(1);
        let i = b.reshape(idx, &with1);
        b.op("stablehlo.gather", &[src, &i], attrs, out)
    } else {
        let coords = coordinates(b, idx, *dim);
        b.op("stablehlo.gather", &[src, &coords], attrs, out)
    };
    (vec![g], vec![ok])
}

/// Over a mesh, a gather whose index has the source's length off `dim`
/// names those dimensions as batching dimensions, pairing each index
/// element with the source row it reads: the partitioner then keeps a
/// split batch on its devices. Coordinates made of iotas (`coordinates`)
/// hide that pairing and are gathered whole. Programs on one device keep
/// the iota form, which portable artifacts (VHLO 1.0.0) can carry.
fn batched_gather_attrs(b: &Builder, src: &Val, idx: &Val, dim: usize) -> Option<super::Attrs> {
    let r = src.ty.rank();
    let same = (0..r).all(|d| d == dim || src.shape()[d] == idx.shape()[d]);
    if !b.is_sharded() || !same || r < 2 {
        return None;
    }
    let batch: Vec<i64> = (0..r).filter(|&d| d != dim).map(|d| d as i64).collect();
    let dims = super::Attr::Gather {
        offset_dims: vec![],
        collapsed_slice_dims: vec![dim as i64],
        operand_batching_dims: batch.clone(),
        start_indices_batching_dims: batch,
        start_index_map: vec![dim as i64],
        index_vector_dim: r as i64,
    };
    Some(vec![
        ("dimension_numbers", dims),
        ("indices_are_sorted", super::Attr::Bool(false)),
        ("slice_sizes", super::arr(&vec![1; r])),
    ])
}

/// `Op::Scatter` along `dim` (replacing or adding), with its index check.
pub(super) fn scatter_op(b: &mut Builder, x: &[Val], dim: &usize, reduce: &ScatterReduce) -> Lowered {
    let (base, idx, src) = (&x[0], &x[1], &x[2]);
    let ok = index_check(b, idx, base, *dim);
    if idx.ty.numel() == 0 || base.ty.rank() == 0 {
        return (vec![base.clone()], vec![ok]);
    }
    let upd = b.slice(src, &vec![0; src.ty.rank()], idx.shape(), &vec![1; src.ty.rank()]);
    let coords = coordinates(b, idx, *dim);
    let r = base.ty.rank();
    let all: Vec<usize> = (0..r).collect();
    let add = *reduce == ScatterReduce::Add;
    let v = scatter(b, base, &coords, &upd, &[], &all, &all, r, add);
    (vec![v], vec![ok])
}

/// `Op::IndexSelect` along `dim`, with its index check.
pub(super) fn index_select(b: &mut Builder, x: &[Val], dim: &usize, outs: &[Meta]) -> Lowered {
    let (src, idx) = (&x[0], &x[1]);
    let ok = index_check(b, idx, src, *dim);
    if idx.ty.numel() == 0 || outs[0].shape.iter().product::<usize>() == 0 {
        return (vec![b.splat(Lit::I(0), outs[0].dtype, &outs[0].shape)], vec![ok]);
    }
    let r = src.ty.rank();
    if r == 0 {
        // A 0-d source: every index must be 0; the result repeats the value.
        return (vec![b.broadcast(src, &outs[0].shape, &[])], vec![ok]);
    }
    let i2 = b.reshape(idx, &[idx.ty.numel(), 1]);
    let offset: Vec<usize> = (0..r).filter(|&d| d != *dim).collect();
    let mut sizes = src.shape().to_vec();
    sizes[*dim] = 1;
    // Gather puts the index dim first among batch dims: output [n, rest...]; then move it to `dim`.
    let offset_dims: Vec<usize> = (1..r).collect();
    let attrs = gather_attrs(&offset_dims, &[*dim], &[*dim], 1, &sizes);
    let mut gshape = vec![idx.ty.numel()];
    gshape.extend(offset.iter().map(|&d| src.shape()[d]));
    let g = b.op("stablehlo.gather", &[src, &i2], attrs, Ty::new(&gshape, src.dtype()));
    // g: [n, dims except `dim`] -> put n at `dim`.
    let mut perm: Vec<usize> = (1..r).collect();
    perm.insert(*dim, 0);
    let v = b.transpose(&g, &perm);
    let v = b.reshape(&v, &outs[0].shape);
    (vec![v], vec![ok])
}

/// `Op::IndexAdd` along `dim`, with its index check.
pub(super) fn index_add(b: &mut Builder, x: &[Val], dim: &usize) -> Lowered {
    let (base, idx, src) = (&x[0], &x[1], &x[2]);
    let ok = index_check(b, idx, base, *dim);
    if idx.ty.numel() == 0 || base.ty.numel() == 0 {
        return (vec![base.clone()], vec![ok]);
    }
    let r = base.ty.rank();
    let n = idx.ty.numel();
    let i2 = b.reshape(idx, &[n, 1]);
    // Updates with the index dim first: [n, rest...].
    let mut perm = vec![*dim];
    perm.extend((0..r).filter(|&d| d != *dim));
    let upd = b.transpose(src, &perm);
    let window: Vec<usize> = (1..r).collect();
    let v = scatter(b, base, &i2, &upd, &window, &[*dim], &[*dim], 1, true);
    (vec![v], vec![ok])
}
