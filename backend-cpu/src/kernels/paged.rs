//! `Op::PagedAttention` (Note [Paged attention] in kiln-tensor): attention of
//! packed queries over a paged KV cache.
//!
//! One task per (sequence, key/value head): it gathers the sequence's keys and
//! values of that head from their blocks into two small contiguous buffers,
//! then runs the fused attention kernel's per-head forward on each query head
//! of the group, with the sequence's queries as the rows of a causal attention
//! whose last row is the last cached position. So each row is computed exactly
//! as `Op::Attention` computes that query (Note [Row-invariant products] makes
//! it the same bits whatever the rows beside it). bf16 and f16 compute in
//! float32 and round once.
use super::attention::{AttnFloat, Dims, HeadForward};
use super::copy::contiguous;
use super::elem::Elem;
use super::matmul::MatRef;
use super::simd::dispatch;
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::paged::PagedLayout;
use kiln_tensor::{DType, Error, HostBuffer, Result};
use rayon::prelude::*;

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

/// `Op::PagedAttention`: inputs `q, k_cache, v_cache, block_tables, context_lens, query_start`.
pub(crate) fn paged_attention(ins: &[Input<'_>], scale: f64) -> Result<HostBuffer> {
    let (qs, ks, vs) = (ins[0].layout.shape(), ins[1].layout.shape(), ins[2].layout.shape());
    let sz = Sizes { n: qs[0], h: qs[1], d: qs[2], bs: ks[1], hk: ks[2], dv: vs[3], scale };
    let ints = |i: usize| contiguous::<i64>(&ins[i]);
    let layout = PagedLayout::new(&ints(5)?, &ints(4)?, &ints(3)?, sz.n, ks[0], sz.bs)?;
    fn typed<T: Elem, F: AttnFloat>(
        ins: &[Input<'_>],
        sz: Sizes,
        layout: &PagedLayout,
        up: fn(T) -> F,
        down: fn(F) -> T,
    ) -> Result<HostBuffer> {
        let (q, k, v) = (contiguous::<T>(&ins[0])?, contiguous::<T>(&ins[1])?, contiguous::<T>(&ins[2])?);
        let q: Vec<F> = q.iter().map(|&x| up(x)).collect();
        let out = forward::<T, F>(&q, &k, &v, sz, layout, up);
        Ok(buf(out.into_iter().map(down).collect::<Vec<T>>()))
    }
    match ins[0].dtype() {
        DType::F32 => typed::<f32, f32>(ins, sz, &layout, |x| x, |x| x),
        DType::F64 => typed::<f64, f64>(ins, sz, &layout, |x| x, |x| x),
        DType::BF16 => typed::<bf16, f32>(ins, sz, &layout, |x| x.to_f32(), bf16::from_f32),
        DType::F16 => typed::<f16, f32>(ins, sz, &layout, |x| x.to_f32(), f16::from_f32),
        dt => Err(Error::unsupported_dtype("paged_attention", dt)),
    }
}

/// The output `[N, H, Dv]` in the compute type.
fn forward<T: Elem, F: AttnFloat>(
    q: &[F],
    kc: &[T],
    vc: &[T],
    sz: Sizes,
    layout: &PagedLayout,
    up: fn(T) -> F,
) -> Vec<F> {
    let Sizes { n, h, d, bs, hk, dv, scale } = sz;
    let g = h / hk;
    let seqs = layout.lens.len();
    // Each task returns its heads' rows: [G, n_s, Dv].
    let parts: Vec<(usize, usize, Vec<F>)> = (0..seqs * hk)
        .into_par_iter()
        .filter(|&task| layout.starts[task / hk + 1] > layout.starts[task / hk])
        .map(|task| {
            let (s, kh) = (task / hk, task % hk);
            let (r0, rows, len) = (layout.starts[s], layout.starts[s + 1] - layout.starts[s], layout.lens[s]);
            // The sequence's keys and values of head kh, position by position.
            let gather = |cache: &[T], width: usize| -> Vec<F> {
                let mut dst = Vec::with_capacity(len * width);
                for p in 0..len {
                    let blk = layout.tables[s * layout.max_blocks + p / bs];
                    let row = ((blk * bs + p % bs) * hk + kh) * width;
                    dst.extend(cache[row..row + width].iter().map(|&x| up(x)));
                }
                dst
            };
            let (ks, vs) = (gather(kc, d), gather(vc, dv));
            let dm = Dims { b: 1, h, t: rows, d, hk, s: len, dv, scale, causal: true };
            let mut out = vec![<F as Elem>::of_f64(0.0); g * rows * dv];
            let mut lse = vec![<F as Elem>::of_f64(0.0); rows];
            for (gi, o) in out.chunks_mut((rows * dv).max(1)).enumerate().take(g) {
                let hq = kh * g + gi;
                dispatch(HeadForward {
                    dm,
                    q: MatRef { data: q, off: (r0 * h + hq) * d, rs: h * d, cs: 1 },
                    k: MatRef { data: &ks, off: 0, rs: d, cs: 1 },
                    v: MatRef { data: &vs, off: 0, rs: dv, cs: 1 },
                    out: o,
                    lse: &mut lse,
                });
            }
            (s, kh, out)
        })
        .collect();
    let mut out = vec![<F as Elem>::of_f64(0.0); n * h * dv];
    for (s, kh, part) in parts {
        let (r0, rows) = (layout.starts[s], layout.starts[s + 1] - layout.starts[s]);
        for gi in 0..g {
            let hq = kh * g + gi;
            for i in 0..rows {
                let src = &part[(gi * rows + i) * dv..][..dv];
                out[((r0 + i) * h + hq) * dv..][..dv].copy_from_slice(src);
            }
        }
    }
    out
}
