//! Indexing: `x.i((.., 1..3))` (Python's `x[:, 1:3]`) with basic and advanced
//! indices, `index`/`index_put_`, gather, scatter, index_select, index_add,
//! masked_select and nonzero.
//!
//! Basic indexing (integers, ranges, stepped slices, `NewAxis`, `Ellipsis`)
//! returns a view, so slice assignment is `x.i((.., 1..3))?.copy_(&v)?` (or any
//! in-place op on the view). Advanced indexing (int64 index tensors, bool masks)
//! returns a copy, built from `IndexSelect` on a flattened view, and writes go
//! through [`Tensor::index_put_`].
use crate::error::fmt_shape;
use crate::reduce::{reshape_input, reshape_result};
use crate::{wrap_dim, DType, Error, Op, Result, Scalar, ScatterReduce, Shape, Tensor};
use smallvec::SmallVec;
use std::ops::{Range, RangeFrom, RangeFull, RangeInclusive, RangeTo, RangeToInclusive};

/// One item of an index expression (see [`Tensor::i`]).
///
/// Integers select (`x[2]`), ranges slice (`x[1:3]`), [`IndexItem::Slice`]
/// slices with a step (`x[::2]`, built with [`s`] or [`IndexItem::slice`]),
/// `NewAxis` inserts a size-1 dim (`x[None]`), `Ellipsis` stands for as many
/// full slices as needed (`x[..., 0]`), and a tensor is an advanced index: an
/// integer tensor picks positions, a bool tensor is a mask.
#[derive(Debug, Clone)]
pub enum IndexItem {
    /// One position (negative counts from the end); removes the dim.
    Select(isize),
    /// Python's `start:end:step`: `None` bounds mean the ends, negative bounds
    /// count from the end, out-of-range bounds are clamped; `step >= 1`.
    Slice { start: Option<isize>, end: Option<isize>, step: isize },
    /// Inserts a dim of size 1 (`None` / `np.newaxis` in Python).
    NewAxis,
    /// `...`: full slices over every dim not otherwise indexed.
    Ellipsis,
    /// An integer tensor (positions along one dim) or a bool/uint8 mask (over as
    /// many dims as it has).
    Tensor(Tensor),
}

impl IndexItem {
    /// A stepped slice `start:end:step`: `IndexItem::slice(None, None, 2)` is Python's `::2`.
    pub fn slice(start: impl SliceBound, end: impl SliceBound, step: isize) -> IndexItem {
        IndexItem::Slice { start: start.bound(), end: end.bound(), step }
    }

    /// Dims of the indexed tensor this item consumes.
    fn consumed(&self) -> usize {
        match self {
            IndexItem::Select(_) | IndexItem::Slice { .. } => 1,
            IndexItem::NewAxis | IndexItem::Ellipsis => 0,
            IndexItem::Tensor(t) if is_mask(t) => t.ndim(),
            IndexItem::Tensor(_) => 1,
        }
    }
}

/// A bound of a stepped slice: an integer, or `None` for "to the end".
pub trait SliceBound {
    fn bound(self) -> Option<isize>;
}
impl SliceBound for Option<isize> {
    fn bound(self) -> Option<isize> {
        self
    }
}
/// An index or bound as `isize`. A `usize` beyond `isize::MAX` becomes
/// `isize::MAX`, which is past the end of any dim: an out-of-range position
/// (an error) or a clamped bound, never a negative index counting from the end.
trait ToIndex {
    fn to_index(self) -> isize;
}
macro_rules! to_index {
    ($($t:ty),*) => {$(
        impl ToIndex for $t {
            fn to_index(self) -> isize {
                isize::try_from(self).unwrap_or(isize::MAX)
            }
        }
    )*};
}
to_index!(i32, i64, isize, usize);

macro_rules! slice_bound {
    ($($t:ty),*) => {$(
        impl SliceBound for $t {
            fn bound(self) -> Option<isize> {
                Some(self.to_index())
            }
        }
    )*};
}
slice_bound!(i32, i64, isize, usize);

/// Python's stepped slice `start:end:step` as an index item:
/// `x.i(s(None, None, 2))` is `x[::2]`, `x.i((.., s(1, -1, 3)))` is `x[:, 1:-1:3]`.
///
/// ```
/// use kiln::prelude::*;
/// let x = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?;
/// assert_eq!(x.i(s(None, None, 2))?.to_vec::<f32>()?, vec![0.0, 2.0, 4.0]);
/// assert_eq!(x.i(s(1, -1, 3))?.to_vec::<f32>()?, vec![1.0, 4.0]);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn s(start: impl SliceBound, end: impl SliceBound, step: isize) -> IndexItem {
    IndexItem::slice(start, end, step)
}

macro_rules! item_from_int {
    ($($t:ty),*) => {$(
        impl From<$t> for IndexItem {
            fn from(i: $t) -> Self {
                IndexItem::Select(i.to_index())
            }
        }
        impl From<Range<$t>> for IndexItem {
            fn from(r: Range<$t>) -> Self {
                IndexItem::Slice { start: Some(r.start.to_index()), end: Some(r.end.to_index()), step: 1 }
            }
        }
        impl From<RangeFrom<$t>> for IndexItem {
            fn from(r: RangeFrom<$t>) -> Self {
                IndexItem::Slice { start: Some(r.start.to_index()), end: None, step: 1 }
            }
        }
        impl From<RangeTo<$t>> for IndexItem {
            fn from(r: RangeTo<$t>) -> Self {
                IndexItem::Slice { start: None, end: Some(r.end.to_index()), step: 1 }
            }
        }
        impl From<RangeInclusive<$t>> for IndexItem {
            fn from(r: RangeInclusive<$t>) -> Self {
                IndexItem::Slice { start: Some(r.start().to_index()), end: inclusive_end(r.end().to_index()), step: 1 }
            }
        }
        impl From<RangeToInclusive<$t>> for IndexItem {
            fn from(r: RangeToInclusive<$t>) -> Self {
                IndexItem::Slice { start: None, end: inclusive_end(r.end.to_index()), step: 1 }
            }
        }
    )*};
}
item_from_int!(i32, i64, isize, usize);

/// `..=e` as an exclusive end: `..=-1` runs to the end (not to `..0`).
fn inclusive_end(e: isize) -> Option<isize> {
    if e == -1 {
        None
    } else {
        Some(e.saturating_add(1))
    }
}

impl From<RangeFull> for IndexItem {
    fn from(_: RangeFull) -> Self {
        IndexItem::Slice { start: None, end: None, step: 1 }
    }
}
impl From<&Tensor> for IndexItem {
    fn from(t: &Tensor) -> Self {
        IndexItem::Tensor(t.clone())
    }
}
impl From<Tensor> for IndexItem {
    fn from(t: Tensor) -> Self {
        IndexItem::Tensor(t)
    }
}

/// Types usable as an index expression in [`Tensor::i`]: one item (an integer,
/// a range, an [`IndexItem`], a `&Tensor`), a tuple of up to 6 items, or a
/// `Vec`/slice of [`IndexItem`]s.
pub trait TensorIndex {
    /// The items of the expression, left to right.
    fn into_items(self) -> SmallVec<[IndexItem; 6]>;
}

macro_rules! index_single {
    ($($t:ty),*) => {$(
        impl TensorIndex for $t {
            fn into_items(self) -> SmallVec<[IndexItem; 6]> {
                smallvec::smallvec![self.into()]
            }
        }
    )*};
}
index_single!(IndexItem, RangeFull, &Tensor, Tensor);
macro_rules! index_single_int {
    ($($t:ty),*) => {$(
        index_single!($t, Range<$t>, RangeFrom<$t>, RangeTo<$t>, RangeInclusive<$t>, RangeToInclusive<$t>);
    )*};
}
index_single_int!(i32, i64, isize, usize);

impl TensorIndex for Vec<IndexItem> {
    fn into_items(self) -> SmallVec<[IndexItem; 6]> {
        self.into_iter().collect()
    }
}
impl TensorIndex for &[IndexItem] {
    fn into_items(self) -> SmallVec<[IndexItem; 6]> {
        self.iter().cloned().collect()
    }
}

macro_rules! index_tuple {
    ($($name:ident),+) => {
        impl<$($name: Into<IndexItem>),+> TensorIndex for ($($name,)+) {
            #[allow(non_snake_case)]
            fn into_items(self) -> SmallVec<[IndexItem; 6]> {
                let ($($name,)+) = self;
                smallvec::smallvec![$($name.into()),+]
            }
        }
    };
}
index_tuple!(A);
index_tuple!(A, B);
index_tuple!(A, B, C);
index_tuple!(A, B, C, D);
index_tuple!(A, B, C, D, E);
index_tuple!(A, B, C, D, E, F);

/// Bool (and, as in PyTorch, uint8) index tensors are masks.
fn is_mask(t: &Tensor) -> bool {
    matches!(t.dtype(), DType::Bool | DType::U8)
}

/// An integer index tensor as int64 on `device`.
fn to_index(op: &'static str, t: &Tensor, x: &Tensor) -> Result<Tensor> {
    if !t.dtype().is_int() {
        return Err(Error::index(
            op,
            format!("tensors used as indices must be long, int, byte or bool tensors, got {}", t.dtype()),
        ));
    }
    t.to_dtype(DType::I64)?.to_device(x.device())
}

/// Advanced indices after masks were turned into integer indices: the dims of
/// the indexed tensor they apply to (increasing), and for each an int64 tensor
/// with negative positions wrapped, all broadcast to one shape.
struct Advanced {
    dims: SmallVec<[usize; 6]>,
    idx: Vec<Tensor>,
    /// The broadcast shape of the index tensors.
    shape: Shape,
}

impl Advanced {
    /// Builds the advanced part of an index over `x` from `(dim, tensor)` pairs
    /// (dims increasing; a mask starts at its dim and spans `mask.ndim()` dims).
    fn new(op: &'static str, x: &Tensor, items: Vec<(usize, Tensor)>) -> Result<Advanced> {
        let mut dims = SmallVec::new();
        let mut idx = vec![];
        // Positions that come from a mask are in range by construction.
        let mut checked = vec![];
        for (d, t) in items {
            if is_mask(&t) {
                let want = &x.shape()[d..d + t.ndim()];
                if t.shape() != want {
                    return Err(Error::index(
                        op,
                        format!(
                            "The shape of the mask {} at index {d} does not match the shape of the indexed tensor {} at index {d}",
                            fmt_shape(t.shape()),
                            fmt_shape(x.shape())
                        ),
                    ));
                }
                let nz = t.nonzero()?;
                for j in 0..t.ndim() {
                    dims.push(d + j);
                    idx.push(nz.select(1, j as isize)?);
                    checked.push(true);
                }
            } else {
                dims.push(d);
                idx.push(to_index(op, &t, x)?);
                checked.push(false);
            }
        }
        let mut shape: Shape = idx.first().map(|t| t.shape().into()).unwrap_or_default();
        for t in idx.iter().skip(1) {
            shape = crate::broadcast_shapes(op, &shape, t.shape()).map_err(|_| {
                let shapes: Vec<String> = idx.iter().map(|t| fmt_shape(t.shape())).collect();
                Error::index(
                    op,
                    format!(
                        "shape mismatch: indexing tensors could not be broadcast together with shapes {}",
                        shapes.join(", ")
                    ),
                )
            })?;
        }
        let mut wrapped = Vec::with_capacity(idx.len());
        for ((t, &d), &ok) in idx.iter().zip(&dims).zip(&checked) {
            let t = if ok { t.clone() } else { wrap_positions(op, t, d, x.shape()[d])? };
            wrapped.push(t.broadcast_to(&shape)?);
        }
        Ok(Advanced { dims, idx: wrapped, shape })
    }

    /// True when the advanced dims are consecutive: the index shape then replaces
    /// them in place; otherwise it goes first (NumPy's and PyTorch's rule).
    fn adjacent(&self) -> bool {
        self.dims.windows(2).all(|w| w[1] == w[0] + 1)
    }

    /// The shape of `x[index]` for a tensor of shape `xs`.
    fn result_shape(&self, xs: &[usize]) -> Shape {
        let rest: Shape = (0..xs.len()).filter(|d| !self.dims.contains(d)).map(|d| xs[d]).collect();
        let mut out = Shape::new();
        if self.adjacent() {
            let first = self.dims[0];
            out.extend_from_slice(&xs[..first]);
            out.extend_from_slice(&self.shape);
            out.extend_from_slice(&rest[first..]);
        } else {
            out.extend_from_slice(&self.shape);
            out.extend_from_slice(&rest);
        }
        out
    }

    /// Flattens the advanced dims of `x` into one dim at position `ax` (the first
    /// advanced dim when they are adjacent, else 0) and returns
    /// `(flat, ax, linear_index)`: `flat` is `x` permuted and reshaped (a view
    /// when the strides allow, else a copy), `linear_index` the 1-D int64
    /// positions along `ax` in `flat`.
    fn flatten(&self, x: &Tensor) -> Result<(Tensor, usize, Tensor)> {
        let n = x.ndim();
        let ax = if self.adjacent() { self.dims[0] } else { 0 };
        // Permutation: the dims before `ax`, the advanced dims, the rest.
        let rest: SmallVec<[usize; 6]> = (0..n).filter(|d| !self.dims.contains(d)).collect();
        let mut perm: SmallVec<[isize; 6]> = rest[..ax].iter().map(|&d| d as isize).collect();
        perm.extend(self.dims.iter().map(|&d| d as isize));
        perm.extend(rest[ax..].iter().map(|&d| d as isize));
        let xp = if perm.iter().enumerate().all(|(i, &p)| p == i as isize) { x.clone() } else { x.permute(&perm)? };
        let sizes: SmallVec<[usize; 6]> = self.dims.iter().map(|&d| x.shape()[d]).collect();
        let mut flat_shape: Shape = xp.shape()[..ax].into();
        flat_shape.push(sizes.iter().product());
        flat_shape.extend_from_slice(&xp.shape()[ax + sizes.len()..]);
        let flat = reshape_input(&xp, &flat_shape)?;
        // Row-major linear position over the advanced dims.
        let mut lin: Option<Tensor> = None;
        let mut stride = 1usize;
        for (t, &size) in self.idx.iter().zip(&sizes).rev() {
            let term = if stride == 1 { t.clone() } else { t.mul(stride as i64)? };
            lin = Some(match lin {
                None => term,
                Some(l) => l.add(&term)?,
            });
            stride *= size;
        }
        let lin = lin.expect("at least one advanced index").reshape(&[-1])?;
        Ok((flat, ax, lin))
    }
}

/// Checks `t`'s positions against a dim of `size` and wraps negative ones.
///
/// Note [Index bounds on the host]: positions are checked here, reading the
/// index's min and max, because advanced indices over several dims are combined
/// into one linear position, where an out-of-range component could land inside
/// the tensor and silently read the wrong element. This is a synchronisation
/// point on asynchronous backends, as it is in PyTorch on CPU.
fn wrap_positions(op: &'static str, t: &Tensor, dim: usize, size: usize) -> Result<Tensor> {
    if t.numel() == 0 {
        return Ok(t.clone());
    }
    let (lo, hi) = (t.min()?.item::<i64>()?, t.max()?.item::<i64>()?);
    let n = size as i64;
    for v in [hi, lo] {
        if v >= n || v < -n {
            return Err(Error::index(op, format!("index {v} is out of bounds for dimension {dim} with size {size}")));
        }
    }
    if lo >= 0 {
        return Ok(t.clone());
    }
    Tensor::where_cond(&t.lt(0)?, &t.add(n)?, t)
}

/// PyTorch refuses to convert the values of an index assignment implicitly.
fn check_put_dtype(op: &'static str, x: &Tensor, values: &Tensor) -> Result<()> {
    if values.dtype() != x.dtype() {
        return Err(Error::dtype(
            op,
            format!(
                "Index put requires the source and destination dtypes match, got {} for the destination and {} for the source.",
                x.dtype(),
                values.dtype()
            ),
        ));
    }
    Ok(())
}

/// Shape `s` with `dim` replaced by `len`.
fn with_dim(s: &[usize], dim: usize, len: usize) -> Shape {
    let mut out: Shape = s.into();
    out[dim] = len;
    out
}

impl Tensor {
    /// Indexes like Python's `x[...]`: basic items (integers, ranges, stepped
    /// slices, `NewAxis`, `Ellipsis`) give a **view** of `self`; tensor items
    /// (int64 positions, bool masks) give a copy with PyTorch's advanced-indexing
    /// rules (index tensors broadcast together; their shape replaces the indexed
    /// dims when those are adjacent, else it goes first).
    ///
    /// Negative integers and range bounds count from the end. Because basic
    /// indexing returns a view, assignment is an in-place op on the view:
    /// `x.i((.., 1..3))?.copy_(&v)?` is `x[:, 1:3] = v`. For advanced indices, use
    /// [`Tensor::i_put_`] or [`Tensor::index_put_`].
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[3, 4])?;
    /// assert_eq!(x.i(1)?.to_vec::<f32>()?, vec![4.0, 5.0, 6.0, 7.0]);                    // x[1]
    /// assert_eq!(x.i((.., 1..3))?.shape(), &[3, 2]);                                     // x[:, 1:3]
    /// assert_eq!(x.i((-1, s(None, None, 2)))?.to_vec::<f32>()?, vec![8.0, 10.0]);        // x[-1, ::2]
    /// assert_eq!(x.i((IndexItem::Ellipsis, IndexItem::NewAxis))?.shape(), &[3, 4, 1]);   // x[..., None]
    /// let idx = Tensor::new([2i64, 0])?;
    /// assert_eq!(x.i((&idx, 0))?.to_vec::<f32>()?, vec![8.0, 0.0]);                      // x[[2, 0], 0]
    /// let mask = x.gt(9.0)?;
    /// assert_eq!(x.i(&mask)?.to_vec::<f32>()?, vec![10.0, 11.0]);                        // x[x > 9]
    /// x.i((.., 0))?.fill_(-1.0)?;                                                        // x[:, 0] = -1
    /// assert_eq!(x.i((.., 0))?.to_vec::<f32>()?, vec![-1.0; 3]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn i(&self, index: impl TensorIndex) -> Result<Tensor> {
        let (view, adv) = self.apply_basic("index", &index.into_items())?;
        if adv.is_empty() {
            return Ok(view);
        }
        view.index_advanced("index", adv)
    }

    /// Assignment through an index expression, Python's `x[index] = values`:
    /// `values` is broadcast to the shape of `x.i(index)` and written into `self`
    /// (through views, bumping the version). With only basic items this is
    /// `self.i(index)?.copy_(values)`; with tensor items it is
    /// [`Tensor::index_put_`] on the basic view (later duplicates win).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::zeros(&[2, 3], DType::F32)?;
    /// let idx = Tensor::new([0i64, 2])?;
    /// x.i_put_((1, &idx), &Tensor::new([5.0f32, 6.0])?)?;  // x[1, [0, 2]] = [5, 6]
    /// assert_eq!(x.to_vec::<f32>()?, vec![0.0, 0.0, 0.0, 5.0, 0.0, 6.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn i_put_(&self, index: impl TensorIndex, values: &Tensor) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let (view, adv) = self.apply_basic("index_put_", &index.into_items())?;
        if adv.is_empty() {
            view.copy_(values)?;
        } else {
            let a = Advanced::new("index_put_", &view, adv)?;
            let r = view.index_put_impl(&a, values, false)?;
            view.copy_(&r)?;
        }
        Ok(self)
    }

    /// Applies the basic items of an index expression as views; returns the view
    /// and the advanced items as `(dim in the view, tensor)`.
    fn apply_basic(&self, op: &'static str, items: &[IndexItem]) -> Result<(Tensor, Vec<(usize, Tensor)>)> {
        let ellipses = items.iter().filter(|it| matches!(it, IndexItem::Ellipsis)).count();
        if ellipses > 1 {
            return Err(Error::index(op, "an index can only have a single ellipsis ('...')"));
        }
        let consumed: usize = items.iter().map(IndexItem::consumed).sum();
        if consumed > self.ndim() {
            return Err(Error::index(op, format!("too many indices for tensor of dimension {}", self.ndim())));
        }
        let mut v = self.clone();
        let mut dim = 0usize;
        // Dims of the original tensor, for error messages.
        let mut orig = 0usize;
        let mut adv = vec![];
        for it in items {
            match it {
                IndexItem::Select(i) => {
                    let n = v.shape()[dim] as isize;
                    if *i < -n || *i >= n {
                        return Err(Error::index(
                            op,
                            format!("index {i} is out of bounds for dimension {orig} with size {n}"),
                        ));
                    }
                    v = v.select(dim as isize, *i)?;
                    orig += 1;
                }
                IndexItem::Slice { start, end, step } => {
                    if *step <= 0 {
                        return Err(Error::invalid(op, format!("step must be greater than zero, got {step}")));
                    }
                    v = v.slice(dim as isize, *start, *end, *step)?;
                    dim += 1;
                    orig += 1;
                }
                IndexItem::NewAxis => {
                    v = v.unsqueeze(dim as isize)?;
                    dim += 1;
                }
                IndexItem::Ellipsis => {
                    let skip = self.ndim() - consumed;
                    dim += skip;
                    orig += skip;
                }
                IndexItem::Tensor(t) if is_mask(t) && t.ndim() == 0 => {
                    // `x[True]` adds a dim of size 1, `x[False]` one of size 0.
                    v = v.unsqueeze(dim as isize)?;
                    if t.to_vec_f64()?[0] == 0.0 {
                        v = v.slice(dim as isize, Some(0), Some(0), 1)?;
                    }
                    dim += 1;
                }
                IndexItem::Tensor(t) => {
                    let k = it.consumed();
                    adv.push((dim, t.clone()));
                    dim += k;
                    orig += k;
                }
            }
        }
        Ok((v, adv))
    }

    fn index_advanced(&self, op: &'static str, items: Vec<(usize, Tensor)>) -> Result<Tensor> {
        let a = Advanced::new(op, self, items)?;
        let out_shape = a.result_shape(self.shape());
        if a.dims.len() == 1 {
            // One index tensor: a plain index_select along its dim.
            let d = a.dims[0];
            let r = self.index_select(d as isize, &reshape_input(&a.idx[0], &[a.idx[0].numel()])?)?;
            return reshape_result(r, &out_shape);
        }
        let (flat, ax, lin) = a.flatten(self)?;
        reshape_result(flat.index_select(ax as isize, &lin)?, &out_shape)
    }

    /// `x[indices]` with one optional index tensor per leading dim (PyTorch's
    /// `Tensor.index`, the C++ form of advanced indexing): `None` keeps a dim
    /// whole, an integer tensor picks positions, a bool tensor is a mask over as
    /// many dims as it has.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::arange(0.0, 6.0, 1.0, DType::F32)?.reshape(&[2, 3])?;
    /// let cols = Tensor::new([2i64, 0])?;
    /// let y = x.index(&[None, Some(&cols)])?;          // x[:, [2, 0]]
    /// assert_eq!(y.to_vec::<f32>()?, vec![2.0, 0.0, 5.0, 3.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn index(&self, indices: &[Option<&Tensor>]) -> Result<Tensor> {
        let items = self.index_items("index", indices)?;
        if items.is_empty() {
            return Ok(self.clone());
        }
        self.index_advanced("index", items)
    }

    /// Resolves `index`-style optional tensors into `(dim, tensor)` pairs.
    fn index_items(&self, op: &'static str, indices: &[Option<&Tensor>]) -> Result<Vec<(usize, Tensor)>> {
        let consumed: usize = indices.iter().map(|t| t.map_or(1, |t| if is_mask(t) { t.ndim() } else { 1 })).sum();
        if consumed > self.ndim() {
            return Err(Error::index(op, format!("too many indices for tensor of dimension {}", self.ndim())));
        }
        let mut dim = 0;
        let mut items = vec![];
        for t in indices {
            match t {
                None => dim += 1,
                Some(t) => {
                    if is_mask(t) && t.ndim() == 0 {
                        return Err(Error::index(
                            op,
                            "a 0-d bool index is only supported by `i`, not by `index`/`index_put_`",
                        ));
                    }
                    let k = if is_mask(t) { t.ndim() } else { 1 };
                    items.push((dim, (*t).clone()));
                    dim += k;
                }
            }
        }
        Ok(items)
    }

    /// Out-of-place `index_put`: a copy of `self` with `values` written (or added,
    /// when `accumulate`) at `self[indices]`; `values` broadcasts to the shape of
    /// `self.index(indices)` and must have `self`'s dtype.
    pub fn index_put(&self, indices: &[Option<&Tensor>], values: &Tensor, accumulate: bool) -> Result<Tensor> {
        let items = self.index_items("index_put", indices)?;
        if items.is_empty() {
            // No index at all: the whole tensor is the target.
            check_put_dtype("index_put", self, values)?;
            let v = values.broadcast_to(self.shape())?;
            return if accumulate { self.add(&v) } else { v.deep_clone() };
        }
        let a = Advanced::new("index_put", self, items)?;
        let r = self.index_put_impl(&a, values, accumulate)?;
        // Unfolding several advanced dims leaves a view of the result; the result of
        // the op must not be one (see Note [Results are not views]).
        if r.is_view() {
            r.deep_clone()
        } else {
            Ok(r)
        }
    }

    /// PyTorch's `index_put_`: `self[indices] = values` (or `+=` when
    /// `accumulate`, where duplicate positions add up; without it the last
    /// duplicate wins). Writes through views and bumps the version.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::zeros(&[3], DType::F32)?;
    /// let idx = Tensor::new([0i64, 2, 0])?;
    /// x.index_put_(&[Some(&idx)], &Tensor::new([1.0f32, 2.0, 3.0])?, true)?;
    /// assert_eq!(x.to_vec::<f32>()?, vec![4.0, 0.0, 2.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn index_put_(&self, indices: &[Option<&Tensor>], values: &Tensor, accumulate: bool) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let items = self.index_items("index_put_", indices)?;
        if items.is_empty() {
            let r = self.index_put(indices, values, accumulate)?;
            return self.copy_(&r);
        }
        let a = Advanced::new("index_put_", self, items)?;
        let r = self.index_put_impl(&a, values, accumulate)?;
        self.copy_(&r)
    }

    /// The functional write behind `index_put` and `i_put_`: flattens the
    /// advanced dims into one, then `IndexAdd` (accumulate) or `Scatter` (replace)
    /// along it, and restores the shape.
    fn index_put_impl(&self, a: &Advanced, values: &Tensor, accumulate: bool) -> Result<Tensor> {
        let op = "index_put_";
        check_put_dtype(op, self, values)?;
        let target = a.result_shape(self.shape());
        let vals = values.broadcast_to(&target).map_err(|_| {
            Error::shape(
                op,
                format!(
                    "shape mismatch: value tensor of shape {} cannot be broadcast to indexing result of shape {}",
                    fmt_shape(values.shape()),
                    fmt_shape(&target)
                ),
            )
        })?;
        let (flat, ax, lin) = a.flatten(self)?;
        // The index dims sit at `ax` both in `target` and in `flat` (see
        // `Advanced::flatten`), so the values fold like `flat` with a reshape.
        let n = lin.shape()[0];
        let vals = reshape_input(&vals, &with_dim(flat.shape(), ax, n))?;
        let out = if accumulate {
            Tensor::apply1(Op::IndexAdd { dim: ax }, &[&flat, &lin, &vals])?
        } else {
            let mut ishape: Shape = smallvec::smallvec![1; flat.ndim()];
            ishape[ax] = n;
            let index = lin.reshape_to(&ishape)?.broadcast_to(vals.shape())?;
            Tensor::apply1(Op::Scatter { dim: ax, reduce: ScatterReduce::Replace }, &[&flat, &index, &vals])?
        };
        // Undo the flattening: unfold the advanced dims, then the permutation.
        let n = self.ndim();
        let rest: SmallVec<[usize; 6]> = (0..n).filter(|d| !a.dims.contains(d)).collect();
        let mut perm: SmallVec<[usize; 6]> = rest[..ax].into();
        perm.extend(a.dims.iter().copied());
        perm.extend(rest[ax..].iter().copied());
        let pshape: Shape = perm.iter().map(|&d| self.shape()[d]).collect();
        let out = reshape_input(&out, &pshape)?;
        let mut inv: SmallVec<[isize; 6]> = smallvec::smallvec![0; n];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i as isize;
        }
        if inv.iter().enumerate().all(|(i, &p)| p == i as isize) {
            Ok(out)
        } else {
            out.permute(&inv)
        }
    }

    /// Indices of the non-zero elements as an int64 tensor of shape `[n, ndim]`,
    /// in row-major order (`torch.nonzero`). The output size depends on the data.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[0.0f32, 1.0], [2.0, 0.0]])?;
    /// assert_eq!(x.nonzero()?.to_vec::<i64>()?, vec![0, 1, 1, 0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn nonzero(&self) -> Result<Tensor> {
        crate::capture::record::check_read(self, "nonzero")?;
        self.backend().nonzero(self)?.to_device(self.device())
    }

    /// The elements where `mask` (bool, broadcastable with `self`) is true, as a
    /// 1-D tensor in row-major order (`torch.masked_select`).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])?;
    /// let m = Tensor::new([true, false])?;        // broadcast over rows
    /// assert_eq!(x.masked_select(&m)?.to_vec::<f32>()?, vec![1.0, 3.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn masked_select(&self, mask: &Tensor) -> Result<Tensor> {
        if mask.dtype() != DType::Bool {
            return Err(Error::dtype("masked_select", format!("expected BoolTensor for mask, got {}", mask.dtype())));
        }
        let (x, m) = Tensor::broadcast_pair("masked_select", self, mask)?;
        let pos = m.reshape(&[-1])?.nonzero()?.select(1, 0)?;
        x.reshape(&[-1])?.index_select(0, &pos)
    }

    /// `out[i][j] = self[i][index[i][j]]` along `dim` (for dim 1; likewise for
    /// any dim); `index` is int64 with `self`'s number of dims, and the result
    /// has `index`'s shape (`torch.gather`).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])?;
    /// let idx = Tensor::new([[1i64, 1], [0, 1]])?;
    /// assert_eq!(x.gather(1, &idx)?.to_vec::<f32>()?, vec![2.0, 2.0, 3.0, 4.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let d = wrap_dim("gather", dim, self.ndim())?;
        Tensor::apply1(Op::Gather { dim: d }, &[self, index])
    }

    fn scatter_op(
        &self,
        name: &'static str,
        dim: isize,
        index: &Tensor,
        src: &Tensor,
        reduce: ScatterReduce,
    ) -> Result<Tensor> {
        if src.dtype() != self.dtype() {
            return Err(Error::dtype(
                name,
                format!("Expected self.dtype to be equal to src.dtype, got {} and {}", self.dtype(), src.dtype()),
            ));
        }
        let d = wrap_dim(name, dim, self.ndim())?;
        Tensor::apply1(Op::Scatter { dim: d, reduce }, &[self, index, src])
    }

    /// A copy of `self` with `src[i][j]` written at `[i][index[i][j]]` (for dim 1;
    /// `torch.scatter`). Where `index` repeats a position, the last write wins.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::zeros(&[2, 3], DType::F32)?;
    /// let idx = Tensor::new([[2i64], [0]])?;
    /// let src = Tensor::new([[1.0f32], [2.0]])?;
    /// assert_eq!(x.scatter(1, &idx, &src)?.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 2.0, 0.0, 0.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn scatter(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        self.scatter_op("scatter", dim, index, src, ScatterReduce::Replace)
    }

    /// [`Tensor::scatter`] with one value for every indexed position.
    pub fn scatter_value(&self, dim: isize, index: &Tensor, value: impl Into<Scalar>) -> Result<Tensor> {
        let src = Tensor::full(index.shape(), value, (self.dtype(), self.device()))?;
        self.scatter(dim, index, &src)
    }

    /// In-place [`Tensor::scatter`].
    pub fn scatter_(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let r = self.scatter(dim, index, src)?;
        self.copy_(&r)
    }

    /// Like [`Tensor::scatter`], but values at repeated positions add up
    /// (`torch.scatter_add`).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::zeros(&[3], DType::F32)?;
    /// let idx = Tensor::new([0i64, 0, 2])?;
    /// let src = Tensor::new([1.0f32, 2.0, 3.0])?;
    /// assert_eq!(x.scatter_add(0, &idx, &src)?.to_vec::<f32>()?, vec![3.0, 0.0, 3.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn scatter_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        self.scatter_op("scatter_add", dim, index, src, ScatterReduce::Add)
    }

    /// In-place [`Tensor::scatter_add`].
    pub fn scatter_add_(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let r = self.scatter_add(dim, index, src)?;
        self.copy_(&r)
    }

    /// The slices of `self` along `dim` at the positions of `index` (a 1-D or 0-d
    /// integer tensor; no negative positions), `torch.index_select`.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]])?;
    /// let idx = Tensor::new([2i64, 0])?;
    /// assert_eq!(x.index_select(0, &idx)?.to_vec::<f32>()?, vec![5.0, 6.0, 1.0, 2.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn index_select(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let d = wrap_dim("index_select", dim, self.ndim())?;
        let index = self.int64_index("index_select", index)?;
        if self.ndim() == 0 {
            // A 0-d tensor has one slice; the index must name it (0 or -1 with index_select's own check).
            let r = Tensor::apply1(Op::IndexSelect { dim: 0 }, &[&self.reshape(&[1])?, &index.reshape(&[-1])?])?;
            return reshape_result(r, &[]);
        }
        Tensor::apply1(Op::IndexSelect { dim: d }, &[self, &index])
    }

    /// Index tensors of `index_select`/`index_add`: any integer dtype, as int64.
    fn int64_index(&self, op: &'static str, index: &Tensor) -> Result<Tensor> {
        if !index.dtype().is_int() {
            return Err(Error::dtype(op, format!("Expected dtype int32 or int64 for index, got {}", index.dtype())));
        }
        index.to_dtype(DType::I64)
    }

    /// A copy of `self` with the slices of `src` added at the positions of `index`
    /// along `dim` (`torch.index_add`); repeated positions add up. `src` has
    /// `self`'s shape except along `dim`, where it has `index`'s length.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::zeros(&[3, 2], DType::F32)?;
    /// let idx = Tensor::new([0i64, 0])?;
    /// let src = Tensor::ones(&[2, 2], DType::F32)?;
    /// assert_eq!(x.index_add(0, &idx, &src)?.to_vec::<f32>()?, vec![2.0, 2.0, 0.0, 0.0, 0.0, 0.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn index_add(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<Tensor> {
        let d = wrap_dim("index_add", dim, self.ndim())?;
        let index = self.int64_index("index_add", index)?;
        if src.dtype() != self.dtype() {
            return Err(Error::dtype(
                "index_add",
                format!("self ({}) and source ({}) must have the same scalar type", self.dtype(), src.dtype()),
            ));
        }
        Tensor::apply1(Op::IndexAdd { dim: d }, &[self, &index, src])
    }

    /// In-place [`Tensor::index_add`].
    pub fn index_add_(&self, dim: isize, index: &Tensor, src: &Tensor) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let r = self.index_add(dim, index, src)?;
        self.copy_(&r)
    }
}
