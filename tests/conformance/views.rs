//! Views: every view op gives PyTorch's shape, strides and storage offset, aliases
//! its base (a write through the view shows in the base, and the other way round),
//! and copies only where PyTorch copies.
use crate::common::{assert_err, assert_exact, f64s};
use crate::{iota, on_devices, t};
use kiln::prelude::*;

/// Asserts that `v` is a view of `base` with the given layout, then writes through
/// it and checks the write shows in `base` at the flat positions `touched`.
#[track_caller]
fn assert_aliases(v: &Tensor, base: &Tensor, shape: &[usize], strides: &[usize], offset: usize, touched: &[usize]) {
    assert_eq!(v.shape(), shape, "shape");
    assert_eq!(v.strides(), strides, "strides");
    assert_eq!(v.storage_offset(), offset, "storage offset");
    assert!(v.is_view() && v.shares_storage(base), "a view of its base");
    let before = f64s(base);
    let version = base.version();
    v.fill_(-7.0).expect("fill_ through a view");
    assert_eq!(base.version(), version + 1, "a write through the view bumps the shared version counter");
    assert_eq!(v.version(), base.version(), "views share the version counter");
    let after = f64s(base);
    for (i, (b, a)) in before.iter().zip(&after).enumerate() {
        let want = if touched.contains(&i) { -7.0 } else { *b };
        assert_eq!(*a, want, "base element {i} after writing through the view");
    }
    assert!(f64s(v).iter().all(|&x| x == -7.0));
}

#[test]
fn view_and_reshape() {
    on_devices(|dev| {
        let x = iota(&[2, 6], dev);
        let v = x.view(&[3, -1])?;
        assert_exact(&v, DType::F32, &[3, 4], &(0..12).map(f64::from).collect::<Vec<_>>());
        assert_aliases(&v, &x, &[3, 4], &[4, 1], 0, &(0..12).collect::<Vec<_>>());
        // A write to the base shows in the view.
        x.i((0, 0))?.fill_(42.0)?;
        assert_eq!(f64s(&v)[0], 42.0);

        let x = iota(&[3, 4], dev);
        let r = x.reshape(&[2, 2, 3])?;
        assert!(r.shares_storage(&x), "reshape of a contiguous tensor is a view");
        let tr = x.t()?;
        let c = tr.reshape(&[12])?;
        assert!(!c.shares_storage(&x), "reshape of a transposed tensor copies");
        assert_exact(&c, DType::F32, &[12], &[0.0, 4.0, 8.0, 1.0, 5.0, 9.0, 2.0, 6.0, 10.0, 3.0, 7.0, 11.0]);
        c.fill_(0.0)?;
        assert_eq!(f64s(&x)[1], 1.0, "writes to the copy do not reach the base");
        // view refuses what reshape copies, with PyTorch's advice.
        assert_err(tr.view(&[12]), &["view size is not compatible with input tensor's size and stride", ".reshape("]);
        // A transposed tensor still views when the merged dims are adjacent in memory.
        let ok = tr.view(&[4, 3, 1])?;
        assert_eq!(ok.strides()[..2], [1, 4]);
        // Splitting the stride-1 dim of a transposed tensor is a view too: strides [2, 1, 4].
        let ok = tr.reshape_to(&[2, 2, 3])?;
        assert!(ok.shares_storage(&x));
        assert_eq!(ok.strides(), &[2, 1, 4]);
        assert!(!tr.reshape_to(&[3, 4])?.shares_storage(&x));
        assert_exact(&x.reshape(&[-1])?, DType::F32, &[12], &f64s(&x));
        assert_err(x.view(&[-1, -1]), &["only one dimension can be inferred"]);
        assert_err(x.view(&[5, -1]), &["view", "invalid for input of size 12"]);
        assert_err(x.reshape(&[7]), &["reshape", "[7]", "invalid for input of size 12"]);
        // 0-d and empty tensors.
        let s = t(3.0f32, dev);
        assert_eq!(s.reshape(&[1, 1])?.shape(), &[1, 1]);
        assert_eq!(s.reshape(&[1])?.reshape(&[])?.shape(), &[] as &[usize]);
        assert_eq!(Tensor::zeros(&[0, 3], (DType::F32, dev))?.reshape(&[3, 0, 5])?.shape(), &[3, 0, 5]);
        Ok(())
    });
}

#[test]
fn permute_transpose_t() {
    on_devices(|dev| {
        let x = iota(&[2, 3, 4], dev);
        let p = x.permute(&[2, 0, -2])?;
        assert_eq!((p.shape(), p.strides()), (&[4, 2, 3][..], &[1, 12, 4][..]));
        assert!(!p.is_contiguous());
        assert_eq!(f64s(&p)[..4], [0.0, 4.0, 8.0, 12.0]);
        assert_aliases(&p.i(1)?, &x, &[2, 3], &[12, 4], 1, &[1, 5, 9, 13, 17, 21]);

        let x = iota(&[2, 3, 4], dev);
        let tr = x.transpose(0, -1)?;
        assert_eq!((tr.shape(), tr.strides()), (&[4, 3, 2][..], &[1, 4, 12][..]));
        assert!(tr.transpose(0, 2)?.is_contiguous());
        let m = iota(&[2, 3], dev);
        let mt = m.t()?;
        assert_exact(&mt, DType::F32, &[3, 2], &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_aliases(&mt.i(0)?, &m, &[2], &[3], 0, &[0, 3]);
        let v = iota(&[3], dev);
        assert!(v.t()?.shares_storage(&v), "t() of a 1-D tensor aliases it");
        assert_eq!(v.t()?.shape(), &[3]);
        assert_err(x.t(), &["t() expects a tensor with <= 2 dimensions, but self is 3D"]);
        assert_err(x.permute(&[0, 1]), &["permute", "3"]);
        assert_err(x.permute(&[0, 1, 1]), &["permute"]);
        assert_err(
            x.transpose(0, 3),
            &["transpose", "dimension out of range (expected to be in range of [-3, 2], but got 3)"],
        );
        Ok(())
    });
}

#[test]
fn narrow_and_select() {
    on_devices(|dev| {
        let x = iota(&[4, 3], dev);
        let n = x.narrow(0, -3, 2)?;
        assert_exact(&n, DType::F32, &[2, 3], &[3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        assert_aliases(&n, &x, &[2, 3], &[3, 1], 3, &[3, 4, 5, 6, 7, 8]);
        let x = iota(&[4, 3], dev);
        assert_aliases(&x.narrow(1, 1, 2)?, &x, &[4, 2], &[3, 1], 1, &[1, 2, 4, 5, 7, 8, 10, 11]);
        assert_eq!(x.narrow(1, 3, 0)?.shape(), &[4, 0]);
        assert_err(x.narrow(1, 2, 2), &["narrow", "start (2) + length (2) exceeds dimension size (3)"]);

        let x = iota(&[2, 3, 4], dev);
        let s = x.select(1, -1)?;
        assert_exact(&s, DType::F32, &[2, 4], &[8.0, 9.0, 10.0, 11.0, 20.0, 21.0, 22.0, 23.0]);
        assert_aliases(&s, &x, &[2, 4], &[12, 1], 8, &[8, 9, 10, 11, 20, 21, 22, 23]);
        let x = iota(&[3], dev);
        let e = x.select(0, 2)?;
        assert_eq!((e.shape(), e.storage_offset()), (&[] as &[usize], 2));
        assert_aliases(&e, &x, &[], &[], 2, &[2]);
        assert_err(x.select(0, 3), &["select", "index 3 is out of bounds for dimension 0 with size 3"]);
        assert_err(x.select(0, -4), &["index -4 is out of bounds"]);
        assert_err(t(1.0f32, dev).select(0, 0), &["select", "0-dim"]);
        Ok(())
    });
}

#[test]
fn slice_with_steps_and_negative_bounds() {
    on_devices(|dev| {
        let x = iota(&[10], dev);
        type Case = (Option<isize>, Option<isize>, isize, &'static [f64]);
        let cases: [Case; 7] = [
            (Some(-3), None, 1, &[7.0, 8.0, 9.0]),
            (Some(1), Some(-1), 2, &[1.0, 3.0, 5.0, 7.0]),
            (Some(-100), Some(100), 4, &[0.0, 4.0, 8.0]),
            (None, Some(3), 1, &[0.0, 1.0, 2.0]),
            (Some(6), Some(2), 1, &[]),
            (Some(9), None, 5, &[9.0]),
            (Some(12), None, 1, &[]),
        ];
        for (start, end, step, want) in cases {
            let s = x.slice(0, start, end, step)?;
            assert_exact(&s, DType::F32, &[want.len()], want);
            assert!(s.shares_storage(&x));
        }
        assert_aliases(&x.slice(0, Some(1), None, 3)?, &x, &[3], &[3], 1, &[1, 4, 7]);
        // The indexing form: x[1::3] and x[:, ::2].
        let x = iota(&[10], dev);
        assert_aliases(&x.i(s(1, None, 3))?, &x, &[3], &[3], 1, &[1, 4, 7]);
        let m = iota(&[2, 5], dev);
        assert_aliases(&m.i((.., s(None, None, 2)))?, &m, &[2, 3], &[5, 2], 0, &[0, 2, 4, 5, 7, 9]);
        let m = iota(&[2, 5], dev);
        assert_aliases(&m.i((-1, 1..=2))?, &m, &[2], &[1], 6, &[6, 7]);
        assert_err(x.slice(0, None, None, 0), &["slice", "step must be positive"]);
        assert_err(x.slice(0, None, None, -1), &["step must be positive"]);
        Ok(())
    });
}

#[test]
fn expand_and_broadcast_to() {
    on_devices(|dev| {
        let x = t([[1.0f32], [2.0], [3.0]], dev);
        let e = x.expand(&[2, -1, 4])?;
        assert_eq!((e.shape(), e.strides()), (&[2, 3, 4][..], &[0, 1, 0][..]));
        assert!(e.shares_storage(&x) && e.is_view() && !e.is_contiguous());
        assert_eq!(f64s(&e)[..8], [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]);
        // The view reads the base's current values.
        x.i(0)?.fill_(9.0)?;
        assert_eq!(f64s(&e)[0], 9.0);
        let b = t([1i64, 2, 3], dev).broadcast_to(&[2, 3])?;
        assert_exact(&b, DType::I64, &[2, 3], &[1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        assert_eq!(b.strides(), &[0, 1]);
        let like = iota(&[5, 3, 1], dev);
        assert_eq!(x.expand_as(&like)?.shape(), &[5, 3, 1]);
        assert_err(x.expand(&[-1, 3, 1]), &["expand", "-1 isn't allowed in a leading, non-existing dimension"]);
        assert_err(x.expand(&[2, 4]), &["expand", "must match the existing size (3) at non-singleton dimension 0"]);
        assert_err(x.expand(&[4]), &["expand", "number of sizes provided (1)"]);
        Ok(())
    });
}

#[test]
fn squeeze_unsqueeze_flatten_unflatten() {
    on_devices(|dev| {
        let x = iota(&[2, 1, 3, 1], dev);
        assert_eq!(x.squeeze()?.shape(), &[2, 3]);
        assert_eq!(x.squeeze_dim(1)?.shape(), &[2, 3, 1]);
        assert_eq!(x.squeeze_dim(-1)?.shape(), &[2, 1, 3]);
        assert_eq!(x.squeeze_dim(0)?.shape(), &[2, 1, 3, 1], "squeezing a dim of size != 1 is a no-op");
        assert_aliases(&x.squeeze()?, &x, &[2, 3], &[3, 1], 0, &[0, 1, 2, 3, 4, 5]);
        let x = iota(&[2, 3], dev);
        assert_eq!(x.unsqueeze(0)?.shape(), &[1, 2, 3]);
        assert_eq!(x.unsqueeze(-1)?.shape(), &[2, 3, 1]);
        let u = x.unsqueeze(1)?;
        assert_eq!(u.shape(), &[2, 1, 3]);
        assert!(u.is_contiguous());
        assert_aliases(&u, &x, &[2, 1, 3], &[3, 3, 1], 0, &[0, 1, 2, 3, 4, 5]);
        assert_eq!(t(1.0f32, dev).unsqueeze(0)?.shape(), &[1]);
        assert_err(
            x.unsqueeze(3),
            &["unsqueeze", "dimension out of range (expected to be in range of [-3, 2], but got 3)"],
        );

        let x = iota(&[2, 3, 4], dev);
        let f = x.flatten(1, 2)?;
        assert_eq!(f.shape(), &[2, 12]);
        assert!(f.shares_storage(&x), "flatten of contiguous dims is a view");
        assert_eq!(x.flatten(0, -1)?.shape(), &[24]);
        assert_eq!(t(5.0f32, dev).flatten(0, -1)?.shape(), &[1]);
        let ft = x.transpose(1, 2)?.flatten(1, 2)?;
        assert!(!ft.shares_storage(&x), "flatten of a transposed tensor copies");
        assert_eq!(f64s(&ft)[..4], [0.0, 4.0, 8.0, 1.0]);
        assert_err(x.flatten(2, 1), &["flatten", "start_dim cannot come after end_dim"]);
        let u = f.unflatten(1, &[3, -1])?;
        assert_eq!(u.shape(), &[2, 3, 4]);
        assert!(u.shares_storage(&x));
        assert_err(f.unflatten(1, &[5, -1]), &["unflatten"]);
        Ok(())
    });
}

#[test]
fn chunk_and_split() {
    on_devices(|dev| {
        let x = iota(&[7, 2], dev);
        let sizes = |v: &[Tensor]| v.iter().map(|c| c.shape()[0]).collect::<Vec<_>>();
        let c = x.chunk(3, 0)?;
        assert_eq!(sizes(&c), vec![3, 3, 1]);
        // PyTorch's rule: chunks of ceil(n / chunks), so 6 in 4 chunks gives 3 chunks of 2.
        assert_eq!(sizes(&iota(&[6], dev).chunk(4, 0)?), vec![2, 2, 2]);
        assert_eq!(sizes(&iota(&[2], dev).chunk(5, 0)?), vec![1, 1]);
        assert_aliases(&c[1], &x, &[3, 2], &[2, 1], 6, &[6, 7, 8, 9, 10, 11]);
        let x = iota(&[7, 2], dev);
        let s = x.split(2, 0)?;
        assert_eq!(sizes(&s), vec![2, 2, 2, 1]);
        assert_exact(&s[3], DType::F32, &[1, 2], &[12.0, 13.0]);
        let cols = x.split(1, -1)?;
        assert_eq!(cols.len(), 2);
        assert_aliases(&cols[1], &x, &[7, 1], &[2, 1], 1, &[1, 3, 5, 7, 9, 11, 13]);
        let x = iota(&[7, 2], dev);
        let s = x.split_sizes(&[1, 4, 2], 0)?;
        assert_eq!(sizes(&s), vec![1, 4, 2]);
        assert_eq!(s[2].storage_offset(), 10);
        assert_err(x.split_sizes(&[1, 2], 0), &["split", "[1, 2]", "7"]);
        assert_err(x.chunk(0, 0), &["chunk", "greater than 0"]);
        Ok(())
    });
}

#[test]
fn diagonal_views() {
    on_devices(|dev| {
        let x = iota(&[3, 4], dev);
        assert_exact(&x.diagonal(0, 0, 1)?, DType::F32, &[3], &[0.0, 5.0, 10.0]);
        assert_exact(&x.diagonal(1, 0, 1)?, DType::F32, &[3], &[1.0, 6.0, 11.0]);
        assert_exact(&x.diagonal(-1, 0, 1)?, DType::F32, &[2], &[4.0, 9.0]);
        assert_exact(&x.diagonal(0, 1, 0)?, DType::F32, &[3], &[0.0, 5.0, 10.0]);
        assert_eq!(x.diagonal(5, 0, 1)?.shape(), &[0]);
        assert_aliases(&x.diagonal(1, 0, 1)?, &x, &[3], &[5], 1, &[1, 6, 11]);
        // Batched: the diagonal dim goes last.
        let b = iota(&[2, 2, 2], dev);
        let d = b.diagonal(0, 1, 2)?;
        assert_exact(&d, DType::F32, &[2, 2], &[0.0, 3.0, 4.0, 7.0]);
        assert_eq!(d.strides(), &[4, 3]);
        assert_err(x.diagonal(0, 1, 1), &["diagonal", "cannot be identical"]);
        Ok(())
    });
}

#[test]
fn as_strided_views() {
    on_devices(|dev| {
        let x = iota(&[12], dev);
        let w = x.as_strided(&[4, 3], &[2, 1], None)?;
        assert_exact(&w, DType::F32, &[4, 3], &[0.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 5.0, 6.0, 6.0, 7.0, 8.0]);
        assert!(w.shares_storage(&x) && w.is_view());
        assert_aliases(&x.as_strided(&[2, 2], &[4, 2], Some(1))?, &x, &[2, 2], &[4, 2], 1, &[1, 3, 5, 7]);
        // The offset of a view is absolute in the storage (PyTorch's rule), and
        // `None` keeps the current one.
        let x = iota(&[12], dev);
        let n = x.narrow(0, 2, 5)?;
        assert_eq!(n.as_strided(&[2], &[1], None)?.storage_offset(), 2);
        assert_exact(&n.as_strided(&[2], &[3], Some(0))?, DType::F32, &[2], &[0.0, 3.0]);
        assert_err(x.as_strided(&[5], &[3], None), &["as_strided", "storage"]);
        assert_err(x.as_strided(&[2, 2], &[1], None), &["as_strided", "mismatch in length of strides and shape"]);
        Ok(())
    });
}

#[test]
fn contiguous_copies_only_when_needed() {
    on_devices(|dev| {
        let x = iota(&[2, 3], dev);
        assert!(x.is_contiguous());
        assert!(x.contiguous()?.same(&x), "contiguous() of a contiguous tensor is the tensor itself");
        let tr = x.t()?;
        assert!(!tr.is_contiguous());
        let c = tr.contiguous()?;
        assert!(c.is_contiguous() && !c.shares_storage(&x) && !c.is_view());
        assert_eq!(c.strides(), &[2, 1]);
        assert_exact(&c, DType::F32, &[3, 2], &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        // Size-1 dims may have any stride and still be contiguous, as in PyTorch.
        assert!(x.i(0..1)?.is_contiguous());
        assert!(x.i(1..2)?.t()?.is_contiguous(), "[3, 1] with strides [1, 3]");
        assert!(!x.i((.., 1..2))?.is_contiguous(), "[2, 1] with strides [3, 1]");
        assert!(!x.i((.., 0..2))?.is_contiguous());
        let d = x.deep_clone()?;
        assert!(!d.shares_storage(&x) && d.is_contiguous());
        assert_eq!(f64s(&d), f64s(&x));
        Ok(())
    });
}

#[test]
fn views_of_views_share_the_root_base() {
    on_devices(|dev| {
        // A tensor that is no view (iota is a reshape of arange, so a view).
        let x = Tensor::from_vec((0..24).map(|v| v as f32).collect::<Vec<_>>(), &[4, 6])?.to_device(dev)?;
        let v = x.t()?.narrow(0, 1, 3)?.select(1, 2)?;
        assert!(v.base().is_some_and(|b| b.same(&x)), "a chained view's base is the root tensor");
        assert_aliases(&v, &x, &[3], &[1], 13, &[13, 14, 15]);
        assert!(x.base().is_none() && !x.is_view());
        // A view of a view (iota's reshape of arange) has the same root.
        let y = iota(&[4, 6], dev);
        let root = y.base().expect("a reshape of arange is a view").clone();
        assert!(y.t()?.i(0)?.base().is_some_and(|b| b.same(&root)));
        // A detached tensor shares the data but not the identity.
        let d = x.detach();
        assert!(d.shares_storage(&x) && !d.same(&x));
        Ok(())
    });
}
