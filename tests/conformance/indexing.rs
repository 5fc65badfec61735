//! Indexing: `x.i(...)` with basic items (views) and advanced items (copies),
//! gather, scatter/scatter_add (in and out of place), index_select, index_add,
//! masked_select, nonzero, embedding, and their bounds and dtype errors.
use crate::common::{assert_err, assert_exact, f64s};
use crate::{iota, on_devices, t};
use kiln::prelude::*;

#[test]
fn basic_indexing_gives_views() {
    on_devices(|dev| {
        let x = iota(&[3, 4], dev);
        let r = x.i(1)?;
        assert_exact(&r, DType::F32, &[4], &[4.0, 5.0, 6.0, 7.0]);
        assert!(r.shares_storage(&x) && r.is_view());
        assert_exact(&x.i(-1)?, DType::F32, &[4], &[8.0, 9.0, 10.0, 11.0]);
        let c = x.i((.., 1..3))?;
        assert_eq!((c.shape(), c.strides(), c.storage_offset()), (&[3, 2][..], &[4, 1][..], 1));
        assert_exact(&x.i((1.., ..2))?, DType::F32, &[2, 2], &[4.0, 5.0, 8.0, 9.0]);
        assert_exact(&x.i((0..=1, -1))?, DType::F32, &[2], &[3.0, 7.0]);
        assert_exact(&x.i(s(None, None, 2))?, DType::F32, &[2, 4], &[0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0]);
        assert_exact(&x.i((.., s(-3, None, 2)))?, DType::F32, &[3, 2], &[1.0, 3.0, 5.0, 7.0, 9.0, 11.0]);
        assert_exact(&x.i((IndexItem::Ellipsis, 0))?, DType::F32, &[3], &[0.0, 4.0, 8.0]);
        assert_eq!(x.i(IndexItem::NewAxis)?.shape(), &[1, 3, 4]);
        assert_eq!(x.i((.., IndexItem::NewAxis, 1))?.shape(), &[3, 1]);
        assert_exact(&x.i((2, 3))?, DType::F32, &[], &[11.0]);
        assert_eq!(x.i((1, 2))?.storage_offset(), 6);
        // Writes through basic indexing reach the base: x[:, 1:3] += 100
        x.i((.., 1..3))?.add_(100.0)?;
        assert_eq!(f64s(&x)[..4], [0.0, 101.0, 102.0, 3.0]);
        assert_err(x.i(3), &["index 3 is out of bounds for dimension 0 with size 3"]);
        assert_err(x.i((0, -5)), &["index -5 is out of bounds for dimension 1 with size 4"]);
        assert_err(x.i((0, 0, 0)), &["too many indices for tensor of dimension 2"]);
        assert_err(x.i((IndexItem::Ellipsis, IndexItem::Ellipsis)), &["single ellipsis"]);
        Ok(())
    });
}

#[test]
fn advanced_indexing_gives_copies() {
    on_devices(|dev| {
        let x = iota(&[3, 4], dev);
        let rows = x.i(t([2i64, 0, 2], dev))?;
        assert_exact(&rows, DType::F32, &[3, 4], &[8.0, 9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0]);
        assert!(!rows.shares_storage(&x), "advanced indexing copies");
        // Negative positions count from the end; int32 indices work too.
        assert_exact(&x.i((.., &t([-1i64, 0], dev)))?, DType::F32, &[3, 2], &[3.0, 0.0, 7.0, 4.0, 11.0, 8.0]);
        assert_exact(&x.i((&t([1i32], dev), 2))?, DType::F32, &[1], &[6.0]);
        // Two index tensors pair up (and broadcast).
        assert_exact(&x.i((&t([0i64, 2], dev), &t([1i64, 3], dev)))?, DType::F32, &[2], &[1.0, 11.0]);
        let grid = x.i((&t([[0i64], [2]], dev), &t([1i64, 3], dev)))?;
        assert_exact(&grid, DType::F32, &[2, 2], &[1.0, 3.0, 9.0, 11.0]);
        // Boolean masks: x[x > 6], x[row_mask], x[:, col_mask].
        assert_exact(&x.i(&x.gt(6.0)?)?, DType::F32, &[5], &[7.0, 8.0, 9.0, 10.0, 11.0]);
        assert_exact(
            &x.i(t([true, false, true], dev))?,
            DType::F32,
            &[2, 4],
            &[0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0],
        );
        assert_exact(
            &x.i((.., &t([false, true, true, false], dev)))?,
            DType::F32,
            &[3, 2],
            &[1.0, 2.0, 5.0, 6.0, 9.0, 10.0],
        );
        assert_exact(&x.i(&x.gt(100.0)?)?, DType::F32, &[0], &[]);
        // The index form.
        let y = x.index(&[None, Some(&t([3i64, 1], dev))])?;
        assert_exact(&y, DType::F32, &[3, 2], &[3.0, 1.0, 7.0, 5.0, 11.0, 9.0]);
        assert_err(x.i(t([3i64], dev)), &["index 3 is out of bounds for dimension 0 with size 3"]);
        assert_err(x.i(t([0.0f32], dev)), &["tensors used as indices must be long, int, byte or bool tensors"]);
        assert_err(
            x.i(t([true, false], dev)),
            &["The shape of the mask [2] at index 0 does not match the shape of the indexed tensor [3, 4] at index 0"],
        );
        assert_err(
            x.i((&t([0i64, 1], dev), &t([0i64, 1, 2], dev))),
            &["shape mismatch: indexing tensors could not be broadcast together"],
        );
        Ok(())
    });
}

#[test]
fn gather_values_and_errors() {
    on_devices(|dev| {
        let x = t([[1.0f32, 2.0], [3.0, 4.0]], dev);
        let g = x.gather(1, &t([[0i64, 0], [1, 0]], dev))?;
        assert_exact(&g, DType::F32, &[2, 2], &[1.0, 1.0, 4.0, 3.0]);
        let g = x.gather(0, &t([[1i64, 0]], dev))?;
        assert_exact(&g, DType::F32, &[1, 2], &[3.0, 2.0]);
        assert_exact(&x.gather(-1, &t([[1i64], [1]], dev))?, DType::F32, &[2, 1], &[2.0, 4.0]);
        // A strided source and an int source.
        assert_exact(&x.t()?.gather(1, &t([[1i64], [0]], dev))?, DType::F32, &[2, 1], &[3.0, 2.0]);
        let xi = t([[10i32, 20, 30]], dev);
        assert_exact(&xi.gather(1, &t([[2i64, 2, 0]], dev))?, DType::I32, &[1, 3], &[30.0, 30.0, 10.0]);
        assert_err(x.gather(1, &t([[2i64]], dev)), &["gather", "index 2 is out of bounds for dimension 1 with size 2"]);
        assert_err(x.gather(1, &t([[-1i64]], dev)), &["gather", "index -1 is out of bounds"]);
        assert_err(
            x.gather(1, &t([1i64], dev)),
            &["gather", "index tensor must have the same number of dimensions as input tensor"],
        );
        assert_err(x.gather(2, &t([[0i64]], dev)), &["gather", "dimension out of range"]);
        assert_err(x.gather(1, &t([[0.0f32]], dev)), &["gather", "int64"]);
        Ok(())
    });
}

#[test]
fn scatter_and_scatter_add() {
    on_devices(|dev| {
        let z = Tensor::zeros(&[2, 3], (DType::F32, dev))?;
        let idx = t([[2i64], [0]], dev);
        let src = t([[1.0f32], [2.0]], dev);
        let y = z.scatter(1, &idx, &src)?;
        assert_exact(&y, DType::F32, &[2, 3], &[0.0, 0.0, 1.0, 2.0, 0.0, 0.0]);
        assert_exact(&z, DType::F32, &[2, 3], &[0.0; 6]);
        let y = z.scatter_value(1, &idx, -1.5)?;
        assert_exact(&y, DType::F32, &[2, 3], &[0.0, 0.0, -1.5, -1.5, 0.0, 0.0]);
        // scatter_add accumulates duplicates; only the index-shaped part of src is used.
        let idx = t([[0i64, 1, 2, 0], [2, 1, 0, 0]], dev);
        let src = iota(&[2, 5], dev);
        let y = Tensor::zeros(&[3, 4], (DType::F32, dev))?.scatter_add(0, &idx, &src)?;
        assert_exact(&y, DType::F32, &[3, 4], &[0.0, 0.0, 7.0, 11.0, 0.0, 7.0, 0.0, 0.0, 5.0, 0.0, 2.0, 0.0]);
        // In place, through a view: the base changes, the version bumps, self is returned.
        let base = Tensor::ones(&[2, 4], (DType::F32, dev))?;
        let view = base.i((.., 1..))?;
        let v0 = base.version();
        let r = view.scatter_add_(1, &t([[0i64, 0], [2, 1]], dev), &t([[1.0f32, 2.0, 9.0], [3.0, 4.0, 9.0]], dev))?;
        assert!(r.same(&view));
        assert_eq!(base.version(), v0 + 1);
        assert_exact(&base, DType::F32, &[2, 4], &[1.0, 4.0, 1.0, 1.0, 1.0, 1.0, 5.0, 4.0]);
        let w = Tensor::zeros(&[3], (DType::I64, dev))?;
        w.scatter_(0, &t([2i64, 0], dev), &t([7i64, 8], dev))?;
        assert_exact(&w, DType::I64, &[3], &[8.0, 0.0, 7.0]);
        assert_err(
            z.scatter(1, &t([[3i64]], dev), &src),
            &["scatter", "index 3 is out of bounds for dimension 1 with size 3"],
        );
        assert_err(z.scatter_add(1, &t([[0i64]], dev), &t([[1.0f64]], dev)), &["scatter_add", "float32", "float64"]);
        Ok(())
    });
}

#[test]
fn index_select_and_index_add() {
    on_devices(|dev| {
        let x = t([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]], dev);
        let y = x.index_select(1, &t([2i64, 0, 2], dev))?;
        assert_exact(&y, DType::F32, &[2, 3], &[3.0, 1.0, 3.0, 6.0, 4.0, 6.0]);
        assert_exact(&x.index_select(0, &t([1i32], dev))?, DType::F32, &[1, 3], &[4.0, 5.0, 6.0]);
        assert_exact(&x.index_select(-2, &t(1i64, dev))?, DType::F32, &[1, 3], &[4.0, 5.0, 6.0]);
        assert_exact(&x.t()?.index_select(0, &t([1i64], dev))?, DType::F32, &[1, 2], &[2.0, 5.0]);
        assert_exact(&x.index_select(1, &Tensor::zeros(&[0], (DType::I64, dev))?)?, DType::F32, &[2, 0], &[]);
        assert_err(
            x.index_select(1, &t([3i64], dev)),
            &["index_select", "index 3 is out of bounds for dimension 1 with size 3"],
        );
        assert_err(x.index_select(1, &t([[0i64]], dev)), &["index_select", "index should be a vector"]);
        assert_err(x.index_select(1, &t([0.0f32], dev)), &["index_select", "int64"]);

        let base = Tensor::zeros(&[3, 2], (DType::F32, dev))?;
        let src = t([[1.0f32, 1.0], [2.0, 2.0], [3.0, 3.0]], dev);
        let y = base.index_add(0, &t([0i64, 2, 0], dev), &src)?;
        assert_exact(&y, DType::F32, &[3, 2], &[4.0, 4.0, 0.0, 0.0, 2.0, 2.0]);
        assert_exact(&base, DType::F32, &[3, 2], &[0.0; 6]);
        let v0 = base.version();
        base.index_add_(1, &t([1i64], dev), &t([[1.0f32], [2.0], [3.0]], dev))?;
        assert_eq!(base.version(), v0 + 1);
        assert_exact(&base, DType::F32, &[3, 2], &[0.0, 1.0, 0.0, 2.0, 0.0, 3.0]);
        assert_err(base.index_add(0, &t([0i64], dev), &t([[1.0f32]], dev)), &["index_add", "[1, 1]"]);
        assert_err(
            base.index_add(0, &t([5i64], dev), &t([[1.0f32, 1.0]], dev)),
            &["index_add", "index 5 is out of bounds"],
        );
        Ok(())
    });
}

#[test]
fn masked_select_and_nonzero() {
    on_devices(|dev| {
        let x = t([[1.0f32, 2.0], [3.0, 4.0]], dev);
        assert_exact(&x.masked_select(&t([true, false], dev))?, DType::F32, &[2], &[1.0, 3.0]);
        assert_exact(&x.masked_select(&x.ge(2.0)?)?, DType::F32, &[3], &[2.0, 3.0, 4.0]);
        assert_exact(&x.t()?.masked_select(&t([[true, true], [false, false]], dev))?, DType::F32, &[2], &[1.0, 3.0]);
        assert_err(
            x.masked_select(&t([1.0f32, 0.0], dev)),
            &["masked_select", "expected BoolTensor for mask, got float32"],
        );
        let n = t([[0.0f32, 1.0], [2.0, 0.0]], dev).nonzero()?;
        assert_exact(&n, DType::I64, &[2, 2], &[0.0, 1.0, 1.0, 0.0]);
        assert_eq!(Tensor::zeros(&[3], (DType::F32, dev))?.nonzero()?.shape(), &[0, 1]);
        assert_exact(&t([0i32, 5, 0, 7], dev).nonzero()?, DType::I64, &[2, 1], &[1.0, 3.0]);
        Ok(())
    });
}

#[test]
fn embedding_lookup() {
    on_devices(|dev| {
        let w = iota(&[5, 3], dev);
        let e = Tensor::embedding(&w, &t([[4i64, 0], [4, 2]], dev))?;
        assert_exact(&e, DType::F32, &[2, 2, 3], &[12.0, 13.0, 14.0, 0.0, 1.0, 2.0, 12.0, 13.0, 14.0, 6.0, 7.0, 8.0]);
        assert_exact(&Tensor::embedding(&w, &t(1i64, dev))?, DType::F32, &[3], &[3.0, 4.0, 5.0]);
        assert_err(Tensor::embedding(&w, &t([5i64], dev)), &["index 5 is out of bounds"]);
        Ok(())
    });
}
