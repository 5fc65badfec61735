//! `Layout`: shape, strides (in elements) and offset of a tensor into its storage.
//! Every view is a pure `Layout` transform; this file holds those transforms.
use crate::error::fmt_shape;
use crate::{Error, Result};
use smallvec::SmallVec;

/// Dimensions of a tensor. Up to 6 dims live inline.
pub type Shape = SmallVec<[usize; 6]>;
/// Strides in elements (never negative, as in PyTorch).
pub type Strides = SmallVec<[usize; 6]>;

/// Number of elements of a shape (1 for a 0-d tensor).
pub fn numel(shape: &[usize]) -> usize {
    // Saturates: no buffer has usize::MAX elements, so an overflowing shape can
    // never pass for a real one (`alloc::bytes` turns it into an error).
    if shape.contains(&0) {
        return 0;
    }
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).unwrap_or(usize::MAX)
}

/// Row-major (C-contiguous) strides of a shape.
pub fn contiguous_strides(shape: &[usize]) -> Strides {
    let mut s: Strides = SmallVec::from_elem(0, shape.len());
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        s[i] = acc;
        // Saturating: such a shape has more elements than any storage and is refused before use.
        acc = acc.saturating_mul(shape[i].max(1));
    }
    s
}

/// Normalises a possibly negative dim against `ndim` (PyTorch's `maybe_wrap_dim`).
pub fn wrap_dim(op: &'static str, dim: isize, ndim: usize) -> Result<usize> {
    let n = ndim.max(1) as isize;
    if dim < -n || dim >= n {
        return Err(Error::dim_out_of_range(op, dim, ndim));
    }
    Ok(if dim < 0 { (dim + n) as usize } else { dim as usize })
}

/// PyTorch's broadcasting of two shapes.
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Shape> {
    let n = a.len().max(b.len());
    let mut out: Shape = SmallVec::from_elem(1, n);
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::shape(
                op,
                format!(
                    "the size of tensor a ({da}) must match the size of tensor b ({db}) at non-singleton dimension {i}; shapes {} and {}",
                    fmt_shape(a),
                    fmt_shape(b)
                ),
            ));
        };
    }
    Ok(out)
}

/// Shape, strides and storage offset of a (possibly strided) tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    shape: Shape,
    strides: Strides,
    offset: usize,
}

impl Layout {
    /// A contiguous row-major layout starting at offset 0.
    pub fn contiguous(shape: &[usize]) -> Layout {
        Layout { shape: shape.into(), strides: contiguous_strides(shape), offset: 0 }
    }
    /// A layout from raw parts. No check: use [`Layout::check_bounds`] before reading memory.
    pub fn new(shape: Shape, strides: Strides, offset: usize) -> Layout {
        debug_assert_eq!(shape.len(), strides.len());
        Layout { shape, strides, offset }
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }
    pub fn offset(&self) -> usize {
        self.offset
    }
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// True when elements are laid out row-major without gaps (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for i in (0..self.shape.len()).rev() {
            if self.shape[i] == 1 {
                continue;
            }
            if self.strides[i] != expected {
                return false;
            }
            expected *= self.shape[i];
        }
        true
    }

    /// The order of dims, outermost first, in which a dense but permuted
    /// layout (a transposed matrix, a `[B, H, T, D]` view of a `[B, T, H, D]`
    /// tensor) is contiguous: `Some(order)` with `permute(order)` contiguous;
    /// `None` when the layout is contiguous already or not a permutation of a
    /// contiguous one (gaps, overlaps, broadcasts).
    pub fn dense_order(&self) -> Option<Vec<usize>> {
        if self.is_contiguous() {
            return None;
        }
        let mut order: Vec<usize> = (0..self.ndim()).collect();
        // Size-1 dims (whose stride is any) go last: `is_contiguous` ignores them.
        order.sort_by_key(|&d| std::cmp::Reverse(if self.shape[d] == 1 { 0 } else { self.strides[d] }));
        let permuted = self.permute("dense_order", &order).ok()?;
        permuted.is_contiguous().then_some(order)
    }

    /// One past the largest storage index this layout touches (0 when empty).
    /// The number of storage elements the layout spans from index 0 (`None`
    /// when that number does not fit a `usize`).
    pub fn storage_extent(&self) -> Option<usize> {
        if self.numel() == 0 {
            return Some(0);
        }
        let mut last = self.offset;
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            last = last.checked_add((d - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }

    /// Checks that every element lies inside a storage of `len` elements.
    pub fn check_bounds(&self, op: &'static str, len: usize) -> Result<()> {
        if !self.shape.contains(&0) && self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).is_none() {
            return Err(Error::shape(
                op,
                format!("sizes {} have more elements than a usize can count (numel overflows)", fmt_shape(&self.shape)),
            ));
        }
        let Some(extent) = self.storage_extent() else {
            return Err(Error::index(
                op,
                format!(
                    "setStorage: sizes {}, strides {}, storage offset {} reach past the largest possible storage",
                    fmt_shape(&self.shape),
                    fmt_shape(&self.strides),
                    self.offset
                ),
            ));
        };
        if extent > len {
            return Err(Error::index(
                op,
                format!(
                    "setStorage: sizes {}, strides {}, storage offset {} require a storage of {extent} elements, but the storage has only {len}",
                    fmt_shape(&self.shape),
                    fmt_shape(&self.strides),
                    self.offset
                ),
            ));
        }
        Ok(())
    }

    /// True when two different indices may address the same storage element
    /// (a stride-0 dimension of size > 1, or strides that interleave).
    /// Conservative like PyTorch's `has_internal_overlap`: may say "maybe" (true)
    /// for some exotic non-overlapping layouts.
    pub fn has_internal_overlap(&self) -> bool {
        let mut dims: SmallVec<[(usize, usize); 6]> =
            self.shape.iter().zip(&self.strides).filter(|(&d, _)| d > 1).map(|(&d, &s)| (s, d)).collect();
        if dims.iter().any(|&(s, _)| s == 0) {
            return true;
        }
        dims.sort_unstable();
        let mut span = 1usize; // extent covered by the smaller-stride dims
        for &(s, d) in &dims {
            if s < span {
                return true;
            }
            span += s * (d - 1);
        }
        false
    }

    /// Storage index of a multi-index (no bounds check on `idx`).
    pub fn index_of(&self, idx: &[usize]) -> usize {
        self.offset + idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum::<usize>()
    }

    // ---- view transforms -------------------------------------------------

    pub fn permute(&self, op: &'static str, dims: &[usize]) -> Result<Layout> {
        let n = self.ndim();
        let mut seen: SmallVec<[bool; 6]> = SmallVec::from_elem(false, n);
        if dims.len() != n {
            return Err(Error::shape(
                op,
                format!("number of dims don't match in permute: tensor has {n} dims, got {} ({dims:?})", dims.len()),
            ));
        }
        for &d in dims {
            if d >= n || seen[d] {
                return Err(Error::invalid(
                    op,
                    format!("permutation {dims:?} is not valid for {n} dims (repeated or out of range)"),
                ));
            }
            seen[d] = true;
        }
        Ok(Layout {
            shape: dims.iter().map(|&d| self.shape[d]).collect(),
            strides: dims.iter().map(|&d| self.strides[d]).collect(),
            offset: self.offset,
        })
    }

    pub fn transpose(&self, d0: usize, d1: usize) -> Layout {
        let mut l = self.clone();
        l.shape.swap(d0, d1);
        l.strides.swap(d0, d1);
        l
    }

    /// `x[.., start:end:step, ..]` along `dim`, with `start`/`end` already clamped.
    pub fn slice(&self, dim: usize, start: usize, end: usize, step: usize) -> Layout {
        let mut l = self.clone();
        let len = if end > start { (end - start).div_ceil(step) } else { 0 };
        if len > 0 {
            l.offset += start * self.strides[dim];
        }
        l.shape[dim] = len;
        l.strides[dim] *= step;
        l
    }

    pub fn select(&self, dim: usize, index: usize) -> Layout {
        let mut l = self.clone();
        l.offset += index * self.strides[dim];
        l.shape.remove(dim);
        l.strides.remove(dim);
        l
    }

    pub fn unsqueeze(&self, dim: usize) -> Layout {
        let mut l = self.clone();
        let st = if dim < self.ndim() { self.strides[dim] * self.shape[dim] } else { 1 };
        l.shape.insert(dim, 1);
        l.strides.insert(dim, st);
        l
    }

    pub fn squeeze_dims(&self, dims: &[usize]) -> Layout {
        let mut l = Layout { shape: Shape::new(), strides: Strides::new(), offset: self.offset };
        for i in 0..self.ndim() {
            if !(dims.contains(&i) && self.shape[i] == 1) {
                l.shape.push(self.shape[i]);
                l.strides.push(self.strides[i]);
            }
        }
        l
    }

    /// Broadcast to `shape` (PyTorch's `expand`): new leading dims and size-1 dims get stride 0.
    pub fn expand(&self, op: &'static str, shape: &[usize]) -> Result<Layout> {
        if shape.len() < self.ndim() {
            return Err(Error::shape(
                op,
                format!(
                    "the number of sizes provided ({}) must be greater or equal to the number of dimensions in the tensor ({})",
                    shape.len(),
                    self.ndim()
                ),
            ));
        }
        let lead = shape.len() - self.ndim();
        let mut strides: Strides = SmallVec::from_elem(0, shape.len());
        for i in 0..shape.len() {
            if i < lead {
                continue;
            }
            let (d, s) = (self.shape[i - lead], self.strides[i - lead]);
            if d == shape[i] {
                strides[i] = s;
            } else if d == 1 {
                strides[i] = 0;
            } else {
                return Err(Error::shape(
                    op,
                    format!(
                        "the expanded size of the tensor ({}) must match the existing size ({d}) at non-singleton dimension {i}; target sizes {}, tensor sizes {}",
                        shape[i],
                        fmt_shape(shape),
                        fmt_shape(&self.shape)
                    ),
                ));
            }
        }
        Ok(Layout { shape: shape.into(), strides, offset: self.offset })
    }

    /// A view with a new shape, if the strides allow one (PyTorch's `computeStride`).
    /// Returns `None` when the data would have to be copied.
    pub fn reshape_view(&self, new_shape: &[usize]) -> Option<Layout> {
        let n = self.numel();
        if n == 0 || self.ndim() == 0 || new_shape.is_empty() {
            return Some(Layout {
                shape: new_shape.into(),
                strides: contiguous_strides(new_shape),
                offset: self.offset,
            });
        }
        let mut new_strides: Strides = SmallVec::from_elem(0, new_shape.len());
        let mut view_d = new_shape.len() as isize - 1;
        let mut chunk_base_stride = *self.strides.last().unwrap();
        let mut tensor_numel = 1usize;
        let mut view_numel = 1usize;
        for tensor_d in (0..self.ndim()).rev() {
            tensor_numel *= self.shape[tensor_d];
            if tensor_d == 0
                || (self.shape[tensor_d - 1] != 1 && self.strides[tensor_d - 1] != tensor_numel * chunk_base_stride)
            {
                while view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d as usize] == 1) {
                    new_strides[view_d as usize] = view_numel * chunk_base_stride;
                    view_numel *= new_shape[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if tensor_d > 0 {
                    chunk_base_stride = self.strides[tensor_d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != -1 {
            return None;
        }
        Some(Layout { shape: new_shape.into(), strides: new_strides, offset: self.offset })
    }

    pub fn diagonal(&self, offset: isize, d1: usize, d2: usize) -> Layout {
        let (n1, n2) = (self.shape[d1] as isize, self.shape[d2] as isize);
        let len = if offset >= 0 { (n1.min(n2 - offset)).max(0) } else { ((n1 + offset).min(n2)).max(0) } as usize;
        let mut off = self.offset;
        if len > 0 {
            if offset >= 0 {
                off += offset as usize * self.strides[d2];
            } else {
                off += (-offset) as usize * self.strides[d1];
            }
        }
        let mut shape = Shape::new();
        let mut strides = Strides::new();
        for i in 0..self.ndim() {
            if i != d1 && i != d2 {
                shape.push(self.shape[i]);
                strides.push(self.strides[i]);
            }
        }
        shape.push(len);
        strides.push(self.strides[d1] + self.strides[d2]);
        Layout { shape, strides, offset: off }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn reshape_view_rules() {
        let l = Layout::contiguous(&[3, 4]);
        assert!(l.reshape_view(&[12]).is_some());
        let t = l.transpose(0, 1);
        assert!(t.reshape_view(&[12]).is_none());
        assert_eq!(t.reshape_view(&[4, 3, 1]).unwrap().strides(), &[1, 4, 4]);
    }
    #[test]
    fn overlap_detection() {
        assert!(Layout::new(Shape::from_slice(&[4, 3]), Strides::from_slice(&[2, 1]), 0).has_internal_overlap());
        assert!(!Layout::new(Shape::from_slice(&[2, 2]), Strides::from_slice(&[4, 2]), 1).has_internal_overlap());
        assert!(Layout::contiguous(&[3]).expand("t", &[2, 3]).unwrap().has_internal_overlap());
        assert!(!Layout::contiguous(&[3, 4]).transpose(0, 1).has_internal_overlap());
    }
}
