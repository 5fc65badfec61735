//! Composites and the remaining movement ops: softmax/log_softmax, cumsum,
//! tril/triu, sort/argsort/topk, cat/stack, rms_norm/layer_norm, cross_entropy.
use crate::common::{assert_close, assert_err, assert_exact, f64s};
use crate::{iota, on_devices, t};
use kiln::prelude::*;

const NAN: f64 = f64::NAN;
const INF: f64 = f64::INFINITY;

fn softmax_ref(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = row.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

#[test]
fn softmax_and_log_softmax() {
    on_devices(|dev| {
        let x = t([[1.0f32, 2.0, 3.0], [1000.0, 1000.0, -1000.0]], dev);
        let mut want = softmax_ref(&[1.0, 2.0, 3.0]);
        want.extend([0.5, 0.5, 0.0]);
        assert_close(&x.softmax(-1)?, DType::F32, &[2, 3], &want, 1e-6);
        let logw: Vec<f64> = vec![
            1.0 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln(),
            2.0 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln(),
            3.0 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln(),
            -(2f64.ln()),
            -(2f64.ln()),
            -2000.0 - 2f64.ln(),
        ];
        assert_close(&x.log_softmax(1)?, DType::F32, &[2, 3], &logw, 1e-5);
        // Over dim 0 of a strided input: each column sums to 1.
        let y = iota(&[3, 2], dev).t()?.softmax(0)?;
        assert_eq!(y.shape(), &[2, 3]);
        let v = f64s(&y);
        for c in 0..3 {
            assert!((v[c] + v[3 + c] - 1.0).abs() < 1e-6);
        }
        assert_close(&y.i(0)?, DType::F32, &[3], &[softmax_ref(&[0.0, 1.0])[0]; 3], 1e-6);
        // -inf entries get 0; an all -inf row is NaN (PyTorch does not special-case it).
        let m = t([[0.0f32, f32::NEG_INFINITY], [f32::NEG_INFINITY, f32::NEG_INFINITY]], dev);
        assert_exact(&m.softmax(-1)?, DType::F32, &[2, 2], &[1.0, 0.0, NAN, NAN]);
        assert_exact(&m.log_softmax(-1)?.i(0)?, DType::F32, &[2], &[0.0, -INF]);
        // Half precision computes in f32 and keeps its dtype.
        let h = x.to_dtype(DType::BF16)?.softmax(-1)?;
        assert_eq!(h.dtype(), DType::BF16);
        assert_close(&h.i(1)?, DType::BF16, &[3], &[0.5, 0.5, 0.0], 1e-3);
        assert_err(t([1i64, 2], dev).softmax(0), &["softmax", "int64"]);
        assert_err(x.softmax(2), &["softmax", "dimension out of range"]);
        Ok(())
    });
}

#[test]
fn cumsum_dims_and_dtypes() {
    on_devices(|dev| {
        let x = iota(&[2, 3], dev);
        assert_exact(&x.cumsum(0)?, DType::F32, &[2, 3], &[0.0, 1.0, 2.0, 3.0, 5.0, 7.0]);
        assert_exact(&x.cumsum(-1)?, DType::F32, &[2, 3], &[0.0, 1.0, 3.0, 3.0, 7.0, 12.0]);
        assert_exact(&x.t()?.cumsum(1)?, DType::F32, &[3, 2], &[0.0, 3.0, 1.0, 5.0, 2.0, 7.0]);
        assert_exact(&t([200u8, 100], dev).cumsum(0)?, DType::I64, &[2], &[200.0, 300.0]);
        assert_exact(&t([true, false, true], dev).cumsum(0)?, DType::I64, &[3], &[1.0, 1.0, 2.0]);
        assert_exact(&t([1i32, -2], dev).cumsum(0)?, DType::I64, &[2], &[1.0, -1.0]);
        assert_exact(&t([1.0f32, f32::NAN, 1.0], dev).cumsum(0)?, DType::F32, &[3], &[1.0, NAN, NAN]);
        assert_exact(&t(4.0f32, dev).cumsum(0)?, DType::F32, &[], &[4.0]);
        assert_exact(&Tensor::zeros(&[0], (DType::F32, dev))?.cumsum(0)?, DType::F32, &[0], &[]);
        let h = t([0.5f32, 0.25], dev).to_dtype(DType::F16)?;
        assert_exact(&h.cumsum(0)?, DType::F16, &[2], &[0.5, 0.75]);
        assert_err(x.cumsum(2), &["cumsum", "dimension out of range"]);
        Ok(())
    });
}

#[test]
fn tril_and_triu() {
    on_devices(|dev| {
        let x = iota(&[3, 4], dev).add(1.0)?;
        let l = x.tril(0)?;
        assert_exact(&l, DType::F32, &[3, 4], &[1.0, 0.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 9.0, 10.0, 11.0, 0.0]);
        assert_exact(&x.tril(-1)?, DType::F32, &[3, 4], &[0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 9.0, 10.0, 0.0, 0.0]);
        assert_exact(&x.triu(1)?, DType::F32, &[3, 4], &[0.0, 2.0, 3.0, 4.0, 0.0, 0.0, 7.0, 8.0, 0.0, 0.0, 0.0, 12.0]);
        assert_exact(
            &x.triu(-1)?,
            DType::F32,
            &[3, 4],
            &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 0.0, 10.0, 11.0, 12.0],
        );
        assert_exact(&x.triu(10)?, DType::F32, &[3, 4], &[0.0; 12]);
        // Batched (the last two dims), bool and -inf fills.
        let b = Tensor::ones(&[2, 2, 2], (DType::Bool, dev))?.tril(0)?;
        assert_exact(&b, DType::Bool, &[2, 2, 2], &[1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]);
        let m = Tensor::full(&[3, 3], f64::NEG_INFINITY, (DType::F32, dev))?.triu(1)?;
        assert_exact(&m, DType::F32, &[3, 3], &[0.0, -INF, -INF, 0.0, 0.0, -INF, 0.0, 0.0, 0.0]);
        // In place, through a view.
        let base = Tensor::ones(&[2, 2, 2], (DType::F32, dev))?;
        base.i(1)?.triu_(0)?;
        assert_exact(&base, DType::F32, &[2, 2, 2], &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]);
        assert_err(iota(&[3], dev).tril(0), &["tril", "at least 2 dimensions"]);
        Ok(())
    });
}

#[test]
fn sort_argsort_topk() {
    on_devices(|dev| {
        let x = t([[3.0f32, 1.0, 2.0, 1.0], [0.0, -1.0, 5.0, 4.0]], dev);
        let (v, i) = x.sort(1, false)?;
        assert_exact(&v, DType::F32, &[2, 4], &[1.0, 1.0, 2.0, 3.0, -1.0, 0.0, 4.0, 5.0]);
        assert_eq!(f64s(&i)[4..], [1.0, 0.0, 3.0, 2.0]);
        let (v, i) = x.sort_stable(-1, false)?;
        assert_exact(&v.i(0)?, DType::F32, &[4], &[1.0, 1.0, 2.0, 3.0]);
        assert_exact(&i, DType::I64, &[2, 4], &[1.0, 3.0, 2.0, 0.0, 1.0, 0.0, 3.0, 2.0]);
        let (v, i) = x.sort_stable(1, true)?;
        assert_exact(&v.i(0)?, DType::F32, &[4], &[3.0, 2.0, 1.0, 1.0]);
        assert_exact(&i.i(0)?, DType::I64, &[4], &[0.0, 2.0, 1.0, 3.0]);
        let (v, i) = x.sort(0, true)?;
        assert_exact(&v, DType::F32, &[2, 4], &[3.0, 1.0, 5.0, 4.0, 0.0, -1.0, 2.0, 1.0]);
        assert_exact(&i, DType::I64, &[2, 4], &[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        assert_exact(&x.argsort(1, true)?.i(1)?, DType::I64, &[4], &[2.0, 3.0, 0.0, 1.0]);
        // NaN sorts as the largest value, like PyTorch.
        let n = t([2.0f32, f32::NAN, -1.0], dev);
        assert_exact(&n.sort(0, false)?.0, DType::F32, &[3], &[-1.0, 2.0, NAN]);
        assert_exact(&n.sort(0, true)?.0, DType::F32, &[3], &[NAN, 2.0, -1.0]);
        assert_exact(&t([3i64, -5, 0], dev).sort(0, false)?.0, DType::I64, &[3], &[-5.0, 0.0, 3.0]);

        let y = t([1.0f32, 5.0, 3.0, 4.0, 5.0], dev);
        let (v, i) = y.topk(3, -1, true, true)?;
        assert_exact(&v, DType::F32, &[3], &[5.0, 5.0, 4.0]);
        assert_eq!(f64s(&i)[2], 3.0);
        let mut first_two = f64s(&i)[..2].to_vec();
        first_two.sort_by(f64::total_cmp);
        assert_eq!(first_two, vec![1.0, 4.0]);
        let (v, i) = y.topk(2, 0, false, true)?;
        assert_exact(&v, DType::F32, &[2], &[1.0, 3.0]);
        assert_exact(&i, DType::I64, &[2], &[0.0, 2.0]);
        let (v, _) = iota(&[2, 3], dev).topk(1, 1, true, true)?;
        assert_exact(&v, DType::F32, &[2, 1], &[2.0, 5.0]);
        assert_eq!(y.topk(0, 0, true, true)?.0.shape(), &[0]);
        assert_err(y.topk(6, 0, true, true), &["topk", "selected index k = 6 out of range"]);
        Ok(())
    });
}

#[test]
fn cat_and_stack() {
    on_devices(|dev| {
        let a = iota(&[2, 2], dev);
        let b = t([[10.0f32, 11.0]], dev);
        let c = Tensor::cat(&[&a, &b], 0)?;
        assert_exact(&c, DType::F32, &[3, 2], &[0.0, 1.0, 2.0, 3.0, 10.0, 11.0]);
        assert!(!c.shares_storage(&a));
        let c = Tensor::cat(&[&a, &a.t()?], 1)?;
        assert_exact(&c, DType::F32, &[2, 4], &[0.0, 1.0, 0.0, 2.0, 2.0, 3.0, 1.0, 3.0]);
        assert_exact(&Tensor::cat(&[&a], -1)?, DType::F32, &[2, 2], &[0.0, 1.0, 2.0, 3.0]);
        // dtypes promote like a binary op; legacy empty [0] tensors are skipped.
        let i = t([[1i64, 2]], dev);
        let c = Tensor::cat(&[&i, &b], 0)?;
        assert_exact(&c, DType::F32, &[2, 2], &[1.0, 2.0, 10.0, 11.0]);
        let empty = Tensor::zeros(&[0], (DType::F32, dev))?;
        assert_exact(&Tensor::cat(&[&empty, &b, &empty], 0)?, DType::F32, &[1, 2], &[10.0, 11.0]);
        assert_exact(
            &Tensor::cat(&[&Tensor::zeros(&[0, 2], (DType::F32, dev))?, &b], 0)?,
            DType::F32,
            &[1, 2],
            &[10.0, 11.0],
        );

        let s = Tensor::stack(&[&t([1.0f32, 2.0], dev), &t([3.0f32, 4.0], dev)], 0)?;
        assert_exact(&s, DType::F32, &[2, 2], &[1.0, 2.0, 3.0, 4.0]);
        let s = Tensor::stack(&[&t([1.0f32, 2.0], dev), &t([3.0f32, 4.0], dev)], -1)?;
        assert_exact(&s, DType::F32, &[2, 2], &[1.0, 3.0, 2.0, 4.0]);
        let s = Tensor::stack(&[&t(1i32, dev), &t(2i32, dev)], 0)?;
        assert_exact(&s, DType::I32, &[2], &[1.0, 2.0]);

        assert_err(
            Tensor::cat(&[&a, &iota(&[2, 3], dev)], 0),
            &["cat", "sizes of tensors must match except in dimension 0", "[2, 2]", "[2, 3]"],
        );
        assert_err(Tensor::cat(&[&a, &iota(&[4], dev)], 0), &["cat", "[2, 2]", "[4]"]);
        assert_err(Tensor::cat(&[&t(1.0f32, dev)], 0), &["cat", "zero-dimensional tensor cannot be concatenated"]);
        assert_err(Tensor::cat(&[], 0), &["cat", "non-empty list of tensors"]);
        assert_err(Tensor::cat(&[&a, &b], 2), &["cat", "dimension out of range"]);
        assert_err(
            Tensor::stack(&[&a, &b], 0),
            &["stack", "stack expects each tensor to be equal size, but got [2, 2] and [1, 2]"],
        );
        Ok(())
    });
}

#[test]
fn rms_norm_and_layer_norm() {
    on_devices(|dev| {
        let x = t([[3.0f32, 4.0], [1.0, -1.0]], dev);
        let r = (12.5f64).sqrt();
        assert_close(&x.rms_norm(None, 0.0)?, DType::F32, &[2, 2], &[3.0 / r, 4.0 / r, 1.0, -1.0], 1e-6);
        let w = t([2.0f32, 0.5], dev);
        let eps = 1e-5;
        let r0 = (12.5f64 + eps).sqrt();
        let r1 = (1.0f64 + eps).sqrt();
        assert_close(
            &x.rms_norm(Some(&w), eps)?,
            DType::F32,
            &[2, 2],
            &[6.0 / r0, 2.0 / r0, 2.0 / r1, -0.5 / r1],
            1e-6,
        );
        let h = x.to_dtype(DType::BF16)?;
        assert_eq!(h.rms_norm(None, 1e-6)?.dtype(), DType::BF16);
        let y = t([[1.0f32, 3.0], [2.0, 2.0]], dev).layer_norm(&[2], None, None, 0.0)?;
        assert_exact(&y, DType::F32, &[2, 2], &[-1.0, 1.0, NAN, NAN]);
        let y = t([[1.0f32, 3.0], [2.0, 2.0]], dev).layer_norm(&[2], Some(&w), Some(&t([1.0f32, 1.0], dev)), 1e-5)?;
        let k = 1.0 / (1.0f64 + 1e-5).sqrt();
        assert_close(&y, DType::F32, &[2, 2], &[1.0 - 2.0 * k, 1.0 + 0.5 * k, 1.0, 1.0], 1e-6);
        assert_err(x.rms_norm(Some(&t([1.0f32, 1.0, 1.0], dev)), 1e-5), &["rms_norm", "[3]"]);
        Ok(())
    });
}

#[test]
fn cross_entropy_reductions_and_ignore_index() {
    on_devices(|dev| {
        let logits = t([[2.0f32, 0.0, -1.0], [0.0, 0.0, 0.0], [1.0, 3.0, 0.5], [0.0, 1.0, 2.0]], dev);
        let target = t([0i64, -100, 1, 2], dev);
        let nll = |row: [f64; 3], c: usize| -> f64 {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            lse - row[c]
        };
        let l0 = nll([2.0, 0.0, -1.0], 0);
        let l2 = nll([1.0, 3.0, 0.5], 1);
        let l3 = nll([0.0, 1.0, 2.0], 2);
        let none = logits.cross_entropy(&target, Some(-100), Reduction::None)?;
        assert_close(&none, DType::F32, &[4], &[l0, 0.0, l2, l3], 1e-6);
        let sum = logits.cross_entropy(&target, Some(-100), Reduction::Sum)?;
        assert_close(&sum, DType::F32, &[], &[l0 + l2 + l3], 1e-6);
        let mean = logits.cross_entropy(&target, Some(-100), Reduction::Mean)?;
        assert_close(&mean, DType::F32, &[], &[(l0 + l2 + l3) / 3.0], 1e-6);
        assert_eq!("sum".parse::<Reduction>()?, Reduction::Sum);
        // Another ignore_index, and all targets ignored (mean is NaN, as in PyTorch).
        let t2 = t([0i64, 1, 1, 1], dev);
        let m2 = logits.cross_entropy(&t2, Some(1), Reduction::Mean)?;
        assert_close(&m2, DType::F32, &[], &[l0], 1e-6);
        let all = logits.cross_entropy(&t([1i64; 4], dev), Some(1), Reduction::Mean)?;
        assert_exact(&all, DType::F32, &[], &[NAN]);
        // [N, C, d] logits with [N, d] targets: classes along dim 1.
        let l3d = logits.t()?.unsqueeze(0)?; // [1, 3, 4]
        let per = l3d.cross_entropy(&t([[0i64, 0, 1, 2]], dev), None, Reduction::None)?;
        assert_close(&per, DType::F32, &[1, 4], &[l0, nll([0.0; 3], 0), l2, l3], 1e-6);
        assert_err(logits.cross_entropy(&t([3i64, 0, 0, 0], dev), None, Reduction::Mean), &["out of bounds"]);
        assert_err("avg".parse::<Reduction>(), &["avg"]);
        Ok(())
    });
}
