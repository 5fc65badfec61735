//! RMS normalisation over the last dim (`Op::RmsNorm`) and its gradients
//! (`Op::RmsNormBackward`), one pass over each row.
//!
//! Forward, per row of `D`: `ss = sum(x²)` (independent lanes, so it
//! vectorises), `rstd = 1 / sqrt(ss / D + eps)`, `y = (x * rstd) * w` (the
//! products in the order of the unfused expression). Backward, with `gw = g *
//! w`: `dx = rstd * gw - x * rstd³ * sum(gw * x) / D` and `dw = sum over rows of
//! g * x * rstd`, each task summing its rows' `dw` before the partial sums are
//! added. bf16/f16 compute in float32 and round once.
use super::copy::{contiguous, narrow_f32, widen_f32};
use super::elem::{assume_init, uninit, zeroed_block, Elem, FloatElem};
use super::iter::fork_zip;
use super::simd::{dispatch, Kernel};
use super::softmax::SoftFloat;
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::{DType, Error, HostBuffer, Result};

const LANES: usize = 16;
/// Elements per parallel task (whole rows).
const TASK_ELEMS: usize = 1 << 15;

trait NormFloat: SoftFloat + Elem {
    fn sqrt(self) -> Self;
}
impl NormFloat for f32 {
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
}
impl NormFloat for f64 {
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}

/// `sum(a * b)` with independent lanes.
#[inline(always)]
fn dot<F: NormFloat>(a: &[F], b: &[F]) -> F {
    let mut acc = [F::ZERO; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = ca.remainder().iter().zip(cb.remainder()).fold(F::ZERO, |s, (&x, &y)| s + x * y);
    for (xa, xb) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] = acc[i] + xa[i] * xb[i];
        }
    }
    acc.iter().fold(tail, |s, &v| s + v)
}

struct Forward<'a, F> {
    x: &'a [F],
    w: &'a [F],
    y: &'a mut [F],
    rstd: &'a mut [F],
    eps: F,
}

impl<F: NormFloat> Kernel for Forward<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let Forward { x, w, y, rstd, eps } = self;
        let d = w.len();
        let inv_d = F::ONE / F::of_f64(d as f64);
        for ((xr, yr), r) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).zip(rstd.iter_mut()) {
            let rs = F::ONE / (dot(xr, xr) * inv_d + eps).sqrt();
            *r = rs;
            for ((o, &xv), &wv) in yr.iter_mut().zip(xr).zip(w) {
                *o = (xv * rs) * wv;
            }
        }
    }
}

struct Backward<'a, F> {
    x: &'a [F],
    w: &'a [F],
    rstd: &'a [F],
    g: &'a [F],
    dx: &'a mut [F],
    /// This task's partial `dw`.
    dw: &'a mut [F],
}

impl<F: NormFloat> Kernel for Backward<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let Backward { x, w, rstd, g, dx, dw } = self;
        let d = w.len();
        let inv_d = F::ONE / F::of_f64(d as f64);
        let rows = x.chunks_exact(d).zip(g.chunks_exact(d)).zip(dx.chunks_exact_mut(d)).zip(rstd);
        for (((xr, gr), dr), &rs) in rows {
            // sum(g * w * x), then dx = rs * g * w - x * rs³ * that / D.
            let mut acc = [F::ZERO; LANES];
            let mut tail = F::ZERO;
            let n = d - d % LANES;
            for j in (0..n).step_by(LANES) {
                for i in 0..LANES {
                    acc[i] = acc[i] + gr[j + i] * w[j + i] * xr[j + i];
                }
            }
            for j in n..d {
                tail = tail + gr[j] * w[j] * xr[j];
            }
            let s = acc.iter().fold(tail, |a, &v| a + v);
            let c = rs * rs * rs * s * inv_d;
            for j in 0..d {
                dr[j] = rs * (gr[j] * w[j]) - xr[j] * c;
                dw[j] = dw[j] + gr[j] * (xr[j] * rs);
            }
        }
    }
}

fn rows_per_task(d: usize) -> usize {
    (TASK_ELEMS / d.max(1)).max(1)
}

fn forward_typed<F: NormFloat>(x: &[F], w: &[F], eps: f64) -> (Vec<F>, Vec<F>) {
    let d = w.len();
    let rows = x.len().checked_div(d).unwrap_or(0);
    let mut rstd = F::zeros(rows);
    if d == 0 {
        // Empty rows: mean of nothing is NaN, like the unfused expression.
        rstd.iter_mut().for_each(|r| *r = F::ONE / (F::of_f64(f64::NAN) + F::of_f64(eps)).sqrt());
        return (Vec::new(), rstd);
    }
    let eps = F::of_f64(eps);
    let per = rows_per_task(d);
    let mut y = uninit::<F>(x.len());
    fork_zip(&mut y, per * d, &mut rstd, per, &|i, y, rstd| {
        let x = &x[i * per * d..][..y.len()];
        dispatch(Forward { x, w, y: zeroed_block(y, F::ZERO), rstd, eps });
    });
    // SAFETY: the pieces `fork_zip` hands out cover `y`, and `zeroed_block` wrote each.
    (unsafe { assume_init(y) }, rstd)
}

fn backward_typed<F: NormFloat>(x: &[F], w: &[F], rstd: &[F], g: &[F]) -> (Vec<F>, Vec<F>) {
    let d = w.len();
    if d == 0 || x.is_empty() {
        return (F::zeros(x.len()), F::zeros(d));
    }
    let per = rows_per_task(d);
    let mut dx = uninit::<F>(x.len());
    let mut partials: Vec<Vec<F>> = vec![Vec::new(); dx.len().div_ceil(per * d)];
    fork_zip(&mut dx, per * d, &mut partials, 1, &|i, dx, dw| {
        let (start, len) = (i * per * d, dx.len());
        dw[0] = F::zeros(d);
        let rs = &rstd[i * per..][..len / d];
        let dx = zeroed_block(dx, F::ZERO);
        dispatch(Backward { x: &x[start..][..len], w, rstd: rs, g: &g[start..][..len], dx, dw: &mut dw[0] });
    });
    // SAFETY: the pieces `fork_zip` hands out cover `dx`, and `zeroed_block` wrote each.
    let dx = unsafe { assume_init(dx) };
    let mut dw = F::zeros(d);
    for p in partials {
        for (a, b) in dw.iter_mut().zip(p) {
            *a = *a + b;
        }
    }
    (dx, dw)
}

/// `Op::RmsNorm`: outputs `y` and `rstd`.
pub(crate) fn rms_norm(x: &Input<'_>, w: &Input<'_>, eps: f64) -> Result<Vec<HostBuffer>> {
    if w.layout.numel() == 0 {
        // Rows of no elements: an empty `y`, and the rstd of an empty mean (NaN).
        let shape = x.layout.shape();
        let rows = kiln_tensor::numel(&shape[..shape.len().saturating_sub(1)]);
        let empty = HostBuffer::zeros(x.dtype(), 0);
        let rstd = if x.dtype() == DType::F64 { buf(vec![f64::NAN; rows]) } else { buf(vec![f32::NAN; rows]) };
        return Ok(vec![empty, rstd]);
    }
    fn half<T: Elem>(x: &Input<'_>, w: &Input<'_>, eps: f64) -> Result<Vec<HostBuffer>> {
        let (y, r) = forward_typed(&widen_f32::<T>(x)?, &widen_f32::<T>(w)?, eps);
        Ok(vec![buf(narrow_f32::<T>(y)), buf(r)])
    }
    Ok(match x.dtype() {
        DType::F32 => {
            let (y, r) = forward_typed(&contiguous::<f32>(x)?, &contiguous::<f32>(w)?, eps);
            vec![buf(y), buf(r)]
        }
        DType::F64 => {
            let (y, r) = forward_typed(&contiguous::<f64>(x)?, &contiguous::<f64>(w)?, eps);
            vec![buf(y), buf(r)]
        }
        DType::BF16 => half::<bf16>(x, w, eps)?,
        DType::F16 => half::<f16>(x, w, eps)?,
        dt => return Err(Error::unsupported_dtype("rms_norm", dt)),
    })
}

/// `Op::RmsNormBackward`: inputs `x, w, rstd, g`; outputs `dx`, `dw`.
pub(crate) fn rms_norm_backward(ins: &[Input<'_>]) -> Result<Vec<HostBuffer>> {
    let (x, w, r, g) = (&ins[0], &ins[1], &ins[2], &ins[3]);
    if w.layout.numel() == 0 {
        return Ok(vec![HostBuffer::zeros(x.dtype(), 0), HostBuffer::zeros(w.dtype(), 0)]);
    }
    fn half<T: Elem>(x: &Input<'_>, w: &Input<'_>, r: &Input<'_>, g: &Input<'_>) -> Result<Vec<HostBuffer>> {
        let (dx, dw) =
            backward_typed(&widen_f32::<T>(x)?, &widen_f32::<T>(w)?, &contiguous::<f32>(r)?, &widen_f32::<T>(g)?);
        Ok(vec![buf(narrow_f32::<T>(dx)), buf(narrow_f32::<T>(dw))])
    }
    fn typed<F: NormFloat>(x: &Input<'_>, w: &Input<'_>, r: &Input<'_>, g: &Input<'_>) -> Result<Vec<HostBuffer>> {
        let (dx, dw) =
            backward_typed(&contiguous::<F>(x)?, &contiguous::<F>(w)?, &contiguous::<F>(r)?, &contiguous::<F>(g)?);
        Ok(vec![buf(dx), buf(dw)])
    }
    match x.dtype() {
        DType::F32 => typed::<f32>(x, w, r, g),
        DType::F64 => typed::<f64>(x, w, r, g),
        DType::BF16 => half::<bf16>(x, w, r, g),
        DType::F16 => half::<f16>(x, w, r, g),
        dt => Err(Error::unsupported_dtype("rms_norm_backward", dt)),
    }
}

/// `Op::RmsNorm` on float32 `x` and `w` with `y` rounded once to `out`
/// (float32, bfloat16 or float16) as each task's rows are done: the bits of
/// the float32 op and a cast of `y` (Note \[Folded casts\] in fold.rs).
pub(crate) fn rms_norm_rounded(x: &Input<'_>, w: &Input<'_>, eps: f64, out: DType) -> Result<Vec<HostBuffer>> {
    fn run<O: FloatElem<C = f32>>(x: &[f32], w: &[f32], eps: f64) -> Vec<HostBuffer> {
        let d = w.len();
        let per = rows_per_task(d);
        let mut y = uninit::<O>(x.len());
        let mut rstd = vec![0f32; x.len() / d];
        fork_zip(&mut y, per * d, &mut rstd, per, &|i, y, rstd| {
            let mut yf = vec![0f32; y.len()];
            dispatch(Forward { x: &x[i * per * d..][..y.len()], w, y: &mut yf, rstd, eps: eps as f32 });
            O::store(&yf, y);
        });
        // SAFETY: the pieces `fork_zip` hands out cover `y`, and `store` wrote each whole.
        vec![buf(unsafe { assume_init(y) }), buf(rstd)]
    }
    const OP: &str = "rms_norm (rounded)";
    for t in [x, w] {
        if t.dtype() != DType::F32 {
            return Err(Error::unsupported_dtype(OP, t.dtype()));
        }
    }
    if out == DType::F32 {
        return rms_norm(x, w, eps);
    }
    if w.layout.numel() == 0 {
        let mut ys = rms_norm(x, w, eps)?;
        ys[0] = HostBuffer::zeros(out, 0);
        return Ok(ys);
    }
    let (xs, ws) = (contiguous::<f32>(x)?, contiguous::<f32>(w)?);
    Ok(match out {
        DType::BF16 => run::<bf16>(&xs, &ws, eps),
        DType::F16 => run::<f16>(&xs, &ws, eps),
        dt => return Err(Error::unsupported_dtype(OP, dt)),
    })
}
