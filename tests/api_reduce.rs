//! Reductions against PyTorch: sum, mean, prod, max/min (with indices), amax,
//! amin, argmax/argmin, var/std, logsumexp, all/any, count_nonzero. Expected
//! values were computed with PyTorch 2.x and pasted in.
mod common;

use common::*;
use kiln::prelude::*;

const INF: f64 = f64::INFINITY;
const NAN: f64 = f64::NAN;

/// `[[1.5, -2, 3.25, 0.5], [4, 0.125, -1, 2], [0, 7, -3.5, 1]]`
fn x34() -> Tensor {
    Tensor::new([[1.5f32, -2.0, 3.25, 0.5], [4.0, 0.125, -1.0, 2.0], [0.0, 7.0, -3.5, 1.0]]).unwrap()
}

// ---- sum, mean, prod ------------------------------------------------------------------

#[test]
fn sum_all_and_over_dims() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        assert_exact(&x.sum()?, DType::F32, &[], &[12.875]);
        assert_exact(&x.sum_dim(0, false)?, DType::F32, &[4], &[5.5, 5.125, -1.25, 3.5]);
        assert_exact(&x.sum_dim(-1, false)?, DType::F32, &[3], &[3.25, 5.125, 4.5]);
        assert_exact(&x.sum_dim(1, true)?, DType::F32, &[3, 1], &[3.25, 5.125, 4.5]);
        assert_exact(&x.sum_dim([0, 1], false)?, DType::F32, &[], &[12.875]);
        assert_exact(&x.sum_dim([-1, 0], true)?, DType::F32, &[1, 1], &[12.875]);
        assert_exact(&x.sum_dim(vec![1i64], false)?, DType::F32, &[3], &[3.25, 5.125, 4.5]);
        // An empty dim list reduces everything, like PyTorch's `sum(dim=[])`.
        assert_exact(&x.sum_dim(Vec::<i32>::new(), false)?, DType::F32, &[], &[12.875]);
        Ok(())
    })
}

#[test]
fn sum_of_views_and_3d() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::arange(0.0, 24.0, 1.0, DType::F32)?.reshape(&[2, 3, 4])?;
        assert_exact(&x.sum_dim([0, 2], false)?, DType::F32, &[3], &[60.0, 92.0, 124.0]);
        assert_exact(&x.sum_dim(1, true)?.sum_dim(2, false)?, DType::F32, &[2, 1], &[66.0, 210.0]);
        // A transposed (non-contiguous) view.
        let t = x.transpose(0, 2)?; // [4, 3, 2]
        assert_exact(
            &t.sum_dim(-1, false)?,
            DType::F32,
            &[4, 3],
            &[12.0, 20.0, 28.0, 14.0, 22.0, 30.0, 16.0, 24.0, 32.0, 18.0, 26.0, 34.0],
        );
        // A broadcast (stride-0) view.
        let e = Tensor::new([1.0f32, 2.0])?.expand(&[3, 2])?;
        assert_exact(&e.sum_dim(0, false)?, DType::F32, &[2], &[3.0, 6.0]);
        Ok(())
    })
}

#[test]
fn sum_of_ints_and_bools_is_int64() -> Result<()> {
    common::on_every_device(|| {
        let i = Tensor::new([[1i32, 2], [3, 4]])?;
        assert_exact(&i.sum()?, DType::I64, &[], &[10.0]);
        assert_exact(&i.sum_dim(0, false)?, DType::I64, &[2], &[4.0, 6.0]);
        let u = Tensor::new([200u8, 100, 50])?;
        assert_exact(&u.sum()?, DType::I64, &[], &[350.0]);
        let b = Tensor::new([true, false, true])?;
        assert_exact(&b.sum()?, DType::I64, &[], &[2.0]);
        let big = Tensor::new([i64::MAX - 1, 1])?;
        assert_eq!(big.sum()?.item::<i64>()?, i64::MAX);
        Ok(())
    })
}

#[test]
fn sum_of_half_floats_keeps_the_dtype() -> Result<()> {
    common::on_every_device(|| {
        let h = Tensor::new([0.1f32, 0.2, 0.3, 0.4])?.to_dtype(DType::F16)?;
        assert_exact(&h.sum()?, DType::F16, &[], &[1.0]);
        let b = Tensor::new([1.1f32, 2.2, 3.3])?.to_dtype(DType::BF16)?;
        assert_exact(&b.mean()?, DType::BF16, &[], &[2.203125]);
        Ok(())
    })
}

#[test]
fn mean_and_errors_for_ints() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        assert_close(&x.mean()?, DType::F32, &[], &[12.875 / 12.0], 1e-6);
        assert_close(&x.mean_dim(0, false)?, DType::F32, &[4], &[5.5 / 3.0, 5.125 / 3.0, -1.25 / 3.0, 3.5 / 3.0], 1e-6);
        assert_exact(&x.mean_dim(-1, true)?, DType::F32, &[3, 1], &[0.8125, 1.28125, 1.125]);
        let f64x = x.to_dtype(DType::F64)?;
        assert_close(&f64x.mean_dim([0, 1], false)?, DType::F64, &[], &[12.875 / 12.0], 1e-15);
        assert_err(Tensor::new([1i64, 2])?.mean(), &["mean", "floating point", "int64"]);
        assert_err(Tensor::new([true])?.mean_dim(0, false), &["mean", "bool"]);
        Ok(())
    })
}

#[test]
fn prod_over_dims() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        // The last row holds a 0 times negatives: -0.0, as in PyTorch.
        assert_exact(&x.prod_dim(1, false)?, DType::F32, &[3], &[-4.875, -1.0, -0.0]);
        assert_exact(&x.prod_dim(0, true)?, DType::F32, &[1, 4], &[0.0, -1.75, 11.375, 1.0]);
        assert_exact(&Tensor::new([2i32, 3, 4])?.prod()?, DType::I64, &[], &[24.0]);
        assert_exact(&Tensor::new([true, true])?.prod()?, DType::I64, &[], &[1.0]);
        Ok(())
    })
}

// ---- max, min, amax, amin ------------------------------------------------------------

#[test]
fn max_min_of_everything() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        assert_exact(&x.max()?, DType::F32, &[], &[7.0]);
        assert_exact(&x.min()?, DType::F32, &[], &[-3.5]);
        assert_exact(&Tensor::new([3i64, -9, 4])?.max()?, DType::I64, &[], &[4.0]);
        assert_exact(&Tensor::new([true, false])?.max()?, DType::Bool, &[], &[1.0]);
        let n = Tensor::new([1.0f32, NAN as f32, 3.0])?;
        assert_exact(&n.max()?, DType::F32, &[], &[NAN]);
        assert_exact(&n.min()?, DType::F32, &[], &[NAN]);
        assert_err(Tensor::zeros(&[0], DType::F32)?.max(), &["max", "numel() == 0"]);
        assert_err(Tensor::zeros(&[2, 0], DType::F32)?.min(), &["min", "numel() == 0"]);
        Ok(())
    })
}

#[test]
fn max_dim_and_min_dim_with_indices() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        let (v, i) = x.max_dim(1, false)?;
        assert_exact(&v, DType::F32, &[3], &[3.25, 4.0, 7.0]);
        assert_exact(&i, DType::I64, &[3], &[2.0, 0.0, 1.0]);
        let (v, i) = x.min_dim(0, true)?;
        assert_exact(&v, DType::F32, &[1, 4], &[0.0, -2.0, -3.5, 0.5]);
        assert_exact(&i, DType::I64, &[1, 4], &[2.0, 0.0, 2.0, 0.0]);
        let (v, i) = x.max_dim(-2, false)?;
        assert_exact(&v, DType::F32, &[4], &[4.0, 7.0, 3.25, 2.0]);
        assert_exact(&i, DType::I64, &[4], &[1.0, 2.0, 0.0, 1.0]);
        // Ties give the first index; NaN wins and reports its own index.
        let t = Tensor::new([[1.0f32, 5.0, 5.0], [2.0, NAN as f32, 9.0]])?;
        let (v, i) = t.max_dim(1, false)?;
        assert_exact(&v, DType::F32, &[2], &[5.0, NAN]);
        assert_exact(&i, DType::I64, &[2], &[1.0, 1.0]);
        let (v, i) = t.min_dim(1, false)?;
        assert_exact(&v, DType::F32, &[2], &[1.0, NAN]);
        assert_exact(&i, DType::I64, &[2], &[0.0, 1.0]);
        assert_err(x.max_dim(2, false), &["dimension out of range (expected to be in range of [-2, 1], but got 2)"]);
        assert_err(Tensor::zeros(&[0, 3], DType::F32)?.max_dim(0, false), &["max", "non-zero size"]);
        Ok(())
    })
}

#[test]
fn amax_amin_over_several_dims() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::arange(0.0, 24.0, 1.0, DType::F32)?.reshape(&[2, 3, 4])?.remainder(7.0)?;
        // x % 7 = [[0..3], [4,5,6,0], [1..4]], [[5,6,0,1], [2..5], [6,0,1,2]]
        assert_exact(&x.amax([0, 2], false)?, DType::F32, &[3], &[6.0, 6.0, 6.0]);
        assert_exact(&x.amin([0, 2], true)?, DType::F32, &[1, 3, 1], &[0.0, 0.0, 0.0]);
        assert_exact(&x.amax(-1, false)?, DType::F32, &[2, 3], &[3.0, 6.0, 4.0, 6.0, 5.0, 6.0]);
        assert_exact(&x.amin(1, false)?, DType::F32, &[2, 4], &[0.0, 1.0, 2.0, 0.0, 2.0, 0.0, 0.0, 1.0]);
        let n = Tensor::new([[1.0f32, NAN as f32], [3.0, 4.0]])?;
        assert_exact(&n.amax(1, false)?, DType::F32, &[2], &[NAN, 4.0]);
        assert_exact(&n.amin(0, false)?, DType::F32, &[2], &[1.0, NAN]);
        assert_err(x.amax([0, 0], false), &["amax", "dim 0 appears multiple times"]);
        Ok(())
    })
}

#[test]
fn argmax_argmin() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        assert_exact(&x.argmax(None, false)?, DType::I64, &[], &[9.0]);
        assert_exact(&x.argmin(None, false)?, DType::I64, &[], &[10.0]);
        assert_exact(&x.argmax(None, true)?, DType::I64, &[1, 1], &[9.0]);
        assert_exact(&x.argmax(Some(1), false)?, DType::I64, &[3], &[2.0, 0.0, 1.0]);
        assert_exact(&x.argmin(Some(-1), true)?, DType::I64, &[3, 1], &[1.0, 2.0, 2.0]);
        assert_exact(&x.argmax(Some(0), false)?, DType::I64, &[4], &[1.0, 2.0, 0.0, 1.0]);
        let ties = Tensor::new([4i32, 9, 9, 1, 1])?;
        assert_exact(&ties.argmax(None, false)?, DType::I64, &[], &[1.0]);
        assert_exact(&ties.argmin(Some(0), false)?, DType::I64, &[], &[3.0]);
        let n = Tensor::new([1.0f32, NAN as f32, 9.0])?;
        assert_exact(&n.argmax(None, false)?, DType::I64, &[], &[1.0]);
        assert_exact(&n.argmin(None, false)?, DType::I64, &[], &[1.0]);
        assert_err(Tensor::new([true, false])?.argmax(None, false), &["argmax", "bool"]);
        assert_err(Tensor::zeros(&[0], DType::F32)?.argmax(None, false), &["argmax", "non-empty"]);
        Ok(())
    })
}

#[test]
fn zero_dim_reductions() -> Result<()> {
    common::on_every_device(|| {
        let s = Tensor::scalar(2.5f32, DType::F32)?;
        assert_exact(&s.sum()?, DType::F32, &[], &[2.5]);
        assert_exact(&s.sum_dim(0, false)?, DType::F32, &[], &[2.5]);
        assert_exact(&s.sum_dim(-1, true)?, DType::F32, &[], &[2.5]);
        assert_exact(&s.mean_dim(0, true)?, DType::F32, &[], &[2.5]);
        let (v, i) = s.max_dim(0, false)?;
        assert_exact(&v, DType::F32, &[], &[2.5]);
        assert_exact(&i, DType::I64, &[], &[0.0]);
        assert_exact(&s.argmax(Some(0), false)?, DType::I64, &[], &[0.0]);
        assert_exact(&s.argmin(None, false)?, DType::I64, &[], &[0.0]);
        assert_exact(&s.max()?, DType::F32, &[], &[2.5]);
        assert_err(s.sum_dim(1, false), &["dimension out of range (expected to be in range of [-1, 0], but got 1)"]);
        Ok(())
    })
}

#[test]
fn empty_reductions() -> Result<()> {
    common::on_every_device(|| {
        let e = Tensor::zeros(&[0, 3], DType::F32)?;
        assert_exact(&e.sum()?, DType::F32, &[], &[0.0]);
        assert_exact(&e.sum_dim(0, false)?, DType::F32, &[3], &[0.0, 0.0, 0.0]);
        assert_exact(&e.sum_dim(1, false)?, DType::F32, &[0], &[]);
        assert_exact(&e.prod_dim(0, false)?, DType::F32, &[3], &[1.0, 1.0, 1.0]);
        assert_exact(&e.mean()?, DType::F32, &[], &[NAN]);
        assert_exact(&e.amax(1, false)?, DType::F32, &[0], &[]);
        Ok(())
    })
}

// ---- var, std ---------------------------------------------------------------------------

#[test]
fn var_and_std() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        assert_close(&x.var_all(1)?, DType::F32, &[], &[7.864938259124756], 1e-6);
        assert_close(
            &x.var(0, 1, false)?,
            DType::F32,
            &[4],
            &[4.083333492279053, 22.13020896911621, 11.645833015441895, 0.5833333134651184],
            1e-6,
        );
        assert_close(&x.var(1, 0, true)?, DType::F32, &[3, 1], &[3.60546875, 3.6123046875, 14.296875], 1e-6);
        assert_close(&x.std_all(1)?, DType::F32, &[], &[2.8044497966766357], 1e-6);
        assert_close(&x.std([0, 1], 0, false)?, DType::F32, &[], &[2.685056209564209], 1e-6);
        assert_close(
            &x.std(-1, 1, false)?,
            DType::F32,
            &[3],
            &[2.192553758621216, 2.194631338119507, 4.366062164306641],
            1e-6,
        );
        // Too few elements for the correction: NaN (0/0) or inf, as in PyTorch.
        assert_exact(&Tensor::new([2.0f32])?.var_all(1)?, DType::F32, &[], &[NAN]);
        assert_exact(&Tensor::new([1.0f32, 2.0])?.var_all(2)?, DType::F32, &[], &[INF]);
        assert_err(Tensor::new([1i64, 2])?.var_all(1), &["var", "floating point"]);
        assert_err(Tensor::new([1i64, 2])?.std(0, 1, false), &["std", "floating point"]);
        Ok(())
    })
}

#[test]
fn var_of_half_floats_computes_in_f32() -> Result<()> {
    common::on_every_device(|| {
        let xb = x34().to_dtype(DType::BF16)?;
        assert_exact(&xb.var(1, 1, false)?, DType::BF16, &[3], &[4.8125, 4.8125, 19.0]);
        assert_exact(&xb.std_all(1)?, DType::BF16, &[], &[2.796875]);
        Ok(())
    })
}

// ---- logsumexp -------------------------------------------------------------------------

#[test]
fn logsumexp_values() -> Result<()> {
    common::on_every_device(|| {
        let x = x34();
        assert_close(
            &x.logsumexp(1, false)?,
            DType::F32,
            &[3],
            &[3.467487096786499, 4.150854587554932, 7.003412246704102],
            1e-6,
        );
        assert_close(
            &x.logsumexp(0, true)?,
            DType::F32,
            &[1, 4],
            &[4.095674514770508, 7.001155853271484, 3.26531720161438, 2.4643688201904297],
            1e-6,
        );
        assert_close(&x.logsumexp([0, 1], false)?, DType::F32, &[], &[7.086675643920898], 1e-6);
        // Results are fresh tensors, not views of a temporary.
        assert!(!x.logsumexp(1, false)?.is_view());
        assert!(!x.var(1, 1, false)?.is_view());
        assert!(!Tensor::scalar(1.0, DType::F32)?.sum_dim(0, true)?.is_view());
        // Large magnitudes do not overflow.
        let big = Tensor::new([[1000.0f32, 1000.5, 999.0], [-1000.0, -1001.0, -1002.0]])?;
        assert_close(&big.logsumexp(1, false)?, DType::F32, &[2], &[1001.1041259765625, -999.5924072265625], 1e-6);
        // Integers give float32.
        let i = Tensor::new([[1i64, 2], [3, 4]])?;
        assert_close(&i.logsumexp(1, false)?, DType::F32, &[2], &[2.3132617473602295, 4.31326150894165], 1e-6);
        Ok(())
    })
}

#[test]
fn logsumexp_infinities_and_nan() -> Result<()> {
    common::on_every_device(|| {
        let s = Tensor::new([
            [f32::NEG_INFINITY, f32::NEG_INFINITY],
            [f32::INFINITY, 1.0],
            [f32::INFINITY, f32::NEG_INFINITY],
            [f32::NAN, 1.0],
        ])?;
        assert_exact(&s.logsumexp(1, false)?, DType::F32, &[4], &[-INF, INF, INF, NAN]);
        assert_exact(&Tensor::zeros(&[2, 0], DType::F32)?.logsumexp(1, false)?, DType::F32, &[2], &[-INF, -INF]);
        Ok(())
    })
}

// ---- all, any, count_nonzero -----------------------------------------------------------

#[test]
fn all_any() -> Result<()> {
    common::on_every_device(|| {
        let b = Tensor::new([[true, false, true], [true, true, true]])?;
        assert_exact(&b.all()?, DType::Bool, &[], &[0.0]);
        assert_exact(&b.any()?, DType::Bool, &[], &[1.0]);
        assert_exact(&b.all_dim(1, false)?, DType::Bool, &[2], &[0.0, 1.0]);
        assert_exact(&b.all_dim(0, true)?, DType::Bool, &[1, 3], &[1.0, 0.0, 1.0]);
        assert_exact(&b.logical_not()?.any_dim(-1, false)?, DType::Bool, &[2], &[1.0, 0.0]);
        let f = Tensor::new([0.0f32, NAN as f32, 0.0])?;
        assert_exact(&f.any()?, DType::Bool, &[], &[1.0]);
        assert_exact(&f.all()?, DType::Bool, &[], &[0.0]);
        // uint8 in, uint8 out (PyTorch keeps this for compatibility).
        let u = Tensor::new([1u8, 0, 3])?;
        assert_exact(&u.all()?, DType::U8, &[], &[0.0]);
        assert_exact(&u.any()?, DType::U8, &[], &[1.0]);
        // Empty: all is true, any is false.
        let e = Tensor::zeros(&[0], DType::Bool)?;
        assert_exact(&e.all()?, DType::Bool, &[], &[1.0]);
        assert_exact(&e.any()?, DType::Bool, &[], &[0.0]);
        Ok(())
    })
}

#[test]
fn count_nonzero() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::new([[0.0f32, 1.5, 0.0], [2.0, -1.0, 0.0]])?;
        assert_exact(&x.count_nonzero()?, DType::I64, &[], &[3.0]);
        assert_exact(&x.count_nonzero_dim(0)?, DType::I64, &[3], &[1.0, 2.0, 0.0]);
        assert_exact(&x.count_nonzero_dim([0, 1])?, DType::I64, &[], &[3.0]);
        assert_exact(&Tensor::new([true, false, true])?.count_nonzero()?, DType::I64, &[], &[2.0]);
        Ok(())
    })
}
