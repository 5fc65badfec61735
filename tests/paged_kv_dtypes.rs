//! Paged attention over caches narrower than its queries (Note [KV cache
//! dtypes]): bfloat16 / float16 caches under float32 queries, float8 caches
//! with a scale per row under float32 and bfloat16 queries. Each row is the
//! fused kernel's over the widened (dequantized) cache: bit for bit on the
//! CPU with batch invariance on, to float32 rounding on PJRT; the typing rule
//! refuses what does not fit.
use kiln::nn::layers::{load_rows, store_rows};
use kiln::prelude::*;

mod common;

/// (context length, new rows, block table) of each sequence: a prompt
/// chunk, a decoded row, a sequence with no new rows.
fn seqs() -> Vec<(usize, usize, Vec<i64>)> {
    vec![(11, 6, vec![4, 0, 6]), (9, 1, vec![1, 5, 2]), (3, 0, vec![3])]
}

const BS: usize = 4;
const BLOCKS: usize = 7;
const MB: usize = 3;

/// The pool `[BLOCKS, BS, rest..]` holding each sequence's rows (`[L,
/// rest..]`) at the slots its block table gives, zeros elsewhere.
fn pool(rows: &[Tensor], dev: Device) -> Tensor {
    let rest = rows[0].shape()[1..].to_vec();
    let mut shape = vec![BLOCKS * BS];
    shape.extend_from_slice(&rest);
    let flat = Tensor::zeros(&shape, rows[0].dtype()).unwrap();
    for (x, (_, _, table)) in rows.iter().zip(seqs()) {
        for p in 0..x.shape()[0] {
            let slot = table[p / BS] as usize * BS + p % BS;
            flat.select(0, slot as isize).unwrap().copy_(&x.select(0, p as isize).unwrap()).unwrap();
        }
    }
    let mut full = vec![BLOCKS, BS];
    full.extend_from_slice(&rest);
    flat.reshape_to(&full).unwrap().to_device(dev).unwrap()
}

/// Sequence rows `[L, Hk, D]` as a cache of `kv` stores them: per sequence
/// the elements and (float8) the scales `[L, Hk]`.
fn stored(x: &[Tensor], kv: DType) -> (Vec<Tensor>, Option<Vec<Tensor>>) {
    let pairs: Vec<(Tensor, Option<Tensor>)> = x.iter().map(|t| store_rows(t, kv).unwrap()).collect();
    let scales = pairs.iter().map(|p| p.1.clone()).collect::<Option<Vec<_>>>();
    (pairs.into_iter().map(|p| p.0).collect(), scales)
}

#[test]
fn narrow_caches_read_as_their_widened_values() {
    let _invariant = common::batch_invariance(true);
    let (h, hk, d) = (4usize, 2usize, 16usize);
    let ss = seqs();
    // Keys spread over two decades per row, so a row's scale matters.
    let spread = |l: usize, seed: u64| {
        let x = common::ramp(&[l, hk, d], seed, DType::F32, Device::Cpu);
        let e = common::ramp(&[l, hk, d], seed + 100, DType::F32, Device::Cpu).mul(0.5).unwrap().exp().unwrap();
        x.mul(&e).unwrap()
    };
    let keys: Vec<Tensor> = ss.iter().enumerate().map(|(i, s)| spread(s.0, 10 + i as u64)).collect();
    let vals: Vec<Tensor> = ss.iter().enumerate().map(|(i, s)| spread(s.0, 20 + i as u64)).collect();
    let n: usize = ss.iter().map(|s| s.1).sum();
    let mut starts = vec![0i64];
    for s in &ss {
        starts.push(starts.last().unwrap() + s.1 as i64);
    }
    let table: Vec<i64> = ss.iter().flat_map(|s| (0..MB).map(|j| s.2.get(j).copied().unwrap_or(0))).collect();
    let lens: Vec<i64> = ss.iter().map(|s| s.0 as i64).collect();
    for (qdt, kv) in [
        (DType::F32, DType::BF16),
        (DType::F32, DType::F16),
        (DType::F32, DType::F8E4M3FN),
        (DType::F32, DType::F8E5M2),
        (DType::BF16, DType::F8E4M3FN),
    ] {
        let q = common::ramp(&[n, h, d], 7, qdt, Device::Cpu);
        let (ks, kscale) = stored(&keys, kv);
        let (vs, vscale) = stored(&vals, kv);
        // The reference: the fused kernel in float32 over the widened rows.
        let widened = |x: &[Tensor], s: &Option<Vec<Tensor>>| -> Vec<Tensor> {
            x.iter().enumerate().map(|(i, t)| load_rows(t, s.as_ref().map(|s| &s[i]), DType::F32).unwrap()).collect()
        };
        let (kw, vw) = (widened(&ks, &kscale), widened(&vs, &vscale));
        let qf = q.to_dtype(DType::F32).unwrap();
        let mut want = vec![];
        for (i, s) in ss.iter().enumerate().filter(|(_, s)| s.1 > 0) {
            let qs = qf.narrow(0, starts[i] as isize, s.1).unwrap().transpose(0, 1).unwrap().unsqueeze(0).unwrap();
            let four = |x: &Tensor| x.permute(&[1, 0, 2]).unwrap().unsqueeze(0).unwrap();
            let o = qs.scaled_dot_product_attention(&four(&kw[i]), &four(&vw[i]), true, None).unwrap();
            want.push(o.squeeze_dim(0).unwrap().transpose(0, 1).unwrap());
        }
        let want = Tensor::cat(&want.iter().collect::<Vec<_>>(), 0).unwrap().to_dtype(qdt).unwrap();
        let want = want.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        for dev in common::devices() {
            let meta =
                |v: &[i64], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape).unwrap().to_device(dev).unwrap();
            let (tb, ln, st) = (meta(&table, &[3, MB]), meta(&lens, &[3]), meta(&starts, &[4]));
            let qd = q.to_device(dev).unwrap();
            let (kc, vc) = (pool(&ks, dev), pool(&vs, dev));
            let got = match (&kscale, &vscale) {
                (Some(a), Some(b)) => {
                    let (sa, sb) = (pool(a, dev), pool(b, dev));
                    qd.paged_attention_scaled((&kc, &sa), (&vc, &sb), &tb, &ln, &st, None).unwrap()
                }
                _ => qd.paged_attention(&kc, &vc, &tb, &ln, &st, None).unwrap(),
            };
            assert_eq!((got.shape(), got.dtype()), (&[n, h, d][..], qdt));
            let got = got.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            if dev == Device::Cpu {
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{qdt} over {kv}: not bit for bit the fused kernel's rows over the widened cache (max error {err})"
                );
                // Batch invariance off: the decoded row reads the cache in
                // place (the direct way), within float32 rounding.
                kiln::tensor::set_batch_invariant(false);
                let direct = match (&kscale, &vscale) {
                    (Some(a), Some(b)) => {
                        let (sa, sb) = (pool(a, dev), pool(b, dev));
                        qd.paged_attention_scaled((&kc, &sa), (&vc, &sb), &tb, &ln, &st, None)
                    }
                    _ => qd.paged_attention(&kc, &vc, &tb, &ln, &st, None),
                };
                kiln::tensor::set_batch_invariant(true);
                let direct = direct.unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
                let err = direct.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                let bound = if qdt == DType::BF16 { 2f32.powi(-6) } else { 1e-5 };
                assert!(err <= bound, "{qdt} over {kv}: the direct way's rows are {err} from the reference");
            } else {
                // PJRT computes the same float32 attention in its own order.
                let bound = if qdt == DType::BF16 { 2f32.powi(-6) } else { 1e-5 };
                assert!(err <= bound, "{dev:?}: {qdt} over {kv}: max error {err}");
            }
        }
    }
}

#[test]
fn caches_that_do_not_fit_are_refused() {
    let (q, k) = (Tensor::zeros(&[2, 2, 4], DType::F32).unwrap(), Tensor::zeros(&[3, 2, 1, 4], DType::F32).unwrap());
    let (tb, ln, st) =
        (Tensor::new([[0i64, 1]]).unwrap(), Tensor::new([2i64]).unwrap(), Tensor::new([0i64, 2]).unwrap());
    let f8 = k.to_dtype(DType::F8E4M3FN).unwrap();
    let sc = Tensor::ones(&[3, 2, 1], DType::F32).unwrap();
    common::assert_err(q.paged_attention(&f8, &f8, &tb, &ln, &st, None), &["float8 caches with scales"]);
    common::assert_err(
        q.paged_attention_scaled((&k, &sc), (&k, &sc), &tb, &ln, &st, None),
        &["float8 caches with scales", "float32"],
    );
    let bad = Tensor::ones(&[3, 2], DType::F32).unwrap();
    common::assert_err(
        q.paged_attention_scaled((&f8, &bad), (&f8, &sc), &tb, &ln, &st, None),
        &["k_scales", "[3, 2, 1]"],
    );
    let half = k.to_dtype(DType::BF16).unwrap();
    common::assert_err(q.paged_attention(&k, &half, &tb, &ln, &st, None), &["caches float32 and bfloat16"]);
    let q64 = q.to_dtype(DType::F64).unwrap();
    common::assert_err(q64.paged_attention(&half, &half, &tb, &ln, &st, None), &["queries float64"]);
}
