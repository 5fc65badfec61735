//! `Linear`: `y = x @ W.T + b` with the weight stored `[out, in]`, as in PyTorch.
use super::{parameter, uniform_param};
use crate::lora::LoraAdapter;
use crate::module::{join_name, Module};
use kiln_tensor::quant::{Activations, QuantSpec};
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, Device, Error, Result, Tensor, TensorOptions};

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
    /// The weight's codes and scales when it is kept quantized (then `weight`
    /// is a placeholder of its shape that holds one element).
    quantized: Option<QuantizedParts>,
    /// A LoRA adapter on the layer (Note [LoRA adapters]).
    adapter: Option<Box<LoraAdapter>>,
    /// Adapters served by slot (Note [Serving adapters]): data, not parameters.
    served: Vec<(usize, LoraAdapter)>,
}

/// A kept-quantized weight on its device (Note [Quantized weights] in kiln-tensor).
#[derive(Debug, Clone)]
struct QuantizedParts {
    spec: QuantSpec,
    codes: Tensor,
    scales: Tensor,
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
        Ok(Linear { weight, bias, quantized: None, adapter: None, served: vec![] })
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
        Ok(Linear { weight, bias, quantized: None, adapter: None, served: vec![] })
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
        Ok(Linear { weight, bias, quantized: None, adapter: None, served: vec![] })
    }

    /// `in_features`.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[1]
    }

    /// `out_features`.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }

    /// Replaces the weight by its quantized form (codes and block scales, laid
    /// out as `spec` says), moved to `device`: only those stay resident, and
    /// [`Linear::forward`] multiplies through the dequantizing product
    /// ([`Tensor::quant_matmul`]). The weight is frozen: it is no longer a
    /// parameter (the input still gets its gradient, so adapters on top of
    /// the layer train). The bias stays as it is.
    pub fn quantize_weight(&mut self, spec: QuantSpec, codes: Tensor, scales: Tensor, device: Device) -> Result<()> {
        // A DoRA adapter reads the dense weight, and a merged adapter is in it.
        if let Some(a) = self.adapter.as_deref().filter(|a| a.magnitude().is_some() || a.is_merged()) {
            let what = if a.is_merged() { "a merged adapter" } else { "a DoRA adapter" };
            return Err(Error::invalid("Linear", format!("the layer has {what}: its weight cannot be quantized")));
        }
        let shape = spec.check("Linear", (codes.dtype(), codes.shape()), (scales.dtype(), scales.shape()))?;
        if shape != [self.out_features(), self.in_features()] {
            return Err(Error::shape(
                "Linear",
                format!("a quantized weight of shape {shape:?} cannot replace one of shape {:?}", self.weight.shape()),
            ));
        }
        let (codes, scales) = (codes.to_device(device)?, scales.to_device(device)?);
        let dims: Vec<isize> = shape.iter().map(|&d| d as isize).collect();
        self.weight = Tensor::zeros(&[], (DType::F32, device))?.expand(&dims)?;
        self.quantized = Some(QuantizedParts { spec, codes, scales });
        Ok(())
    }

    /// How the products with the kept-quantized weight treat their input
    /// (Note [Int8 activations] in kiln-tensor: `Activations::Int8` rounds
    /// each input row to 8-bit integers first, for faster integer products;
    /// inference only). An error when the weight is not kept quantized.
    pub fn set_activations(&mut self, activations: Activations) -> Result<()> {
        match &mut self.quantized {
            Some(q) => {
                q.spec = q.spec.clone().with_activations(activations);
                Ok(())
            }
            None => Err(Error::invalid(
                "Linear::set_activations",
                "the weight is dense; only a kept-quantized weight (Linear::quantize_weight) rounds its input",
            )),
        }
    }

    /// Whether the weight is kept quantized.
    pub fn is_quantized(&self) -> bool {
        self.quantized.is_some()
    }

    /// The quantized weight's layout, codes and scales, when kept quantized.
    pub fn quantized_weight(&self) -> Option<(&QuantSpec, &Tensor, &Tensor)> {
        self.quantized.as_ref().map(|q| (&q.spec, &q.codes, &q.scales))
    }

    /// The LoRA adapter on the layer, if any.
    pub fn adapter(&self) -> Option<&LoraAdapter> {
        self.adapter.as_deref()
    }

    /// The LoRA adapter on the layer, mutably.
    pub fn adapter_mut(&mut self) -> Option<&mut LoraAdapter> {
        self.adapter.as_deref_mut()
    }

    /// Puts `adapter` on the layer (replacing one it had, which is
    /// returned): checked to fit the layer (`A` `[r, in]`, `B` `[out, r]`,
    /// on the weight's device); a merged adapter cannot be replaced, since
    /// its update is in the weight.
    pub fn set_adapter(&mut self, adapter: LoraAdapter) -> Result<Option<LoraAdapter>> {
        let (a, b) = (adapter.lora_a.shape(), adapter.lora_b.shape());
        if a[1] != self.in_features() || b[0] != self.out_features() {
            return Err(Error::shape(
                "Linear::set_adapter",
                format!(
                    "an adapter with lora_A {a:?} and lora_B {b:?} does not fit a layer {} -> {}",
                    self.in_features(),
                    self.out_features()
                ),
            ));
        }
        if adapter.lora_a.device() != self.weight.device() {
            return Err(Error::device(
                "Linear::set_adapter",
                format!("the adapter is on {:?}, the layer on {:?}", adapter.lora_a.device(), self.weight.device()),
            ));
        }
        if adapter.magnitude().is_some() && self.quantized.is_some() {
            return Err(Error::invalid("Linear::set_adapter", "DoRA needs the dense weight, which is kept quantized"));
        }
        if self.adapter.as_ref().is_some_and(|a| a.is_merged()) {
            return Err(Error::invalid("Linear::set_adapter", "the layer's adapter is merged: unmerge it first"));
        }
        Ok(self.adapter.replace(Box::new(adapter)).map(|a| *a))
    }

    /// Takes the adapter off the layer (a merged one stays in the weight).
    pub fn take_adapter(&mut self) -> Option<LoraAdapter> {
        self.adapter.take().map(|a| *a)
    }

    /// The adapters served by slot (Note [Serving adapters]).
    pub fn served_adapters(&self) -> &[(usize, LoraAdapter)] {
        &self.served
    }

    /// Serves `adapter` in slot `slot` of the layer (see
    /// [`crate::lora::load_served_adapter`]); checked to fit the layer and be
    /// on its device, the slot to be free.
    pub fn add_served_adapter(&mut self, slot: usize, adapter: LoraAdapter) -> Result<()> {
        let (a, b) = (adapter.lora_a.shape(), adapter.lora_b.shape());
        if a[1] != self.in_features() || b[0] != self.out_features() || adapter.lora_a.device() != self.weight.device()
        {
            return Err(Error::shape(
                "Linear::add_served_adapter",
                format!(
                    "an adapter with lora_A {a:?} and lora_B {b:?} on {:?} does not fit a layer {} -> {} on {:?}",
                    adapter.lora_a.device(),
                    self.in_features(),
                    self.out_features(),
                    self.weight.device()
                ),
            ));
        }
        if self.served.iter().any(|(s, _)| *s == slot) {
            return Err(Error::invalid("Linear::add_served_adapter", format!("slot {slot} is taken")));
        }
        self.served.push((slot, adapter));
        Ok(())
    }

    /// `x @ W.T (+ b)` over the last dim of `x` (`[..., in]` to `[..., out]`),
    /// plus the adapter's `scaling * B(A(x))` when one is on the layer and
    /// not merged, and under a routing the served adapters on their rows.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let y = match &self.quantized {
            None => x.linear(&self.weight, self.bias.as_ref())?,
            Some(q) => {
                let y = x.quant_matmul(&q.codes, &q.scales, &q.spec)?;
                match &self.bias {
                    Some(b) => y.add(b)?,
                    None => y,
                }
            }
        };
        let y = match self.adapter.as_deref() {
            Some(a) if !a.is_merged() => a.add_to(&y, x, &self.weight, self.bias.as_ref())?,
            _ => y,
        };
        // Layers without served adapters never look at the routing.
        if self.served.is_empty() {
            return Ok(y);
        }
        match crate::lora::serve::routing() {
            Some(r) => r.apply(&y, x, &self.served),
            None => Ok(y),
        }
    }
}

impl Module for Linear {
    fn visit_linears_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Linear) -> Result<()>) -> Result<()> {
        f(prefix, self)
    }

    // A kept-quantized weight is frozen data, not a parameter (see
    // `quantize_weight`): parameter walks skip it.
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        if self.quantized.is_none() {
            f(&join_name(prefix, "weight"), &self.weight);
        }
        if let Some(b) = &self.bias {
            f(&join_name(prefix, "bias"), b);
        }
        if let Some(a) = &self.adapter {
            a.visit_params(prefix, f);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        if self.quantized.is_none() {
            f(&join_name(prefix, "weight"), &mut self.weight)?;
        }
        if let Some(b) = &mut self.bias {
            f(&join_name(prefix, "bias"), b)?;
        }
        match &mut self.adapter {
            Some(a) => a.visit_params_mut(prefix, f),
            None => Ok(()),
        }
    }

    fn train(&mut self, on: bool) {
        if let Some(a) = &mut self.adapter {
            a.train(on)
        }
    }

    fn is_training(&self) -> bool {
        self.adapter.as_ref().is_some_and(|a| a.is_training())
    }
}
