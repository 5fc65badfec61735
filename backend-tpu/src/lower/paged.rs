//! `Op::PagedAttention` in StableHLO (Note [Paged attention] in kiln-tensor):
//! a gather-based lowering with static shapes, so a decode step over a fixed
//! number of rows and blocks is one program whatever the block tables hold.
//!
//! Each query row finds its sequence from `query_start`, gathers the rows of
//! its block table and through them every position the table can address
//! (`max_blocks * block_size`), and attends to the first `visible` of them
//! (its position + 1) with the rest masked. The metadata checks compute one
//! bool that the backend turns into the CPU backend's error.
use super::index::all;
use super::ops::Check;
use super::{gather_attrs, Builder, Lit, Ty, Val};
use kiln_tensor::{DType, Meta};

/// `src[idx]` along dim 0: `[M, rest...]` for `idx [M]` (int64, in range).
fn take(b: &mut Builder, src: &Val, idx: &Val) -> Val {
    let m = idx.ty.numel();
    let r = src.ty.rank();
    let i2 = b.reshape(idx, &[m, 1]);
    let mut sizes = src.shape().to_vec();
    sizes[0] = 1;
    let offset_dims: Vec<usize> = (1..r).collect();
    let attrs = gather_attrs(&offset_dims, &[0], &[0], 1, &sizes);
    let mut shape = vec![m];
    shape.extend_from_slice(&src.shape()[1..]);
    b.op("stablehlo.gather", &[src, &i2], attrs, Ty::new(&shape, src.dtype()))
}

/// The output `[N, H, Dv]` and the metadata check.
pub fn paged_attention(b: &mut Builder, x: &[Val], scale: f64, out: &Meta) -> (Val, (Val, Check)) {
    let (q, kc, vc, tables, lens, starts) = (&x[0], &x[1], &x[2], &x[3], &x[4], &x[5]);
    let (n, h, d) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (blocks, bs, hk, dv) = (kc.shape()[0], kc.shape()[1], kc.shape()[2], vc.shape()[3]);
    let (s, mb) = (tables.shape()[0], tables.shape()[1]);
    let (g, p) = (h / hk, mb * bs);
    let ct = match q.dtype() {
        DType::BF16 | DType::F16 => DType::F32,
        t => t,
    };
    let begins = b.slice(starts, &[0], &[s], &[1]);
    let ends = b.slice(starts, &[1], &[s + 1], &[1]);
    let rows = b.sub(&ends, &begins);
    // Checks: starts run from 0 to N without decreasing, each context covers its
    // rows and fits its table, and the table entries it reaches are blocks.
    let first = b.slice(starts, &[0], &[1], &[1]);
    let last = b.slice(starts, &[s], &[s + 1], &[1]);
    let mut conds = vec![
        b.compare_lit("EQ", &first, Lit::I(0)),
        b.compare_lit("EQ", &last, Lit::I(n as i64)),
        b.compare_lit("GE", &rows, Lit::I(0)),
        b.compare("GE", lens, &rows),
        b.compare_lit("LE", lens, Lit::I(p as i64)),
    ];
    if s * mb > 0 {
        let j = b.iota(&[s, mb], 1, DType::I64);
        let jb = b.splat_like(Lit::I(bs as i64), &j);
        let start_pos = b.mul(&j, &jb);
        let lb = b.broadcast(lens, &[s, mb], &[0]);
        let used = b.compare("LT", &start_pos, &lb);
        let lo = b.compare_lit("GE", tables, Lit::I(0));
        let hi = b.compare_lit("LT", tables, Lit::I(blocks as i64));
        let inside = b.and(&lo, &hi);
        let unused = b.not(&used);
        conds.push(b.or(&inside, &unused));
    }
    let mut ok = b.constant(Lit::B(true), DType::Bool);
    for c in &conds {
        let a = all(b, c);
        ok = b.and(&ok, &a);
    }
    let check = (ok, Check::PagedMetadata);
    if n * h * dv == 0 || s == 0 || p == 0 || blocks == 0 {
        return (b.splat(Lit::F(0.0), out.dtype, &out.shape), check);
    }
    // The sequence of each row: how many sequences end at or before it (clamped
    // into range; the check covers rows past the last sequence).
    let r = b.iota(&[n, s], 0, DType::I64);
    let eb = b.broadcast(&ends, &[n, s], &[1]);
    let past = b.compare("GE", &r, &eb);
    let past = b.convert_raw(&past, DType::I64);
    let sid = b.reduce(&past, Lit::I(0), &[1], "add");
    let top = b.splat_like(Lit::I(s as i64 - 1), &sid);
    let sid = b.binary("minimum", &sid, &top);
    // visible = len - rows + (row - begin) + 1.
    let (begin_r, rows_r, len_r) = (take(b, &begins, &sid), take(b, &rows, &sid), take(b, lens, &sid));
    let ri = b.iota(&[n], 0, DType::I64);
    let i = b.sub(&ri, &begin_r);
    let vis = b.sub(&len_r, &rows_r);
    let vis = b.add(&vis, &i);
    let one = b.splat_like(Lit::I(1), &vis);
    let vis = b.add(&vis, &one);
    // Every slot each row's table addresses: block * bs + offset, [N * P].
    let tb = take(b, tables, &sid);
    let zero = b.splat_like(Lit::I(0), &tb);
    let maxb = b.splat_like(Lit::I(blocks as i64 - 1), &tb);
    let tb = b.binary("maximum", &tb, &zero);
    let tb = b.binary("minimum", &tb, &maxb);
    let tb = b.broadcast(&tb, &[n, mb, bs], &[0, 1]);
    let bsv = b.splat_like(Lit::I(bs as i64), &tb);
    let base = b.mul(&tb, &bsv);
    let off = b.iota(&[n, mb, bs], 2, DType::I64);
    let slots = b.add(&base, &off);
    let slots = b.reshape(&slots, &[n * p]);
    let kflat = b.reshape(kc, &[blocks * bs, hk, d]);
    let vflat = b.reshape(vc, &[blocks * bs, hk, dv]);
    // Each addressed row in the compute type, times its scale for float8
    // caches (Note [KV cache dtypes] in kiln-tensor).
    let mut rows_of = |flat: &Val, width: usize, scales: Option<&Val>| {
        let r = take(b, flat, &slots);
        let r = b.reshape(&r, &[n, p, hk, width]);
        let r = b.convert_raw(&r, ct);
        match scales {
            None => r,
            Some(sc) => {
                let sf = b.reshape(sc, &[blocks * bs, hk]);
                let sr = take(b, &sf, &slots);
                let sr = b.reshape(&sr, &[n, p, hk]);
                let sr = b.convert_raw(&sr, ct);
                let sr = b.broadcast(&sr, &[n, p, hk, width], &[0, 1, 2]);
                b.mul(&r, &sr)
            }
        }
    };
    let kr = rows_of(&kflat, d, x.get(6));
    let vr = rows_of(&vflat, dv, x.get(7));
    let qf = b.convert_raw(q, ct);
    let qg = b.reshape(&qf, &[n, hk, g, d]);
    // [N, Hk, G, D] x [N, P, Hk, D] -> [N, Hk, G, P]
    let sc = b.dot_general(&qg, &kr, &[0, 1], &[0, 2], &[3], &[3]);
    let sv = b.splat_like(Lit::F(scale), &sc);
    let sc = b.mul(&sc, &sv);
    let pos = b.iota(&[n, hk, g, p], 3, DType::I64);
    let visb = b.broadcast(&vis, &[n, hk, g, p], &[0]);
    let seen = b.compare("LT", &pos, &visb);
    let ninf = b.splat_like(Lit::F(f64::NEG_INFINITY), &sc);
    let sc = b.select(&seen, &sc, &ninf);
    let m = b.reduce(&sc, Lit::F(f64::NEG_INFINITY), &[3], "maximum");
    let mb4 = b.broadcast(&m, &[n, hk, g, p], &[0, 1, 2]);
    let z = b.sub(&sc, &mb4);
    let e = b.unary("exponential", &z);
    let sum = b.reduce(&e, Lit::F(0.0), &[3], "add");
    let sb = b.broadcast(&sum, &[n, hk, g, p], &[0, 1, 2]);
    let pr = b.div(&e, &sb);
    // [N, Hk, G, P] x [N, P, Hk, Dv] -> [N, Hk, G, Dv]
    let o = b.dot_general(&pr, &vr, &[0, 1], &[0, 2], &[3], &[1]);
    let o = b.reshape(&o, &[n, h, dv]);
    (b.convert_raw(&o, out.dtype), check)
}
