//! `Op::GroupedMatMul` in StableHLO (Note [Grouped products] in kiln-tensor):
//! static shapes, with the group sizes read inside the program, so a step
//! whose grouping changes (a router's choices) stays one compiled program.
//!
//! The ragged rows are cut into tiles of `TILE` rows, and one
//! `stablehlo.while` walks the (tile, group) pairs that overlap, in order:
//! each visit multiplies the tile by the group's matrix with the rows of
//! other groups masked out, and adds the result into place. A pair is
//! visited only when it overlaps (or a group is empty), so the loop runs at
//! most `tiles + groups` times and does about `M K N + G TILE K N` multiply-
//! adds: the product of the rows, not a dense product per group (Megablocks'
//! way of running a grouped product as tiles).
use super::index::all;
use super::ops::Check;
use super::{arr, Builder, Lit, Ty, Val};
use kiln_tensor::grouped::grouped_dim;
use kiln_tensor::{DType, Meta, Op, Result};

/// Rows per tile.
const TILE: usize = 32;

/// `x[start.., ..]` of static `sizes`, at dynamic scalar `starts` (int64).
fn dyn_slice(b: &mut Builder, x: &Val, starts: &[&Val], sizes: &[usize]) -> Val {
    let mut operands = vec![x];
    operands.extend_from_slice(starts);
    b.op("stablehlo.dynamic_slice", &operands, vec![("slice_sizes", arr(sizes))], Ty::new(sizes, x.dtype()))
}

/// `x` with `upd` written at dynamic scalar `starts`.
fn dyn_update(b: &mut Builder, x: &Val, upd: &Val, starts: &[&Val]) -> Val {
    let mut operands = vec![x, upd];
    operands.extend_from_slice(starts);
    b.op("stablehlo.dynamic_update_slice", &operands, vec![], x.ty.clone())
}

/// `x[i]` of a 1-D int64 `x` at a dynamic scalar `i`, as a scalar.
fn at(b: &mut Builder, x: &Val, i: &Val) -> Val {
    let s = dyn_slice(b, x, &[i], &[1]);
    b.reshape(&s, &[])
}

/// The output and the check that the sizes are non-negative and sum to at
/// most the ragged dimension's length.
pub fn grouped_mm(b: &mut Builder, x: &[Val], out: &Meta) -> Result<(Val, (Val, Check))> {
    let (a, w, sizes) = (&x[0], &x[1], &x[2]);
    let rows_mode = w.ty.rank() == 3;
    let m = grouped_dim(a.shape(), w.shape());
    let g = sizes.shape()[0];
    let ct = match out.dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    };
    // Group ends (inclusive prefix sum), and the check.
    let cum = Meta { shape: [g].as_slice().into(), dtype: DType::I64 };
    let (mut ends, _) = super::ops::lower_op(b, &Op::Cumsum { dim: 0 }, std::slice::from_ref(sizes), &[cum])?;
    let ends = ends.remove(0);
    // Every size in [0, M] and every end at most M: ends grow by at most M
    // a step, so no prefix sum can wrap around past the check.
    let lo = b.compare_lit("GE", sizes, Lit::I(0));
    let hi = b.compare_lit("LE", sizes, Lit::I(m as i64));
    let in_range = b.and(&lo, &hi);
    let in_range = all(b, &in_range);
    let ends_ok = b.compare_lit("LE", &ends, Lit::I(m as i64));
    let ends_ok = all(b, &ends_ok);
    let ok = b.and(&in_range, &ends_ok);
    let check = (ok, Check::GroupSizes);
    if m == 0 || g == 0 || out.shape.iter().product::<usize>() == 0 {
        return Ok((b.splat(Lit::I(0), out.dtype, &out.shape), check));
    }
    let t = TILE.min(m);
    let tiles = m.div_ceil(t);
    let mp = tiles * t;
    let (a, w) = (b.convert_raw(a, ct), b.convert_raw(w, ct));
    // Operands padded to whole tiles along the ragged dimension.
    let (a, w) = if rows_mode {
        (b.pad(&a, Lit::I(0), &[0, 0], &[mp - m, 0]), w)
    } else {
        (b.pad(&a, Lit::I(0), &[0, 0], &[0, mp - m]), b.pad(&w, Lit::I(0), &[0, 0], &[mp - m, 0]))
    };
    let acc_shape: Vec<usize> = if rows_mode { vec![mp, w.shape()[2]] } else { out.shape.to_vec() };
    let acc = b.splat(Lit::I(0), ct, &acc_shape);
    let zero = b.constant(Lit::I(0), DType::I64);
    // Loop state: tile, group, accumulator, then the operands and group ends carried through.
    let state = [zero.clone(), zero, acc, a, w, ends, sizes.clone()];
    let tys: Vec<Ty> = state.iter().map(|v| v.ty.clone()).collect();
    let cond = b.region(&tys, |b, s| {
        let more_tiles = b.compare_lit("LT", &s[0], Lit::I(tiles as i64));
        let more_groups = b.compare_lit("LT", &s[1], Lit::I(g as i64));
        vec![b.and(&more_tiles, &more_groups)]
    });
    let body = b.region(&tys, |b, s| {
        let (tile, grp, acc, a, w, ends, sizes) = (&s[0], &s[1], &s[2], &s[3], &s[4], &s[5], &s[6]);
        let tt = b.constant(Lit::I(t as i64), DType::I64);
        let row0 = b.mul(tile, &tt);
        let row1 = b.add(&row0, &tt);
        let end = at(b, ends, grp);
        let len = at(b, sizes, grp);
        let start = b.sub(&end, &len);
        // Rows of the tile that belong to the group.
        let iota = b.iota(&[t], 0, DType::I64);
        let r0 = b.broadcast(&row0, &[t], &[]);
        let rows = b.add(&iota, &r0);
        let (sb, eb) = (b.broadcast(&start, &[t], &[]), b.broadcast(&end, &[t], &[]));
        let ge = b.compare("GE", &rows, &sb);
        let lt = b.compare("LT", &rows, &eb);
        let mine = b.and(&ge, &lt);
        let z = b.constant(Lit::I(0), DType::I64);
        let acc = if rows_mode {
            let (k, n) = (w.shape()[1], w.shape()[2]);
            let xt = dyn_slice(b, a, &[&row0, &z], &[t, k]);
            let wg = dyn_slice(b, w, &[grp, &z, &z], &[1, k, n]);
            let wg = b.reshape(&wg, &[k, n]);
            let p = b.dot_general(&xt, &wg, &[], &[], &[1], &[0]);
            let mask = b.broadcast(&mine, &[t, n], &[0]);
            let zeros = b.splat_like(Lit::I(0), &p);
            let p = b.select(&mask, &p, &zeros);
            let cur = dyn_slice(b, acc, &[&row0, &z], &[t, n]);
            let sum = b.add(&cur, &p);
            dyn_update(b, acc, &sum, &[&row0, &z])
        } else {
            let (k, n) = (a.shape()[0], w.shape()[1]);
            let at_ = dyn_slice(b, a, &[&z, &row0], &[k, t]);
            let bt = dyn_slice(b, w, &[&row0, &z], &[t, n]);
            // Both operands masked: a row of another group never reaches this one (not even as 0 * inf).
            let ma = b.broadcast(&mine, &[k, t], &[1]);
            let za = b.splat_like(Lit::I(0), &at_);
            let at_ = b.select(&ma, &at_, &za);
            let mb = b.broadcast(&mine, &[t, n], &[0]);
            let zb = b.splat_like(Lit::I(0), &bt);
            let bt = b.select(&mb, &bt, &zb);
            let p = b.dot_general(&at_, &bt, &[], &[], &[1], &[0]);
            let p = b.reshape(&p, &[1, k, n]);
            let cur = dyn_slice(b, acc, &[grp, &z, &z], &[1, k, n]);
            let sum = b.add(&cur, &p);
            dyn_update(b, acc, &sum, &[grp, &z, &z])
        };
        // Next pair: the next tile when the group reaches past this one, the
        // next group when it ends inside it (both when it ends exactly at its end).
        let one = b.constant(Lit::I(1), DType::I64);
        let tile_done = b.compare("LE", &row1, &end);
        let group_done = b.compare("LE", &end, &row1);
        let t1 = b.add(tile, &one);
        let g1 = b.add(grp, &one);
        let tile = b.select(&tile_done, &t1, tile);
        let grp = b.select(&group_done, &g1, grp);
        vec![tile, grp, acc, a.clone(), w.clone(), ends.clone(), sizes.clone()]
    });
    let refs: Vec<&Val> = state.iter().collect();
    let res = b.op_n("stablehlo.while", &refs, vec![cond, body], vec![], &tys);
    let acc = if rows_mode { b.slice_dim(&res[2], 0, 0, m) } else { res[2].clone() };
    Ok((b.convert_raw(&acc, out.dtype), check))
}
