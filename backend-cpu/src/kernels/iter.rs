//! Strided loop nests: several operands of one shape walked together, with
//! mergeable dims merged, innermost runs handed to the kernel, and large work
//! split across threads.
use crate::team::fork;
use smallvec::SmallVec;

/// Work (in element-operations) below which a kernel stays on the calling thread:
/// waking the pool costs a few microseconds, about what 32K simple element-ops cost.
pub(crate) const PAR_MIN: usize = 32 * 1024;

/// Side of the blocks a tiled walk uses (see `Nest::tile_band`).
const TILE: usize = 64;

/// Number of threads kernels split large work across (rayon's pool, whose
/// threads make the teams of Note [Teams of compute threads]).
pub(crate) fn threads() -> usize {
    rayon::current_num_threads()
}

/// A pointer that may cross to the compute threads: each task writes a disjoint range.
pub(crate) struct OutPtr<T>(pub(crate) *mut T);
// By hand: a derive would ask `T: Copy`, and the pointer is `Copy` whatever `T` is.
impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutPtr<T> {}
// SAFETY: the pointer is only used to write disjoint ranges of one allocation
// that outlives the parallel loop (every user says how its ranges are disjoint).
unsafe impl<T: Send> Send for OutPtr<T> {}
// SAFETY: as above; tasks never touch each other's range.
unsafe impl<T: Send> Sync for OutPtr<T> {}

impl<T> OutPtr<T> {
    /// The pointer (a method, so closures capture the `Send` wrapper, not the raw field).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Runs `f(j0, j1)` over disjoint ranges covering `0..n` columns: the whole
/// range on this thread when the work (`m * n * k` multiply-adds) is below
/// 2^16 or there is one thread, else equal ranges, several per thread, each a
/// multiple of `tile` columns but the last, in parallel.
pub(crate) fn column_ranges(m: usize, n: usize, k: usize, tile: usize, f: impl Fn(usize, usize) + Sync) {
    if m * n * k < 1 << 16 || threads() == 1 {
        f(0, n);
        return;
    }
    let parts = (threads() * 4).min(n.div_ceil(tile)).max(1);
    let per = n.div_ceil(parts).next_multiple_of(tile);
    fork(n.div_ceil(per), &|p| f(p * per, ((p + 1) * per).min(n)));
}

/// A loop nest over `N` operands that share a shape, each with its own strides
/// and offset (in elements).
///
/// Size-1 dims are dropped and adjacent dims merge when every operand allows it
/// (outer stride == inner stride * inner size), so a contiguous tensor is one
/// run and a row-broadcast operand keeps a contiguous inner run.
#[derive(Debug, Clone)]
pub(crate) struct Nest<const N: usize> {
    /// `(size, stride of each operand)`, outermost first.
    dims: SmallVec<[(usize, [usize; N]); 6]>,
    offsets: [usize; N],
    numel: usize,
}

impl<const N: usize> Nest<N> {
    pub fn new(shape: &[usize], strides: [&[usize]; N], offsets: [usize; N]) -> Self {
        let numel = shape.iter().product();
        let mut dims: SmallVec<[(usize, [usize; N]); 6]> = SmallVec::new();
        for d in (0..shape.len()).rev() {
            let size = shape[d];
            if size == 1 {
                continue;
            }
            let st: [usize; N] = std::array::from_fn(|k| strides[k][d]);
            if let Some(inner) = dims.last_mut() {
                if (0..N).all(|k| st[k] == inner.1[k] * inner.0) {
                    inner.0 *= size;
                    continue;
                }
            }
            dims.push((size, st));
        }
        dims.reverse();
        Nest { dims, offsets, numel }
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Strides of the innermost dim (zeros when the nest is a single element).
    pub fn inner_strides(&self) -> [usize; N] {
        self.dims.last().map_or([0; N], |d| d.1)
    }

    /// Length of the innermost dim (1 for a single element).
    pub fn inner_len(&self) -> usize {
        self.dims.last().map_or(1, |d| d.0)
    }

    /// Offsets of the element at row-major position `l`.
    fn offsets_at(&self, mut l: usize) -> [usize; N] {
        let mut pos = self.offsets;
        for &(size, st) in self.dims.iter().rev() {
            let i = l % size;
            l /= size;
            for k in 0..N {
                pos[k] += i * st[k];
            }
        }
        pos
    }

    /// The work granule of a tiled walk, when one pays: some operand reads (or
    /// writes) its innermost dim with a stride, as a transposed view does. The
    /// last two dims are then walked in `TILE x TILE` blocks, so each cache line
    /// of the strided operand serves `TILE` consecutive rows. Returns the number
    /// of elements in a band of `TILE` rows; `walk` ranges should be multiples of it.
    pub fn tile_band(&self) -> Option<usize> {
        let nd = self.dims.len();
        if nd < 2 {
            return None;
        }
        let (cols, st) = self.dims[nd - 1];
        let strided = st.iter().any(|&s| s > 1);
        (strided && cols >= 8 && self.dims[nd - 2].0 >= 8).then_some(TILE * cols)
    }

    /// Calls `f(offsets, len)` for runs covering the row-major positions
    /// `start..end`, in tiles when `tiled` (see `tile_band`; then `start` and `end`
    /// must be multiples of the innermost size), else in order.
    #[inline]
    pub fn walk(&self, start: usize, end: usize, tiled: bool, mut f: impl FnMut([usize; N], usize)) {
        if !tiled {
            return self.for_each_run(start, end, f);
        }
        let nd = self.dims.len();
        let (cols, cst) = self.dims[nd - 1];
        let (rows, rst) = self.dims[nd - 2];
        let end_row = end.min(self.numel) / cols;
        let mut row = start / cols;
        while row < end_row {
            // Rows row..row + h of one matrix (a band never crosses into the next one).
            let h = (rows - row % rows).min(TILE).min(end_row - row);
            let base = self.offsets_at(row * cols);
            let mut c0 = 0;
            while c0 < cols {
                let w = TILE.min(cols - c0);
                for i in 0..h {
                    f(std::array::from_fn(|k| base[k] + i * rst[k] + c0 * cst[k]), w);
                }
                c0 += w;
            }
            row += h;
        }
    }

    /// Calls `f(offsets, len)` for each innermost run covering the row-major
    /// positions `start..end`; consecutive elements of a run are `inner_strides()` apart.
    #[inline]
    pub fn for_each_run(&self, start: usize, end: usize, mut f: impl FnMut([usize; N], usize)) {
        let end = end.min(self.numel);
        if start >= end {
            return;
        }
        let nd = self.dims.len();
        if nd == 0 {
            f(self.offsets, 1);
            return;
        }
        let mut idx: SmallVec<[usize; 6]> = SmallVec::from_elem(0, nd);
        let mut pos = self.offsets;
        let mut rem = start;
        for d in (0..nd).rev() {
            let (size, st) = self.dims[d];
            let i = rem % size;
            rem /= size;
            idx[d] = i;
            for k in 0..N {
                pos[k] += i * st[k];
            }
        }
        let (inner, ist) = self.dims[nd - 1];
        let mut done = start;
        loop {
            let len = (inner - idx[nd - 1]).min(end - done);
            f(pos, len);
            done += len;
            if done >= end {
                return;
            }
            // The run reached the end of its row: step to the start of the next row.
            for k in 0..N {
                pos[k] -= idx[nd - 1] * ist[k];
            }
            idx[nd - 1] = 0;
            let mut d = nd - 1;
            loop {
                d -= 1;
                let (size, st) = self.dims[d];
                idx[d] += 1;
                for k in 0..N {
                    pos[k] += st[k];
                }
                if idx[d] < size {
                    break;
                }
                for k in 0..N {
                    pos[k] -= size * st[k];
                }
                idx[d] = 0;
            }
        }
    }
}

/// How many tasks to split `n` items of `cost` element-operations each into (1: stay serial).
pub(crate) fn tasks_for(n: usize, cost: usize) -> usize {
    let t = threads();
    let work = n.saturating_mul(cost.max(1));
    if t <= 1 || work < 2 * PAR_MIN || n < 2 {
        return 1;
    }
    (work / PAR_MIN).min(4 * t).min(n).max(2)
}

// Note [Parallel helpers take &dyn]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The helpers below take their task as `&dyn Fn`: the fork's plumbing (the
// team's and rayon's, Note [Teams of compute threads]) is then compiled once
// per element type instead of once per kernel closure (hundreds of them), which
// keeps the crate's compile time and code size down. The kernel's loop lives
// inside the closure, fully inlined; only the call per task is indirect. Every
// parallel loop of the kernels goes through `team::fork`, directly or here.

/// Runs `f(start, chunk)` over consecutive chunks of `out`, in parallel when the
/// work (`cost` element-operations per item) is large enough to pay for it.
/// See Note [Parallel helpers take &dyn].
pub(crate) fn par_chunks<T: Send>(out: &mut [T], cost: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    // Chunks of whole cache lines where possible.
    par_chunks_by(out, cost, 16, f)
}

/// `par_chunks` with chunk lengths that are multiples of `granule` (but the last).
pub(crate) fn par_chunks_by<T: Send>(out: &mut [T], cost: usize, granule: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    let n = out.len();
    let tasks = tasks_for(n, cost);
    if tasks <= 1 {
        f(0, out);
        return;
    }
    let chunk = n.div_ceil(tasks).next_multiple_of(granule.max(1)).min(n);
    fork_chunks(out, chunk, 1, &|i, c| f(i * chunk, c));
}

/// Runs `f(i, piece)` over the consecutive `len`-sized pieces of `out` (the
/// last may be shorter), `per_task` pieces to a task, through `fork`: the one
/// place that hands disjoint pieces of one slice to tasks.
pub(crate) fn fork_chunks<T: Send>(out: &mut [T], len: usize, per_task: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    let (n, len, per_task) = (out.len(), len.max(1), per_task.max(1));
    let pieces = n.div_ceil(len);
    let ptr = OutPtr(out.as_mut_ptr());
    fork(pieces.div_ceil(per_task), &|t| {
        for i in t * per_task..((t + 1) * per_task).min(pieces) {
            let start = i * len;
            let end = (start + len).min(n);
            // SAFETY: piece `i` is `out[i * len..]` up to `len` elements; pieces
            // never overlap and each is given to exactly one task, and `out`'s
            // borrow outlives `fork`, which returns after every task.
            f(i, unsafe { std::slice::from_raw_parts_mut(ptr.get().add(start), end - start) });
        }
    });
}

/// Runs `f(start, end)` over a split of `0..n`, in parallel when large, and
/// returns the results in order.
pub(crate) fn par_ranges<R: Send>(n: usize, cost: usize, f: &(dyn Fn(usize, usize) -> R + Sync)) -> Vec<R> {
    par_ranges_by(n, cost, 1, f)
}

/// `par_ranges` with range bounds that are multiples of `granule` (but the last).
pub(crate) fn par_ranges_by<R: Send>(
    n: usize,
    cost: usize,
    granule: usize,
    f: &(dyn Fn(usize, usize) -> R + Sync),
) -> Vec<R> {
    let tasks = tasks_for(n, cost);
    if tasks <= 1 {
        return vec![f(0, n)];
    }
    let chunk = n.div_ceil(tasks).next_multiple_of(granule.max(1));
    fork_map(n.div_ceil(chunk), &|i| f((i * chunk).min(n), ((i + 1) * chunk).min(n)))
}

/// `f(i)` for every `i < tasks` through `fork`, the results in order.
pub(crate) fn fork_map<R: Send>(tasks: usize, f: &(dyn Fn(usize) -> R + Sync)) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..tasks).map(|_| None).collect();
    fork_chunks(&mut out, 1, 1, &|i, r| r[0] = Some(f(i)));
    out.into_iter().map(|r| r.expect("fork runs every task")).collect()
}

/// A task of `fork_zip`: the piece's index and its two pieces.
type ZipTask<'a, A, B> = dyn Fn(usize, &mut [A], &mut [B]) + Sync + 'a;

/// `fork_chunks` over two slices cut into the same number of pieces
/// (`a` into `la`-sized ones, `b` into `lb`-sized ones): `f(i, a_i, b_i)`.
pub(crate) fn fork_zip<A: Send, B: Send>(a: &mut [A], la: usize, b: &mut [B], lb: usize, f: &ZipTask<'_, A, B>) {
    let (la, lb) = (la.max(1), lb.max(1));
    let pieces = a.len().div_ceil(la).min(b.len().div_ceil(lb));
    let pb = OutPtr(b.as_mut_ptr());
    let nb = b.len();
    let na = (pieces * la).min(a.len());
    fork_chunks(&mut a[..na], la, 1, &|i, a_i| {
        let start = i * lb;
        // SAFETY: as in `fork_chunks`: piece `i` of `b` is given to the task of
        // piece `i` of `a` only, pieces are disjoint, `i < pieces` keeps `start`
        // inside `b`, and `b`'s borrow outlives the fork.
        f(i, a_i, unsafe { std::slice::from_raw_parts_mut(pb.get().add(start), (start + lb).min(nb) - start) })
    });
}

/// Runs `f(i, block)` over the consecutive `block`-sized pieces of `out`, in
/// parallel when the work (`cost` element-operations per item) is large enough.
pub(crate) fn par_blocks<T: Send>(out: &mut [T], block: usize, cost: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    if block == 0 || out.is_empty() {
        return;
    }
    let blocks = out.len().div_ceil(block);
    if blocks < 2 || tasks_for(out.len(), cost) <= 1 {
        for (i, c) in out.chunks_mut(block).enumerate() {
            f(i, c);
        }
        return;
    }
    let min_len = (PAR_MIN / block.saturating_mul(cost.max(1)).max(1)).max(1);
    fork_chunks(out, block, min_len, f);
}
