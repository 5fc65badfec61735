//! Fused scaled dot-product attention (`Op::Attention`) and its gradients
//! (`Op::AttentionBackward`), flash-attention style.
//!
//! Forward: one task per (batch, query head). Query rows go in blocks of
//! [`BLOCK`]: the block's scores `scale * q k^T` (one small GEMM into a scratch
//! buffer that stays in cache), a softmax per row over the keys it may see, the
//! row's log-sum-exp kept for the backward, and `p v` written straight into the
//! output (a second GEMM). With a causal mask a block only computes the keys up
//! to its last row's diagonal, so about half of the work of the full `[T, S]`
//! product is skipped. Nothing of size `[B, H, T, S]` is ever allocated.
//!
//! Backward: one task per (batch, key/value head), looping over the query heads
//! that share it (grouped-query attention), so `dk` and `dv` accumulate in the
//! task's own output rows without locks. Per query block it recomputes `p =
//! exp(scale * q k^T - lse)`, then `dv += p^T g`, `dp = g v^T`, `ds = p * (dp -
//! rowsum(g * out)) * scale`, `dq = ds k` and `dk += ds^T q`.
//!
//! f32 and f64 compute in their own type; bf16 runs its products on the AMX
//! tile unit where the CPU has one (`attention_tiles`); otherwise bf16 and
//! f16 are widened to f32 and rounded once at the end.
use super::copy::{contiguous, narrow_f32, widen_f32};
use super::elem::Elem;
use super::iter::{fork_chunks, fork_zip};
use super::matmul::{gemm_small, GemmElem, MatRef};
use super::simd::{dispatch, Kernel};
use super::softmax::{fmax, SoftFloat};
use super::{attention_tiles, gemm_bf16};
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::{DType, Error, HostBuffer, Layout, Result};

/// Query rows per block: the scratch scores of a block are `BLOCK x S`.
pub(super) const BLOCK: usize = 64;

/// A 4-D `[B, heads, rows, cols]` operand: its storage and strides.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a, F> {
    data: &'a [F],
    off: usize,
    strides: [usize; 4],
}

impl<'a, F> Operand<'a, F> {
    pub(super) fn new(data: &'a [F], l: &Layout) -> Operand<'a, F> {
        let s = l.strides();
        Operand { data, off: l.offset(), strides: [s[0], s[1], s[2], s[3]] }
    }
    /// The `[rows, cols]` matrix of batch `b`, head `h`.
    pub(super) fn head(&self, b: usize, h: usize) -> MatRef<'a, F> {
        let [sb, sh, sr, sc] = self.strides;
        MatRef { data: self.data, off: self.off + b * sb + h * sh, rs: sr, cs: sc }
    }
}

/// Sizes of one attention problem.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub b: usize,
    pub h: usize,
    pub t: usize,
    pub d: usize,
    pub hk: usize,
    pub s: usize,
    pub dv: usize,
    pub scale: f64,
    pub causal: bool,
}

impl Dims {
    fn new(q: &Layout, k: &Layout, v: &Layout, scale: f64, causal: bool) -> Result<Dims> {
        let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
        if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 || ks[1] == 0 || qs[1] % ks[1] != 0 {
            return Err(Error::shape("scaled_dot_product_attention", "expected 4-D query, key and value"));
        }
        if causal && ks[2] < qs[2] {
            return Err(Error::shape(
                "scaled_dot_product_attention",
                "a causal mask needs at least as many keys as queries",
            ));
        }
        Ok(Dims { b: qs[0], h: qs[1], t: qs[2], d: qs[3], hk: ks[1], s: ks[2], dv: vs[3], scale, causal })
    }
    /// Query heads per key/value head.
    pub(super) fn group(&self) -> usize {
        self.h / self.hk
    }
    /// Keys query row `i` sees.
    pub(super) fn visible(&self, i: usize) -> usize {
        if self.causal {
            (i + 1 + self.s - self.t).min(self.s)
        } else {
            self.s
        }
    }
}

/// Float types the kernels compute in.
pub(super) trait AttnFloat: GemmElem + SoftFloat {}
impl AttnFloat for f32 {}
impl AttnFloat for f64 {}

const fn zero<F: AttnFloat>() -> F {
    <F as SoftFloat>::ZERO
}
const fn one<F: AttnFloat>() -> F {
    <F as SoftFloat>::ONE
}

/// Independent accumulator lanes in the row loops (one AVX-512 register of f32),
/// so that the max and the sum vectorise.
const LANES: usize = 16;

/// Overwrites `row[..n]` with `exp(row - max) / sum` and zeroes `row[n..]`;
/// returns the log-sum-exp `max + ln(sum)` (NaN rows give NaN, like softmax).
#[inline(always)]
pub(super) fn softmax_prefix<F: AttnFloat, const FMA: bool>(row: &mut [F], n: usize) -> F {
    let (vis, rest) = row.split_at_mut(n);
    rest.fill(zero::<F>());
    if vis.is_empty() {
        return F::NEG_INF;
    }
    let mut mv = [F::NEG_INF; LANES];
    let mut chunks = vis.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            mv[i] = fmax(mv[i], c[i]);
        }
    }
    let m = chunks.remainder().iter().chain(&mv).fold(F::NEG_INF, |m, &x| fmax(m, x));
    let mut sv = [zero::<F>(); LANES];
    let mut chunks = vis.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let e = (c[i] - m).exp::<FMA>();
            c[i] = e;
            sv[i] = sv[i] + e;
        }
    }
    let mut sum = zero::<F>();
    for x in chunks.into_remainder() {
        let e = (*x - m).exp::<FMA>();
        *x = e;
        sum = sum + e;
    }
    let sum = sv.iter().fold(sum, |a, &b| a + b);
    let inv = one::<F>() / sum;
    for x in vis.iter_mut() {
        *x = *x * inv;
    }
    m + sum.ln()
}

/// The scaled scores of query rows `i0..i0 + rows` of one head against keys
/// `0..su`, into `sc` (`rows x su`).
fn scores<F: AttnFloat>(
    sc: &mut [F],
    q: MatRef<'_, F>,
    k: MatRef<'_, F>,
    i0: usize,
    rows: usize,
    su: usize,
    dm: &Dims,
) {
    gemm_small(sc, su, rows, su, dm.d, q.rows_from(i0), k.t(), <F as Elem>::of_f64(dm.scale), false);
}

/// Forward of one (batch, head): `out` is its `[T, Dv]` block, `lse` its `[T]`.
pub(super) struct HeadForward<'a, F> {
    pub dm: Dims,
    pub q: MatRef<'a, F>,
    pub k: MatRef<'a, F>,
    pub v: MatRef<'a, F>,
    pub out: &'a mut [F],
    pub lse: &'a mut [F],
}

impl<F: AttnFloat> Kernel for HeadForward<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let HeadForward { dm, q, k, v, out, lse } = self;
        let mut sc: Vec<F> = Vec::new();
        for i0 in (0..dm.t).step_by(BLOCK) {
            let rows = BLOCK.min(dm.t - i0);
            let su = dm.visible(i0 + rows - 1);
            sc.resize(rows * su, zero::<F>());
            scores(&mut sc, q, k, i0, rows, su, &dm);
            for r in 0..rows {
                lse[i0 + r] = softmax_prefix::<F, FMA>(&mut sc[r * su..(r + 1) * su], dm.visible(i0 + r));
            }
            let p = MatRef { data: &sc[..], off: 0, rs: su, cs: 1 };
            gemm_small(&mut out[i0 * dm.dv..], dm.dv, rows, dm.dv, su, p, v, one::<F>(), false);
        }
    }
}

fn forward_typed<F: AttnFloat>(q: Operand<'_, F>, k: Operand<'_, F>, v: Operand<'_, F>, dm: Dims) -> (Vec<F>, Vec<F>) {
    let (heads, t, dv) = (dm.b * dm.h, dm.t, dm.dv);
    let mut out = F::zeros(heads * t * dv);
    let mut lse = F::zeros(heads * t);
    if heads == 0 || t == 0 {
        return (out, lse);
    }
    let g = dm.group();
    let task = |bh: usize, out: &mut [F], lse: &mut [F]| {
        let (b, h) = (bh / dm.h, bh % dm.h);
        dispatch(HeadForward { dm, q: q.head(b, h), k: k.head(b, h / g), v: v.head(b, h / g), out, lse });
    };
    let (oc, lc) = (t * dv.max(1), t);
    if dv == 0 {
        // No output columns: only the log-sum-exps.
        fork_chunks(&mut lse, lc, 1, &|bh, l| task(bh, &mut [], l));
    } else {
        fork_zip(&mut out, oc, &mut lse, lc, &|bh, o, l| task(bh, o, l));
    }
    (out, lse)
}

/// Backward of one (batch, key/value head) and the query heads sharing it.
struct GroupBackward<'a, F> {
    dm: Dims,
    b: usize,
    kh: usize,
    q: Operand<'a, F>,
    k: MatRef<'a, F>,
    v: MatRef<'a, F>,
    out: Operand<'a, F>,
    g: Operand<'a, F>,
    lse: &'a [F],
    /// `[G, T, D]`: the gradients of the group's query heads.
    dq: &'a mut [F],
    /// `[S, D]` and `[S, Dv]`, zero on entry.
    dk: &'a mut [F],
    dv: &'a mut [F],
}

impl<F: AttnFloat> Kernel for GroupBackward<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let GroupBackward { dm, b, kh, q, k, v, out, g, lse, dq, dk, dv } = self;
        let (t, d) = (dm.t, dm.d);
        let scale = <F as Elem>::of_f64(dm.scale);
        let mut p: Vec<F> = Vec::new();
        let mut ds: Vec<F> = Vec::new();
        let mut di: Vec<F> = Vec::new();
        for gi in 0..dm.group() {
            let h = kh * dm.group() + gi;
            let (qh, oh, gh) = (q.head(b, h), out.head(b, h), g.head(b, h));
            let lse = &lse[(b * dm.h + h) * t..][..t];
            let dqh = &mut dq[gi * t * d..][..t * d];
            for i0 in (0..t).step_by(BLOCK) {
                let rows = BLOCK.min(t - i0);
                let su = dm.visible(i0 + rows - 1);
                p.resize(rows * su, zero::<F>());
                ds.resize(rows * su, zero::<F>());
                scores(&mut p, qh, k, i0, rows, su, &dm);
                // p = exp(scores - lse) where visible, else 0; di = rowsum(g * out).
                di.clear();
                for r in 0..rows {
                    let i = i0 + r;
                    let n = dm.visible(i);
                    let l = lse[i];
                    let row = &mut p[r * su..(r + 1) * su];
                    for x in row[..n].iter_mut() {
                        *x = (*x - l).exp::<FMA>();
                    }
                    row[n..].fill(zero::<F>());
                    let (go, oo) = (gh.rows_from(i), oh.rows_from(i));
                    let mut acc = zero::<F>();
                    for c in 0..dm.dv {
                        acc = acc + go.data[go.off + c * go.cs] * oo.data[oo.off + c * oo.cs];
                    }
                    di.push(acc);
                }
                let pm = MatRef { data: &p[..], off: 0, rs: su, cs: 1 };
                // dv[..su] += p^T g
                gemm_small(dv, dm.dv, su, dm.dv, rows, pm.t(), gh.rows_from(i0), one::<F>(), true);
                // ds = g v^T, then ds = p * (ds - di) * scale.
                gemm_small(&mut ds, su, rows, su, dm.dv, gh.rows_from(i0), v.t(), one::<F>(), false);
                for r in 0..rows {
                    let (pr, dr) = (&p[r * su..(r + 1) * su], &mut ds[r * su..(r + 1) * su]);
                    let dr_i = di[r];
                    for (x, &pv) in dr.iter_mut().zip(pr) {
                        *x = pv * (*x - dr_i) * scale;
                    }
                }
                let dsm = MatRef { data: &ds[..], off: 0, rs: su, cs: 1 };
                // dq rows = ds k; dk[..su] += ds^T q.
                gemm_small(&mut dqh[i0 * d..], d, rows, d, su, dsm, k, one::<F>(), false);
                gemm_small(dk, d, su, d, rows, dsm.t(), qh.rows_from(i0), one::<F>(), true);
            }
        }
    }
}

/// `x` in `groups` chunks of `per` elements, one (empty) chunk per group
/// also when `per` is 0, so that zero-sized dims still give every group its task.
pub(super) fn chunks<T>(x: &mut [T], per: usize, groups: usize) -> Vec<&mut [T]> {
    if per == 0 {
        (0..groups).map(|_| &mut [][..]).collect()
    } else {
        x.chunks_mut(per).collect()
    }
}

/// Gradients `(dq, dk, dv)` of one attention problem.
#[allow(clippy::type_complexity)]
fn backward_typed<F: AttnFloat>(ops: [Operand<'_, F>; 5], lse: &[F], dm: Dims) -> (Vec<F>, Vec<F>, Vec<F>) {
    let [q, k, v, out, g] = ops;
    let (tq, tk, tv) = (dm.t * dm.d, dm.s * dm.d, dm.s * dm.dv);
    let mut dq = F::zeros(dm.b * dm.h * tq);
    let mut dk = F::zeros(dm.b * dm.hk * tk);
    let mut dv = F::zeros(dm.b * dm.hk * tv);
    let groups = dm.b * dm.hk;
    if groups == 0 || dm.t == 0 || dm.s == 0 {
        return (dq, dk, dv);
    }
    let task = |bk: usize, dq: &mut [F], dk: &mut [F], dv: &mut [F]| {
        let (b, kh) = (bk / dm.hk, bk % dm.hk);
        dispatch(GroupBackward { dm, b, kh, q, k: k.head(b, kh), v: v.head(b, kh), out, g, lse, dq, dk, dv });
    };
    let (qc, kc, vc) =
        (chunks(&mut dq, dm.group() * tq, groups), chunks(&mut dk, tk, groups), chunks(&mut dv, tv, groups));
    let mut parts: Vec<_> = qc.into_iter().zip(kc).zip(vc).map(|((dq, dk), dv)| (dq, dk, dv)).collect();
    fork_chunks(&mut parts, 1, 1, &|bk, p| {
        let (dq, dk, dv) = &mut p[0];
        task(bk, dq, dk, dv)
    });
    (dq, dk, dv)
}

/// `x` widened to f32 in a contiguous buffer, with its layout.
fn widen<T: Elem>(x: &Input<'_>) -> Result<(Vec<f32>, Layout)> {
    Ok((widen_f32::<T>(x)?, Layout::contiguous(x.layout.shape())))
}

/// `Op::Attention`: outputs `out` and `lse`.
pub(crate) fn forward(ins: &[Input<'_>], scale: f64, causal: bool) -> Result<Vec<HostBuffer>> {
    let (q, k, v) = (&ins[0], &ins[1], &ins[2]);
    let dm = Dims::new(q.layout, k.layout, v.layout, scale, causal)?;
    fn typed<F: AttnFloat>(ins: &[Input<'_>], dm: Dims) -> Result<Vec<HostBuffer>> {
        let o = |i: usize| -> Result<Operand<'_, F>> { Ok(Operand::new(ins[i].slice::<F>()?, ins[i].layout)) };
        let (out, lse) = forward_typed(o(0)?, o(1)?, o(2)?, dm);
        Ok(vec![buf(out), buf(lse)])
    }
    fn half<T: Elem>(ins: &[Input<'_>], dm: Dims) -> Result<Vec<HostBuffer>> {
        let w = ins.iter().map(widen::<T>).collect::<Result<Vec<_>>>()?;
        let o = |i: usize| Operand::new(&w[i].0[..], &w[i].1);
        let (out, lse) = forward_typed(o(0), o(1), o(2), dm);
        Ok(vec![buf(narrow_f32::<T>(out)), buf(lse)])
    }
    match q.dtype() {
        DType::F32 => typed::<f32>(ins, dm),
        DType::F64 => typed::<f64>(ins, dm),
        DType::BF16 if gemm_bf16::available() => attention_tiles::forward(ins, dm),
        DType::BF16 => half::<bf16>(ins, dm),
        DType::F16 => half::<f16>(ins, dm),
        dt => Err(Error::unsupported_dtype("scaled_dot_product_attention", dt)),
    }
}

/// `Op::AttentionBackward`: inputs `q, k, v, out, lse, g`; outputs `dq, dk, dv`.
pub(crate) fn backward(ins: &[Input<'_>], scale: f64, causal: bool) -> Result<Vec<HostBuffer>> {
    let dm = Dims::new(ins[0].layout, ins[1].layout, ins[2].layout, scale, causal)?;
    fn typed<F: AttnFloat>(ins: &[Input<'_>], lse: &[F], dm: Dims) -> Result<Vec<HostBuffer>> {
        let o = |i: usize| -> Result<Operand<'_, F>> { Ok(Operand::new(ins[i].slice::<F>()?, ins[i].layout)) };
        let (dq, dk, dv) = backward_typed([o(0)?, o(1)?, o(2)?, o(3)?, o(5)?], lse, dm);
        Ok(vec![buf(dq), buf(dk), buf(dv)])
    }
    fn half<T: Elem>(ins: &[Input<'_>], lse: &[f32], dm: Dims) -> Result<Vec<HostBuffer>> {
        let w = [0, 1, 2, 3, 5].map(|i| widen::<T>(&ins[i]));
        let w = w.into_iter().collect::<Result<Vec<_>>>()?;
        let o = |i: usize| Operand::new(&w[i].0[..], &w[i].1);
        let (dq, dk, dv) = backward_typed([o(0), o(1), o(2), o(3), o(4)], lse, dm);
        Ok(vec![buf(narrow_f32::<T>(dq)), buf(narrow_f32::<T>(dk)), buf(narrow_f32::<T>(dv))])
    }
    let name = "scaled_dot_product_attention_backward";
    match ins[0].dtype() {
        DType::F32 => typed::<f32>(ins, &contiguous::<f32>(&ins[4])?, dm),
        DType::F64 => typed::<f64>(ins, &contiguous::<f64>(&ins[4])?, dm),
        DType::BF16 if gemm_bf16::available() => attention_tiles::backward(ins, &contiguous::<f32>(&ins[4])?, dm),
        DType::BF16 => half::<bf16>(ins, &contiguous::<f32>(&ins[4])?, dm),
        DType::F16 => half::<f16>(ins, &contiguous::<f32>(&ins[4])?, dm),
        dt => Err(Error::unsupported_dtype(name, dt)),
    }
}
