//! bf16 attention on the AMX tile unit: the products of
//! `scaled_dot_product_attention` and of its gradients with bf16 operands and
//! f32 sums, the softmax and its gradient in f32 (Note [Attention on tiles]).
// Only x86-64 Linux has the unit; elsewhere `gemm_bf16::available()` is false
// and none of this runs.
use super::attention::{chunks, softmax_prefix, Dims, Operand, BLOCK};
use super::elem::{assume_init, uninit};
use super::gemm_bf16::{product, round_into, Packed, Strided};
use super::iter::{fork_chunks, fork_zip};
use super::matmul::MatRef;
use super::simd::dispatch;
use super::simd::Kernel;
use super::softmax::SoftFloat;
use super::{buf, Input};
use half::bf16;
use kiln_tensor::{HostBuffer, Result};
use std::mem::MaybeUninit;

// Note [Attention on tiles]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// With bf16 operands and the tile unit (Note [bf16 products on tiles]) the
// attention kernels run their products there rather than widening q, k, v
// (and, backward, the output and its gradient) to f32 and multiplying on the
// FMA units. Per (batch, head) the operands read as `b` are packed once; per
// block of BLOCK query rows the scores `q k^T` come back as f32 sums, the
// softmax (and, backward, `ds = p (dp - rowsum(g out)) scale`) runs in f32,
// and the probabilities (and `ds`) enter their products rounded to bf16, the
// precision PyTorch's CPU flash attention gives them for bf16 inputs. Sums
// are f32 throughout and each result is rounded to bf16 once. Every row's
// products depend on its own row and the keys only (the products are
// row-invariant), so a query row's result does not depend on the rows
// computed with it. As in the f32 kernels, a masked probability is an exact
// zero that multiplies its key's value (an infinite value poisons the row
// either way).

/// `v` as a product's output: it writes only initialised values.
fn as_out(v: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; every caller hands the
    // slice to `product`, which writes initialised values only, so `v` stays
    // initialised.
    unsafe { &mut *(v as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// `src` rounded into `dst` (as long), 16 at a time.
fn round(src: &[f32], dst: &mut [bf16]) {
    // SAFETY: `MaybeUninit<bf16>` has `bf16`'s layout, and `round_into` writes
    // (initialised values into) every element.
    round_into(src, unsafe { &mut *(dst as *mut [bf16] as *mut [MaybeUninit<bf16>]) });
}

/// `m` as the `a` or `b` operand of a tile product.
fn strided(m: MatRef<'_, bf16>) -> Strided<'_> {
    Strided { v: m.data, off: m.off, rs: m.rs, cs: m.cs }
}

/// Each thread's buffers for the kernels below, kept across heads and calls
/// (several small packings per query block would otherwise allocate each time).
/// A kernel takes them out for its run (not borrowing them inside a
/// closure, which would not be compiled for the kernel's instruction set).
struct Scratch {
    packs: [Packed; 10],
    sums: [Vec<f32>; 5],
    rounded: [Vec<bf16>; 2],
}

impl Default for Scratch {
    fn default() -> Scratch {
        Scratch { packs: std::array::from_fn(|_| Packed::new()), sums: Default::default(), rounded: Default::default() }
    }
}

thread_local! {
    static SCRATCH: std::cell::Cell<Option<Box<Scratch>>> = const { std::cell::Cell::new(None) };
}

/// This thread's scratch (a fresh one when it is out or was never made).
fn take_scratch() -> Box<Scratch> {
    SCRATCH.take().unwrap_or_default()
}

/// Puts this thread's scratch back for the next kernel.
fn put_scratch(s: Box<Scratch>) {
    SCRATCH.set(Some(s));
}

/// Forward of one (batch, head) on tiles: `out` is its `[T, Dv]` block, `lse` its `[T]`.
pub(super) struct HeadForwardTiles<'a> {
    pub dm: Dims,
    pub q: MatRef<'a, bf16>,
    pub k: MatRef<'a, bf16>,
    pub v: MatRef<'a, bf16>,
    pub out: &'a mut [MaybeUninit<bf16>],
    pub lse: &'a mut [f32],
}

impl Kernel for HeadForwardTiles<'_> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let HeadForwardTiles { dm, q, k, v, out, lse } = self;
        let mut scratch = take_scratch();
        let Scratch { packs: [kb, vb, qa, pa, ..], sums: [sc, ..], rounded: [p, ..] } = &mut *scratch;
        let (d, dv) = (dm.d, dm.dv);
        kb.pack_b(strided(k.t()), d, dm.s, false);
        vb.pack_b(strided(v), dm.s, dv, false);
        let scale = dm.scale as f32;
        for i0 in (0..dm.t).step_by(BLOCK) {
            let rows = BLOCK.min(dm.t - i0);
            let su = dm.visible(i0 + rows - 1);
            sc.resize(rows * su, 0f32);
            p.resize(rows * su, bf16::ZERO);
            qa.pack_a(strided(q.rows_from(i0)), rows, d, false);
            product(qa, kb, (rows, d, su), as_out(sc), false);
            for r in 0..rows {
                let row = &mut sc[r * su..(r + 1) * su];
                for x in row.iter_mut() {
                    *x *= scale;
                }
                lse[i0 + r] = softmax_prefix::<f32, FMA>(row, dm.visible(i0 + r));
            }
            round(sc, p);
            pa.pack_a(Strided { v: p, off: 0, rs: su, cs: 1 }, rows, su, false);
            product(pa, vb, (rows, su, dv), &mut out[i0 * dv..(i0 + rows) * dv], false);
        }
        put_scratch(scratch);
    }
}

/// `Op::Attention` for bf16 inputs on tiles: outputs `out` (bf16) and `lse` (f32).
pub(super) fn forward(ins: &[Input<'_>], dm: Dims) -> Result<Vec<HostBuffer>> {
    let o = |i: usize| -> Result<Operand<'_, bf16>> { Ok(Operand::new(ins[i].slice::<bf16>()?, ins[i].layout)) };
    let (q, k, v) = (o(0)?, o(1)?, o(2)?);
    let (heads, t, dv) = (dm.b * dm.h, dm.t, dm.dv);
    let mut out = uninit::<bf16>(heads * t * dv);
    let mut lse = vec![0f32; heads * t];
    if heads > 0 && t > 0 {
        let g = dm.group();
        let task = |bh: usize, out: &mut [MaybeUninit<bf16>], lse: &mut [f32]| {
            let (b, h) = (bh / dm.h, bh % dm.h);
            dispatch(HeadForwardTiles { dm, q: q.head(b, h), k: k.head(b, h / g), v: v.head(b, h / g), out, lse });
        };
        if dv == 0 {
            // No output columns: only the log-sum-exps.
            fork_chunks(&mut lse, t, 1, &|bh, l| task(bh, &mut [], l));
        } else {
            fork_zip(&mut out, t * dv, &mut lse, t, &|bh, o, l| task(bh, o, l));
        }
    }
    // SAFETY: each head's task wrote its `[T, Dv]` block of `out` in full
    // (every query block's rows), and the blocks cover `out`; with no heads or
    // rows `out` is empty.
    let out = unsafe { assume_init(out) };
    Ok(vec![buf(out), buf(lse)])
}

/// `acc[i] += add[i]`.
fn add_into(acc: &mut [f32], add: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(add) {
        *a += x;
    }
}

/// Backward of one (batch, key/value head) and the query heads sharing it,
/// on tiles (Note [Attention on tiles]).
struct GroupBackwardTiles<'a> {
    dm: Dims,
    b: usize,
    kh: usize,
    q: Operand<'a, bf16>,
    k: MatRef<'a, bf16>,
    v: MatRef<'a, bf16>,
    out: Operand<'a, bf16>,
    g: Operand<'a, bf16>,
    lse: &'a [f32],
    /// `[G, T, D]`: the gradients of the group's query heads.
    dq: &'a mut [MaybeUninit<bf16>],
    /// `[S, D]` and `[S, Dv]`.
    dk: &'a mut [MaybeUninit<bf16>],
    dv: &'a mut [MaybeUninit<bf16>],
}

impl Kernel for GroupBackwardTiles<'_> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let GroupBackwardTiles { dm, b, kh, q, k, v, out, g, lse, dq, dk, dv } = self;
        let (t, s, d, dvn) = (dm.t, dm.s, dm.d, dm.dv);
        let scale = dm.scale as f32;
        let mut scratch = take_scratch();
        let Scratch { packs, sums: [dk_acc, dv_acc, p, dp, part], rounded: [p16, ds16] } = &mut *scratch;
        // Packed once for every query head of the group (k^T, v^T, k), then
        // each query block's operands.
        let [kt, vt, kb, qa, pt, gb, ga, dsa, dst, qb] = packs;
        kt.pack_b(strided(k.t()), d, s, false);
        vt.pack_b(strided(v.t()), dvn, s, false);
        kb.pack_b(strided(k), s, d, false);
        for acc in [&mut *dk_acc, &mut *dv_acc] {
            acc.clear();
        }
        dk_acc.resize(s * d, 0.0);
        dv_acc.resize(s * dvn, 0.0);
        for gi in 0..dm.group() {
            let h = kh * dm.group() + gi;
            let (qh, oh, gh) = (q.head(b, h), out.head(b, h), g.head(b, h));
            let lse = &lse[(b * dm.h + h) * t..][..t];
            let dqh = &mut dq[gi * t * d..][..t * d];
            for i0 in (0..t).step_by(BLOCK) {
                let rows = BLOCK.min(t - i0);
                let su = dm.visible(i0 + rows - 1);
                let (qr, gr) = (qh.rows_from(i0), gh.rows_from(i0));
                p.resize(rows * su, 0f32);
                dp.resize(rows * su, 0f32);
                p16.resize(rows * su, bf16::ZERO);
                ds16.resize(rows * su, bf16::ZERO);
                // p = exp(scale q k^T - lse) where visible, else 0.
                qa.pack_a(strided(qr), rows, d, false);
                product(qa, kt, (rows, d, su), as_out(p), false);
                for r in 0..rows {
                    let (n, l) = (dm.visible(i0 + r), lse[i0 + r]);
                    let row = &mut p[r * su..(r + 1) * su];
                    for x in row[..n].iter_mut() {
                        *x = SoftFloat::exp::<FMA>(*x * scale - l);
                    }
                    row[n..].fill(0.0);
                }
                round(p, p16);
                // dv[..su] += p^T g.
                pt.pack_a(Strided { v: p16, off: 0, rs: 1, cs: su }, su, rows, false);
                gb.pack_b(strided(gr), rows, dvn, false);
                part.resize(su * dvn.max(d), 0f32);
                product(pt, gb, (su, rows, dvn), as_out(&mut part[..su * dvn]), false);
                add_into(&mut dv_acc[..su * dvn], &part[..su * dvn]);
                // dp = g v^T; ds = p (dp - rowsum(g out)) scale.
                ga.pack_a(strided(gr), rows, dvn, false);
                product(ga, vt, (rows, dvn, su), as_out(dp), false);
                for r in 0..rows {
                    let (go, oo) = (gr.rows_from(r), oh.rows_from(i0 + r));
                    let di = (0..dvn).fold(0f32, |acc, c| {
                        acc + go.data[go.off + c * go.cs].to_f32() * oo.data[oo.off + c * oo.cs].to_f32()
                    });
                    let (pr, dr) = (&p[r * su..(r + 1) * su], &mut dp[r * su..(r + 1) * su]);
                    for (x, &pv) in dr.iter_mut().zip(pr) {
                        *x = pv * (*x - di) * scale;
                    }
                }
                round(dp, ds16);
                // dq rows = ds k; dk[..su] += ds^T q.
                dsa.pack_a(Strided { v: ds16, off: 0, rs: su, cs: 1 }, rows, su, false);
                product(dsa, kb, (rows, su, d), &mut dqh[i0 * d..(i0 + rows) * d], false);
                dst.pack_a(Strided { v: ds16, off: 0, rs: 1, cs: su }, su, rows, false);
                qb.pack_b(strided(qr), rows, d, false);
                product(dst, qb, (su, rows, d), as_out(&mut part[..su * d]), false);
                add_into(&mut dk_acc[..su * d], &part[..su * d]);
            }
        }
        round_into(dk_acc, dk);
        round_into(dv_acc, dv);
        put_scratch(scratch);
    }
}

/// `Op::AttentionBackward` for bf16 inputs on tiles: inputs `q, k, v, out,
/// lse, g` (`lse` f32, contiguous); outputs `dq, dk, dv` in bf16.
pub(super) fn backward(ins: &[Input<'_>], lse: &[f32], dm: Dims) -> Result<Vec<HostBuffer>> {
    let o = |i: usize| -> Result<Operand<'_, bf16>> { Ok(Operand::new(ins[i].slice::<bf16>()?, ins[i].layout)) };
    let (q, k, v, out, g) = (o(0)?, o(1)?, o(2)?, o(3)?, o(5)?);
    let (tq, tk, tv) = (dm.t * dm.d, dm.s * dm.d, dm.s * dm.dv);
    let (mut dq, mut dk, mut dv) =
        (uninit::<bf16>(dm.b * dm.h * tq), uninit::<bf16>(dm.b * dm.hk * tk), uninit::<bf16>(dm.b * dm.hk * tv));
    let groups = dm.b * dm.hk;
    if groups > 0 {
        let mut parts: Vec<_> = chunks(&mut dq, dm.group() * tq, groups)
            .into_iter()
            .zip(chunks(&mut dk, tk, groups))
            .zip(chunks(&mut dv, tv, groups))
            .map(|((dq, dk), dv)| (dq, dk, dv))
            .collect();
        fork_chunks(&mut parts, 1, 1, &|bk, p| {
            let (dq, dk, dv) = &mut p[0];
            let (b, kh) = (bk / dm.hk, bk % dm.hk);
            let (k, v) = (k.head(b, kh), v.head(b, kh));
            dispatch(GroupBackwardTiles { dm, b, kh, q, k, v, out, g, lse, dq, dk, dv });
        });
    }
    // SAFETY: each group's task wrote its heads' `dq` rows (a product over
    // every query block of every head: `product` writes every element, zeros
    // for an empty depth) and all of its `dk` and `dv` (the final rounding
    // loop); the groups' chunks cover the three buffers, which are empty when
    // there are no groups.
    let (dq, dk, dv) = unsafe { (assume_init(dq), assume_init(dk), assume_init(dv)) };
    Ok(vec![buf(dq), buf(dk), buf(dv)])
}
