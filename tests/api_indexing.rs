//! Indexing against PyTorch: basic indexing (`x.i(..)` views: integers, every
//! range kind, stepped slices, new axes, ellipsis), advanced indexing (index
//! tensors, bool masks, mixed with basic items), `index`, `index_put_`,
//! slice assignment through views, gather/scatter/index_select/index_add,
//! masked_select and nonzero. Expected values come from PyTorch.
mod common;

use common::*;
use kiln::prelude::*;

/// `arange(24).reshape(2, 3, 4)` as float32.
fn x234() -> Tensor {
    Tensor::arange(0.0, 24.0, 1.0, DType::F32).unwrap().reshape(&[2, 3, 4]).unwrap()
}

fn range(a: usize, b: usize) -> Vec<f64> {
    (a..b).map(|v| v as f64).collect()
}

fn idx(v: &[i64]) -> Tensor {
    Tensor::new(v.to_vec()).unwrap()
}

// ---- basic indexing: views ---------------------------------------------------------------

/// `to_dtype` keeps the strides of a dense permuted tensor (PyTorch's
/// `preserve_format`): a permuted view casts to the same permutation of a
/// fresh tensor, with the values of the cast; a view with gaps casts to a
/// contiguous tensor; gradients come back through the views in float32.
#[test]
fn casts_keep_a_permuted_layout() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        let t = x.permute(&[2, 0, 1])?; // [4, 2, 3], strides [1, 12, 4]
        let c = t.to_dtype(DType::F64)?;
        assert_eq!(c.strides(), t.strides(), "a permuted cast keeps its strides");
        assert!(!c.shares_storage(&t));
        let want: Vec<f64> = (0..24).map(|e| ((e / 6) + (e / 3 % 2) * 12 + (e % 3) * 4) as f64).collect();
        assert_exact(&c, DType::F64, &[4, 2, 3], &want);
        let m = x.i((.., .., 0..2))?.to_dtype(DType::F64)?;
        assert!(m.is_contiguous(), "a view with gaps casts to a contiguous tensor");
        let w = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?.requires_grad_(true)?.clone();
        let y = w.t()?.to_dtype(DType::BF16)?;
        assert_eq!(y.strides(), &[1, 3]);
        let g = Tensor::new([[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]])?;
        y.to_dtype(DType::F32)?.mul(&g)?.sum()?.backward()?;
        assert_exact(&w.grad().expect("a gradient"), DType::F32, &[2, 3], &[1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
        Ok(())
    })
}

#[test]
fn integers_select() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        let a = x.i(1)?;
        assert_exact(&a, DType::F32, &[3, 4], &range(12, 24));
        assert!(a.shares_storage(&x));
        assert_exact(&x.i(-1)?, DType::F32, &[3, 4], &range(12, 24));
        assert_exact(&x.i((0, 2))?, DType::F32, &[4], &range(8, 12));
        assert_exact(&x.i((1, -1, -1))?, DType::F32, &[], &[23.0]);
        assert_exact(&x.i((0i64, 1usize, 2isize))?, DType::F32, &[], &[6.0]);
        Ok(())
    })
}

#[test]
// `1..-1` and `4..2` are Python slices here (negative ends count from the end,
// reversed bounds give an empty slice), not empty Rust iterators.
#[allow(clippy::reversed_empty_ranges)]
fn every_range_kind() -> Result<()> {
    common::on_every_device(|| {
        let v = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?;
        assert_exact(&v.i(..)?, DType::F32, &[6], &range(0, 6));
        assert_exact(&v.i(1..4)?, DType::F32, &[3], &range(1, 4));
        assert_exact(&v.i(2..)?, DType::F32, &[4], &range(2, 6));
        assert_exact(&v.i(..2)?, DType::F32, &[2], &range(0, 2));
        assert_exact(&v.i(1..=3)?, DType::F32, &[3], &range(1, 4));
        assert_exact(&v.i(..=2)?, DType::F32, &[3], &range(0, 3));
        // Typed bounds.
        assert_exact(&v.i(1i64..3i64)?, DType::F32, &[2], &range(1, 3));
        assert_exact(&v.i(1usize..3usize)?, DType::F32, &[2], &range(1, 3));
        assert_exact(&v.i(1isize..)?, DType::F32, &[5], &range(1, 6));
        // Negative bounds count from the end; `..=-1` runs to the end.
        assert_exact(&v.i(-2..)?, DType::F32, &[2], &range(4, 6));
        assert_exact(&v.i(..-1)?, DType::F32, &[5], &range(0, 5));
        assert_exact(&v.i(-3..=-1)?, DType::F32, &[3], &range(3, 6));
        assert_exact(&v.i(-3..=-2)?, DType::F32, &[2], &range(3, 5));
        // Out-of-range bounds clamp like Python; empty slices are fine.
        assert_exact(&v.i(4..100)?, DType::F32, &[2], &range(4, 6));
        assert_exact(&v.i(-100..2)?, DType::F32, &[2], &range(0, 2));
        assert_exact(&v.i(4..2)?, DType::F32, &[0], &[]);
        Ok(())
    })
}

#[test]
#[allow(clippy::reversed_empty_ranges)] // `1..-1` is Python's `1:-1`
fn stepped_slices_new_axis_and_ellipsis() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        let every2 = s(None, None, 2);
        assert_exact(&x.i((0, 0, every2.clone()))?, DType::F32, &[2], &[0.0, 2.0]);
        // x[1, 1:, None, ::3]
        let y = x.i((1, 1.., IndexItem::NewAxis, s(None, None, 3)))?;
        assert_exact(&y, DType::F32, &[2, 1, 2], &[16.0, 19.0, 20.0, 23.0]);
        assert!(y.shares_storage(&x));
        // x[-1, ..., 1:-1]
        assert_exact(
            &x.i((-1, IndexItem::Ellipsis, 1..-1))?,
            DType::F32,
            &[3, 2],
            &[13.0, 14.0, 17.0, 18.0, 21.0, 22.0],
        );
        assert_eq!(x.i((IndexItem::Ellipsis, 0))?.shape(), &[2, 3]);
        assert_eq!(x.i((IndexItem::NewAxis, IndexItem::Ellipsis, IndexItem::NewAxis))?.shape(), &[1, 2, 3, 4, 1]);
        assert_eq!(x.i(IndexItem::Ellipsis)?.shape(), &[2, 3, 4]);
        // x[1:-1:2] style bounds with negative start.
        let v = Tensor::arange(0.0, 10.0, 1.0, DType::F32)?;
        assert_exact(&v.i(s(-8, -1, 3))?, DType::F32, &[3], &[2.0, 5.0, 8.0]);
        assert_exact(&v.i(s(1, None, 4))?, DType::F32, &[3], &[1.0, 5.0, 9.0]);
        assert_exact(&v.i(IndexItem::slice(Some(7), Some(100), 2))?, DType::F32, &[2], &[7.0, 9.0]);
        // Up to six items; items as a Vec.
        let z = Tensor::zeros(&[1, 2, 1, 2, 1, 2], DType::F32)?;
        assert_eq!(z.i((0, .., 0, .., 0, 1))?.shape(), &[2, 2]);
        assert_eq!(x.i(vec![IndexItem::Select(1), IndexItem::NewAxis])?.shape(), &[1, 3, 4]);
        Ok(())
    })
}

#[test]
fn basic_index_errors() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        assert_err(x.i(5), &["index 5 is out of bounds for dimension 0 with size 2"]);
        assert_err(x.i((0, 5)), &["index 5 is out of bounds for dimension 1 with size 3"]);
        assert_err(x.i((.., .., -5)), &["index -5 is out of bounds for dimension 2 with size 4"]);
        assert_err(x.i((0, 0, 0, 0)), &["too many indices for tensor of dimension 3"]);
        assert_err(x.i((IndexItem::Ellipsis, 0, IndexItem::Ellipsis)), &["an index can only have a single ellipsis"]);
        assert_err(x.i(IndexItem::slice(None, None, 0)), &["step must be greater than zero"]);
        assert_err(x.i(IndexItem::slice(None, None, -1)), &["step must be greater than zero"]);
        assert_err(Tensor::scalar(1.0, DType::F32)?.i(0), &["too many indices for tensor of dimension 0"]);
        Ok(())
    })
}

#[test]
fn slice_assignment_writes_through_views() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::zeros(&[3, 4], DType::F32)?;
        let v0 = x.version();
        // x[:, 1:3] = [[1, 2]] (broadcast over rows)
        x.i((.., 1..3))?.copy_(&Tensor::new([[1.0f32, 2.0]])?)?;
        assert!(x.version() > v0);
        // x[-1, ::2] += 10
        x.i((-1, s(None, None, 2)))?.add_(10.0)?;
        assert_exact(&x, DType::F32, &[3, 4], &[0.0, 1.0, 2.0, 0.0, 0.0, 1.0, 2.0, 0.0, 10.0, 1.0, 12.0, 0.0]);
        // i_put_ with only basic items is the same thing.
        x.i_put_((0, ..), &Tensor::scalar(5.0, DType::F32)?)?;
        assert_exact(&x.i(0)?, DType::F32, &[4], &[5.0; 4]);
        Ok(())
    })
}

// ---- advanced indexing ------------------------------------------------------------------

#[test]
fn index_tensors_and_adjacency() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        // x[:, [0, 2], [1, 3]]: adjacent advanced dims stay in place.
        assert_exact(&x.i((.., &idx(&[0, 2]), &idx(&[1, 3])))?, DType::F32, &[2, 2], &[1.0, 11.0, 13.0, 23.0]);
        // x[[1, 0], :, [3, 0]]: separated, so the index dims go first.
        assert_exact(
            &x.i((&idx(&[1, 0]), .., &idx(&[3, 0])))?,
            DType::F32,
            &[2, 3],
            &[15.0, 19.0, 23.0, 0.0, 4.0, 8.0],
        );
        // x[0, :, [0, 1]]: integers select first (PyTorch, unlike NumPy).
        assert_exact(&x.i((0, .., &idx(&[0, 1])))?, DType::F32, &[3, 2], &[0.0, 1.0, 4.0, 5.0, 8.0, 9.0]);
        // x[[[1], [0]], [0, 2]]: index tensors broadcast ([2, 1] with [2]).
        let rows = Tensor::new([[1i64], [0]])?;
        assert_exact(
            &x.i((&rows, &idx(&[0, 2])))?,
            DType::F32,
            &[2, 2, 4],
            &[12.0, 13.0, 14.0, 15.0, 20.0, 21.0, 22.0, 23.0, 0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0, 11.0],
        );
        // x[..., [3, -1, 0]]: negative positions wrap.
        assert_exact(
            &x.i((IndexItem::Ellipsis, &idx(&[3, -1, 0])))?,
            DType::F32,
            &[2, 3, 3],
            &[3.0, 3.0, 0.0, 7.0, 7.0, 4.0, 11.0, 11.0, 8.0, 15.0, 15.0, 12.0, 19.0, 19.0, 16.0, 23.0, 23.0, 20.0],
        );
        // x[:, [[2, 0], [1, 1]]]: a 2-D index tensor.
        let i2 = Tensor::new([[2i64, 0], [1, 1]])?;
        let want = [
            8.0, 9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 4.0, 5.0, 6.0, 7.0, 20.0, 21.0, 22.0, 23.0,
            12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 19.0, 16.0, 17.0, 18.0, 19.0,
        ];
        let r = x.i((.., &i2))?;
        assert_exact(&r, DType::F32, &[2, 2, 2, 4], &want);
        assert!(!r.is_view(), "advanced indexing returns a fresh tensor");
        // x[:, tensor(1)]: a 0-d index removes the dim.
        assert_exact(
            &x.i((.., &Tensor::scalar(1, DType::I64)?))?,
            DType::F32,
            &[2, 4],
            &[4.0, 5.0, 6.0, 7.0, 16.0, 17.0, 18.0, 19.0],
        );
        // int32 indices work too; the result is a copy.
        let r = x.i(&Tensor::new([1i32])?)?;
        assert_exact(&r, DType::F32, &[1, 3, 4], &range(12, 24));
        assert!(!r.shares_storage(&x));
        Ok(())
    })
}

#[test]
fn bool_masks() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        // x[x > 20]: a full-shape mask gives a 1-D result (a fresh tensor).
        let sel = x.i(&x.gt(20.0)?)?;
        assert_exact(&sel, DType::F32, &[3], &[21.0, 22.0, 23.0]);
        assert!(!sel.is_view());
        // x[:, x[0] > 5]: a 2-D mask over the last two dims.
        let m = x.i(0)?.gt(5.0)?;
        assert_exact(
            &x.i((.., &m))?,
            DType::F32,
            &[2, 6],
            &[6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 18.0, 19.0, 20.0, 21.0, 22.0, 23.0],
        );
        // x[[True, False]]
        assert_exact(&x.i(&Tensor::new([true, false])?)?, DType::F32, &[1, 3, 4], &range(0, 12));
        // A mask that selects nothing.
        assert_exact(&x.i(&x.gt(100.0)?)?, DType::F32, &[0], &[]);
        // A 0-d True adds a dim.
        assert_eq!(x.i(&Tensor::scalar(true, DType::Bool)?)?.shape(), &[1, 2, 3, 4]);
        assert_eq!(x.i(&Tensor::scalar(false, DType::Bool)?)?.shape(), &[0, 2, 3, 4]);
        assert_err(
            x.i(&Tensor::new([true, false, true])?),
            &["The shape of the mask [3] at index 0 does not match the shape of the indexed tensor [2, 3, 4] at index 0"],
        );
        Ok(())
    })
}

#[test]
fn advanced_index_errors() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        assert_err(x.i(idx(&[5])), &["index 5 is out of bounds for dimension 0 with size 2"]);
        assert_err(x.i((.., &idx(&[0, -4]))), &["index -4 is out of bounds for dimension 1 with size 3"]);
        assert_err(
            x.i((&idx(&[0, 1]), &idx(&[0, 1, 2]))),
            &["shape mismatch: indexing tensors could not be broadcast together with shapes [2], [3]"],
        );
        assert_err(x.i(&Tensor::new([1.0f32])?), &["tensors used as indices must be long, int, byte or bool tensors"]);
        Ok(())
    })
}

#[test]
fn index_with_optional_tensors() -> Result<()> {
    common::on_every_device(|| {
        let x = x234();
        assert_exact(
            &x.index(&[None, Some(&idx(&[0, 2])), Some(&idx(&[1, 3]))])?,
            DType::F32,
            &[2, 2],
            &[1.0, 11.0, 13.0, 23.0],
        );
        assert_exact(&x.index(&[Some(&idx(&[1]))])?, DType::F32, &[1, 3, 4], &range(12, 24));
        let m = x.i(0)?.gt(5.0)?;
        assert_eq!(x.index(&[None, Some(&m)])?.shape(), &[2, 6]);
        assert!(x.index(&[])?.same(&x));
        assert_err(x.index(&[None, None, None, Some(&idx(&[0]))]), &["too many indices for tensor of dimension 3"]);
        Ok(())
    })
}

#[test]
fn index_put() -> Result<()> {
    common::on_every_device(|| {
        // accumulate: duplicates add up.
        let y = Tensor::zeros(&[3, 4], DType::F32)?;
        y.index_put_(&[Some(&idx(&[0, 2, 0])), Some(&idx(&[1, 3, 1]))], &Tensor::new([1.0f32, 2.0, 3.0])?, true)?;
        assert_exact(&y, DType::F32, &[3, 4], &[0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]);
        // Separated advanced dims: y[[1, 0], :, [3, 0]] = arange(6).reshape(2, 3)
        let y = Tensor::zeros(&[2, 3, 4], DType::F32)?;
        let vals = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
        y.index_put_(&[Some(&idx(&[1, 0])), None, Some(&idx(&[3, 0]))], &vals, false)?;
        assert_exact(
            &y,
            DType::F32,
            &[2, 3, 4],
            &[
                3.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0,
                0.0, 0.0, 0.0, 2.0,
            ],
        );
        // Adjacent advanced dims after a full slice, values broadcast.
        let y = Tensor::zeros(&[2, 3, 4], DType::F32)?;
        y.index_put_(&[None, Some(&idx(&[0, 2])), Some(&idx(&[1, 3]))], &Tensor::new([5.0f32, 6.0])?, false)?;
        assert_exact(
            &y,
            DType::F32,
            &[2, 3, 4],
            &[
                0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0, 0.0, 6.0,
            ],
        );
        // A mask: y[y == 0] = 7; negative positions wrap.
        let y = Tensor::zeros(&[2, 3], DType::F32)?;
        y.index_put_(&[Some(&y.eq(0.0)?)], &Tensor::scalar(7.0, DType::F32)?, false)?;
        assert_exact(&y, DType::F32, &[2, 3], &[7.0; 6]);
        y.index_put_(&[None, Some(&idx(&[-1]))], &Tensor::scalar(1.0, DType::F32)?, true)?;
        assert_exact(&y, DType::F32, &[2, 3], &[7.0, 7.0, 8.0, 7.0, 7.0, 8.0]);
        // The out-of-place form leaves the input alone.
        let z = y.index_put(&[Some(&idx(&[0]))], &Tensor::scalar(0.0, DType::F32)?, false)?;
        assert!(!z.is_view());
        let z2 = y.index_put(&[Some(&idx(&[1, 0])), Some(&idx(&[2, 2]))], &Tensor::scalar(0.0, DType::F32)?, false)?;
        assert!(!z2.is_view());
        assert_exact(&z2, DType::F32, &[2, 3], &[7.0, 7.0, 0.0, 7.0, 7.0, 0.0]);
        assert_exact(&z, DType::F32, &[2, 3], &[0.0, 0.0, 0.0, 7.0, 7.0, 8.0]);
        assert_exact(&y.i(0)?, DType::F32, &[3], &[7.0, 7.0, 8.0]);
        Ok(())
    })
}

#[test]
fn index_put_through_a_view_and_errors() -> Result<()> {
    common::on_every_device(|| {
        let base = Tensor::zeros(&[3, 4], DType::F32)?;
        let view = base.i((.., 1..))?; // [3, 3]
        let v0 = base.version();
        view.index_put_(&[Some(&idx(&[2])), Some(&idx(&[0]))], &Tensor::scalar(9.0, DType::F32)?, false)?;
        assert!(base.version() > v0);
        assert_exact(&base.i(2)?, DType::F32, &[4], &[0.0, 9.0, 0.0, 0.0]);
        // i_put_ with basic and advanced items: base[1, [0, 3]] = [5, 6]
        base.i_put_((1, &idx(&[0, 3])), &Tensor::new([5.0f32, 6.0])?)?;
        assert_exact(&base.i(1)?, DType::F32, &[4], &[5.0, 0.0, 0.0, 6.0]);
        assert_err(
            base.index_put_(&[Some(&idx(&[0]))], &Tensor::scalar(1.0, DType::F64)?, false),
            &["Index put requires the source and destination dtypes match, got float32 for the destination and float64 for the source."],
        );
        assert_err(
            Tensor::zeros(&[3], DType::F32)?.index_put_(
                &[Some(&idx(&[0, 1]))],
                &Tensor::new([1.0f32, 2.0, 3.0])?,
                false,
            ),
            &["shape mismatch: value tensor of shape [3] cannot be broadcast to indexing result of shape [2]"],
        );
        assert_err(
            Tensor::zeros(&[3], DType::F32)?.index_put_(&[Some(&idx(&[3]))], &Tensor::scalar(1.0, DType::F32)?, false),
            &["index 3 is out of bounds for dimension 0 with size 3"],
        );
        Ok(())
    })
}

// ---- gather, scatter, index_select, index_add -----------------------------------------

#[test]
fn gather_and_scatter() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[3, 4])?;
        let g = Tensor::new([[2i64, 1, 0, 0], [1, 1, 1, 2]])?;
        assert_exact(&x.gather(0, &g)?, DType::F32, &[2, 4], &[8.0, 5.0, 2.0, 3.0, 4.0, 5.0, 6.0, 11.0]);
        let g1 = Tensor::new([[3i64, 0], [1, 1], [0, 2]])?;
        assert_exact(&x.gather(-1, &g1)?, DType::F32, &[3, 2], &[3.0, 0.0, 5.0, 5.0, 8.0, 10.0]);

        let src = Tensor::arange(1.0, 7.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
        let zeros = Tensor::zeros(&[3, 3], DType::F32)?;
        let si = Tensor::new([[0i64, 1, 2], [2, 0, 0]])?;
        assert_exact(
            &zeros.scatter(0, &si, &src)?,
            DType::F32,
            &[3, 3],
            &[1.0, 5.0, 6.0, 0.0, 2.0, 0.0, 4.0, 0.0, 3.0],
        );
        let sa = Tensor::new([[0i64, 1, 2], [0, 1, 0]])?;
        assert_exact(
            &zeros.scatter_add(0, &sa, &src)?,
            DType::F32,
            &[3, 3],
            &[5.0, 0.0, 6.0, 0.0, 7.0, 0.0, 0.0, 0.0, 3.0],
        );
        assert_exact(
            &zeros.scatter_value(1, &Tensor::new([[2i64], [0], [1]])?, 4.0)?,
            DType::F32,
            &[3, 3],
            &[0.0, 0.0, 4.0, 4.0, 0.0, 0.0, 0.0, 4.0, 0.0],
        );
        // In place, through a view.
        let base = Tensor::zeros(&[2, 3, 3], DType::F32)?;
        base.i(1)?.scatter_(0, &si, &src)?;
        assert_exact(&base.i(1)?, DType::F32, &[3, 3], &[1.0, 5.0, 6.0, 0.0, 2.0, 0.0, 4.0, 0.0, 3.0]);
        base.i(0)?.scatter_add_(0, &sa, &src)?;
        assert_exact(&base.i(0)?, DType::F32, &[3, 3], &[5.0, 0.0, 6.0, 0.0, 7.0, 0.0, 0.0, 0.0, 3.0]);
        assert_err(
            zeros.scatter(0, &si, &src.to_dtype(DType::F64)?),
            &["scatter", "Expected self.dtype to be equal to src.dtype"],
        );
        assert_err(x.gather(0, &g.to_dtype(DType::I32)?), &["gather", "int64"]);
        assert_err(x.gather(2, &g), &["dimension out of range"]);
        Ok(())
    })
}

#[test]
fn index_select_and_index_add() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::new([[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]])?;
        assert_exact(&x.index_select(0, &idx(&[2, 0, 2]))?, DType::F32, &[3, 2], &[5.0, 6.0, 1.0, 2.0, 5.0, 6.0]);
        assert_exact(&x.index_select(-1, &idx(&[1]))?, DType::F32, &[3, 1], &[2.0, 4.0, 6.0]);
        assert_exact(&x.index_select(1, &Tensor::scalar(0, DType::I64)?)?, DType::F32, &[3, 1], &[1.0, 3.0, 5.0]);
        assert_exact(&x.index_select(0, &Tensor::new([1i32])?)?, DType::F32, &[1, 2], &[3.0, 4.0]);
        assert_err(
            x.index_select(0, &Tensor::new([1.0f32])?),
            &["index_select", "Expected dtype int32 or int64 for index"],
        );

        let ones = Tensor::ones(&[3, 2], DType::F32)?;
        let src = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[3, 2])?;
        assert_exact(&ones.index_add(0, &idx(&[2, 0, 2]), &src)?, DType::F32, &[3, 2], &[3.0, 4.0, 1.0, 1.0, 5.0, 7.0]);
        let ones23 = Tensor::ones(&[2, 3], DType::F32)?;
        let src22 = Tensor::arange(0.0, 4.0, 1.0, DType::F32)?.reshape(&[2, 2])?;
        assert_exact(
            &ones23.index_add(1, &idx(&[2, 0]), &src22)?,
            DType::F32,
            &[2, 3],
            &[2.0, 1.0, 1.0, 4.0, 1.0, 3.0],
        );
        ones23.index_add_(1, &idx(&[2, 0]), &src22)?;
        assert_exact(&ones23, DType::F32, &[2, 3], &[2.0, 1.0, 1.0, 4.0, 1.0, 3.0]);
        assert_err(ones.index_add(0, &idx(&[0]), &src), &["index_add"]);
        Ok(())
    })
}

#[test]
fn masked_select_and_nonzero() -> Result<()> {
    common::on_every_device(|| {
        let x = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
        // The mask broadcasts.
        assert_exact(&x.masked_select(&Tensor::new([[true], [false]])?)?, DType::F32, &[3], &[0.0, 1.0, 2.0]);
        assert_exact(&x.masked_select(&x.ge(4.0)?)?, DType::F32, &[2], &[4.0, 5.0]);
        assert_exact(&x.masked_select(&Tensor::new([false, true, true])?)?, DType::F32, &[4], &[1.0, 2.0, 4.0, 5.0]);
        assert_err(x.masked_select(&Tensor::new([1u8, 0, 1])?), &["masked_select", "expected BoolTensor for mask"]);
        let nz = Tensor::new([[0.0f32, 1.0, 0.0], [2.0, 0.0, 3.0]])?.nonzero()?;
        assert_exact(&nz, DType::I64, &[3, 2], &[0.0, 1.0, 1.0, 0.0, 1.0, 2.0]);
        assert_exact(&Tensor::zeros(&[4], DType::F32)?.nonzero()?, DType::I64, &[0, 1], &[]);
        Ok(())
    })
}
