//! Matrix multiplication.
use super::*;

fn mm(a: &Tensor, b: &Tensor) -> Tensor {
    run(Op::MatMul, &[a, b])
}

/// `[..., m, k] @ [..., k, n]` in f64 from contiguous row-major data.
fn reference(a: &[f32], b: &[f32], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; batch * m * n];
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                c[(bi * m + i) * n + j] =
                    (0..k).map(|p| a[(bi * m + i) * k + p] as f64 * b[(bi * k + p) * n + j] as f64).sum();
            }
        }
    }
    c
}

fn close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((*g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{g} vs {w}");
    }
}

#[test]
fn small_by_hand_and_transposed() {
    let _off = super::batch_invariance(false);
    let a = f32s(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let b = f32s(&[7., 8., 9., 10., 11., 12.], &[3, 2]);
    assert_eq!(vals::<f32>(&mm(&a, &b)), [58., 64., 139., 154.]);
    // a.t() @ a.t().t(): strided operands are read in place.
    let at = a.t().unwrap();
    assert_eq!(vals::<f32>(&mm(&at, &a)), [17., 22., 27., 22., 29., 36., 27., 36., 45.]);
    // A column slice with step 2: B[:, ::2].
    let wide = f32s(&(0..12).map(|v| v as f32).collect::<Vec<_>>(), &[3, 4]);
    let cols = wide.slice(1, None, None, 2).unwrap();
    assert_eq!(vals::<f32>(&mm(&a, &cols)), [32., 44., 68., 98.]);
}

#[test]
fn batched_broadcast_and_sizes() {
    let _off = super::batch_invariance(false);
    for &(batch, m, k, n) in &[(3, 5, 7, 4), (1, 1, 300, 1), (2, 130, 70, 90), (1, 256, 200, 300), (64, 8, 16, 8)] {
        let av = noise(batch * m * k, 11);
        let bv = noise(batch * k * n, 12);
        let a = f32s(&av, &[batch, m, k]);
        let b = f32s(&bv, &[batch, k, n]);
        close(&vals::<f32>(&mm(&a, &b)), &reference(&av, &bv, batch, m, k, n), 1e-5);
        // f64 too.
        let a64 = t(av.iter().map(|&v| v as f64).collect(), &[batch, m, k]);
        let b64 = t(bv.iter().map(|&v| v as f64).collect(), &[batch, k, n]);
        let c64 = vals::<f64>(&mm(&a64, &b64));
        let want = reference(&av, &bv, batch, m, k, n);
        assert!(c64.iter().zip(&want).all(|(g, w)| (g - w).abs() < 1e-10));
    }
    // The same [k, n] matrix broadcast over a batch of 4 (stride 0).
    let av = noise(4 * 3 * 5, 13);
    let bv = noise(5 * 2, 14);
    let b = f32s(&bv, &[1, 5, 2]).expand(&[4, 5, 2]).unwrap();
    let rep: Vec<f32> = (0..4).flat_map(|_| bv.clone()).collect();
    close(&vals::<f32>(&mm(&f32s(&av, &[4, 3, 5]), &b)), &reference(&av, &rep, 4, 3, 5, 2), 1e-6);
    // k = 0 gives zeros, m = 0 an empty result.
    assert_eq!(vals::<f32>(&mm(&f32s(&[], &[2, 0]), &f32s(&[], &[0, 3]))), [0.0; 6]);
    assert_eq!(mm(&f32s(&[], &[0, 2]), &f32s(&[1., 2.], &[2, 1])).shape(), &[0, 1]);
}

#[test]
fn bf16_f16_int_and_bool() {
    let _off = super::batch_invariance(false);
    let av = noise(4 * 64, 21);
    let bv = noise(64 * 3, 22);
    let abf = bf(&av);
    let bbf = bf(&bv);
    let aw: Vec<f32> = abf.iter().map(|v| v.to_f32()).collect();
    let bw: Vec<f32> = bbf.iter().map(|v| v.to_f32()).collect();
    let want = reference(&aw, &bw, 1, 4, 64, 3);
    let got = vals::<bf16>(&mm(&t(abf, &[4, 64]), &t(bbf, &[64, 3])));
    for (g, w) in got.iter().zip(&want) {
        // One rounding of an f32-accumulated value: within one bf16 ulp.
        assert!((g.to_f64() - w).abs() <= w.abs() / 128.0 + 1e-6, "{g} vs {w}");
    }
    let h = vals::<f16>(&mm(&t(hf(&[1., 2., 3., 4.]), &[2, 2]), &t(hf(&[0.5, 0., 0., 2.]), &[2, 2])));
    assert_eq!(h, hf(&[0.5, 4., 1.5, 8.]));
    let i = vals::<i64>(&mm(&t(vec![1i64, 2, 3, 4], &[2, 2]), &t(vec![5i64, 6, 7, 8], &[2, 2])));
    assert_eq!(i, [19, 22, 43, 50]);
    let w = vals::<i8>(&mm(&t(vec![100i8, 100], &[1, 2]), &t(vec![1i8, 1], &[2, 1])));
    assert_eq!(w, [-56]);
    let b =
        vals::<bool>(&mm(&t(vec![true, false, false, false], &[2, 2]), &t(vec![false, true, true, false], &[2, 2])));
    assert_eq!(b, [false, true, false, false]);
}

/// `a` (`m x k`) and `b` (`k x n`) as tensors whose storage is the transpose,
/// so the matmul reads them with swapped strides.
fn transposed(v: &[f32], rows: usize, cols: usize) -> Tensor {
    let mut tv = vec![0.0; v.len()];
    for i in 0..rows {
        for j in 0..cols {
            tv[j * rows + i] = v[i * cols + j];
        }
    }
    f32s(&tv, &[cols, rows]).t().unwrap()
}

#[test]
fn large_products_split_across_threads() {
    let _off = super::batch_invariance(false);
    // Products large enough to be split by rows (m > n) or by columns (square
    // ones included) into uneven parts, or columns into shrinking chunks (Note
    // [Threaded matmul]), with row-major, transposed and column-strided operands.
    let shapes = [
        (29, 777, 1061),
        (100, 50, 33),
        (15, 385, 2050),
        (97, 384, 64),
        (333, 200, 65),
        (130, 70, 130),
        (40, 30, 1500),
    ];
    for &(m, k, n) in &shapes {
        let av = noise(m * k, 21);
        let bv = noise(k * n, 22);
        let want = reference(&av, &bv, 1, m, k, n);
        let a = f32s(&av, &[m, k]);
        let b = f32s(&bv, &[k, n]);
        close(&vals::<f32>(&mm(&a, &b)), &want, 2e-5);
        close(&vals::<f32>(&mm(&transposed(&av, m, k), &transposed(&bv, k, n))), &want, 2e-5);
        // B as every other column of a [k, 2n] matrix.
        let mut wide = vec![7.0f32; k * 2 * n];
        for p in 0..k {
            for j in 0..n {
                wide[p * 2 * n + 2 * j] = bv[p * n + j];
            }
        }
        let bs = f32s(&wide, &[k, 2 * n]).slice(1, None, None, 2).unwrap();
        close(&vals::<f32>(&mm(&a, &bs)), &want, 2e-5);
    }
}

#[test]
fn column_chunks_shrink_and_cover_every_column_once() {
    let _off = super::batch_invariance(false);
    use crate::kernels::matmul::{chunk_min, next_chunk};
    // The narrowest chunk: 128 columns, or 2^28 multiply-adds, or equal parts.
    assert_eq!(chunk_min(4096, 4096, 4096, 2), 128);
    assert_eq!(chunk_min(2048, 2048, 2048, 2), 128);
    assert_eq!(chunk_min(1024, 1024, 1024, 2), 256);
    assert_eq!(chunk_min(512, 512, 4096, 2), 1024);
    assert_eq!(chunk_min(64, 8, 100, 2), 32);
    let chunks = |len: usize, threads: usize, min: usize| {
        let mut widths = Vec::new();
        let mut s = 0;
        while s < len {
            let e = next_chunk(s, len, threads, min);
            assert!(e > s && e <= len, "chunk {s}..{e} of {len}");
            widths.push(e - s);
            s = e;
        }
        widths
    };
    // A quarter of what is left on two threads, down to the narrowest chunk; a
    // tail at least half as wide stays a chunk of its own.
    assert_eq!(chunks(4096, 2, 256), [1024, 768, 576, 448, 320, 256, 256, 256, 192]);
    assert_eq!(chunks(2048, 2, 128), [512, 384, 320, 256, 192, 128, 128, 128]);
    // Narrower products: equal parts.
    assert_eq!(chunks(1024, 2, 256), [256; 4]);
    // Below 64 columns per chunk, chunks are multiples of 16; a tail under
    // min / 2 joins the chunk before it.
    assert_eq!(chunks(100, 2, 32), [32, 32, 36]);
    assert_eq!(chunks(64, 2, 32), [32, 32]);
    for (len, threads, min) in [(1500, 2, 256), (4097, 3, 256), (9000, 8, 256), (777, 4, 48), (65, 2, 32)] {
        let w = chunks(len, threads, min);
        assert_eq!(w.iter().sum::<usize>(), len);
        let (last, rest) = w.split_last().unwrap();
        assert!(*last >= min / 2, "{len} {threads}: {w:?}");
        let align = if min >= 64 { 64 } else { 16 };
        for (i, &c) in rest.iter().enumerate() {
            assert!(c >= min && c % align == 0, "{len} {threads}: {w:?}");
            assert!(i == 0 || c <= rest[i - 1], "chunks shrink: {w:?}");
        }
    }
}

/// Note [Dot-product products]: `x @ w.T` with `w` row-major and depth of at
/// least 256 runs as dot products of rows when it has few rows (and always with
/// batch invariance on): against the f64 reference for depths that are not a
/// multiple of the vector width, widths that are not a multiple of the tile,
/// row counts on both sides of the switch and of the row tile, and a left
/// operand that is not row-major.
#[test]
fn linear_products_as_dot_products() {
    let _off = super::batch_invariance(false);
    for &(k, n) in &[(256usize, 1usize), (300, 37), (1000, 4), (384, 130), (257, 9)] {
        let wv = noise(n * k, n as u64);
        let w = f32s(&wv, &[n, k]);
        // `w.T` laid out row-major `[k, n]`, for the reference.
        let mut wt = vec![0.0; k * n];
        for j in 0..n {
            for p in 0..k {
                wt[p * n + j] = wv[j * k + p];
            }
        }
        for m in [1usize, 2, 5, 6, 7, 13, 31, 32, 33, 100] {
            let xv = noise(m * k, (m * k) as u64);
            let want = reference(&xv, &wt, 1, m, k, n);
            close(&vals::<f32>(&mm(&f32s(&xv, &[m, k]), &w.t().unwrap())), &want, 2e-5);
            close(&vals::<f32>(&mm(&transposed(&xv, m, k), &w.t().unwrap())), &want, 2e-5);
        }
    }
}

/// The dot-product way keeps `Gemm`'s contract: `dst = scale * a @ b` or
/// `dst += scale * a @ b`, only the `m x n` elements at row stride `ld`.
#[test]
fn dot_products_scale_accumulate_and_keep_the_rest() {
    let _off = super::batch_invariance(false);
    use crate::kernels::matmul::{gemm_small, MatRef};
    let (m, n, k, ld) = (7usize, 5usize, 300usize, 8usize);
    let (av, wv) = (noise(m * k, 31), noise(n * k, 32));
    let dot = |i: usize, j: usize| (0..k).map(|p| av[i * k + p] as f64 * wv[j * k + p] as f64).sum::<f64>();
    for accumulate in [false, true] {
        let before = noise(m * ld, 33);
        let mut dst = before.clone();
        let a = MatRef { data: &av, off: 0, rs: k, cs: 1 };
        let w = MatRef { data: &wv, off: 0, rs: k, cs: 1 };
        gemm_small(&mut dst, ld, m, n, k, a, w.t(), 0.5f32, accumulate);
        for i in 0..m {
            for j in 0..ld {
                let (got, old) = (dst[i * ld + j] as f64, before[i * ld + j] as f64);
                if j >= n {
                    assert_eq!(got, old, "element ({i}, {j}) outside the product was written");
                    continue;
                }
                let want = 0.5 * dot(i, j) + if accumulate { old } else { 0.0 };
                assert!((got - want).abs() <= 2e-5 * (1.0 + want.abs()), "({i}, {j}): {got} vs {want}");
            }
        }
    }
}

/// Note [Row-invariant products]: with batch invariance on, a row of `x @ w.T` has the same bits whatever
/// the number of rows computed with it and its position among them, for the
/// shapes that make gemm change algorithms (one row, m * n <= 256, depth past
/// 512 and not a multiple of it, products split across threads).
#[test]
fn rows_do_not_depend_on_the_rest_of_the_batch() {
    let _on = super::batch_invariance(true);
    for &(k, n) in &[
        (1usize, 50usize),
        (2, 1),
        (384, 1),
        (3, 8),
        (64, 64),
        (100, 128),
        (384, 1152),
        (513, 40),
        (1100, 300),
        (2048, 96),
    ] {
        let big = 300;
        let x = f32s(&noise(big * k, k as u64), &[big, k]);
        let w = f32s(&noise(n * k, n as u64 + 7), &[n, k]);
        let wt = w.t().unwrap();
        let all = vals::<f32>(&mm(&x, &wt));
        for m in [1usize, 2, 3, 5, 16, 17, 33, 64, 65, 129] {
            for off in [0usize, 1, 150] {
                let rows = x.narrow(0, off as isize, m).unwrap();
                let part = vals::<f32>(&mm(&rows, &wt));
                let same = part.iter().zip(&all[off * n..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "k {k}, n {n}: rows {off}..{} alone differ from the same rows among {big}", off + m);
                // The same rows stored column by column.
                let strided = rows.t().unwrap().contiguous().unwrap().t().unwrap();
                let part = vals::<f32>(&mm(&strided, &wt));
                let same = part.iter().zip(&all[off * n..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "k {k}, n {n}: rows {off}..{} stored by columns differ", off + m);
            }
        }
    }
}

/// Attention rows do not depend on how many queries run with them either: a
/// causal prompt in one piece, one query at a time after a cache, or in uneven
/// chunks, gives the same bits for every query.
#[test]
fn attention_rows_do_not_depend_on_the_chunking() {
    let _on = super::batch_invariance(true);
    let (h, hk, t, d) = (4usize, 2usize, 150usize, 32usize);
    let q = f32s(&noise(h * t * d, 1), &[1, h, t, d]);
    let k = f32s(&noise(hk * t * d, 2), &[1, hk, t, d]);
    let v = f32s(&noise(hk * t * d, 3), &[1, hk, t, d]);
    let attn = |q: &Tensor, s: usize| {
        let (k, v) = (k.narrow(2, 0, s).unwrap(), v.narrow(2, 0, s).unwrap());
        run2(Op::Attention { scale: 0.125, causal: true }, &[q, &k, &v]).0
    };
    let whole = vals::<f32>(&attn(&q, t));
    for chunk in [1usize, 7, 64, 65] {
        let mut start = 0;
        while start < t {
            let c = chunk.min(t - start);
            let part = vals::<f32>(&attn(&q.narrow(2, start as isize, c).unwrap(), start + c));
            for hi in 0..h {
                for i in 0..c {
                    let (got, want) = (&part[(hi * c + i) * d..][..d], &whole[(hi * t + start + i) * d..][..d]);
                    assert!(
                        got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "chunks of {chunk}: head {hi}, query {} differs",
                        start + i
                    );
                }
            }
            start += c;
        }
    }
}

/// The largest error one bf16 product element may carry against the exact
/// sum `want` of its `k` terms whose magnitudes add to `abs`: f32 sums
/// (at most k roundings of 2^-24 each, relative to `abs`), then one rounding
/// to bf16 (half an ulp of 8 significant bits: 2^-8 relative).
fn bf16_bound(want: f64, abs: f64, k: usize) -> f64 {
    let sum = k as f64 * 2f64.powi(-24) * abs;
    2f64.powi(-8) * (want.abs() + sum) + sum
}

/// Note [bf16 dot products]: every way this CPU has, against the exact sums,
/// for depths that are not a multiple of any way's step, widths that are not a
/// multiple of the tile, row counts around the row tile, rows at a stride.
#[test]
fn bf16_products_as_dot_products_every_way() {
    use crate::kernels::rowdot_bf16::{ways, RowDot};
    assert!(!ways().is_empty(), "this test needs an x86-64 CPU with AVX2 + FMA");
    for &(k, n) in &[(256usize, 1usize), (300, 37), (1031, 5), (257, 9), (33, 7)] {
        let w = bf(&noise(n * k, n as u64 + 40));
        for m in [1usize, 2, 6, 7, 13, 33] {
            // Rows at a stride of k + 3: the gap must not be read into the sums.
            let x_rs = k + 3;
            let x = bf(&noise(m * x_rs, (m * k) as u64));
            for &way in ways() {
                let mut out = vec![bf16::NAN; m * n];
                RowDot { x: &x, x_rs, w: &w, w_rs: k, m, n, k }.run_way(way, &mut out);
                for i in 0..m {
                    for j in 0..n {
                        let terms = (0..k).map(|p| x[i * x_rs + p].to_f64() * w[j * k + p].to_f64());
                        let (want, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                        let got = out[i * n + j].to_f64();
                        let bound = bf16_bound(want, abs, k);
                        assert!(
                            (got - want).abs() <= bound,
                            "{way:?}, k {k}, n {n}, m {m}, ({i}, {j}): {got} vs {want} (bound {bound})"
                        );
                    }
                }
            }
        }
    }
}

/// bf16 `x @ W.T` through `matmul`: one row to a prompt's worth, a left operand
/// stored by columns, a batch of products, against the exact sums.
#[test]
fn bf16_linear_products() {
    let _off = super::batch_invariance(false);
    let (k, n) = (300usize, 37usize);
    let (wv, xv) = (bf(&noise(2 * n * k, 50)), bf(&noise(2 * 100 * k, 51)));
    let w = t(wv.clone(), &[2, n, k]);
    for m in [1usize, 7, 32, 33, 40, 100] {
        let x = t(xv[..2 * m * k].to_vec(), &[2, m, k]);
        let by_columns = x.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
        for x in [&x, &by_columns] {
            let got = vals::<bf16>(&mm(x, &w.transpose(1, 2).unwrap()));
            for (e, g) in got.iter().enumerate() {
                let (b, i, j) = (e / (m * n), e / n % m, e % n);
                let terms = (0..k).map(|p| xv[(b * m + i) * k + p].to_f64() * wv[(b * n + j) * k + p].to_f64());
                let (want, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                assert!((g.to_f64() - want).abs() <= bf16_bound(want, abs, k), "m {m}, {e}: {g} vs {want}");
            }
        }
    }
}

/// With batch invariance on, a bf16 row of `x @ w.T` has the same bits alone
/// as among any number of rows (Note [bf16 dot products]). The data cancel
/// exactly (the second half of each row of `w` negates the first, `x` repeats
/// its first half at 256 times the scale), so each element is the rounding
/// error of its f32 sums alone and shows any change in their order through
/// the rounding to bf16.
#[test]
fn bf16_rows_do_not_depend_on_the_rest_of_the_batch() {
    let _on = super::batch_invariance(true);
    let halves = |rows: usize, k: usize, seed: u64, sign: f32, scale: f32| -> Vec<bf16> {
        let v = noise(rows * k / 2, seed);
        let row = |r: usize| v[r * k / 2..][..k / 2].iter().map(|x| x * scale).collect::<Vec<f32>>();
        (0..rows)
            .flat_map(|r| [row(r), row(r).iter().map(|x| x * sign).collect()].concat())
            .map(bf16::from_f32)
            .collect()
    };
    for &(k, n) in &[(256usize, 3usize), (1100, 40)] {
        let big = 200;
        let x = t(halves(big, k, k as u64, 1.0, 256.0), &[big, k]);
        let wt = t(halves(n, k, n as u64 + 7, -1.0, 1.0), &[n, k]).t().unwrap();
        let all = vals::<bf16>(&mm(&x, &wt));
        assert!(all.iter().any(|v| v.to_f32() != 0.0), "k {k}: the sums' rounding errors should show");
        for m in [1usize, 5, 33, 64, 129] {
            for off in [0usize, 1, 70] {
                let part = vals::<bf16>(&mm(&x.narrow(0, off as isize, m).unwrap(), &wt));
                let same = part.iter().zip(&all[off * n..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "k {k}, n {n}: rows {off}..{} alone differ from the same rows among {big}", off + m);
            }
        }
    }
}

/// bf16 `x @ W` with `W` laid out `[k, n]` (the input gradient's layout): from
/// `MIN_ROWS_COPIED` rows on, its rows along the depth are copied first; both
/// sides of the switch against the exact sums.
#[test]
fn bf16_products_of_a_weight_copied_into_rows() {
    let _off = super::batch_invariance(false);
    let (k, n) = (300usize, 37usize);
    let wv = bf(&noise(k * n, 60));
    let w = t(wv.clone(), &[k, n]);
    for m in [200usize, 300] {
        let xv = bf(&noise(m * k, 61));
        let got = vals::<bf16>(&mm(&t(xv.clone(), &[m, k]), &w));
        for (e, g) in got.iter().enumerate() {
            let (i, j) = (e / n, e % n);
            let terms = (0..k).map(|p| xv[i * k + p].to_f64() * wv[p * n + j].to_f64());
            let (want, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
            assert!((g.to_f64() - want).abs() <= bf16_bound(want, abs, k), "m {m}, ({i}, {j}): {g} vs {want}");
        }
    }
}

/// Note [bf16 products on tiles]: where the CPU has AMX, the tile kernel
/// against the exact sums for every layout of both operands (rows along the
/// depth, columns along it, neither), shapes off every tile and block edge
/// (rows around 16, 32 and MC = 128, depths around 32 and the 256 of a depth
/// block, columns around 16, 32 and NC = 256), and rows that keep their bits
/// whatever else is in the product. Where it has no AMX, `available()` says so.
#[test]
fn bf16_products_on_tiles() {
    use crate::kernels::gemm_bf16::{available, gemm, Strided};
    #[cfg(target_arch = "x86_64")]
    #[allow(unused_unsafe)] // `__cpuid_count` is unsafe in older Rust versions
    // SAFETY: CPUID leaf 7 exists on x86-64 (zeros beyond the maximum leaf).
    let amx = std::env::var("KILN_CPU_AMX").map_or(true, |v| v != "0")
        && (unsafe { std::arch::x86_64::__cpuid_count(7, 0) }.edx >> 22) & 0b101 == 0b101
        && cfg!(target_os = "linux");
    #[cfg(not(target_arch = "x86_64"))]
    let amx = false;
    assert_eq!(available(), amx, "AMX detection disagrees with CPUID");
    if !amx {
        return;
    }
    // (rows, depth, columns) of `a` and `b`; each operand in three layouts.
    let layouts = |rows: usize, cols: usize, v: &[bf16], how: usize| -> (Vec<bf16>, usize, usize) {
        match how {
            0 => (v.to_vec(), cols, 1),
            1 => {
                let mut t = vec![bf16::ZERO; rows * cols];
                for i in 0..rows {
                    for j in 0..cols {
                        t[j * rows + i] = v[i * cols + j];
                    }
                }
                (t, 1, rows)
            }
            _ => {
                // Every element two apart, rows with a gap: no stride is 1.
                let rs = 2 * cols + 3;
                let mut t = vec![bf16::NAN; rows * rs];
                for i in 0..rows {
                    for j in 0..cols {
                        t[i * rs + 2 * j] = v[i * cols + j];
                    }
                }
                (t, rs, 2)
            }
        }
    };
    for &(m, k, n) in
        &[(1usize, 1usize, 1usize), (7, 33, 17), (33, 300, 40), (130, 31, 270), (16, 257, 32), (129, 64, 1)]
    {
        let (av, bv) = (bf(&noise(m * k, (m + k) as u64)), bf(&noise(k * n, (k + n) as u64)));
        let mut first: Option<Vec<bf16>> = None;
        for (ha, hb) in (0..3).flat_map(|a| (0..3).map(move |b| (a, b))) {
            let (a, a_rs, a_cs) = layouts(m, k, &av, ha);
            let (b, b_rs, b_cs) = layouts(k, n, &bv, hb);
            let mut out = nans(m * n);
            let sa = Strided { v: &a, off: 0, rs: a_rs, cs: a_cs };
            gemm(sa, Strided { v: &b, off: 0, rs: b_rs, cs: b_cs }, m, k, n, &mut out);
            let out = read(&out);
            for (e, g) in out.iter().enumerate() {
                let (i, j) = (e / n, e % n);
                let terms = (0..k).map(|p| av[i * k + p].to_f64() * bv[p * n + j].to_f64());
                let (want, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                let bound = bf16_bound(want, abs, k);
                assert!((g.to_f64() - want).abs() <= bound, "{m}x{k}x{n} layouts {ha},{hb} ({i}, {j}): {g} vs {want}");
            }
            // The layouts change the packing only: the same bits every time.
            let bits: Vec<u16> = out.iter().map(|v| v.to_bits()).collect();
            let first = first.get_or_insert_with(|| out.clone());
            assert!(first.iter().map(|v| v.to_bits()).eq(bits), "{m}x{k}x{n}: layouts {ha},{hb} change the bits");
            // Rows alone: the same bits as among the others (row invariance).
            if ha == 0 && hb == 0 && m > 1 {
                for (off, rows) in [(0usize, 1usize), (m / 2, m - m / 2)] {
                    let mut part = nans(rows * n);
                    let sa = Strided { v: &a, off: off * k, rs: k, cs: 1 };
                    gemm(sa, Strided { v: &b, off: 0, rs: b_rs, cs: b_cs }, rows, k, n, &mut part);
                    let part = read(&part);
                    let same = part.iter().zip(&out[off * n..]).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{m}x{k}x{n}: rows {off}..{} alone differ", off + rows);
                }
            }
        }
    }
}

/// Packed tiles and rows of sums start on cache lines (Note [Tiles on cache
/// lines]), at every size: large buffers come from the allocator 16 bytes past
/// a line unless their type asks for more.
#[test]
fn packed_tiles_and_sums_sit_on_cache_lines() {
    use crate::kernels::gemm_bf16::{Packed, SumRow};
    for (extent, tiles) in [(1usize, 1usize), (17, 3), (2048, 12), (384, 64)] {
        for parallel in [false, true] {
            let mut v = Packed::new();
            v.panels(extent, tiles, false, parallel, |_, _, _| {});
            assert_eq!(v.tiles.as_ptr() as usize % 64, 0, "{extent} x {tiles} tiles");
        }
    }
    for rows in [1usize, 1000, 100_000] {
        let v = vec![SumRow([0.0; 16]); rows];
        assert_eq!(v.as_ptr() as usize % 64, 0, "{rows} rows of sums");
    }
}

/// An output buffer whose every element is NaN until a product writes it.
fn nans(n: usize) -> Vec<std::mem::MaybeUninit<bf16>> {
    vec![std::mem::MaybeUninit::new(bf16::NAN); n]
}

/// The elements of a buffer from `nans` (all initialised there).
fn read(v: &[std::mem::MaybeUninit<bf16>]) -> Vec<bf16> {
    // SAFETY: `nans` initialised every element; writes since keep them initialised.
    v.iter().map(|x| unsafe { x.assume_init() }).collect()
}
