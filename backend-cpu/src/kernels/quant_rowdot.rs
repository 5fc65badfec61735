//! Quantized products of a few rows, `x @ W.T` with `W`'s codes decoded in
//! the vector registers (Note [Codes decoded in the registers]).
// Only x86-64 with AVX-512 has the instructions this way uses; elsewhere
// `quant_matmul` keeps its tiles.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]
use super::iter::{column_ranges, OutPtr};
use super::quant::Scales;
use super::simd::{level, Level};
use kiln_tensor::quant::QuantSpec;

// Note [Codes decoded in the registers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Note [Dequantizing inside the product] decodes a tile of W into a float32
// buffer and reads it back for the dot products: in a decoding step every
// code is then written and read again as four bytes, and the loops that
// decode it cost more than the bytes the codes save (FP8 and NVFP4 decoding
// ran slower than the f32 weights they replace). With AVX-512 the products
// of a few rows (a decoding step; every row count with batch invariance on)
// run here instead: 16 codes at a time go from memory into a register and
// become 16 f32 weights there, which meet the rows of `x` in fused
// multiply-adds, as in Note [Dot-product products]: tiles of R rows of `x`
// by C rows of W, one accumulator per pair, lanes summed by a fixed tree.
//
// - E4M3: the code's 7 magnitude bits shifted into an f32's exponent and
//   significand (bits 20..27) are, as an f32, its value times 2^-120 for
//   normal and subnormal codes alike; a multiply by 2^120 (exact) and the
//   sign bit give the value, 0x7F / 0xFF become NaN.
// - E2M1 and int4: the bytes' nibbles are spread over the 16 lanes (element
//   2j is byte j's low nibble), and a permute picks each value from the 16 a
//   code can take (`Codes::nibble_values`).
// - int8: sign-extended to 32 bits and converted, exactly.
//
// With AVX512-VBMI a step takes 64 codes: each code picks the two bytes of
// its bf16 value from tables (two of 128 bytes for E4M3, its sign bit then
// joining the high byte, 0x7F giving NaN; one of 16 for a 4-bit code, sign
// included; int8 codes are instead unpacked with their sign bytes, which
// gives the same order), and the bf16 values become f32 by unpacking with zeros, which
// works within 128-bit lanes: the four f32 registers of a step hold the
// elements in a fixed shuffled order, so each row of `x` is permuted into
// that order once per call (`permute_rows`); lane l of every register holds
// elements 16 l .. 16 l + 15 of the step, so it takes their block's scale.
//
// A tile's rows of codes are a few hundred bytes each, too short for the
// hardware prefetchers to ramp up on, so each wide step prefetches the same
// bytes of the next tile's rows: their loads overlap this tile's products.
//
// Each weight is then `value * scale`, one rounding, the order of Note
// [Quantized weights]; 16 consecutive elements share one block scale, so
// blocks must be a multiple of 16 columns wide (or cover the whole depth).
// The last `k % 16` elements are decoded one by one into a zeroed step. An
// element's bits depend on k, the step width the CPU allows and its two rows
// only: these products are row-invariant.

/// Elements per step (one AVX-512 register of f32).
const STEP: usize = 16;

/// One product: `x` float32 rows `m x k` (contiguous), W `n x k` as `spec`'s
/// codes and scales; the result goes to `out[i * n + j]`.
pub(super) struct QuantRowDot<'a> {
    pub spec: &'a QuantSpec,
    pub codes: &'a [u8],
    pub scales: &'a Scales<'a>,
    pub x: &'a [f32],
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Whether this CPU decodes `spec`'s codes in the registers for depth `k`
/// (Note [Codes decoded in the registers]).
pub(super) fn applies(spec: &QuantSpec, k: usize) -> bool {
    let b1 = spec.block[1];
    level() == Level::Avx512 && b1 > 0 && (b1.is_multiple_of(STEP) || b1 >= k)
}

impl QuantRowDot<'_> {
    /// Writes every `out[i * n + j]` (`out` holds `m * n` elements), with
    /// wide steps where the CPU has them; panics (before any read) when an
    /// operand is shorter than its shape, or when [`applies`] says no.
    pub(super) fn run(&self, out: &mut [f32]) {
        self.run_steps(wide_steps(), out)
    }

    /// As [`QuantRowDot::run`], with wide steps or without; panics when
    /// asked for wide steps on a CPU without AVX512-VBMI.
    pub(super) fn run_steps(&self, wide: bool, out: &mut [f32]) {
        let QuantRowDot { spec, m, n, k, .. } = *self;
        assert!(applies(spec, k), "quant_rowdot: not for this CPU or block");
        assert_eq!(out.len(), m * n, "quant_rowdot: output of the wrong size");
        assert!(self.x.len() >= m * k, "quant_rowdot: x too short");
        let nibbles = spec.codes.packed_in_nibbles();
        let row_bytes = if nibbles { k / 2 } else { k };
        assert!(!nibbles || k.is_multiple_of(2), "quant_rowdot: odd depth of 4-bit codes");
        assert!(self.codes.len() >= n * row_bytes, "quant_rowdot: codes too short");
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            // Sums over no columns (and tiles would hold no scales).
            out.fill(0.0);
            return;
        }
        let out = OutPtr(out.as_mut_ptr());
        // Codes 64 at a time where the CPU has byte permutes, with `x` in the
        // order they come out in.
        assert!(!wide || wide_steps(), "quant_rowdot: wide steps need AVX512-VBMI");
        let permuted: Vec<f32>;
        let x = if wide {
            permuted = permute_rows(self.x, m, k);
            &permuted[..]
        } else {
            self.x
        };
        let step_blocks: Vec<usize> = (0..k / STEP).map(|st| st * STEP / spec.block[1]).collect();
        let plan = Plan { job: QuantRowDot { x, ..*self }, step_blocks, row_bytes };
        column_ranges(m, n, k, TILE_C, |j0, j1| {
            // SAFETY: the asserts bound every read (x rows < m, code rows < n);
            // columns j0..j1 of each output row are written by this call only (the
            // ranges handed out are disjoint) and lie inside `out`; `applies`
            // confirmed AVX-512, `wide_steps` AVX512-VBMI.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                if wide {
                    x86::columns_wide(&plan, out, j0, j1)
                } else {
                    x86::columns(&plan, out, j0, j1)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (j0, j1, &plan);
        });
    }
}

/// A product ready to run: `x` permuted for wide steps, the block column of
/// each 16-element step, the bytes of a row of codes.
struct Plan<'a> {
    job: QuantRowDot<'a>,
    step_blocks: Vec<usize>,
    row_bytes: usize,
}

/// Elements per wide step (one register of bytes).
const WIDE: usize = 64;

/// Whether the CPU has the byte permutes of the wide steps (detected once).
fn wide_steps() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VBMI.get_or_init(|| is_x86_feature_detected!("avx512vbmi"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Rows of `x` with each whole chunk of 64 elements in the order a wide step
/// decodes W's codes: vector `v` of the chunk holds, in its 128-bit lane `l`,
/// elements `16 l + 4 v .. 16 l + 4 v + 4`; the rest of a row as it was.
fn permute_rows(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let mut out = x[..m * k].to_vec();
    for row in out.chunks_exact_mut(k) {
        for chunk in row.chunks_exact_mut(WIDE) {
            let orig: [f32; WIDE] = chunk.try_into().expect("a whole chunk");
            for v in 0..4 {
                for l in 0..4 {
                    chunk[16 * v + 4 * l..][..4].copy_from_slice(&orig[16 * l + 4 * v..][..4]);
                }
            }
        }
    }
    out
}

/// Rows of `x` and of W per tile.
const TILE_R: usize = 4;
const TILE_C: usize = 4;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Plan, STEP, TILE_C, TILE_R};
    use crate::kernels::iter::OutPtr;
    use crate::kernels::quant::{code_index, code_of, code_value, e4m3, tile_scales};
    use kiln_tensor::quant::Codes;
    use std::arch::x86_64::*;

    /// Columns `j0..j1` of every row, 16 codes per step.
    ///
    /// # Safety
    /// As the closure in [`QuantRowDot::run`] argues.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn columns(plan: &Plan<'_>, out: OutPtr<f32>, j0: usize, j1: usize) {
        // SAFETY: forwarded.
        unsafe { by_codes::<false>(plan, out, j0, j1) }
    }

    /// Columns `j0..j1` of every row, codes 64 per step (`x` permuted by
    /// `permute_rows`).
    ///
    /// # Safety
    /// As the closure in [`QuantRowDot::run`] argues, with AVX512-VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
    pub(super) unsafe fn columns_wide(plan: &Plan<'_>, out: OutPtr<f32>, j0: usize, j1: usize) {
        // SAFETY: forwarded.
        unsafe { by_codes::<true>(plan, out, j0, j1) }
    }

    /// The tiles compiled for each kind of code: with the kind a constant, the
    /// decoding has no branch and a step's loops are small enough to unroll,
    /// which keeps the accumulators in registers.
    #[inline(always)]
    unsafe fn by_codes<const WIDE: bool>(plan: &Plan<'_>, out: OutPtr<f32>, j0: usize, j1: usize) {
        // SAFETY (all): forwarded.
        unsafe {
            match plan.job.spec.codes {
                Codes::E4M3 => columns_impl::<WIDE, { code_index(Codes::E4M3) }>(plan, out, j0, j1),
                Codes::E2M1 => columns_impl::<WIDE, { code_index(Codes::E2M1) }>(plan, out, j0, j1),
                Codes::I8 => columns_impl::<WIDE, { code_index(Codes::I8) }>(plan, out, j0, j1),
                Codes::I4 => columns_impl::<WIDE, { code_index(Codes::I4) }>(plan, out, j0, j1),
            }
        }
    }

    /// R x C tiles (edge tiles narrower) of codes of kind `K` (`by_codes`).
    #[inline(always)]
    unsafe fn columns_impl<const WIDE: bool, const K: u8>(plan: &Plan<'_>, out: OutPtr<f32>, j0: usize, j1: usize) {
        let m = plan.job.m;
        // Built once per range: its byte tables cost more than a tile's products.
        let consts = Consts::new(plan.job.spec.codes);
        let c = &consts;
        // The effective scales of a tile's rows of W, one loop per tile.
        let ([b0, b1], k) = (plan.job.spec.block, plan.job.k);
        let cols = k.div_ceil(b1);
        let mut ws = tile_scales(TILE_C * cols);
        let mut j = j0;
        while j < j1 {
            let width = if j + TILE_C <= j1 { TILE_C } else { 1 };
            for (r, row) in ws.chunks_exact_mut(cols).take(width).enumerate() {
                plan.job.scales.get_many((j + r) / b0 * cols, row);
                // The next tile's, fetched while this one computes.
                plan.job.scales.prefetch((j + width + r) / b0 * cols, cols);
            }
            let ws = &ws[..];
            let mut i = 0;
            // SAFETY (all tiles): rows < m, columns j0..j1, as the caller's
            // contract; `ws` holds the tile's rows of scales.
            unsafe {
                if width == TILE_C {
                    while i + TILE_R <= m {
                        tile::<TILE_R, TILE_C, WIDE, K>(plan, c, ws, out, i, j);
                        i += TILE_R;
                    }
                    while i < m {
                        tile::<1, TILE_C, WIDE, K>(plan, c, ws, out, i, j);
                        i += 1;
                    }
                } else {
                    while i < m {
                        tile::<1, 1, WIDE, K>(plan, c, ws, out, i, j);
                        i += 1;
                    }
                }
            }
            j += width;
        }
    }

    /// The constants of the decoding, in registers for the whole tile.
    #[derive(Clone, Copy)]
    struct Consts {
        low7: __m512i,
        sign8: __m512i,
        e4m3_unit: __m512,
        nan: __m512,
        nibble_shifts: __m512i,
        low4: __m512i,
        /// The value of each of the 16 nibbles of a 4-bit code.
        nibble_values: __m512,
        /// The high and low bytes of the bf16 value of each E4M3 magnitude
        /// (codes 0..128; exact: E4M3 has 4 significant bits), 64 per register.
        e4m3_high: [__m512i; 2],
        e4m3_low: [__m512i; 2],
        /// The same for the 16 nibbles of a 4-bit code, repeated in each 128-bit lane.
        nibble_high: __m512i,
        nibble_low: __m512i,
        low_nibble: __m512i,
        high_nibble: __m512i,
        zero: __m512i,
    }

    impl Consts {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        fn new(codes: Codes) -> Consts {
            // Byte codes read no nibble table: any will do.
            let table: [f32; 16] = codes.nibble_values().unwrap_or([0.0; 16]);
            let bf16_bits = |c: usize| (e4m3(c as u8).to_bits() >> 16) as u16;
            let high: [u8; 128] = std::array::from_fn(|c| (bf16_bits(c) >> 8) as u8);
            let low: [u8; 128] = std::array::from_fn(|c| bf16_bits(c) as u8);
            // SAFETY: 64 bytes from offsets 0 and 64 of 128-byte local arrays.
            let halves = |t: &[u8; 128]| unsafe {
                [_mm512_loadu_si512(t.as_ptr().cast()), _mm512_loadu_si512(t[64..].as_ptr().cast())]
            };
            // Exact in bf16: E2M1 values and the integers -8..7 have at most 3 significant bits.
            let nibble_bits = |c: usize| (table[c % 16].to_bits() >> 16) as u16;
            let nibble_high: [u8; 64] = std::array::from_fn(|c| (nibble_bits(c) >> 8) as u8);
            let nibble_low: [u8; 64] = std::array::from_fn(|c| nibble_bits(c) as u8);
            Consts {
                // SAFETY: 64 bytes of local arrays.
                nibble_high: unsafe { _mm512_loadu_si512(nibble_high.as_ptr().cast()) },
                // SAFETY: as above.
                nibble_low: unsafe { _mm512_loadu_si512(nibble_low.as_ptr().cast()) },
                low_nibble: _mm512_set1_epi16(0x0F),
                high_nibble: _mm512_set1_epi16(0x0F00),
                e4m3_high: halves(&high),
                e4m3_low: halves(&low),
                zero: _mm512_setzero_si512(),
                low7: _mm512_set1_epi32(0x7F),
                sign8: _mm512_set1_epi32(0x80),
                e4m3_unit: _mm512_set1_ps(2f32.powi(120)),
                nan: _mm512_set1_ps(f32::NAN),
                nibble_shifts: _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0),
                low4: _mm512_set1_epi32(0xF),
                // SAFETY: 16 f32 in a local array.
                nibble_values: unsafe { _mm512_loadu_ps(table.as_ptr()) },
            }
        }

        /// 16 weights of a row from element `p` on, decoded and scaled by `s`.
        ///
        /// # Safety
        /// The codes of elements `p..p + 16` must be inside `row`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn weights(&self, codes: &Codes, row: *const u8, p: usize, s: __m512) -> __m512 {
            match codes {
                Codes::E4M3 => {
                    // SAFETY: 16 bytes from p, inside the row by the caller's contract.
                    let c = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(row.add(p).cast()) });
                    let mag = _mm512_and_si512(c, self.low7);
                    let v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<20>(mag)), self.e4m3_unit);
                    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(c, self.sign8));
                    let v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
                    let nan = _mm512_cmpeq_epi32_mask(mag, self.low7);
                    _mm512_mul_ps(_mm512_mask_mov_ps(v, nan, self.nan), s)
                }
                Codes::E2M1 | Codes::I4 => {
                    // SAFETY: 8 bytes (16 codes) from p / 2, inside the row by the
                    // caller's contract (p is even: a multiple of 16).
                    let b = unsafe { _mm_loadl_epi64(row.add(p / 2).cast()) };
                    // Each byte twice, then lane 2j keeps the low nibble, 2j + 1 the high.
                    let twice = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
                    let idx = _mm512_and_si512(_mm512_srlv_epi32(twice, self.nibble_shifts), self.low4);
                    _mm512_mul_ps(_mm512_permutexvar_ps(idx, self.nibble_values), s)
                }
                Codes::I8 => {
                    // SAFETY: 16 bytes from p, inside the row by the caller's contract.
                    let c = _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(row.add(p).cast()) });
                    _mm512_mul_ps(_mm512_cvtepi32_ps(c), s)
                }
            }
        }
    }

    impl Consts {
        /// 64 weights of a row from element `p` on, decoded and scaled by `s`
        /// (lane `l` scaling elements `p + 16 l ..`), in the order of
        /// `permute_rows`. Each code picks the bytes of its bf16 value from
        /// tables (an E4M3 magnitude from two of 128 bytes, 0x7F giving NaN,
        /// its sign bit joining the high byte; an E2M1 code, sign included,
        /// from 16), and bf16 becomes f32 by moving into the high half of a
        /// 32-bit lane.
        ///
        /// # Safety
        /// Elements `p..p + 64` must be inside `row`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
        unsafe fn weights_wide(&self, codes: &Codes, row: *const u8, p: usize, s: __m512) -> [__m512; 4] {
            let (low, high) = match codes {
                Codes::E4M3 => {
                    // SAFETY: 64 bytes from p, inside the row by the caller's contract.
                    let c = unsafe { _mm512_loadu_si512(row.add(p).cast()) };
                    let [h0, h1] = self.e4m3_high;
                    let [l0, l1] = self.e4m3_low;
                    // Bit 7 of each index is ignored: 128 entries.
                    let high = _mm512_permutex2var_epi8(h0, c, h1);
                    let low = _mm512_permutex2var_epi8(l0, c, l1);
                    // high | (c & 0x80): the sign.
                    (low, _mm512_ternarylogic_epi32::<0xF8>(high, c, _mm512_set1_epi8(-128)))
                }
                Codes::E2M1 | Codes::I4 => {
                    // SAFETY: 32 bytes (64 codes) from p / 2, inside the row by the
                    // caller's contract (p is a multiple of 64).
                    let b = _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(row.add(p / 2).cast()) });
                    // Byte 2j: element 2j's code (the low nibble), byte 2j + 1: the high.
                    let c = _mm512_or_si512(
                        _mm512_and_si512(b, self.low_nibble),
                        _mm512_and_si512(_mm512_slli_epi16::<4>(b), self.high_nibble),
                    );
                    (_mm512_shuffle_epi8(self.nibble_low, c), _mm512_shuffle_epi8(self.nibble_high, c))
                }
                // SAFETY: forwarded (64 bytes from p).
                Codes::I8 => return unsafe { Self::int8_wide(row, p, s) },
            };
            let w0 = _mm512_unpacklo_epi8(low, high);
            let w1 = _mm512_unpackhi_epi8(low, high);
            let f = |w| _mm512_castsi512_ps(w);
            [
                _mm512_mul_ps(f(_mm512_unpacklo_epi16(self.zero, w0)), s),
                _mm512_mul_ps(f(_mm512_unpackhi_epi16(self.zero, w0)), s),
                _mm512_mul_ps(f(_mm512_unpacklo_epi16(self.zero, w1)), s),
                _mm512_mul_ps(f(_mm512_unpackhi_epi16(self.zero, w1)), s),
            ]
        }
    }

    impl Consts {
        /// 64 int8 weights from element `p` on, scaled by `s`, in the order
        /// of `weights_wide`: sign-extended by unpacking with their sign
        /// bytes, as the bf16 values there are unpacked.
        ///
        /// # Safety
        /// Elements `p..p + 64` must be inside `row`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn int8_wide(row: *const u8, p: usize, s: __m512) -> [__m512; 4] {
            // SAFETY: 64 bytes from p, inside the row by the caller's contract.
            let c = unsafe { _mm512_loadu_si512(row.add(p).cast()) };
            let sign = _mm512_movm_epi8(_mm512_movepi8_mask(c));
            let (w0, w1) = (_mm512_unpacklo_epi8(c, sign), _mm512_unpackhi_epi8(c, sign));
            let (s0, s1) = (_mm512_srai_epi16::<15>(w0), _mm512_srai_epi16::<15>(w1));
            let f = |w| _mm512_mul_ps(_mm512_cvtepi32_ps(w), s);
            [
                f(_mm512_unpacklo_epi16(w0, s0)),
                f(_mm512_unpackhi_epi16(w0, s0)),
                f(_mm512_unpacklo_epi16(w1, s1)),
                f(_mm512_unpackhi_epi16(w1, s1)),
            ]
        }
    }

    /// The R x C outputs of rows `i..i + R` and columns `j..j + C`.
    ///
    /// # Safety
    /// Rows `i + r < m`, columns `j + c` in the caller's range.
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize, const WIDE: bool, const K: u8>(
        plan: &Plan<'_>,
        consts: &Consts,
        ws: &[f32],
        out: OutPtr<f32>,
        i: usize,
        j: usize,
    ) {
        // A copy: the constants stay in registers across the tile.
        let consts = *consts;
        let (job, row_bytes) = (&plan.job, plan.row_bytes);
        let (k, spec, codes) = (job.k, job.spec, code_of(K));
        let b1 = spec.block[1];
        let scale_cols = k.div_ceil(b1);
        let xs: [&[f32]; R] = std::array::from_fn(|r| &job.x[(i + r) * k..][..k]);
        let rows: [&[u8]; C] = std::array::from_fn(|c| &job.codes[(j + c) * row_bytes..][..row_bytes]);
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let steps = k / STEP;
        let ws: [&[f32]; C] = std::array::from_fn(|c| &ws[c * scale_cols..][..scale_cols]);
        let scale = |c: usize, st: usize| ws[c][plan.step_blocks[st]];
        let (full, mut p) = (steps * STEP, 0);
        // The codes of the next tile's rows, fetched while this tile computes
        // (`wrapping_add`: past the last row it is an address, never read).
        let ahead: [*const u8; C] = std::array::from_fn(|c| rows[c].as_ptr().wrapping_add(C * row_bytes));
        let nibbles = codes.packed_in_nibbles();
        if WIDE {
            while p + super::WIDE <= k {
                let at = if nibbles { p / 2 } else { p };
                for a in ahead {
                    // SAFETY: a prefetch reads nothing and cannot fault, whatever the address.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(at).cast()) };
                }
                let st = p / STEP;
                // Plain loops in this loop: closures do not inherit the target
                // features, and their intrinsics would be calls (measured: a
                // decoding step 2x slower when a change elsewhere tipped LLVM's inlining).
                // The chunk of each row of `x`, loaded once for the C rows of W.
                let mut xv = [[_mm512_setzero_ps(); 4]; R];
                for (r, xv) in xv.iter_mut().enumerate() {
                    for (v, xv) in xv.iter_mut().enumerate() {
                        // SAFETY: 16 f32 from p + 16 v, inside the row's chunk p..p + 64.
                        *xv = unsafe { _mm512_loadu_ps(xs[r].as_ptr().add(p + 16 * v)) };
                    }
                }
                for c in 0..C {
                    // Lane l of a wide step's weights holds elements p + 16 l ..: their scale.
                    let [s0, s1, s2, s3] = [scale(c, st), scale(c, st + 1), scale(c, st + 2), scale(c, st + 3)];
                    let s = _mm512_set_ps(s3, s3, s3, s3, s2, s2, s2, s2, s1, s1, s1, s1, s0, s0, s0, s0);
                    // SAFETY: elements p..p + 64 <= k of each row; WIDE only with VBMI.
                    let w = unsafe { consts.weights_wide(&codes, rows[c].as_ptr(), p, s) };
                    for (acc, xv) in acc.iter_mut().zip(&xv) {
                        for (&xv, &w) in xv.iter().zip(&w) {
                            acc[c] = _mm512_fmadd_ps(xv, w, acc[c]);
                        }
                    }
                }
                p += super::WIDE;
            }
        }
        while p < full {
            let mut w = [_mm512_setzero_ps(); C];
            for (c, w) in w.iter_mut().enumerate() {
                let s = _mm512_set1_ps(scale(c, p / STEP));
                // SAFETY: elements p..p + 16 <= k of a row of `row_bytes` bytes.
                *w = unsafe { consts.weights(&codes, rows[c].as_ptr(), p, s) };
            }
            for r in 0..R {
                // SAFETY: 16 f32 from p < k - 15 of a row of k.
                let xv = unsafe { _mm512_loadu_ps(xs[r].as_ptr().add(p)) };
                for c in 0..C {
                    acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
                }
            }
            p += STEP;
        }
        let p = steps * STEP;
        if p < k {
            // The last elements one by one into a zeroed step.
            let w: [__m512; C] = std::array::from_fn(|c| {
                let mut v = [0f32; STEP];
                for (q, v) in v.iter_mut().enumerate().take(k - p) {
                    let e = p + q;
                    *v = code_value(codes, rows[c], e) * ws[c][e / b1];
                }
                // SAFETY: 16 f32 in a local array.
                unsafe { _mm512_loadu_ps(v.as_ptr()) }
            });
            for r in 0..R {
                let mut v = [0f32; STEP];
                v[..k - p].copy_from_slice(&xs[r][p..]);
                // SAFETY: 16 f32 in a local array.
                let xv = unsafe { _mm512_loadu_ps(v.as_ptr()) };
                for c in 0..C {
                    acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (c, &v) in acc.iter().enumerate() {
                // SAFETY: row i + r < m, column j + c < n in this call's range,
                // written by this call only (the caller's contract).
                unsafe { *out.get().add((i + r) * job.n + j + c) = _mm512_reduce_add_ps(v) };
            }
        }
    }
}
