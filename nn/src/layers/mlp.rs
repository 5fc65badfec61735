//! The SwiGLU MLP of Llama and Qwen: `down(silu(gate(x)) * up(x))`.
use super::Linear;
use crate::module::Module;
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, Result, Tensor, TensorOptions};

/// The gated feed-forward block of Llama/Qwen (`LlamaMLP`): parameters
/// `gate_proj` and `up_proj` (`[intermediate, hidden]`) and `down_proj`
/// (`[hidden, intermediate]`).
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct SwiGluMlp {
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear,
}

impl SwiGluMlp {
    /// A block with `N(0, std²)` weights (`bias` for all three projections).
    pub fn new(
        hidden: usize,
        intermediate: usize,
        bias: bool,
        std: f64,
        opts: impl Into<TensorOptions>,
    ) -> Result<Self> {
        let opts = opts.into();
        Ok(SwiGluMlp {
            gate_proj: Linear::new_normal(hidden, intermediate, bias, std, opts)?,
            up_proj: Linear::new_normal(hidden, intermediate, bias, std, opts)?,
            down_proj: Linear::new_normal(intermediate, hidden, bias, std, opts)?,
        })
    }

    /// `down(silu(gate(x)) * up(x))` for `x: [..., hidden]`.
    ///
    /// In float32 and float64 the gate is one fused pass ([`Tensor::silu_mul`]);
    /// half precision rounds `silu` before the product, as transformers does.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let g = self.gate_proj.forward(x)?;
        let u = self.up_proj.forward(x)?;
        self.down_proj.forward(&silu_gate(&g, &u)?)
    }
}

/// SwiGLU's gate `silu(g) * u`: one fused pass in float32 and float64; half
/// precision rounds `silu` before the product, as transformers does.
pub(crate) fn silu_gate(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    match g.dtype() {
        DType::F32 | DType::F64 => g.silu_mul(u),
        _ => g.silu()?.mul(u),
    }
}
