//! Linear algebra against PyTorch: `matmul`'s rules (1-D operands, batch
//! broadcasting, folding, strided inputs), `mm`, `bmm`, `dot`, `outer`, `linear`,
//! and the error messages for bad shapes and dtypes.
mod common;

use common::*;
use kiln::prelude::*;

fn arange(n: usize, shape: &[isize]) -> Tensor {
    Tensor::arange(0.0, n as f64, 1.0, DType::F32).unwrap().reshape(shape).unwrap()
}

#[test]
fn matrix_times_matrix() -> Result<()> {
    common::on_every_device(|| {
        let a = Tensor::new([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]])?;
        let b = Tensor::new([[1.0f32, -1.0], [0.5, 2.0], [0.0, 1.0]])?;
        let want = [2.0, 6.0, 6.5, 12.0];
        assert_exact(&a.matmul(&b)?, DType::F32, &[2, 2], &want);
        assert_exact(&a.mm(&b)?, DType::F32, &[2, 2], &want);
        // Transposed (strided) operands.
        let bt = b.t()?.contiguous()?.t()?;
        assert!(!bt.is_contiguous());
        assert_exact(&a.matmul(&bt)?, DType::F32, &[2, 2], &want);
        assert_exact(&b.t()?.matmul(&a.t()?)?, DType::F32, &[2, 2], &[2.0, 6.5, 6.0, 12.0]);
        // float64 and int64.
        assert_exact(&a.to_dtype(DType::F64)?.matmul(&b.to_dtype(DType::F64)?)?, DType::F64, &[2, 2], &want);
        let ai = Tensor::arange(0.0, 6.0, 1.0, DType::I64)?.reshape(&[2, 3])?;
        let bi = Tensor::arange(0.0, 6.0, 1.0, DType::I64)?.reshape(&[3, 2])?;
        assert_exact(&ai.matmul(&bi)?, DType::I64, &[2, 2], &[10.0, 13.0, 28.0, 40.0]);
        Ok(())
    })
}

#[test]
fn one_dimensional_operands() -> Result<()> {
    common::on_every_device(|| {
        let v = Tensor::new([1.0f32, -2.0, 0.5])?;
        let w = Tensor::new([4.0f32, 1.0, 2.0])?;
        // 1-D @ 1-D: a 0-d dot product.
        assert_exact(&v.matmul(&w)?, DType::F32, &[], &[3.0]);
        assert_exact(&v.dot(&w)?, DType::F32, &[], &[3.0]);
        let m = arange(6, &[2, 3]);
        // 2-D @ 1-D -> [2]; 1-D @ 2-D -> [3].
        assert_exact(&m.matmul(&v)?, DType::F32, &[2], &[-1.0, -2.5]);
        assert_exact(&Tensor::new([1.0f32, 1.0])?.matmul(&m)?, DType::F32, &[3], &[3.0, 5.0, 7.0]);
        // 1-D @ 3-D: the prepended dim broadcasts over the batch and is removed.
        let b = arange(18, &[3, 3, 2]).mul(0.5)?;
        assert_exact(&v.matmul(&b)?, DType::F32, &[3, 2], &[-1.0, -1.25, -2.5, -2.75, -4.0, -4.25]);
        // 3-D @ 1-D.
        let m3 = arange(12, &[2, 2, 3]);
        assert_exact(&m3.matmul(&v)?, DType::F32, &[2, 2], &[-1.0, -2.5, -4.0, -5.5]);
        // Results are fresh tensors, never views of a temporary (PyTorch's `_base` is None).
        for r in [v.matmul(&w)?, m.matmul(&v)?, v.matmul(&b)?, m3.matmul(&v)?, m3.matmul(&m3.transpose(1, 2)?)?] {
            assert!(!r.is_view() && r.is_contiguous());
        }
        Ok(())
    })
}

#[test]
fn batch_dims_broadcast() -> Result<()> {
    common::on_every_device(|| {
        let a = arange(12, &[2, 1, 2, 3]).sub(5.0)?;
        let b = arange(18, &[3, 3, 2]).mul(0.5)?;
        let want = [
            -10.0, -16.0, -1.0, -2.5, -46.0, -52.0, -10.0, -11.5, -82.0, -88.0, -19.0, -20.5, 8.0, 11.0, 17.0, 24.5,
            26.0, 29.0, 62.0, 69.5, 44.0, 47.0, 107.0, 114.5,
        ];
        assert_exact(&a.matmul(&b)?, DType::F32, &[2, 3, 2, 2], &want);
        // Expanded (stride-0) operands give the same result as materialised ones.
        let ae = a.expand(&[2, 3, 2, 3])?;
        let be = b.expand(&[2, 3, 3, 2])?;
        assert_exact(&ae.matmul(&be)?, DType::F32, &[2, 3, 2, 2], &want);
        assert_exact(&ae.contiguous()?.matmul(&be.contiguous()?)?, DType::F32, &[2, 3, 2, 2], &want);
        // The inputs are left alone.
        assert_eq!(a.shape(), &[2, 1, 2, 3]);
        Ok(())
    })
}

#[test]
fn batch_times_matrix() -> Result<()> {
    common::on_every_device(|| {
        let w = arange(8, &[4, 2]).sub(3.0)?;
        let a = arange(24, &[2, 3, 4]).sub(10.0)?;
        assert_exact(
            &a.matmul(&w)?,
            DType::F32,
            &[2, 3, 2],
            &[10.0, -24.0, 10.0, -8.0, 10.0, 8.0, 10.0, 24.0, 10.0, 40.0, 10.0, 56.0],
        );
        // Batch dims that a view could not merge into the rows.
        let at = arange(24, &[3, 2, 4]).transpose(0, 1)?;
        assert_exact(
            &at.matmul(&w)?,
            DType::F32,
            &[2, 3, 2],
            &[10.0, 16.0, 10.0, 48.0, 10.0, 80.0, 10.0, 32.0, 10.0, 64.0, 10.0, 96.0],
        );
        // Both operands batched with equal batch dims (bmm) and more batch dims.
        let x = arange(24, &[2, 3, 4]);
        let y = arange(16, &[2, 4, 2]);
        let z = x.bmm(&y)?;
        assert_eq!(z.shape(), &[2, 3, 2]);
        assert_exact(&z.i(0)?, DType::F32, &[3, 2], &[28.0, 34.0, 76.0, 98.0, 124.0, 162.0]);
        let x4 = x.reshape(&[1, 2, 3, 4])?.expand(&[2, 2, 3, 4])?;
        let y4 = y.reshape(&[2, 1, 4, 2])?;
        let z4 = x4.matmul(&y4)?;
        assert_eq!(z4.shape(), &[2, 2, 3, 2]);
        assert_exact(&z4.i((0, 0))?, DType::F32, &[3, 2], &[28.0, 34.0, 76.0, 98.0, 124.0, 162.0]);
        assert_exact(&z4.i((1, 1))?, DType::F32, &[3, 2], &f64s(&z.i(1)?));
        Ok(())
    })
}

#[test]
fn half_precision_and_empty() -> Result<()> {
    common::on_every_device(|| {
        let a = arange(6, &[2, 3]).div(7.0)?.to_dtype(DType::BF16)?;
        let b = arange(6, &[3, 2]).div(3.0)?.to_dtype(DType::BF16)?;
        assert_close(&a.matmul(&b)?, DType::BF16, &[2, 2], &[0.4765625, 0.6171875, 1.3359375, 1.90625], 1e-2);
        // k = 0: a sum over nothing.
        let e = Tensor::zeros(&[2, 0], DType::F32)?.matmul(&Tensor::zeros(&[0, 3], DType::F32)?)?;
        assert_exact(&e, DType::F32, &[2, 3], &[0.0; 6]);
        let e = Tensor::zeros(&[0, 4], DType::F32)?.matmul(&Tensor::zeros(&[4, 3], DType::F32)?)?;
        assert_exact(&e, DType::F32, &[0, 3], &[]);
        Ok(())
    })
}

#[test]
fn matmul_errors() -> Result<()> {
    common::on_every_device(|| {
        let f = Tensor::zeros(&[2, 3], DType::F32)?;
        let d = Tensor::zeros(&[3, 5], DType::F64)?;
        assert_err(f.matmul(&d), &["matmul", "expected m1 and m2 to have the same dtype, but got: float32 != float64"]);
        assert_err(
            Tensor::zeros(&[4], DType::F32)?.matmul(&Tensor::scalar(5.0, DType::F32)?),
            &["both arguments to matmul need to be at least 1D, but they are 1D and 0D"],
        );
        assert_err(
            f.matmul(&Tensor::zeros(&[4, 5], DType::F32)?),
            &["mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"],
        );
        assert_err(
            Tensor::zeros(&[4], DType::F32)?.matmul(&Tensor::zeros(&[5], DType::F32)?),
            &["inconsistent tensor size, expected tensor [4] and src [5] to have the same number of elements, but got 4 and 5 elements respectively"],
        );
        assert_err(
            Tensor::zeros(&[3, 4], DType::F32)?.matmul(&Tensor::zeros(&[5], DType::F32)?),
            &["size mismatch, got input (3), mat (3x4), vec (5)"],
        );
        assert_err(
            Tensor::zeros(&[2, 3, 4], DType::F32)?.matmul(&Tensor::zeros(&[2, 5, 6], DType::F32)?),
            &["matmul", "[2, 3, 4]", "[2, 5, 6]"],
        );
        assert_err(
            Tensor::zeros(&[2, 3, 4], DType::F32)?.matmul(&Tensor::zeros(&[3, 4, 6], DType::F32)?),
            &["matmul", "must match"],
        );
        assert_err(Tensor::new([true])?.matmul(&Tensor::new([true])?), &["matmul", "bool"]);
        Ok(())
    })
}

#[test]
fn mm_and_bmm_are_strict() -> Result<()> {
    common::on_every_device(|| {
        let v = Tensor::zeros(&[3], DType::F32)?;
        let m = Tensor::zeros(&[3, 3], DType::F32)?;
        assert_err(v.mm(&m), &["mm: self must be a matrix, got 1-D tensor"]);
        assert_err(m.mm(&v), &["mm: mat2 must be a matrix, got 1-D tensor"]);
        assert_err(
            Tensor::zeros(&[2, 3], DType::F32)?.mm(&Tensor::zeros(&[4, 5], DType::F32)?),
            &["mm: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"],
        );
        assert_err(m.mm(&m.to_dtype(DType::F64)?), &["mm", "float32 != float64"]);
        let b = Tensor::zeros(&[2, 3, 4], DType::F32)?;
        assert_err(m.bmm(&b), &["bmm: batch1 must be a 3D tensor"]);
        assert_err(b.bmm(&m), &["bmm: batch2 must be a 3D tensor"]);
        assert_err(
            b.bmm(&Tensor::zeros(&[3, 4, 5], DType::F32)?),
            &["Expected size for first two dimensions of batch2 tensor to be: [2, 4] but got: [3, 4]."],
        );
        assert_err(
            b.bmm(&Tensor::zeros(&[2, 5, 5], DType::F32)?),
            &["Expected size for first two dimensions of batch2 tensor to be: [2, 4] but got: [2, 5]."],
        );
        Ok(())
    })
}

#[test]
fn dot_and_outer() -> Result<()> {
    common::on_every_device(|| {
        let a = Tensor::new([1i64, 2, 3])?;
        assert_exact(&a.dot(&a)?, DType::I64, &[], &[14.0]);
        assert_err(
            Tensor::zeros(&[4, 1], DType::F32)?.dot(&Tensor::zeros(&[4], DType::F32)?),
            &["1D tensors expected, but got 2D and 1D tensors"],
        );
        assert_err(
            Tensor::zeros(&[4], DType::F32)?.dot(&Tensor::zeros(&[4], DType::F64)?),
            &["dot", "expected both vectors to have same dtype, but found float32 and float64"],
        );
        assert_err(
            Tensor::zeros(&[4], DType::F32)?.dot(&Tensor::zeros(&[5], DType::F32)?),
            &["inconsistent tensor size"],
        );
        let x = Tensor::new([1.0f32, 2.0])?;
        let y = Tensor::new([1.0f32, 10.0, 100.0])?;
        assert_exact(&x.outer(&y)?, DType::F32, &[2, 3], &[1.0, 10.0, 100.0, 2.0, 20.0, 200.0]);
        // Promotes like mul.
        assert_exact(&a.outer(&x)?, DType::F32, &[3, 2], &[1.0, 2.0, 2.0, 4.0, 3.0, 6.0]);
        assert_err(Tensor::zeros(&[4, 1], DType::F32)?.outer(&x), &["outer: Expected 1-D argument self, but got 2-D"]);
        Ok(())
    })
}

#[test]
fn linear() -> Result<()> {
    common::on_every_device(|| {
        let x = arange(6, &[2, 3]);
        let w = Tensor::new([[1.0f32, 0.0, -1.0], [0.5, 0.5, 0.5]])?;
        let b = Tensor::new([10.0f32, -10.0])?;
        assert_exact(&x.linear(&w, Some(&b))?, DType::F32, &[2, 2], &[8.0, -8.5, 8.0, -4.0]);
        let x3 = arange(12, &[2, 2, 3]);
        assert_exact(&x3.linear(&w, None)?, DType::F32, &[2, 2, 2], &[-2.0, 1.5, -2.0, 6.0, -2.0, 10.5, -2.0, 15.0]);
        // A 1-D weight reduces the last dim.
        assert_exact(&x.linear(&Tensor::new([1.0f32, 2.0, 3.0])?, None)?, DType::F32, &[2], &[8.0, 26.0]);
        assert_err(
            x.linear(&Tensor::zeros(&[2, 4], DType::F32)?, None),
            &["mat1 and mat2 shapes cannot be multiplied (2x3 and 4x2)"],
        );
        Ok(())
    })
}
