//! Unary, binary, compare, where, cast, full, arange, copy and assign.
use super::*;
use kiln_tensor::{BinaryOp, CmpOp, DType, Error, Scalar, UnaryOp};

fn bin(op: BinaryOp, a: &Tensor, b: &Tensor) -> Tensor {
    run(Op::Binary(op), &[a, b])
}

fn un(op: UnaryOp, a: &Tensor) -> Tensor {
    run(Op::Unary(op), &[a])
}

#[test]
fn add_contiguous_broadcast_and_strided() {
    let a = f32s(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let row = f32s(&[10., 20., 30.], &[3]).expand(&[2, 3]).unwrap();
    assert_eq!(vals::<f32>(&bin(BinaryOp::Add, &a, &row)), [11., 22., 33., 14., 25., 36.]);
    let col = f32s(&[100., 200.], &[2, 1]).expand(&[2, 3]).unwrap();
    assert_eq!(vals::<f32>(&bin(BinaryOp::Sub, &a, &col)), [-99., -98., -97., -196., -195., -194.]);
    let s = f32s(&[2.], &[]).expand(&[2, 3]).unwrap();
    assert_eq!(vals::<f32>(&bin(BinaryOp::Mul, &s, &a)), [2., 4., 6., 8., 10., 12.]);
    // a.t() is [3, 2] with strides [1, 3].
    let at = a.t().unwrap();
    let b = f32s(&[1., 1., 1., 1., 1., 1.], &[3, 2]);
    assert_eq!(vals::<f32>(&bin(BinaryOp::Add, &at, &b)), [2., 5., 3., 6., 4., 7.]);
    // Empty shapes work.
    let e = f32s(&[], &[0, 4]);
    assert_eq!(bin(BinaryOp::Add, &e, &e).shape(), &[0, 4]);
}

#[test]
fn f32_arithmetic_is_exact_and_matches_scalar_math() {
    let n = 100_003; // above the threading threshold, odd length
    let x = noise(n, 1);
    let y: Vec<f32> = noise(n, 2).iter().map(|v| v + 1.5).collect();
    let (a, b) = (f32s(&x, &[n]), f32s(&y, &[n]));
    let want = |f: fn(f32, f32) -> f32| -> Vec<f32> { x.iter().zip(&y).map(|(&p, &q)| f(p, q)).collect() };
    assert!(same_f32(&vals::<f32>(&bin(BinaryOp::Add, &a, &b)), &want(|p, q| p + q)));
    assert!(same_f32(&vals::<f32>(&bin(BinaryOp::Mul, &a, &b)), &want(|p, q| p * q)));
    assert!(same_f32(&vals::<f32>(&bin(BinaryOp::Div, &a, &b)), &want(|p, q| p / q)));
    let sq: Vec<f32> = y.iter().map(|v| v.sqrt()).collect();
    assert!(same_f32(&vals::<f32>(&un(UnaryOp::Sqrt, &b)), &sq));
    // Strided (every other element) and reversed-order views through as_strided.
    let big = f32s(&x, &[n]);
    let half_view = strided(&big, &[n / 2], &[2], 1);
    let want_h: Vec<f32> = (0..n / 2).map(|i| x[1 + 2 * i] * 2.0).collect();
    let two = f32s(&[2.0], &[]).expand(&[(n / 2) as isize]).unwrap();
    assert!(same_f32(&vals::<f32>(&bin(BinaryOp::Mul, &half_view, &two)), &want_h));
}

/// Distance in units in the last place between two finite f32 of the same sign.
fn ulps(a: f32, b: f32) -> u32 {
    if a == b || (a.is_nan() && b.is_nan()) {
        return 0;
    }
    let key = |v: f32| {
        let i = v.to_bits() as i32;
        if i < 0 {
            i32::MIN.wrapping_sub(i)
        } else {
            i
        }
    };
    key(a).abs_diff(key(b))
}

fn max_ulps(op: UnaryOp, xs: &[f32], reference: fn(f32) -> f32) -> u32 {
    let got = vals::<f32>(&un(op, &f32s(xs, &[xs.len()])));
    let (worst, at) = xs.iter().zip(&got).map(|(&x, &g)| (ulps(g, reference(x)), x)).max_by_key(|p| p.0).unwrap();
    if worst > 2 {
        eprintln!("{op:?}: {worst} ulp at x = {at:e}");
    }
    worst
}

#[test]
fn exp_tanh_sigmoid_are_within_two_ulp() {
    let mut xs: Vec<f32> = (0..200_000).map(|i| -104.0 + i as f32 * (194.0 / 200_000.0)).collect();
    xs.extend(noise(50_000, 3).iter().map(|v| v * 3.0));
    xs.extend([0.0, -0.0, 1e-30, -1e-30, 88.72, 88.73, -87.5, -100.0, -103.9]);
    // References: correctly rounded results (f64 math rounded once).
    assert!(max_ulps(UnaryOp::Exp, &xs, |x| (x as f64).exp() as f32) <= 1, "exp");
    assert!(max_ulps(UnaryOp::Tanh, &xs, |x| (x as f64).tanh() as f32) <= 2, "tanh");
    // Sigmoid is PyTorch's formula `1 / (1 + exp(-x))`, which flushes to 0 once exp(-x)
    // overflows (x < -88.7); above that it stays within 2 ulp of the true value.
    let normal: Vec<f32> = xs.iter().copied().filter(|&x| x > -87.0).collect();
    let sig = |x: f32| (1.0 / (1.0 + (-(x as f64)).exp())) as f32;
    assert!(max_ulps(UnaryOp::Sigmoid, &normal, sig) <= 2, "sigmoid");
    let special = f32s(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1000.0, -1000.0], &[5]);
    let e = vals::<f32>(&un(UnaryOp::Exp, &special));
    assert!(e[0].is_nan() && e[1] == f32::INFINITY && e[2] == 0.0 && e[3] == f32::INFINITY && e[4] == 0.0);
    let t = vals::<f32>(&un(UnaryOp::Tanh, &special));
    assert!(t[0].is_nan() && t[1] == 1.0 && t[2] == -1.0 && t[3] == 1.0 && t[4] == -1.0);
    let z = vals::<f32>(&un(UnaryOp::Tanh, &f32s(&[-0.0], &[1])));
    assert!(z[0] == 0.0 && z[0].is_sign_negative());
    let s = vals::<f32>(&un(UnaryOp::Sigmoid, &special));
    assert!(s[0].is_nan() && s[1] == 1.0 && s[2] == 0.0);
}

#[test]
fn other_float_unaries() {
    let x = f32s(&[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.4999998, f32::NAN], &[8]);
    let r = vals::<f32>(&un(UnaryOp::Round, &x));
    assert!(same_f32(&r, &[0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 2.0, f32::NAN]));
    assert!(r[3].is_sign_negative());
    // torch.sign: NaN -> 0, -0.0 -> 0.
    let s = vals::<f32>(&un(UnaryOp::Sign, &f32s(&[-3.0, 0.0, -0.0, 2.0, f32::NAN], &[5])));
    assert_eq!(s, [-1.0, 0.0, 0.0, 1.0, 0.0]);
    let e = vals::<f64>(&un(UnaryOp::Erf, &t(vec![0.0f64, 0.5, -1.0, 3.0], &[4])));
    let want = [0.0, 0.5204998778130465, -0.8427007929497149, 0.9999779095030014];
    for (g, w) in e.iter().zip(want) {
        assert!((g - w).abs() < 1e-15, "{g} vs {w}");
    }
    let rs = vals::<f32>(&un(UnaryOp::Rsqrt, &f32s(&[4.0, 0.0], &[2])));
    assert_eq!(rs, [0.5, f32::INFINITY]);
    let nan = vals::<bool>(&un(UnaryOp::IsNan, &f32s(&[1.0, f32::NAN], &[2])));
    assert_eq!(nan, [false, true]);
    let inf = vals::<bool>(&un(UnaryOp::IsInf, &f32s(&[f32::NEG_INFINITY, f32::NAN, 1.0], &[3])));
    assert_eq!(inf, [true, false, false]);
    let not = vals::<bool>(&un(UnaryOp::Not, &f32s(&[0.0, f32::NAN, -0.0, 2.0], &[4])));
    assert_eq!(not, [true, false, true, false]);
}

#[test]
fn bf16_and_f16_compute_in_f32_and_round_once() {
    // 1 + 2^-8 is halfway between two bf16 values: the sum rounds to even (1.0).
    let a = t(bf(&[1.0, 1.0, 3.0, 0.1]), &[4]);
    let b = t(bf(&[0.00390625, 0.01171875, 1.0, 0.2]), &[4]);
    let s = vals::<bf16>(&bin(BinaryOp::Add, &a, &b));
    let want: Vec<bf16> = [(1.0f32, 0.00390625f32), (1.0, 0.01171875), (3.0, 1.0), (0.1, 0.2)]
        .iter()
        .map(|&(x, y)| bf16::from_f32(bf16::from_f32(x).to_f32() + bf16::from_f32(y).to_f32()))
        .collect();
    assert_eq!(s, want);
    assert_eq!(s[0], bf16::ONE);
    let q = vals::<bf16>(&bin(BinaryOp::Div, &a, &b));
    assert_eq!(q[2], bf16::from_f32(3.0));
    let h = t(hf(&[1.0, 2.0, 65504.0]), &[3]);
    let hs = vals::<f16>(&bin(BinaryOp::Add, &h, &h));
    assert_eq!(hs, hf(&[2.0, 4.0, f32::INFINITY]));
    // Strided bf16 (transposed) exp goes through the staging path.
    let m = t(bf(&[0.0, 1.0, 2.0, 3.0]), &[2, 2]).t().unwrap();
    let e = vals::<bf16>(&un(UnaryOp::Exp, &m));
    assert_eq!(e, bf(&[1.0, 2.0f32.exp(), 1.0f32.exp(), 3.0f32.exp()]));
}

#[test]
fn integer_arithmetic_wraps_and_rounds_like_python() {
    let a = t(vec![127i8, -128, 5, -7], &[4]);
    let b = t(vec![1i8, -1, 3, 2], &[4]);
    assert_eq!(vals::<i8>(&bin(BinaryOp::Add, &a, &b)), [-128, 127, 8, -5]);
    assert_eq!(vals::<i8>(&bin(BinaryOp::Mul, &a, &b)), [127, -128, 15, -14]);
    let u = t(vec![3u8, 200], &[2]);
    let v = t(vec![5u8, 100], &[2]);
    assert_eq!(vals::<u8>(&bin(BinaryOp::Sub, &u, &v)), [254, 100]);
    assert_eq!(vals::<u8>(&bin(BinaryOp::Add, &u, &v)), [8, 44]);
    let x = t(vec![7i64, -7, 7, -7, 0, -9], &[6]);
    let y = t(vec![2i64, 2, -2, -2, -3, 3], &[6]);
    assert_eq!(vals::<i64>(&bin(BinaryOp::Div, &x, &y)), [3, -3, -3, 3, 0, -3]);
    assert_eq!(vals::<i64>(&bin(BinaryOp::FloorDiv, &x, &y)), [3, -4, -4, 3, 0, -3]);
    assert_eq!(vals::<i64>(&bin(BinaryOp::Remainder, &x, &y)), [1, 1, -1, -1, 0, 0]);
    assert_eq!(vals::<i64>(&bin(BinaryOp::Fmod, &x, &y)), [1, -1, 1, -1, 0, 0]);
    assert_eq!(vals::<i64>(&bin(BinaryOp::Pow, &t(vec![3i64, -2, 0], &[3]), &t(vec![4i64, 3, 0], &[3]))), [81, -8, 1]);
    assert_eq!(vals::<i64>(&un(UnaryOp::Abs, &t(vec![-3i64, 4], &[2]))), [3, 4]);
    assert_eq!(vals::<i8>(&un(UnaryOp::Neg, &t(vec![-128i8, 5], &[2]))), [-128, -5]);
    assert_eq!(vals::<i32>(&un(UnaryOp::Sign, &t(vec![-3i32, 0, 9], &[3]))), [-1, 0, 1]);
    let m = bin(BinaryOp::Maximum, &t(vec![1i32, 5], &[2]), &t(vec![3i32, 2], &[2]));
    assert_eq!(vals::<i32>(&m), [3, 5]);
}

#[test]
fn integer_division_by_zero_and_negative_powers_are_errors() {
    let x = t(vec![1i32, 2], &[2]);
    let z = t(vec![1i32, 0], &[2]);
    for op in [BinaryOp::Div, BinaryOp::FloorDiv, BinaryOp::Remainder, BinaryOp::Fmod] {
        let e = Tensor::apply1(Op::Binary(op), &[&x, &z]).unwrap_err();
        assert!(matches!(e, Error::Invalid { .. }) && e.to_string().contains("ZeroDivisionError"), "{e}");
    }
    let e = Tensor::apply1(Op::Binary(BinaryOp::Pow), &[&x, &t(vec![2i32, -1], &[2])]).unwrap_err();
    assert!(e.to_string().contains("negative"), "{e}");
    let bz = t(vec![true, false], &[2]);
    assert!(Tensor::apply1(Op::Binary(BinaryOp::FloorDiv), &[&bz, &bz]).is_err());
}

#[test]
fn float_floor_div_remainder_fmod_follow_pytorch() {
    let a = f32s(&[5.5, -5.5, 5.5, -5.5, 4.0, -4.0, 0.0, -0.0, 1.0], &[9]);
    let b = f32s(&[2.0, 2.0, -2.0, -2.0, 2.0, 2.0, -3.0, 3.0, 0.0], &[9]);
    let r = vals::<f32>(&bin(BinaryOp::Remainder, &a, &b));
    assert!(same_f32(&r[..6], &[1.5, 0.5, -0.5, -1.5, 0.0, -0.0]));
    let f = vals::<f32>(&bin(BinaryOp::Fmod, &a, &b));
    assert!(same_f32(&f[..6], &[1.5, -1.5, 1.5, -1.5, 0.0, -0.0]));
    let fl = vals::<f32>(&bin(BinaryOp::FloorDiv, &a, &b));
    assert!(same_f32(&fl, &[2.0, -3.0, -3.0, 2.0, 2.0, -2.0, -0.0, -0.0, f32::INFINITY]));
}

#[test]
fn pow_with_scalar_exponents() {
    let x = f32s(&[1.5, -2.0, 4.0, 0.0], &[4]);
    let p = |e: f32| vals::<f32>(&bin(BinaryOp::Pow, &x, &f32s(&[e], &[]).expand(&[4]).unwrap()));
    assert_eq!(p(2.0), [2.25, 4.0, 16.0, 0.0]);
    assert_eq!(p(3.0), [3.375, -8.0, 64.0, 0.0]);
    assert_eq!(p(-1.0), [1.0 / 1.5, -0.5, 0.25, f32::INFINITY]);
    assert_eq!(p(1.0), [1.5, -2.0, 4.0, 0.0]);
    let h = p(0.5);
    assert!(h[1].is_nan() && h[2] == 2.0);
    let g = vals::<f32>(&bin(BinaryOp::Pow, &x, &f32s(&[2.0, 2.0, 0.5, 3.0], &[4])));
    assert_eq!(g, [2.25, 4.0, 2.0, 0.0]);
}

#[test]
fn nan_propagation_in_max_min() {
    let a = f32s(&[f32::NAN, 1.0, -2.0, f32::NAN], &[4]);
    let b = f32s(&[1.0, f32::NAN, 3.0, f32::NAN], &[4]);
    assert!(same_f32(&vals(&bin(BinaryOp::Maximum, &a, &b)), &[f32::NAN, f32::NAN, 3.0, f32::NAN]));
    assert!(same_f32(&vals(&bin(BinaryOp::Minimum, &a, &b)), &[f32::NAN, f32::NAN, -2.0, f32::NAN]));
    assert!(same_f32(&vals(&bin(BinaryOp::Fmax, &a, &b)), &[1.0, 1.0, 3.0, f32::NAN]));
    assert!(same_f32(&vals(&bin(BinaryOp::Fmin, &a, &b)), &[1.0, 1.0, -2.0, f32::NAN]));
}

#[test]
fn logical_and_bool_ops() {
    let a = f32s(&[0.0, 1.0, f32::NAN, 0.0], &[4]);
    let b = f32s(&[0.0, 0.0, 2.0, -1.0], &[4]);
    assert_eq!(vals::<bool>(&bin(BinaryOp::And, &a, &b)), [false, false, true, false]);
    assert_eq!(vals::<bool>(&bin(BinaryOp::Or, &a, &b)), [false, true, true, true]);
    assert_eq!(vals::<bool>(&bin(BinaryOp::Xor, &a, &b)), [false, true, false, true]);
    let p = t(vec![true, false, true, false], &[4]);
    let q = t(vec![true, true, false, false], &[4]);
    assert_eq!(vals::<bool>(&bin(BinaryOp::Add, &p, &q)), [true, true, true, false]);
    assert_eq!(vals::<bool>(&bin(BinaryOp::Mul, &p, &q)), [true, false, false, false]);
    assert_eq!(vals::<bool>(&bin(BinaryOp::Pow, &p, &q)), [true, false, true, true]);
}

#[test]
fn comparisons_and_where() {
    let a = f32s(&[1.0, f32::NAN, 3.0, -0.0], &[4]);
    let b = f32s(&[2.0, f32::NAN, 3.0, 0.0], &[4]);
    let c = |op| vals::<bool>(&run(Op::Compare(op), &[&a, &b]));
    assert_eq!(c(CmpOp::Eq), [false, false, true, true]);
    assert_eq!(c(CmpOp::Ne), [true, true, false, false]);
    assert_eq!(c(CmpOp::Lt), [true, false, false, false]);
    assert_eq!(c(CmpOp::Le), [true, false, true, true]);
    assert_eq!(c(CmpOp::Gt), [false, false, false, false]);
    assert_eq!(c(CmpOp::Ge), [false, false, true, true]);
    let h = run(Op::Compare(CmpOp::Lt), &[&t(bf(&[1.0, -2.0]), &[2]), &t(bf(&[1.5, -3.0]), &[2])]);
    assert_eq!(vals::<bool>(&h), [true, false]);
    let i = run(Op::Compare(CmpOp::Gt), &[&t(vec![200u8, 3], &[2]), &t(vec![100u8, 4], &[2])]);
    assert_eq!(vals::<bool>(&i), [true, false]);
    let cond = t(vec![true, false, true], &[3, 1]).expand(&[3, 4]).unwrap();
    let x = f32s(&[4.0, 0.0, 4.0, -4.0], &[1, 4]).expand(&[3, 4]).unwrap();
    let y = f32s(&[-1.0], &[]).expand(&[3, 4]).unwrap();
    let w = vals::<f32>(&run(Op::Where, &[&cond, &x, &y]));
    assert_eq!(w, [4.0, 0.0, 4.0, -4.0, -1.0, -1.0, -1.0, -1.0, 4.0, 0.0, 4.0, -4.0]);
}

#[test]
fn casts_follow_pytorch() {
    let x = f32s(&[2.7, -2.7, -1.5, 300.0, f32::NAN, 0.0], &[6]);
    assert_eq!(vals::<i32>(&run(Op::Cast(DType::I32), &[&x]))[..4], [2, -2, -1, 300]);
    assert_eq!(vals::<u8>(&run(Op::Cast(DType::U8), &[&x]))[..4], [2, 254, 255, 44]);
    assert_eq!(vals::<bool>(&run(Op::Cast(DType::Bool), &[&x])), [true, true, true, true, true, false]);
    // f32 -> bf16: round to nearest even, overflow to inf, NaN stays NaN.
    let y = f32s(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 3.4e38, f32::NAN, -0.0], &[5]);
    let b = vals::<bf16>(&run(Op::Cast(DType::BF16), &[&y]));
    assert_eq!(&b[..2], &bf(&[1.0, 1.015625])[..]);
    assert!(b[2].to_f32().is_infinite() && b[3].is_nan() && b[4].is_sign_negative());
    let back = vals::<f32>(&run(Op::Cast(DType::F32), &[&t(b.clone(), &[5])]));
    assert_eq!(back[1], 1.015625);
    // int -> bf16 goes through f32; int -> bool is != 0.
    let i = t(vec![16_777_217i64, 0, -3], &[3]);
    assert_eq!(vals::<bf16>(&run(Op::Cast(DType::BF16), &[&i]))[2], bf16::from_f32(-3.0));
    assert_eq!(vals::<bool>(&run(Op::Cast(DType::Bool), &[&i])), [true, false, true]);
    assert_eq!(vals::<f32>(&run(Op::Cast(DType::F32), &[&i]))[0], 16_777_216.0);
    let bo = t(vec![true, false], &[2]);
    assert_eq!(vals::<f16>(&run(Op::Cast(DType::F16), &[&bo])), hf(&[1.0, 0.0]));
    // A transposed cast.
    let m = t(vec![1i64, 2, 3, 4, 5, 6], &[2, 3]).t().unwrap();
    assert_eq!(vals::<f64>(&run(Op::Cast(DType::F64), &[&m])), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
}

#[test]
fn full_arange_copy() {
    crate::register();
    let f = Tensor::apply_on(
        Op::Full { shape: [2usize, 2][..].into(), value: Scalar::Float(-0.0), dtype: DType::F32 },
        &[],
        kiln_tensor::Device::Cpu,
    )
    .unwrap();
    assert!(vals::<f32>(&f[0]).iter().all(|v| *v == 0.0 && v.is_sign_negative()));
    let f = Tensor::apply_on(
        Op::Full { shape: [3usize][..].into(), value: Scalar::Float(0.1), dtype: DType::BF16 },
        &[],
        kiln_tensor::Device::Cpu,
    )
    .unwrap();
    assert_eq!(vals::<bf16>(&f[0]), bf(&[0.1, 0.1, 0.1]));
    let a = Tensor::apply_on(
        Op::Arange { start: 1.0, step: 0.5, len: 4, dtype: DType::F32 },
        &[],
        kiln_tensor::Device::Cpu,
    )
    .unwrap();
    assert_eq!(vals::<f32>(&a[0]), [1.0, 1.5, 2.0, 2.5]);
    let x = t((0..24).collect::<Vec<i32>>(), &[2, 3, 4]);
    let p = x.permute(&[2, 0, 1]).unwrap();
    let c = run(Op::Copy, &[&p]);
    assert_eq!(&vals::<i32>(&c)[..6], &[0, 4, 8, 12, 16, 20]);
}

#[test]
fn assign_writes_through_strided_views() {
    let base = f32s(&[0.0; 12], &[3, 4]);
    let v = base.t().unwrap().narrow(0, 1, 2).unwrap(); // [2, 3], strides [1, 4], offset 1
    v.copy_(&f32s(&[1., 2., 3., 4., 5., 6.], &[2, 3])).unwrap();
    assert_eq!(vals::<f32>(&base), [0., 1., 4., 0., 0., 2., 5., 0., 0., 3., 6., 0.]);
    // Aliasing source and destination (a transpose of itself).
    let sq = f32s(&[1., 2., 3., 4.], &[2, 2]);
    sq.copy_(&sq.t().unwrap()).unwrap();
    assert_eq!(vals::<f32>(&sq), [1., 3., 2., 4.]);
    // A large parallel copy into a strided view.
    let n = 300_000;
    let big = f32s(&vec![0.0; 2 * n], &[n, 2]);
    big.select(1, 1).unwrap().copy_(&f32s(&noise(n, 9), &[n])).unwrap();
    let got = vals::<f32>(&big);
    assert!(got.chunks(2).zip(noise(n, 9)).all(|(p, w)| p[0] == 0.0 && p[1] == w));
    // Op::Assign out of place.
    let base = f32s(&[0.0; 6], &[6]);
    let src = f32s(&[7., 8.], &[2]);
    let out = run(Op::Assign { shape: [2usize][..].into(), strides: [3usize][..].into(), offset: 1 }, &[&base, &src]);
    assert_eq!(vals::<f32>(&out), [0., 7., 0., 0., 8., 0.]);
}

#[test]
fn transposed_operands_walk_in_tiles() {
    // Sizes that are not multiples of the tile, large enough to run in parallel.
    let (r, c) = (333, 517);
    let v = noise(r * c, 31);
    let a = f32s(&v, &[r, c]);
    let at = a.t().unwrap(); // [c, r]
    let want_t: Vec<f32> = (0..c).flat_map(|j| (0..r).map(move |i| (i, j))).map(|(i, j)| v[i * c + j]).collect();
    assert_eq!(vals::<f32>(&run(Op::Copy, &[&at])), want_t);
    let ones = f32s(&vec![1.0; r * c], &[c, r]);
    let sum: Vec<f32> = want_t.iter().map(|x| x + 1.0).collect();
    assert_eq!(vals::<f32>(&bin(BinaryOp::Add, &at, &ones)), sum);
    let e = vals::<f32>(&un(UnaryOp::Neg, &at));
    assert!(e.iter().zip(&want_t).all(|(p, q)| *p == -q));
    // bf16 through the staging path, and a cast.
    let h = t(bf(&v), &[r, c]).t().unwrap();
    let hv = vals::<f32>(&run(Op::Cast(DType::F32), &[&h]));
    assert!(hv.iter().zip(&want_t).all(|(p, q)| *p == bf16::from_f32(*q).to_f32()));
    // A 3-d permutation.
    let x = t((0..(5 * 70 * 90)).collect::<Vec<i32>>(), &[5, 70, 90]);
    let p = x.permute(&[0, 2, 1]).unwrap();
    let got = vals::<i32>(&run(Op::Copy, &[&p]));
    assert!(
        (0..5).all(|b| (0..90).all(|j| (0..70).all(|i| got[(b * 90 + j) * 70 + i] == ((b * 70 + i) * 90 + j) as i32)))
    );
    // Writing into a transposed view.
    let base = f32s(&vec![0.0; r * c], &[r, c]);
    base.t().unwrap().copy_(&f32s(&want_t, &[c, r])).unwrap();
    assert_eq!(vals::<f32>(&base), v);
}

#[test]
fn every_instruction_set_level_computes_the_same_math() {
    use crate::kernels::elem::{assume_init, uninit};
    use crate::kernels::simd::{Kernel, MapUnary, UnOp};
    #[derive(Clone, Copy)]
    struct E;
    impl UnOp<f32> for E {
        fn f<const FMA: bool>(self, x: f32) -> f32 {
            crate::kernels::simd::exp_f32::<FMA>(x)
        }
    }
    let xs: Vec<f32> = (0..100_000).map(|i| -104.0 + i as f32 * (194.0 / 100_000.0)).collect();
    let (mut base, mut fused) = (uninit::<f32>(xs.len()), uninit::<f32>(xs.len()));
    MapUnary { op: E, x: &xs, out: &mut base }.run::<false>();
    MapUnary { op: E, x: &xs, out: &mut fused }.run::<true>();
    // SAFETY: MapUnary wrote one output per input, all of both buffers.
    let (base, fused) = unsafe { (assume_init(base), assume_init(fused)) };
    for ((&x, &b), &f) in xs.iter().zip(&base).zip(&fused) {
        let want = (x as f64).exp() as f32;
        assert!(ulps(b, want) <= 1 && ulps(f, want) <= 1, "exp({x}): {b} / {f} vs {want}");
    }
}

#[test]
fn bf16_rounding_matches_the_reference_conversion() {
    use crate::kernels::elem::f32_to_bf16;
    let mut bits: Vec<u32> = (0..200_000u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    bits.extend([
        0x3F80_8000,
        0x3F81_8000,
        0x7F7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0001,
        0x0000_8000,
        0x8000_8001,
    ]);
    for b in bits {
        let x = f32::from_bits(b);
        let (got, want) = (f32_to_bf16(x), bf16::from_f32(x));
        assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{b:#x}");
    }
}

#[test]
fn fresh_outputs_are_written_in_full_for_every_layout_and_dtype() {
    // Outputs start uninitialised (Note [Uninitialised outputs]): every element of
    // every result must come from the op, for direct (f32), staged (bf16, f16) and
    // per-element (i32) engines, contiguous, transposed (tiled), broadcast and
    // strided inputs, split across threads (77100 elements).
    let (r, c) = (300, 257);
    let av: Vec<f32> = (0..r * c).map(|i| (i % 97) as f32).collect();
    let bv: Vec<f32> = (0..r * c).map(|i| (i % 89) as f32).collect();
    let want_t: Vec<f32> = (0..r * c).map(|i| av[i] + bv[(i % c) * r + i / c]).collect();
    let want_row: Vec<f32> = (0..r * c).map(|i| av[i] + bv[i % c]).collect();
    // Rows of c elements at a stride of 2c in the 2rc elements of `av` twice over.
    let twice = [av.clone(), av.clone()].concat();
    let want_step: Vec<f32> = (0..r * c).map(|i| -twice[(i / c) * 2 * c + i % c]).collect();
    let make = |v: &[f32], shape: &[usize], dt: DType| f32s(v, shape).to_dtype(dt).unwrap();
    for dt in [DType::F32, DType::BF16, DType::F16, DType::I32] {
        // Leave junk where the outputs may be allocated.
        drop(std::hint::black_box(vec![0x7fu8; 4 << 20]));
        let a = make(&av, &[r, c], dt);
        let bt = make(&bv, &[c, r], dt).t().unwrap();
        let row = make(&bv[..c], &[c], dt).expand(&[r as isize, c as isize]).unwrap();
        let wide = make(&twice, &[r, 2 * c], dt);
        let step = strided(&wide, &[r, c], &[2 * c, 1], 0);
        let check = |x: Tensor, want: &[f32], what: &str| {
            let got = vals::<f32>(&x.to_dtype(DType::F32).unwrap());
            let bad = got.iter().zip(want).position(|(g, w)| g != w);
            assert!(bad.is_none(), "{dt:?} {what}: element {bad:?} differs");
        };
        check(bin(BinaryOp::Add, &a, &bt), &want_t, "a + b.t()");
        check(bin(BinaryOp::Add, &a, &row), &want_row, "a + row");
        check(un(UnaryOp::Neg, &step), &want_step, "-(every row's first half)");
    }
}
