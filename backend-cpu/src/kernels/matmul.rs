//! Batched matrix multiplication `[..., m, k] @ [..., k, n]` (equal batch dims).
//!
//! f32 and f64 run on the `gemm` crate, which takes row and column strides, so
//! transposed and broadcast (stride-0) operands are read in place. bf16
//! products run on the AMX tile unit where the CPU has it (Note [bf16 products
//! on tiles]), as dot products of rows in the vector registers (Note [bf16 dot
//! products]), or widened to f32; f16 is widened to f32 (exactly). Both
//! accumulate in f32 and round once, as PyTorch does on CPU. Integer and bool
//! products use a plain loop in their own type (wrapping).
use super::copy::materialize_vec;
use super::elem::{advise_huge_pages, assume_init, uninit, Elem};
use super::gemm_bf16;
use super::iter::{fork_chunks, par_blocks, threads, Nest, OutPtr};
use super::map::map1;
use super::rowdot_bf16::{self, RowDot};
use super::{buf, Input};
use crate::team::fork;
use gemm::Parallelism;
use half::{bf16, f16};
use kiln_tensor::{numel, with_dtype, DType, Error, HostBuffer, Layout, Meta, Result};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The geometry of one batched product.
struct Geometry {
    m: usize,
    k: usize,
    n: usize,
    /// Row and column strides of the `a` and `b` matrices.
    a_rs: usize,
    a_cs: usize,
    b_rs: usize,
    b_cs: usize,
    /// Storage offsets of each batch's `a` and `b` matrix.
    offsets: Vec<(usize, usize)>,
}

impl Geometry {
    fn new(la: &Layout, lb: &Layout) -> Result<Geometry> {
        let r = la.ndim();
        let (sa, sb) = (la.shape(), lb.shape());
        if r < 2 || lb.ndim() != r || sa[..r - 2] != sb[..r - 2] || sa[r - 1] != sb[r - 2] {
            return Err(Error::shape(
                "matmul",
                format!("mat1 and mat2 shapes cannot be multiplied ({sa:?} and {sb:?})"),
            ));
        }
        let batch = &sa[..r - 2];
        let nest = Nest::new(batch, [&la.strides()[..r - 2], &lb.strides()[..r - 2]], [la.offset(), lb.offset()]);
        let [ia, ib] = nest.inner_strides();
        let mut offsets = Vec::with_capacity(numel(batch));
        nest.for_each_run(0, nest.numel(), |[oa, ob], len| {
            offsets.extend((0..len).map(|j| (oa + j * ia, ob + j * ib)))
        });
        Ok(Geometry {
            m: sa[r - 2],
            k: sa[r - 1],
            n: sb[r - 1],
            a_rs: la.strides()[r - 2],
            a_cs: la.strides()[r - 1],
            b_rs: lb.strides()[r - 2],
            b_cs: lb.strides()[r - 1],
            offsets,
        })
    }
    fn batches(&self) -> usize {
        self.offsets.len()
    }
}

/// Runs a matmul; the output is `[..., m, n]` contiguous.
pub(crate) fn matmul(a: &Input<'_>, b: &Input<'_>, out: &Meta) -> Result<HostBuffer> {
    if a.dtype() != b.dtype() {
        return Err(Error::dtype(
            "matmul",
            format!("expected both inputs to have the same dtype, but got {} and {}", a.dtype(), b.dtype()),
        ));
    }
    let g = Geometry::new(a.layout, b.layout)?;
    let total = g.batches() * g.m * g.n;
    if total == 0 || g.k == 0 {
        return Ok(with_dtype!(out.dtype, T => buf(T::zeros(total))));
    }
    Ok(match a.dtype() {
        DType::F32 => buf(gemm_batched::<f32>(a.slice()?, b.slice()?, &g)),
        DType::F64 => buf(gemm_batched::<f64>(a.slice()?, b.slice()?, &g)),
        DType::BF16 => buf(bf16_matmul(a, b, &g)?),
        DType::F16 => buf(via_f32::<f16>(a, b)?),
        dt => with_dtype!(dt, T => buf(loop_matmul::<T>(a, b, &g)?)),
    })
}

/// The elements of `x` widened to f32, with the layout that views them: the
/// storage span the view covers when it is compact (so transposed and broadcast
/// operands stay as they are), else a contiguous copy.
fn widen<T: Elem>(x: &Input<'_>) -> Result<(Vec<f32>, Layout)> {
    let l = x.layout;
    // The layout was bounds-checked against the buffer, so its extent exists.
    let (start, end) = (l.offset(), l.storage_extent().unwrap_or(usize::MAX));
    if end - start <= 2 * l.numel() {
        let v: Vec<f32> = x.slice::<T>()?[start..end].iter().map(|v| v.cast_f32()).collect();
        return Ok((v, Layout::new(l.shape().into(), l.strides().into(), 0)));
    }
    Ok((map1::<T, f32>(x, 1, |v| v.cast_f32())?, Layout::contiguous(l.shape())))
}

/// bf16 products: on AMX tiles when they have many rows and the CPU has the
/// unit (Note [bf16 products on tiles]), as dot products of rows where Note
/// [bf16 dot products] says so, else widened to f32 for gemm.
fn bf16_matmul(a: &Input<'_>, b: &Input<'_>, g: &Geometry) -> Result<Vec<bf16>> {
    let (m, k, n) = (g.m, g.k, g.n);
    let packed = gemm_bf16::available() && m >= gemm_bf16::MIN_ROWS && !kiln_tensor::is_batch_invariant();
    if !packed && !rowdot_bf16::applies(m, k, g.b_rs == 1) {
        return via_f32::<bf16>(a, b);
    }
    let (av, bv) = (a.slice::<bf16>()?, b.slice::<bf16>()?);
    if packed {
        // Not cleared first: each product writes every element of its part.
        let mut out = uninit::<bf16>(g.batches() * m * n);
        for (&(oa, ob), out) in g.offsets.iter().zip(out.chunks_exact_mut((m * n).max(1))) {
            let a = gemm_bf16::Strided { v: av, off: oa, rs: g.a_rs, cs: g.a_cs };
            let b = gemm_bf16::Strided { v: bv, off: ob, rs: g.b_rs, cs: g.b_cs };
            gemm_bf16::gemm(a, b, m, k, n, out);
        }
        // SAFETY: the parts cover `out` (one of m * n per batch, in order; none
        // when m * n is 0), and `gemm` writes every element of its part.
        return Ok(unsafe { assume_init(out) });
    }
    let mut out = vec![bf16::ZERO; g.batches() * m * n];
    for (&(oa, ob), out) in g.offsets.iter().zip(out.chunks_exact_mut(m * n)) {
        // Rows along the depth: in place where the operand has them, else copied.
        let (x_copy, w_copy): (Vec<bf16>, Vec<bf16>);
        let (x, x_rs) = if g.a_cs == 1 {
            (&av[oa..], g.a_rs)
        } else {
            x_copy = rows_along_depth(av, oa, m, k, g.a_rs, g.a_cs);
            (&x_copy[..], k)
        };
        let (w, w_rs) = if g.b_rs == 1 {
            (&bv[ob..], g.b_cs)
        } else {
            w_copy = rows_along_depth(bv, ob, n, k, g.b_cs, g.b_rs);
            (&w_copy[..], k)
        };
        RowDot { x, x_rs, w, w_rs, m, n, k }.run(out);
    }
    Ok(out)
}

/// The `rows x depth` matrix whose element `(i, p)` is `v[off + i * rs + p * ds]`,
/// row-major, copied in square blocks so that both sides stay in cache.
fn rows_along_depth(v: &[bf16], off: usize, rows: usize, depth: usize, rs: usize, ds: usize) -> Vec<bf16> {
    const BLOCK: usize = 32;
    let mut out = vec![bf16::ZERO; rows * depth];
    if rows == 0 || depth == 0 {
        return out;
    }
    // The largest index read, so every index below is inside `v`.
    assert!(off + (rows - 1) * rs + (depth - 1) * ds < v.len(), "rows_along_depth: out of bounds");
    fork_chunks(&mut out, BLOCK * depth, 1, &|b, dst| {
        let i0 = b * BLOCK;
        let n_rows = dst.len() / depth;
        for p0 in (0..depth).step_by(BLOCK) {
            let p1 = (p0 + BLOCK).min(depth);
            for r in 0..n_rows {
                let src = off + (i0 + r) * rs;
                for p in p0..p1 {
                    // SAFETY: i0 + r < rows and p < depth, so the index is at most
                    // the one the assert bounds; `r * depth + p` < `dst.len()`.
                    unsafe { *dst.get_unchecked_mut(r * depth + p) = *v.get_unchecked(src + p * ds) };
                }
            }
        }
    });
    out
}

fn via_f32<T: Elem>(a: &Input<'_>, b: &Input<'_>) -> Result<Vec<T>> {
    let (av, la) = widen::<T>(a)?;
    let (bv, lb) = widen::<T>(b)?;
    let g = Geometry::new(&la, &lb)?;
    let c = gemm_batched::<f32>(&av, &bv, &g);
    Ok(c.into_iter().map(T::of_f32).collect())
}

/// Element types `gemm` multiplies natively.
pub(super) trait GemmElem: Elem {
    const ZERO: Self;
    const ONE: Self;
    /// Runs `g` outside gemm when a kernel of this crate should
    /// (Note [Dot-product products]); false when it did not.
    ///
    /// # Safety
    /// As [`Gemm::run`].
    unsafe fn run_outside_gemm(g: &Gemm<Self>) -> bool;
}
impl GemmElem for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    unsafe fn run_outside_gemm(g: &Gemm<Self>) -> bool {
        // SAFETY: the caller's contract is `try_run`'s.
        unsafe { super::rowdot::try_run(g) }
    }
}
impl GemmElem for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    unsafe fn run_outside_gemm(_: &Gemm<Self>) -> bool {
        false
    }
}

/// Products of at least this many multiply-adds are split across threads.
const GEMM_PAR_MIN: usize = 1 << 16;
/// A product is split into parts of at least this many rows (or columns).
const SPLIT_MIN: usize = 32;
/// Column chunks shrink down to this width, no further (Note [Threaded matmul]).
const CHUNK_MIN: usize = 128;
/// ... and to no fewer multiply-adds than this.
const CHUNK_WORK: usize = 1 << 28;

// Note [Threaded matmul]
// ~~~~~~~~~~~~~~~~~~~~~~
// A large product runs as independent products on one thread of `gemm` each:
// C's columns (or its rows, when it is taller than wide) are cut into ranges,
// and each part multiplies the whole of A with its columns of B (or its rows of
// A with the whole of B). The parts never wait for each other until the end.
// gemm's own threading cuts the product inside its blocking loops, and
// synchronises the threads at every block: on two cores the independent parts
// were faster in most interleaved runs of both (`kiln-bench matmul`, median
// GFLOP/s: 257 -> 303 at 1024^3, 249 -> 277 at 4096^3).
//
// The cost is that every part packs the operand it shares for itself. gemm packs
// B (the row-major output makes B its left operand) and reads a row-major A in
// place, so a cut by columns packs each element of B once in all, where a cut by
// rows packs all of B in every part. Rows are therefore cut one part per thread
// only, and columns whenever C is at least as wide as tall.
//
// Columns are not cut into equal parts up front: the threads take chunks from a
// shared cursor, each chunk a 1 / (2 * threads) share of the columns still left
// (`next_chunk`), down to a narrowest chunk (`chunk_min`) of CHUNK_MIN columns or
// CHUNK_WORK multiply-adds, whichever is wider, or, for narrower products, the
// 1 / (2 * threads) share of all the columns, which makes equal parts. The cores
// of a shared machine change speed from one second to the next (a part of a
// 4096^3 product took 0.25 s on one core and 0.30 s on the other in the same
// call): with equal parts, the faster core sat idle for the difference at the
// end; with shrinking chunks it takes over the columns the slower core has not
// reached, and the last chunks are small. A chunk of 128 columns still runs at
// the speed of a whole product on one thread (4096 rows and depth: within 1% of
// 1024 columns), as gemm reuses each panel of A over the chunk's columns; at
// 1024 rows and depth, chunks of 128 columns (2^27 multiply-adds) lost 2-4%
// against equal parts of 256. Against four equal parts, call by call (medians of
// paired ratios over 30-150 calls), chunks down to 128 columns ran 4096^3 at
// 1.03x and 2048^3 at 1.02x; chunks down to 256 columns had run 4096^3 at
// 1.01x-1.06x in four runs but 2048^3 at 0.97x-1.02x, as a last chunk of 256
// columns there is a quarter of the whole product's time. On two threads, 1024^3
// and smaller keep their four equal parts.

/// All products of a batch into one fresh buffer. The buffer is not zeroed
/// first: gemm is called with `read_dst = false`, so it writes every element of
/// each product without reading it (a memset of the output saved per matmul).
/// Needs `m, n, k > 0`.
fn gemm_batched<T: GemmElem>(a: &[T], b: &[T], g: &Geometry) -> Vec<T> {
    let (m, n) = (g.m, g.n);
    let total = g.batches() * m * n;
    let mut out: Vec<T> = Vec::with_capacity(total);
    // Before gemm's first write touches it, like every large kernel output.
    advise_huge_pages(out.spare_capacity_mut());
    let base = OutPtr(out.as_mut_ptr());
    let work = m * n * g.k;
    let nb = g.batches();
    let run = |i: usize, threads: usize| {
        let (oa, ob) = g.offsets[i];
        // SAFETY: `i < nb`, so `i * m * n + m * n <= total`, the capacity of `out`:
        // the range is inside the allocation and disjoint from every other `i`'s.
        unsafe { gemm_one(base.get().add(i * m * n), a, oa, b, ob, g, threads) }
    };
    if nb > 1 && threads() > 1 && work < (1 << 22) && nb * work >= GEMM_PAR_MIN {
        // Many small products: one per task.
        fork(nb, &|i| run(i, 1));
    } else {
        let threads = if work >= GEMM_PAR_MIN { threads() } else { 1 };
        (0..nb).for_each(|i| run(i, threads));
    }
    // SAFETY: every one of the `nb` products wrote all of its `m * n` elements
    // (gemm with `read_dst = false` assigns each output), so all `total` are initialised.
    unsafe { out.set_len(total) };
    out
}

/// `dst (m x n, row-major) = a[oa..] (m x k) @ b[ob..] (k x n)`, every element of
/// `dst` written and none read, on up to `threads` threads (Note [Threaded matmul]).
///
/// # Safety
/// `dst` must be valid for writes of `m * n` elements that nothing else accesses
/// during the call.
unsafe fn gemm_one<T: GemmElem>(dst: *mut T, a: &[T], oa: usize, b: &[T], ob: usize, g: &Geometry, threads: usize) {
    let (m, k, n) = (g.m, g.k, g.n);
    assert!(m > 0 && n > 0 && k > 0);
    // Largest element index each operand is read at: in bounds, so every read below is too.
    assert!(oa + (m - 1) * g.a_rs + (k - 1) * g.a_cs < a.len());
    assert!(ob + (k - 1) * g.b_rs + (n - 1) * g.b_cs < b.len());
    let by_rows = m > n;
    let (d, pa, pb) = (OutPtr(dst), OutPtr(a.as_ptr().cast_mut()), OutPtr(b.as_ptr().cast_mut()));
    let part = |s: usize, e: usize| {
        // SAFETY: the part is rows (or columns) s..e < m (or n) of the product: gemm
        // reads lhs at `oa + i * a_rs + p * a_cs` and rhs at `ob + p * b_rs + j * b_cs`
        // for i < m, p < k, j < n only (the part's rows or columns shifted by s), and
        // the asserts above show the largest such index is inside `a` / `b` (strides
        // are unsigned, so every other index is smaller). It writes dst at `i * n + j`
        // for the part's rows or columns only: disjoint from the other parts' (the
        // ranges handed out never overlap), inside the `m * n` elements the caller
        // guarantees are ours alone, which cannot alias the shared `a` and `b`. Without
        // `accumulate` it reads a dst element only after writing it (a later depth
        // chunk), so uninitialised memory there is fine. `a` and `b` are only read
        // through the pointers made mutable for `OutPtr`.
        unsafe {
            let (a0, b0) = (pa.get().add(oa), pb.get().add(ob));
            let (rows, cols, dst, a0, b0) = if by_rows {
                (e - s, n, d.get().add(s * n), a0.add(s * g.a_rs), b0)
            } else {
                (m, e - s, d.get().add(s), a0, b0.add(s * g.b_cs))
            };
            let (a_rs, a_cs, b_rs, b_cs) = (g.a_rs, g.a_cs, g.b_rs, g.b_cs);
            let (accumulate, scale) = (false, T::ONE);
            Gemm { m: rows, n: cols, k, dst, ld: n, accumulate, a: a0, a_rs, a_cs, b: b0, b_rs, b_cs, scale }.run()
        }
    };
    if by_rows {
        let parts = threads.min(m / SPLIT_MIN).max(1);
        if parts == 1 {
            part(0, m);
        } else {
            fork(parts, &|t| part(t * m / parts, (t + 1) * m / parts));
        }
        return;
    }
    if threads == 1 || n < 2 * SPLIT_MIN {
        part(0, n);
        return;
    }
    let min = chunk_min(m, k, n, threads);
    let cursor = AtomicUsize::new(0);
    fork(threads, &|_| {
        // Each claim moves the cursor from s to the chunk's end: no two claims get
        // overlapping columns, and the loop ends once the cursor reaches n.
        while let Ok(s) = cursor
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| (s < n).then(|| next_chunk(s, n, threads, min)))
        {
            part(s, next_chunk(s, n, threads, min));
        }
    });
}

/// The narrowest column chunk of an `m x k @ k x n` product on `threads` threads
/// (Note [Threaded matmul]): CHUNK_MIN columns, or more to reach CHUNK_WORK
/// multiply-adds, but no more than a 1 / (2 * threads) share of all the columns.
pub(super) fn chunk_min(m: usize, k: usize, n: usize, threads: usize) -> usize {
    (CHUNK_WORK / (m * k)).max(CHUNK_MIN).min(n / (2 * threads)).max(SPLIT_MIN)
}

/// The end of the column chunk that starts at `start < len` (Note [Threaded
/// matmul]): a 1 / (2 * threads) share of the columns left, at least `min`,
/// rounded up to a multiple of 64 columns (16 when `min` is below 64, so small
/// products still split); a tail narrower than `min / 2` joins the chunk before it.
pub(super) fn next_chunk(start: usize, len: usize, threads: usize, min: usize) -> usize {
    let align = if min >= 64 { 64 } else { 16 };
    let want = (len - start).div_ceil(2 * threads).max(min).next_multiple_of(align);
    let end = (start + want).min(len);
    if len - end < min / 2 {
        len
    } else {
        end
    }
}

/// A strided matrix inside a slice: element `(i, j)` is `data[off + i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(super) struct MatRef<'a, T> {
    pub data: &'a [T],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// The transpose (a view: strides swapped).
    pub fn t(self) -> MatRef<'a, T> {
        MatRef { rs: self.cs, cs: self.rs, ..self }
    }
    /// The matrix from row `i` on.
    pub fn rows_from(self, i: usize) -> MatRef<'a, T> {
        MatRef { off: self.off + i * self.rs, ..self }
    }
}

/// `dst[i * ld + j] = scale * (a @ b)[i][j]` (or `+=` with `accumulate`) for
/// `i < m`, `j < n`, with `a` `m x k` and `b` `k x n`: one product on the
/// calling thread, for kernels that parallelise over many small products.
/// Panics (before touching memory) if a matrix does not fit its slice.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm_small<T: GemmElem>(
    dst: &mut [T],
    ld: usize,
    m: usize,
    n: usize,
    k: usize,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    scale: T,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(n <= ld || m == 1, "gemm_small: rows of {n} overlap at stride {ld}");
    assert!((m - 1) * ld + n <= dst.len(), "gemm_small: destination too short");
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * ld..i * ld + n].fill(T::ZERO);
            }
        }
        return;
    }
    assert!(a.off + (m - 1) * a.rs + (k - 1) * a.cs < a.data.len(), "gemm_small: lhs out of bounds");
    assert!(b.off + (k - 1) * b.rs + (n - 1) * b.cs < b.data.len(), "gemm_small: rhs out of bounds");
    // SAFETY: gemm reads lhs at `a.off + i * a.rs + p * a.cs` and rhs at `b.off + p * b.rs +
    // j * b.cs` for i < m, p < k, j < n: the asserts bound the largest such index inside
    // each slice (strides are unsigned, so every other index is smaller). It writes (and
    // with `read_dst` reads) dst at `i * ld + j`, whose largest value is inside `dst`,
    // which we borrow exclusively, so it cannot alias `a` or `b`. T is f32 or f64.
    unsafe {
        let (pa, pb) = (a.data.as_ptr().add(a.off), b.data.as_ptr().add(b.off));
        let (a_rs, a_cs, b_rs, b_cs) = (a.rs, a.cs, b.rs, b.cs);
        Gemm { m, n, k, dst: dst.as_mut_ptr(), ld, accumulate, a: pa, a_rs, a_cs, b: pb, b_rs, b_cs, scale }.run()
    }
}

// Note [Row-invariant products]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With batch invariance on (`kiln_tensor::set_batch_invariant`), row i of
// every product `a @ b` (matmul, and the products inside attention) is
// computed from row i of `a` and from `b` alone: the same bits whatever the
// number of other rows, their values and the row's position among them. So a
// token's logits do not depend on what else is in its batch, a prompt fed in
// chunks gives the bits it gives in one piece, and a decoded token's keys are
// those a prefill of the same text computes. The serving engine relies on it:
// a request's tokens are what `generate()` gives it alone, whatever else runs
// beside it (Note [Batch invariance] in kiln-nn's `serve`).
//
// `gemm` chooses its algorithm from the shape, and each algorithm sums the k
// terms of an element in its own order: a vector-vector kernel for depth 1 or
// 2, matrix-vector kernels for a single row or column, a dot-product ("horizontal") kernel when m * n <= 256 with a row-major
// `a` and a column-major `b`, and otherwise its microkernels over depth blocks
// of `kc` terms, where `kc` is min(k, 512) for products within 64 x 64 and a
// cache-derived depth (k cut into equal parts) for larger ones. Inside one
// depth block the microkernels add each element's terms in order (fused
// multiply-adds into one accumulator) whatever its tile, and blocks add into
// the output in order. `Gemm::run` therefore only calls gemm with shapes that
// reach the microkernels with one depth rule: depth in chunks of `ROW_KC`
// (512) terms, which both `kc` rules leave whole, added in order; and a depth
// of at least 3, at least two columns, two rows and more than 256 elements,
// smaller shapes going through a scratch product padded with zeros. Columns are not cut into fixed chunks: a
// column's bits may depend on the width of the product (weights are fixed, so
// nothing relies on it). `tests/matmul.rs` checks rows against every row
// count, offset and thread split the kernels use.
//
// Products `x @ W.T` of depth 256 and more leave gemm altogether: they are
// computed as dot products of rows, invariant by construction (Note
// [Dot-product products]), so the serving engine's decoding rows do not pay
// for invariance. It is a switch because of its cost elsewhere: shallower
// products of a few rows take gemm's matrix-vector kernel when off and the
// microkernels, which pack the whole weight for every call, when on; and
// prompt chunks of hundreds of rows run slower as dot products than in gemm.

/// Depth of the chunks `Gemm::run` feeds gemm (Note [Row-invariant products]).
const ROW_KC: usize = 512;

/// The fewest rows `Gemm::run` hands gemm for an `n`-column product.
fn min_rows(n: usize) -> usize {
    (256 / n.max(1) + 1).max(2)
}

/// One product for gemm: `dst = scale * a @ b` (or `dst += scale * a @ b`
/// with `accumulate`), `a` `m x k`, `b` `k x n`, `dst` row-major with row
/// stride `ld`, each operand by pointer and strides.
#[derive(Clone, Copy)]
pub(super) struct Gemm<T> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dst: *mut T,
    pub ld: usize,
    pub accumulate: bool,
    pub a: *const T,
    pub a_rs: usize,
    pub a_cs: usize,
    pub b: *const T,
    pub b_rs: usize,
    pub b_cs: usize,
    pub scale: T,
}

impl<T: GemmElem> Gemm<T> {
    /// Runs the product on the calling thread; with batch invariance on, each
    /// row's bits independent of the others (Note [Row-invariant products]).
    /// Needs `k > 0`.
    ///
    /// # Safety
    /// `a + i * a_rs + p * a_cs` and `b + p * b_rs + j * b_cs` must be readable
    /// for `i < m`, `p < k`, `j < n`, and `dst + i * ld + j` writable (and,
    /// with `accumulate`, readable) for `i < m`, `j < n`, with nothing else
    /// accessing those destination elements during the call; `dst` must not
    /// overlap `a` or `b`.
    pub(super) unsafe fn run(self) {
        let Gemm { m, n, k, dst, ld, accumulate, a, a_rs, a_cs, b, b_rs, b_cs, .. } = self;
        if m == 0 || n == 0 {
            return;
        }
        // SAFETY: the caller's contract is `run_outside_gemm`'s.
        if unsafe { T::run_outside_gemm(&self) } {
            return;
        }
        if !kiln_tensor::is_batch_invariant() {
            // SAFETY: the caller's contract is gemm's for this call.
            unsafe { self.call() };
            return;
        }
        // Shapes gemm would send elsewhere: depth below 3 (its vector-vector
        // kernel), one column, or too few rows (see `min_rows`).
        let (kp, np) = (k.max(3), n.max(2));
        let mp = m.max(min_rows(np));
        if (mp, np, kp) != (m, n, k) {
            // A scratch product padded with zeros (exact: the extra terms are 0 * 0),
            // the real rows and columns first.
            let mut pa = vec![T::ZERO; mp * kp];
            let mut pd = vec![T::ZERO; mp * np];
            for i in 0..m {
                for p in 0..k {
                    // SAFETY: i < m and p < k: readable by the caller's contract.
                    pa[i * kp + p] = unsafe { *a.add(i * a_rs + p * a_cs) };
                }
                if accumulate {
                    for j in 0..n {
                        // SAFETY: i < m and j < n: readable with `accumulate`.
                        pd[i * np + j] = unsafe { *dst.add(i * ld + j) };
                    }
                }
            }
            let pb = if (np, kp) != (n, k) {
                let mut pb = vec![T::ZERO; kp * np];
                for p in 0..k {
                    for j in 0..n {
                        // SAFETY: p < k and j < n: readable by the caller's contract.
                        pb[p * np + j] = unsafe { *b.add(p * b_rs + j * b_cs) };
                    }
                }
                Some(pb)
            } else {
                None
            };
            let (b, b_rs, b_cs) = match &pb {
                Some(pb) => (pb.as_ptr(), np, 1),
                None => (b, b_rs, b_cs),
            };
            let padded = Gemm {
                m: mp,
                n: np,
                k: kp,
                dst: pd.as_mut_ptr(),
                ld: np,
                a: pa.as_ptr(),
                a_rs: kp,
                a_cs: 1,
                b,
                b_rs,
                b_cs,
                ..self
            };
            // SAFETY: the scratch buffers hold `mp x kp`, `kp x np` and `mp x np`
            // contiguous elements and are ours alone; an unpadded `b` keeps the
            // caller's contract and cannot overlap them.
            unsafe { padded.run() };
            for i in 0..m {
                for j in 0..n {
                    // SAFETY: i < m and j < n: writable by the caller's contract.
                    unsafe { *dst.add(i * ld + j) = pd[i * np + j] };
                }
            }
            return;
        }
        for p0 in (0..k).step_by(ROW_KC) {
            // SAFETY: the chunk reads columns p0..p0 + kc < k of `a` and rows p0..p0 + kc
            // of `b`, inside the caller's bounds, and writes (reads after the first
            // chunk) exactly the caller's `m x n` destination elements.
            unsafe {
                let chunk = Gemm {
                    k: ROW_KC.min(k - p0),
                    accumulate: accumulate || p0 > 0,
                    a: a.add(p0 * a_cs),
                    b: b.add(p0 * b_rs),
                    ..self
                };
                chunk.call()
            }
        }
    }

    /// One gemm call on this thread.
    ///
    /// # Safety
    /// As [`Gemm::run`].
    unsafe fn call(self) {
        let Gemm { m, n, k, dst, ld, accumulate, a, a_rs, a_cs, b, b_rs, b_cs, scale } = self;
        // SAFETY: the caller guarantees the reads and writes gemm makes for these
        // strides and sizes; gemm supports f32 and f64, the only `GemmElem`s.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst,
                1,
                ld as isize,
                accumulate,
                a,
                a_cs as isize,
                a_rs as isize,
                b,
                b_cs as isize,
                b_rs as isize,
                T::ONE,
                scale,
                false,
                false,
                false,
                Parallelism::None,
            )
        }
    }
}

/// Integer and bool matmul in the element type (wrapping; bool: or of ands).
fn loop_matmul<T: Elem>(a: &Input<'_>, b: &Input<'_>, g: &Geometry) -> Result<Vec<T>> {
    let (m, k, n) = (g.m, g.k, g.n);
    let av = materialize_vec::<T>(a)?;
    let bv = materialize_vec::<T>(b)?;
    let mut out = T::zeros(g.batches() * m * n);
    // out: (batch * m, n); row r of batch r / m.
    par_blocks(&mut out, n, k, &|r, orow| {
        let (bi, i) = (r / m, r % m);
        let arow = &av[(bi * m + i) * k..][..k];
        for (p, &x) in arow.iter().enumerate() {
            let brow = &bv[(bi * k + p) * n..][..n];
            for (o, &y) in orow.iter_mut().zip(brow) {
                *o = o.add_(x.mul_(y));
            }
        }
    });
    Ok(out)
}
