//! Lowerings of the reductions (NaN-propagating max and min, first-index
//! arg max) and sorting (stable, NaN largest).
use super::elementwise::*;
use super::ops::*;
use super::{arr, Attr, Builder, Lit, Ty, Val};
use kiln_tensor::{ArgReduceOp, DType, Meta, ReduceOp, Result};

pub(super) fn sum_keep(b: &mut Builder, x: &Val, dim: usize) -> Val {
    let s = b.reduce(x, Lit::F(0.0), &[dim], "add");
    let kept: Vec<usize> = (0..x.ty.rank()).filter(|&d| d != dim).collect();
    b.broadcast(&s, x.shape(), &kept)
}

pub(super) fn max_keep(b: &mut Builder, x: &Val, dim: usize) -> Val {
    let s = b.reduce(x, Lit::F(f64::NEG_INFINITY), &[dim], "nan_maximum");
    let kept: Vec<usize> = (0..x.ty.rank()).filter(|&d| d != dim).collect();
    b.broadcast(&s, x.shape(), &kept)
}

/// Stable `log(sum(exp(x)))` along `dim` (removed); an infinite max stands in as 0.
pub(super) fn logsumexp(b: &mut Builder, x: &Val, dim: usize) -> Val {
    let m = b.reduce(x, Lit::F(f64::NEG_INFINITY), &[dim], "nan_maximum");
    let a = b.unary("abs", &m);
    let inf = b.compare_lit("EQ", &a, Lit::F(f64::INFINITY));
    let z = b.splat_like(Lit::F(0.0), &m);
    let m = b.select(&inf, &z, &m);
    let kept: Vec<usize> = (0..x.ty.rank()).filter(|&d| d != dim).collect();
    let mb = b.broadcast(&m, x.shape(), &kept);
    let d = b.sub(x, &mb);
    let e = b.unary("exponential", &d);
    let s = b.reduce(&e, Lit::F(0.0), &[dim], "add");
    let l = b.unary("log", &s);
    b.add(&l, &m)
}

pub(super) fn reduce(b: &mut Builder, op: ReduceOp, x: &Val, dims: &[usize], out: DType) -> Result<Val> {
    let dt = x.dtype();
    Ok(match op {
        ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod => {
            let acc = if dt.is_float() { compute(dt) } else { DType::I64 };
            let v = b.cast(x, acc);
            let (init, body) = if op == ReduceOp::Prod { (Lit::I(1), "multiply") } else { (Lit::I(0), "add") };
            let mut s = b.reduce(&v, init, dims, body);
            if op == ReduceOp::Mean {
                let n: usize = dims.iter().map(|&d| x.shape()[d]).product();
                let c = b.splat(Lit::F(n as f64), acc, s.shape());
                s = b.div(&s, &c);
            }
            b.cast(&s, out)
        }
        ReduceOp::Max | ReduceOp::Min => {
            let max = op == ReduceOp::Max;
            let init = match (dt.is_float(), max) {
                (true, true) => Lit::F(f64::NEG_INFINITY),
                (true, false) => Lit::F(f64::INFINITY),
                (false, _) => extreme_int(dt, max),
            };
            let v = up(b, x);
            let r = b.reduce(&v, init, dims, if max { "nan_maximum" } else { "nan_minimum" });
            b.convert_raw(&r, out)
        }
        ReduceOp::Any | ReduceOp::All => {
            let t = truth(b, x);
            if op == ReduceOp::Any {
                b.reduce(&t, Lit::B(false), dims, "or")
            } else {
                b.reduce(&t, Lit::B(true), dims, "and")
            }
        }
    })
}

/// The smallest (`lowest`) or largest value of an integer dtype.
pub(super) fn extreme_int(d: DType, lowest: bool) -> Lit {
    let (lo, hi): (i64, i64) = match d {
        DType::U8 => (0, 255),
        DType::I8 => (i8::MIN as i64, i8::MAX as i64),
        DType::I16 => (i16::MIN as i64, i16::MAX as i64),
        DType::I32 => (i32::MIN as i64, i32::MAX as i64),
        DType::Bool => (0, 1),
        _ => (i64::MIN, i64::MAX),
    };
    if d == DType::Bool {
        return Lit::B(!lowest);
    }
    Lit::I(if lowest { lo } else { hi })
}

/// Index (int64) of the max/min along `dim`: ties give the first index, NaN counts as the extreme.
pub(super) fn arg_reduce(b: &mut Builder, op: ArgReduceOp, x: &Val, dim: usize) -> Val {
    let v = up(b, x);
    let dt = v.dtype();
    let max = op == ArgReduceOp::ArgMax;
    let idx = b.iota(v.shape(), dim, DType::I64);
    let init_v = if dt.is_float() {
        b.constant(Lit::F(if max { f64::NEG_INFINITY } else { f64::INFINITY }), dt)
    } else {
        b.constant(extreme_int(dt, max), dt)
    };
    let init_i = b.constant(Lit::I(i64::MAX), DType::I64);
    let (st, si) = (Ty::new(&[], dt), Ty::new(&[], DType::I64));
    let float = dt.is_float();
    let region = b.region(&[st.clone(), si.clone(), st, si], |b, a| {
        let (av, ai, bv, bi) = (&a[0], &a[1], &a[2], &a[3]);
        let better = b.compare(if max { "GT" } else { "LT" }, av, bv);
        let eq = b.compare("EQ", av, bv);
        let (better, eq) = if float {
            let (an, bn) = (b.is_nan(av), b.is_nan(bv));
            let nbn = b.not(&bn);
            let nan_wins = b.and(&an, &nbn);
            let both = b.and(&an, &bn);
            (b.or(&better, &nan_wins), b.or(&eq, &both))
        } else {
            (better, eq)
        };
        let first = b.compare("LT", ai, bi);
        let tie = b.and(&eq, &first);
        let pick = b.or(&better, &tie);
        vec![b.select(&pick, av, bv), b.select(&pick, ai, bi)]
    });
    let shape: Vec<usize> = (0..v.ty.rank()).filter(|&d| d != dim).map(|d| v.shape()[d]).collect();
    let outs = b.op_n(
        "stablehlo.reduce",
        &[&v, &idx, &init_v, &init_i],
        vec![region],
        vec![("dimensions", arr(&[dim]))],
        &[Ty::new(&shape, dt), Ty::new(&shape, DType::I64)],
    );
    outs[1].clone()
}

/// Stable sort along `dim` with NaN largest; returns values and int64 indices.
pub(super) fn sort(b: &mut Builder, x: &Val, dim: usize, descending: bool) -> (Val, Val) {
    if x.ty.rank() == 0 {
        return (x.clone(), b.splat(Lit::I(0), DType::I64, &[]));
    }
    let idx = b.iota(x.shape(), dim, DType::I64);
    let dt = x.dtype();
    let float = dt.is_float();
    let (st, si) = (Ty::new(&[], dt), Ty::new(&[], DType::I64));
    let region = b.region(&[st.clone(), st, si.clone(), si], |b, a| {
        let (p, q) = (&a[0], &a[1]);
        let (p, q) = if float { (up(b, p), up(b, q)) } else { (p.clone(), q.clone()) };
        // Ascending "p before q": p < q, with NaN after everything.
        let (first, second) = if descending { (&q, &p) } else { (&p, &q) };
        let lt = b.compare("LT", first, second);
        let r = if float {
            let (fnan, snan) = (b.is_nan(first), b.is_nan(second));
            let nf = b.not(&fnan);
            let nan_after = b.and(&nf, &snan);
            b.or(&lt, &nan_after)
        } else {
            lt
        };
        vec![r]
    });
    let attrs = vec![("dimension", Attr::Int(dim as i64, "i64")), ("is_stable", Attr::Bool(true))];
    let outs = b.op_n("stablehlo.sort", &[x, &idx], vec![region], attrs, &[x.ty.clone(), idx.ty.clone()]);
    (outs[0].clone(), outs[1].clone())
}

/// `Op::Softmax` (or log-softmax) along `dim`, computed in float32 for half precision.
pub(super) fn softmax(b: &mut Builder, x: &[Val], dim: &usize, log: &bool, outs: &[Meta]) -> Val {
    let xf = up(b, &x[0]);
    let m = max_keep(b, &xf, *dim);
    let z = b.sub(&xf, &m);
    let e = b.unary("exponential", &z);
    let s = sum_keep(b, &e, *dim);
    let y = if *log {
        let l = b.unary("log", &s);
        b.sub(&z, &l)
    } else {
        b.div(&e, &s)
    };
    b.convert_raw(&y, outs[0].dtype)
}

/// `Op::Cumsum` along `dim` as a `reduce_window`, accumulating in float32 or int64.
pub(super) fn cumsum(b: &mut Builder, x: &[Val], dim: &usize, outs: &[Meta]) -> Val {
    // Accumulate in float32 for bf16/f16 (each prefix rounded once), int64 for integers.
    let v = b.cast(&x[0], compute(outs[0].dtype));
    if v.ty.rank() == 0 || v.ty.numel() == 0 {
        return b.convert_raw(&v, outs[0].dtype);
    }
    let n = v.shape()[*dim];
    let r = v.ty.rank();
    let mut win = vec![1; r];
    win[*dim] = n.max(1);
    let mut pad = vec![vec![0i64, 0]; r];
    pad[*dim] = vec![n.saturating_sub(1) as i64, 0];
    let dt = v.dtype();
    let init = b.constant(Lit::I(0), dt);
    let st = Ty::new(&[], dt);
    let region = b.region(&[st.clone(), st], |b, a| vec![b.add(&a[0], &a[1])]);
    let attrs = vec![
        ("window_dimensions", arr(&win)),
        ("window_strides", arr(&vec![1; r])),
        ("padding", Attr::IntRows { rows: pad, width: 2 }),
    ];
    let ty = v.ty.clone();
    let c = b.op_region("stablehlo.reduce_window", &[&v, &init], region, attrs, ty);
    b.convert_raw(&c, outs[0].dtype)
}
