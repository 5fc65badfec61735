//! Typing of the reductions, softmax, logsumexp and cumsum.
use super::{meta, Typing};
use crate::error::fmt_shape;
use crate::op::ReduceOp;
use crate::{DType, Error, Meta, Result, Shape};
use smallvec::{smallvec, SmallVec};

fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Shape {
    let mut out = Shape::new();
    for (i, &d) in shape.iter().enumerate() {
        if dims.contains(&i) {
            if keepdim {
                out.push(1);
            }
        } else {
            out.push(d);
        }
    }
    out
}

/// `Op::Reduce { op, dims, keepdim }`.
pub(super) fn reduce(c: &Typing<'_>, op: &ReduceOp, dims: &[usize], keepdim: &bool) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    for &d in dims {
        c.check_dim(d, x.shape.len())?;
    }
    let dt = match op {
        ReduceOp::Sum | ReduceOp::Prod if !x.dtype.is_float() => DType::I64,
        ReduceOp::Mean if !x.dtype.is_float() => {
            return Err(Error::dtype(
                c.name,
                format!(
                "could not infer output dtype. Input dtype must be either a floating point or complex dtype. Got: {}",
                x.dtype
            ),
            ))
        }
        ReduceOp::Any | ReduceOp::All => DType::Bool,
        _ => x.dtype,
    };
    if matches!(op, ReduceOp::Max | ReduceOp::Min) {
        for &d in dims {
            if x.shape.get(d) == Some(&0) {
                return Err(Error::shape(
                    c.name,
                    format!("expected reduction dim {d} to have non-zero size; input shape {}", fmt_shape(&x.shape)),
                ));
            }
        }
    }
    Ok(smallvec![Meta { shape: reduced_shape(&x.shape, dims, *keepdim), dtype: dt }])
}

/// `Op::ArgReduce { dim, keepdim, .. }`.
pub(super) fn arg_reduce(c: &Typing<'_>, dim: &Option<usize>, keepdim: &bool) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    let shape = match dim {
        Some(d) => {
            c.check_dim(*d, x.shape.len())?;
            if x.shape.get(*d) == Some(&0) {
                return Err(Error::shape(c.name, format!("expected reduction dim {d} to have non-zero size")));
            }
            if x.shape.is_empty() {
                Shape::new()
            } else {
                reduced_shape(&x.shape, &[*d], *keepdim)
            }
        }
        None => {
            if x.shape.iter().product::<usize>() == 0 {
                return Err(Error::shape(
                    c.name,
                    "expected a non-empty tensor: cannot take the arg of an empty sequence",
                ));
            }
            if *keepdim {
                smallvec![1; x.shape.len()]
            } else {
                Shape::new()
            }
        }
    };
    Ok(smallvec![Meta { shape, dtype: DType::I64 }])
}

/// `Op::Softmax { dim, .. }`.
pub(super) fn softmax(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    if !x.dtype.is_float() {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    c.check_dim(*dim, x.shape.len().max(1))?;
    Ok(smallvec![meta(&x.shape, x.dtype)])
}

/// `Op::LogSumExp { dim }`.
pub(super) fn logsumexp(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    if !x.dtype.is_float() {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    c.check_dim(*dim, x.shape.len())?;
    Ok(smallvec![Meta { shape: reduced_shape(&x.shape, &[*dim], false), dtype: x.dtype }])
}

/// `Op::Cumsum { dim }`.
pub(super) fn cumsum(c: &Typing<'_>, dim: &usize) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    c.check_dim(*dim, x.shape.len())?;
    let dt = if x.dtype.is_float() { x.dtype } else { DType::I64 };
    Ok(smallvec![meta(&x.shape, dt)])
}
