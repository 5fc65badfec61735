//! Movement and views: reshape/view, permute, transpose, narrow, slice, select,
//! expand, squeeze/unsqueeze, flatten/unflatten, chunk/split, diagonal,
//! as_strided, contiguous, cat and stack. Views alias their base's storage.
use crate::error::fmt_shape;
use crate::{wrap_dim, Error, Op, Result, Shape, Tensor, ViewOp};
use smallvec::SmallVec;

/// Resolves a shape with at most one `-1` against `numel` (PyTorch's `infer_size`).
pub(crate) fn infer_size(op: &'static str, shape: &[isize], numel: usize) -> Result<Shape> {
    let mut infer = None;
    let mut known = 1usize;
    let mut out = Shape::with_capacity(shape.len());
    for (i, &d) in shape.iter().enumerate() {
        if d == -1 {
            if infer.is_some() {
                return Err(Error::shape(op, "only one dimension can be inferred"));
            }
            infer = Some(i);
            out.push(0);
        } else if d < 0 {
            return Err(Error::shape(op, format!("invalid shape dimension {d}")));
        } else {
            known *= d as usize;
            out.push(d as usize);
        }
    }
    let bad = || Error::shape(op, format!("shape '{shape:?}' is invalid for input of size {numel}"));
    match infer {
        Some(i) => {
            if known == 0 || !numel.is_multiple_of(known) {
                return Err(bad());
            }
            out[i] = numel / known;
        }
        None if known != numel => return Err(bad()),
        None => {}
    }
    Ok(out)
}

impl Tensor {
    /// A view with a new shape (one dim may be `-1`). Fails when the strides do
    /// not allow a view; use [`Tensor::reshape`] to copy in that case.
    pub fn view(&self, shape: &[isize]) -> Result<Tensor> {
        let s = infer_size("view", shape, self.numel())?;
        self.view_op(ViewOp::Reshape(s))
    }

    /// Like `torch.reshape`: a view when the strides allow it, else a contiguous copy.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::arange(0.0, 12.0, 1.0, DType::F32)?.reshape(&[3, 4])?;
    /// assert!(x.reshape(&[-1])?.shares_storage(&x));        // a view
    /// assert!(!x.t()?.reshape(&[-1])?.shares_storage(&x));  // needs a copy
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn reshape(&self, shape: &[isize]) -> Result<Tensor> {
        let s = infer_size("reshape", shape, self.numel())?;
        if self.layout().reshape_view(&s).is_some() {
            self.view_op(ViewOp::Reshape(s))
        } else {
            // The copy is internal: the result is a new base, not a view of it
            // (PyTorch's `_unsafe_view`; see Note [Results are not views]).
            self.contiguous()?.view_op_as_base(ViewOp::Reshape(s))
        }
    }

    /// Reshape to a shape given as `usize`s.
    pub fn reshape_to(&self, shape: &[usize]) -> Result<Tensor> {
        let s: SmallVec<[isize; 6]> = shape.iter().map(|&d| d as isize).collect();
        self.reshape(&s)
    }

    /// Reorders dims (negative dims allowed).
    pub fn permute(&self, dims: &[isize]) -> Result<Tensor> {
        let n = self.ndim();
        let p: SmallVec<[usize; 6]> = dims.iter().map(|&d| wrap_dim("permute", d, n)).collect::<Result<_>>()?;
        self.view_op(ViewOp::Permute(p))
    }

    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let n = self.ndim();
        if n == 0 {
            return Ok(self.clone());
        }
        let (a, b) = (wrap_dim("transpose", d0, n)?, wrap_dim("transpose", d1, n)?);
        let mut p: SmallVec<[usize; 6]> = (0..n).collect();
        p.swap(a, b);
        self.view_op(ViewOp::Permute(p))
    }

    /// Transpose of a matrix (`<= 2` dims), like `Tensor.t()`.
    pub fn t(&self) -> Result<Tensor> {
        if self.ndim() > 2 {
            return Err(Error::shape(
                "t",
                format!("t() expects a tensor with <= 2 dimensions, but self is {}D", self.ndim()),
            ));
        }
        if self.ndim() < 2 {
            return Ok(self.clone());
        }
        self.transpose(0, 1)
    }

    /// `length` elements of `dim` starting at `start` (negative start counts from the end).
    pub fn narrow(&self, dim: isize, start: isize, length: usize) -> Result<Tensor> {
        if self.ndim() == 0 {
            return Err(Error::shape("narrow", "narrow() cannot be applied to a 0-dim tensor"));
        }
        let d = wrap_dim("narrow", dim, self.ndim())?;
        let size = self.shape()[d] as isize;
        let s = if start < 0 { start + size } else { start };
        if s < 0 || s > size || s as usize + length > size as usize {
            return Err(Error::index(
                "narrow",
                format!("start ({start}) + length ({length}) exceeds dimension size ({size}) of dim {d}"),
            ));
        }
        self.view_op(ViewOp::Slice { dim: d, start: s as usize, end: s as usize + length, step: 1 })
    }

    /// Python slicing `x[.., start:end:step, ..]` along `dim`; `None` bounds mean the ends,
    /// negative bounds count from the end and are clamped like Python's. `step >= 1`.
    pub fn slice(&self, dim: isize, start: Option<isize>, end: Option<isize>, step: isize) -> Result<Tensor> {
        if self.ndim() == 0 {
            return Err(Error::index("slice", "slicing a 0-dim tensor is not allowed"));
        }
        if step <= 0 {
            return Err(Error::invalid("slice", format!("slice step must be positive, got {step}")));
        }
        let d = wrap_dim("slice", dim, self.ndim())?;
        let n = self.shape()[d] as isize;
        let clamp = |v: isize| -> usize { (if v < 0 { v + n } else { v }).clamp(0, n) as usize };
        let s = start.map_or(0, clamp);
        let e = end.map_or(n as usize, clamp).max(s);
        self.view_op(ViewOp::Slice { dim: d, start: s, end: e, step: step as usize })
    }

    /// Removes `dim` by picking one index (negative indices count from the end).
    pub fn select(&self, dim: isize, index: isize) -> Result<Tensor> {
        if self.ndim() == 0 {
            return Err(Error::index("select", "select() cannot be applied to a 0-dim tensor"));
        }
        let d = wrap_dim("select", dim, self.ndim())?;
        let n = self.shape()[d] as isize;
        if index < -n || index >= n {
            return Err(Error::index(
                "select",
                format!("index {index} is out of bounds for dimension {d} with size {n}"),
            ));
        }
        let i = if index < 0 { index + n } else { index } as usize;
        self.view_op(ViewOp::Select { dim: d, index: i })
    }

    /// Broadcasts to `shape` without copying (stride-0 dims). `-1` keeps a dim's size.
    pub fn expand(&self, shape: &[isize]) -> Result<Tensor> {
        let lead = shape.len().saturating_sub(self.ndim());
        let mut s = Shape::with_capacity(shape.len());
        for (i, &d) in shape.iter().enumerate() {
            if d == -1 {
                if i < lead {
                    return Err(Error::shape(
                        "expand",
                        "the expanded size -1 isn't allowed in a leading, non-existing dimension",
                    ));
                }
                s.push(self.shape()[i - lead]);
            } else if d < 0 {
                return Err(Error::shape("expand", format!("invalid size {d}")));
            } else {
                s.push(d as usize);
            }
        }
        self.broadcast_to(&s)
    }

    /// Broadcasts to `shape` (a view); returns `self` when the shape already matches.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.shape() == shape {
            return Ok(self.clone());
        }
        self.view_op(ViewOp::Expand(shape.into()))
    }

    /// Broadcasts `self` to `other`'s shape.
    pub fn expand_as(&self, other: &Tensor) -> Result<Tensor> {
        self.broadcast_to(other.shape())
    }

    /// Inserts a size-1 dim at `dim` (`-1` appends).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let d = wrap_dim("unsqueeze", dim, self.ndim() + 1)?;
        self.view_op(ViewOp::Unsqueeze(d))
    }

    /// Removes every size-1 dim.
    pub fn squeeze(&self) -> Result<Tensor> {
        let dims: SmallVec<[usize; 6]> = (0..self.ndim()).filter(|&i| self.shape()[i] == 1).collect();
        self.view_op(ViewOp::Squeeze(dims))
    }

    /// Removes `dim` if it has size 1 (otherwise returns the same view, like PyTorch).
    pub fn squeeze_dim(&self, dim: isize) -> Result<Tensor> {
        if self.ndim() == 0 {
            wrap_dim("squeeze", dim, 0)?;
            return Ok(self.clone());
        }
        let d = wrap_dim("squeeze", dim, self.ndim())?;
        self.view_op(ViewOp::Squeeze(smallvec::smallvec![d]))
    }

    /// Flattens dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.ndim() == 0 {
            return self.reshape(&[1]);
        }
        let (s, e) = (wrap_dim("flatten", start, self.ndim())?, wrap_dim("flatten", end, self.ndim())?);
        if s > e {
            return Err(Error::invalid("flatten", "flatten() has invalid args: start_dim cannot come after end_dim"));
        }
        let mut shape: SmallVec<[isize; 6]> = SmallVec::new();
        shape.extend(self.shape()[..s].iter().map(|&d| d as isize));
        shape.push(self.shape()[s..=e].iter().product::<usize>() as isize);
        shape.extend(self.shape()[e + 1..].iter().map(|&d| d as isize));
        self.reshape(&shape)
    }

    /// Splits `dim` into `sizes` (one may be `-1`).
    pub fn unflatten(&self, dim: isize, sizes: &[isize]) -> Result<Tensor> {
        let d = wrap_dim("unflatten", dim, self.ndim())?;
        let inner = infer_size("unflatten", sizes, self.shape()[d])?;
        let mut shape: SmallVec<[isize; 6]> = self.shape()[..d].iter().map(|&x| x as isize).collect();
        shape.extend(inner.iter().map(|&x| x as isize));
        shape.extend(self.shape()[d + 1..].iter().map(|&x| x as isize));
        self.view(&shape)
    }

    /// Views of consecutive pieces of `dim`, each `size` long (the last may be shorter).
    pub fn split(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = wrap_dim("split", dim, self.ndim())?;
        if size == 0 && self.shape()[d] > 0 {
            return Err(Error::invalid("split", "split_size can only be 0 if dimension size is 0"));
        }
        let n = self.shape()[d];
        let mut out = vec![];
        let mut s = 0;
        while s < n {
            let len = size.min(n - s);
            out.push(self.narrow(d as isize, s as isize, len)?);
            s += len;
        }
        if n == 0 {
            out.push(self.clone());
        }
        Ok(out)
    }

    /// Views of pieces of `dim` with the given sizes (must sum to the dim's size).
    pub fn split_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = wrap_dim("split", dim, self.ndim())?;
        if sizes.iter().sum::<usize>() != self.shape()[d] {
            return Err(Error::shape(
                "split_with_sizes",
                format!("split sizes {sizes:?} must sum to the size of dim {d} ({})", self.shape()[d]),
            ));
        }
        let mut s = 0;
        sizes
            .iter()
            .map(|&len| {
                let t = self.narrow(d as isize, s as isize, len);
                s += len;
                t
            })
            .collect()
    }

    /// `chunks` views of nearly equal size along `dim` (PyTorch's rule: `ceil(n / chunks)` each).
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        if chunks == 0 {
            return Err(Error::invalid("chunk", "chunk expects `chunks` to be greater than 0"));
        }
        let d = wrap_dim("chunk", dim, self.ndim())?;
        let n = self.shape()[d];
        self.split(n.div_ceil(chunks).max(1), d as isize)
    }

    /// The diagonal of dims `dim1`, `dim2` as a view (appended as the last dim).
    pub fn diagonal(&self, offset: isize, dim1: isize, dim2: isize) -> Result<Tensor> {
        let (a, b) = (wrap_dim("diagonal", dim1, self.ndim())?, wrap_dim("diagonal", dim2, self.ndim())?);
        if a == b {
            return Err(Error::invalid("diagonal", format!("diagonal dimensions cannot be identical {dim1}, {dim2}")));
        }
        self.view_op(ViewOp::Diagonal { offset, dim1: a, dim2: b })
    }

    /// A view with explicit shape, strides and storage offset. The view may overlap
    /// itself (reading is fine; in-place writes to it are refused). It must stay
    /// inside the storage.
    pub fn as_strided(&self, shape: &[usize], strides: &[usize], offset: Option<usize>) -> Result<Tensor> {
        if shape.len() != strides.len() {
            return Err(Error::shape(
                "as_strided",
                format!("mismatch in length of strides and shape: {} and {}", fmt_shape(strides), fmt_shape(shape)),
            ));
        }
        self.view_op(ViewOp::AsStrided {
            shape: shape.into(),
            strides: strides.into(),
            offset: offset.unwrap_or(self.storage_offset()),
        })
    }

    /// A contiguous tensor with the same values: `self` when already contiguous, else a copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        Tensor::apply1(Op::Copy, &[self])
    }

    /// A copy of the data in new storage (PyTorch's `clone()`), differentiable.
    pub fn deep_clone(&self) -> Result<Tensor> {
        Tensor::apply1(Op::Copy, &[self])
    }

    /// Concatenates along `dim` (dtypes are promoted like a binary op).
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::invalid("cat", "expected a non-empty list of tensors"))?;
        // PyTorch skips legacy empty 1-D tensors of shape [0].
        let kept: Vec<&Tensor> = tensors.iter().copied().filter(|t| !(t.ndim() == 1 && t.numel() == 0)).collect();
        let kept = if kept.is_empty() { vec![*first] } else { kept };
        if kept[0].ndim() == 0 {
            return Err(Error::shape("cat", "zero-dimensional tensor cannot be concatenated"));
        }
        let d = wrap_dim("cat", dim, kept[0].ndim())?;
        let dt = kept.iter().skip(1).fold(kept[0].dtype(), |acc, t| crate::DType::promote(acc, t.dtype()));
        let conv: Vec<Tensor> = kept.iter().map(|t| t.to_dtype(dt)).collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = conv.iter().collect();
        Tensor::apply1(Op::Cat { dim: d }, &refs)
    }

    /// Stacks tensors of equal shape along a new dim.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| Error::invalid("stack", "expected a non-empty list of tensors"))?;
        for t in tensors {
            if t.shape() != first.shape() {
                return Err(Error::shape(
                    "stack",
                    format!(
                        "stack expects each tensor to be equal size, but got {} and {}",
                        fmt_shape(first.shape()),
                        fmt_shape(t.shape())
                    ),
                ));
            }
        }
        let d = wrap_dim("stack", dim, first.ndim() + 1)? as isize;
        let us: Vec<Tensor> = tensors.iter().map(|t| t.unsqueeze(d)).collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = us.iter().collect();
        Tensor::cat(&refs, d)
    }
}
