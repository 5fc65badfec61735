//! Reductions over dims with keepdim: sum/mean/prod, max/min with indices,
//! amax/amin, argmax/argmin (first index on ties, NaN as the extreme), var/std,
//! logsumexp, all/any, count_nonzero; result dtypes and the errors.
use crate::common::{assert_close, assert_err, assert_exact};
use crate::{iota, on_devices, t};
use kiln::prelude::*;

const NAN: f64 = f64::NAN;
const INF: f64 = f64::INFINITY;

#[test]
fn sum_over_dims() {
    on_devices(|dev| {
        let x = iota(&[2, 3, 4], dev); // x[i, j, k] = 12i + 4j + k
        assert_exact(&x.sum()?, DType::F32, &[], &[276.0]);
        let want = [12.0, 15.0, 18.0, 21.0, 48.0, 51.0, 54.0, 57.0];
        assert_exact(&x.sum_dim(1, false)?, DType::F32, &[2, 4], &want);
        assert_exact(&x.sum_dim(1, true)?, DType::F32, &[2, 1, 4], &want);
        assert_exact(&x.sum_dim([0, 2], true)?, DType::F32, &[1, 3, 1], &[60.0, 92.0, 124.0]);
        assert_exact(&x.sum_dim([-1, 0], false)?, DType::F32, &[3], &[60.0, 92.0, 124.0]);
        assert_exact(&x.sum_dim(-1, false)?, DType::F32, &[2, 3], &[6.0, 22.0, 38.0, 54.0, 70.0, 86.0]);
        assert_exact(&x.sum_dim(Vec::<isize>::new(), false)?, DType::F32, &[], &[276.0]);
        // A strided input.
        assert_exact(&x.transpose(0, 2)?.sum_dim(0, false)?, DType::F32, &[3, 2], &[6.0, 54.0, 22.0, 70.0, 38.0, 86.0]);
        // 0-d and empty inputs.
        assert_exact(&t(5.0f32, dev).sum_dim(0, false)?, DType::F32, &[], &[5.0]);
        assert_exact(&t(5.0f32, dev).sum_dim(-1, true)?, DType::F32, &[], &[5.0]);
        assert_exact(&Tensor::zeros(&[0, 3], (DType::F32, dev))?.sum_dim(0, false)?, DType::F32, &[3], &[0.0; 3]);
        assert_exact(&Tensor::zeros(&[0], (DType::F32, dev))?.sum()?, DType::F32, &[], &[0.0]);
        Ok(())
    });
}

#[test]
fn sum_dtypes() {
    on_devices(|dev| {
        assert_exact(&t([200u8, 100], dev).sum()?, DType::I64, &[], &[300.0]);
        assert_exact(&t([[1i32, 2], [3, 4]], dev).sum_dim(0, false)?, DType::I64, &[2], &[4.0, 6.0]);
        assert_exact(&t([true, true, false], dev).sum()?, DType::I64, &[], &[2.0]);
        assert_exact(&t([-100i8, -100], dev).sum()?, DType::I64, &[], &[-200.0]);
        assert_eq!(t([i64::MAX - 1, 1], dev).sum()?.item::<i64>()?, i64::MAX, "int64 sums are exact");
        let h = t([1.5f32, 2.0], dev).to_dtype(DType::F16)?;
        assert_exact(&h.sum()?, DType::F16, &[], &[3.5]);
        let b = t([1.5f32, 2.0], dev).to_dtype(DType::BF16)?;
        assert_exact(&b.sum()?, DType::BF16, &[], &[3.5]);
        assert_exact(&t([0.1f64, 0.2], dev).sum()?, DType::F64, &[], &[0.1 + 0.2]);
        Ok(())
    });
}

#[test]
fn mean_and_prod() {
    on_devices(|dev| {
        let x = iota(&[2, 3], dev);
        assert_exact(&x.mean()?, DType::F32, &[], &[2.5]);
        assert_exact(&x.mean_dim(0, false)?, DType::F32, &[3], &[1.5, 2.5, 3.5]);
        assert_exact(&x.mean_dim(-1, true)?, DType::F32, &[2, 1], &[1.0, 4.0]);
        assert_exact(&x.mean_dim([0, 1], false)?, DType::F32, &[], &[2.5]);
        assert!(Tensor::zeros(&[0], (DType::F32, dev))?.mean()?.item::<f32>()?.is_nan(), "mean of nothing is NaN");
        assert_err(t([1i64, 2], dev).mean(), &["mean", "could not infer output dtype"]);
        let p = t([1.0f32, 2.0, 3.0, 4.0], dev);
        assert_exact(&p.prod()?, DType::F32, &[], &[24.0]);
        assert_exact(&p.reshape(&[2, 2])?.prod_dim(1, false)?, DType::F32, &[2], &[2.0, 12.0]);
        assert_exact(&t([2i32, -3], dev).prod()?, DType::I64, &[], &[-6.0]);
        assert_exact(&Tensor::zeros(&[0], (DType::F32, dev))?.prod()?, DType::F32, &[], &[1.0]);
        Ok(())
    });
}

#[test]
fn max_min_with_indices() {
    on_devices(|dev| {
        let x = t([[1.0f32, 3.0, 3.0], [2.0, 2.0, 1.0]], dev);
        assert_exact(&x.max()?, DType::F32, &[], &[3.0]);
        assert_exact(&x.min()?, DType::F32, &[], &[1.0]);
        let (v, i) = x.max_dim(1, false)?;
        assert_exact(&v, DType::F32, &[2], &[3.0, 2.0]);
        assert_exact(&i, DType::I64, &[2], &[1.0, 0.0]);
        let (v, i) = x.min_dim(0, true)?;
        assert_exact(&v, DType::F32, &[1, 3], &[1.0, 2.0, 1.0]);
        assert_exact(&i, DType::I64, &[1, 3], &[0.0, 1.0, 1.0]);
        let (v, i) = x.max_dim(-1, true)?;
        assert_eq!((v.shape(), i.shape()), (&[2, 1][..], &[2, 1][..]));
        // NaN propagates and counts as the extreme.
        let n = t([[1.0f32, f32::NAN, 5.0], [0.0, -1.0, -2.0]], dev);
        assert_exact(&n.max()?, DType::F32, &[], &[NAN]);
        let (v, i) = n.max_dim(1, false)?;
        assert_exact(&v, DType::F32, &[2], &[NAN, 0.0]);
        assert_exact(&i, DType::I64, &[2], &[1.0, 0.0]);
        let (v, i) = n.min_dim(1, false)?;
        assert_exact(&v, DType::F32, &[2], &[NAN, -2.0]);
        assert_exact(&i, DType::I64, &[2], &[1.0, 2.0]);
        // Integers keep their dtype.
        assert_exact(&t([3i32, -7, 5], dev).min()?, DType::I32, &[], &[-7.0]);
        assert_exact(&t([true, false], dev).max()?, DType::Bool, &[], &[1.0]);
        let x = iota(&[2, 3, 4], dev);
        assert_exact(&x.amax([0, 2], false)?, DType::F32, &[3], &[15.0, 19.0, 23.0]);
        assert_exact(&x.amin(-1, true)?, DType::F32, &[2, 3, 1], &[0.0, 4.0, 8.0, 12.0, 16.0, 20.0]);
        assert_err(Tensor::zeros(&[0], (DType::F32, dev))?.max(), &["max"]);
        assert_err(Tensor::zeros(&[2, 0], (DType::F32, dev))?.max_dim(1, false), &["max", "non-zero size"]);
        Ok(())
    });
}

#[test]
fn argmax_argmin() {
    on_devices(|dev| {
        let x = t([[1.0f32, 7.0, 7.0], [9.0, 2.0, 9.0]], dev);
        assert_exact(&x.argmax(None, false)?, DType::I64, &[], &[3.0]);
        assert_exact(&x.argmax(None, true)?, DType::I64, &[1, 1], &[3.0]);
        assert_exact(&x.argmax(Some(1), false)?, DType::I64, &[2], &[1.0, 0.0]);
        assert_exact(&x.argmax(Some(-1), true)?, DType::I64, &[2, 1], &[1.0, 0.0]);
        assert_exact(&x.argmax(Some(0), false)?, DType::I64, &[3], &[1.0, 0.0, 1.0]);
        assert_exact(&x.argmin(None, false)?, DType::I64, &[], &[0.0]);
        assert_exact(&x.argmin(Some(1), false)?, DType::I64, &[2], &[0.0, 1.0]);
        // NaN is both the maximum and the minimum: its first index wins.
        let n = t([3.0f32, f32::NAN, 5.0, f32::NAN], dev);
        assert_exact(&n.argmax(None, false)?, DType::I64, &[], &[1.0]);
        assert_exact(&n.argmin(Some(0), false)?, DType::I64, &[], &[1.0]);
        // A strided input and an integer one.
        assert_exact(&x.t()?.argmax(Some(1), false)?, DType::I64, &[3], &[1.0, 0.0, 1.0]);
        assert_exact(&t([5i64, -1, 5], dev).argmax(None, false)?, DType::I64, &[], &[0.0]);
        assert_exact(&t(4.0f32, dev).argmax(Some(0), false)?, DType::I64, &[], &[0.0]);
        assert_err(Tensor::zeros(&[0], (DType::F32, dev))?.argmax(None, false), &["argmax"]);
        assert_err(
            x.argmax(Some(2), false),
            &["argmax", "dimension out of range (expected to be in range of [-2, 1], but got 2)"],
        );
        Ok(())
    });
}

#[test]
fn var_std() {
    on_devices(|dev| {
        let x = t([[1.0f32, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0]], dev);
        assert_close(&x.var(-1, 1, false)?, DType::F32, &[2], &[5.0 / 3.0, 20.0 / 3.0], 1e-6);
        assert_close(&x.var(-1, 0, true)?, DType::F32, &[2, 1], &[1.25, 5.0], 1e-6);
        assert_close(&x.var(0, 1, false)?, DType::F32, &[4], &[0.5, 2.0, 4.5, 8.0], 1e-6);
        let vals = [1.0f64, 2.0, 3.0, 4.0, 2.0, 4.0, 6.0, 8.0];
        let mean = vals.iter().sum::<f64>() / 8.0;
        let ss: f64 = vals.iter().map(|v| (v - mean).powi(2)).sum();
        assert_close(&x.var_all(1)?, DType::F32, &[], &[ss / 7.0], 1e-6);
        assert_close(&x.std_all(1)?, DType::F32, &[], &[(ss / 7.0).sqrt()], 1e-6);
        assert_close(&x.std_all(0)?, DType::F32, &[], &[(ss / 8.0).sqrt()], 1e-6);
        assert_close(&x.std(1, 1, false)?, DType::F32, &[2], &[(5.0f64 / 3.0).sqrt(), (20.0f64 / 3.0).sqrt()], 1e-6);
        // Too few elements for the correction: 0/0 and x/0, like PyTorch.
        assert_exact(&t([1.0f32], dev).var_all(1)?, DType::F32, &[], &[NAN]);
        assert_exact(&t([1.0f32, 2.0], dev).var_all(2)?, DType::F32, &[], &[INF]);
        // Large offsets do not destroy precision (two-pass, not E[x^2] - E[x]^2).
        let big = t([1e4f32 + 1.0, 1e4 + 2.0, 1e4 + 3.0], dev);
        assert_close(&big.var_all(1)?, DType::F32, &[], &[1.0], 1e-5);
        let h = x.to_dtype(DType::BF16)?;
        assert_eq!(h.var(-1, 1, false)?.dtype(), DType::BF16);
        assert_err(t([1i64, 2], dev).var_all(1), &["var"]);
        Ok(())
    });
}

#[test]
fn logsumexp_is_stable() {
    on_devices(|dev| {
        let x = t([[0.0f32, 0.0], [1000.0, 1000.0], [f32::NEG_INFINITY, f32::NEG_INFINITY], [f32::INFINITY, 0.0]], dev);
        let ln2 = 2f64.ln();
        assert_close(&x.logsumexp(-1, false)?, DType::F32, &[4], &[ln2, 1000.0 + ln2, -INF, INF], 1e-6);
        assert_close(&x.logsumexp(1, true)?, DType::F32, &[4, 1], &[ln2, 1000.0 + ln2, -INF, INF], 1e-6);
        let y = t([[-1000.0f32, 0.0], [-2e4, -2e4]], dev);
        assert_close(&y.logsumexp(1, false)?, DType::F32, &[2], &[0.0, -2e4 + ln2], 1e-6);
        assert_close(&iota(&[2, 2], dev).logsumexp([0, 1], false)?, DType::F32, &[], &[3.440_189_698_561_196], 1e-6);
        assert_eq!(t([1i64, 2], dev).logsumexp(0, false)?.dtype(), DType::F32);
        Ok(())
    });
}

#[test]
fn all_any_count_nonzero() {
    on_devices(|dev| {
        let b = t([[true, false], [true, true]], dev);
        assert_exact(&b.all()?, DType::Bool, &[], &[0.0]);
        assert_exact(&b.any()?, DType::Bool, &[], &[1.0]);
        assert_exact(&b.all_dim(1, false)?, DType::Bool, &[2], &[0.0, 1.0]);
        assert_exact(&b.any_dim(0, true)?, DType::Bool, &[1, 2], &[1.0, 1.0]);
        let f = t([0.0f32, f32::NAN, -0.0], dev);
        assert_exact(&f.any()?, DType::Bool, &[], &[1.0]);
        assert_exact(&f.all()?, DType::Bool, &[], &[0.0]);
        let empty = Tensor::zeros(&[0], (DType::Bool, dev))?;
        assert_exact(&empty.all()?, DType::Bool, &[], &[1.0]);
        assert_exact(&empty.any()?, DType::Bool, &[], &[0.0]);
        assert_exact(&t([3u8, 0], dev).all()?, DType::U8, &[], &[0.0]);
        let x = t([[0.0f32, 1.0, 2.0], [0.0, 0.0, 3.0]], dev);
        assert_exact(&x.count_nonzero()?, DType::I64, &[], &[3.0]);
        assert_exact(&x.count_nonzero_dim(0)?, DType::I64, &[3], &[0.0, 1.0, 2.0]);
        Ok(())
    });
}

#[test]
fn reduction_dim_errors() {
    on_devices(|dev| {
        let x = iota(&[2, 3], dev);
        assert_err(
            x.sum_dim(2, false),
            &["sum", "dimension out of range (expected to be in range of [-2, 1], but got 2)"],
        );
        assert_err(x.sum_dim(-3, false), &["sum", "but got -3"]);
        assert_err(x.mean_dim([1, -1], false), &["mean", "dim 1 appears multiple times in the list of dims"]);
        assert_err(x.amax(5, false), &["amax", "but got 5"]);
        assert_err(x.max_dim(2, false), &["max", "but got 2"]);
        assert_err(t(1.0f32, dev).sum_dim(1, false), &["sum", "expected to be in range of [-1, 0], but got 1"]);
        Ok(())
    });
}
