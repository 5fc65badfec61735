//! Elementwise math: broadcasting, PyTorch's type promotion (tensors, 0-d tensors
//! and scalars), comparisons, logical ops, where, clamp, pow, the unary functions
//! and activations, integer and float division/remainder rules, rounding.
use crate::common::{assert_close, assert_err, assert_exact, f64s};
use crate::{iota, on_devices, t};
use kiln::prelude::*;
use kiln::Operand;

const NAN: f64 = f64::NAN;
const INF: f64 = f64::INFINITY;

#[test]
fn broadcasting_shapes_and_values() {
    on_devices(|dev| {
        let a = iota(&[2, 1, 3], dev); // a[i, 0, k] = 3i + k
        let b = t([[0.0f32], [10.0], [20.0], [30.0]], dev); // b[j, 0] = 10j
        let y = a.add(&b)?;
        assert_eq!(y.shape(), &[2, 4, 3]);
        let want: Vec<f64> =
            (0..2).flat_map(|i| (0..4).flat_map(move |j| (0..3).map(move |k| (3 * i + k + 10 * j) as f64))).collect();
        assert_exact(&y, DType::F32, &[2, 4, 3], &want);
        // 0-d with anything, size-0 dims, identical shapes.
        assert_exact(&t(2.0f32, dev).mul(&iota(&[3], dev))?, DType::F32, &[3], &[0.0, 2.0, 4.0]);
        assert_exact(&Tensor::zeros(&[0, 3], (DType::F32, dev))?.add(&iota(&[1, 3], dev))?, DType::F32, &[0, 3], &[]);
        assert_exact(&Tensor::zeros(&[2, 0], (DType::F32, dev))?.add(&iota(&[1], dev))?, DType::F32, &[2, 0], &[]);
        // Strided operands read in logical order.
        let m = iota(&[2, 3], dev);
        let s = m.t()?.sub(&iota(&[3, 2], dev))?;
        assert_exact(&s, DType::F32, &[3, 2], &[0.0, 2.0, -1.0, 1.0, -2.0, 0.0]);
        assert_err(
            iota(&[2, 3], dev).add(&iota(&[2], dev)),
            &["add", "the size of tensor a (3) must match the size of tensor b (2) at non-singleton dimension 1"],
        );
        assert_err(iota(&[0], dev).mul(&iota(&[2], dev)), &["mul", "(0)", "(2)"]);
        Ok(())
    });
}

#[test]
fn type_promotion_follows_pytorch() {
    on_devices(|dev| {
        let i64v = t([1i64, 3], dev);
        let i32v = t([1i32, 3], dev);
        let u8v = t([200u8, 10], dev);
        let i8v = t([-100i8, 100], dev);
        let bv = t([true, false], dev);
        let f16v = t([1.5f32, 2.0], dev).to_dtype(DType::F16)?;
        let bf16v = t([1.5f32, 2.0], dev).to_dtype(DType::BF16)?;
        let f32v = t([0.5f32, 1.0], dev);
        let f64v = t([0.5f64, 1.0], dev);
        let f32_0d = t(2.0f32, dev);
        let f64_0d = t(2.0f64, dev);
        let i32_0d = t(2i32, dev);
        let i64_0d = t(2i64, dev);
        let i64_1 = t([2i64], dev);
        let u8_0d = t(2u8, dev);
        let bf16_0d = t(1.0f32, dev).to_dtype(DType::BF16)?;
        let f16_0d = t(1.0f32, dev).to_dtype(DType::F16)?;
        let cases: Vec<(&str, &Tensor, Operand<'_>, DType)> = vec![
            ("int64 + float32 0-d", &i64v, (&f32_0d).into(), DType::F32),
            ("int64 * 2.5", &i64v, 2.5.into(), DType::F32),
            ("int64 + int32 0-d", &i64v, (&i32_0d).into(), DType::I64),
            ("int32 + int64 0-d", &i32v, (&i64_0d).into(), DType::I32),
            ("int32 + int64[1]", &i32v, (&i64_1).into(), DType::I64),
            ("uint8 + int8", &u8v, (&i8v).into(), DType::I16),
            ("uint8 + int64 0-d", &u8v, (&i64_0d).into(), DType::U8),
            ("uint8 * 2", &u8v, 2.into(), DType::U8),
            ("int8 + uint8 0-d", &i8v, (&u8_0d).into(), DType::I8),
            ("bool + bool", &bv, (&bv).into(), DType::Bool),
            ("bool + 1", &bv, 1.into(), DType::I64),
            ("bool + 1.5", &bv, 1.5.into(), DType::F32),
            ("bool + float64 0-d", &bv, (&f64_0d).into(), DType::F64),
            ("int64 + true", &i64v, true.into(), DType::I64),
            ("float16 + bfloat16", &f16v, (&bf16v).into(), DType::F32),
            ("float16 * 2.5", &f16v, 2.5.into(), DType::F16),
            ("bfloat16 + float32 0-d", &bf16v, (&f32_0d).into(), DType::BF16),
            ("float32 + float64 0-d", &f32v, (&f64_0d).into(), DType::F32),
            ("float32 + float64", &f32v, (&f64v).into(), DType::F64),
            ("bfloat16 0-d + float16 0-d", &bf16_0d, (&f16_0d).into(), DType::F32),
            ("int64 0-d + 2.5", &i64_0d, 2.5.into(), DType::F32),
            ("float64 0-d + float32", &f64_0d, (&f32v).into(), DType::F32),
            ("int32 0-d + float16", &i32_0d, (&f16v).into(), DType::F16),
            ("int64 + bfloat16 0-d", &i64v, (&bf16_0d).into(), DType::BF16),
        ];
        for (what, a, b, want) in cases {
            let y = a.add(b)?;
            assert_eq!(y.dtype(), want, "{what}");
            assert_eq!(a.mul(b)?.dtype(), want, "{what} (mul)");
        }
        // The values are computed in the promoted type.
        assert_exact(&u8v.add(&i8v)?, DType::I16, &[2], &[100.0, 110.0]);
        assert_exact(&(&i64v * 2.5), DType::F32, &[2], &[2.5, 7.5]);
        assert_exact(&bv.add(&t([false, false], dev))?, DType::Bool, &[2], &[1.0, 0.0]);
        assert_exact(&bv.add(&bv)?, DType::Bool, &[2], &[1.0, 0.0]);
        assert_exact(&bv.mul(&t([true, true], dev))?, DType::Bool, &[2], &[1.0, 0.0]);
        assert_exact(&f16v.add(&bf16v)?, DType::F32, &[2], &[3.0, 4.0]);
        assert_exact(&i32v.add(&i64_0d)?, DType::I32, &[2], &[3.0, 5.0]);
        // True division always gives a float.
        assert_exact(&i32v.div(&t([2i32, 2], dev))?, DType::F32, &[2], &[0.5, 1.5]);
        assert_exact(&bv.div(2)?, DType::F32, &[2], &[0.5, 0.0]);
        assert_exact(&f16v.div(2)?, DType::F16, &[2], &[0.75, 1.0]);
        Ok(())
    });
}

#[test]
fn comparisons() {
    on_devices(|dev| {
        let x = t([1.0f32, 2.0, f32::NAN], dev);
        assert_exact(&x.gt(1.5)?, DType::Bool, &[3], &[0.0, 1.0, 0.0]);
        assert_exact(&x.ge(2)?, DType::Bool, &[3], &[0.0, 1.0, 0.0]);
        assert_exact(&x.lt(2.0)?, DType::Bool, &[3], &[1.0, 0.0, 0.0]);
        assert_exact(&x.le(&t(1.0f32, dev))?, DType::Bool, &[3], &[1.0, 0.0, 0.0]);
        assert_exact(&x.eq(&x)?, DType::Bool, &[3], &[1.0, 1.0, 0.0]);
        assert_exact(&x.ne(&x)?, DType::Bool, &[3], &[0.0, 0.0, 1.0]);
        // Mixed dtypes compare in the promoted type.
        let i = t([1i64, 2, 3], dev);
        assert_exact(&i.gt(2.5)?, DType::Bool, &[3], &[0.0, 0.0, 1.0]);
        assert_exact(&i.eq(&t([1.0f32, 2.5, 3.0], dev))?, DType::Bool, &[3], &[1.0, 0.0, 1.0]);
        assert_exact(&t([200u8], dev).gt(&t([-1i8], dev))?, DType::Bool, &[1], &[1.0]);
        assert_exact(&t([true, false], dev).eq(1)?, DType::Bool, &[2], &[1.0, 0.0]);
        // Broadcasting.
        let c = t([[1.0f32], [2.0]], dev).lt(&t([1.0f32, 2.0, 3.0], dev))?;
        assert_exact(&c, DType::Bool, &[2, 3], &[0.0, 1.0, 1.0, 0.0, 0.0, 1.0]);
        assert_err(iota(&[2], dev).lt(&iota(&[3], dev)), &["lt", "(2)", "(3)"]);
        Ok(())
    });
}

#[test]
fn logical_ops() {
    on_devices(|dev| {
        let a = t([true, true, false, false], dev);
        let b = t([true, false, true, false], dev);
        assert_exact(&a.logical_and(&b)?, DType::Bool, &[4], &[1.0, 0.0, 0.0, 0.0]);
        assert_exact(&a.logical_or(&b)?, DType::Bool, &[4], &[1.0, 1.0, 1.0, 0.0]);
        assert_exact(&a.logical_xor(&b)?, DType::Bool, &[4], &[0.0, 1.0, 1.0, 0.0]);
        assert_exact(&a.logical_not()?, DType::Bool, &[4], &[0.0, 0.0, 1.0, 1.0]);
        // Any dtype: non-zero (NaN included) is true; the result is bool.
        let f = t([0.0f32, 0.5, f32::NAN, -0.0], dev);
        assert_exact(&f.logical_not()?, DType::Bool, &[4], &[1.0, 0.0, 0.0, 1.0]);
        assert_exact(&f.logical_and(&t([3i64, 3, 3, 3], dev))?, DType::Bool, &[4], &[0.0, 1.0, 1.0, 0.0]);
        assert_exact(&t([0i32, 7], dev).logical_or(0)?, DType::Bool, &[2], &[0.0, 1.0]);
        let m = t([[true], [false]], dev).logical_and(&t([true, false], dev))?;
        assert_exact(&m, DType::Bool, &[2, 2], &[1.0, 0.0, 0.0, 0.0]);
        Ok(())
    });
}

#[test]
fn where_select() {
    on_devices(|dev| {
        let cond = t([[true], [false]], dev);
        let a = t([1i64, 2, 3], dev);
        let y = Tensor::where_cond(&cond, &a, 0.5)?;
        assert_exact(&y, DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 0.5, 0.5, 0.5]);
        let y = Tensor::where_cond(&cond, &t([1i32, 2, 3], dev), &a.neg()?)?;
        assert_exact(&y, DType::I64, &[2, 3], &[1.0, 2.0, 3.0, -1.0, -2.0, -3.0]);
        let y = Tensor::where_cond(&t([true, false], dev), 1.0, 0.0)?;
        assert_exact(&y, DType::F32, &[2], &[1.0, 0.0]);
        let y = Tensor::where_cond(&t([false, true], dev), &t([f32::NAN, 1.0], dev), f64::NEG_INFINITY)?;
        assert_exact(&y, DType::F32, &[2], &[-INF, 1.0]);
        assert_err(
            Tensor::where_cond(&t([1.0f32], dev), 1.0, 0.0),
            &["where", "where expected condition to be a boolean tensor, but got a tensor with dtype float32"],
        );
        assert_err(Tensor::where_cond(&t([true, false], dev), &iota(&[3], dev), 0.0), &["where", "(2)", "(3)"]);
        Ok(())
    });
}

#[test]
fn clamp_and_relu() {
    on_devices(|dev| {
        let x = t([-2.0f32, 0.5, 3.0, f32::NAN], dev);
        assert_exact(&x.clamp(Some(0.0), Some(1.0))?, DType::F32, &[4], &[0.0, 0.5, 1.0, NAN]);
        assert_exact(&x.clamp(Some(0.0), None)?, DType::F32, &[4], &[0.0, 0.5, 3.0, NAN]);
        assert_exact(&x.clamp(None, Some(1.0))?, DType::F32, &[4], &[-2.0, 0.5, 1.0, NAN]);
        assert_exact(&x.relu()?, DType::F32, &[4], &[0.0, 0.5, 3.0, NAN]);
        let lo = t([0.0f32, 1.0, 1.0, 1.0], dev);
        assert_exact(&x.clamp_tensor(Some(&lo), None)?, DType::F32, &[4], &[0.0, 1.0, 3.0, NAN]);
        let i = t([-5i64, 0, 5], dev);
        assert_exact(&i.clamp(Some(-1.0), Some(2.0))?, DType::I64, &[3], &[-1.0, 0.0, 2.0]);
        assert_exact(&i.relu()?, DType::I64, &[3], &[0.0, 0.0, 5.0]);
        // Fractional bounds promote an integer tensor (PyTorch's clamp type promotion).
        assert_exact(&i.clamp(Some(-1.5), Some(2.5))?, DType::F32, &[3], &[-1.5, 0.0, 2.5]);
        assert_err(x.clamp(None, None), &["clamp", "at least one of 'min' or 'max' must not be None"]);
        Ok(())
    });
}

#[test]
fn pow_rules() {
    on_devices(|dev| {
        let x = t([1.0f32, 2.0, 3.0], dev);
        assert_exact(&x.pow(2.0)?, DType::F32, &[3], &[1.0, 4.0, 9.0]);
        assert_exact(&x.pow(2)?, DType::F32, &[3], &[1.0, 4.0, 9.0]);
        assert_close(&x.pow(0.5)?, DType::F32, &[3], &[1.0, 2f64.sqrt(), 3f64.sqrt()], 1e-6);
        let inv = x.pow(&t([[0.0f32], [-1.0]], dev))?;
        assert_close(&inv, DType::F32, &[2, 3], &[1.0, 1.0, 1.0, 1.0, 0.5, 1.0 / 3.0], 1e-7);
        assert_exact(
            &t([-8.0f32, 0.0, -2.0], dev).pow(&t([1.0f32 / 3.0, 0.0, 3.0], dev))?,
            DType::F32,
            &[3],
            &[NAN, 1.0, -8.0],
        );
        let i = t([2i64, 3, -2], dev);
        assert_exact(&i.pow(2)?, DType::I64, &[3], &[4.0, 9.0, 4.0]);
        assert_exact(&i.pow(3)?, DType::I64, &[3], &[8.0, 27.0, -8.0]);
        assert_exact(&i.pow(2.0)?, DType::F32, &[3], &[4.0, 9.0, 4.0]);
        assert_exact(&i.pow(&t([0i64, 1, 0], dev))?, DType::I64, &[3], &[1.0, 3.0, 1.0]);
        let h = t([3.0f32], dev).to_dtype(DType::F16)?;
        assert_exact(&h.pow(2)?, DType::F16, &[1], &[9.0]);
        assert_err(i.pow(-1), &["Integers to negative integer powers are not allowed"]);
        Ok(())
    });
}

#[test]
fn unary_math_functions() {
    on_devices(|dev| {
        let tol = 1e-6;
        let e = std::f64::consts::E;
        assert_close(
            &t([0.0f32, 1.0, f32::NEG_INFINITY, f32::INFINITY], dev).exp()?,
            DType::F32,
            &[4],
            &[1.0, e, 0.0, INF],
            tol,
        );
        assert_close(&t([1.0f32, e as f32, 0.0, -1.0], dev).log()?, DType::F32, &[4], &[0.0, 1.0, -INF, NAN], tol);
        assert_close(&t([4.0f32, 2.0, -1.0, 0.0], dev).sqrt()?, DType::F32, &[4], &[2.0, 2f64.sqrt(), NAN, 0.0], tol);
        assert_close(&t([4.0f32, 0.0, 0.25], dev).rsqrt()?, DType::F32, &[3], &[0.5, INF, 2.0], tol);
        assert_close(
            &t([0.0f32, 1.0, 50.0, -50.0], dev).tanh()?,
            DType::F32,
            &[4],
            &[0.0, 1f64.tanh(), 1.0, -1.0],
            tol,
        );
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let xs = [0.0, 2.0, -100.0, 100.0, -5.0];
        let want: Vec<f64> = xs.iter().map(|&x| sig(x)).collect();
        assert_close(&t(xs.map(|x| x as f32), dev).sigmoid()?, DType::F32, &[5], &want, tol);
        assert_close(
            &t([0.0f32, 0.5, -1.0, 3.0], dev).erf()?,
            DType::F32,
            &[4],
            &[0.0, 0.520_499_877_813_046_5, -0.842_700_792_949_714_9, 0.999_977_909_503_001_4],
            tol,
        );
        assert_close(&t([0.5f32, -2.0], dev).reciprocal()?, DType::F32, &[2], &[2.0, -0.5], tol);
        assert_close(&t([0.0f32, 1e-7], dev).log1p()?, DType::F32, &[2], &[0.0, 1e-7], 1e-9);
        assert_close(&t([0.0f32, 1e-7], dev).expm1()?, DType::F32, &[2], &[0.0, 1e-7], 1e-9);
        let pi = std::f64::consts::PI;
        assert_close(&t([0.0f32, pi as f32 / 2.0], dev).sin()?, DType::F32, &[2], &[0.0, 1.0], tol);
        assert_close(&t([0.0f32, pi as f32], dev).cos()?, DType::F32, &[2], &[1.0, -1.0], tol);
        // Integer and bool inputs compute in float32.
        assert_close(&t([0i64, 1], dev).exp()?, DType::F32, &[2], &[1.0, e], tol);
        assert_close(&t([4i32, 9], dev).sqrt()?, DType::F32, &[2], &[2.0, 3.0], tol);
        assert_close(&t([true, false], dev).sigmoid()?, DType::F32, &[2], &[sig(1.0), 0.5], tol);
        // float64 keeps its precision; bf16 stays bf16.
        let d = t([1.0f64], dev).exp()?;
        assert_eq!(d.dtype(), DType::F64);
        assert!((d.to_vec::<f64>()?[0] - e).abs() < 1e-15);
        let b = t([1.0f32], dev).to_dtype(DType::BF16)?.exp()?;
        assert_exact(&b, DType::BF16, &[1], &[2.71875]);
        Ok(())
    });
}

#[test]
fn activations() {
    on_devices(|dev| {
        let x = t([-3.0f32, -1.0, 0.0, 1.0, 3.0], dev);
        // Exact GELU: x * Phi(x).
        let gelu = [-0.004_049_694_8, -0.158_655_253_9, 0.0, 0.841_344_746_1, 2.995_950_305_2];
        assert_close(&x.gelu()?, DType::F32, &[5], &gelu, 1e-6);
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let gt: Vec<f64> = [-3.0f64, -1.0, 0.0, 1.0, 3.0]
            .iter()
            .map(|&v| 0.5 * v * (1.0 + (k * (v + 0.044715 * v * v * v)).tanh()))
            .collect();
        assert_close(&x.gelu_tanh()?, DType::F32, &[5], &gt, 1e-6);
        let silu: Vec<f64> = [-3.0f64, -1.0, 0.0, 1.0, 3.0].iter().map(|&v| v / (1.0 + (-v).exp())).collect();
        assert_close(&x.silu()?, DType::F32, &[5], &silu, 1e-6);
        // Large magnitudes stay finite.
        let big = t([-100.0f32, 100.0], dev);
        assert_close(&big.silu()?, DType::F32, &[2], &[0.0, 100.0], 1e-6);
        assert_close(&big.gelu()?, DType::F32, &[2], &[0.0, 100.0], 1e-6);
        let h = x.to_dtype(DType::BF16)?;
        assert_eq!(h.gelu()?.dtype(), DType::BF16);
        assert_eq!(h.silu()?.dtype(), DType::BF16);
        Ok(())
    });
}

#[test]
fn integer_division_remainder_and_fmod() {
    on_devices(|dev| {
        let a = t([7i64, -7, 7, -7, 0], dev);
        let b = t([2i64, 2, -2, -2, 3], dev);
        assert_exact(&a.floor_divide(&b)?, DType::I64, &[5], &[3.0, -4.0, -4.0, 3.0, 0.0]);
        assert_exact(&a.div_trunc(&b)?, DType::I64, &[5], &[3.0, -3.0, -3.0, 3.0, 0.0]);
        // remainder (Python's %): the sign of the divisor; fmod (C): the sign of the dividend.
        assert_exact(&a.remainder(&b)?, DType::I64, &[5], &[1.0, 1.0, -1.0, -1.0, 0.0]);
        assert_exact(&(&a % &b), DType::I64, &[5], &[1.0, 1.0, -1.0, -1.0, 0.0]);
        assert_exact(&a.fmod(&b)?, DType::I64, &[5], &[1.0, -1.0, 1.0, -1.0, 0.0]);
        assert_exact(&(&a / &b), DType::F32, &[5], &[3.5, -3.5, -3.5, 3.5, 0.0]);
        assert_exact(&(&a % 3i64), DType::I64, &[5], &[1.0, 2.0, 1.0, 2.0, 0.0]);
        assert_exact(&a.floor_divide(-3)?, DType::I64, &[5], &[-3.0, 2.0, -3.0, 2.0, 0.0]);
        let i = t([-7i32, 9], dev);
        assert_exact(&i.remainder(4)?, DType::I32, &[2], &[1.0, 1.0]);
        assert_exact(&i.fmod(4)?, DType::I32, &[2], &[-3.0, 1.0]);
        // An int tensor with a float divisor computes in float.
        assert_exact(&i.floor_divide(2.0)?, DType::F32, &[2], &[-4.0, 4.0]);
        assert_exact(&i.remainder(2.5)?, DType::F32, &[2], &[0.5, 1.5]);
        Ok(())
    });
}

#[test]
fn integer_division_by_zero_is_an_error() {
    on_devices(|dev| {
        let a = t([1i64, -1, 0], dev);
        let z = t([1i64, 0, 1], dev);
        assert_err(a.floor_divide(&z), &["floor_divide", "ZeroDivisionError"]);
        assert_err(a.remainder(&z), &["remainder", "ZeroDivisionError"]);
        assert_err(a.fmod(0), &["fmod", "ZeroDivisionError"]);
        assert_err(a.div_trunc(0), &["ZeroDivisionError"]);
        assert_err(t([5i32], dev).floor_divide(0), &["ZeroDivisionError"]);
        // True division of integers is float division: inf, -inf, nan.
        assert_exact(&a.div(0)?, DType::F32, &[3], &[INF, -INF, NAN]);
        // Floats never raise.
        let f = t([1.0f32, -1.0, 0.0], dev);
        assert_exact(&f.floor_divide(0.0)?, DType::F32, &[3], &[INF, -INF, NAN]);
        assert_exact(&f.remainder(0.0)?, DType::F32, &[3], &[NAN, NAN, NAN]);
        assert_exact(&f.fmod(0.0)?, DType::F32, &[3], &[NAN, NAN, NAN]);
        Ok(())
    });
}

#[test]
fn float_division_family() {
    on_devices(|dev| {
        let a = t([7.5f32, -7.5, 7.5, -7.5], dev);
        let b = t([2.0f32, 2.0, -2.0, -2.0], dev);
        assert_exact(&a.floor_divide(&b)?, DType::F32, &[4], &[3.0, -4.0, -4.0, 3.0]);
        assert_exact(&a.div_trunc(&b)?, DType::F32, &[4], &[3.0, -3.0, -3.0, 3.0]);
        assert_exact(&a.remainder(&b)?, DType::F32, &[4], &[1.5, 0.5, -0.5, -1.5]);
        assert_exact(&a.fmod(&b)?, DType::F32, &[4], &[1.5, -1.5, 1.5, -1.5]);
        assert_exact(&a.div(&b)?, DType::F32, &[4], &[3.75, -3.75, -3.75, 3.75]);
        Ok(())
    });
}

#[test]
fn rounding_and_sign() {
    on_devices(|dev| {
        let x = t([0.5f32, 1.5, 2.5, -0.5, -2.5, 2.4, -0.0, 3.7], dev);
        assert_exact(&x.round()?, DType::F32, &[8], &[0.0, 2.0, 2.0, -0.0, -2.0, 2.0, -0.0, 4.0]);
        let y = t([-1.5f32, 1.5, -0.2], dev);
        assert_exact(&y.floor()?, DType::F32, &[3], &[-2.0, 1.0, -1.0]);
        assert_exact(&y.ceil()?, DType::F32, &[3], &[-1.0, 2.0, -0.0]);
        assert_exact(&y.trunc()?, DType::F32, &[3], &[-1.0, 1.0, -0.0]);
        assert_exact(&t([3i64, -2], dev).round()?, DType::I64, &[2], &[3.0, -2.0]);
        assert_exact(&t([-3i32, 0, 5], dev).sign()?, DType::I32, &[3], &[-1.0, 0.0, 1.0]);
        assert_exact(&t([-3.5f32, 0.0, 2.5], dev).sign()?, DType::F32, &[3], &[-1.0, 0.0, 1.0]);
        assert_exact(&t([-3i32, 4], dev).abs()?, DType::I32, &[2], &[3.0, 4.0]);
        assert_exact(&t([-0.0f32, -2.5], dev).abs()?, DType::F32, &[2], &[0.0, 2.5]);
        assert_exact(&t([1i64, -2], dev).neg()?, DType::I64, &[2], &[-1.0, 2.0]);
        let n = t([1.0f32, f32::NAN, f32::INFINITY, f32::NEG_INFINITY], dev);
        assert_exact(&n.isnan()?, DType::Bool, &[4], &[0.0, 1.0, 0.0, 0.0]);
        assert_exact(&n.isinf()?, DType::Bool, &[4], &[0.0, 0.0, 1.0, 1.0]);
        assert_exact(&t([1i64], dev).isnan()?, DType::Bool, &[1], &[0.0]);
        Ok(())
    });
}

#[test]
fn maximum_minimum_and_nan() {
    on_devices(|dev| {
        let a = t([1.0f32, f32::NAN, 3.0, f32::NAN], dev);
        let b = t([2.0f32, 2.0, f32::NAN, f32::NAN], dev);
        assert_exact(&a.maximum(&b)?, DType::F32, &[4], &[2.0, NAN, NAN, NAN]);
        assert_exact(&a.minimum(&b)?, DType::F32, &[4], &[1.0, NAN, NAN, NAN]);
        assert_exact(&a.fmax(&b)?, DType::F32, &[4], &[2.0, 2.0, 3.0, NAN]);
        assert_exact(&a.fmin(&b)?, DType::F32, &[4], &[1.0, 2.0, 3.0, NAN]);
        let m = t([1i32, 5], dev).maximum(&t([2.5f32], dev))?;
        assert_exact(&m, DType::F32, &[2], &[2.5, 5.0]);
        assert_exact(&t([3i64, -3], dev).minimum(&t([0i64], dev))?, DType::I64, &[2], &[0.0, -3.0]);
        let at = t([1.0f32, -1.0], dev).atan2(&t([0.0f32, 0.0], dev))?;
        assert_close(&at, DType::F32, &[2], &[std::f64::consts::FRAC_PI_2, -std::f64::consts::FRAC_PI_2], 1e-6);
        assert!(f64s(&a.maximum(&b)?)[1].is_nan());
        Ok(())
    });
}

#[test]
fn bool_arithmetic_that_pytorch_refuses() {
    on_devices(|dev| {
        let b = t([true, false], dev);
        assert_err(b.neg(), &["neg", "negation, the `-` operator, on a bool tensor is not supported"]);
        assert_err(b.sub(&b), &["sub", "the `-` operator, with two bool tensors is not supported"]);
        Ok(())
    });
}

#[test]
fn bitwise_ops_and_shifts() {
    on_devices(|dev| {
        let x = t([12i64, 10, -1, 7], dev);
        assert_exact(&x.bitwise_and(6i64)?, DType::I64, &[4], &[4.0, 2.0, 6.0, 6.0]);
        assert_exact(&x.bitwise_or(3i64)?, DType::I64, &[4], &[15.0, 11.0, -1.0, 7.0]);
        assert_exact(&x.bitwise_xor(&t([5i64, 5, 5, 5], dev))?, DType::I64, &[4], &[9.0, 15.0, -6.0, 2.0]);
        // Shifts by a negative amount or by the width or more follow PyTorch:
        // left gives 0, right gives the shift by width - 1.
        let v = t([1i64, -8, 5, -8, 3, -3], dev);
        let by = t([3i64, 1, 64, 70, -1, -1], dev);
        assert_exact(&v.bitwise_left_shift(&by)?, DType::I64, &[6], &[8.0, -16.0, 0.0, 0.0, 0.0, 0.0]);
        assert_exact(&v.bitwise_right_shift(&by)?, DType::I64, &[6], &[0.0, -4.0, 0.0, -1.0, 0.0, -1.0]);
        // uint8 shifts right logically and wraps left; narrower signed types keep their width.
        let u = t([200u8, 255, 1], dev);
        assert_exact(&u.bitwise_right_shift(1i64)?, DType::U8, &[3], &[100.0, 127.0, 0.0]);
        assert_exact(&u.bitwise_left_shift(1i64)?, DType::U8, &[3], &[144.0, 254.0, 2.0]);
        let i = t([1i32, -2147483648, 6], dev);
        assert_exact(&i.bitwise_left_shift(31i64)?, DType::I32, &[3], &[-2147483648.0, 0.0, 0.0]);
        assert_exact(&i.bitwise_right_shift(31i64)?, DType::I32, &[3], &[0.0, -1.0, 0.0]);
        // Broadcasting, strided operands, bool and promotion with a Python int.
        let m = t([[1i64, 2], [4, 8]], dev);
        assert_exact(&m.t()?.bitwise_or(&t([16i64, 32], dev))?, DType::I64, &[2, 2], &[17.0, 36.0, 18.0, 40.0]);
        let b = t([true, false, true], dev);
        assert_exact(&b.bitwise_and(&t([true, true, false], dev))?, DType::Bool, &[3], &[1.0, 0.0, 0.0]);
        assert_exact(&b.bitwise_xor(&t([true, true, false], dev))?, DType::Bool, &[3], &[0.0, 1.0, 1.0]);
        assert_exact(&b.bitwise_or(2i64)?, DType::I64, &[3], &[3.0, 2.0, 3.0]);
        assert_err(t([1.0f32], dev).bitwise_and(1i64), &["bitwise_and", "not implemented for dtype float32"]);
        assert_err(b.bitwise_left_shift(&b), &["bitwise_left_shift", "not implemented for dtype bool"]);
        Ok(())
    });
}
