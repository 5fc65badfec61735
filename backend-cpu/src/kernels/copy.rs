//! Creation and data movement: full, arange, cast, contiguous copies,
//! `assign` (writing into a strided view) and cat.
use super::elem::{convert, Elem};
use super::iter::{par_chunks, par_ranges_by, tasks_for, Nest};
use super::map::map1;
use super::{buf, Input};
use kiln_tensor::{with_dtype, DType, Error, HostBuffer, HostElement, Layout, Meta, Result, Scalar};

/// A scalar converted with PyTorch's rules (through f32 into bf16/f16, truncating into integers).
fn scalar_to<T: Elem>(v: Scalar) -> T {
    match v {
        Scalar::Bool(b) => T::of_bool(b),
        Scalar::Int(i) => T::of_i64(i),
        Scalar::Float(f) => T::of_f64(f),
    }
}

/// A buffer of `numel(shape)` copies of `value`.
pub(crate) fn full(shape: &[usize], value: Scalar, dtype: DType) -> HostBuffer {
    with_dtype!(dtype, T => {
        let v: T = scalar_to(value);
        let mut out = T::zeros(kiln_tensor::numel(shape));
        // `zeros` already holds +0 (false): fill only other values (-0.0 included).
        let is_zero = match value {
            Scalar::Bool(b) => !b,
            Scalar::Int(i) => i == 0,
            Scalar::Float(f) => f.to_bits() == 0,
        };
        if !is_zero {
            par_chunks(&mut out, 1, &|_, c| c.fill(v));
        }
        buf(out)
    })
}

/// `start + i * step` for `i in 0..len`, computed in f64 and converted once.
pub(crate) fn arange(start: f64, step: f64, len: usize, dtype: DType) -> HostBuffer {
    with_dtype!(dtype, T => {
        let mut out = T::zeros(len);
        par_chunks(&mut out, 1, &|s, c| {
            for (i, o) in c.iter_mut().enumerate() {
                *o = T::of_f64(start + step * (s + i) as f64);
            }
        });
        buf(out)
    })
}

/// `x.to(dtype)`.
pub(crate) fn cast(x: &Input<'_>, to: DType) -> Result<HostBuffer> {
    if x.dtype() == to {
        return materialize(x);
    }
    with_dtype!(x.dtype(), S => with_dtype!(to, D => Ok(buf(map1::<S, D>(x, 1, convert::<S, D>)?))))
}

/// A contiguous row-major copy of a strided input.
pub(crate) fn materialize(x: &Input<'_>) -> Result<HostBuffer> {
    with_dtype!(x.dtype(), T => Ok(buf(materialize_vec::<T>(x)?)))
}

/// A contiguous row-major copy of a strided input, typed.
pub(crate) fn materialize_vec<T: Elem>(x: &Input<'_>) -> Result<Vec<T>> {
    map1::<T, T>(x, 1, |v| v)
}

/// The elements of `x` in row-major order: borrowed when already contiguous,
/// else a copy.
pub(crate) fn contiguous<'a, T: Elem>(x: &Input<'a>) -> Result<std::borrow::Cow<'a, [T]>> {
    let l = x.layout;
    if l.is_contiguous() {
        Ok(std::borrow::Cow::Borrowed(&x.slice::<T>()?[l.offset()..l.offset() + l.numel()]))
    } else {
        Ok(std::borrow::Cow::Owned(materialize_vec::<T>(x)?))
    }
}

/// The elements of `x` (bf16, f16) in row-major order, widened to f32 (exactly).
pub(crate) fn widen_f32<T: Elem>(x: &Input<'_>) -> Result<Vec<f32>> {
    super::map::map1::<T, f32>(x, 1, |v| v.cast_f32())
}

/// f32 results rounded once into `T` (split across threads when large).
pub(crate) fn narrow_f32<T: Elem>(v: Vec<f32>) -> Vec<T> {
    if v.len() < super::iter::PAR_MIN {
        return v.into_iter().map(T::of_f32).collect();
    }
    let mut out = vec![T::of_f32(0.0); v.len()];
    super::iter::fork_chunks(&mut out, super::iter::PAR_MIN, 1, &|i, o| {
        for (o, &s) in o.iter_mut().zip(&v[i * super::iter::PAR_MIN..]) {
            *o = T::of_f32(s);
        }
    });
    out
}

/// Writes `src` (same shape and dtype) into `dst` through `dst_layout`.
pub(crate) fn assign(dst: &mut HostBuffer, dst_layout: &Layout, src: &Input<'_>) -> Result<()> {
    if dst.dtype() != src.dtype() || dst_layout.shape() != src.layout.shape() {
        return Err(Error::invalid(
            "assign",
            format!(
                "needs equal shapes and dtypes, got {:?} {} and {:?} {}",
                dst_layout.shape(),
                dst.dtype(),
                src.layout.shape(),
                src.dtype()
            ),
        ));
    }
    with_dtype!(dst.dtype(), T => {
        let d = <T as HostElement>::slice_mut(dst).ok_or_else(|| Error::backend("cpu", "assign: destination dtype mismatch"))?;
        copy_into(d, dst_layout, src.slice::<T>()?, src.layout)
    })
}

/// `Op::Assign` out of place: a contiguous copy of `base` with `src` written at
/// the positions `view` selects (in `base`'s row-major element indices).
pub(crate) fn assign_out_of_place(base: &Input<'_>, view: &Layout, src: &Input<'_>) -> Result<HostBuffer> {
    let mut out = materialize(base)?;
    assign(&mut out, view, src)?;
    Ok(out)
}

/// A raw pointer that tasks of one parallel copy share; see the SAFETY notes where it is written through.
#[derive(Clone, Copy)]
struct SharedMut<T>(*mut T);
// SAFETY: the pointer is only written through in `copy_into`, where every task writes a disjoint
// set of elements of a buffer that is exclusively borrowed for the whole parallel section.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above: sharing the pointer between tasks never lets two of them touch one element.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the `Sync` wrapper rather than the raw field).
    fn get(self) -> *mut T {
        self.0
    }
}

/// Copies the elements `sl` views in `src` into the elements `dl` views in `dst`
/// (equal shapes), in row-major order. Large copies into a destination layout
/// without internal overlap run in parallel.
pub(crate) fn copy_into<T: Elem>(dst: &mut [T], dl: &Layout, src: &[T], sl: &Layout) -> Result<()> {
    if dl.shape() != sl.shape() {
        return Err(Error::backend("cpu", format!("copy between shapes {:?} and {:?}", dl.shape(), sl.shape())));
    }
    dl.check_bounds("copy", dst.len())?;
    sl.check_bounds("copy", src.len())?;
    let nest = Nest::new(dl.shape(), [dl.strides(), sl.strides()], [dl.offset(), sl.offset()]);
    let n = nest.numel();
    let [ds, ss] = nest.inner_strides();
    let band = nest.tile_band();
    if tasks_for(n, 1) <= 1 || dl.has_internal_overlap() {
        nest.walk(0, n, band.is_some(), |[d, s], len| match (ds, ss) {
            (1, 1) => dst[d..d + len].copy_from_slice(&src[s..s + len]),
            (1, 0) => dst[d..d + len].fill(src[s]),
            (ds, ss) => {
                for j in 0..len {
                    dst[d + j * ds] = src[s + j * ss];
                }
            }
        });
        return Ok(());
    }
    let ptr = SharedMut(dst.as_mut_ptr());
    par_ranges_by(n, 1, band.unwrap_or(1), &|a, b| {
        nest.walk(a, b, band.is_some(), |[d, s], len| {
            if (ds, ss) == (1, 1) {
                // SAFETY: `d + len <= dl.storage_extent() <= dst.len()` and `s + len <= src.len()`
                // (both layouts were bounds-checked above); `src` and `dst` are distinct borrows so
                // they cannot overlap; and `dl` has no internal overlap, so the row-major ranges
                // handed to different tasks address disjoint elements of `dst`: no other task
                // reads or writes `dst[d..d + len]` while this copy runs.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(s), ptr.get().add(d), len) };
            } else {
                for j in 0..len {
                    let v = src[s + j * ss];
                    // SAFETY: `d + j * ds < dl.storage_extent() <= dst.len()` (bounds-checked above),
                    // and, `dl` having no internal overlap, this element belongs to this task's
                    // row-major range only, so no other task accesses it concurrently.
                    unsafe { ptr.get().add(d + j * ds).write(v) };
                }
            }
        });
    });
    Ok(())
}

/// Concatenation along `dim`: each input is copied into its slab of the output.
pub(crate) fn cat(ins: &[Input<'_>], dim: usize, out: &Meta) -> Result<HostBuffer> {
    let dtype = out.dtype;
    let full = Layout::contiguous(&out.shape);
    with_dtype!(dtype, T => {
        let mut o = T::zeros(full.numel());
        let mut start = 0;
        for x in ins {
            let size = x.layout.shape().get(dim).copied().unwrap_or(1);
            if size == 0 {
                continue;
            }
            let slab = full.slice(dim, start, start + size, 1);
            copy_into(&mut o, &slab, x.slice::<T>()?, x.layout)?;
            start += size;
        }
        Ok(buf(o))
    })
}
