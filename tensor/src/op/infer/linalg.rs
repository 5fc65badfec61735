//! Typing of the products: matmul and the quantized weight ops.
use super::{meta, Typing};
use crate::error::fmt_shape;
use crate::op::quant::QuantSpec;
use crate::{DType, Error, Meta, Result, Shape};
use smallvec::{smallvec, SmallVec};

/// `Op::Dequantize(spec)`.
pub(super) fn dequantize(c: &Typing<'_>, spec: &QuantSpec) -> Result<SmallVec<[Meta; 2]>> {
    let [out, inp] =
        spec.check(c.name, (c.inputs[0].dtype, &c.inputs[0].shape), (c.inputs[1].dtype, &c.inputs[1].shape))?;
    Ok(smallvec![meta(&[out, inp], DType::F32)])
}

/// `Op::QuantMatMul(spec)`.
pub(super) fn quant_matmul(c: &Typing<'_>, spec: &QuantSpec) -> Result<SmallVec<[Meta; 2]>> {
    let x = &c.inputs[0];
    let [out, inp] =
        spec.check(c.name, (c.inputs[1].dtype, &c.inputs[1].shape), (c.inputs[2].dtype, &c.inputs[2].shape))?;
    if !matches!(x.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::dtype(c.name, format!("expected a float32, bfloat16 or float16 input, got {}", x.dtype)));
    }
    if x.shape.last() != Some(&inp) {
        return Err(Error::shape(
            c.name,
            format!("mat1 and mat2 shapes cannot be multiplied ({} and [{inp}, {out}])", fmt_shape(&x.shape)),
        ));
    }
    let mut s: Shape = x.shape.clone();
    *s.last_mut().expect("checked above") = out;
    Ok(smallvec![Meta { shape: s, dtype: x.dtype }])
}

/// `Op::MatMul`.
pub(super) fn matmul(c: &Typing<'_>) -> Result<SmallVec<[Meta; 2]>> {
    let (a, b) = (&c.inputs[0], &c.inputs[1]);
    c.same_dtype(a, b)?;
    let (ra, rb) = (a.shape.len(), b.shape.len());
    if ra < 2 || ra != rb || a.shape[..ra - 2] != b.shape[..rb - 2] || a.shape[ra - 1] != b.shape[rb - 2] {
        return Err(Error::shape(
            c.name,
            format!("mat1 and mat2 shapes cannot be multiplied ({} and {})", fmt_shape(&a.shape), fmt_shape(&b.shape)),
        ));
    }
    let mut s: Shape = a.shape[..ra - 1].into();
    s.push(b.shape[rb - 1]);
    Ok(smallvec![Meta { shape: s, dtype: a.dtype }])
}
