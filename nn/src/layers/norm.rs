//! Normalisation layers: `RmsNorm` (Llama, Qwen) and `LayerNorm`.
use super::parameter;
use crate::module::Module;
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, Result, Tensor, TensorOptions};

/// RMS normalisation over the last dim, as Llama computes it (`LlamaRMSNorm`):
/// in float32, `y = x * rsqrt(mean(x², -1) + eps)`, cast back to the input
/// dtype, then times `weight`.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::layers::RmsNorm;
/// let norm = RmsNorm::new(2, 0.0, DType::F32)?;
/// let y = norm.forward(&Tensor::new([[3.0f32, 4.0]])?)?.to_vec::<f32>()?;
/// assert!((y[0] - 3.0 / 12.5f32.sqrt()).abs() < 1e-6);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct RmsNorm {
    /// `[dim]`, initialised to ones.
    pub weight: Tensor,
    /// Added to the mean square before the square root.
    #[module(skip)]
    pub eps: f64,
}

impl RmsNorm {
    /// A norm over `dim` features with a weight of ones.
    pub fn new(dim: usize, eps: f64, opts: impl Into<TensorOptions>) -> Result<RmsNorm> {
        let opts = opts.into();
        Ok(RmsNorm { weight: parameter(Tensor::ones(&[dim], DType::F32)?, opts)?, eps })
    }

    /// Normalises `x: [..., dim]` over its last dim.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let dt = x.dtype();
        if matches!(dt, DType::F32 | DType::F64) && self.weight.dtype() == dt {
            // The same products in one fused pass (`Tensor::rms_norm`).
            return x.rms_norm(Some(&self.weight), self.eps);
        }
        // transformers normalises in float32; half precision is upcast, f64 keeps its precision.
        let x32 = if matches!(dt, DType::BF16 | DType::F16) { x.to_dtype(DType::F32)? } else { x.clone() };
        let ms = x32.square()?.mean_dim(-1, true)?;
        let y = x32.mul(&ms.add(self.eps)?.rsqrt()?)?.to_dtype(dt)?;
        self.weight.mul(&y)
    }
}

/// Layer normalisation over the last dim (`torch.nn.LayerNorm(dim)`):
/// `(x - mean) / sqrt(var + eps) * weight + bias`, biased variance,
/// half-precision inputs computed in float32.
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct LayerNorm {
    /// `[dim]`, initialised to ones (absent without an elementwise affine).
    pub weight: Option<Tensor>,
    /// `[dim]`, initialised to zeros (absent without a bias).
    pub bias: Option<Tensor>,
    /// Added to the variance before the square root.
    #[module(skip)]
    pub eps: f64,
    #[module(skip)]
    dim: usize,
}

impl LayerNorm {
    /// A norm over `dim` features with weight ones and bias zeros.
    pub fn new(dim: usize, eps: f64, affine: bool, bias: bool, opts: impl Into<TensorOptions>) -> Result<LayerNorm> {
        let opts = opts.into();
        let weight = if affine { Some(parameter(Tensor::ones(&[dim], DType::F32)?, opts)?) } else { None };
        let bias = if affine && bias { Some(parameter(Tensor::zeros(&[dim], DType::F32)?, opts)?) } else { None };
        Ok(LayerNorm { weight, bias, eps, dim })
    }

    /// Normalises `x: [..., dim]` over its last dim.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        x.layer_norm(&[self.dim], self.weight.as_ref(), self.bias.as_ref(), self.eps)
    }
}
