//! `Op::PagedAttention` (Note [Paged attention] in kiln-tensor): attention of
//! packed queries over a paged KV cache.
//!
//! Each sequence is computed in one of two ways:
//!
//! - Gathered, one task per key/value head: the sequence's keys and values
//!   of that head are copied from their blocks into two contiguous buffers,
//!   and the fused attention
//!   kernel's per-head forward runs on each query head of the group, with the
//!   sequence's queries as the rows of a causal attention whose last row is
//!   the last cached position. Each row is then computed exactly as
//!   `Op::Attention` computes that query (Note [Row-invariant products] makes
//!   it the same bits whatever the rows beside it). Prompt chunks take this
//!   way (their rows share the products), and every sequence does with batch
//!   invariance on.
//! - Direct, for a few rows (decoding) with batch invariance off, one task
//!   per sequence (its heads split into groups when there are fewer
//!   sequences than threads to keep busy): scores, softmax and weighted sum
//!   of values read the keys and values in place, position by position with
//!   every head's rows at once (they are contiguous in a block), so a
//!   decoding step streams through the cache once instead of copying it. A
//!   cache narrower than the compute type (Note [KV cache dtypes] in
//!   kiln-tensor) is read the same way, each position's rows widened (times
//!   their scales) into a scratch row as the pass reaches them.
//!
//! bf16 with the AMX tile unit takes the gathered way on tiles, each row as
//! `Op::Attention` computes it there (Note [Attention on tiles]); otherwise
//! bf16 and f16 compute in float32 and round once.
use super::attention::{softmax_prefix, AttnFloat, Dims, HeadForward};
use super::attention_tiles::HeadForwardTiles;
use super::copy::contiguous;
use super::elem::Elem;
use super::elem::{assume_init, uninit};
use super::gemm_bf16;
use super::iter::fork_map;
use super::matmul::MatRef;
use super::simd::{dispatch, Kernel};
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::paged::PagedLayout;
use kiln_tensor::{f8e4m3fn, f8e5m2, DType, Error, HostBuffer, Result};

/// The identity from the storage type to the compute type, when they are one
/// type (the direct way then reads the cache as it is, with no copy).
type SameType<T, F> = fn(&[T]) -> &[F];

/// The sizes of a call.
#[derive(Clone, Copy)]
struct Sizes {
    n: usize,
    h: usize,
    d: usize,
    bs: usize,
    hk: usize,
    dv: usize,
    scale: f64,
}

/// `Op::PagedAttention`: inputs `q, k_cache, v_cache, block_tables,
/// context_lens, query_start` and, for float8 caches, `k_scales, v_scales`
/// (Note [KV cache dtypes] in kiln-tensor).
pub(crate) fn paged_attention(ins: &[Input<'_>], scale: f64) -> Result<HostBuffer> {
    let (qs, ks, vs) = (ins[0].layout.shape(), ins[1].layout.shape(), ins[2].layout.shape());
    let sz = Sizes { n: qs[0], h: qs[1], d: qs[2], bs: ks[1], hk: ks[2], dv: vs[3], scale };
    let ints = |i: usize| contiguous::<i64>(&ins[i]);
    let layout = PagedLayout::new(&ints(5)?, &ints(4)?, &ints(3)?, sz.n, ks[0], sz.bs)?;
    let scales = match ins.get(6..8) {
        Some([k, v]) => Some((contiguous::<f32>(k)?, contiguous::<f32>(v)?)),
        _ => None,
    };
    let scales = scales.as_ref().map(|(k, v)| (&k[..], &v[..]));
    let (qt, ct) = (ins[0].dtype(), ins[1].dtype());
    match (qt, ct) {
        (DType::F32, DType::F32) => typed::<f32, f32, f32>(ins, sz, &layout, same, scales, |x| x, Some(|x| x)),
        (DType::F64, DType::F64) => typed::<f64, f64, f64>(ins, sz, &layout, same, scales, |x| x, Some(|x| x)),
        (DType::BF16, DType::BF16) if gemm_bf16::available() => {
            let (q, k, v) = (contiguous::<bf16>(&ins[0])?, contiguous::<bf16>(&ins[1])?, contiguous::<bf16>(&ins[2])?);
            Ok(buf(forward_tiles(&q, &k, &v, sz, &layout)))
        }
        (DType::BF16, DType::BF16) => typed::<bf16, bf16, f32>(ins, sz, &layout, widen, scales, bf16::from_f32, None),
        (DType::F16, DType::F16) => typed::<f16, f16, f32>(ins, sz, &layout, widen, scales, f16::from_f32, None),
        (DType::F32, DType::BF16) => typed::<f32, bf16, f32>(ins, sz, &layout, same, scales, |x| x, None),
        (DType::F32, DType::F16) => typed::<f32, f16, f32>(ins, sz, &layout, same, scales, |x| x, None),
        (DType::F32, DType::F8E4M3FN) => typed::<f32, f8e4m3fn, f32>(ins, sz, &layout, same, scales, |x| x, None),
        (DType::F32, DType::F8E5M2) => typed::<f32, f8e5m2, f32>(ins, sz, &layout, same, scales, |x| x, None),
        (DType::BF16, DType::F8E4M3FN) => {
            typed::<bf16, f8e4m3fn, f32>(ins, sz, &layout, widen, scales, bf16::from_f32, None)
        }
        (DType::BF16, DType::F8E5M2) => {
            typed::<bf16, f8e5m2, f32>(ins, sz, &layout, widen, scales, bf16::from_f32, None)
        }
        (DType::F16, DType::F8E4M3FN) => {
            typed::<f16, f8e4m3fn, f32>(ins, sz, &layout, widen, scales, f16::from_f32, None)
        }
        (DType::F16, DType::F8E5M2) => typed::<f16, f8e5m2, f32>(ins, sz, &layout, widen, scales, f16::from_f32, None),
        _ => Err(Error::dtype("paged_attention", format!("queries {qt} over caches {ct} are not supported"))),
    }
}

/// The query rows of type `T` converted to the compute type `F`, the caches
/// of type `C` read through `read` (scaled when `scales` are given), the
/// output rounded back by `down`; `same` when the caches are of the
/// compute type.
fn typed<T: Elem, C: Elem, F: AttnFloat>(
    ins: &[Input<'_>],
    sz: Sizes,
    layout: &PagedLayout,
    up: fn(&[T], &mut [F]),
    scales: Option<(&[f32], &[f32])>,
    down: fn(F) -> T,
    same: Option<SameType<C, F>>,
) -> Result<HostBuffer> {
    let (q, k, v) = (contiguous::<T>(&ins[0])?, contiguous::<C>(&ins[1])?, contiguous::<C>(&ins[2])?);
    let mut qf = vec![<F as Elem>::of_f64(0.0); q.len()];
    up(&q, &mut qf);
    // Widening is exact: every cache type is narrower than (or) the compute type.
    let widened: &Up<'_, C, F> = &|_, s, d| {
        for (d, s) in d.iter_mut().zip(s) {
            *d = <F as Elem>::of_f64(s.cast_f64());
        }
    };
    let out = match scales {
        None => forward::<C, F>(&qf, &k, &v, sz, layout, (widened, widened), same),
        Some((ks, vs)) => {
            let rk: &Up<'_, C, F> = &|r, s, d| dequantize(s, ks[r], d);
            let rv: &Up<'_, C, F> = &|r, s, d| dequantize(s, vs[r], d);
            forward::<C, F>(&qf, &k, &v, sz, layout, (rk, rv), None)
        }
    };
    Ok(buf(out.into_iter().map(down).collect::<Vec<T>>()))
}

/// A float8 row times its scale, each element one float32 product.
fn dequantize<C: Elem, F: AttnFloat>(src: &[C], scale: f32, dst: &mut [F]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = <F as Elem>::of_f32(s.cast_f32() * scale);
    }
}

/// Rows of the type they are.
fn same<T: Copy>(src: &[T], dst: &mut [T]) {
    dst.copy_from_slice(src);
}

/// bf16 / f16 rows widened (exactly) to f32.
fn widen<T: Elem>(src: &[T], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.cast_f32();
    }
}

/// The output `[N, H, Dv]` in the compute type.
fn forward<T: Elem, F: AttnFloat>(
    q: &[F],
    kc: &[T],
    vc: &[T],
    sz: Sizes,
    layout: &PagedLayout,
    read: Readers<'_, T, F>,
    same: Option<SameType<T, F>>,
) -> Vec<F> {
    // Rows per sequence up to which the direct way runs (when it may).
    // (Eight: a decoded token and the up to seven proposed ones a
    // speculative step verifies, Note [Speculative decoding] in kiln-nn.)
    const DIRECT_ROWS: usize = 8;
    let direct = !kiln_tensor::is_batch_invariant();
    let Sizes { h, hk, dv, .. } = sz;
    let g = h / hk;
    let seqs = layout.lens.len();
    let rows_of = |s: usize| layout.starts[s + 1] - layout.starts[s];
    // The direct way splits a sequence's heads into groups only when there
    // are too few sequences to keep every thread busy.
    let groups = (2 * super::iter::threads()).div_ceil(seqs.max(1)).clamp(1, hk.max(1));
    let per = hk.div_ceil(groups);
    // Tasks: (sequence, first kv head, end kv head); the gathered way takes one head per task.
    let tasks: Vec<(usize, usize, usize)> = (0..seqs)
        .filter(|&s| rows_of(s) > 0)
        .flat_map(|s| {
            let one = !direct || rows_of(s) > DIRECT_ROWS;
            let step = if one { 1 } else { per };
            (0..hk).step_by(step.max(1)).map(move |k0| (s, k0, (k0 + step).min(hk)))
        })
        .collect();
    // Each task returns its query heads' rows: [(kh1 - kh0) * G, n_s, Dv].
    let parts: Vec<(usize, usize, Vec<F>)> = fork_map(tasks.len(), &|i| {
        let (s, kh0, kh1) = tasks[i];
        let rows = rows_of(s);
        if direct && rows <= DIRECT_ROWS {
            let mut out = vec![<F as Elem>::of_f64(0.0); (kh1 - kh0) * g * rows * dv];
            let (caches, heads) = (Caches { kc, vc, same, read }, (kh0, kh1));
            let task = Direct { q, caches, sz, layout, s, heads, out: &mut out };
            dispatch(task);
            return (s, kh0, out);
        }
        let zero = <F as Elem>::of_f64(0.0);
        let (mut out, mut lse) = (vec![zero; g * rows * dv], vec![zero; rows]);
        gathered_heads(q, (kc, vc), (s, kh0), sz, layout, (read, zero), &mut out, &mut |dm, [q, k, v], out| {
            dispatch(HeadForward { dm, q, k, v, out, lse: &mut lse })
        });
        (s, kh0, out)
    });
    assemble(parts, sz, layout, <F as Elem>::of_f64(0.0))
}

/// The output `[N, H, Dv]` from each task's `(sequence, first kv head, its
/// query heads' rows [heads, rows, Dv])`.
fn assemble<E: Copy>(parts: Vec<(usize, usize, Vec<E>)>, sz: Sizes, layout: &PagedLayout, zero: E) -> Vec<E> {
    let Sizes { n, h, hk, dv, .. } = sz;
    let g = h / hk;
    let mut out = vec![zero; n * h * dv];
    for (s, kh0, part) in parts {
        let (r0, rows) = (layout.starts[s], layout.starts[s + 1] - layout.starts[s]);
        for (j, head) in part.chunks_exact((rows * dv).max(1)).enumerate() {
            let hq = kh0 * g + j;
            for (i, src) in head.chunks_exact(dv.max(1)).enumerate() {
                out[((r0 + i) * h + hq) * dv..][..dv].copy_from_slice(src);
            }
        }
    }
    out
}

/// The keys (or values, `width` per row) of sequence `s`'s first `len`
/// positions in head `kh`, position by position from their blocks, each row
/// converted by `read`.
fn gather<T, F: Copy>(
    cache: &[T],
    (s, kh, len): (usize, usize, usize),
    width: usize,
    sz: Sizes,
    layout: &PagedLayout,
    read: &Up<'_, T, F>,
    zero: F,
) -> Vec<F> {
    let Sizes { bs, hk, .. } = sz;
    let mut dst = vec![zero; len * width];
    for (p, out) in dst.chunks_exact_mut(width.max(1)).enumerate().take(len) {
        let blk = layout.tables[s * layout.max_blocks + p / bs];
        let row = (blk * bs + p % bs) * hk + kh;
        read(row, &cache[row * width..][..width], out);
    }
    dst
}

/// How the gathered way reads a cache row into compute elements, given the
/// row's index in the pool (`slot * Hk + head`, the index of its scale) and
/// its elements.
type Up<'a, T, X> = dyn Fn(usize, &[T], &mut [X]) + Sync + 'a;

/// The readers of the key rows and of the value rows.
type Readers<'a, T, X> = (&'a Up<'a, T, X>, &'a Up<'a, T, X>);

/// One query head's kernel, given its dims, its query rows, the keys and the
/// values, and its rows of the output.
type HeadKernel<'r, X, O> = dyn FnMut(Dims, [MatRef<'_, X>; 3], &mut [O]) + 'r;

/// The gathered way's task for sequence `s` and key/value head `kh`: the
/// sequence's keys and values of head `kh` gathered (each row converted by
/// `read`), then `run(dims, [q, k, v], that head's rows of out)` for each query
/// head of the group (`out` is `[G, rows, Dv]`).
#[allow(clippy::too_many_arguments)]
fn gathered_heads<T, X: Copy, O>(
    q: &[X],
    (kc, vc): (&[T], &[T]),
    (s, kh): (usize, usize),
    sz: Sizes,
    layout: &PagedLayout,
    ((rk, rv), zero): (Readers<'_, T, X>, X),
    out: &mut [O],
    run: &mut HeadKernel<'_, X, O>,
) {
    let Sizes { h, d, hk, dv, scale, .. } = sz;
    let g = h / hk;
    let (r0, rows, len) = (layout.starts[s], layout.starts[s + 1] - layout.starts[s], layout.lens[s]);
    let (ks, vs) =
        (gather(kc, (s, kh, len), d, sz, layout, rk, zero), gather(vc, (s, kh, len), dv, sz, layout, rv, zero));
    let dm = Dims { b: 1, h, t: rows, d, hk, s: len, dv, scale, causal: true };
    for (gi, o) in out.chunks_mut((rows * dv).max(1)).enumerate().take(g) {
        let hq = kh * g + gi;
        let qm = MatRef { data: q, off: (r0 * h + hq) * d, rs: h * d, cs: 1 };
        let (km, vm) =
            (MatRef { data: &ks[..], off: 0, rs: d, cs: 1 }, MatRef { data: &vs[..], off: 0, rs: dv, cs: 1 });
        run(dm, [qm, km, vm], o);
    }
}

/// The gathered way in bf16 on tiles, one task per (sequence, key/value
/// head): the sequence's keys and values gathered as they are (bf16), then
/// the tile kernel's per-head forward on each query head of the group, so
/// each row is the one `Op::Attention` gives (its products are row-invariant).
fn forward_tiles(q: &[bf16], kc: &[bf16], vc: &[bf16], sz: Sizes, layout: &PagedLayout) -> Vec<bf16> {
    let Sizes { h, hk, dv, .. } = sz;
    let g = h / hk;
    let rows_of = |s: usize| layout.starts[s + 1] - layout.starts[s];
    let tasks: Vec<(usize, usize)> =
        (0..layout.lens.len()).filter(|&s| rows_of(s) > 0).flat_map(|s| (0..hk).map(move |kh| (s, kh))).collect();
    let parts: Vec<(usize, usize, Vec<bf16>)> = fork_map(tasks.len(), &|i| {
        let (s, kh) = tasks[i];
        let copy: &Up<'_, bf16, bf16> = &|_, s, d| d.copy_from_slice(s);
        let (mut out, mut lse) = (uninit::<bf16>(g * rows_of(s) * dv), vec![0f32; rows_of(s)]);
        gathered_heads(
            q,
            (kc, vc),
            (s, kh),
            sz,
            layout,
            ((copy, copy), bf16::ZERO),
            &mut out,
            &mut |dm, [q, k, v], out| dispatch(HeadForwardTiles { dm, q, k, v, out, lse: &mut lse }),
        );
        // SAFETY: each of the g query heads' `rows x dv` outputs was written in
        // full by its kernel (every block of rows); with no elements there is
        // nothing to write.
        (s, kh, unsafe { assume_init(out) })
    });
    assemble(parts, sz, layout, bf16::ZERO)
}

/// The direct way for one sequence and a range of its key/value heads: every
/// query row of their query heads against the keys and values read in place.
/// Each position's rows of all heads are contiguous in a block, so both
/// passes (scores, then weighted values) stream through the sequence's
/// blocks once, with no index arithmetic per position beyond the block's.
struct Direct<'a, C, F> {
    q: &'a [F],
    caches: Caches<'a, C, F>,
    sz: Sizes,
    layout: &'a PagedLayout,
    s: usize,
    /// Key/value heads `[first, end)`.
    heads: (usize, usize),
    /// `[(end - first) * G, rows, Dv]`.
    out: &'a mut [F],
}

/// The caches as the direct way reads them: in place when they are of the
/// compute type (`same`), else each position's rows through the readers
/// into a scratch row.
struct Caches<'a, C, F> {
    kc: &'a [C],
    vc: &'a [C],
    same: Option<SameType<C, F>>,
    read: Readers<'a, C, F>,
}

impl<C, F: Copy> Caches<'_, C, F> {
    /// The rows of heads `kh0..kh1` at cache slot `slot` (`width` each) of
    /// `cache` (keys: 0, values: 1), and the offset of head `kh0` in them.
    #[inline(always)]
    fn rows<'s>(
        &'s self,
        which: usize,
        slot: usize,
        (kh0, kh1): (usize, usize),
        width: usize,
        hk: usize,
        scratch: &'s mut [F],
    ) -> (&'s [F], usize) {
        let (cache, read) = if which == 0 { (self.kc, self.read.0) } else { (self.vc, self.read.1) };
        if let Some(same) = self.same {
            return (&same(cache)[slot * hk * width..][..hk * width], kh0 * width);
        }
        for (kh, dst) in (kh0..kh1).zip(scratch.chunks_exact_mut(width.max(1))) {
            let r = slot * hk + kh;
            read(r, &cache[r * width..][..width], dst);
        }
        (scratch, 0)
    }
}

impl<C, F: AttnFloat> Kernel for Direct<'_, C, F> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let Direct { q, caches, sz, layout, s, heads: (kh0, kh1), out } = self;
        let Sizes { h, d, bs, hk, dv, scale, .. } = sz;
        let g = h / hk;
        let (r0, rows, len) = (layout.starts[s], layout.starts[s + 1] - layout.starts[s], layout.lens[s]);
        let table = &layout.tables[s * layout.max_blocks..];
        let scale = <F as Elem>::of_f64(scale);
        let nh = (kh1 - kh0) * g;
        // Row i of a chunk of `rows` ending at position len - 1 sees the first vis(i) positions.
        let vis = |i: usize| len - rows + i + 1;
        // Scores `[nh, rows, len]`, then their softmax over each row's visible prefix.
        let zero = <F as Elem>::of_f64(0.0);
        let mut sc = vec![zero; nh * rows * len];
        let mut scratch = vec![zero; (kh1 - kh0) * d.max(dv)];
        for (b, &blk) in table.iter().enumerate().take(len.div_ceil(bs)) {
            for j in 0..bs.min(len - b * bs) {
                let p = b * bs + j;
                let (keys, o) = caches.rows(0, blk * bs + j, (kh0, kh1), d, hk, &mut scratch);
                for jh in 0..nh {
                    let hq = kh0 * g + jh;
                    let kr = &keys[o + (jh / g) * d..][..d];
                    for i in 0..rows {
                        let qr = &q[((r0 + i) * h + hq) * d..][..d];
                        sc[(jh * rows + i) * len + p] = dot(qr, kr) * scale;
                    }
                }
            }
        }
        for (r, row) in sc.chunks_exact_mut(len.max(1)).enumerate().take(nh * rows) {
            softmax_prefix::<F, FMA>(row, vis(r % rows));
        }
        for (b, &blk) in table.iter().enumerate().take(len.div_ceil(bs)) {
            for j in 0..bs.min(len - b * bs) {
                let p = b * bs + j;
                let (values, o) = caches.rows(1, blk * bs + j, (kh0, kh1), dv, hk, &mut scratch);
                for jh in 0..nh {
                    let vr = &values[o + (jh / g) * dv..][..dv];
                    for i in (0..rows).filter(|&i| p < vis(i)) {
                        let w = sc[(jh * rows + i) * len + p];
                        for (x, &y) in out[(jh * rows + i) * dv..][..dv].iter_mut().zip(vr) {
                            *x = *x + w * y;
                        }
                    }
                }
            }
        }
    }
}

/// A dot product with independent partial sums (so it vectorises), summed
/// as a tree.
#[inline(always)]
fn dot<F: AttnFloat>(a: &[F], b: &[F]) -> F {
    const L: usize = 16;
    let zero = <F as Elem>::of_f64(0.0);
    let mut acc = [zero; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s = *s + x * y;
        }
    }
    // The lanes pass through memory on their way to the tree: with the tree
    // in view, LLVM built the sums above two lanes at a time (xmm pairs
    // instead of one zmm on AVX-512) and the serving engine's paged attention
    // took about 15% longer. The bits are the same either way.
    let mut acc = std::hint::black_box(acc);
    let mut w = L / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] = acc[l] + acc[l + w];
        }
        w /= 2;
    }
    let mut s = acc[0];
    for (x, y) in ra.iter().zip(rb) {
        s = s + *x * *y;
    }
    s
}
