//! `Elem`: what the kernels need from each element type beyond `HostElement`:
//! PyTorch's cast rules, zero-filled allocation, accumulation types, and the
//! float / integer families the math kernels are written for.
use half::{bf16, f16, slice::HalfFloatSliceExt};
use kiln_tensor::HostElement;
use std::mem::MaybeUninit;

/// The family of an element type, a constant the compiler folds away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Bool,
    Int,
    /// bf16 and f16: stored in 16 bits, computed in f32.
    Half,
    F32,
    F64,
}

/// An accumulator of reductions: f32, f64 or i64 (wrapping).
pub(crate) trait Acc: Copy + Send + Sync + PartialOrd + std::fmt::Debug + 'static {
    const ZERO: Self;
    const ONE: Self;
    /// Identity of `max` (-inf, or the smallest i64).
    const LOWEST: Self;
    /// Identity of `min`.
    const HIGHEST: Self;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn nan(self) -> bool;
    /// `self / n` (means are floating only).
    fn div_count(self, n: usize) -> Self;
    /// Rounds (or wraps) into an element type, once.
    fn to_out<O: Elem>(self) -> O;
}
macro_rules! float_acc {
    ($t:ty, $of:ident) => {
        impl Acc for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const LOWEST: Self = <$t>::NEG_INFINITY;
            const HIGHEST: Self = <$t>::INFINITY;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn nan(self) -> bool {
                self.is_nan()
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
            #[inline(always)]
            fn to_out<O: Elem>(self) -> O {
                O::$of(self)
            }
        }
    };
}
float_acc!(f32, of_f32);
float_acc!(f64, of_f64);
impl Acc for i64 {
    const ZERO: Self = 0;
    const ONE: Self = 1;
    const LOWEST: Self = i64::MIN;
    const HIGHEST: Self = i64::MAX;
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self.wrapping_mul(o)
    }
    #[inline(always)]
    fn nan(self) -> bool {
        false
    }
    #[inline(always)]
    fn div_count(self, n: usize) -> Self {
        self / n.max(1) as i64
    }
    #[inline(always)]
    fn to_out<O: Elem>(self) -> O {
        O::of_i64(self)
    }
}

/// An element type as the kernels see it.
///
/// The `of_*` constructors follow PyTorch's casts: float to integer truncates
/// (through i64, wrapping like x86 does for values in range of i64; never UB),
/// anything to bool is `!= 0` (NaN is true), and every conversion into bf16/f16
/// goes through f32 (c10's `BFloat16`/`Half` are built from a float), rounding
/// to nearest even.
pub(crate) trait Elem: HostElement + PartialOrd {
    const KIND: Kind;
    /// Accumulator of sums and products: f32 for f32/bf16/f16, f64, i64 for integers and bool.
    type Acc: Acc;
    fn to_acc(self) -> Self::Acc;
    /// `n` zeros, from a zeroed allocation: a memset when the heap reuses freed
    /// memory, so kernels that write every element take `uninit` buffers instead
    /// (Note [Uninitialised outputs]).
    fn zeros(n: usize) -> Vec<Self>;
    fn truthy(self) -> bool;
    fn is_nan_(self) -> bool;
    fn cast_f32(self) -> f32;
    fn cast_f64(self) -> f64;
    fn cast_i64(self) -> i64;
    fn of_f32(v: f32) -> Self;
    fn of_f64(v: f64) -> Self;
    fn of_i64(v: i64) -> Self;
    fn of_bool(b: bool) -> Self;
    /// `self + o` in this type (wrapping for integers, `or` for bool, f32 then rounded for bf16/f16).
    fn add_(self, o: Self) -> Self;
    /// `self * o`, same conventions.
    fn mul_(self, o: Self) -> Self;
}

/// Allocations at least this large ask the OS for 2 MiB pages.
const HUGE_PAGE_MIN: usize = 4 << 20;

/// `n` zeros. Large buffers are advised to use transparent huge pages before
/// they are first touched, then cleared: a 64 MiB output in fresh memory
/// otherwise costs 16K page faults, more time than the kernel that fills it.
/// (A zeroed allocation would not do: glibc's `calloc` clears memory that
/// comes from the heap, touching every page before the advice could apply.)
fn zeroed<T: Copy>(n: usize, zero: T) -> Vec<T> {
    if let Some(mut v) = crate::plan::take::<T>(n) {
        v.fill(MaybeUninit::new(zero));
        // SAFETY: every element was just written.
        return unsafe { assume_init(v) };
    }
    if n.saturating_mul(std::mem::size_of::<T>()) < HUGE_PAGE_MIN {
        return vec![zero; n];
    }
    let mut v = uninit::<T>(n);
    v.fill(MaybeUninit::new(zero));
    // SAFETY: every element was just written.
    unsafe { assume_init(v) }
}

// Note [Uninitialised outputs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A kernel that writes every element of its output (the elementwise engines in
// map.rs) takes it from `uninit` instead of `zeros`. glibc's malloc hands back
// the memory of earlier, freed outputs (blocks of every size come from the heap
// once the backend is registered, Note [Keeping freed memory] in lib.rs), which
// `calloc` must clear first: a memset as large as the output, a whole extra pass
// over memory (30% of the samples of an add of 64K f32 elements; PyTorch does
// not clear its outputs). Without it, kiln's add went from 0.36x to 1.15x of
// PyTorch's GB/s at 256K elements, 0.59x to 1.01x at 1M, 0.74x to 1.28x at 4M
// and about 1.7x to 2.6x at 16M (`benches/compare_torch.py`).
//
// The buffer holds `MaybeUninit<T>`: kernels write through `MaybeUninit::write`,
// so no reference to uninitialised memory exists, and `assume_init` turns it
// into a `Vec<T>` once every element is written. The engines check that their
// runs added up to each chunk they were handed before they call it done.
// Kernels that read their output back (softmax scales the exponentials it
// stored) or accumulate into it get each block from `zeroed_block`, cleared just
// before they work on it, while it is in cache: softmax over rows went from
// 0.66x to 0.98x of PyTorch at 512 x 512 and from 0.69x to 1.01x at 1024 x 1024.
// Other kernels (cat, gather, attention, ...) still take `zeros`.

/// A fresh buffer of `n` elements for a kernel that writes every one of them
/// (Note [Uninitialised outputs]): from the running program's arena (Note
/// [Planned memory] in plan.rs), else allocated, large buffers advised to use
/// huge pages.
pub(crate) fn uninit<T>(n: usize) -> Vec<MaybeUninit<T>> {
    if let Some(v) = crate::plan::take::<T>(n) {
        return v;
    }
    let v = Box::<[T]>::new_uninit_slice(n).into_vec();
    advise_huge_pages(&v);
    v
}

/// The buffer of `uninit` once its elements are written.
///
/// # Safety
/// Every element of `v` must have been written.
pub(crate) unsafe fn assume_init<T>(v: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut v = std::mem::ManuallyDrop::new(v);
    let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: `MaybeUninit<T>` has the size and alignment of `T`, so the allocation
    // (of `cap` elements, owned by `v`, which is not dropped) has the same layout as
    // a `Vec<T>` of that capacity; the caller guarantees all `len` elements are
    // initialised.
    unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, cap) }
}

/// Writes `src` into all of `dst` (same length).
#[inline(always)]
pub(crate) fn write_slice<T: Copy>(dst: &mut [MaybeUninit<T>], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "write_slice: lengths differ");
    for (d, &s) in dst.iter_mut().zip(src) {
        d.write(s);
    }
}

/// A block of an `uninit` buffer, zeroed just before a kernel that reads its
/// output back (or accumulates into it) works on it: the block is in cache then,
/// unlike a memset of the whole buffer up front (Note [Uninitialised outputs]).
#[inline]
pub(crate) fn zeroed_block<T: Copy>(b: &mut [MaybeUninit<T>], zero: T) -> &mut [T] {
    b.fill(MaybeUninit::new(zero));
    // SAFETY: every element was just written, `MaybeUninit<T>` has `T`'s layout,
    // and the borrow of `b` moves into the result.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr().cast::<T>(), b.len()) }
}

pub(crate) fn advise_huge_pages<T>(v: &[T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let bytes = std::mem::size_of_val(v);
        if bytes < HUGE_PAGE_MIN {
            return;
        }
        let start = v.as_ptr() as usize;
        let (lo, hi) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if hi > lo {
            // SAFETY: madvise(MADV_HUGEPAGE) only records a paging hint for [lo, hi), whole pages
            // inside the allocation behind `v`; it reads and writes no memory, so no reference is
            // affected. A failure (e.g. THP disabled) just leaves the hint unset.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
}

/// PyTorch's cast from `S` to `D` (`tensor.to(dtype)`).
#[inline(always)]
pub(crate) fn convert<S: Elem, D: Elem>(s: S) -> D {
    match (S::KIND, D::KIND) {
        (_, Kind::Bool) => D::of_bool(s.truthy()),
        (Kind::Bool | Kind::Int, _) => D::of_i64(s.cast_i64()),
        (Kind::F64, _) => D::of_f64(s.cast_f64()),
        (Kind::Half | Kind::F32, _) => D::of_f32(s.cast_f32()),
    }
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const KIND: Kind = Kind::Int;
            type Acc = i64;
            #[inline(always)]
            fn to_acc(self) -> i64 {
                self as i64
            }
            fn zeros(n: usize) -> Vec<Self> {
                zeroed(n, 0)
            }
            #[inline(always)]
            fn truthy(self) -> bool {
                self != 0
            }
            #[inline(always)]
            fn is_nan_(self) -> bool {
                false
            }
            #[inline(always)]
            fn cast_f32(self) -> f32 {
                self as f32
            }
            #[inline(always)]
            fn cast_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn cast_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn of_f32(v: f32) -> Self {
                (v as i64) as $t
            }
            #[inline(always)]
            fn of_f64(v: f64) -> Self {
                (v as i64) as $t
            }
            #[inline(always)]
            fn of_i64(v: i64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn of_bool(b: bool) -> Self {
                b as $t
            }
            #[inline(always)]
            fn add_(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn mul_(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
        }
    )*};
}
int_elem!(u8, i8, i16, i32, i64);

impl Elem for bool {
    const KIND: Kind = Kind::Bool;
    type Acc = i64;
    #[inline(always)]
    fn to_acc(self) -> i64 {
        self as i64
    }
    fn zeros(n: usize) -> Vec<Self> {
        zeroed(n, false)
    }
    #[inline(always)]
    fn truthy(self) -> bool {
        self
    }
    #[inline(always)]
    fn is_nan_(self) -> bool {
        false
    }
    #[inline(always)]
    fn cast_f32(self) -> f32 {
        self as u8 as f32
    }
    #[inline(always)]
    fn cast_f64(self) -> f64 {
        self as u8 as f64
    }
    #[inline(always)]
    fn cast_i64(self) -> i64 {
        self as i64
    }
    #[inline(always)]
    fn of_f32(v: f32) -> Self {
        v != 0.0
    }
    #[inline(always)]
    fn of_f64(v: f64) -> Self {
        v != 0.0
    }
    #[inline(always)]
    fn of_i64(v: i64) -> Self {
        v != 0
    }
    #[inline(always)]
    fn of_bool(b: bool) -> Self {
        b
    }
    #[inline(always)]
    fn add_(self, o: Self) -> Self {
        self | o
    }
    #[inline(always)]
    fn mul_(self, o: Self) -> Self {
        self & o
    }
}

macro_rules! native_float_elem {
    ($t:ty, $kind:ident) => {
        impl Elem for $t {
            const KIND: Kind = Kind::$kind;
            type Acc = $t;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            fn zeros(n: usize) -> Vec<Self> {
                zeroed(n, 0.0)
            }
            #[inline(always)]
            fn truthy(self) -> bool {
                self != 0.0
            }
            #[inline(always)]
            fn is_nan_(self) -> bool {
                self.is_nan()
            }
            #[inline(always)]
            fn cast_f32(self) -> f32 {
                self as f32
            }
            #[inline(always)]
            fn cast_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn cast_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn of_f32(v: f32) -> Self {
                v as $t
            }
            #[inline(always)]
            fn of_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn of_i64(v: i64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn of_bool(b: bool) -> Self {
                b as u8 as $t
            }
            #[inline(always)]
            fn add_(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul_(self, o: Self) -> Self {
                self * o
            }
        }
    };
}
native_float_elem!(f32, F32);
native_float_elem!(f64, F64);

/// f32 to bf16 bits, rounding to nearest even (NaN stays a quiet NaN). Branch-free, so loops vectorise.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x40) as u16;
    bf16::from_bits(if x.is_nan() { nan } else { rounded })
}

#[inline(always)]
pub(crate) fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

impl Elem for bf16 {
    const KIND: Kind = Kind::Half;
    type Acc = f32;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        bf16_to_f32(self)
    }
    fn zeros(n: usize) -> Vec<Self> {
        let mut v = std::mem::ManuallyDrop::new(zeroed(n, 0u16));
        let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
        // SAFETY: `bf16` is `#[repr(transparent)]` over `u16`: same size and alignment, so the
        // allocation's layout is unchanged, and every bit pattern (here all zeros, +0.0) is a
        // valid bf16. `v` is not dropped, so the allocation has exactly one owner.
        unsafe { Vec::from_raw_parts(ptr as *mut bf16, len, cap) }
    }
    #[inline(always)]
    fn truthy(self) -> bool {
        self.to_bits() & 0x7FFF != 0
    }
    #[inline(always)]
    fn is_nan_(self) -> bool {
        self.to_bits() & 0x7FFF > 0x7F80
    }
    #[inline(always)]
    fn cast_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn cast_f64(self) -> f64 {
        bf16_to_f32(self) as f64
    }
    #[inline(always)]
    fn cast_i64(self) -> i64 {
        bf16_to_f32(self) as i64
    }
    #[inline(always)]
    fn of_f32(v: f32) -> Self {
        f32_to_bf16(v)
    }
    #[inline(always)]
    fn of_f64(v: f64) -> Self {
        f32_to_bf16(v as f32)
    }
    #[inline(always)]
    fn of_i64(v: i64) -> Self {
        f32_to_bf16(v as f32)
    }
    #[inline(always)]
    fn of_bool(b: bool) -> Self {
        if b {
            bf16::ONE
        } else {
            bf16::ZERO
        }
    }
    #[inline(always)]
    fn add_(self, o: Self) -> Self {
        f32_to_bf16(bf16_to_f32(self) + bf16_to_f32(o))
    }
    #[inline(always)]
    fn mul_(self, o: Self) -> Self {
        f32_to_bf16(bf16_to_f32(self) * bf16_to_f32(o))
    }
}

/// f16 and the float8 types: stored narrow, converted through f32 by their
/// own `to_f32` / `from_f32` (for float8, Note [float8 conversions] in
/// kiln-tensor; only casts and data movement reach the kernels with them, the
/// op typing rules refuse arithmetic as PyTorch does). `$truthy` and `$nan`
/// test the bits, `$zeros` allocates `n` zeros.
macro_rules! narrow_float_elem {
    ($t:ty, truthy: $truthy:expr, nan: $nan:expr, zeros: $zeros:expr) => {
        impl Elem for $t {
            const KIND: Kind = Kind::Half;
            type Acc = f32;
            #[inline(always)]
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            fn zeros(n: usize) -> Vec<Self> {
                $zeros(n)
            }
            #[inline(always)]
            fn truthy(self) -> bool {
                $truthy(self)
            }
            #[inline(always)]
            fn is_nan_(self) -> bool {
                $nan(self)
            }
            #[inline(always)]
            fn cast_f32(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn cast_f64(self) -> f64 {
                self.to_f64()
            }
            #[inline(always)]
            fn cast_i64(self) -> i64 {
                self.to_f32() as i64
            }
            #[inline(always)]
            fn of_f32(v: f32) -> Self {
                <$t>::from_f32(v)
            }
            #[inline(always)]
            fn of_f64(v: f64) -> Self {
                <$t>::from_f32(v as f32)
            }
            #[inline(always)]
            fn of_i64(v: i64) -> Self {
                <$t>::from_f32(v as f32)
            }
            #[inline(always)]
            fn of_bool(b: bool) -> Self {
                if b {
                    <$t>::ONE
                } else {
                    <$t>::ZERO
                }
            }
            #[inline(always)]
            fn add_(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() + o.to_f32())
            }
            #[inline(always)]
            fn mul_(self, o: Self) -> Self {
                <$t>::from_f32(self.to_f32() * o.to_f32())
            }
        }
    };
}

/// `n` f16 zeros from a zeroed `u16` allocation.
fn f16_zeros(n: usize) -> Vec<f16> {
    let mut v = std::mem::ManuallyDrop::new(zeroed(n, 0u16));
    let (ptr, len, cap) = (v.as_mut_ptr(), v.len(), v.capacity());
    // SAFETY: `f16` is `#[repr(transparent)]` over `u16` (same size and alignment) and
    // all-zero bits are +0.0; `v` is not dropped, so the allocation has one owner.
    unsafe { Vec::from_raw_parts(ptr as *mut f16, len, cap) }
}

narrow_float_elem!(f16, truthy: |x: f16| x.to_bits() & 0x7FFF != 0, nan: |x: f16| x.to_bits() & 0x7FFF > 0x7C00, zeros: f16_zeros);
narrow_float_elem!(
    kiln_tensor::f8e4m3fn,
    truthy: |x: kiln_tensor::f8e4m3fn| x.to_bits() & 0x7F != 0,
    nan: |x: kiln_tensor::f8e4m3fn| x.is_nan(),
    zeros: |n| zeroed(n, kiln_tensor::f8e4m3fn::ZERO)
);
narrow_float_elem!(
    kiln_tensor::f8e5m2,
    truthy: |x: kiln_tensor::f8e5m2| x.to_bits() & 0x7F != 0,
    nan: |x: kiln_tensor::f8e5m2| x.is_nan(),
    zeros: |n| zeroed(n, kiln_tensor::f8e5m2::ZERO)
);

/// The native float types math is computed in (f32, f64), with the
/// transcendental functions the kernels use: vectorisable versions for f32,
/// the platform's libm for f64.
pub(crate) trait Compute: Elem + num_traits::Float + Default {
    const ZERO: Self;
    const ONE: Self;
    const HALF: Self;
    fn exp_<const FMA: bool>(self) -> Self;
    fn tanh_<const FMA: bool>(self) -> Self;
    fn sigmoid_<const FMA: bool>(self) -> Self;
    fn erf_(self) -> Self;
    fn round_even(self) -> Self;
    fn copysign_(self, sign: Self) -> Self;
}
impl Compute for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const HALF: Self = 0.5;
    #[inline(always)]
    fn exp_<const FMA: bool>(self) -> Self {
        super::simd::exp_f32::<FMA>(self)
    }
    #[inline(always)]
    fn tanh_<const FMA: bool>(self) -> Self {
        super::simd::tanh_f32::<FMA>(self)
    }
    #[inline(always)]
    fn sigmoid_<const FMA: bool>(self) -> Self {
        super::simd::sigmoid_f32::<FMA>(self)
    }
    #[inline(always)]
    fn erf_(self) -> Self {
        libm::erff(self)
    }
    #[inline(always)]
    fn round_even(self) -> Self {
        self.round_ties_even()
    }
    #[inline(always)]
    fn copysign_(self, sign: Self) -> Self {
        self.copysign(sign)
    }
}
impl Compute for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const HALF: Self = 0.5;
    #[inline(always)]
    fn exp_<const FMA: bool>(self) -> Self {
        self.exp()
    }
    #[inline(always)]
    fn tanh_<const FMA: bool>(self) -> Self {
        self.tanh()
    }
    #[inline(always)]
    fn sigmoid_<const FMA: bool>(self) -> Self {
        1.0 / (1.0 + (-self).exp())
    }
    #[inline(always)]
    fn erf_(self) -> Self {
        libm::erf(self)
    }
    #[inline(always)]
    fn round_even(self) -> Self {
        self.round_ties_even()
    }
    #[inline(always)]
    fn copysign_(self, sign: Self) -> Self {
        self.copysign(sign)
    }
}

/// Floating element types: each is computed in a `Compute` type (bf16/f16 in f32,
/// rounded once per op when stored).
pub(crate) trait FloatElem: Elem {
    type C: Compute;
    /// True when `C` is `Self` (f32, f64): slices are used as they are.
    const DIRECT: bool;
    /// The slice itself when this type is its own compute type (f32, f64).
    fn direct(s: &[Self]) -> Option<&[Self::C]>;
    fn direct_mut(s: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<Self::C>]>;
    /// Widens `src` into `dst` (same length).
    fn load(src: &[Self], dst: &mut [Self::C]);
    /// Rounds `src` into `dst`, writing all of it (same length).
    fn store(src: &[Self::C], dst: &mut [MaybeUninit<Self>]);
    fn to_c(self) -> Self::C;
}

macro_rules! native_float {
    ($t:ty) => {
        impl FloatElem for $t {
            type C = $t;
            const DIRECT: bool = true;
            #[inline(always)]
            fn direct(s: &[Self]) -> Option<&[$t]> {
                Some(s)
            }
            #[inline(always)]
            fn direct_mut(s: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<$t>]> {
                Some(s)
            }
            #[inline(always)]
            fn load(src: &[Self], dst: &mut [$t]) {
                dst.copy_from_slice(src)
            }
            #[inline(always)]
            fn store(src: &[$t], dst: &mut [MaybeUninit<Self>]) {
                write_slice(dst, src);
            }
            #[inline(always)]
            fn to_c(self) -> $t {
                self
            }
        }
    };
}
native_float!(f32);
native_float!(f64);

impl FloatElem for bf16 {
    type C = f32;
    const DIRECT: bool = false;
    #[inline(always)]
    fn direct(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn direct_mut(_: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<f32>]> {
        None
    }
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        super::simd::dispatch(Bf16Widen { src, dst })
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [MaybeUninit<Self>]) {
        assert_eq!(src.len(), dst.len(), "store: lengths differ");
        super::simd::dispatch(Bf16Round { src, dst })
    }
    #[inline(always)]
    fn to_c(self) -> f32 {
        bf16_to_f32(self)
    }
}

/// bf16 widened to f32, compiled for the CPU's best instruction set (the
/// staging loops of `fmap` run at every bf16 elementwise op).
struct Bf16Widen<'a> {
    src: &'a [bf16],
    dst: &'a mut [f32],
}

impl super::simd::Kernel for Bf16Widen<'_> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        for (d, &s) in self.dst.iter_mut().zip(self.src) {
            *d = bf16_to_f32(s);
        }
    }
}

/// f32 rounded to bf16, as [`Bf16Widen`].
struct Bf16Round<'a> {
    src: &'a [f32],
    dst: &'a mut [MaybeUninit<bf16>],
}

impl super::simd::Kernel for Bf16Round<'_> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        for (d, &s) in self.dst.iter_mut().zip(self.src) {
            d.write(f32_to_bf16(s));
        }
    }
}

impl FloatElem for f16 {
    type C = f32;
    const DIRECT: bool = false;
    #[inline(always)]
    fn direct(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn direct_mut(_: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<f32>]> {
        None
    }
    #[inline(always)]
    fn load(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [MaybeUninit<Self>]) {
        // Cleared first (a staged run of at most STAGE elements, in cache) so that
        // half's vectorised conversion, which takes `&mut [f16]`, can fill it.
        zeroed_block(dst, f16::ZERO).convert_from_f32_slice(src)
    }
    #[inline(always)]
    fn to_c(self) -> f32 {
        self.to_f32()
    }
}

/// Integer element types, with the wrapping arithmetic PyTorch's integer kernels have.
pub(crate) trait IntElem: Elem + Ord {
    const SIGNED: bool;
    fn wsub(self, o: Self) -> Self;
    /// Truncating division; the divisor is non-zero (checked by the caller).
    fn wdiv(self, o: Self) -> Self;
    fn wrem(self, o: Self) -> Self;
    fn wneg(self) -> Self;
    fn wabs(self) -> Self;
    /// `self ** e`, wrapping.
    fn wpow(self, e: u64) -> Self;
    fn is_neg(self) -> bool;
    fn sign(self) -> Self;
    fn band(self, o: Self) -> Self;
    fn bor(self, o: Self) -> Self;
    fn bxor(self, o: Self) -> Self;
    /// `self << o`, 0 when `o` is negative or at least the bit width (PyTorch's rule).
    fn shl(self, o: Self) -> Self;
    /// `self >> o` (arithmetic for signed types), the shift by `width - 1` when `o`
    /// is negative or at least the bit width (PyTorch's rule).
    fn shr(self, o: Self) -> Self;
}
macro_rules! int_ops {
    ($($t:ty: $signed:expr),*) => {$(
        impl IntElem for $t {
            const SIGNED: bool = $signed;
            #[inline(always)]
            fn wsub(self, o: Self) -> Self {
                self.wrapping_sub(o)
            }
            #[inline(always)]
            fn wdiv(self, o: Self) -> Self {
                self.wrapping_div(o)
            }
            #[inline(always)]
            fn wrem(self, o: Self) -> Self {
                self.wrapping_rem(o)
            }
            #[inline(always)]
            fn wneg(self) -> Self {
                self.wrapping_neg()
            }
            #[inline(always)]
            #[allow(unused_comparisons)]
            fn wabs(self) -> Self {
                if self < 0 as $t { self.wrapping_neg() } else { self }
            }
            #[inline]
            fn wpow(self, mut e: u64) -> Self {
                let (mut base, mut acc) = (self, 1 as $t);
                while e > 0 {
                    if e & 1 == 1 {
                        acc = acc.wrapping_mul(base);
                    }
                    base = base.wrapping_mul(base);
                    e >>= 1;
                }
                acc
            }
            #[inline(always)]
            #[allow(unused_comparisons)]
            fn is_neg(self) -> bool {
                self < 0 as $t
            }
            #[inline(always)]
            #[allow(unused_comparisons)]
            fn sign(self) -> Self {
                ((self > 0 as $t) as $t).wrapping_sub((self < 0 as $t) as $t)
            }
            #[inline(always)]
            fn band(self, o: Self) -> Self {
                self & o
            }
            #[inline(always)]
            fn bor(self, o: Self) -> Self {
                self | o
            }
            #[inline(always)]
            fn bxor(self, o: Self) -> Self {
                self ^ o
            }
            #[inline(always)]
            #[allow(unused_comparisons)]
            fn shl(self, o: Self) -> Self {
                if o < 0 as $t || o as u64 >= <$t>::BITS as u64 { 0 } else { self << o }
            }
            #[inline(always)]
            #[allow(unused_comparisons)]
            fn shr(self, o: Self) -> Self {
                if o < 0 as $t || o as u64 >= <$t>::BITS as u64 { self >> (<$t>::BITS - 1) } else { self >> o }
            }
        }
    )*};
}
int_ops!(u8: false, i8: true, i16: true, i32: true, i64: true);
