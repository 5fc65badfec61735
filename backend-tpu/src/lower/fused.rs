//! Lowerings of the fused model primitives: rotary embeddings, attention
//! and its gradients, the cross-entropy gradient, RMSNorm.
use super::ops::*;
use super::reduce::*;
use super::{Builder, Lit, Val};
use kiln_tensor::{DType, Meta};

/// `x * cos + rotate_half(x) * sin`, each product and the sum rounded in the element type.
pub(super) fn rotary(b: &mut Builder, x: &Val, cos: &Val, sin: &Val) -> Val {
    let r = x.ty.rank();
    let d = x.shape()[r - 1];
    let h = d / 2;
    let x1 = b.slice_dim(x, r - 1, 0, h);
    let x2 = b.slice_dim(x, r - 1, h, d);
    let nx2 = {
        let f = up(b, &x2);
        let n = b.unary("negate", &f);
        b.convert_raw(&n, x.dtype())
    };
    let rot = b.concat(&[&nx2, &x1], r - 1);
    let dims = [r - 2, r - 1];
    let cb = b.broadcast(cos, x.shape(), &dims);
    let sb = b.broadcast(sin, x.shape(), &dims);
    let rounded_mul = |b: &mut Builder, p: &Val, q: &Val| {
        let (pf, qf) = (up(b, p), up(b, q));
        let m = b.mul(&pf, &qf);
        b.convert_raw(&m, p.dtype())
    };
    let a = rounded_mul(b, x, &cb);
    let c = rounded_mul(b, &rot, &sb);
    // Materialise both products so the compiler cannot contract `a + c` into
    // fused multiply-adds: the result must round like the unfused ops.
    let barrier = b.op_n("stablehlo.optimization_barrier", &[&a, &c], vec![], vec![], &[a.ty.clone(), c.ty.clone()]);
    let (af, cf) = (up(b, &barrier[0]), up(b, &barrier[1]));
    let s = b.add(&af, &cf);
    b.convert_raw(&s, x.dtype())
}

/// Query heads grouped by their key/value head: `[B, H, T, D] -> [B, Hk, G, T, D]`.
pub(super) fn group(b: &mut Builder, q: &Val, hk: usize) -> Val {
    let s = q.shape();
    b.reshape(q, &[s[0], hk, s[1] / hk, s[2], s[3]])
}

/// Scaled, masked scores `[B, Hk, G, T, S]` (in the compute type).
pub(super) fn scores(b: &mut Builder, qg: &Val, k: &Val, scale: f64, causal: bool) -> Val {
    let s = b.dot_general(qg, k, &[0, 1], &[0, 1], &[4], &[3]);
    let sc = b.splat_like(Lit::F(scale), &s);
    let s = b.mul(&s, &sc);
    if !causal {
        return s;
    }
    let sh = s.shape().to_vec();
    let (t, kv) = (sh[3], sh[4]);
    let i = b.iota(&sh, 3, DType::I64);
    let j = b.iota(&sh, 4, DType::I64);
    let off = b.splat(Lit::I(kv as i64 - t as i64), DType::I64, &sh);
    let lim = b.add(&i, &off);
    let keep = b.compare("LE", &j, &lim);
    let ninf = b.splat_like(Lit::F(f64::NEG_INFINITY), &s);
    b.select(&keep, &s, &ninf)
}

pub(super) fn attention(
    b: &mut Builder,
    q: &Val,
    k: &Val,
    v: &Val,
    scale: f64,
    causal: bool,
    outs: &[Meta],
) -> (Val, Val) {
    let ct = outs[1].dtype;
    let (q, k, v) = (b.convert_raw(q, ct), b.convert_raw(k, ct), b.convert_raw(v, ct));
    let hk = k.shape()[1];
    let qg = group(b, &q, hk);
    let s = scores(b, &qg, &k, scale, causal);
    let lse = logsumexp(b, &s, 4);
    let lb = b.broadcast(&lse, s.shape(), &[0, 1, 2, 3]);
    let d = b.sub(&s, &lb);
    let p = b.unary("exponential", &d);
    // [B, Hk, G, T, S] x [B, Hk, S, Dv] -> [B, Hk, G, T, Dv]
    let o = b.dot_general(&p, &v, &[0, 1], &[0, 1], &[4], &[2]);
    let o = b.reshape(&o, &outs[0].shape);
    let lse = b.reshape(&lse, &outs[1].shape);
    (b.convert_raw(&o, outs[0].dtype), lse)
}

pub(super) fn attention_backward(b: &mut Builder, x: &[Val], scale: f64, causal: bool, outs: &[Meta]) -> Vec<Val> {
    let ct = compute(x[0].dtype());
    let c: Vec<Val> = x.iter().map(|v| b.convert_raw(v, ct)).collect();
    let (q, k, v, o, lse, g) = (&c[0], &c[1], &c[2], &c[3], &c[4], &c[5]);
    let hk = k.shape()[1];
    let qg = group(b, q, hk);
    let gg = group(b, g, hk);
    let og = group(b, o, hk);
    let s = scores(b, &qg, k, scale, causal);
    let ls = lse.shape().to_vec();
    let lg = b.reshape(lse, &[ls[0], hk, ls[1] / hk, ls[2]]);
    let lb = b.broadcast(&lg, s.shape(), &[0, 1, 2, 3]);
    let d = b.sub(&s, &lb);
    let p = b.unary("exponential", &d);
    // dv [B, Hk, S, Dv] = sum over G, T of p * g
    let dv = b.dot_general(&p, &gg, &[0, 1], &[0, 1], &[2, 3], &[2, 3]);
    // dp [B, Hk, G, T, S] = g v^T
    let dp = b.dot_general(&gg, v, &[0, 1], &[0, 1], &[4], &[3]);
    // delta [B, Hk, G, T] = rowsum(g * out)
    let go = b.mul(&gg, &og);
    let delta = b.reduce(&go, Lit::F(0.0), &[4], "add");
    let db = b.broadcast(&delta, s.shape(), &[0, 1, 2, 3]);
    let t = b.sub(&dp, &db);
    let ds = b.mul(&p, &t);
    let sc = b.splat_like(Lit::F(scale), &ds);
    let ds = b.mul(&ds, &sc);
    // dq [B, Hk, G, T, D] = ds k
    let dq = b.dot_general(&ds, k, &[0, 1], &[0, 1], &[4], &[2]);
    // dk [B, Hk, S, D] = sum over G, T of ds * q
    let dk = b.dot_general(&ds, &qg, &[0, 1], &[0, 1], &[2, 3], &[2, 3]);
    let dq = b.reshape(&dq, &outs[0].shape);
    vec![b.convert_raw(&dq, outs[0].dtype), b.convert_raw(&dk, outs[1].dtype), b.convert_raw(&dv, outs[2].dtype)]
}

/// `(softmax(x) - (1 - eps) onehot(t) - eps / C) * w` along dim 1.
pub(super) fn cross_entropy_backward(b: &mut Builder, x: &[Val], eps: f64, outs: &[Meta]) -> Val {
    let (xv, t, w) = (&x[0], &x[1], &x[2]);
    let ct = compute(xv.dtype());
    let xf = b.convert_raw(xv, ct);
    let r = xf.ty.rank();
    let cdim = xf.shape()[1];
    let m = max_keep(b, &xf, 1);
    let z = b.sub(&xf, &m);
    let e = b.unary("exponential", &z);
    let s = sum_keep(b, &e, 1);
    let p = b.div(&e, &s);
    let other: Vec<usize> = (0..r).filter(|&d| d != 1).collect();
    let tb = b.broadcast(t, xf.shape(), &other);
    let cls = b.iota(xf.shape(), 1, DType::I64);
    let hot = b.compare("EQ", &cls, &tb);
    let hot = b.convert_raw(&hot, ct);
    let a = b.splat_like(Lit::F(1.0 - eps), &p);
    let ha = b.mul(&hot, &a);
    let d = b.sub(&p, &ha);
    let d = if eps != 0.0 {
        let u = b.splat_like(Lit::F(eps / cdim as f64), &p);
        b.sub(&d, &u)
    } else {
        d
    };
    let wf = b.convert_raw(w, ct);
    let wb = b.broadcast(&wf, xf.shape(), &other);
    let y = b.mul(&d, &wb);
    b.convert_raw(&y, outs[0].dtype)
}

/// `Op::RmsNorm`: `y` and `rstd`.
pub(super) fn rms_norm(b: &mut Builder, x: &[Val], eps: &f64, outs: &[Meta]) -> Vec<Val> {
    let (xf, wf) = (up(b, &x[0]), up(b, &x[1]));
    let r = xf.ty.rank();
    let d = xf.shape()[r - 1];
    let acc = outs[1].dtype;
    let xa = b.convert_raw(&xf, acc);
    let sq = b.mul(&xa, &xa);
    let ss = b.reduce(&sq, Lit::F(0.0), &[r - 1], "add");
    let rows = ss.shape().to_vec();
    let dn = b.splat(Lit::F(d as f64), acc, &rows);
    let ms = b.div(&ss, &dn);
    let e = b.splat(Lit::F(*eps), acc, &rows);
    let t = b.add(&ms, &e);
    let sq = b.unary("sqrt", &t);
    let o = b.splat_like(Lit::F(1.0), &sq);
    let rstd = b.div(&o, &sq);
    let rb = b.broadcast(&rstd, xa.shape(), &(0..r - 1).collect::<Vec<_>>());
    let rb = b.convert_raw(&rb, xf.dtype());
    let xn = b.mul(&xf, &rb);
    let wb = b.broadcast(&wf, xf.shape(), &[r - 1]);
    let y = b.mul(&xn, &wb);
    vec![b.convert_raw(&y, outs[0].dtype), rstd]
}

/// `Op::RmsNormBackward`: `dx` and `dw`.
pub(super) fn rms_norm_backward(b: &mut Builder, x: &[Val], outs: &[Meta]) -> Vec<Val> {
    let (xf, wf, rstd, g) = (up(b, &x[0]), up(b, &x[1]), &x[2], up(b, &x[3]));
    let ct = xf.dtype();
    let r = xf.ty.rank();
    let d = xf.shape()[r - 1];
    let lead: Vec<usize> = (0..r - 1).collect();
    let rs = b.convert_raw(rstd, ct);
    let rb = b.broadcast(&rs, xf.shape(), &lead);
    let wb = b.broadcast(&wf, xf.shape(), &[r - 1]);
    let gw = b.mul(&g, &wb);
    // dx = rstd * gw - x * rstd^3 * sum(gw * x) / D
    let gx = b.mul(&gw, &xf);
    let s = b.reduce(&gx, Lit::F(0.0), &[r - 1], "add");
    let dn = b.splat(Lit::F(d as f64), ct, s.shape());
    let s = b.div(&s, &dn);
    let sb = b.broadcast(&s, xf.shape(), &lead);
    let r2 = b.mul(&rb, &rb);
    let r3 = b.mul(&r2, &rb);
    let t1 = b.mul(&rb, &gw);
    let t2 = b.mul(&xf, &r3);
    let t2 = b.mul(&t2, &sb);
    let dx = b.sub(&t1, &t2);
    let xn = b.mul(&xf, &rb);
    let gxn = b.mul(&g, &xn);
    let dw = b.reduce(&gxn, Lit::F(0.0), &lead, "add");
    vec![b.convert_raw(&dx, outs[0].dtype), b.convert_raw(&dw, outs[1].dtype)]
}
