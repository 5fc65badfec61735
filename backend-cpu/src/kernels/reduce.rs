//! Reductions over dims (sum, mean, prod, amax, amin, any, all), arg-reductions
//! (argmax, argmin) and cumsum.
//!
//! A reduction splits the input's dims into kept and reduced ones (each set
//! merged where strides allow). When the reduced elements of one output are
//! contiguous, each output folds a slice with several independent accumulators
//! (vectorised); when the kept dims are the contiguous ones (a reduction over a
//! leading dim), rows are accumulated into a block of outputs at once.
use super::copy::materialize_vec;
use super::elem::{bf16_to_f32, f32_to_bf16, Acc, Elem, Kind};
use super::iter::{par_blocks, par_chunks, par_ranges, tasks_for, threads, Nest};
use super::map::map1;
use super::simd::{dispatch, Kernel};
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::{
    contiguous_strides, numel, with_dtype, ArgReduceOp, DType, Error, HostBuffer, Layout, Meta, ReduceOp, Result, Shape,
};
use smallvec::SmallVec;
use std::marker::PhantomData;

/// One reduction: how to start, take an element, merge partial results and finish.
pub(crate) trait Reducer: Copy + Send + Sync {
    type In: FoldElem;
    type Acc: Copy + Send + Sync;
    type Out: Elem;
    fn init(self) -> Self::Acc;
    fn step(self, acc: Self::Acc, x: Self::In) -> Self::Acc;
    fn combine(self, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// The output of an accumulator over `n` elements.
    fn finish(self, acc: Self::Acc, n: usize) -> Self::Out;
}

macro_rules! reducer_struct {
    ($($name:ident<$($p:ident),*>),*) => {$(
        struct $name<$($p),*>(PhantomData<fn() -> ($($p,)*)>);
        impl<$($p),*> Clone for $name<$($p),*> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<$($p),*> Copy for $name<$($p),*> {}
        impl<$($p),*> $name<$($p),*> {
            fn new() -> Self {
                $name(PhantomData)
            }
        }
    )*};
}
reducer_struct!(ProdR<T, O>, MaxR<T>, MinR<T>, AnyR<T>, AllR<T>);

/// Sum in the accumulation type (f32 for f32/bf16/f16, f64, i64 for integers and
/// bool), rounded once; with `mean`, divided by the count first (in the
/// accumulation type: PyTorch's `sum(dtype=float32).div_(n)` for bf16/f16).
struct SumR<T, O> {
    mean: bool,
    _t: PhantomData<fn() -> (T, O)>,
}
impl<T, O> Clone for SumR<T, O> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T, O> Copy for SumR<T, O> {}
impl<T, O> SumR<T, O> {
    fn new(mean: bool) -> Self {
        SumR { mean, _t: PhantomData }
    }
}

impl<T: FoldElem, O: Elem> Reducer for SumR<T, O> {
    type In = T;
    type Acc = T::Acc;
    type Out = O;
    #[inline(always)]
    fn init(self) -> T::Acc {
        T::Acc::ZERO
    }
    #[inline(always)]
    fn step(self, acc: T::Acc, x: T) -> T::Acc {
        acc.add(x.to_acc())
    }
    #[inline(always)]
    fn combine(self, a: T::Acc, b: T::Acc) -> T::Acc {
        a.add(b)
    }
    #[inline(always)]
    fn finish(self, acc: T::Acc, n: usize) -> O {
        if self.mean {
            acc.div_count(n).to_out()
        } else {
            acc.to_out()
        }
    }
}

impl<T: FoldElem, O: Elem> Reducer for ProdR<T, O> {
    type In = T;
    type Acc = T::Acc;
    type Out = O;
    #[inline(always)]
    fn init(self) -> T::Acc {
        T::Acc::ONE
    }
    #[inline(always)]
    fn step(self, acc: T::Acc, x: T) -> T::Acc {
        acc.mul(x.to_acc())
    }
    #[inline(always)]
    fn combine(self, a: T::Acc, b: T::Acc) -> T::Acc {
        a.mul(b)
    }
    #[inline(always)]
    fn finish(self, acc: T::Acc, _: usize) -> O {
        acc.to_out()
    }
}

/// NaN-propagating max, in the (exact) accumulation type.
impl<T: FoldElem> Reducer for MaxR<T> {
    type In = T;
    type Acc = T::Acc;
    type Out = T;
    #[inline(always)]
    fn init(self) -> T::Acc {
        T::Acc::LOWEST
    }
    #[inline(always)]
    fn step(self, acc: T::Acc, x: T) -> T::Acc {
        self.combine(acc, x.to_acc())
    }
    #[inline(always)]
    fn combine(self, a: T::Acc, b: T::Acc) -> T::Acc {
        if b > a || b.nan() {
            b
        } else {
            a
        }
    }
    #[inline(always)]
    fn finish(self, acc: T::Acc, _: usize) -> T {
        acc.to_out()
    }
}

/// NaN-propagating min.
impl<T: FoldElem> Reducer for MinR<T> {
    type In = T;
    type Acc = T::Acc;
    type Out = T;
    #[inline(always)]
    fn init(self) -> T::Acc {
        T::Acc::HIGHEST
    }
    #[inline(always)]
    fn step(self, acc: T::Acc, x: T) -> T::Acc {
        self.combine(acc, x.to_acc())
    }
    #[inline(always)]
    fn combine(self, a: T::Acc, b: T::Acc) -> T::Acc {
        if b < a || b.nan() {
            b
        } else {
            a
        }
    }
    #[inline(always)]
    fn finish(self, acc: T::Acc, _: usize) -> T {
        acc.to_out()
    }
}

impl<T: FoldElem> Reducer for AnyR<T> {
    type In = T;
    type Acc = bool;
    type Out = bool;
    #[inline(always)]
    fn init(self) -> bool {
        false
    }
    #[inline(always)]
    fn step(self, acc: bool, x: T) -> bool {
        acc | x.truthy()
    }
    #[inline(always)]
    fn combine(self, a: bool, b: bool) -> bool {
        a | b
    }
    #[inline(always)]
    fn finish(self, acc: bool, _: usize) -> bool {
        acc
    }
}

impl<T: FoldElem> Reducer for AllR<T> {
    type In = T;
    type Acc = bool;
    type Out = bool;
    #[inline(always)]
    fn init(self) -> bool {
        true
    }
    #[inline(always)]
    fn step(self, acc: bool, x: T) -> bool {
        acc & x.truthy()
    }
    #[inline(always)]
    fn combine(self, a: bool, b: bool) -> bool {
        a & b
    }
    #[inline(always)]
    fn finish(self, acc: bool, _: usize) -> bool {
        acc
    }
}

/// Folds a contiguous slice into `acc` with 64 independent accumulators (four
/// AVX-512 vectors of f32: the loop vectorises, and four dependency chains hide
/// the latency of each step, which matters for max/min's compare-and-select),
/// in blocks of 4096 elements whose partial results are then combined (a
/// two-level cascade that keeps float sums accurate).
struct Fold<'a, R: Reducer> {
    r: R,
    acc: R::Acc,
    xs: &'a [R::In],
}

impl<R: Reducer> Kernel for Fold<'_, R> {
    type Out = R::Acc;
    #[inline(always)]
    fn run<const FMA: bool>(self) -> R::Acc {
        const LANES: usize = 64;
        let r = self.r;
        let mut acc = self.acc;
        for block in self.xs.chunks(4096) {
            let mut lanes = [r.init(); LANES];
            // Four rows of lanes per pass: `lanes` lives in memory (LLVM keeps an
            // array it indexes in a loop there), so each pass loads and stores it
            // once for four steps instead of once per step. Lane i still takes
            // elements i, i + 64, i + 128, ... in order: the same sums as one row at a time.
            let mut quad = block.chunks_exact(4 * LANES);
            for c in &mut quad {
                let c: &[R::In; 4 * LANES] = c.try_into().expect("chunks_exact yields 4 * LANES elements");
                for i in 0..LANES {
                    let mut a = lanes[i];
                    for u in 0..4 {
                        a = r.step(a, c[u * LANES + i]);
                    }
                    lanes[i] = a;
                }
            }
            let mut it = quad.remainder().chunks_exact(LANES);
            for c in &mut it {
                // A fixed-size array, so the lane loop compiles to whole vectors.
                let c: &[R::In; LANES] = c.try_into().expect("chunks_exact yields LANES elements");
                for i in 0..LANES {
                    lanes[i] = r.step(lanes[i], c[i]);
                }
            }
            for (i, &x) in it.remainder().iter().enumerate() {
                lanes[i] = r.step(lanes[i], x);
            }
            let mut w = LANES;
            while w > 1 {
                w /= 2;
                for i in 0..w {
                    lanes[i] = r.combine(lanes[i], lanes[i + w]);
                }
            }
            acc = r.combine(acc, lanes[0]);
        }
        acc
    }
}

/// `accs[j] = step(accs[j], xs[j])`: one row into a block of outputs.
struct RowFold<'a, R: Reducer> {
    r: R,
    accs: &'a mut [R::Acc],
    xs: &'a [R::In],
}

impl<R: Reducer> Kernel for RowFold<'_, R> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let r = self.r;
        for (a, &x) in self.accs.iter_mut().zip(self.xs) {
            *a = r.step(*a, x);
        }
    }
}

/// How an element type runs the fold loops: the float types pick the instruction
/// set at run time (their loops are the hot ones); the others use baseline code,
/// which keeps the number of compiled copies down.
pub(crate) trait FoldElem: Elem {
    #[inline]
    fn fold<R: Reducer<In = Self>>(r: R, acc: R::Acc, xs: &[Self]) -> R::Acc {
        Fold { r, acc, xs }.run::<false>()
    }
    #[inline]
    fn row_fold<R: Reducer<In = Self>>(r: R, accs: &mut [R::Acc], xs: &[Self]) {
        RowFold { r, accs, xs }.run::<false>()
    }
}
macro_rules! fold_baseline {
    ($($t:ty),*) => {$(impl FoldElem for $t {})*};
}
fold_baseline!(bool, u8, i8, i16, i32, i64, f16);
macro_rules! fold_dispatch {
    ($($t:ty),*) => {$(
        impl FoldElem for $t {
            #[inline]
            fn fold<R: Reducer<In = Self>>(r: R, acc: R::Acc, xs: &[Self]) -> R::Acc {
                dispatch(Fold { r, acc, xs })
            }
            #[inline]
            fn row_fold<R: Reducer<In = Self>>(r: R, accs: &mut [R::Acc], xs: &[Self]) {
                dispatch(RowFold { r, accs, xs })
            }
        }
    )*};
}
fold_dispatch!(f32, f64, bf16);

/// Outputs per block of the row-accumulating strategy.
const ROW_BLOCK: usize = 256;

/// Reduces `x` over `dims` with `r`; the output is contiguous over the kept dims.
fn run<R: Reducer>(r: R, x: &Input<'_>, dims: &[usize]) -> Result<Vec<R::Out>> {
    let xv = x.slice::<R::In>()?;
    let l = x.layout;
    let (shape, strides) = (l.shape(), l.strides());
    let (mut kshape, mut kstr) = (Shape::new(), Shape::new());
    let mut red: SmallVec<[(usize, usize); 6]> = SmallVec::new();
    for d in 0..shape.len() {
        if dims.contains(&d) {
            red.push((shape[d], strides[d]));
        } else {
            kshape.push(shape[d]);
            kstr.push(strides[d]);
        }
    }
    // Reduction order is free: put the smallest stride innermost.
    red.sort_by_key(|d| std::cmp::Reverse(d.1));
    let rshape: Shape = red.iter().map(|d| d.0).collect();
    let rstr: Shape = red.iter().map(|d| d.1).collect();
    let (n_out, n_red) = (numel(&kshape), numel(&rshape));
    let mut out = R::Out::zeros(n_out);
    if n_out == 0 {
        return Ok(out);
    }
    if n_red == 0 {
        out.fill(r.finish(r.init(), 0));
        return Ok(out);
    }
    let kcs = contiguous_strides(&kshape);
    let knest = Nest::new(&kshape, [&kcs[..], &kstr[..]], [0, l.offset()]);
    let rnest = Nest::new(&rshape, [&rstr[..]], [0]);
    let [_, kin] = knest.inner_strides();
    let [rin] = rnest.inner_strides();

    let fold_range = |base: usize, start: usize, end: usize| -> R::Acc {
        let mut acc = r.init();
        rnest.for_each_run(start, end, |[o], len| {
            let s = base + o;
            acc = if rin == 1 || len == 1 {
                R::In::fold(r, acc, &xv[s..s + len])
            } else {
                (0..len).fold(acc, |a, j| r.step(a, xv[s + j * rin]))
            };
        });
        acc
    };

    if kin == 1 && rin != 1 && knest.inner_len() > 1 {
        // The kept dims are contiguous: accumulate whole rows into blocks of outputs.
        par_chunks(&mut out, n_red, &|start, chunk| {
            knest.for_each_run(start, start + chunk.len(), |[o, xb], len| {
                let mut blk = 0;
                while blk < len {
                    let w = (len - blk).min(ROW_BLOCK);
                    let mut accs = [r.init(); ROW_BLOCK];
                    rnest.for_each_run(0, n_red, |[ro], rlen| {
                        for t in 0..rlen {
                            let s = xb + blk + ro + t * rin;
                            R::In::row_fold(r, &mut accs[..w], &xv[s..s + w]);
                        }
                    });
                    let dst = &mut chunk[o - start + blk..o - start + blk + w];
                    for (d, &a) in dst.iter_mut().zip(&accs[..w]) {
                        *d = r.finish(a, n_red);
                    }
                    blk += w;
                }
            });
        });
    } else if n_out >= 2 * threads() || tasks_for(n_red, 1) <= 1 {
        // Many outputs (or little work): one task per group of outputs.
        par_chunks(&mut out, n_red, &|start, chunk| {
            knest.for_each_run(start, start + chunk.len(), |[o, xb], len| {
                for j in 0..len {
                    chunk[o - start + j] = r.finish(fold_range(xb + j * kin, 0, n_red), n_red);
                }
            });
        });
    } else {
        // Few, long reductions: split each one across threads.
        let mut bases = Vec::with_capacity(n_out);
        knest.for_each_run(0, n_out, |[_, xb], len| bases.extend((0..len).map(|j| xb + j * kin)));
        for (o, &base) in out.iter_mut().zip(&bases) {
            let parts = par_ranges(n_red, 1, &|a, b| fold_range(base, a, b));
            let acc = parts.into_iter().fold(r.init(), |a, p| r.combine(a, p));
            *o = r.finish(acc, n_red);
        }
    }
    Ok(out)
}

/// Runs a reduction over `dims`.
///
/// Each reducer is compiled only for the dtypes it serves: sums and products of
/// integers produce i64, means are floating only, and any/all reduce the input's
/// truth values as bool.
pub(crate) fn reduce(op: ReduceOp, x: &Input<'_>, dims: &[usize], out: &Meta) -> Result<HostBuffer> {
    let dt = x.dtype();
    if matches!(op, ReduceOp::Any | ReduceOp::All) {
        let layout = Layout::contiguous(x.layout.shape());
        let flags = match dt {
            DType::Bool => None,
            _ => Some(HostBuffer::Bool(with_dtype!(dt, T => map1::<T, bool>(x, 1, |v| v.truthy())?))),
        };
        let xb = match &flags {
            Some(buf) => Input { buf, layout: &layout },
            None => *x,
        };
        return Ok(buf(match op {
            ReduceOp::Any => run(AnyR::<bool>::new(), &xb, dims)?,
            _ => run(AllR::<bool>::new(), &xb, dims)?,
        }));
    }
    let mean_of_int = || Error::dtype("mean", format!("mean needs a floating input, got {dt} (output {})", out.dtype));
    Ok(match (dt, op) {
        (DType::F32, _) => float_reduce::<f32>(op, x, dims)?,
        (DType::F64, _) => float_reduce::<f64>(op, x, dims)?,
        (DType::BF16, _) => float_reduce::<bf16>(op, x, dims)?,
        (DType::F16, _) => float_reduce::<f16>(op, x, dims)?,
        (DType::F8E5M2 | DType::F8E4M3FN, _) => return Err(Error::unsupported_dtype("sum", dt)),
        (_, ReduceOp::Mean) => return Err(mean_of_int()),
        (DType::Bool, _) => int_reduce::<bool>(op, x, dims)?,
        (DType::U8, _) => int_reduce::<u8>(op, x, dims)?,
        (DType::I8, _) => int_reduce::<i8>(op, x, dims)?,
        (DType::I16, _) => int_reduce::<i16>(op, x, dims)?,
        (DType::I32, _) => int_reduce::<i32>(op, x, dims)?,
        (DType::I64, _) => int_reduce::<i64>(op, x, dims)?,
    })
}

/// Sum, mean, prod, max and min of a float type (the output has the input's dtype).
fn float_reduce<T: FoldElem>(op: ReduceOp, x: &Input<'_>, dims: &[usize]) -> Result<HostBuffer> {
    Ok(buf(match op {
        ReduceOp::Sum => run(SumR::<T, T>::new(false), x, dims)?,
        ReduceOp::Mean => run(SumR::<T, T>::new(true), x, dims)?,
        ReduceOp::Prod => run(ProdR::<T, T>::new(), x, dims)?,
        ReduceOp::Max => run(MaxR::<T>::new(), x, dims)?,
        ReduceOp::Min => run(MinR::<T>::new(), x, dims)?,
        ReduceOp::Any | ReduceOp::All => return Err(Error::backend("cpu", "any/all reduce bool flags")),
    }))
}

/// Sum and prod (into i64), max and min of an integer or bool type.
fn int_reduce<T: FoldElem>(op: ReduceOp, x: &Input<'_>, dims: &[usize]) -> Result<HostBuffer> {
    Ok(match op {
        ReduceOp::Sum => buf(run(SumR::<T, i64>::new(false), x, dims)?),
        ReduceOp::Prod => buf(run(ProdR::<T, i64>::new(), x, dims)?),
        ReduceOp::Max => buf(run(MaxR::<T>::new(), x, dims)?),
        ReduceOp::Min => buf(run(MinR::<T>::new(), x, dims)?),
        ReduceOp::Mean | ReduceOp::Any | ReduceOp::All => {
            return Err(Error::backend("cpu", format!("{op:?} is not an integer reduction")))
        }
    })
}

// ---- argmax / argmin -----------------------------------------------------------

/// Index of the max (`MAX`) or min of `n` elements `stride` apart: the first one on
/// ties, and the first NaN if there is one (NaN counts as the extreme both ways).
#[inline]
fn arg_scan<T: Elem, const MAX: bool>(v: &[T], base: usize, n: usize, stride: usize) -> i64 {
    match T::KIND {
        Kind::F32 | Kind::Half if stride == 1 => arg_scan_blocks::<T, MAX>(&v[base..base + n]),
        Kind::F32 | Kind::Half | Kind::F64 | Kind::Int | Kind::Bool => {
            arg_scan_one_by_one::<T, MAX>(v, base, n, stride)
        }
    }
}

/// Elements per block of [`arg_scan_blocks`]; lanes of its extremes.
const ARG_BLOCK: usize = 1024;
const ARG_LANES: usize = 16;

/// [`arg_scan`] of a contiguous run of float32, bf16 or f16 elements (a
/// decoding step's argmax over the vocabulary): each block is widened to f32
/// in L1, its extreme and whether it holds a NaN found by lanes that
/// vectorise, then the first index of the block's extreme when it beats the
/// blocks before (strictly: ties keep the first); at a block with a NaN, the
/// first NaN. The same index as [`arg_scan_one_by_one`], ten times faster.
fn arg_scan_blocks<T: Elem, const MAX: bool>(v: &[T]) -> i64 {
    let beats = |x: f32, e: f32| if MAX { x > e } else { x < e };
    let mut w = [0f32; ARG_BLOCK];
    let mut best: Option<(f32, usize)> = None;
    for (b, chunk) in v.chunks(ARG_BLOCK).enumerate() {
        let w = &mut w[..chunk.len()];
        for (d, &x) in w.iter_mut().zip(chunk) {
            *d = x.cast_f32();
        }
        let (mut ext, mut nan) = ([w[0]; ARG_LANES], [false; ARG_LANES]);
        let mut lanes = w.chunks_exact(ARG_LANES);
        for l in &mut lanes {
            for i in 0..ARG_LANES {
                nan[i] |= l[i].is_nan();
                ext[i] = if beats(l[i], ext[i]) { l[i] } else { ext[i] };
            }
        }
        for &x in lanes.remainder() {
            nan[0] |= x.is_nan();
            ext[0] = if beats(x, ext[0]) { x } else { ext[0] };
        }
        if nan.contains(&true) {
            let i = w.iter().position(|x| x.is_nan()).unwrap_or(0);
            return (b * ARG_BLOCK + i) as i64;
        }
        let e = ext.iter().copied().fold(ext[0], |e, x| if beats(x, e) { x } else { e });
        if best.is_none_or(|(bv, _)| beats(e, bv)) {
            let i = w.iter().position(|&x| x == e).unwrap_or(0);
            best = Some((e, b * ARG_BLOCK + i));
        }
    }
    best.map_or(0, |(_, i)| i as i64)
}

/// [`arg_scan`] element by element, any type and stride.
fn arg_scan_one_by_one<T: Elem, const MAX: bool>(v: &[T], base: usize, n: usize, stride: usize) -> i64 {
    let mut best = v[base];
    if best.is_nan_() {
        return 0;
    }
    let mut bi = 0;
    for i in 1..n {
        let x = v[base + i * stride];
        if x.is_nan_() {
            return i as i64;
        }
        if (MAX && x > best) || (!MAX && x < best) {
            best = x;
            bi = i;
        }
    }
    bi as i64
}

/// argmax / argmin along `dim`, or over the flattened tensor when `dim` is `None`.
pub(crate) fn arg_reduce(op: ArgReduceOp, x: &Input<'_>, dim: Option<usize>) -> Result<HostBuffer> {
    with_dtype!(x.dtype(), T => Ok(buf(match op {
        ArgReduceOp::ArgMax => arg_impl::<T, true>(x, dim)?,
        ArgReduceOp::ArgMin => arg_impl::<T, false>(x, dim)?,
    })))
}

fn arg_impl<T: Elem, const MAX: bool>(x: &Input<'_>, dim: Option<usize>) -> Result<Vec<i64>> {
    let xv = x.slice::<T>()?;
    let l = x.layout;
    let name = if MAX { "argmax" } else { "argmin" };
    let empty = || Error::shape(name, "expected a non-empty tensor: cannot take the arg of an empty sequence");
    match dim {
        _ if l.ndim() == 0 => Ok(vec![0]),
        None => {
            let n = l.numel();
            if n == 0 {
                return Err(empty());
            }
            if l.is_contiguous() {
                return Ok(vec![arg_scan::<T, MAX>(xv, l.offset(), n, 1)]);
            }
            let v = materialize_vec::<T>(x)?;
            Ok(vec![arg_scan::<T, MAX>(&v, 0, n, 1)])
        }
        Some(d) => {
            let (shape, strides) = (l.shape(), l.strides());
            let (n, s) = (shape[d], strides[d]);
            let kshape: Shape = shape.iter().enumerate().filter(|&(i, _)| i != d).map(|(_, &v)| v).collect();
            let kstr: Shape = strides.iter().enumerate().filter(|&(i, _)| i != d).map(|(_, &v)| v).collect();
            let mut out = vec![0i64; numel(&kshape)];
            if out.is_empty() {
                return Ok(out);
            }
            if n == 0 {
                return Err(empty());
            }
            let kcs = contiguous_strides(&kshape);
            let knest = Nest::new(&kshape, [&kcs[..], &kstr[..]], [0, l.offset()]);
            let [_, kin] = knest.inner_strides();
            par_chunks(&mut out, n, &|start, chunk| {
                knest.for_each_run(start, start + chunk.len(), |[o, xb], len| {
                    for j in 0..len {
                        chunk[o - start + j] = arg_scan::<T, MAX>(xv, xb + j * kin, n, s);
                    }
                });
            });
            Ok(out)
        }
    }
}

// ---- cumsum --------------------------------------------------------------------

/// Inclusive prefix sum along `dim`. Accumulates like PyTorch's CPU kernel: f32 in
/// f64, bf16/f16 in f32 (each prefix rounded once), integers and bool in i64.
pub(crate) fn cumsum(x: &Input<'_>, dim: usize) -> Result<HostBuffer> {
    Ok(match x.dtype() {
        DType::F32 => buf(cumsum_impl::<f32, f64, f32>(x, dim, |v| v as f64, |a| a as f32)?),
        DType::F64 => buf(cumsum_impl::<f64, f64, f64>(x, dim, |v| v, |a| a)?),
        DType::BF16 => buf(cumsum_impl::<bf16, f32, bf16>(x, dim, bf16_to_f32, f32_to_bf16)?),
        DType::F16 => buf(cumsum_impl::<f16, f32, f16>(x, dim, |v| v.to_f32(), f16::from_f32)?),
        dt => with_dtype!(dt, T => buf(cumsum_impl::<T, i64, i64>(x, dim, |v| v.cast_i64(), |a| a)?)),
    })
}

fn cumsum_impl<T: Elem, A: Acc, O: Elem>(
    x: &Input<'_>,
    dim: usize,
    to: impl Fn(T) -> A + Sync,
    from: impl Fn(A) -> O + Sync,
) -> Result<Vec<O>> {
    let l = x.layout;
    let shape = l.shape();
    let total = l.numel();
    let owned;
    let xs: &[T] = if l.is_contiguous() {
        &x.slice::<T>()?[l.offset()..l.offset() + total]
    } else {
        owned = materialize_vec::<T>(x)?;
        &owned
    };
    let mut out = O::zeros(total);
    if total == 0 {
        return Ok(out);
    }
    if shape.is_empty() {
        out[0] = from(to(xs[0]));
        return Ok(out);
    }
    // x: (outer, n, inner), contiguous.
    let n = shape[dim];
    let inner = numel(&shape[dim + 1..]);
    let block = n * inner;
    par_blocks(&mut out, block, 1, &|bi, ob| {
        let xb = &xs[bi * block..(bi + 1) * block];
        if inner == 1 {
            let mut acc = A::ZERO;
            for (o, &v) in ob.iter_mut().zip(xb) {
                acc = acc.add(to(v));
                *o = from(acc);
            }
        } else {
            let mut accs = vec![A::ZERO; inner];
            for (orow, row) in ob.chunks_exact_mut(inner).zip(xb.chunks_exact(inner)) {
                for ((o, a), &v) in orow.iter_mut().zip(accs.iter_mut()).zip(row) {
                    *a = a.add(to(v));
                    *o = from(*a);
                }
            }
        }
    });
    Ok(out)
}
