//! Linear algebra: `matmul`'s rules (1-D operands, batch broadcasting, strided
//! operands), `mm`, `bmm`, `dot`, `outer`, `linear`, dtypes and the errors.
use crate::common::{assert_close, assert_err, assert_exact, f64s};
use crate::{iota, on_devices, t};
use kiln::prelude::*;

/// Reference matmul of row-major `a` [m, k] and `b` [k, n] in f64.
fn reference(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

#[test]
fn matmul_2d_and_1d_operands() {
    on_devices(|dev| {
        let a = iota(&[2, 3], dev);
        let b = iota(&[3, 4], dev).sub(5.0)?;
        let y = a.matmul(&b)?;
        assert_exact(&y, DType::F32, &[2, 4], &reference(&f64s(&a), &f64s(&b), 2, 3, 4));
        let v = t([1.0f32, -1.0, 2.0], dev);
        // [2, 3] @ [3] -> [2]; [3] @ [3, 4] -> [4]; [3] @ [3] -> 0-d.
        assert_exact(&a.matmul(&v)?, DType::F32, &[2], &[3.0, 9.0]);
        assert_exact(&v.matmul(&b)?, DType::F32, &[4], &reference(&f64s(&v), &f64s(&b), 1, 3, 4));
        assert_exact(&v.matmul(&v)?, DType::F32, &[], &[6.0]);
        // [2, 2, 3] @ [3] -> [2, 2]; [3] @ [2, 3, 4] -> [2, 4].
        let batch = iota(&[2, 2, 3], dev);
        assert_exact(&batch.matmul(&v)?, DType::F32, &[2, 2], &[3.0, 9.0, 15.0, 21.0]);
        let b3 = iota(&[2, 3, 4], dev);
        let r = v.matmul(&b3)?;
        assert_eq!(r.shape(), &[2, 4]);
        assert_eq!(f64s(&r)[..4], reference(&f64s(&v), &f64s(&b3)[..12], 1, 3, 4)[..]);
        // Inner dim 0: a zero result of the right shape.
        let e = Tensor::zeros(&[2, 0], (DType::F32, dev))?.matmul(&Tensor::zeros(&[0, 3], (DType::F32, dev))?)?;
        assert_exact(&e, DType::F32, &[2, 3], &[0.0; 6]);
        Ok(())
    });
}

#[test]
fn matmul_batch_broadcasting() {
    on_devices(|dev| {
        let a = iota(&[2, 1, 3, 4], dev);
        let b = iota(&[5, 4, 2], dev).mul(0.5)?;
        let y = a.matmul(&b)?;
        assert_eq!(y.shape(), &[2, 5, 3, 2]);
        let (av, bv, yv) = (f64s(&a), f64s(&b), f64s(&y));
        for i in 0..2 {
            for j in 0..5 {
                let want = reference(&av[i * 12..(i + 1) * 12], &bv[j * 8..(j + 1) * 8], 3, 4, 2);
                let at = (i * 5 + j) * 6;
                assert_eq!(yv[at..at + 6], want[..], "batch ({i}, {j})");
            }
        }
        // A 2-D operand broadcasts against a batch.
        let m = iota(&[4, 2], dev);
        let y = iota(&[3, 2, 4], dev).matmul(&m)?;
        assert_eq!(y.shape(), &[3, 2, 2]);
        assert_eq!(f64s(&y)[..4], reference(&f64s(&iota(&[2, 4], dev)), &f64s(&m), 2, 4, 2)[..]);
        Ok(())
    });
}

#[test]
fn matmul_strided_operands() {
    on_devices(|dev| {
        let a = iota(&[4, 3], dev);
        let b = iota(&[4, 6], dev);
        let at = a.t()?;
        let bs = b.i((.., s(None, None, 2)))?;
        let y = at.matmul(&bs)?;
        let want = reference(&f64s(&at), &f64s(&bs), 3, 4, 3);
        assert_exact(&y, DType::F32, &[3, 3], &want);
        // An expanded (stride-0) operand and a transposed batch.
        let e = t([[1.0f32, 2.0]], dev).expand(&[3, 2])?;
        assert_exact(&e.matmul(&t([[1.0f32], [1.0]], dev))?, DType::F32, &[3, 1], &[3.0, 3.0, 3.0]);
        let bt = iota(&[2, 3, 2], dev).transpose(1, 2)?; // [2, 2, 3]
        let y = bt.matmul(&iota(&[2, 3, 1], dev))?;
        let want: Vec<f64> = (0..2)
            .flat_map(|bi| {
                let m = f64s(&bt.i(bi).unwrap());
                let v = f64s(&iota(&[2, 3, 1], dev).i(bi).unwrap());
                reference(&m, &v, 2, 3, 1)
            })
            .collect();
        assert_exact(&y, DType::F32, &[2, 2, 1], &want);
        Ok(())
    });
}

#[test]
fn matmul_dtypes() {
    on_devices(|dev| {
        let a = t([[1i64, 2], [3, 4]], dev);
        assert_exact(&a.matmul(&a)?, DType::I64, &[2, 2], &[7.0, 10.0, 15.0, 22.0]);
        let a32 = t([[1i32, -2]], dev);
        assert_exact(&a32.matmul(&t([[3i32], [4]], dev))?, DType::I32, &[1, 1], &[-5.0]);
        let d = t([[0.1f64, 0.2]], dev).matmul(&t([[0.3f64], [0.4]], dev))?;
        assert_exact(&d, DType::F64, &[1, 1], &[0.1 * 0.3 + 0.2 * 0.4]);
        // bf16 accumulates in f32 and rounds once: 64 * (1 + 2^-7) = 64.5 is a bf16;
        // a bf16 running sum loses the small part once the sum passes 16.
        let h = Tensor::full(&[1, 64], 1.0078125, (DType::BF16, dev))?;
        let ones = Tensor::ones(&[64, 1], (DType::BF16, dev))?;
        assert_exact(&h.matmul(&ones)?, DType::BF16, &[1, 1], &[64.5]);
        let h = Tensor::full(&[2, 2], 0.5, (DType::F16, dev))?;
        assert_exact(&h.matmul(&h)?, DType::F16, &[2, 2], &[0.5; 4]);
        assert_err(
            t([[1.0f32]], dev).matmul(&t([[1.0f64]], dev)),
            &["matmul", "expected m1 and m2 to have the same dtype, but got: float32 != float64"],
        );
        assert_err(t([[true]], dev).matmul(&t([[true]], dev)), &["matmul", "bool"]);
        Ok(())
    });
}

#[test]
fn mm_bmm_dot_outer_linear() {
    on_devices(|dev| {
        let a = iota(&[2, 3], dev);
        let b = iota(&[3, 2], dev);
        assert_exact(&a.mm(&b)?, DType::F32, &[2, 2], &[10.0, 13.0, 28.0, 40.0]);
        assert_err(a.mm(&a), &["mm", "mat1 and mat2 shapes cannot be multiplied (2x3 and 2x3)"]);
        assert_err(a.mm(&iota(&[3], dev)), &["mm", "mat2 must be a matrix, got 1-D tensor"]);
        let x = iota(&[2, 2, 3], dev);
        let y = iota(&[2, 3, 1], dev);
        let r = x.bmm(&y)?;
        assert_exact(&r, DType::F32, &[2, 2, 1], &[5.0, 14.0, 86.0, 122.0]);
        assert_err(x.bmm(&b), &["bmm", "batch2 must be a 3D tensor"]);
        assert_err(x.bmm(&iota(&[3, 3, 1], dev)), &["bmm", "[2, 3] but got: [3, 3]"]);
        let v = t([1.0f32, 2.0, 3.0], dev);
        assert_exact(&v.dot(&v)?, DType::F32, &[], &[14.0]);
        assert_exact(&t([1i64, 2], dev).dot(&t([3i64, 4], dev))?, DType::I64, &[], &[11.0]);
        assert_err(v.dot(&t([1.0f32, 2.0], dev)), &["dot", "inconsistent tensor size", "3", "2"]);
        assert_err(v.dot(&a), &["dot", "1D tensors expected, but got 1D and 2D tensors"]);
        assert_exact(&t([1.0f32, 2.0], dev).outer(&v)?, DType::F32, &[2, 3], &[1.0, 2.0, 3.0, 2.0, 4.0, 6.0]);
        // linear: x @ w.T + b, over any leading dims.
        let w = t([[1.0f32, 0.0, -1.0], [0.5, 0.5, 0.5]], dev); // [out 2, in 3]
        let bias = t([10.0f32, 20.0], dev);
        let inp = iota(&[2, 2, 3], dev);
        let out = inp.linear(&w, Some(&bias))?;
        assert_close(&out, DType::F32, &[2, 2, 2], &[8.0, 21.5, 8.0, 26.0, 8.0, 30.5, 8.0, 35.0], 1e-6);
        assert_exact(&iota(&[1, 3], dev).linear(&w, None)?, DType::F32, &[1, 2], &[-2.0, 1.5]);
        Ok(())
    });
}

#[test]
fn matmul_shape_errors() {
    on_devices(|dev| {
        assert_err(
            iota(&[2, 3], dev).matmul(&iota(&[4, 5], dev)),
            &["matmul", "mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"],
        );
        assert_err(
            iota(&[2, 3], dev).matmul(&iota(&[4], dev)),
            &["matmul", "size mismatch, got input (2), mat (2x3), vec (4)"],
        );
        assert_err(iota(&[3], dev).matmul(&iota(&[4], dev)), &["matmul", "inconsistent tensor size", "[3]", "[4]"]);
        assert_err(iota(&[2, 2, 3], dev).matmul(&iota(&[2, 4, 1], dev)), &["matmul", "[2, 2, 3]", "[2, 4, 1]"]);
        assert_err(iota(&[2, 2, 3], dev).matmul(&iota(&[3, 3, 1], dev)), &["matmul", "(2)", "(3)"]);
        assert_err(
            t(1.0f32, dev).matmul(&iota(&[1], dev)),
            &["matmul", "both arguments to matmul need to be at least 1D"],
        );
        Ok(())
    });
}
