//! f32 products `a @ w.T` with `w` row-major (the Linear layout, `x @ W.T`)
//! computed as dot products of rows (Note [Dot-product products]).
// Only x86-64 has the vector units this way uses; elsewhere `try_run` declines.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]
use super::matmul::Gemm;
use super::simd::{level, Level};
use pulp::Simd;

// Note [Dot-product products]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A product `x @ W.T` with `W` row-major `[n, k]` is, element by element, the
// dot product of row i of `x` and row j of `W`, both contiguous in memory.
// gemm computes it with its microkernels, which need `W` re-laid-out into
// panels: for every call it packs the whole weight (a transposition, as the
// row-major output makes `W` its left operand), and for a few rows that costs
// more than the multiply-adds it serves (in the serving engine's decode steps,
// packing took more samples than gemm's microkernel).
//
// Such products run here instead, on `pulp`'s vector types: a tile of R rows
// of `x` by C rows of `W` keeps R x C vector accumulators, each lane the
// partial sum of the terms whose index is that lane modulo the vector width;
// every step loads one vector of each of the R + C rows and does R x C fused
// multiply-adds; a last step loads the k % width remaining terms (zeros
// beyond), and each accumulator is summed by pulp's fixed halving tree. Rows
// of `x` go in blocks that stay in cache while the block runs through all of
// `W`, so `W` streams from memory once per block. Nothing is packed.
//
// Each element's bits depend on k, the vector width and its two rows only:
// not on the tile, the block, the other rows or the thread split, so these
// products are row-invariant by construction (Note [Row-invariant products]).
// With batch invariance on, every such product of depth at least `MIN_DEPTH`
// runs here whatever its row count (a left operand that is not row-major is
// copied first); with it off, those of at most `MAX_ROWS` rows with a
// row-major left operand do. That is where this way wins: in interleaved runs
// of `x @ W.T` through `Tensor::matmul` on two threads (depth 384 and 1024,
// 384 to 8192 columns), it ran at 2-4x gemm's speed with 4 to 16 rows,
// 0.95-2.6x with 32, 0.8-2.1x with 48, and 0.5-1.0x from 64 rows on, where
// gemm's packed panels are read from L1 while the rows of a block here come
// from L2 for every tile of columns.
//
// Depth below `MIN_DEPTH` (attention's head sizes) stays with gemm: there the
// final sums, a few shuffles and adds per element, cost as much as the
// multiply-adds. It needs AVX2 + FMA (8 lanes) or AVX-512 (16 lanes); on
// other CPUs everything stays with gemm.

/// Products of at least this depth run here (Note [Dot-product products]).
const MIN_DEPTH: usize = 256;
/// With batch invariance off, products of at most this many rows run here.
const MAX_ROWS: usize = 32;
/// Rows of `x` per block: the block's rows take at most this many elements.
const BLOCK_ELEMS: usize = 1 << 16;

/// Runs `g` here when Note [Dot-product products] says so; false (and
/// nothing touched) when it stays with gemm.
///
/// # Safety
/// As [`Gemm::run`].
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn try_run(g: &Gemm<f32>) -> bool {
    let invariant = kiln_tensor::is_batch_invariant();
    if g.b_rs != 1 || g.k < MIN_DEPTH || g.m == 0 || g.n == 0 {
        return false;
    }
    if !invariant && (g.a_cs != 1 || g.m > MAX_ROWS) {
        return false;
    }
    // The vector unit, chosen as the rest of the crate's kernels choose theirs.
    enum Unit {
        V4(pulp::x86::V4),
        V3(pulp::x86::V3),
    }
    let unit = match level() {
        Level::Avx512 => pulp::x86::V4::try_new().map(Unit::V4),
        Level::Avx2 => pulp::x86::V3::try_new().map(Unit::V3),
        Level::Baseline => None,
    };
    let Some(unit) = unit else {
        return false;
    };
    // The left operand row by row: in place when row-major, else copied.
    let copy: Vec<f32>;
    let (a, a_rs) = if g.a_cs == 1 {
        (g.a, g.a_rs)
    } else {
        let mut v = Vec::with_capacity(g.m * g.k);
        for i in 0..g.m {
            // SAFETY: i < m and p < k: readable by the caller's contract.
            v.extend((0..g.k).map(|p| unsafe { *g.a.add(i * g.a_rs + p * g.a_cs) }));
        }
        copy = v;
        (copy.as_ptr(), g.k)
    };
    // SAFETY (both slices): rows i < m of `a` are read at `a + i * a_rs + p`
    // (p < k) and rows j < n of `w` at `b + j * b_cs + p`, readable by the
    // caller's contract (or inside `copy`), so the spans up to the last
    // row's end are; nothing writes them during the call (`dst` overlaps
    // neither).
    let x = unsafe { std::slice::from_raw_parts(a, (g.m - 1) * a_rs + g.k) };
    let w = unsafe { std::slice::from_raw_parts(g.b, (g.n - 1) * g.b_cs + g.k) };
    let job = Job { x, x_rs: a_rs, w, g };
    match unit {
        Unit::V4(s) => s.vectorize(|| job.run::<_, 6, 4>(s)),
        Unit::V3(s) => s.vectorize(|| job.run::<_, 2, 4>(s)),
    }
    true
}

/// Elsewhere everything stays with gemm.
///
/// # Safety
/// As [`Gemm::run`].
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn try_run(_: &Gemm<f32>) -> bool {
    false
}

/// One product: `x` rows at stride `x_rs` (`g`'s left operand, or its copy),
/// `w` rows at `g`'s stride `b_cs`; sizes, destination, scale and accumulate
/// flag are `g`'s.
struct Job<'a> {
    x: &'a [f32],
    x_rs: usize,
    w: &'a [f32],
    g: &'a Gemm<f32>,
}

impl Job<'_> {
    /// The product with R x C tiles (edge tiles narrower), blocks of rows outermost.
    #[inline(always)]
    fn run<S: Simd, const R: usize, const C: usize>(&self, s: S) {
        let Gemm { m, n, k, .. } = *self.g;
        let rows_per_block = (BLOCK_ELEMS / k).max(R) / R * R;
        let mut i0 = 0;
        while i0 < m {
            let i1 = (i0 + rows_per_block).min(m);
            let mut j = 0;
            while j < n {
                if j + C <= n {
                    self.columns::<S, R, C>(s, i0, i1, j);
                    j += C;
                } else {
                    self.columns::<S, R, 1>(s, i0, i1, j);
                    j += 1;
                }
            }
            i0 = i1;
        }
    }

    /// Rows `i0..i1` against the C rows of `w` from `j`.
    #[inline(always)]
    fn columns<S: Simd, const R: usize, const C: usize>(&self, s: S, i0: usize, i1: usize, j: usize) {
        let (k, w_rs) = (self.g.k, self.g.b_cs);
        let ws: [&[f32]; C] = std::array::from_fn(|c| &self.w[(j + c) * w_rs..][..k]);
        let mut i = i0;
        while i + R <= i1 {
            self.tile::<S, R, C>(s, i, j, ws);
            i += R;
        }
        while i < i1 {
            self.tile::<S, 1, C>(s, i, j, ws);
            i += 1;
        }
    }

    /// The R x C outputs of rows `i..i + R` and columns `j..j + C`.
    #[inline(always)]
    fn tile<S: Simd, const R: usize, const C: usize>(&self, s: S, i: usize, j: usize, ws: [&[f32]; C]) {
        let xs: [(&[S::f32s], &[f32]); R] =
            std::array::from_fn(|r| S::as_simd_f32s(&self.x[(i + r) * self.x_rs..][..self.g.k]));
        let wv: [(&[S::f32s], &[f32]); C] = ws.map(|w| S::as_simd_f32s(w));
        let steps = xs[0].0.len();
        let zero = s.splat_f32s(0.0);
        let mut acc = [[zero; C]; R];
        for p in 0..steps {
            let wp: [S::f32s; C] = std::array::from_fn(|c| wv[c].0[p]);
            for r in 0..R {
                let xp = xs[r].0[p];
                for c in 0..C {
                    acc[r][c] = s.mul_add_f32s(xp, wp[c], acc[r][c]);
                }
            }
        }
        if !xs[0].1.is_empty() {
            let wp: [S::f32s; C] = std::array::from_fn(|c| s.partial_load_f32s(wv[c].1));
            for r in 0..R {
                let xp = s.partial_load_f32s(xs[r].1);
                for c in 0..C {
                    acc[r][c] = s.mul_add_f32s(xp, wp[c], acc[r][c]);
                }
            }
        }
        let g = self.g;
        for (r, acc) in acc.iter().enumerate() {
            for (c, &v) in acc.iter().enumerate() {
                let sum = s.reduce_sum_f32s(v) * g.scale;
                // SAFETY: i + r < m and j + c < n: the caller of `try_run` lets us
                // write (and with `accumulate` read) this element, and no other
                // thread touches it during the call.
                unsafe {
                    let d = g.dst.add((i + r) * g.ld + j + c);
                    *d = if g.accumulate { *d + sum } else { sum };
                }
            }
        }
    }
}
