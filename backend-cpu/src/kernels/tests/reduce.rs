//! Reductions, arg-reductions and cumsum.
use super::*;
use kiln_tensor::{ArgReduceOp, DType, ReduceOp};

fn red(op: ReduceOp, x: &Tensor, dims: &[usize], keepdim: bool) -> Tensor {
    run(Op::Reduce { op, dims: dims.into(), keepdim }, &[x])
}

fn arg(op: ArgReduceOp, x: &Tensor, dim: Option<usize>, keepdim: bool) -> Tensor {
    run(Op::ArgReduce { op, dim, keepdim }, &[x])
}

#[test]
fn sums_over_every_dim_set_and_layout() {
    let x = t((0..24).map(|v| v as f32).collect(), &[2, 3, 4]);
    assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &x, &[0, 1, 2], false)), [276.0]);
    assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &x, &[2], false)), [6., 22., 38., 54., 70., 86.]);
    assert_eq!(
        vals::<f32>(&red(ReduceOp::Sum, &x, &[0], false)),
        (12..24).map(|v| (2 * v - 12) as f32).collect::<Vec<_>>()
    );
    assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &x, &[1], false)), [12., 15., 18., 21., 48., 51., 54., 57.]);
    let k = red(ReduceOp::Sum, &x, &[0, 2], true);
    assert_eq!(k.shape(), &[1, 3, 1]);
    assert_eq!(vals::<f32>(&k), [60., 92., 124.]);
    // The same sums through a permuted (non-contiguous) view.
    let p = x.permute(&[2, 0, 1]).unwrap();
    assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &p, &[0], false)), [6., 22., 38., 54., 70., 86.]);
    assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &p, &[1, 2], false)), [60., 66., 72., 78.]);
    // A broadcast (stride-0) input.
    let e = f32s(&[1., 2.], &[2, 1]).expand(&[2, 5]).unwrap();
    assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &e, &[1], false)), [5., 10.]);
    // Empty reductions.
    let z = f32s(&[], &[3, 0]);
    assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &z, &[1], false)), [0., 0., 0.]);
    assert_eq!(vals::<f32>(&red(ReduceOp::Prod, &z, &[1], false)), [1., 1., 1.]);
    assert!(vals::<f32>(&red(ReduceOp::Mean, &z, &[1], false))[0].is_nan());
    assert_eq!(vals::<bool>(&red(ReduceOp::All, &z, &[1], false)), [true, true, true]);
}

#[test]
fn large_sums_are_accurate_and_threaded() {
    let n = 1 << 20;
    let v = noise(n, 5);
    let want: f64 = v.iter().map(|&x| x as f64).sum();
    let x = f32s(&v, &[n]);
    let got = vals::<f32>(&red(ReduceOp::Sum, &x, &[0], false))[0] as f64;
    assert!((got - want).abs() < 1e-2, "{got} vs {want}");
    // Rows (inner strategy), columns (row-accumulating strategy), and few long rows (split).
    let m = x.reshape(&[1024, 1024]).unwrap();
    let rows = vals::<f32>(&red(ReduceOp::Sum, &m, &[1], false));
    let cols = vals::<f32>(&red(ReduceOp::Sum, &m, &[0], false));
    for i in [0, 17, 1023] {
        let r: f64 = v[i * 1024..(i + 1) * 1024].iter().map(|&x| x as f64).sum();
        let c: f64 = (0..1024).map(|j| v[j * 1024 + i] as f64).sum();
        assert!((rows[i] as f64 - r).abs() < 1e-4 && (cols[i] as f64 - c).abs() < 1e-4);
    }
    let two = x.reshape(&[2, n as isize / 2]).unwrap();
    let halves = vals::<f32>(&red(ReduceOp::Sum, &two, &[1], false));
    let h0: f64 = v[..n / 2].iter().map(|&x| x as f64).sum();
    assert!((halves[0] as f64 - h0).abs() < 1e-2);
    let mx = vals::<f32>(&red(ReduceOp::Max, &x, &[0], false))[0];
    assert_eq!(mx, v.iter().cloned().fold(f32::MIN, f32::max));
}

#[test]
fn integer_and_bool_sums_promote_to_i64() {
    let u = t(vec![200u8, 100, 255], &[3]);
    let s = red(ReduceOp::Sum, &u, &[0], false);
    assert_eq!(s.dtype(), DType::I64);
    assert_eq!(vals::<i64>(&s), [555]);
    let b = t(vec![true, false, true, true], &[2, 2]);
    assert_eq!(vals::<i64>(&red(ReduceOp::Sum, &b, &[0, 1], false)), [3]);
    assert_eq!(vals::<i64>(&red(ReduceOp::Prod, &t(vec![3i32, -4, 5], &[3]), &[0], false)), [-60]);
    assert_eq!(vals::<i8>(&red(ReduceOp::Max, &t(vec![3i8, -4, 5], &[3]), &[0], false)), [5]);
    assert_eq!(vals::<i8>(&red(ReduceOp::Min, &t(vec![3i8, -4, 5], &[3]), &[0], false)), [-4]);
    assert_eq!(vals::<bool>(&red(ReduceOp::Any, &t(vec![0i32, 0, 2, 0], &[2, 2]), &[1], false)), [false, true]);
    assert_eq!(vals::<bool>(&red(ReduceOp::All, &f32s(&[1., f32::NAN, 0., 1.], &[2, 2]), &[1], false)), [true, false]);
    assert_eq!(vals::<bool>(&red(ReduceOp::Max, &b, &[1], false)), [true, true]);
}

#[test]
fn bf16_sum_and_mean_accumulate_in_f32() {
    // bf16(0.1) is 0.10009765625: the sum of 1000 of them is 100.09765625 in f32, 100 once rounded
    // (a bf16 running sum would stall at 32), and the mean rounds back to bf16(0.1).
    let x = t(vec![bf16::from_f32(0.1); 1000], &[1000]);
    assert_eq!(vals::<bf16>(&red(ReduceOp::Sum, &x, &[0], false)), [bf16::from_f32(100.0)]);
    assert_eq!(vals::<bf16>(&red(ReduceOp::Mean, &x, &[0], false)), [bf16::from_f32(0.1)]);
    let h = t(vec![f16::from_f32(0.1); 1000], &[1000]);
    let exact = 1000.0 * f16::from_f32(0.1).to_f32(); // every partial sum is exact in f32
    assert_eq!(vals::<f16>(&red(ReduceOp::Sum, &h, &[0], false)), [f16::from_f32(exact)]);
    let c = vals::<bf16>(&run(Op::Cumsum { dim: 0 }, &[&x]));
    assert_eq!(c[999], bf16::from_f32(100.0));
    let m = vals::<f32>(&red(ReduceOp::Mean, &f32s(&[1., 2., 3., 4.], &[2, 2]), &[0], false));
    assert_eq!(m, [2., 3.]);
}

#[test]
fn folds_see_every_element_at_every_length() {
    // Lengths around the fold's passes (4 x 64 lanes, then 64, then a tail) and
    // its blocks of 4096; small integers, so every summation order is exact.
    for n in [1, 63, 64, 65, 255, 256, 257, 319, 4095, 4096, 4097, 9001] {
        let v: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let want: f32 = v.iter().sum();
        assert_eq!(vals::<f32>(&red(ReduceOp::Sum, &f32s(&v, &[n]), &[0], false)), [want], "sum of {n}");
        for pos in [0, n / 2, n - 1] {
            let mut w = v.clone();
            w[pos] = 100.0;
            let x = f32s(&w, &[n]);
            assert_eq!(vals::<f32>(&red(ReduceOp::Max, &x, &[0], false)), [100.0], "max of {n} at {pos}");
            w[pos] = -100.0;
            let x = f32s(&w, &[n]);
            assert_eq!(vals::<f32>(&red(ReduceOp::Min, &x, &[0], false)), [-100.0], "min of {n} at {pos}");
            w[pos] = f32::NAN;
            let x = f32s(&w, &[n]);
            assert!(vals::<f32>(&red(ReduceOp::Max, &x, &[0], false))[0].is_nan(), "NaN of {n} at {pos}");
        }
    }
}

#[test]
fn max_min_propagate_nan() {
    let x = f32s(&[1.0, f32::NAN, 3.0, f32::NAN, 2.0, 1.0, 2.0, 0.0], &[2, 4]);
    let m = vals::<f32>(&red(ReduceOp::Max, &x, &[1], false));
    assert!(m[0].is_nan() && m[1] == 2.0);
    let m0 = vals::<f32>(&red(ReduceOp::Min, &x, &[0], false));
    assert!(m0[0] == 1.0 && m0[1].is_nan() && m0[2] == 2.0 && m0[3].is_nan());
    let s = vals::<f32>(&red(ReduceOp::Sum, &x, &[0, 1], false));
    assert!(s[0].is_nan());
    let all_neg_inf = f32s(&[f32::NEG_INFINITY; 3], &[3]);
    assert_eq!(vals::<f32>(&red(ReduceOp::Max, &all_neg_inf, &[0], false)), [f32::NEG_INFINITY]);
}

#[test]
fn argmax_argmin_take_first_tie_and_first_nan() {
    let x = f32s(&[1., 3., 3., 0., 0., 0., 2., 2., 5., -1., 5., -1.], &[3, 4]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMax, &x, Some(1), false)), [1, 2, 0]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMin, &x, Some(1), false)), [3, 0, 1]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMax, &x, Some(0), false)), [2, 0, 2, 1]);
    assert_eq!(arg(ArgReduceOp::ArgMax, &x, Some(1), true).shape(), &[3, 1]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMax, &x, None, false)), [8]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMin, &x, None, false)), [9]);
    // Flattened over a transposed view: row-major order of the view.
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMax, &x.t().unwrap(), None, false)), [2]);
    let n = f32s(&[1., f32::NAN, 3., f32::NAN, 2., 1., 2., 0.], &[2, 4]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMax, &n, Some(1), false)), [1, 0]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMin, &n, Some(1), false)), [1, 3]);
    let i = t(vec![3i64, 9, 9, 1], &[4]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMax, &i, Some(0), false)), [1]);
    let h = t(bf(&[1.0, 4.0, 4.0]), &[3]);
    assert_eq!(vals::<i64>(&arg(ArgReduceOp::ArgMax, &h, None, false)), [1]);
}

/// Long contiguous rows (a vocabulary's logits) take a blocked scan: the same
/// index as element by element, on ties across and within blocks, signed
/// zeros, and NaNs before, in and after the extreme's block.
#[test]
fn long_rows_take_the_first_extreme_and_the_first_nan() {
    // The index a scan in order finds: the first NaN, else the first extreme.
    let want = |v: &[f32], max: bool| -> i64 {
        if let Some(i) = v.iter().position(|x| x.is_nan()) {
            return i as i64;
        }
        let mut b = 0;
        for (i, &x) in v.iter().enumerate() {
            if (max && x > v[b]) || (!max && x < v[b]) {
                b = i;
            }
        }
        b as i64
    };
    for (case, n) in [1usize, 7, 16, 33, 1023, 1024, 1025, 3000, 4099].into_iter().enumerate() {
        // Few distinct values (bf16-exact): ties everywhere; the extremes
        // planted twice, in two blocks when there are two; signed zeros.
        let mut v: Vec<f32> = noise(n, case as u64).iter().map(|x| (x * 20.0).round()).collect();
        for (i, x) in v.iter_mut().enumerate() {
            if i % 7 == 3 && *x == 0.0 {
                *x = -0.0;
            }
        }
        v[n / 3] = 40.0;
        v[n - 1 - n / 5] = 40.0;
        v[n / 2] = -40.0;
        v[n - 1] = -40.0;
        let mut rows = vec![v.clone()];
        for at in [0, n / 2, n - 1, (n / 3 + 1).min(n - 1)] {
            let mut w = v.clone();
            w[at] = f32::NAN;
            if at + 2 < n {
                w[at + 2] = f32::NAN;
            }
            rows.push(w);
        }
        for row in rows {
            for (op, max) in [(ArgReduceOp::ArgMax, true), (ArgReduceOp::ArgMin, false)] {
                let expect = want(&row, max);
                let x = f32s(&row, &[1, n]);
                assert_eq!(vals::<i64>(&arg(op, &x, Some(1), false)), [expect], "f32 n={n} {op:?}");
                assert_eq!(vals::<i64>(&arg(op, &x, None, false)), [expect], "f32 flat n={n} {op:?}");
                let h = t(bf(&row), &[1, n]);
                assert_eq!(vals::<i64>(&arg(op, &h, Some(1), false)), [expect], "bf16 n={n} {op:?}");
                let h = t(hf(&row), &[n]);
                assert_eq!(vals::<i64>(&arg(op, &h, None, false)), [expect], "f16 n={n} {op:?}");
            }
        }
    }
}

#[test]
fn cumsum_along_each_dim() {
    let x = t((0..24).map(|v| v as f32).collect(), &[2, 3, 4]);
    let c2 = vals::<f32>(&run(Op::Cumsum { dim: 2 }, &[&x]));
    assert_eq!(&c2[..8], &[0., 1., 3., 6., 4., 9., 15., 22.]);
    let c1 = vals::<f32>(&run(Op::Cumsum { dim: 1 }, &[&x]));
    assert_eq!(&c1[..12], &[0., 1., 2., 3., 4., 6., 8., 10., 12., 15., 18., 21.]);
    let c0 = vals::<f32>(&run(Op::Cumsum { dim: 0 }, &[&x]));
    assert_eq!(&c0[12..16], &[12., 14., 16., 18.]);
    // A transposed input.
    let m = f32s(&[1., 2., 3., 4.], &[2, 2]).t().unwrap();
    assert_eq!(vals::<f32>(&run(Op::Cumsum { dim: 1 }, &[&m])), [1., 4., 2., 6.]);
    let u = run(Op::Cumsum { dim: 0 }, &[&t(vec![200u8, 100, 255], &[3])]);
    assert_eq!(u.dtype(), DType::I64);
    assert_eq!(vals::<i64>(&u), [200, 300, 555]);
    assert_eq!(vals::<i64>(&run(Op::Cumsum { dim: 0 }, &[&t(vec![true, true, false], &[3])])), [1, 2, 2]);
    // f32 cumsum accumulates in f64 (PyTorch's CPU kernel): 1e8 + 5 rounds to 100000008.
    let big = f32s(&[1e8, 1., 1., 1., 1., 1.], &[6]);
    assert_eq!(vals::<f32>(&run(Op::Cumsum { dim: 0 }, &[&big]))[5], 100_000_008.0);
}
