//! Typing of concatenation, indexing, sorting and in-place writes.
use super::{meta, Typing};
use crate::error::fmt_shape;
use crate::{DType, Error, Layout, Meta, Result, Shape};
use smallvec::{smallvec, SmallVec};

/// `Op::Cat { dim }`.
pub(super) fn cat(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let first = c.inputs.first().ok_or_else(|| Error::invalid(c.name, "expected a non-empty list of tensors"))?;
    c.check_dim(*dim, first.shape.len())?;
    let mut shape = first.shape.clone();
    shape[*dim] = 0;
    for m in c.inputs {
        c.same_dtype(first, m)?;
        let ok = m.shape.len() == first.shape.len()
            && m.shape.iter().zip(&first.shape).enumerate().all(|(i, (a, b))| i == *dim || a == b);
        if !ok {
            return Err(Error::shape(
                c.name,
                format!(
                    "sizes of tensors must match except in dimension {dim}; got {} and {}",
                    fmt_shape(&first.shape),
                    fmt_shape(&m.shape)
                ),
            ));
        }
        shape[*dim] += m.shape[*dim];
    }
    Ok(smallvec![Meta { shape, dtype: first.dtype }])
}

/// `Op::Gather { dim }`.
pub(super) fn gather(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let (x, idx) = (&c.inputs[0], &c.inputs[1]);
    c.index_dtype(idx)?;
    c.check_dim(*dim, x.shape.len())?;
    if idx.shape.len() != x.shape.len() {
        return Err(Error::shape(c.name, "index tensor must have the same number of dimensions as input tensor"));
    }
    for i in 0..x.shape.len() {
        if i != *dim && idx.shape[i] > x.shape[i] {
            return Err(Error::shape(
                c.name,
                format!(
                    "size of index {} does not fit input {} at dimension {i}",
                    fmt_shape(&idx.shape),
                    fmt_shape(&x.shape)
                ),
            ));
        }
    }
    Ok(smallvec![meta(&idx.shape, x.dtype)])
}

/// `Op::Scatter { dim, .. }`.
pub(super) fn scatter(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let (base, idx, src) = (&c.inputs[0], &c.inputs[1], &c.inputs[2]);
    c.index_dtype(idx)?;
    c.same_dtype(base, src)?;
    c.check_dim(*dim, base.shape.len())?;
    if idx.shape.len() != base.shape.len() || src.shape.len() != base.shape.len() {
        return Err(Error::shape(c.name, "index tensor must have the same number of dimensions as self tensor"));
    }
    for i in 0..base.shape.len() {
        if idx.shape[i] > src.shape[i] || (i != *dim && idx.shape[i] > base.shape[i]) {
            return Err(Error::shape(
                c.name,
                format!(
                    "expected index {} to be smaller than self {} apart from dimension {dim} and to be smaller than src {}",
                    fmt_shape(&idx.shape),
                    fmt_shape(&base.shape),
                    fmt_shape(&src.shape)
                ),
            ));
        }
    }
    Ok(smallvec![base.clone()])
}

/// `Op::IndexSelect { dim }`.
pub(super) fn index_select(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let (x, idx) = (&c.inputs[0], &c.inputs[1]);
    c.index_dtype(idx)?;
    c.check_dim(*dim, x.shape.len())?;
    if idx.shape.len() > 1 {
        return Err(Error::shape(c.name, "index_select(): index should be a vector (0-d or 1-d)"));
    }
    let mut s = x.shape.clone();
    if !s.is_empty() {
        s[*dim] = idx.shape.iter().product();
    }
    Ok(smallvec![meta(&s, x.dtype)])
}

/// `Op::IndexAdd { dim }`.
pub(super) fn index_add(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let (base, idx, src) = (&c.inputs[0], &c.inputs[1], &c.inputs[2]);
    c.index_dtype(idx)?;
    c.same_dtype(base, src)?;
    c.check_dim(*dim, base.shape.len())?;
    let n: usize = idx.shape.iter().product();
    let mut want = base.shape.clone();
    if !want.is_empty() {
        want[*dim] = n;
    }
    if idx.shape.len() > 1 || src.shape != want {
        return Err(Error::shape(
            c.name,
            format!(
                "source {} must have shape {} (self with dim {dim} of the index's length)",
                fmt_shape(&src.shape),
                fmt_shape(&want)
            ),
        ));
    }
    Ok(smallvec![base.clone()])
}

/// `Op::Sort { dim, .. }`.
pub(super) fn sort(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    c.check_dim(*dim, x.shape.len())?;
    Ok(smallvec![x.clone(), meta(&x.shape, DType::I64)])
}

/// `Op::TopK { k, dim, .. }`.
pub(super) fn topk(c: &Typing<'_>, k: &usize, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    c.check_dim(*dim, x.shape.len())?;
    let n = x.shape.get(*dim).copied().unwrap_or(1);
    if *k > n {
        return Err(Error::index(c.name, format!("selected index k = {k} out of range for a dimension of size {n}")));
    }
    let mut s = x.shape.clone();
    if !s.is_empty() {
        s[*dim] = *k;
    }
    Ok(smallvec![meta(&s, x.dtype), meta(&s, DType::I64)])
}

/// `Op::Assign { shape, strides, offset }`.
pub(super) fn assign(c: &Typing<'_>, shape: &Shape, strides: &Shape, offset: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let (base, src) = (&c.inputs[0], &c.inputs[1]);
    c.same_dtype(base, src)?;
    if src.shape != *shape {
        return Err(Error::shape(
            c.name,
            format!("source shape {} does not match the destination {}", fmt_shape(&src.shape), fmt_shape(shape)),
        ));
    }
    let l = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
    l.check_bounds(c.name, base.shape.iter().product())?;
    Ok(smallvec![base.clone()])
}
