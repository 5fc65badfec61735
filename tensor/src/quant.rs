//! The tensor API of block-quantized weights (`dequantize`, `quant_matmul`);
//! the formats themselves are `op::quant`'s (Note [Quantized weights]).
use crate::Result;

pub use crate::op::quant::*;

impl crate::Tensor {
    /// The float32 weight `[out, in]` of a block-quantized one (`codes`,
    /// `scales` laid out as `spec` says, Note [Quantized weights]).
    pub fn dequantize(codes: &crate::Tensor, scales: &crate::Tensor, spec: &QuantSpec) -> Result<crate::Tensor> {
        crate::Tensor::apply1(crate::Op::Dequantize(spec.clone()), &[codes, scales])
    }

    /// `self @ W.T` for a block-quantized weight `W [out, in]` given as
    /// `codes` and `scales` (weight-only quantization): `self [..., in]`
    /// float32, bfloat16 or float16; the result `[..., out]` in `self`'s
    /// dtype, accumulated in float32. `W` is never materialised (see
    /// `Op::QuantMatMul`).
    pub fn quant_matmul(
        &self,
        codes: &crate::Tensor,
        scales: &crate::Tensor,
        spec: &QuantSpec,
    ) -> Result<crate::Tensor> {
        crate::Tensor::apply1(crate::Op::QuantMatMul(spec.clone()), &[self, codes, scales])
    }
}
