//! In-place ops: results, writes through views into the base, the version counter,
//! self-aliasing (`x.add_(&x)`), and the writes PyTorch refuses (through expanded or
//! overlapping views, results that need a wider dtype, leaves that require grad).
use crate::common::{assert_err, assert_exact};
use crate::{iota, on_devices, t};
use kiln::prelude::*;

#[test]
fn arithmetic_in_place_with_tensors_and_scalars() {
    on_devices(|dev| {
        let x = t([1.0f32, 2.0, 3.0], dev);
        let v0 = x.version();
        let r = x.add_(&t([10.0f32, 20.0, 30.0], dev))?;
        assert!(r.same(&x), "in-place ops return self");
        assert_exact(&x, DType::F32, &[3], &[11.0, 22.0, 33.0]);
        x.sub_(1.0)?;
        assert_exact(&x, DType::F32, &[3], &[10.0, 21.0, 32.0]);
        x.mul_(&t(0.5f32, dev))?;
        assert_exact(&x, DType::F32, &[3], &[5.0, 10.5, 16.0]);
        x.div_(2)?;
        assert_exact(&x, DType::F32, &[3], &[2.5, 5.25, 8.0]);
        x.pow_(2.0)?;
        assert_exact(&x, DType::F32, &[3], &[6.25, 27.5625, 64.0]);
        x.neg_()?;
        assert_exact(&x, DType::F32, &[3], &[-6.25, -27.5625, -64.0]);
        assert_eq!(x.version(), v0 + 6, "each in-place op bumps the version once");

        // Integer tensors stay integer; int and bool operands are fine.
        let i = t([7i32, -7], dev);
        i.add_(3)?;
        i.mul_(&t([2i64, 3], dev))?;
        i.sub_(1)?;
        assert_exact(&i, DType::I32, &[2], &[19.0, -13.0]);
        // A lower dtype operand is cast into self's dtype.
        let h = t([1.5f32], dev).to_dtype(DType::BF16)?;
        h.add_(&t([1.0f64], dev))?;
        assert_exact(&h, DType::BF16, &[1], &[2.5]);
        Ok(())
    });
}

#[test]
fn inplace_broadcasts_the_operand_not_self() {
    on_devices(|dev| {
        let x = iota(&[2, 3], dev);
        x.add_(&t([100.0f32, 200.0, 300.0], dev))?;
        assert_exact(&x, DType::F32, &[2, 3], &[100.0, 201.0, 302.0, 103.0, 204.0, 305.0]);
        x.mul_(&t([[1.0f32], [-1.0]], dev))?;
        assert_exact(&x, DType::F32, &[2, 3], &[100.0, 201.0, 302.0, -103.0, -204.0, -305.0]);
        // self cannot grow: [3] += [2, 3] fails with PyTorch's message.
        let small = t([1.0f32, 2.0, 3.0], dev);
        assert_err(
            small.add_(&iota(&[2, 3], dev)),
            &["add_", "output with shape [3] doesn't match the broadcast shape [2, 3]"],
        );
        assert_exact(&small, DType::F32, &[3], &[1.0, 2.0, 3.0]);
        Ok(())
    });
}

#[test]
fn writes_through_views_reach_the_base() {
    on_devices(|dev| {
        let x = iota(&[3, 4], dev);
        let col = x.i((.., 1))?;
        let v0 = x.version();
        col.add_(100.0)?;
        assert_eq!(x.version(), v0 + 1);
        assert_eq!(col.version(), x.version(), "the view and its base share the counter");
        let row = x.select(0, 2)?;
        row.mul_(-1.0)?;
        let tr = x.t()?;
        tr.i(0)?.fill_(0.5)?; // x[:, 0] = 0.5
        assert_exact(&x, DType::F32, &[3, 4], &[0.5, 101.0, 2.0, 3.0, 0.5, 105.0, 6.0, 7.0, 0.5, -109.0, -10.0, -11.0]);
        // Stepped slice and diagonal.
        let x = Tensor::zeros(&[4, 4], (DType::I64, dev))?;
        x.diagonal(0, 0, 1)?.fill_(1)?;
        x.i((s(None, None, 2), 3))?.add_(5)?;
        let want = [1, 0, 0, 5, 0, 1, 0, 0, 0, 0, 1, 5, 0, 0, 0, 1].map(|v| v as f64);
        assert_exact(&x, DType::I64, &[4, 4], &want);
        Ok(())
    });
}

#[test]
fn copy_fill_zero_clamp_masked_fill() {
    on_devices(|dev| {
        let x = iota(&[2, 3], dev);
        // copy_ broadcasts the source and converts its dtype.
        x.copy_(&t([1.5f64, -2.0, 3.0], dev))?;
        assert_exact(&x, DType::F32, &[2, 3], &[1.5, -2.0, 3.0, 1.5, -2.0, 3.0]);
        let i = Tensor::zeros(&[2], (DType::I32, dev))?;
        i.copy_(&t([2.9f32, -2.9], dev))?;
        assert_exact(&i, DType::I32, &[2], &[2.0, -2.0]);
        assert_err(x.copy_(&t([1.0f32, 2.0], dev)), &["copy_", "[2]", "[2, 3]"]);
        // copy_ into a transposed view writes the right places.
        let y = Tensor::zeros(&[2, 3], (DType::F32, dev))?;
        y.t()?.copy_(&iota(&[3, 2], dev))?;
        assert_exact(&y, DType::F32, &[2, 3], &[0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);

        x.i((.., 0))?.fill_(9)?;
        assert_exact(&x, DType::F32, &[2, 3], &[9.0, -2.0, 3.0, 9.0, -2.0, 3.0]);
        x.i(1)?.zero_()?;
        assert_exact(&x, DType::F32, &[2, 3], &[9.0, -2.0, 3.0, 0.0, 0.0, 0.0]);
        x.clamp_(Some(-1.0), Some(5.0))?;
        assert_exact(&x, DType::F32, &[2, 3], &[5.0, -1.0, 3.0, 0.0, 0.0, 0.0]);
        x.i(0)?.clamp_(None, Some(0.0))?;
        assert_exact(&x, DType::F32, &[2, 3], &[0.0, -1.0, 0.0, 0.0, 0.0, 0.0]);
        // masked_fill_ with a mask broadcast over rows.
        let m = t([true, false, true], dev);
        x.masked_fill_(&m, 7.5)?;
        assert_exact(&x, DType::F32, &[2, 3], &[7.5, -1.0, 7.5, 7.5, 0.0, 7.5]);
        let b = t([true, true], dev);
        b.fill_(false)?;
        assert_exact(&b, DType::Bool, &[2], &[0.0, 0.0]);
        Ok(())
    });
}

#[test]
fn slice_and_index_assignment() {
    on_devices(|dev| {
        // x[:, 1:3] = v (broadcast), x[0] = 5, x[[2, 0], 0] = [-1, -2], x[x > 10] = 0
        let x = iota(&[3, 4], dev);
        let v0 = x.version();
        x.i_put_((.., 1..3), &t([100.0f32, 200.0], dev))?;
        x.i_put_(0, &t(5.0f32, dev))?;
        x.i_put_((&t([2i64, 0], dev), 0), &t([-1.0f32, -2.0], dev))?;
        assert!(x.version() > v0);
        let want = [-2.0, 5.0, 5.0, 5.0, 4.0, 100.0, 200.0, 7.0, -1.0, 100.0, 200.0, 11.0];
        assert_exact(&x, DType::F32, &[3, 4], &want);
        let mask = x.gt(10.0)?;
        x.i_put_(&mask, &t(0.0f32, dev))?;
        let want = [-2.0, 5.0, 5.0, 5.0, 4.0, 0.0, 0.0, 7.0, -1.0, 0.0, 0.0, 0.0];
        assert_exact(&x, DType::F32, &[3, 4], &want);

        // index_put_: replace (the last duplicate wins, as on PyTorch's CPU) and accumulate.
        let y = Tensor::zeros(&[5], (DType::F32, dev))?;
        let idx = t([1i64, 3, 1], dev);
        y.index_put_(&[Some(&idx)], &t([1.0f32, 2.0, 3.0], dev), true)?;
        assert_exact(&y, DType::F32, &[5], &[0.0, 4.0, 0.0, 2.0, 0.0]);
        y.index_put_(&[Some(&t([4i64, 0], dev))], &t([9.0f32, 8.0], dev), false)?;
        assert_exact(&y, DType::F32, &[5], &[8.0, 4.0, 0.0, 2.0, 9.0]);
        // Through a view: writes land in the base.
        let base = Tensor::zeros(&[2, 3], (DType::I64, dev))?;
        base.i(1)?.index_put_(&[Some(&t([2i64], dev))], &t([7i64], dev), false)?;
        assert_exact(&base, DType::I64, &[2, 3], &[0.0, 0.0, 0.0, 0.0, 0.0, 7.0]);
        // Out-of-place index_put leaves self alone.
        let z = base.index_put(&[Some(&t([0i64], dev))], &t([1i64, 1, 1], dev), false)?;
        assert_exact(&z, DType::I64, &[2, 3], &[1.0, 1.0, 1.0, 0.0, 0.0, 7.0]);
        assert_exact(&base, DType::I64, &[2, 3], &[0.0, 0.0, 0.0, 0.0, 0.0, 7.0]);
        Ok(())
    });
}

#[test]
fn self_aliasing_operands() {
    on_devices(|dev| {
        let x = t([1.0f32, 2.0, 3.0], dev);
        x.add_(&x)?;
        assert_exact(&x, DType::F32, &[3], &[2.0, 4.0, 6.0]);
        x.mul_(&x)?;
        assert_exact(&x, DType::F32, &[3], &[4.0, 16.0, 36.0]);
        x.sub_(&x)?;
        assert_exact(&x, DType::F32, &[3], &[0.0, 0.0, 0.0]);
        // An operand that is a different, non-overlapping part of the same storage.
        let y = iota(&[2, 3], dev);
        y.i(0)?.add_(&y.i(1)?)?;
        assert_exact(&y, DType::F32, &[2, 3], &[3.0, 5.0, 7.0, 3.0, 4.0, 5.0]);
        y.copy_(&y)?;
        assert_exact(&y, DType::F32, &[2, 3], &[3.0, 5.0, 7.0, 3.0, 4.0, 5.0]);
        Ok(())
    });
}

const OVERLAP: &str = "unsupported operation: more than one element of the written-to tensor refers to a single memory location. Please clone() the tensor before performing the operation.";

#[test]
fn writes_through_overlapping_views_are_refused() {
    on_devices(|dev| {
        let x = t([[1.0f32], [2.0]], dev);
        let e = x.expand(&[2, 3])?;
        let v0 = x.version();
        assert_err(e.add_(1.0), &["add_", OVERLAP]);
        assert_err(e.fill_(0.0), &["fill_", OVERLAP]);
        assert_err(e.copy_(&iota(&[2, 3], dev)), &["copy_", OVERLAP]);
        assert_err(e.mul_(&e), &["mul_", OVERLAP]);
        assert_err(e.masked_fill_(&t([true, false, true], dev), 0.0), &["masked_fill_", OVERLAP]);
        let w = iota(&[10], dev).as_strided(&[4, 3], &[2, 1], None)?;
        assert_err(w.add_(1.0), &["add_", OVERLAP]);
        assert_err(w.zero_(), &["fill_", OVERLAP]);
        assert_exact(&x, DType::F32, &[2, 1], &[1.0, 2.0]);
        assert_eq!(x.version(), v0, "a refused write changes nothing");
        // Non-overlapping strided views are writable.
        let ok = iota(&[12], dev).as_strided(&[2, 2], &[4, 2], Some(1))?;
        ok.add_(1.0)?;
        // An expanded *operand* is fine.
        let y = Tensor::zeros(&[2, 3], (DType::F32, dev))?;
        y.add_(&e)?;
        assert_exact(&y, DType::F32, &[2, 3], &[1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
        Ok(())
    });
}

#[test]
fn results_that_do_not_fit_self_are_refused() {
    on_devices(|dev| {
        let i = t([1i64, 2], dev);
        assert_err(i.add_(2.5), &["add_", "result type Float can't be cast to the desired output type Long"]);
        assert_err(
            i.mul_(&t([0.5f32, 1.0], dev)),
            &["mul_", "result type Float can't be cast to the desired output type Long"],
        );
        assert_err(i.div_(2), &["div_", "result type Float can't be cast to the desired output type Long"]);
        assert_exact(&i, DType::I64, &[2], &[1.0, 2.0]);
        let b = t([true, false], dev);
        assert_err(b.add_(1), &["add_", "result type Long can't be cast to the desired output type Bool"]);
        // Float into a narrower float is fine (a cast, as in PyTorch).
        let h = t([1.0f32], dev).to_dtype(DType::F16)?;
        h.mul_(&t([3.0f64], dev))?;
        assert_exact(&h, DType::F16, &[1], &[3.0]);
        Ok(())
    });
}

#[test]
fn leaves_that_require_grad_refuse_in_place_writes() {
    on_devices(|dev| {
        let w = t([1.0f32, 2.0], dev);
        w.requires_grad_(true)?;
        assert!(w.is_leaf() && w.requires_grad());
        assert_err(
            w.add_(1.0),
            &["add_", "a leaf Variable that requires grad is being used in an in-place operation."],
        );
        assert_err(w.fill_(0.0), &["fill_", "a leaf Variable that requires grad"]);
        assert_err(
            w.narrow(0, 0, 1)?.mul_(2.0),
            &["mul_", "a view of a leaf Variable that requires grad is being used in an in-place operation."],
        );
        assert_eq!(w.detach().to_vec::<f32>()?, vec![1.0, 2.0]);
        // With grad mode off (`torch.no_grad()`), the write is allowed.
        let prev = kiln::set_grad_enabled(false);
        let r = w.add_(1.0).map(|_| ());
        kiln::set_grad_enabled(prev);
        r?;
        assert_eq!(w.detach().to_vec::<f32>()?, vec![2.0, 3.0]);
        // A detached alias is no leaf that requires grad: writable, and the leaf sees it.
        w.detach().mul_(2.0)?;
        assert_eq!(w.detach().to_vec::<f32>()?, vec![4.0, 6.0]);
        assert_err(t([1i64], dev).requires_grad_(true), &["requires_grad_", "floating point", "int64"]);
        Ok(())
    });
}
