//! `LoraAdapter`: one LoRA adapter on one `Linear` (PEFT's `LoraLayer` for
//! one adapter): `A` `[r, in]`, `B` `[out, r]`, the scaling, the dropout on
//! the adapter's input, and the product it adds to the layer's output
//! (Note [LoRA adapters]).
use crate::layers::{normal_param, parameter, uniform_param, Dropout};
use crate::module::{join_name, Module};
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, Device, Error, Result, Tensor, TensorOptions};

/// The name of DoRA's magnitude vector, as PEFT's files hold it.
pub const MAGNITUDE: &str = "lora_magnitude_vector";

// Note [DoRA magnitudes]
// ~~~~~~~~~~~~~~~~~~~~~~
// DoRA (Liu et al. 2024) splits the adapted weight into a magnitude and a
// direction: `W' = m * (W + s B A) / ||W + s B A||`, the norm taken over each
// output row and treated as a constant (detached), `m` a trainable vector
// started at the norms of the base weight (with B = 0). The layer computes it
// without forming `W'`, as PEFT does: `y + (m / n - 1) * W x + (m / n) * s B A x`.
// It needs the dense weight: a kept-quantized base is refused. PEFT's files
// name `m` `….lora_magnitude_vector`; merging writes `W'` into the weight and
// keeps `n` to unmerge.

/// How a fresh adapter's matrices are drawn (PEFT's `init_lora_weights`),
/// from the global generator (`kiln::manual_seed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraInit {
    /// `true`, PEFT's default: `A` Kaiming-uniform with `a = sqrt(5)`
    /// (`U(-1/sqrt(in), 1/sqrt(in))`), `B` zero, so the adapter starts as
    /// the identity.
    Default,
    /// `"gaussian"`: `A ~ N(0, 1/r²)`, `B` zero.
    Gaussian,
    /// `false`: both as a fresh `torch.nn.Linear` (`A ~ U(±1/sqrt(in))`,
    /// `B ~ U(±1/sqrt(r))`), so the adapter changes the output from the
    /// start (for tests).
    Random,
}

/// A LoRA adapter on one [`crate::layers::Linear`]: the layer computes
/// `W x + b + scaling * B(A(dropout(x)))` (PEFT's product; the scaling is
/// applied to `A`'s rank-`r` output), or only `W x + b` while the adapter is
/// merged into `W`.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// `lora_A.weight`, `[r, in_features]`.
    pub lora_a: Tensor,
    /// `lora_B.weight`, `[out_features, r]`.
    pub lora_b: Tensor,
    scaling: f64,
    dropout: Dropout,
    merged: bool,
    /// DoRA's magnitude `m` (`lora_magnitude_vector`, `[out_features]`), when
    /// the adapter is a DoRA one (Note [DoRA magnitudes]).
    magnitude: Option<Tensor>,
    /// The row norms `||W + scaling * B A||` the weight was merged with
    /// (DoRA), to unmerge it.
    merged_norm: Option<Tensor>,
}

impl LoraAdapter {
    /// A fresh adapter of rank `r` for a layer `in_features -> out_features`,
    /// its matrices drawn as `init` says, in `opts`' dtype and device, as
    /// trainable parameters.
    pub fn new(
        in_features: usize,
        out_features: usize,
        r: usize,
        scaling: f64,
        dropout: f64,
        init: LoraInit,
        opts: impl Into<TensorOptions>,
    ) -> Result<LoraAdapter> {
        if r == 0 {
            return Err(Error::invalid("LoraAdapter", "the rank r must be at least 1"));
        }
        let opts = opts.into();
        let bound = |fan_in: usize| 1.0 / (fan_in.max(1) as f64).sqrt();
        let (lora_a, lora_b) = match init {
            LoraInit::Default => (
                uniform_param(&[r, in_features], bound(in_features), opts)?,
                parameter(Tensor::zeros(&[out_features, r], opts.dtype)?, opts)?,
            ),
            LoraInit::Gaussian => (
                normal_param(&[r, in_features], 1.0 / r as f64, opts)?,
                parameter(Tensor::zeros(&[out_features, r], opts.dtype)?, opts)?,
            ),
            LoraInit::Random => (
                uniform_param(&[r, in_features], bound(in_features), opts)?,
                uniform_param(&[out_features, r], bound(r), opts)?,
            ),
        };
        LoraAdapter::from_weights(lora_a, lora_b, scaling, dropout)
    }

    /// An adapter around existing matrices (checked: `A` `[r, in]` and `B`
    /// `[out, r]` of one floating dtype and device, a finite scaling, a
    /// dropout probability in `[0, 1)`).
    pub fn from_weights(lora_a: Tensor, lora_b: Tensor, scaling: f64, dropout: f64) -> Result<LoraAdapter> {
        let (a, b) = (lora_a.shape(), lora_b.shape());
        if a.len() != 2 || b.len() != 2 || a[0] != b[1] || a[0] == 0 {
            return Err(Error::shape(
                "LoraAdapter",
                format!("lora_A must be [r, in] and lora_B [out, r] with one r >= 1, got {a:?} and {b:?}"),
            ));
        }
        if lora_a.dtype() != lora_b.dtype() || !lora_a.dtype().is_float() || lora_a.device() != lora_b.device() {
            return Err(Error::dtype(
                "LoraAdapter",
                format!(
                    "lora_A ({}, {:?}) and lora_B ({}, {:?}) must share one floating dtype and device",
                    lora_a.dtype(),
                    lora_a.device(),
                    lora_b.dtype(),
                    lora_b.device()
                ),
            ));
        }
        if !scaling.is_finite() {
            return Err(Error::invalid("LoraAdapter", format!("the scaling must be finite, got {scaling}")));
        }
        Ok(LoraAdapter {
            lora_a,
            lora_b,
            scaling,
            dropout: Dropout::new(dropout)?,
            merged: false,
            magnitude: None,
            merged_norm: None,
        })
    }

    /// DoRA's magnitude vector, for a DoRA adapter.
    pub fn magnitude(&self) -> Option<&Tensor> {
        self.magnitude.as_ref()
    }

    /// Makes the adapter a DoRA one with magnitude `m` (`[out_features]`,
    /// the adapter's dtype and device).
    pub fn with_magnitude(mut self, m: Tensor) -> Result<LoraAdapter> {
        if m.shape() != [self.lora_b.shape()[0]]
            || m.dtype() != self.lora_a.dtype()
            || m.device() != self.lora_a.device()
        {
            return Err(Error::shape(
                "LoraAdapter::with_magnitude",
                format!(
                    "the magnitude must be [{}] in {} on {:?}, got {:?} {} on {:?}",
                    self.lora_b.shape()[0],
                    self.lora_a.dtype(),
                    self.lora_a.device(),
                    m.shape(),
                    m.dtype(),
                    m.device()
                ),
            ));
        }
        self.magnitude = Some(m);
        Ok(self)
    }

    /// DoRA: the norm of each row of `W + scaling * B A` (in the adapter's
    /// dtype, detached: the paper's section 4.3, as PEFT computes it).
    pub(crate) fn row_norms(&self, weight: &Tensor) -> Result<Tensor> {
        let _g = kiln_autograd::no_grad();
        let _c = ConstantScope::enter();
        let lora = self.lora_b.matmul(&self.lora_a)?.mul(self.scaling)?;
        weight.to_dtype(self.lora_a.dtype())?.add(&lora)?.square()?.sum_dim(1, false)?.sqrt()
    }

    pub(crate) fn set_merged_norm(&mut self, norm: Option<Tensor>) {
        self.merged_norm = norm;
    }

    pub(crate) fn merged_norm(&self) -> Option<&Tensor> {
        self.merged_norm.as_ref()
    }

    /// The rank `r`.
    pub fn rank(&self) -> usize {
        self.lora_a.shape()[0]
    }

    /// The factor on `B(A(x))`: `lora_alpha / r`, or `lora_alpha / sqrt(r)`
    /// with rsLoRA.
    pub fn scaling(&self) -> f64 {
        self.scaling
    }

    /// The dropout probability on the adapter's input.
    pub fn dropout(&self) -> f64 {
        self.dropout.p()
    }

    /// Whether the adapter is merged into its layer's weight (then the
    /// layer's forward does not add it again).
    pub fn is_merged(&self) -> bool {
        self.merged
    }

    pub(crate) fn set_merged(&mut self, merged: bool) {
        self.merged = merged;
    }

    /// The adapter's update of the weight, `scaling * B @ A` (`[out, in]`),
    /// in `dtype`, computed in f32 (what merging adds to `W`).
    pub fn delta_weight(&self, dtype: DType) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let (a, b) = (self.lora_a.to_dtype(DType::F32)?, self.lora_b.to_dtype(DType::F32)?);
        b.matmul(&a)?.mul(self.scaling)?.to_dtype(dtype)
    }

    /// `y + B(scaling * A(dropout(x)))`: the input is cast to the adapter's
    /// dtype and the sum taken in the wider of the two dtypes, then cast
    /// back to `y`'s (PEFT's `_cast_input_dtype` and its final cast), so a
    /// low-precision base keeps f32 adapters exact.
    ///
    /// A DoRA adapter needs the layer's dense `weight` and `bias`: it gives
    /// `y + (m / n - 1) * W x + (m / n) * B(scaling * A(x))` with `n` the
    /// detached row norms of `W + scaling * B A` (PEFT's DoRA forward; with
    /// dropout active, `W x` is recomputed on the dropped input).
    pub(crate) fn add_to(&self, y: &Tensor, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let xd = self.dropout.forward(x)?;
        let delta = self.delta(&xd)?;
        let delta = match &self.magnitude {
            None => delta,
            Some(m) => {
                let dt = self.lora_a.dtype();
                let base = if self.dropout.is_active() {
                    xd.to_dtype(dt)?.linear(&weight.to_dtype(dt)?, None)?
                } else {
                    match bias {
                        Some(b) => y.sub(b)?.to_dtype(dt)?,
                        None => y.to_dtype(dt)?,
                    }
                };
                let scale = m.div(&self.row_norms(weight)?)?;
                base.mul(&scale.sub(1.0)?)?.add(&delta.mul(&scale)?)?
            }
        };
        if delta.dtype() == y.dtype() {
            return y.add(&delta);
        }
        y.to_dtype(delta.dtype())?.add(&delta)?.to_dtype(y.dtype())
    }

    /// `B(scaling * A(x))` in the adapter's dtype (`x` cast to it), without
    /// dropout.
    pub(crate) fn delta(&self, x: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        let x = if x.dtype() == self.lora_a.dtype() { x.clone() } else { x.to_dtype(self.lora_a.dtype())? };
        // Scaling A's rank-r output rather than B's: the same product (bit-equal
        // for a power-of-two scaling), with one full-width tensor fewer kept
        // for backward.
        x.linear(&self.lora_a, None)?.mul(self.scaling)?.linear(&self.lora_b, None)
    }

    /// Moves the adapter's matrices to `device`, keeping `requires_grad`.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        Module::to_device(self, device)
    }
}

impl Module for LoraAdapter {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        f(&join_name(prefix, "lora_A.weight"), &self.lora_a);
        f(&join_name(prefix, "lora_B.weight"), &self.lora_b);
        if let Some(m) = &self.magnitude {
            f(&join_name(prefix, MAGNITUDE), m);
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        f(&join_name(prefix, "lora_A.weight"), &mut self.lora_a)?;
        f(&join_name(prefix, "lora_B.weight"), &mut self.lora_b)?;
        match &mut self.magnitude {
            Some(m) => f(&join_name(prefix, MAGNITUDE), m),
            None => Ok(()),
        }
    }

    fn train(&mut self, on: bool) {
        self.dropout.train(on)
    }

    fn is_training(&self) -> bool {
        self.dropout.is_training()
    }
}
