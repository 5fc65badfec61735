//! Rotary position embedding (`Op::Rotary`), fused: `x * cos + rotate_half(x) *
//! sin` in one pass over `x`, where `rotate_half(x) = cat(-x[.., d/2:],
//! x[.., :d/2])`. Every product and the sum round in the element type, as the
//! unfused ops do, so half-precision results are the same bits.
use super::copy::materialize_vec;
use super::elem::{assume_init, uninit, Elem};
use super::iter::par_blocks;
use super::simd::{dispatch, Kernel};
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::{DType, Error, HostBuffer, Result};
use std::mem::MaybeUninit;

fn run<T: Elem>(x: &Input<'_>, cos: &Input<'_>, sin: &Input<'_>) -> Result<Vec<T>> {
    let shape = x.layout.shape();
    let n = shape.len();
    let (t, d) = (shape[n - 2], shape[n - 1]);
    if d % 2 != 0 {
        return Err(Error::shape("rotary_embedding", format!("the last dim must be even, got {d}")));
    }
    let (cos, sin) = (materialize_vec::<T>(cos)?, materialize_vec::<T>(sin)?);
    let xs = x.slice::<T>()?;
    let (strides, off) = (x.layout.strides(), x.layout.offset());
    let dims = &shape[..n - 1];
    let sd = strides[n - 1];
    let mut out = uninit::<T>(x.layout.numel());
    par_blocks(&mut out, (ROWS * d).max(1), 4, &|b, block| {
        dispatch(Rows { xs, off, dims, strides, sd, t, first: b * ROWS, cos: &cos, sin: &sin, out: block });
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
/// sin[h + j]` at the row's position, `x`'s elements `sd` apart; compiled
/// for the CPU's best instruction set (the same operations in the same
/// order on every set: no fused multiply-adds).
struct Rows<'a, T> {
    xs: &'a [T],
    off: usize,
    dims: &'a [usize],
    strides: &'a [usize],
    sd: usize,
    t: usize,
    first: usize,
    cos: &'a [T],
    sin: &'a [T],
    out: &'a mut [MaybeUninit<T>],
}

impl<T: Elem> Kernel for Rows<'_, T> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let Rows { xs, off, dims, strides, sd, t, first, cos, sin, out } = self;
        let d = cos.len() / t.max(1);
        let h = d / 2;
        let minus = T::of_f64(-1.0);
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
                let row = &xs[base..base + d];
                let (x1, x2) = row.split_at(h);
                for j in 0..h {
                    lo[j].write(x1[j].mul_(c[j]).add_(x2[j].mul_(minus).mul_(s[j])));
                    hi[j].write(x2[j].mul_(c[h + j]).add_(x1[j].mul_(s[h + j])));
                }
            } else {
                let at = |j: usize| xs[base + j * sd];
                for j in 0..h {
                    lo[j].write(at(j).mul_(c[j]).add_(at(h + j).mul_(minus).mul_(s[j])));
                    hi[j].write(at(h + j).mul_(c[h + j]).add_(at(j).mul_(s[h + j])));
                }
            }
        }
    }
}

/// `Op::Rotary`: inputs `x [..., T, d]`, `cos [T, d]`, `sin [T, d]` (`d` even).
pub(crate) fn rotary(x: &Input<'_>, cos: &Input<'_>, sin: &Input<'_>) -> Result<HostBuffer> {
    Ok(match x.dtype() {
        DType::F32 => buf(run::<f32>(x, cos, sin)?),
        DType::F64 => buf(run::<f64>(x, cos, sin)?),
        DType::BF16 => buf(run::<bf16>(x, cos, sin)?),
        DType::F16 => buf(run::<f16>(x, cos, sin)?),
        dt => return Err(Error::unsupported_dtype("rotary_embedding", dt)),
    })
}
