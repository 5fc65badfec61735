//! Elementwise engines: walk strided inputs in the row-major order of a fresh
//! contiguous output, hand contiguous / broadcast / strided runs to tight loops,
//! and split large outputs across threads.
//!
//! `map1`..`map3` apply a per-element closure (LLVM vectorises the contiguous
//! runs); `fmap` hands float kernels whole slices in their compute type (f32 or
//! f64), staging strided, broadcast or 16-bit operands through small buffers.
use super::elem::{assume_init, uninit, Compute, Elem, FloatElem};
use super::iter::{par_chunks_by, Nest};
use super::simd::{dispatch, Kernel};
use super::Input;
use kiln_tensor::{contiguous_strides, Result};
use std::mem::MaybeUninit;

/// Elements staged per operand when a run cannot be handed over as a slice.
const STAGE: usize = 512;

/// A fresh output of `n` elements, filled chunk by chunk (in parallel when the
/// work is large, as `par_chunks_by` splits it) by `fill(start, chunk)`, which
/// walks its chunk's runs, writes every element of each and returns the total
/// length of the runs it wrote (Note [Uninitialised outputs]).
fn filled<O: Send>(
    n: usize,
    cost: usize,
    granule: usize,
    fill: &(dyn Fn(usize, &mut [MaybeUninit<O>]) -> usize + Sync),
) -> Vec<O> {
    let mut out = uninit::<O>(n);
    par_chunks_by(&mut out, cost, granule, &|start, chunk| {
        let written = fill(start, chunk);
        assert_eq!(written, chunk.len(), "an elementwise kernel wrote {written} of its {} outputs", chunk.len());
    });
    // SAFETY: `par_chunks_by` hands each element of `out` to exactly one chunk, and
    // `fill` wrote every element of the runs it walked, which `Nest::walk` keeps
    // inside the chunk and disjoint (in order, or tile by tile): as their lengths
    // add up to the chunk's (asserted above), they cover it, so every element is
    // initialised.
    unsafe { assume_init(out) }
}

/// `out[i] = f(a[i])`.
pub(crate) fn map1<A: Elem, O: Elem>(a: &Input<'_>, cost: usize, f: impl Fn(A) -> O + Sync) -> Result<Vec<O>> {
    let av = a.slice::<A>()?;
    let l = a.layout;
    let cs = contiguous_strides(l.shape());
    let nest = Nest::new(l.shape(), [&cs, l.strides()], [0, l.offset()]);
    let [_, sa] = nest.inner_strides();
    let band = nest.tile_band();
    Ok(filled(nest.numel(), cost, band.unwrap_or(16), &|start, chunk| {
        let mut written = 0;
        nest.walk(start, start + chunk.len(), band.is_some(), |[o, ia], len| {
            written += len;
            let dst = &mut chunk[o - start..o - start + len];
            match sa {
                1 => dispatch(Contiguous1 { dst, src: &av[ia..ia + len], f: &f }),
                0 => dst.fill(MaybeUninit::new(f(av[ia]))),
                s => {
                    for (j, d) in dst.iter_mut().enumerate() {
                        d.write(f(av[ia + j * s]));
                    }
                }
            }
        });
        written
    }))
}

/// A contiguous run of `map1`, compiled for the CPU's best instruction set
/// (casts and copies vectorise 16 lanes wide with AVX-512, not 4).
struct Contiguous1<'a, A, O, F> {
    dst: &'a mut [MaybeUninit<O>],
    src: &'a [A],
    f: &'a F,
}

impl<A: Copy, O, F: Fn(A) -> O> Kernel for Contiguous1<'_, A, O, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        for (d, &x) in self.dst.iter_mut().zip(self.src) {
            d.write((self.f)(x));
        }
    }
}

/// `out[i] = f(a[i], b[i])` (equal shapes).
pub(crate) fn map2<A: Elem, B: Elem, O: Elem>(
    a: &Input<'_>,
    b: &Input<'_>,
    cost: usize,
    f: impl Fn(A, B) -> O + Sync,
) -> Result<Vec<O>> {
    let (av, bv) = (a.slice::<A>()?, b.slice::<B>()?);
    let (la, lb) = (a.layout, b.layout);
    let cs = contiguous_strides(la.shape());
    let nest = Nest::new(la.shape(), [&cs, la.strides(), lb.strides()], [0, la.offset(), lb.offset()]);
    let [_, sa, sb] = nest.inner_strides();
    let band = nest.tile_band();
    Ok(filled(nest.numel(), cost, band.unwrap_or(16), &|start, chunk| {
        let mut written = 0;
        nest.walk(start, start + chunk.len(), band.is_some(), |[o, ia, ib], len| {
            written += len;
            let dst = &mut chunk[o - start..o - start + len];
            match (sa, sb) {
                (1, 1) => {
                    for ((d, &x), &y) in dst.iter_mut().zip(&av[ia..ia + len]).zip(&bv[ib..ib + len]) {
                        d.write(f(x, y));
                    }
                }
                (1, 0) => {
                    let y = bv[ib];
                    for (d, &x) in dst.iter_mut().zip(&av[ia..ia + len]) {
                        d.write(f(x, y));
                    }
                }
                (0, 1) => {
                    let x = av[ia];
                    for (d, &y) in dst.iter_mut().zip(&bv[ib..ib + len]) {
                        d.write(f(x, y));
                    }
                }
                (sa, sb) => {
                    for (j, d) in dst.iter_mut().enumerate() {
                        d.write(f(av[ia + j * sa], bv[ib + j * sb]));
                    }
                }
            }
        });
        written
    }))
}

/// `out[i] = f(a[i], b[i], c[i])` (equal shapes).
pub(crate) fn map3<A: Elem, B: Elem, C: Elem, O: Elem>(
    a: &Input<'_>,
    b: &Input<'_>,
    c: &Input<'_>,
    cost: usize,
    f: impl Fn(A, B, C) -> O + Sync,
) -> Result<Vec<O>> {
    let (av, bv, cv) = (a.slice::<A>()?, b.slice::<B>()?, c.slice::<C>()?);
    let (la, lb, lc) = (a.layout, b.layout, c.layout);
    let cs = contiguous_strides(la.shape());
    let nest = Nest::new(
        la.shape(),
        [&cs, la.strides(), lb.strides(), lc.strides()],
        [0, la.offset(), lb.offset(), lc.offset()],
    );
    let [_, sa, sb, sc] = nest.inner_strides();
    let band = nest.tile_band();
    Ok(filled(nest.numel(), cost, band.unwrap_or(16), &|start, chunk| {
        let mut written = 0;
        nest.walk(start, start + chunk.len(), band.is_some(), |[o, ia, ib, ic], len| {
            written += len;
            let dst = &mut chunk[o - start..o - start + len];
            if (sa, sb, sc) == (1, 1, 1) {
                let it = dst.iter_mut().zip(&av[ia..ia + len]).zip(&bv[ib..ib + len]).zip(&cv[ic..ic + len]);
                for (((d, &x), &y), &z) in it {
                    d.write(f(x, y, z));
                }
            } else {
                for (j, d) in dst.iter_mut().enumerate() {
                    d.write(f(av[ia + j * sa], bv[ib + j * sb], cv[ic + j * sc]));
                }
            }
        });
        written
    }))
}

/// A float kernel: `N` input slices and an output slice of one length, in the
/// compute type. It must write every element of the output (Note
/// [Uninitialised outputs]); the kernels of elementwise.rs are `map_unary` and
/// `map_binary`, which assert that their slices have one length.
pub(crate) type FloatKernel<'k, C, const N: usize> = dyn Fn(&[&[C]; N], &mut [MaybeUninit<C>]) + Sync + 'k;

/// Float kernel engine: `kernel(inputs, out)` on slices of the compute type.
///
/// f32/f64 runs whose inputs are all contiguous are handed over in place;
/// otherwise up to `STAGE` elements at a time are gathered (and widened, for
/// bf16/f16) into stack buffers, and results of 16-bit types are rounded once
/// on the way out.
///
/// The kernel is called through `&dyn`: the engine is compiled once per element
/// type and arity rather than once per op, and the indirect call costs nothing
/// next to a run of elements.
pub(crate) fn fmap<T: FloatElem, const N: usize>(
    ins: [&Input<'_>; N],
    cost: usize,
    kernel: &FloatKernel<'_, T::C, N>,
) -> Result<Vec<T>> {
    let vals: [&[T]; N] = {
        let mut v: [&[T]; N] = [&[]; N];
        for k in 0..N {
            v[k] = ins[k].slice::<T>()?;
        }
        v
    };
    let shape = ins[0].layout.shape();
    let cs = contiguous_strides(shape);
    // One operand slot for the output plus up to three inputs; unused slots mirror the output.
    assert!(N <= 3, "fmap takes at most three inputs");
    let strides: [&[usize]; 4] =
        std::array::from_fn(|k| if k == 0 || k > N { &cs[..] } else { ins[k - 1].layout.strides() });
    let offsets: [usize; 4] = std::array::from_fn(|k| if k == 0 || k > N { 0 } else { ins[k - 1].layout.offset() });
    let nest: Nest<4> = Nest::new(shape, strides, offsets);
    let inner = nest.inner_strides();
    let all_unit = (0..N).all(|k| inner[k + 1] == 1);
    let band = nest.tile_band();
    Ok(filled(nest.numel(), cost, band.unwrap_or(16), &|start, chunk| {
        // Staging buffers (one per input, and one for the output), set up on first
        // use only: contiguous f32/f64 runs never need them.
        let cap = chunk.len().min(STAGE);
        let mut stage: Vec<T::C> = Vec::new();
        let mut ostage: Vec<MaybeUninit<T::C>> = Vec::new();
        let mut written = 0;
        nest.walk(start, start + chunk.len(), band.is_some(), |pos, len| {
            written += len;
            let o = pos[0] - start;
            if all_unit {
                if let Some(dst) = T::direct_mut(&mut chunk[o..o + len]) {
                    let srcs: [&[T::C]; N] =
                        std::array::from_fn(|k| T::direct(&vals[k][pos[k + 1]..pos[k + 1] + len]).unwrap_or(&[]));
                    kernel(&srcs, dst);
                    return;
                }
            }
            if ostage.is_empty() {
                stage = vec![<T::C as Compute>::ZERO; N * cap];
                ostage = Box::<[T::C]>::new_uninit_slice(cap).into_vec();
            }
            let bufs: [&mut [T::C]; N] = {
                let mut rest = &mut stage[..];
                std::array::from_fn(|_| {
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(cap);
                    rest = tail;
                    head
                })
            };
            let mut done = 0;
            while done < len {
                let m = (len - done).min(cap);
                let mut direct = [false; N];
                for k in 0..N {
                    let (base, s) = (pos[k + 1] + done * inner[k + 1], inner[k + 1]);
                    let v = vals[k];
                    match s {
                        1 if T::DIRECT => direct[k] = true,
                        1 => T::load(&v[base..base + m], &mut bufs[k][..m]),
                        0 => bufs[k][..m].fill(v[base].to_c()),
                        s => {
                            for (j, b) in bufs[k][..m].iter_mut().enumerate() {
                                *b = v[base + j * s].to_c();
                            }
                        }
                    }
                }
                let mut srcs: [&[T::C]; N] = [&[]; N];
                for (k, src) in srcs.iter_mut().enumerate() {
                    *src = if direct[k] {
                        let base = pos[k + 1] + done;
                        T::direct(&vals[k][base..base + m]).unwrap_or(&[])
                    } else {
                        &bufs[k][..m]
                    };
                }
                let dst = &mut chunk[o + done..o + done + m];
                match T::direct_mut(dst) {
                    Some(d) => kernel(&srcs, d),
                    None => {
                        let obuf = &mut ostage[..m];
                        kernel(&srcs, obuf);
                        // SAFETY: the kernel wrote all `m` elements of `obuf` (FloatKernel's
                        // contract), and `MaybeUninit<T::C>` has `T::C`'s layout.
                        let obuf = unsafe { std::slice::from_raw_parts(obuf.as_ptr().cast::<T::C>(), m) };
                        T::store(obuf, dst);
                    }
                }
                done += m;
            }
        });
        written
    }))
}
