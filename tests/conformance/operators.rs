//! The `std::ops` operators: the same results as the methods, for every
//! owned/borrowed combination and scalars on either side, and a panic carrying
//! the method's error message when the operands do not fit.
use crate::common::{assert_exact, assert_panics};
use crate::{iota, on_devices, t};
use kiln::prelude::*;

#[test]
fn arithmetic_operators() {
    on_devices(|dev| {
        let a = t([1.0f32, 2.0, 3.0], dev);
        let b = t([4.0f32, 5.0, 6.0], dev);
        assert_exact(&(&a + &b), DType::F32, &[3], &[5.0, 7.0, 9.0]);
        assert_exact(&(&a - &b), DType::F32, &[3], &[-3.0, -3.0, -3.0]);
        assert_exact(&(&a * &b), DType::F32, &[3], &[4.0, 10.0, 18.0]);
        assert_exact(&(&b / &a), DType::F32, &[3], &[4.0, 2.5, 2.0]);
        assert_exact(&(&b % &a), DType::F32, &[3], &[0.0, 1.0, 0.0]);
        // Owned and borrowed operands.
        assert_exact(&(a.clone() + &b), DType::F32, &[3], &[5.0, 7.0, 9.0]);
        assert_exact(&(&a + b.clone()), DType::F32, &[3], &[5.0, 7.0, 9.0]);
        assert_exact(&(a.clone() * b.clone()), DType::F32, &[3], &[4.0, 10.0, 18.0]);
        // Scalars on the right and on the left.
        assert_exact(&(&a * 2.0), DType::F32, &[3], &[2.0, 4.0, 6.0]);
        assert_exact(&(a.clone() + 1), DType::F32, &[3], &[2.0, 3.0, 4.0]);
        assert_exact(&(&a - 0.5f32), DType::F32, &[3], &[0.5, 1.5, 2.5]);
        assert_exact(&(2.0 * &a), DType::F32, &[3], &[2.0, 4.0, 6.0]);
        assert_exact(&(1.0 - &a), DType::F32, &[3], &[0.0, -1.0, -2.0]);
        assert_exact(&(6.0 / &a), DType::F32, &[3], &[6.0, 3.0, 2.0]);
        assert_exact(&(10i64 - a.clone()), DType::F32, &[3], &[9.0, 8.0, 7.0]);
        // Scalar operands promote like Python numbers.
        let i = t([1i64, 2, 3], dev);
        assert_exact(&(&i * 2.5), DType::F32, &[3], &[2.5, 5.0, 7.5]);
        assert_exact(&(&i * 2), DType::I64, &[3], &[2.0, 4.0, 6.0]);
        assert_exact(&(3 - &i), DType::I64, &[3], &[2.0, 1.0, 0.0]);
        assert_exact(&(1.5 + &i), DType::F32, &[3], &[2.5, 3.5, 4.5]);
        assert_exact(&(&i / 2), DType::F32, &[3], &[0.5, 1.0, 1.5]);
        assert_exact(&(-7i64 % &i), DType::I64, &[3], &[0.0, 1.0, 2.0]);
        let h = t([1.0f32], dev).to_dtype(DType::F16)?;
        assert_exact(&(&h * 3.0), DType::F16, &[1], &[3.0]);
        assert_exact(&(3.0 * &h), DType::F16, &[1], &[3.0]);
        // Broadcasting.
        let col = t([[10.0f32], [20.0]], dev);
        assert_exact(&(&col + &a), DType::F32, &[2, 3], &[11.0, 12.0, 13.0, 21.0, 22.0, 23.0]);
        Ok(())
    });
}

#[test]
fn unary_operators() {
    on_devices(|dev| {
        let a = t([1.0f32, -2.0, 0.0], dev);
        assert_exact(&(-&a), DType::F32, &[3], &[-1.0, 2.0, -0.0]);
        assert_exact(&(-a.clone()), DType::F32, &[3], &[-1.0, 2.0, -0.0]);
        assert_exact(&(-t([3i32], dev)), DType::I32, &[1], &[-3.0]);
        let m = t([true, false], dev);
        assert_exact(&!&m, DType::Bool, &[2], &[0.0, 1.0]);
        assert_exact(&!m.clone(), DType::Bool, &[2], &[0.0, 1.0]);
        let mask = a.gt(0.0)?;
        assert_exact(&!&mask, DType::Bool, &[3], &[0.0, 1.0, 1.0]);
        Ok(())
    });
}

#[test]
fn operators_panic_with_the_error_message() {
    on_devices(|dev| {
        let a = iota(&[2, 3], dev);
        let b = iota(&[4], dev);
        let msg = "the size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1";
        assert_panics(|| &a + &b, &["add", msg]);
        assert_panics(|| &a - &b, &["sub", msg]);
        assert_panics(|| &a * &b, &["mul", msg]);
        assert_panics(|| &a / &b, &["div", msg]);
        assert_panics(|| &a % &b, &["remainder", msg]);
        assert_panics(|| a.clone() + b.clone(), &[msg]);
        let bools = t([true], dev);
        assert_panics(|| -&bools, &["negation, the `-` operator, on a bool tensor is not supported"]);
        assert_panics(|| &bools - &bools, &["the `-` operator, with two bool tensors is not supported"]);
        assert_panics(|| &t([1i64], dev) % 0i64, &["ZeroDivisionError"]);
        Ok(())
    });
}

#[test]
fn operands_on_different_devices() {
    let devs = crate::devices();
    for &x in &devs {
        for &y in &devs {
            if x == y {
                continue;
            }
            let (a, b) = (iota(&[2], x), iota(&[2], y));
            crate::common::assert_err(
                a.add(&b),
                &["expected all tensors to be on the same device, but found at least two devices"],
            );
            assert_panics(|| &a * &b, &["same device"]);
        }
    }
}
