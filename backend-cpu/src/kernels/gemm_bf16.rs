//! bf16 products of many rows on the AMX tile unit (Intel Xeon from
//! Sapphire Rapids on), both operands packed into tiles (Note [bf16 products
//! on tiles]).
// Only x86-64 Linux has the unit here; elsewhere `available()` is false.
#![cfg_attr(not(all(target_arch = "x86_64", target_os = "linux")), allow(dead_code, unused_imports))]
use super::elem::uninit;
use super::iter::{fork_chunks, OutPtr};
use crate::team::fork;
use half::bf16;
use std::mem::MaybeUninit;

// Note [bf16 products on tiles]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// AMX (`amx-bf16`) multiplies tiles: `tdpbf16ps` adds a 16 x 32 bf16 tile of
// `a` times a 32 x 16 tile of `b` into a 16 x 16 tile of f32 sums, 8,192
// multiply-adds per instruction. On a Xeon with AMX a kernel reading its
// tiles from L1 ran 1,045 GFLOP/s on one core, against 218 for an f32
// product on the FMA units and 89 for a blocked `vdpbf16ps` product (that
// CPU issues `vdpbf16ps` at half its FMA rate, so the vector bf16 ways
// cannot beat f32 there). Products of many rows therefore run here where
// the CPU has the unit:
//
// - `a` (m x k) is packed into panels of 16 rows; each panel into tiles of
//   32 depths, a tile's rows 64 bytes apart. `b` (k x n) into panels of 16
//   columns; each into tiles of 16 pairs of depths, a tile's row holding the
//   16 columns' two elements of one pair side by side (the layout the unit
//   reads `b` in). Depths, rows and columns past the edges are zeros, and
//   panels come in pairs, so every tile is whole.
// - The kernel holds 2 x 2 tiles of sums (32 x 32 outputs) in four tile
//   registers and, per 32 depths, loads two tiles of `a` and two of `b` and
//   issues four `tdpbf16ps`.
// - A task owns MC x NC outputs and keeps their f32 sums in a buffer across
//   blocks of KC depths (its tiles of `b` stay in L2), then rounds them to
//   bf16 once (round to nearest even), as PyTorch's CPU bf16 products round.
//
// The unit adds each pair's two products into the sum in order of depth,
// treating subnormal inputs as zero and flushing subnormal sums (as
// `vdpbf16ps`, Note [bf16 dot products]). An element's bits depend on k and
// its row and column only, stored and reloaded exactly between depth blocks,
// never on the tiling, the task or the threads: these products are
// row-invariant too (Note [Row-invariant products]). They are not bit-equal
// to the dot products of rows (whose 16 lanes sum separately), so batch
// invariance keeps every bf16 product on one way (see `matmul`).
//
// Note [Tiles on cache lines]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tile load reads 16 rows of 64 bytes. When each row straddles two cache
// lines (as in a buffer from the allocator, which starts 16 bytes past a
// line), a load took 15 ns instead of 2.3 on a Xeon with AMX, and a kernel
// loading one tile per `tdpbf16ps` ran at a third of the unit's rate (1.0
// against 3.0 TFLOP/s on one core, its tiles in L1). The packed operands are
// therefore vectors of 1 KiB tiles aligned to 64 bytes, and the sums vectors
// of 64-byte rows, their row stride a multiple of 64 bytes.
//
// Linux hands out the tile registers on request (`arch_prctl`), once per
// process; a CPU or kernel without them, or `KILN_CPU_AMX=0`, leaves bf16
// products to the ways of Note [bf16 dot products].

/// Rows of a tile of `a` and of sums; columns of a tile of `b` and of sums.
const T: usize = 16;
/// Depths per tile (16 pairs).
const TK: usize = 32;
/// bf16 elements per tile of `a` or `b` (1 KiB).
const TILE: usize = T * TK;
/// One packed tile of `a` or `b`, on whole cache lines (Note [Tiles on cache lines]).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct Tile([bf16; TILE]);

/// Sixteen f32 sums, a tile row, on one cache line (Note [Tiles on cache lines]).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(super) struct SumRow(pub(super) [f32; T]);

/// Rows per task (a multiple of 2T).
const MC: usize = 8 * T;
/// Columns per task (a multiple of 2T).
const NC: usize = 16 * T;
/// Depth tiles per block: a task's tiles of `b` in one block take NC * KC_TILES KiB / 16.
const KC_TILES: usize = 8;

/// Products of at least this many rows run here where the unit is available.
pub(super) const MIN_ROWS: usize = 32;

/// Whether this process can use the tile unit (detected, and requested from
/// the kernel, once).
pub(super) fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| std::env::var("KILN_CPU_AMX").map_or(true, |v| v != "0") && enable())
}

/// Asks for the tile registers where the CPU has `amx-tile` and `amx-bf16`.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn enable() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    #[allow(unused_unsafe)] // unsafe in older Rust versions
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is answered (with
    // zeros where it is beyond the CPU's maximum leaf).
    let edx = unsafe { __cpuid_count(7, 0) }.edx;
    let has = |bit: u32| edx & (1 << bit) != 0;
    if !(has(22) && has(24) && is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")) {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and only
    // changes which register state this process may use; it fails cleanly
    // (returns -1) on kernels without AMX support.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn enable() -> bool {
    false
}

/// A strided matrix: element `(i, j)` is `v[off + i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(super) struct Strided<'a> {
    pub v: &'a [bf16],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl Strided<'_> {
    /// Panics unless every element of a `rows x cols` matrix is inside `v`.
    fn check(&self, rows: usize, cols: usize) {
        if rows > 0 && cols > 0 {
            let last = (rows - 1) * self.rs + (cols - 1) * self.cs + self.off;
            assert!(last < self.v.len(), "gemm_bf16: operand out of bounds");
        }
    }
    /// Element `(i, j)`.
    ///
    /// # Safety
    /// `(i, j)` inside the shape [`Strided::check`] accepted.
    #[inline(always)]
    unsafe fn at(&self, i: usize, j: usize) -> bf16 {
        // SAFETY: the caller's contract.
        unsafe { *self.v.get_unchecked(self.off + i * self.rs + j * self.cs) }
    }
}

/// `out = a @ b` rounded to bf16, `a` m x k, `b` k x n, `out` m x n row-major,
/// every element written (a fresh output need not be cleared first), on the
/// pool's threads; panics (before any product) when an operand lies outside
/// its slice or when the unit is not available (ask [`available`] first).
pub(super) fn gemm(a: Strided<'_>, b: Strided<'_>, m: usize, k: usize, n: usize, out: &mut [MaybeUninit<bf16>]) {
    assert!(available(), "gemm_bf16: no tile unit");
    let [mut pa, mut pb] = PACKS.take().unwrap_or_else(|| [Packed::new(), Packed::new()]);
    pa.pack_a(a, m, k, true);
    pb.pack_b(b, k, n, true);
    product(&pa, &pb, (m, k, n), out, true);
    // Kept for the next product on this thread unless large.
    if pa.tiles.len().max(pb.tiles.len()) * TILE * 2 <= KEEP_BYTES {
        PACKS.set(Some([pa, pb]));
    }
}

/// Packed operands up to this size are kept for the next product.
const KEEP_BYTES: usize = 8 << 20;

thread_local! {
    /// The packed operands of this thread's last product (`gemm`): a
    /// buffer written once is packed again without being cleared first.
    static PACKS: std::cell::Cell<Option<[Packed; 2]>> = const { std::cell::Cell::new(None) };
}

/// An operand packed into tiles (Note [bf16 products on tiles]): `a` in
/// panels of T rows, or `b` in panels of T columns, of `kt` depth tiles each,
/// zeros past its rows (columns) and depths. Packing again reuses the buffer
/// (kernels that pack small operands many times).
pub(super) struct Packed {
    /// The panels, in the first `panels * kt` tiles (all written); the rest
    /// is spare room from earlier packings.
    pub(super) tiles: Vec<MaybeUninit<Tile>>,
    /// Rows of `a` or columns of `b`.
    extent: usize,
    /// Depth tiles per panel.
    kt: usize,
    /// The first `written` tiles of `tiles` hold values (from any packing).
    written: usize,
}

/// What a product's f32 sums are stored as: rounded to bf16, or kept.
pub(super) trait Sums: Copy + Send + Sync {
    const ZERO: Self;
    /// Writes every element of `dst` from `src` (as long).
    fn store(src: &[f32], dst: &mut [MaybeUninit<Self>]);
}

impl Sums for bf16 {
    const ZERO: bf16 = bf16::ZERO;
    fn store(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
        round_into(src, dst);
    }
}

impl Sums for f32 {
    const ZERO: f32 = 0.0;
    fn store(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.write(s);
        }
    }
}

/// `out = a @ b` over the first `k` depths of packed operands: the first `m`
/// rows of `pa`, the first `n` columns of `pb`, `out` m x n row-major, every
/// element written; across the pool's threads when `parallel`, else on this
/// one. `pa` must hold zeros past depth `k` (packed with depth `k`; `pb` may
/// be packed deeper: its depths past `k` meet those zeros). Panics when the
/// packed operands are smaller than asked or the unit is not available.
pub(super) fn product<O: Sums>(
    pa: &Packed,
    pb: &Packed,
    (m, k, n): (usize, usize, usize),
    out: &mut [MaybeUninit<O>],
    parallel: bool,
) {
    assert!(available(), "gemm_bf16: no tile unit");
    assert_eq!(out.len(), m * n, "gemm_bf16: output of the wrong size");
    let kt = k.div_ceil(TK);
    assert!(m <= pa.extent && n <= pb.extent && kt == pa.kt && kt <= pb.kt, "gemm_bf16: packed operands too small");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(MaybeUninit::new(O::ZERO));
        return;
    }
    let (row_tasks, col_tasks) = (m.div_ceil(MC), n.div_ceil(NC));
    let out = OutPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let (i0, j0) = ((t / col_tasks) * MC, (t % col_tasks) * NC);
        let (rows, cols) = ((m - i0).min(MC), (n - j0).min(NC));
        // Pairs of panels: the packed operands hold whole pairs.
        let (pairs_i, pairs_j) = (rows.div_ceil(2 * T), cols.div_ceil(2 * T));
        let ldc = pairs_j * 2 * T;
        // The task's sums: the first depth block stores every one of them
        // before any is read (k > 0), so the thread's buffer is reused as it is.
        SUMS.with_borrow_mut(|lines| {
            if lines.len() < pairs_i * 2 * ldc {
                lines.resize(pairs_i * 2 * ldc, SumRow([0.0; T]));
            }
            // SAFETY: `SumRow` is T f32s without padding.
            let c = unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<f32>(), lines.len() * T) };
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            // SAFETY: `available()` was asserted (the CPU has the unit and the
            // process its registers). Every tile pointer handed to `block` is
            // inside the packed operands: panel pairs < pairs_i (pairs_j) from
            // i0 / T (j0 / T) stay below the packed panel counts, which round
            // their extents (>= m, n, asserted) up to pairs, and tiles t0..t0 +
            // len <= kt <= each operand's kt; the sums are the 32 x 32 outputs at
            // (2T ip, 2T jp) of `c`, which holds pairs_i * 2T rows of ldc.
            unsafe {
                amx::configure();
                for t0 in (0..kt).step_by(KC_TILES) {
                    let len = (kt - t0).min(KC_TILES);
                    for jp in 0..pairs_j {
                        let b0 = pb.tiles.as_ptr().add((j0 / T + 2 * jp) * pb.kt + t0).cast::<bf16>();
                        for ip in 0..pairs_i {
                            let a0 = pa.tiles.as_ptr().add((i0 / T + 2 * ip) * pa.kt + t0).cast::<bf16>();
                            let c0 = c.as_mut_ptr().add(2 * T * (ip * ldc + jp));
                            let (a1, b1) = (a0.add(pa.kt * TILE), b0.add(pb.kt * TILE));
                            amx::block(a0, a1, b0, b1, len, c0, ldc, t0 == 0);
                        }
                    }
                }
                amx::release();
            }
            for r in 0..rows {
                let src = &c[r * ldc..][..cols];
                // SAFETY: row i0 + r < m, columns j0..j0 + cols <= n: this task's
                // outputs, which no other task writes, inside `out`'s m * n elements.
                let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add((i0 + r) * n + j0), cols) };
                O::store(src, dst);
            }
        });
    };
    if parallel {
        fork(row_tasks * col_tasks, &task);
    } else {
        (0..row_tasks * col_tasks).for_each(task);
    }
}

thread_local! {
    /// Each thread's buffer of f32 sums (at most MC x NC), in rows of T.
    static SUMS: std::cell::RefCell<Vec<SumRow>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether the packing's vector ways are compiled in (where the unit can be:
/// elsewhere every tile takes the element-wise way).
const VECTOR_PACKING: bool = cfg!(all(target_arch = "x86_64", target_os = "linux"));

// Note [Packing by transposes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tile of `a` holds a row's 32 depths side by side; a tile of `b` a depth
// pair's 16 columns. An operand laid out the other way (a transposed `a`,
// as x^T in a weight's gradient; a Linear's weight as `b`, whose columns run
// along the depth) would be packed element by element, two bytes at a time:
// that took as long as a fifth of the products it fed in a bf16 training
// step. Taking two depths as one 32-bit element, such a tile is the 16 x 16
// transpose of 32-bit elements read as 16 vectors of the source (for `a`,
// after interleaving the rows of two depths), which AVX-512 does in 64
// shuffles (unpacks of 32 and 64 bits, then two rounds of 128-bit lane
// shuffles), writing each tile row whole. Partial panels and the depths of
// a last partial tile take the element-wise way; both give the same tile.

impl Packed {
    /// Nothing packed yet.
    pub(super) fn new() -> Packed {
        Packed { tiles: Vec::new(), extent: 0, kt: 0, written: 0 }
    }

    /// The panels of T rows (or columns) of an operand with `extent` of them,
    /// a whole number of pairs of panels of `tiles` tiles each: every panel
    /// zeroed, then `fill(first, count, elements)` for each panel holding rows
    /// `first..first + count`, on the pool's threads (zeroed there, in cache,
    /// rather than all at once beforehand on the caller's thread), or on this
    /// thread alone unless `parallel`. When `whole_depth` (the depth is whole
    /// tiles) `fill` writes every depth of the rows it is given, and a panel
    /// whose tiles already hold values (an earlier packing's) is not zeroed
    /// first: its rows past `extent` keep those values, which only reach sums
    /// of rows (columns) that are never stored. Depths past a partial last
    /// tile must be zeros (they meet the other operand's), so those panels
    /// are always cleared.
    pub(super) fn panels(
        &mut self,
        extent: usize,
        tiles: usize,
        whole_depth: bool,
        parallel: bool,
        fill: impl Fn(usize, usize, &mut [bf16]) + Sync,
    ) {
        let n = extent.div_ceil(2 * T) * 2 * tiles;
        if self.tiles.len() < n {
            (self.tiles, self.written) = (uninit::<Tile>(n), 0);
        }
        let (v, written) = (&mut self.tiles[..n], self.written);
        let each = |panel: usize, dst: &mut [MaybeUninit<Tile>]| {
            let (first, end) = (panel * T, (panel * tiles + dst.len()));
            if !(whole_depth && end <= written) {
                dst.fill(MaybeUninit::new(Tile([bf16::ZERO; TILE])));
            }
            // SAFETY: every tile of `dst` was written just above, or, when not,
            // holds the values of an earlier packing (it lies below `written`);
            // a `Tile` is TILE bf16s without padding.
            let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<bf16>(), dst.len() * TILE) };
            if first < extent {
                fill(first, (extent - first).min(T), dst);
            }
        };
        let len = tiles.max(1);
        if parallel {
            fork_chunks(v, len, 1, &each);
        } else {
            v.chunks_mut(len).enumerate().for_each(|(panel, dst)| each(panel, dst));
        }
        // The chunks cover the first n tiles, each written in full above.
        (self.extent, self.kt, self.written) = (extent, tiles, written.max(n));
    }

    /// `a` in panels of T rows (a whole number of pairs of panels), each in
    /// tiles of TK depths: element `(i, p)` of a panel's tile at `i * TK + p`.
    pub(super) fn pack_a(&mut self, a: Strided<'_>, m: usize, k: usize, parallel: bool) {
        a.check(m, k);
        let kt = k.div_ceil(TK);
        self.panels(m, kt, k.is_multiple_of(TK), parallel, |i0, rows, dst| {
            if a.cs == 1 {
                // Rows along the depth: 32 depths of a row at a time.
                for r in 0..rows {
                    let row = &a.v[a.off + (i0 + r) * a.rs..][..k];
                    let mut parts = row.chunks_exact(TK);
                    for (t, part) in (&mut parts).enumerate() {
                        // A fixed-size copy (one 64-byte move), not a call per 64 bytes.
                        let part: &[bf16; TK] = part.try_into().expect("chunks of TK");
                        let to: &mut [bf16; TK] = (&mut dst[t * TILE + r * TK..][..TK]).try_into().expect("TK");
                        *to = *part;
                    }
                    let rest = parts.remainder();
                    if !rest.is_empty() {
                        dst[(k / TK) * TILE + r * TK..][..rest.len()].copy_from_slice(rest);
                    }
                }
            } else if a.rs == 1 {
                // Columns along the rows (a transposed operand). A whole panel's
                // whole tiles are transposed in registers (Note [Packing by
                // transposes]); the rest one depth at a time.
                let whole = if rows == T && VECTOR_PACKING { k / TK } else { 0 };
                for t in 0..whole {
                    let col = |q: usize| &a.v[a.off + (t * TK + q) * a.cs + i0..][..T];
                    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                    // SAFETY: packing runs only where the tile unit is available,
                    // which implies AVX-512 (`enable`); each column holds T elements
                    // and the tile TILE.
                    unsafe {
                        amx::transpose_pairs(col, &mut dst[t * TILE..][..TILE])
                    };
                }
                for p in whole * TK..k {
                    let tile = &mut dst[(p / TK) * TILE + p % TK..][..(T - 1) * TK + 1];
                    let col = &a.v[a.off + p * a.cs + i0..][..rows];
                    for (d, &v) in tile.iter_mut().step_by(TK).zip(col) {
                        *d = v;
                    }
                }
            } else {
                for p in 0..k {
                    let base = (p / TK) * TILE + p % TK;
                    for r in 0..rows {
                        // SAFETY: i0 + r < m and p < k: inside the checked shape.
                        dst[base + r * TK] = unsafe { a.at(i0 + r, p) };
                    }
                }
            }
        })
    }

    /// `b` in panels of T columns (a whole number of pairs of panels), each in
    /// tiles of TK depths: element `(p, j)` of a panel's tile at
    /// `(p / 2) * 2T + 2 j + p % 2`.
    pub(super) fn pack_b(&mut self, b: Strided<'_>, k: usize, n: usize, parallel: bool) {
        b.check(k, n);
        let kt = k.div_ceil(TK);
        self.panels(n, kt, k.is_multiple_of(TK), parallel, |j0, cols, dst| {
            // The index of depth p's element of column c in the panel.
            let at = |p: usize, c: usize| (p / TK) * TILE + (p % TK / 2) * 2 * T + 2 * c + p % 2;
            if b.rs == 1 {
                // Columns along the depth (a Linear's weight). A whole panel's
                // whole tiles are transposed in registers (Note [Packing by
                // transposes]); the rest one column at a time.
                let whole = if cols == T && VECTOR_PACKING { k / TK } else { 0 };
                for t in 0..whole {
                    let col = |c: usize| &b.v[b.off + (j0 + c) * b.cs + t * TK..][..TK];
                    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                    // SAFETY: as in `pack_a`: AVX-512 present; each column holds TK
                    // elements and the tile TILE.
                    unsafe {
                        amx::transpose_columns(col, &mut dst[t * TILE..][..TILE])
                    };
                }
                for c in 0..cols {
                    let col = &b.v[b.off + (j0 + c) * b.cs..][..k];
                    for (p, &v) in col.iter().enumerate().skip(whole * TK) {
                        dst[at(p, c)] = v;
                    }
                }
            } else if b.cs == 1 && cols == T && k.is_multiple_of(2) && VECTOR_PACKING {
                // Rows along the columns, a whole panel: two depths' rows of 16
                // interleaved by vector shuffles.
                for p in (0..k).step_by(2) {
                    let (x, y) = (&b.v[b.off + p * b.rs + j0..][..T], &b.v[b.off + (p + 1) * b.rs + j0..][..T]);
                    let pair = &mut dst[at(p, 0)..][..2 * T];
                    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
                    // SAFETY: `pack_b` runs only where the tile unit is available,
                    // which implies AVX2 (`enable`); the slices have the lengths
                    // `interleave` reads and writes.
                    unsafe {
                        amx::interleave(x, y, pair)
                    };
                }
            } else if b.cs == 1 {
                // Rows along the columns: two depths' rows interleaved at a time.
                for p in (0..k).step_by(2) {
                    let row = |p: usize| &b.v[b.off + p * b.rs + j0..][..cols];
                    let pair = &mut dst[at(p, 0)..][..2 * cols];
                    for (d, &v) in pair.chunks_exact_mut(2).zip(row(p)) {
                        d[0] = v;
                    }
                    if p + 1 < k {
                        for (d, &v) in pair.chunks_exact_mut(2).zip(row(p + 1)) {
                            d[1] = v;
                        }
                    }
                }
            } else {
                for p in 0..k {
                    let base = at(p, 0);
                    for c in 0..cols {
                        // SAFETY: p < k and j0 + c < n: inside the checked shape.
                        dst[base + 2 * c] = unsafe { b.at(p, j0 + c) };
                    }
                }
            }
        })
    }
}

/// `dst[i] = src[i]` rounded to bf16 (to nearest even; NaN stays NaN), every
/// element of `dst` written (`src` is as long).
pub(super) fn round_into(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if available() {
        // SAFETY: the unit implies AVX512-BF16 (checked by `enable`).
        unsafe { amx::round_into(src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        d.write(bf16::from_f32(s));
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use super::{T, TILE, TK};
    use half::bf16;
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// The tile configuration: palette 1, all eight tiles 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    const CONFIG: Config = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64;
            c[48 + t] = 16;
            t += 1;
        }
        Config(c)
    };

    /// Configures this thread's tiles.
    ///
    /// # Safety
    /// The process has the tile registers (`available()`).
    pub(super) unsafe fn configure() {
        // SAFETY: `ldtilecfg` reads the 64 bytes of a valid palette-1 configuration.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
    }

    /// Returns this thread's tiles to their initial state.
    ///
    /// # Safety
    /// As [`configure`].
    pub(super) unsafe fn release() {
        // SAFETY: clears tile state only.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// Sums of two panels of `a` (`a0`, `a1`) by two of `b` (`b0`, `b1`) over
    /// `len` depth tiles, added into the 32 x 32 f32 outputs at `c` (row
    /// stride `ldc`), which start from zero when `first`.
    ///
    /// # Safety
    /// Tiles configured ([`configure`]); `len` tiles (TILE elements each) readable
    /// from each of `a0`, `a1`, `b0`, `b1`; 32 rows of 32 f32 at `c`, `ldc` apart,
    /// readable and writable.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(super) unsafe fn block(
        a0: *const bf16,
        a1: *const bf16,
        b0: *const bf16,
        b1: *const bf16,
        len: usize,
        c: *mut f32,
        ldc: usize,
        first: bool,
    ) {
        let (sc, sab) = (ldc * 4, TK * 2);
        // SAFETY (every asm block): the caller's contract gives the memory each
        // tile load and store touches: 16 rows of 64 bytes at the stride given.
        unsafe {
            let (c01, c10, c11) = (c.add(T), c.add(T * ldc), c.add(T * ldc + T));
            if first {
                asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            } else {
                asm!(
                    "tileloadd tmm0, [{c00} + {s}*1]",
                    "tileloadd tmm1, [{c01} + {s}*1]",
                    "tileloadd tmm2, [{c10} + {s}*1]",
                    "tileloadd tmm3, [{c11} + {s}*1]",
                    c00 = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11, s = in(reg) sc,
                    options(nostack, readonly),
                );
            }
            for t in 0..len {
                asm!(
                    "tileloadd tmm4, [{a0} + {s}*1]",
                    "tileloadd tmm6, [{b0} + {s}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{b1} + {s}*1]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{a1} + {s}*1]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0.add(t * TILE), a1 = in(reg) a1.add(t * TILE),
                    b0 = in(reg) b0.add(t * TILE), b1 = in(reg) b1.add(t * TILE), s = in(reg) sab,
                    options(nostack, readonly),
                );
            }
            asm!(
                "tilestored [{c00} + {s}*1], tmm0",
                "tilestored [{c01} + {s}*1], tmm1",
                "tilestored [{c10} + {s}*1], tmm2",
                "tilestored [{c11} + {s}*1], tmm3",
                c00 = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11, s = in(reg) sc,
                options(nostack),
            );
        }
    }

    /// The 16 x 16 transpose of 32-bit elements: row `r` of the result holds
    /// element `r` of each input row, in order.
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // Per 128-bit lane L: t[2i] holds rows 2i, 2i+1 at elements 4L, 4L+1;
        // t[2i+1] at 4L+2, 4L+3.
        let t: [__m512i; 16] = std::array::from_fn(|j| {
            let (a, b) = (r[j & !1], r[j | 1]);
            if j % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        // u[4g + e]: per lane L, rows 4g..4g+4 at element 4L + e.
        let u: [__m512i; 16] = std::array::from_fn(|j| {
            let (g, e) = (j / 4, j % 4);
            let (a, b) = (t[4 * g + e / 2], t[4 * g + 2 + e / 2]);
            if e % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        // Row 4L + e gathers lane L of u[e], u[4 + e], u[8 + e], u[12 + e].
        let mut out = [_mm512_setzero_si512(); 16];
        for e in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x88>(u[e], u[4 + e]);
            let v1 = _mm512_shuffle_i32x4::<0xdd>(u[e], u[4 + e]);
            let v2 = _mm512_shuffle_i32x4::<0x88>(u[8 + e], u[12 + e]);
            let v3 = _mm512_shuffle_i32x4::<0xdd>(u[8 + e], u[12 + e]);
            out[e] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
            out[8 + e] = _mm512_shuffle_i32x4::<0xdd>(v0, v2);
            out[4 + e] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
            out[12 + e] = _mm512_shuffle_i32x4::<0xdd>(v1, v3);
        }
        out
    }

    /// A tile of `a` from 32 columns of 16 rows (`col(q)`, depth q): row r of
    /// the tile holds the 32 depths of row r. Depths pair into 32-bit
    /// elements (interleaved), whose 16 x 16 transpose is the tile.
    ///
    /// # Safety
    /// AVX-512 present.
    #[target_feature(enable = "avx512f,avx2")]
    pub(super) unsafe fn transpose_pairs<'a>(col: impl Fn(usize) -> &'a [bf16], tile: &mut [bf16]) {
        assert!(tile.len() >= TILE, "transpose_pairs: short tile");
        let pairs: [__m512i; 16] = std::array::from_fn(|j| {
            let (x, y) = (col(2 * j), col(2 * j + 1));
            assert!(x.len() >= T && y.len() >= T, "transpose_pairs: short column");
            // SAFETY: 32 bytes of each column (asserted).
            let (x, y) = unsafe { (_mm256_loadu_si256(x.as_ptr().cast()), _mm256_loadu_si256(y.as_ptr().cast())) };
            let (first, second) = interleave16(x, y);
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
        });
        for (r, v) in transpose16(pairs).into_iter().enumerate() {
            // SAFETY: row r's 64 bytes at r * TK lie inside the TILE elements asserted.
            unsafe { _mm512_storeu_si512(tile.as_mut_ptr().add(r * TK).cast(), v) };
        }
    }

    /// A tile of `b` from 16 columns of 32 depths (`col(c)`): row r of the
    /// tile holds depths 2r, 2r+1 of each column side by side, so with
    /// depth pairs as 32-bit elements the tile is their 16 x 16 transpose.
    ///
    /// # Safety
    /// AVX-512 present.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose_columns<'a>(col: impl Fn(usize) -> &'a [bf16], tile: &mut [bf16]) {
        assert!(tile.len() >= TILE, "transpose_columns: short tile");
        let cols: [__m512i; 16] = std::array::from_fn(|c| {
            let x = col(c);
            assert!(x.len() >= TK, "transpose_columns: short column");
            // SAFETY: 64 bytes of the column (asserted).
            unsafe { _mm512_loadu_si512(x.as_ptr().cast()) }
        });
        for (r, v) in transpose16(cols).into_iter().enumerate() {
            // SAFETY: row r's 64 bytes at r * 2T lie inside the TILE elements asserted.
            unsafe { _mm512_storeu_si512(tile.as_mut_ptr().add(r * 2 * T).cast(), v) };
        }
    }

    /// `out[2c] = x[c]`, `out[2c + 1] = y[c]` for the 16 elements of `x` and `y`.
    ///
    /// # Safety
    /// AVX2 present.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn interleave(x: &[bf16], y: &[bf16], out: &mut [bf16]) {
        assert!(x.len() >= T && y.len() >= T && out.len() >= 2 * T, "interleave: short slices");
        // SAFETY: the lengths were asserted: 32 bytes read from each of `x`
        // and `y`, 64 written to `out`.
        unsafe {
            let (first, second) =
                interleave16(_mm256_loadu_si256(x.as_ptr().cast()), _mm256_loadu_si256(y.as_ptr().cast()));
            _mm256_storeu_si256(out.as_mut_ptr().cast(), first);
            _mm256_storeu_si256(out.as_mut_ptr().add(T).cast(), second);
        }
    }

    /// The 16 elements of `a` and of `b` interleaved (`a0 b0 a1 b1 ...`), as
    /// elements 0-15 and 16-31.
    #[target_feature(enable = "avx2")]
    fn interleave16(a: __m256i, b: __m256i) -> (__m256i, __m256i) {
        // Per 128-bit lane: elements 0-3 (4-7) of each, interleaved.
        let (lo, hi) = (_mm256_unpacklo_epi16(a, b), _mm256_unpackhi_epi16(a, b));
        (_mm256_permute2x128_si256::<0x20>(lo, hi), _mm256_permute2x128_si256::<0x31>(lo, hi))
    }

    /// As [`super::round_into`], 16 at a time with `vcvtneps2bf16` (which
    /// rounds to nearest even and keeps NaN a NaN, as `bf16::from_f32`; it
    /// flushes subnormal inputs, which the unit's sums never are).
    ///
    /// # Safety
    /// AVX512-BF16 present.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn round_into(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, the length of both slices.
            unsafe {
                let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src.as_ptr().add(i)));
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), std::mem::transmute::<__m256bh, __m256i>(v));
            }
            i += 16;
        }
        for j in i..n {
            dst[j].write(bf16::from_f32(src[j]));
        }
    }
}
