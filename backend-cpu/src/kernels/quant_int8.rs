//! Quantized products with int8 activations (Note [Int8 activations] in
//! kiln-tensor): the input rows rounded once per call, and, for a few rows
//! where the CPU has AVX512-VNNI, integer products of their codes with W's
//! (Note [Integer products of int8 activations]).
// Only x86-64 has the instructions the integer products use; elsewhere the
// rounded rows go through the float products.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]
use super::iter::{column_ranges, OutPtr};
use super::quant::Scales;
use super::simd::{level, Level};
use kiln_tensor::quant::{round_activation_block, Codes, QuantSpec, ACTIVATION_BLOCK};

// Note [Integer products of int8 activations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Once a row of `x` is int8 codes `q` with a scale per 32 elements, its
// product with a row of integer codes is a sum of small integer products,
// which `vpdpbusd` forms 64 at a time: unsigned bytes (W's) times signed
// bytes (x's), four adjacent products summed into each of 16 int32 lanes. A
// step is 64 elements: lane `l` holds elements `4 l .. 4 l + 4`, so it lies
// in one block of `x` (32 elements) and in one block of W when W's blocks are
// a divisor or a multiple of 64 elements wide and a multiple of 4 (or cover
// the whole depth): then each lane's integer sum, converted (exactly: it is
// below 2^17), times its two scales is added to a float32 accumulator.
//
// W's codes are made unsigned bytes `u` with a fixed offset `o`, `value = (u
// - o) / h`: int8 codes flip their sign bit (`o` = 128, `h` = 1); 4-bit
// integers are their nibbles (`o` = 8); an E2M1 code picks `2 v + 12` from a
// table of 16 (`o` = 12, `h` = 2: every E2M1 value doubled is an integer).
// So `sum(q * value) = (sum(q * u) - o * sum(q)) / h`: the lane sums of `q`
// times `-o` are computed once per call and start each lane's sum, and `1 /
// h` (exact) multiplies each output at the end. The nibbles of 32 bytes are
// spread in element order by widening each byte to 16 bits and merging it
// with itself shifted by 4 (`(b << 4 | b) & 0x0F0F`).
//
// Past the depth, `q` is zero (rows are padded to whole steps) and W's codes
// are read with a byte mask (bytes past a row are never touched). Each
// output's bits depend on its row of `x`, its row of W and k only: these
// products are row-invariant. Tiles of R rows of `x` by C rows of W, with the
// next tile's codes prefetched, as Note [Codes decoded in the registers].

/// Elements per step (one register of bytes).
const STEP: usize = 64;

/// Rows of `x` rounded to int8 (Note [Int8 activations]): codes padded with
/// zeros to whole steps, and the scale of every block.
pub(super) struct Int8Rows {
    m: usize,
    k: usize,
    /// Elements per padded row (a multiple of `STEP`).
    kp: usize,
    /// `m x kp` codes.
    q: Vec<i8>,
    /// `m x blocks` scales (`blocks = ceil(k / 32)`).
    d: Vec<f32>,
}

impl Int8Rows {
    /// Rounds float32 rows `m x k`.
    pub(super) fn round(x: &[f32], m: usize, k: usize) -> Int8Rows {
        let kp = k.next_multiple_of(STEP);
        let blocks = k.div_ceil(ACTIVATION_BLOCK);
        let mut q = vec![0i8; m * kp];
        let mut d = vec![0f32; m * blocks];
        if k > 0 {
            for ((row, qr), dr) in
                x[..m * k].chunks_exact(k).zip(q.chunks_exact_mut(kp)).zip(d.chunks_exact_mut(blocks))
            {
                for ((xb, qb), db) in row.chunks(ACTIVATION_BLOCK).zip(qr.chunks_mut(ACTIVATION_BLOCK)).zip(dr) {
                    *db = round_activation_block(xb, &mut qb[..xb.len()]);
                }
            }
        }
        Int8Rows { m, k, kp, q, d }
    }

    /// The rounded rows as float32 values `q * d`, `m x k`: the input of every
    /// other product.
    pub(super) fn values(&self) -> Vec<f32> {
        let (k, blocks) = (self.k, self.k.div_ceil(ACTIVATION_BLOCK));
        let mut out = vec![0f32; self.m * k];
        if k == 0 {
            return out;
        }
        for ((o, qr), dr) in out.chunks_exact_mut(k).zip(self.q.chunks_exact(self.kp)).zip(self.d.chunks_exact(blocks))
        {
            for (e, o) in o.iter_mut().enumerate() {
                *o = qr[e] as f32 * dr[e / ACTIVATION_BLOCK];
            }
        }
        out
    }
}

/// Whether this CPU has the integer products (detected once).
fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| level() == Level::Avx512 && is_x86_feature_detected!("avx512vnni"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// W's codes as unsigned bytes: `value = (u - offset) / halves`.
fn offset(codes: Codes) -> Option<(i32, f32)> {
    match codes {
        Codes::I8 => Some((128, 1.0)),
        Codes::I4 => Some((8, 1.0)),
        Codes::E2M1 => Some((12, 2.0)),
        // Not integers: these products take the rounded rows as floats.
        Codes::E4M3 => None,
    }
}

/// Whether the integer products serve `spec` at depth `k` on this CPU (Note
/// [Integer products of int8 activations]).
pub(super) fn applies(spec: &QuantSpec, k: usize) -> bool {
    let b1 = spec.block[1];
    let lanes_in_blocks = b1 >= k || (b1.is_multiple_of(4) && (STEP.is_multiple_of(b1) || b1.is_multiple_of(STEP)));
    vnni() && offset(spec.codes).is_some() && b1 > 0 && lanes_in_blocks
}

/// One product: `x` rounded, W `n x k` as `spec`'s codes and scales; the
/// result goes to `out[i * n + j]`.
pub(super) struct Int8Dot<'a> {
    pub spec: &'a QuantSpec,
    pub codes: &'a [u8],
    pub scales: &'a Scales<'a>,
    pub x: &'a Int8Rows,
    pub n: usize,
}

/// A product ready to run: per row of `x` and step, each lane's sum of `q`
/// times `-offset` and its block's scale.
struct Plan<'a> {
    job: &'a Int8Dot<'a>,
    start: Vec<i32>,
    dx: Vec<f32>,
    row_bytes: usize,
    halves: f32,
}

impl Int8Dot<'_> {
    /// Writes every `out[i * n + j]` (`out` holds `m * n` elements); panics
    /// (before any read) when an operand is shorter than its shape, or when
    /// [`applies`] says no.
    pub(super) fn run(&self, out: &mut [f32]) {
        let (spec, x, n) = (self.spec, self.x, self.n);
        let (m, k, kp) = (x.m, x.k, x.kp);
        assert!(applies(spec, k), "quant_int8: not for this CPU or block");
        let (offset, halves) = offset(spec.codes).expect("applies: integer codes");
        assert_eq!(out.len(), m * n, "quant_int8: output of the wrong size");
        let nibbles = spec.codes.packed_in_nibbles();
        assert!(!nibbles || k.is_multiple_of(2), "quant_int8: odd depth of 4-bit codes");
        let row_bytes = if nibbles { k / 2 } else { k };
        assert!(self.codes.len() >= n * row_bytes, "quant_int8: codes too short");
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            // Sums over no columns (and tiles would hold no scales).
            out.fill(0.0);
            return;
        }
        let blocks = k.div_ceil(ACTIVATION_BLOCK);
        let lanes = m * kp / 4;
        let (mut start, mut dx) = (vec![0i32; lanes], vec![0f32; lanes]);
        for (l, (s, d)) in start.iter_mut().zip(&mut dx).enumerate() {
            let (i, e) = (l / (kp / 4), 4 * (l % (kp / 4)));
            let q = &x.q[i * kp + e..][..4];
            *s = -offset * q.iter().map(|&v| v as i32).sum::<i32>();
            let b = e / ACTIVATION_BLOCK;
            // Lanes past the depth hold q = 0: a zero scale keeps them 0.
            *d = if b < blocks { x.d[i * blocks + b] } else { 0.0 };
        }
        let plan = Plan { job: self, start, dx, row_bytes, halves };
        let out = OutPtr(out.as_mut_ptr());
        column_ranges(m, n, k, TILE_C, |j0, j1| {
            // SAFETY: the asserts bound every read (x rows < m, code rows < n);
            // columns j0..j1 of each output row are written by this call only (the
            // ranges handed out are disjoint) and lie inside `out`; `applies`
            // confirmed AVX-512 with VNNI.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                x86::columns(&plan, out, j0, j1)
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (j0, j1, &plan);
        });
    }
}

/// Rows of `x` and of W per tile.
const TILE_R: usize = 4;
const TILE_C: usize = 4;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Plan, STEP, TILE_C, TILE_R};
    use crate::kernels::iter::OutPtr;
    use crate::kernels::quant::{code_index, code_of, tile_scales};
    use kiln_tensor::quant::Codes;
    use std::arch::x86_64::*;

    /// Columns `j0..j1` of every row, in R x C tiles (edge tiles narrower).
    ///
    /// # Safety
    /// As the closure in [`super::Int8Dot::run`] argues.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn columns(plan: &Plan<'_>, out: OutPtr<f32>, j0: usize, j1: usize) {
        // Compiled for each kind of code, as Note [Codes decoded in the
        // registers]'s tiles are: no branch on the kind inside a step.
        // SAFETY (all): forwarded.
        unsafe {
            match plan.job.spec.codes {
                Codes::I8 => columns_of::<{ code_index(Codes::I8) }>(plan, out, j0, j1),
                Codes::I4 => columns_of::<{ code_index(Codes::I4) }>(plan, out, j0, j1),
                Codes::E2M1 => columns_of::<{ code_index(Codes::E2M1) }>(plan, out, j0, j1),
                Codes::E4M3 => unreachable!("applies: integer codes only"),
            }
        }
    }

    /// [`columns`] for codes of kind `K`.
    #[inline(always)]
    unsafe fn columns_of<const K: u8>(plan: &Plan<'_>, out: OutPtr<f32>, j0: usize, j1: usize) {
        let m = plan.job.x.m;
        let consts = Consts::new();
        // The effective scales of a tile's rows of W, zero past the last block.
        let b1 = plan.job.spec.block[1];
        let per_row = plan.job.x.kp.div_ceil(b1);
        let mut ws = tile_scales(TILE_C * per_row);
        let mut j = j0;
        while j < j1 {
            let c = if j + TILE_C <= j1 { TILE_C } else { 1 };
            fill_scales(plan, j, c, per_row, &mut ws);
            let mut i = 0;
            // SAFETY (all tiles): rows < m, columns j..j + c in j0..j1, as the
            // caller's contract; `ws` holds c rows of `per_row` scales.
            unsafe {
                if c == TILE_C {
                    while i + TILE_R <= m {
                        tile::<TILE_R, TILE_C, K>(plan, &consts, &ws, per_row, out, i, j);
                        i += TILE_R;
                    }
                    while i < m {
                        tile::<1, TILE_C, K>(plan, &consts, &ws, per_row, out, i, j);
                        i += 1;
                    }
                } else {
                    while i < m {
                        tile::<1, 1, K>(plan, &consts, &ws, per_row, out, i, j);
                        i += 1;
                    }
                }
            }
            j += c;
        }
    }

    /// The effective scales of W's rows `j..j + c`, `per_row` each.
    fn fill_scales(plan: &Plan<'_>, j: usize, c: usize, per_row: usize, ws: &mut [f32]) {
        let job = plan.job;
        let ([b0, b1], k) = (job.spec.block, job.x.k);
        let cols = k.div_ceil(b1);
        for (r, row) in ws.chunks_exact_mut(per_row).take(c).enumerate() {
            let (real, past) = row.split_at_mut(cols);
            job.scales.get_many((j + r) / b0 * cols, real);
            past.fill(0.0);
        }
    }

    /// The constants of the decoding, in registers for the whole tile.
    struct Consts {
        /// Flips an int8 code's sign bit: `u = c + 128`.
        sign: __m512i,
        /// `(b << 4 | b) & 0x0F0F` spreads a 16-bit lane's two nibbles.
        nibbles: __m512i,
        /// `2 v + 12` of each E2M1 code, in each 128-bit lane.
        e2m1: __m512i,
    }

    impl Consts {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        fn new() -> Consts {
            let values = Codes::E2M1.nibble_values().expect("E2M1 codes are nibbles");
            let table: [i8; 64] = std::array::from_fn(|c| (2.0 * values[c % 16]) as i8 + 12);
            Consts {
                sign: _mm512_set1_epi8(-128),
                nibbles: _mm512_set1_epi16(0x0F0F),
                // SAFETY: 64 bytes of a local array.
                e2m1: unsafe { _mm512_loadu_si512(table.as_ptr().cast()) },
            }
        }

        /// The 64 codes of a row from element `p` on as unsigned bytes, in
        /// element order; only the row's first `valid` bytes from there are read.
        ///
        /// # Safety
        /// `row` holds at least `valid` bytes from the step's first byte.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn codes(&self, codes: Codes, row: *const u8, p: usize, valid: usize) -> __m512i {
            match codes {
                Codes::I8 => {
                    let at = row.wrapping_add(p);
                    // SAFETY: 64 bytes from p when the step is whole, else the first
                    // `valid` under a mask (masked bytes are never read).
                    let c = unsafe {
                        if valid >= STEP {
                            _mm512_loadu_si512(at.cast())
                        } else {
                            _mm512_maskz_loadu_epi8(mask64(valid), at.cast())
                        }
                    };
                    _mm512_xor_si512(c, self.sign)
                }
                Codes::I4 | Codes::E2M1 => {
                    let at = row.wrapping_add(p / 2);
                    // SAFETY: as above, 32 bytes (64 codes) from p / 2.
                    let b = unsafe {
                        if valid >= STEP / 2 {
                            _mm256_loadu_si256(at.cast())
                        } else {
                            _mm256_maskz_loadu_epi8(mask64(valid) as u32, at.cast())
                        }
                    };
                    let w = _mm512_cvtepu8_epi16(b);
                    // (A | B) & C: 0xF0 | 0xCC = 0xFC, & 0xAA = 0xA8.
                    let u = _mm512_ternarylogic_epi32::<0xA8>(_mm512_slli_epi16::<4>(w), w, self.nibbles);
                    match codes {
                        Codes::E2M1 => _mm512_shuffle_epi8(self.e2m1, u),
                        _ => u,
                    }
                }
                Codes::E4M3 => unreachable!("applies: integer codes only"),
            }
        }
    }

    /// The first `n` bits set (n < 64).
    #[inline(always)]
    fn mask64(n: usize) -> u64 {
        (1u64 << n) - 1
    }

    /// The R x C outputs of rows `i..i + R` and columns `j..j + C`.
    ///
    /// # Safety
    /// Rows `i + r < m`, columns `j + c` in the caller's range; `ws` holds C
    /// rows of `per_row` scales.
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize, const K: u8>(
        plan: &Plan<'_>,
        consts: &Consts,
        ws: &[f32],
        per_row: usize,
        out: OutPtr<f32>,
        i: usize,
        j: usize,
    ) {
        let job = plan.job;
        let codes = code_of(K);
        let (x, row_bytes) = (job.x, plan.row_bytes);
        let (k, kp, b1) = (x.k, x.kp, job.spec.block[1]);
        let rows: [*const u8; C] = std::array::from_fn(|c| job.codes[(j + c) * row_bytes..].as_ptr());
        let ahead = rows.map(|r| r.wrapping_add(C * row_bytes));
        let nibbles = codes.packed_in_nibbles();
        // Blocks of W per step when they are narrower than a step, and the
        // block of each lane among them.
        let narrow = b1 < STEP && b1 < k;
        let per_step = if narrow { STEP / b1 } else { 1 };
        // Lane l's first element is 4 l; narrow blocks are 4, 8, 16 or 32 wide.
        let lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        let shift = _mm512_set1_epi32(if narrow { b1.trailing_zeros() as i32 } else { 31 });
        let lane_block = _mm512_srlv_epi32(_mm512_slli_epi32::<2>(lanes), shift);
        let scale_mask: u16 = if per_step >= 16 { u16::MAX } else { (1u16 << per_step) - 1 };
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut p = 0;
        while p < kp {
            let s = p / STEP;
            let at = if nibbles { p / 2 } else { p };
            for a in ahead {
                // SAFETY: a prefetch reads nothing and cannot fault, whatever the address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(at).cast()) };
            }
            let valid = row_bytes - at;
            // Plain loops: closures would not inherit this function's target features.
            let mut w = [_mm512_setzero_si512(); C];
            let mut dw = [_mm512_setzero_ps(); C];
            for c in 0..C {
                // SAFETY: each row holds `row_bytes` bytes, `valid` of them from `at`.
                w[c] = unsafe { consts.codes(codes, rows[c], p, valid) };
                let row = &ws[c * per_row..][..per_row];
                dw[c] = if narrow {
                    // SAFETY: blocks s * per_step .. + per_step <= per_row (b1 divides kp).
                    let v = unsafe { _mm512_maskz_loadu_ps(scale_mask, row.as_ptr().add(s * per_step)) };
                    _mm512_permutexvar_ps(lane_block, v)
                } else {
                    _mm512_set1_ps(row[p / b1])
                };
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let lane0 = ((i + r) * kp + p) / 4;
                // SAFETY: row i + r < m of `q` (kp bytes) and of the lane data
                // (kp / 4 each), 64 bytes / 16 lanes from p.
                let (q, start, dx) = unsafe {
                    (
                        _mm512_loadu_si512(x.q.as_ptr().add((i + r) * kp + p).cast()),
                        _mm512_loadu_si512(plan.start.as_ptr().add(lane0).cast()),
                        _mm512_loadu_ps(plan.dx.as_ptr().add(lane0)),
                    )
                };
                for c in 0..C {
                    let sum = _mm512_dpbusd_epi32(start, w[c], q);
                    let t = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dx);
                    acc[c] = _mm512_fmadd_ps(t, dw[c], acc[c]);
                }
            }
            p += STEP;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (c, &v) in acc.iter().enumerate() {
                // SAFETY: row i + r < m, column j + c < n in this call's range,
                // written by this call only (the caller's contract).
                unsafe { *out.get().add((i + r) * job.n + j + c) = _mm512_reduce_add_ps(v) / plan.halves };
            }
        }
    }
}
