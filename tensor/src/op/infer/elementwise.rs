//! Typing of the elementwise primitives and random bits.
use super::{meta, Typing};
use crate::error::fmt_shape;
use crate::op::{BinaryOp, UnaryOp};
use crate::{DType, Error, Meta, Result, Shape};
use smallvec::{smallvec, SmallVec};

/// `Op::RandomBits { shape }`.
pub(super) fn random_bits(c: &Typing<'_>, shape: &Shape) -> Result<SmallVec<[Meta; 2]>> {
    let st = &c.inputs[0];
    if st.dtype != DType::I64 || st.shape.as_slice() != [2] {
        return Err(Error::invalid(
            c.name,
            format!(
                "expected a generator state of shape [2] and dtype int64, got {} {}",
                fmt_shape(&st.shape),
                st.dtype
            ),
        ));
    }
    Ok(smallvec![meta(shape, DType::I64), meta(&[2], DType::I64)])
}

/// `Op::Unary(u)`.
pub(super) fn unary(c: &Typing<'_>, u: &UnaryOp) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    if u.is_float_only() && !x.dtype.is_float() {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    let dt = match u {
        UnaryOp::Not | UnaryOp::IsNan | UnaryOp::IsInf => DType::Bool,
        UnaryOp::Neg if x.dtype == DType::Bool => {
            return Err(Error::dtype(
                c.name,
                "negation, the `-` operator, on a bool tensor is not supported; use the `!` operator or logical_not() instead",
            ))
        }
        _ => x.dtype,
    };
    Ok(smallvec![meta(&x.shape, dt)])
}

/// `Op::Binary(b)`.
pub(super) fn binary(c: &Typing<'_>, b: &BinaryOp) -> Result<SmallVec<[Meta; 2]>> {
    let (x, y) = (&c.inputs[0], &c.inputs[1]);
    c.same_shape(x, y)?;
    c.same_dtype(x, y)?;
    if *b == BinaryOp::Sub && x.dtype == DType::Bool {
        return Err(Error::dtype(
            c.name,
            "subtraction, the `-` operator, with two bool tensors is not supported; use the `^` operator or logical_xor() instead",
        ));
    }
    if matches!(b, BinaryOp::Atan2 | BinaryOp::SiluMul | BinaryOp::SiluGradMul) && !x.dtype.is_float() {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    let shift = matches!(b, BinaryOp::LeftShift | BinaryOp::RightShift);
    if b.is_bitwise() && (x.dtype.is_float() || (shift && x.dtype == DType::Bool)) {
        return Err(Error::unsupported_dtype(c.name, x.dtype));
    }
    let dt = if b.is_logical() { DType::Bool } else { x.dtype };
    Ok(smallvec![meta(&x.shape, dt)])
}

/// `Op::Compare(_)`.
pub(super) fn compare(c: &Typing<'_>) -> Result<SmallVec<[Meta; 2]>> {
    c.same_shape(&c.inputs[0], &c.inputs[1])?;
    c.same_dtype(&c.inputs[0], &c.inputs[1])?;
    Ok(smallvec![meta(&c.inputs[0].shape, DType::Bool)])
}

/// `Op::Where`.
pub(super) fn where_(c: &Typing<'_>) -> Result<SmallVec<[Meta; 2]>> {
    let (cond, a, b) = (&c.inputs[0], &c.inputs[1], &c.inputs[2]);
    if cond.dtype != DType::Bool {
        return Err(Error::dtype(
            c.name,
            format!("where expected condition to be a boolean tensor, but got a tensor with dtype {}", cond.dtype),
        ));
    }
    c.same_shape(cond, a)?;
    c.same_shape(a, b)?;
    c.same_dtype(a, b)?;
    Ok(smallvec![meta(&a.shape, a.dtype)])
}
