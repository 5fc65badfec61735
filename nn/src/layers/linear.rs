//! `Linear`: `y = x @ W.T + b` with the weight stored `[out, in]`, as in PyTorch.
use super::{parameter, uniform_param};
use crate::module::{join_name, Module};
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{Error, Result, Tensor, TensorOptions};

/// A fully connected layer (`torch.nn.Linear`): weight `[out_features, in_features]`,
/// optional bias `[out_features]`.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::layers::Linear;
/// use kiln::nn::module::Module;
/// kiln::manual_seed(0);
/// let lin = Linear::new(4, 3, true, DType::F32)?;
/// let y = lin.forward(&Tensor::ones(&[2, 4], DType::F32)?)?;
/// assert_eq!(y.shape(), &[2, 3]);
/// assert_eq!(lin.num_parameters(), 4 * 3 + 3);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`, when the layer has a bias.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A layer initialised like PyTorch's: kaiming-uniform with `a = sqrt(5)`,
    /// i.e. `U(-1/sqrt(in), 1/sqrt(in))` for the weight and the bias, drawn from
    /// the global generator (`kiln::manual_seed`).
    pub fn new(in_features: usize, out_features: usize, bias: bool, opts: impl Into<TensorOptions>) -> Result<Linear> {
        let opts = opts.into();
        let bound = if in_features > 0 { 1.0 / (in_features as f64).sqrt() } else { 0.0 };
        let weight = uniform_param(&[out_features, in_features], bound, opts)?;
        let bias = if bias { Some(uniform_param(&[out_features], bound, opts)?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// A layer with weights drawn from `N(0, std²)` and a zero bias (Hugging
    /// Face's `_init_weights` for decoder models uses `std = 0.02`).
    pub fn new_normal(
        in_features: usize,
        out_features: usize,
        bias: bool,
        std: f64,
        opts: impl Into<TensorOptions>,
    ) -> Result<Linear> {
        let opts = opts.into();
        let weight = super::normal_param(&[out_features, in_features], std, opts)?;
        let bias = if bias { Some(parameter(Tensor::zeros(&[out_features], opts.dtype)?, opts)?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// A layer around existing tensors (checked: the weight 2-D, the bias `[out]`).
    pub fn from_weights(weight: Tensor, bias: Option<Tensor>) -> Result<Linear> {
        if weight.ndim() != 2 {
            return Err(Error::shape(
                "Linear",
                format!("weight must be 2-D [out, in], got shape {:?}", weight.shape()),
            ));
        }
        if let Some(b) = &bias {
            if b.shape() != [weight.shape()[0]] {
                return Err(Error::shape(
                    "Linear",
                    format!(
                        "bias must have shape [{}] for a weight of shape {:?}, got {:?}",
                        weight.shape()[0],
                        weight.shape(),
                        b.shape()
                    ),
                ));
            }
        }
        Ok(Linear { weight, bias })
    }

    /// `in_features`.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// `out_features`.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }

    /// `x @ W.T (+ b)` over the last dim of `x` (`[..., in]` to `[..., out]`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        x.linear(&self.weight, self.bias.as_ref())
    }
}

impl Module for Linear {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&join_name(prefix, "weight"), &self.weight);
        if let Some(b) = &self.bias {
            f(&join_name(prefix, "bias"), b);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        f(&join_name(prefix, "weight"), &mut self.weight)?;
        if let Some(b) = &mut self.bias {
            f(&join_name(prefix, "bias"), b)?;
        }
        Ok(())
    }
}
