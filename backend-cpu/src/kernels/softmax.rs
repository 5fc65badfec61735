//! `softmax` and `log_softmax` along one dim, fused: one pass for the max, one
//! for the exponentials and their sum, one to normalise (two for log_softmax,
//! which needs no stored exponentials).
//!
//! The input is viewed as `(outer, n, inner)` with the softmax dim in the middle.
//! When `inner == 1` (the last dim, the common case) each row is a contiguous
//! slice folded with several independent lanes, so the max, the exponentials
//! (`simd::exp_f32`) and the sum vectorise; otherwise the `inner` columns are
//! the contiguous ones and each pass runs across them. Rows are split across
//! threads. bf16/f16 compute in float32 and round once; f64 stays in f64.
//!
//! NaN handling matches PyTorch: a NaN anywhere in a slice, a `+inf`, or a slice
//! made only of `-inf` makes the whole slice NaN (the max-shifted exponentials
//! then hold a NaN, and so does their sum).
use super::copy::{contiguous, materialize_vec};
use super::elem::{assume_init, bf16_to_f32, f32_to_bf16, uninit, zeroed_block, FloatElem};
use super::iter::par_blocks;
use super::simd::{dispatch, exp_f32, Kernel};
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::{numel, DType, Error, HostBuffer, Result};

/// Lanes of independent accumulators in the row loops (one AVX-512 register of f32).
const LANES: usize = 16;

/// The float types the kernel computes in.
pub(super) trait SoftFloat:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    const NEG_INF: Self;
    const ZERO: Self;
    const ONE: Self;
    fn exp<const FMA: bool>(self) -> Self;
    fn ln(self) -> Self;
}

impl SoftFloat for f32 {
    const NEG_INF: f32 = f32::NEG_INFINITY;
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    #[inline(always)]
    fn exp<const FMA: bool>(self) -> f32 {
        exp_f32::<FMA>(self)
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
}

impl SoftFloat for f64 {
    const NEG_INF: f64 = f64::NEG_INFINITY;
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    #[inline(always)]
    fn exp<const FMA: bool>(self) -> f64 {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> f64 {
        f64::ln(self)
    }
}

/// `max(a, b)` that ignores a NaN `b` (a NaN still poisons the sum later) and
/// compiles to a vector max.
#[inline(always)]
pub(super) fn fmax<F: SoftFloat>(a: F, b: F) -> F {
    if b > a {
        b
    } else {
        a
    }
}

/// One softmax over a contiguous row.
#[inline(always)]
fn row<F: SoftFloat, const FMA: bool>(x: &[F], out: &mut [F], log: bool) {
    let mut mv = [F::NEG_INF; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            mv[i] = fmax(mv[i], c[i]);
        }
    }
    let mut m = rest.iter().fold(F::NEG_INF, |m, &v| fmax(m, v));
    for v in mv {
        m = fmax(m, v);
    }
    let mut sv = [F::ZERO; LANES];
    let mut tail = F::ZERO;
    if log {
        for c in x.chunks_exact(LANES) {
            for i in 0..LANES {
                sv[i] = sv[i] + (c[i] - m).exp::<FMA>();
            }
        }
        for &v in rest {
            tail = tail + (v - m).exp::<FMA>();
        }
        // `(x - max) - log(sum)`, not `x - (max + log(sum))`: the shifted value is
        // exact, and adding a large max first would round the small log away.
        let ls = sv.iter().fold(tail, |a, &b| a + b).ln();
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (v - m) - ls;
        }
    } else {
        let n = x.len() - rest.len();
        for (oc, c) in out[..n].chunks_exact_mut(LANES).zip(x.chunks_exact(LANES)) {
            for i in 0..LANES {
                let e = (c[i] - m).exp::<FMA>();
                oc[i] = e;
                sv[i] = sv[i] + e;
            }
        }
        for (o, &v) in out[n..].iter_mut().zip(rest) {
            let e = (v - m).exp::<FMA>();
            *o = e;
            tail = tail + e;
        }
        let inv = F::ONE / sv.iter().fold(tail, |a, &b| a + b);
        for o in out.iter_mut() {
            *o = *o * inv;
        }
    }
}

/// One softmax over the middle dim of a contiguous `(n, inner)` block, across columns.
#[inline(always)]
fn columns<F: SoftFloat, const FMA: bool>(x: &[F], out: &mut [F], inner: usize, log: bool) {
    let mut m = vec![F::NEG_INF; inner];
    for r in x.chunks_exact(inner) {
        for (a, &v) in m.iter_mut().zip(r) {
            *a = fmax(*a, v);
        }
    }
    let mut s = vec![F::ZERO; inner];
    if log {
        for r in x.chunks_exact(inner) {
            for ((a, &v), &mx) in s.iter_mut().zip(r).zip(&m) {
                *a = *a + (v - mx).exp::<FMA>();
            }
        }
        for a in s.iter_mut() {
            *a = a.ln();
        }
        for (o, r) in out.chunks_exact_mut(inner).zip(x.chunks_exact(inner)) {
            for (((o, &v), &ls), &mx) in o.iter_mut().zip(r).zip(&s).zip(&m) {
                *o = (v - mx) - ls;
            }
        }
    } else {
        for (o, r) in out.chunks_exact_mut(inner).zip(x.chunks_exact(inner)) {
            for (((o, &v), a), &mx) in o.iter_mut().zip(r).zip(s.iter_mut()).zip(&m) {
                let e = (v - mx).exp::<FMA>();
                *o = e;
                *a = *a + e;
            }
        }
        for a in s.iter_mut() {
            *a = F::ONE / *a;
        }
        for o in out.chunks_exact_mut(inner) {
            for (o, &inv) in o.iter_mut().zip(&s) {
                *o = *o * inv;
            }
        }
    }
}

/// A run of consecutive `(n, inner)` blocks, compiled for the best instruction set.
struct Blocks<'a, F> {
    x: &'a [F],
    out: &'a mut [F],
    n: usize,
    inner: usize,
    log: bool,
}

impl<F: SoftFloat> Kernel for Blocks<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let block = self.n * self.inner;
        for (xb, ob) in self.x.chunks_exact(block).zip(self.out.chunks_exact_mut(block)) {
            if self.inner == 1 {
                row::<F, FMA>(xb, ob, self.log);
            } else {
                columns::<F, FMA>(xb, ob, self.inner, self.log);
            }
        }
    }
}

/// Softmax of contiguous `xs` viewed as `(outer, n, inner)`.
fn run<F: SoftFloat>(xs: &[F], n: usize, inner: usize, log: bool) -> Vec<F> {
    let block = n * inner;
    if block == 0 {
        return Vec::new();
    }
    let mut out = uninit::<F>(xs.len());
    // About 15 element-operations per element (max, exp, sum, scale).
    par_blocks(&mut out, block, 15, &|bi, ob| {
        let xb = &xs[bi * block..bi * block + ob.len()];
        dispatch(Blocks { x: xb, out: zeroed_block(ob, F::ZERO), n, inner, log });
    });
    // SAFETY: `par_blocks` calls the closure on every block of `out` (`block > 0`),
    // and `zeroed_block` wrote each one.
    unsafe { assume_init(out) }
}

/// `softmax` (or `log_softmax`) of `x` along `dim`.
pub(crate) fn softmax(x: &Input<'_>, dim: usize, log: bool) -> Result<HostBuffer> {
    let shape = x.layout.shape();
    let (n, inner) = if shape.is_empty() { (1, 1) } else { (shape[dim], numel(&shape[dim + 1..])) };
    struct Softmax {
        n: usize,
        inner: usize,
        log: bool,
    }
    impl InComputeType for Softmax {
        fn run<F: ComputeFloat>(&self, xs: &[F]) -> Result<Vec<F>> {
            Ok(run(xs, self.n, self.inner, self.log))
        }
    }
    in_compute_type(x, if log { "log_softmax" } else { "softmax" }, Softmax { n, inner, log })
}

/// A computation over the elements of a floating tensor, in its compute type.
trait InComputeType {
    fn run<F: ComputeFloat>(&self, xs: &[F]) -> Result<Vec<F>>;
}

/// Runs `k` on `x`'s elements in row-major order, in `x`'s compute type (f32 and
/// f64 as they are, bf16 and f16 widened to f32), and returns its result in
/// `x`'s dtype (rounded once for the half types).
fn in_compute_type<K: InComputeType>(x: &Input<'_>, name: &'static str, k: K) -> Result<HostBuffer> {
    Ok(match x.dtype() {
        DType::F32 => buf(k.run(&contiguous::<f32>(x)?)?),
        DType::F64 => buf(k.run(&contiguous::<f64>(x)?)?),
        DType::BF16 => {
            let xs: Vec<f32> = contiguous::<half::bf16>(x)?.iter().map(|&v| bf16_to_f32(v)).collect();
            buf(k.run(&xs)?.into_iter().map(f32_to_bf16).collect::<Vec<_>>())
        }
        DType::F16 => {
            let xs: Vec<f32> = contiguous::<f16>(x)?.iter().map(|&v| v.to_f32()).collect();
            buf(k.run(&xs)?.into_iter().map(f16::from_f32).collect::<Vec<_>>())
        }
        dt => return Err(Error::unsupported_dtype(name, dt)),
    })
}

/// The types kernels here compute in (f32, f64), with their element conversions.
trait ComputeFloat: SoftFloat + super::elem::Elem {}
impl ComputeFloat for f32 {}
impl ComputeFloat for f64 {}

/// The cross-entropy gradient of a run of consecutive `(n, inner)` blocks.
struct CeBlocks<'a, F> {
    x: &'a [F],
    out: &'a mut [F],
    /// Targets and weights of these blocks, `inner` per block.
    t: &'a [i64],
    w: &'a [F],
    n: usize,
    inner: usize,
    smoothing: f64,
}

impl<F: ComputeFloat> Kernel for CeBlocks<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let CeBlocks { x, out, t, w, n, inner, smoothing } = self;
        let block = n * inner;
        let hit = <F as super::elem::Elem>::of_f64(1.0 - smoothing);
        let spread = <F as super::elem::Elem>::of_f64(smoothing / n as f64);
        for (bi, (xb, ob)) in x.chunks_exact(block).zip(out.chunks_exact_mut(block)).enumerate() {
            if inner == 1 {
                row::<F, FMA>(xb, ob, false);
            } else {
                columns::<F, FMA>(xb, ob, inner, false);
            }
            for j in 0..inner {
                let (tj, wj) = (t[bi * inner + j] as usize, w[bi * inner + j]);
                if smoothing != 0.0 || inner != 1 {
                    for c in 0..n {
                        let o = &mut ob[c * inner + j];
                        *o = (*o - spread) * wj;
                    }
                } else {
                    for o in ob.iter_mut() {
                        *o = *o * wj;
                    }
                }
                let o = &mut ob[tj * inner + j];
                *o = *o - hit * wj;
            }
        }
    }
}

fn ce_run<F: ComputeFloat>(xs: &[F], t: &[i64], w: &[F], n: usize, inner: usize, smoothing: f64) -> Vec<F> {
    let block = n * inner;
    if block == 0 {
        return Vec::new();
    }
    let mut out = uninit::<F>(xs.len());
    par_blocks(&mut out, block, 16, &|bi, ob| {
        let blocks = ob.len() / block;
        let (xb, tb, wb) =
            (&xs[bi * block..][..ob.len()], &t[bi * inner..][..blocks * inner], &w[bi * inner..][..blocks * inner]);
        dispatch(CeBlocks { x: xb, out: zeroed_block(ob, F::ZERO), t: tb, w: wb, n, inner, smoothing });
    });
    // SAFETY: `par_blocks` calls the closure on every block of `out` (`block > 0`),
    // and `zeroed_block` wrote each one.
    unsafe { assume_init(out) }
}

/// The class indices `t` in row-major order, each checked against `n` classes.
fn targets(t: &Input<'_>, n: usize) -> Result<Vec<i64>> {
    let tv = materialize_vec::<i64>(t)?;
    if let Some(bad) = tv.iter().find(|&&c| c < 0 || c as usize >= n) {
        return Err(Error::index("cross_entropy_backward", format!("target {bad} is out of bounds for {n} classes")));
    }
    Ok(tv)
}

/// `Op::CrossEntropyBackward`: `(softmax(x) - (1 - smoothing) onehot(t) -
/// smoothing / C) * w` along dim 1 of `x [N, C, ...]`.
pub(crate) fn cross_entropy_backward(
    x: &Input<'_>,
    t: &Input<'_>,
    w: &Input<'_>,
    smoothing: f64,
) -> Result<HostBuffer> {
    let shape = x.layout.shape();
    let (n, inner) = (shape[1], numel(&shape[2..]));
    let tv = targets(t, n)?;
    struct Ce<'a> {
        t: Vec<i64>,
        /// The weights, in the compute type (`Op::infer` checked their dtype).
        w: &'a Input<'a>,
        n: usize,
        inner: usize,
        smoothing: f64,
    }
    impl InComputeType for Ce<'_> {
        fn run<F: ComputeFloat>(&self, xs: &[F]) -> Result<Vec<F>> {
            Ok(ce_run(xs, &self.t, &materialize_vec::<F>(self.w)?, self.n, self.inner, self.smoothing))
        }
    }
    in_compute_type(x, "cross_entropy_backward", Ce { t: tv, w, n, inner, smoothing })
}

/// The log-sum-exp of each `(n, inner)` block of a run, over `n`.
struct LseBlocks<'a, F> {
    x: &'a [F],
    out: &'a mut [F],
    n: usize,
    inner: usize,
}

impl<F: ComputeFloat> Kernel for LseBlocks<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let LseBlocks { x, out, n, inner } = self;
        // An infinite max stands in as 0: all -inf gives log(0) = -inf, a +inf gives +inf.
        let shift =
            |m: F| if m == F::NEG_INF || m == <F as super::elem::Elem>::of_f64(f64::INFINITY) { F::ZERO } else { m };
        for (xb, ob) in x.chunks_exact(n * inner).zip(out.chunks_exact_mut(inner)) {
            if inner == 1 {
                let mut mv = [F::NEG_INF; LANES];
                let chunks = xb.chunks_exact(LANES);
                let rest = chunks.remainder();
                for c in chunks {
                    for i in 0..LANES {
                        mv[i] = fmax(mv[i], c[i]);
                    }
                }
                let m = shift(rest.iter().chain(&mv).fold(F::NEG_INF, |m, &v| fmax(m, v)));
                let mut sv = [F::ZERO; LANES];
                for c in xb.chunks_exact(LANES) {
                    for i in 0..LANES {
                        sv[i] = sv[i] + (c[i] - m).exp::<FMA>();
                    }
                }
                let tail = rest.iter().fold(F::ZERO, |s, &v| s + (v - m).exp::<FMA>());
                ob[0] = sv.iter().fold(tail, |a, &b| a + b).ln() + m;
            } else {
                let mut m = vec![F::NEG_INF; inner];
                for r in xb.chunks_exact(inner) {
                    for (a, &v) in m.iter_mut().zip(r) {
                        *a = fmax(*a, v);
                    }
                }
                m.iter_mut().for_each(|v| *v = shift(*v));
                ob.fill(F::ZERO);
                for r in xb.chunks_exact(inner) {
                    for ((a, &v), &mx) in ob.iter_mut().zip(r).zip(&m) {
                        *a = *a + (v - mx).exp::<FMA>();
                    }
                }
                for (a, &mx) in ob.iter_mut().zip(&m) {
                    *a = a.ln() + mx;
                }
            }
        }
    }
}

fn lse_run<F: ComputeFloat>(xs: &[F], n: usize, inner: usize) -> Vec<F> {
    let outer = xs.len().checked_div(n * inner).unwrap_or(0);
    let mut out = vec![F::ZERO; outer * inner];
    if out.is_empty() {
        return out;
    }
    par_blocks(&mut out, inner, 4 * n, &|bi, ob| {
        let xb = &xs[bi * n * inner..][..n * inner];
        dispatch(LseBlocks { x: xb, out: ob, n, inner });
    });
    out
}

/// `Op::LogSumExp` along `dim`.
pub(crate) fn logsumexp(x: &Input<'_>, dim: usize) -> Result<HostBuffer> {
    let shape = x.layout.shape();
    let (n, inner) = if shape.is_empty() { (1, 1) } else { (shape[dim], numel(&shape[dim + 1..])) };
    if n == 0 {
        // The sum of nothing is 0, its log -inf.
        let len = numel(&shape[..dim]) * inner;
        let neg = f64::NEG_INFINITY;
        return Ok(match x.dtype() {
            DType::F32 => buf(vec![neg as f32; len]),
            DType::F64 => buf(vec![neg; len]),
            DType::BF16 => buf(vec![half::bf16::NEG_INFINITY; len]),
            DType::F16 => buf(vec![f16::NEG_INFINITY; len]),
            dt => return Err(Error::unsupported_dtype("logsumexp", dt)),
        });
    }
    struct Lse {
        n: usize,
        inner: usize,
    }
    impl InComputeType for Lse {
        fn run<F: ComputeFloat>(&self, xs: &[F]) -> Result<Vec<F>> {
            Ok(lse_run(xs, self.n, self.inner))
        }
    }
    in_compute_type(x, "logsumexp", Lse { n, inner })
}

// ---- widened: float32 computation on narrower logits (Note [Folded casts] in fold.rs) ----

/// `Op::LogSumExp` along `dim` of `x` (float32, bfloat16 or float16) widened
/// exactly to float32: the float32 result of casting `x` first, each block
/// widened as it is reduced (the widened copy is never written out).
pub(crate) fn logsumexp_widened(x: &Input<'_>, dim: usize) -> Result<HostBuffer> {
    fn run<I: FloatElem<C = f32>>(x: &Input<'_>, n: usize, inner: usize) -> Result<Vec<f32>> {
        let xs = contiguous::<I>(x)?;
        let outer = xs.len().checked_div(n * inner).unwrap_or(0);
        let mut out = vec![0f32; outer * inner];
        par_blocks(&mut out, inner, 4 * n, &|bi, ob| {
            let mut xf = vec![0f32; n * inner];
            I::load(&xs[bi * n * inner..][..n * inner], &mut xf);
            dispatch(LseBlocks { x: &xf, out: ob, n, inner });
        });
        Ok(out)
    }
    let shape = x.layout.shape();
    let (n, inner) = if shape.is_empty() { (1, 1) } else { (shape[dim], numel(&shape[dim + 1..])) };
    if n == 0 {
        return Ok(buf(vec![f32::NEG_INFINITY; numel(&shape[..dim]) * inner]));
    }
    Ok(buf(match x.dtype() {
        DType::F32 => run::<f32>(x, n, inner)?,
        DType::BF16 => run::<bf16>(x, n, inner)?,
        DType::F16 => run::<f16>(x, n, inner)?,
        dt => return Err(Error::unsupported_dtype("logsumexp (widened)", dt)),
    }))
}

/// `Op::CrossEntropyBackward` computed in float32 on logits `x` (float32,
/// bfloat16 or float16) widened exactly and float32 weights, each block's
/// result rounded once to `out` (float32, bfloat16 or float16): the bits of
/// casting `x` to float32, the float32 op, and casting its result to `out`.
pub(crate) fn cross_entropy_backward_widened(
    x: &Input<'_>,
    t: &Input<'_>,
    w: &Input<'_>,
    smoothing: f64,
    out: DType,
) -> Result<HostBuffer> {
    fn run<I: FloatElem<C = f32>, O: FloatElem<C = f32>>(
        x: &Input<'_>,
        t: &[i64],
        w: &[f32],
        (n, inner): (usize, usize),
        smoothing: f64,
    ) -> Result<Vec<O>> {
        let xs = contiguous::<I>(x)?;
        let block = n * inner;
        let mut out = uninit::<O>(xs.len());
        par_blocks(&mut out, block, 16, &|bi, ob| {
            let (mut xf, mut of) = (vec![0f32; block], vec![0f32; block]);
            I::load(&xs[bi * block..][..block], &mut xf);
            let (tb, wb) = (&t[bi * inner..][..inner], &w[bi * inner..][..inner]);
            dispatch(CeBlocks { x: &xf, out: &mut of, t: tb, w: wb, n, inner, smoothing });
            O::store(&of, ob);
        });
        // SAFETY: `par_blocks` calls the closure on every `block`-sized piece of
        // `out` (`block > 0`: checked by the caller), and `store` wrote each whole.
        Ok(unsafe { assume_init(out) })
    }
    const OP: &str = "cross_entropy_backward (widened)";
    let shape = x.layout.shape();
    if shape.len() < 2 {
        return Err(Error::shape(OP, format!("expected logits [N, C, ...], got {shape:?}")));
    }
    let (n, inner) = (shape[1], numel(&shape[2..]));
    let tv = targets(t, n)?;
    if w.dtype() != DType::F32 {
        return Err(Error::unsupported_dtype(OP, w.dtype()));
    }
    if n * inner == 0 {
        return Ok(HostBuffer::zeros(out, 0));
    }
    let wv = materialize_vec::<f32>(w)?;
    let dims = (n, inner);
    macro_rules! to {
        ($i:ty) => {
            match out {
                DType::F32 => buf(run::<$i, f32>(x, &tv, &wv, dims, smoothing)?),
                DType::BF16 => buf(run::<$i, bf16>(x, &tv, &wv, dims, smoothing)?),
                DType::F16 => buf(run::<$i, f16>(x, &tv, &wv, dims, smoothing)?),
                dt => return Err(Error::unsupported_dtype(OP, dt)),
            }
        };
    }
    Ok(match x.dtype() {
        DType::F32 => to!(f32),
        DType::BF16 => to!(bf16),
        DType::F16 => to!(f16),
        dt => return Err(Error::unsupported_dtype(OP, dt)),
    })
}
