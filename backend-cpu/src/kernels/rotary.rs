//! Rotary position embedding (`Op::Rotary`), fused: `x * cos + rotate_half(x) *
//! sin` in one pass over `x`, where `rotate_half(x) = cat(-x[.., d/2:],
//! x[.., :d/2])`. Every product and the sum round in the element type, as the
//! unfused ops do, so half-precision results are the same bits. `widened` is
//! the float32 computation on a narrower `x`, its result rounded once
//! (Note \[Folded casts\] in fold.rs).
use super::copy::materialize_vec;
use super::elem::{assume_init, bf16_to_f32, f32_to_bf16, uninit, Elem};
use super::iter::par_blocks;
use super::simd::{dispatch, Kernel};
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::{DType, Error, HostBuffer, Result};
use std::mem::MaybeUninit;

/// How a row's elements enter the type it is computed in (`C`) and its
/// results leave it: exactly, or rounded once to a narrower type.
trait Convert<C>: Copy {
    fn into_c(self) -> C;
    fn from_c(c: C) -> Self;
}

impl<T: Elem> Convert<T> for T {
    #[inline(always)]
    fn into_c(self) -> T {
        self
    }
    #[inline(always)]
    fn from_c(c: T) -> T {
        c
    }
}

impl Convert<f32> for bf16 {
    #[inline(always)]
    fn into_c(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn from_c(c: f32) -> bf16 {
        f32_to_bf16(c)
    }
}

impl Convert<f32> for f16 {
    #[inline(always)]
    fn into_c(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_c(c: f32) -> f16 {
        f16::from_f32(c)
    }
}

/// The rotation of `x` (of `I`) computed in `C` with tables of `C`, results in `O`.
fn run<I: Elem + Convert<C>, C: Elem, O: Elem + Convert<C>>(
    x: &Input<'_>,
    cos: &Input<'_>,
    sin: &Input<'_>,
) -> Result<Vec<O>> {
    let shape = x.layout.shape();
    let n = shape.len();
    let (t, d) = (shape[n - 2], shape[n - 1]);
    if d % 2 != 0 {
        return Err(Error::shape("rotary_embedding", format!("the last dim must be even, got {d}")));
    }
    let (cos, sin) = (materialize_vec::<C>(cos)?, materialize_vec::<C>(sin)?);
    let xs = x.slice::<I>()?;
    let (strides, off) = (x.layout.strides(), x.layout.offset());
    let dims = &shape[..n - 1];
    let sd = strides[n - 1];
    let mut out = uninit::<O>(x.layout.numel());
    par_blocks(&mut out, (ROWS * d).max(1), 4, &|b, block| {
        dispatch(Rows::<I, C, O> { xs, off, dims, strides, sd, t, first: b * ROWS, cos: &cos, sin: &sin, out: block });
    });
    // SAFETY: `par_blocks` hands every element of `out` to exactly one block
    // (with `d == 0` there are none), and `Rows` writes all `d` elements of
    // each of its rows (`d` is even: h + h of them).
    Ok(unsafe { assume_init(out) })
}

/// Rows per task's block (one dispatch each).
const ROWS: usize = 64;

/// Rows `first..` of the output (`out`, whole rows of `d`): `out[j] = x[j]
/// cos[j] - x[h + j] sin[j]` and `out[h + j] = x[h + j] cos[h + j] + x[j]
/// sin[h + j]` at the row's position, `x`'s elements `sd` apart, computed in
/// `C`; compiled for the CPU's best instruction set (the same operations in
/// the same order on every set: no fused multiply-adds).
struct Rows<'a, I, C, O> {
    xs: &'a [I],
    off: usize,
    dims: &'a [usize],
    strides: &'a [usize],
    sd: usize,
    t: usize,
    first: usize,
    cos: &'a [C],
    sin: &'a [C],
    out: &'a mut [MaybeUninit<O>],
}

impl<I: Convert<C>, C: Elem, O: Convert<C>> Kernel for Rows<'_, I, C, O> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let Rows { xs, off, dims, strides, sd, t, first, cos, sin, out } = self;
        let d = cos.len() / t.max(1);
        let h = d / 2;
        let minus = C::of_f64(-1.0);
        let (x_in, out_of) = (|v: I| v.into_c(), |c: C| O::from_c(c));
        for (i, orow) in out.chunks_exact_mut(d).enumerate() {
            let r = first + i;
            // Storage offset of row `r` (row-major over all dims but the last).
            let (mut rest, mut base) = (r, off);
            for (&len, &st) in dims.iter().zip(strides).rev() {
                base += (rest % len) * st;
                rest /= len;
            }
            let pos = r % t;
            let (c, s) = (&cos[pos * d..][..d], &sin[pos * d..][..d]);
            let (lo, hi) = orow.split_at_mut(h);
            if sd == 1 {
                // Every slice exactly `h` long, so the loop has no bounds checks and vectorises.
                let (x1, x2) = (&xs[base..][..h], &xs[base + h..][..h]);
                let (c1, c2, s1, s2) = (&c[..h], &c[h..][..h], &s[..h], &s[h..][..h]);
                let (lo, hi) = (&mut lo[..h], &mut hi[..h]);
                for j in 0..h {
                    let (a, b) = (x_in(x1[j]), x_in(x2[j]));
                    lo[j].write(out_of(a.mul_(c1[j]).add_(b.mul_(minus).mul_(s1[j]))));
                    hi[j].write(out_of(b.mul_(c2[j]).add_(a.mul_(s2[j]))));
                }
            } else {
                let at = |j: usize| x_in(xs[base + j * sd]);
                for j in 0..h {
                    lo[j].write(out_of(at(j).mul_(c[j]).add_(at(h + j).mul_(minus).mul_(s[j]))));
                    hi[j].write(out_of(at(h + j).mul_(c[h + j]).add_(at(j).mul_(s[h + j]))));
                }
            }
        }
    }
}

/// `Op::Rotary`: inputs `x [..., T, d]`, `cos [T, d]`, `sin [T, d]` (`d` even).
pub(crate) fn rotary(x: &Input<'_>, cos: &Input<'_>, sin: &Input<'_>) -> Result<HostBuffer> {
    Ok(match x.dtype() {
        DType::F32 => buf(run::<f32, f32, f32>(x, cos, sin)?),
        DType::F64 => buf(run::<f64, f64, f64>(x, cos, sin)?),
        DType::BF16 => buf(run::<bf16, bf16, bf16>(x, cos, sin)?),
        DType::F16 => buf(run::<f16, f16, f16>(x, cos, sin)?),
        dt => return Err(Error::unsupported_dtype("rotary_embedding", dt)),
    })
}

/// The float32 rotation (`Op::Rotary` on float32 `x`, `cos`, `sin`) of an
/// `x` of float32, bfloat16 or float16 widened exactly, its results rounded
/// once to `out` (any of the three): the bits of casting `x` to float32,
/// rotating, and casting the result to `out` (Note \[Folded casts\] in fold.rs).
pub(crate) fn widened(x: &Input<'_>, cos: &Input<'_>, sin: &Input<'_>, out: DType) -> Result<HostBuffer> {
    for t in [cos, sin] {
        if t.dtype() != DType::F32 {
            return Err(Error::unsupported_dtype("rotary_embedding (widened)", t.dtype()));
        }
    }
    macro_rules! to {
        ($i:ty) => {
            match out {
                DType::F32 => buf(run::<$i, f32, f32>(x, cos, sin)?),
                DType::BF16 => buf(run::<$i, f32, bf16>(x, cos, sin)?),
                DType::F16 => buf(run::<$i, f32, f16>(x, cos, sin)?),
                dt => return Err(Error::unsupported_dtype("rotary_embedding (widened)", dt)),
            }
        };
    }
    Ok(match x.dtype() {
        DType::F32 => to!(f32),
        DType::BF16 => to!(bf16),
        DType::F16 => to!(f16),
        dt => return Err(Error::unsupported_dtype("rotary_embedding (widened)", dt)),
    })
}
