//! bf16 products `x @ w.T` with `w` row-major (the Linear layout) computed as
//! dot products of rows in the vector registers (Note [bf16 dot products]).
// Only x86-64 has the vector units this way uses; elsewhere `matmul` declines.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]
use super::iter::{column_ranges, OutPtr};
use super::simd::{level, Level};
use half::bf16;

// Note [bf16 dot products]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A bf16 product widened to f32 first (both operands, every call) reads and
// writes the weight three times over in f32 before gemm sees it: a decoding
// step in bf16 ran at half the speed of the same step in f32, where the
// weight is read once. Products `x @ W.T` with `W` row-major along the depth
// (a Linear's weight) run here instead, as in Note [Dot-product products]:
// tiles of R rows of `x` by C rows of `W`, R x C vector accumulators, rows of
// `x` in blocks that stay in cache while `W` streams past them once, nothing
// packed and nothing widened in memory. The terms are multiplied in the
// registers, in one of three ways chosen once per process:
//
// - with AVX512-BF16, `vdpbf16ps` multiplies 32 bf16 pairs per instruction
//   and adds each adjacent pair of products into one of 16 f32 lanes: the
//   products are exact (8-bit significands), the sums are rounded to f32
//   (the instruction treats subnormal inputs as zero and flushes subnormal
//   sums, below 1.2e-38);
// - with AVX-512 but no BF16 instructions, 16 elements are widened to f32 in
//   the registers (a zero-extension and a shift: bf16 is f32's top half) and
//   fused-multiply-added;
// - with AVX2 + FMA, the same on 8 lanes.
//
// A tile's rows of W are a few KiB each, too short for the hardware
// prefetchers to ramp up on: each step prefetches (into L2) the same line of
// the next tile's rows, so their loads overlap this tile's products (on a
// Xeon with AMX, a Qwen3-0.6B decoding step's bf16 products went from ~78%
// to ~89% of the read bandwidth).
//
// Every lane sums the terms whose index falls in it, in order of depth; a
// last step loads the remaining terms into a zeroed buffer; the lanes are
// summed by a fixed halving tree and the f32 sum is rounded to bf16 once, as
// PyTorch's CPU bf16 products round. An element's bits therefore depend on k,
// the way and its two rows only, never on the tile, the block, the other rows
// or the thread split: these products are row-invariant (Note [Row-invariant
// products]), whatever batch invariance says.
//
// Where the CPU has AMX, products of many rows run on its tiles instead (Note
// [bf16 products on tiles]). Elsewhere every bf16 product of depth at least
// `MIN_DEPTH` whose weight has its rows along the depth runs here, whatever
// its row count: against the widening
// way, on two threads of an EPYC (Zen 5), `x @ W.T` ran at 1.1-1.8x with 2048
// rows (depth 384 and 1024), 2.1x with 512 rows and 5x with 64, and with `x`
// stored by columns (copied into rows first) at 0.85-1.8x. A weight laid out
// the other way (`x @ W`, the input gradient `dy @ W`) is copied into rows
// first from `MIN_ROWS_COPIED` rows of `x` on, where the copy is small beside
// the product; with fewer rows the product stays with gemm through f32 (64
// rows by a [1024, 1024] weight: copying it cost more than widening did). With
// batch invariance on, every such product runs here.

/// bf16 products of at least this depth run here (Note [bf16 dot products]).
const MIN_DEPTH: usize = 256;
/// A weight without rows along the depth is copied into them from this many rows of `x` on.
const MIN_ROWS_COPIED: usize = 256;
/// Rows of `x` per block: the block's rows take at most this many elements.
const BLOCK_ELEMS: usize = 1 << 17;

/// One batch of products: `x` rows `i < m` at `x[i * x_rs..][..k]`, `w` rows
/// `j < n` at `w[j * w_rs..][..k]`; the result goes to `out[i * n + j]`.
pub(super) struct RowDot<'a> {
    pub x: &'a [bf16],
    pub x_rs: usize,
    pub w: &'a [bf16],
    pub w_rs: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Whether a bf16 product of `m` rows and depth `k` runs here (Note [bf16
/// dot products]); `w_rows` says whether its weight has its rows along the
/// depth in memory already (a Linear's `W.T`), else it is copied so.
pub(super) fn applies(m: usize, k: usize, w_rows: bool) -> bool {
    way().is_some() && k >= MIN_DEPTH && (w_rows || m >= MIN_ROWS_COPIED || kiln_tensor::is_batch_invariant())
}

/// The way this CPU multiplies bf16 here, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Way {
    DotBf16,
    Widen16,
    Widen8,
}

/// This CPU's way: the first of [`ways`], `None` where it has neither AVX2 +
/// FMA nor AVX-512.
pub(super) fn way() -> Option<Way> {
    ways().first().copied()
}

/// The ways this CPU can run, best first (detected once).
pub(super) fn ways() -> &'static [Way] {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static WAYS: OnceLock<Vec<Way>> = OnceLock::new();
        WAYS.get_or_init(|| {
            let l = level();
            let mut v = Vec::new();
            if l == Level::Avx512 && is_x86_feature_detected!("avx512bf16") {
                v.push(Way::DotBf16);
            }
            if l == Level::Avx512 {
                v.push(Way::Widen16);
            }
            if l >= Level::Avx2 {
                v.push(Way::Widen8);
            }
            v
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    &[]
}

impl RowDot<'_> {
    /// Writes every `out[i * n + j]` (`out` holds `m * n` elements) this
    /// CPU's way; panics (before any read) when a row lies outside its slice,
    /// and when this CPU has no way (callers ask [`applies`] first).
    pub(super) fn run(&self, out: &mut [bf16]) {
        self.run_way(way().expect("rowdot_bf16: no vector unit for bf16 dot products"), out)
    }

    /// As [`RowDot::run`], the given way; panics when this CPU lacks its
    /// instructions (see [`ways`]).
    pub(super) fn run_way(&self, way: Way, out: &mut [bf16]) {
        let RowDot { m, n, k, .. } = *self;
        assert!(ways().contains(&way), "rowdot_bf16: this CPU cannot run {way:?}");
        assert_eq!(out.len(), m * n, "rowdot_bf16: output of the wrong size");
        if m == 0 || n == 0 {
            return;
        }
        assert!((m - 1) * self.x_rs + k <= self.x.len(), "rowdot_bf16: x rows out of bounds");
        assert!((n - 1) * self.w_rs + k <= self.w.len(), "rowdot_bf16: w rows out of bounds");
        let out = OutPtr(out.as_mut_ptr());
        column_ranges(m, n, k, TILE_C, |j0, j1| {
            // SAFETY: the asserts above bound every row read (rows < m of x, < n of
            // w, k elements each) inside the slices; the columns j0..j1 of each
            // output row are written by this call only (the ranges handed out are
            // disjoint), inside `out`'s m * n elements; the CPU has the way's
            // features (`ways()` detected them).
            unsafe { self.columns(way, out, j0, j1) }
        });
    }

    /// Columns `j0..j1` of every row.
    ///
    /// # Safety
    /// As the closure in [`RowDot::run`] argues: rows in bounds, the columns
    /// ours alone, the way's features present.
    unsafe fn columns(&self, way: Way, out: OutPtr<bf16>, j0: usize, j1: usize) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract; each entry point needs its way's features.
        unsafe {
            match way {
                Way::DotBf16 => x86::dot_bf16(self, out, j0, j1),
                Way::Widen16 => x86::widen16(self, out, j0, j1),
                Way::Widen8 => x86::widen8(self, out, j0, j1),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (way, out, j0, j1);
    }
}

/// Columns per tile.
const TILE_C: usize = 4;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{RowDot, BLOCK_ELEMS, TILE_C};
    use crate::kernels::iter::OutPtr;
    use half::bf16;
    use std::arch::x86_64::*;

    /// One way of multiplying: `Raw` is one step's terms of a row as loaded.
    trait Unit {
        type Acc: Copy;
        type Raw: Copy;
        /// bf16 elements per step.
        const STEP: usize;
        unsafe fn zero() -> Self::Acc;
        /// One step's terms from `p` (STEP readable elements).
        unsafe fn load(p: *const bf16) -> Self::Raw;
        unsafe fn madd(acc: Self::Acc, x: Self::Raw, w: Self::Raw) -> Self::Acc;
        unsafe fn sum(acc: Self::Acc) -> f32;
    }

    /// `vdpbf16ps` on 32 bf16 pairs.
    struct DotBf16;
    impl Unit for DotBf16 {
        type Acc = __m512;
        type Raw = __m512bh;
        const STEP: usize = 32;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn load(p: *const bf16) -> __m512bh {
            // SAFETY: the caller makes 32 elements (64 bytes) readable at p.
            let v = unsafe { _mm512_loadu_si512(p.cast()) };
            // SAFETY: both are 512 bits of plain data; `__m512bh` is 32 bf16 lanes.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn madd(acc: __m512, x: __m512bh, w: __m512bh) -> __m512 {
            _mm512_dpbf16_ps(acc, x, w)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn sum(acc: __m512) -> f32 {
            _mm512_reduce_add_ps(acc)
        }
    }

    /// 16 bf16 widened to f32 in a register, then fused multiply-adds.
    struct Widen16;
    impl Unit for Widen16 {
        type Acc = __m512;
        type Raw = __m512;
        const STEP: usize = 16;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn load(p: *const bf16) -> __m512 {
            // SAFETY: the caller makes 16 elements (32 bytes) readable at p.
            let h = unsafe { _mm256_loadu_si256(p.cast()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn madd(acc: __m512, x: __m512, w: __m512) -> __m512 {
            _mm512_fmadd_ps(x, w, acc)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn sum(acc: __m512) -> f32 {
            _mm512_reduce_add_ps(acc)
        }
    }

    /// 8 bf16 widened to f32 in a register, then fused multiply-adds.
    struct Widen8;
    impl Unit for Widen8 {
        type Acc = __m256;
        type Raw = __m256;
        const STEP: usize = 8;
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(p: *const bf16) -> __m256 {
            // SAFETY: the caller makes 8 elements (16 bytes) readable at p.
            let h = unsafe { _mm_loadu_si128(p.cast()) };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn madd(acc: __m256, x: __m256, w: __m256) -> __m256 {
            _mm256_fmadd_ps(x, w, acc)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn sum(acc: __m256) -> f32 {
            // A fixed tree: halves, then quarters, then the last pair.
            let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            _mm_cvtss_f32(s)
        }
    }

    /// # Safety
    /// As [`RowDot::columns`], with AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn dot_bf16(job: &RowDot<'_>, out: OutPtr<bf16>, j0: usize, j1: usize) {
        // SAFETY: forwarded.
        unsafe { run::<DotBf16, 6, TILE_C>(job, out, j0, j1) }
    }

    /// # Safety
    /// As [`RowDot::columns`], with AVX-512.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn widen16(job: &RowDot<'_>, out: OutPtr<bf16>, j0: usize, j1: usize) {
        // SAFETY: forwarded.
        unsafe { run::<Widen16, 6, TILE_C>(job, out, j0, j1) }
    }

    /// # Safety
    /// As [`RowDot::columns`], with AVX2 + FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn widen8(job: &RowDot<'_>, out: OutPtr<bf16>, j0: usize, j1: usize) {
        // SAFETY: forwarded.
        unsafe { run::<Widen8, 2, TILE_C>(job, out, j0, j1) }
    }

    /// Columns `j0..j1` with R x C tiles (edge tiles narrower), blocks of rows outermost.
    #[inline(always)]
    unsafe fn run<U: Unit, const R: usize, const C: usize>(job: &RowDot<'_>, out: OutPtr<bf16>, j0: usize, j1: usize) {
        let (m, k) = (job.m, job.k);
        let rows_per_block = (BLOCK_ELEMS / k).max(R) / R * R;
        let mut i0 = 0;
        while i0 < m {
            let i1 = (i0 + rows_per_block).min(m);
            let mut j = j0;
            while j < j1 {
                let mut i = i0;
                // SAFETY (all tiles): the caller's contract covers rows < m, columns
                // j0..j1; each tile stays inside them.
                if j + C <= j1 {
                    while i + R <= i1 {
                        unsafe { tile::<U, R, C>(job, out, i, j) };
                        i += R;
                    }
                    while i < i1 {
                        unsafe { tile::<U, 1, C>(job, out, i, j) };
                        i += 1;
                    }
                    j += C;
                } else {
                    while i < i1 {
                        unsafe { tile::<U, 1, 1>(job, out, i, j) };
                        i += 1;
                    }
                    j += 1;
                }
            }
            i0 = i1;
        }
    }

    /// bf16 elements per cache line: the next tile's rows are prefetched a line at a time.
    const LINE: usize = 32;

    /// The R x C outputs of rows `i..i + R` and columns `j..j + C`.
    #[inline(always)]
    unsafe fn tile<U: Unit, const R: usize, const C: usize>(job: &RowDot<'_>, out: OutPtr<bf16>, i: usize, j: usize) {
        let k = job.k;
        let xs: [*const bf16; R] = std::array::from_fn(|r| job.x[(i + r) * job.x_rs..][..k].as_ptr());
        let ws: [*const bf16; C] = std::array::from_fn(|c| job.w[(j + c) * job.w_rs..][..k].as_ptr());
        // The rows of W of the next tile, fetched into L2 while this tile
        // computes (`wrapping_add`: past the last row it is an address, never
        // read).
        let ahead: [*const bf16; C] = ws.map(|w| w.wrapping_add(C * job.w_rs));
        // SAFETY: every row read is one of the k-element rows sliced above: full
        // steps read below `steps * STEP <= k`, the last step reads from a zeroed
        // copy of the remainder.
        unsafe {
            let mut acc = [[U::zero(); C]; R];
            let steps = k / U::STEP;
            for s in 0..steps {
                let p = s * U::STEP;
                if p % LINE == 0 {
                    for a in ahead {
                        // SAFETY: a prefetch reads nothing and cannot fault, whatever the address.
                        _mm_prefetch::<_MM_HINT_T1>(a.wrapping_add(p).cast());
                    }
                }
                let wp: [U::Raw; C] = std::array::from_fn(|c| U::load(ws[c].add(p)));
                for r in 0..R {
                    let xp = U::load(xs[r].add(p));
                    for c in 0..C {
                        acc[r][c] = U::madd(acc[r][c], xp, wp[c]);
                    }
                }
            }
            let (p, rest) = (steps * U::STEP, k % U::STEP);
            if rest > 0 {
                let tail = |row: *const bf16| {
                    let mut buf = [bf16::ZERO; 32];
                    buf[..rest].copy_from_slice(std::slice::from_raw_parts(row.add(p), rest));
                    buf
                };
                let wt: [[bf16; 32]; C] = std::array::from_fn(|c| tail(ws[c]));
                let wp: [U::Raw; C] = std::array::from_fn(|c| U::load(wt[c].as_ptr()));
                for r in 0..R {
                    let xt = tail(xs[r]);
                    let xp = U::load(xt.as_ptr());
                    for c in 0..C {
                        acc[r][c] = U::madd(acc[r][c], xp, wp[c]);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (c, &v) in acc.iter().enumerate() {
                    // The caller's contract: row i + r < m, column j + c in this
                    // call's range, written by this call only.
                    *out.get().add((i + r) * job.n + j + c) = bf16::from_f32(U::sum(v));
                }
            }
        }
    }
}
