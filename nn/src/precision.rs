//! Mixed precision with PyTorch's shape: [`MixedPrecisionPolicy`] (FSDP2's
//! `MixedPrecisionPolicy`) says in which dtype a model computes and returns
//! its output while its parameters, gradients and optimizer state stay
//! float32; the per-op rules are autocast's (Note \[Autocast\] in kiln-tensor).
use kiln_tensor::{autocast, DType, Error, Result, Tensor};

/// How a model mixes precisions (PyTorch's `MixedPrecisionPolicy`):
///
/// * `param_dtype`: the dtype its products compute in (bfloat16 or float16):
///   its forward runs under [`autocast()`] to it, so matmuls, linear layers and
///   attention take their float32 parameters and inputs in that dtype, while
///   softmax, norms, losses and reductions compute in float32. `None` runs in
///   the parameters' own dtype.
/// * `reduce_dtype`: the dtype gradients are reduced in across devices. The
///   gradients of float32 parameters are float32 and are reduced as such:
///   `None` or float32 (another value is an error).
/// * `output_dtype`: the dtype the forward's output is cast to (`None` keeps
///   the dtype it was computed in).
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::precision::MixedPrecisionPolicy;
/// let p = MixedPrecisionPolicy::bf16_mixed();
/// let w = Tensor::ones(&[4, 4], DType::F32)?;
/// let y = p.run(|| Tensor::ones(&[2, 4], DType::F32)?.matmul(&w))?;
/// assert_eq!(y.dtype(), DType::F32); // computed in bf16, returned as output_dtype
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MixedPrecisionPolicy {
    pub param_dtype: Option<DType>,
    pub reduce_dtype: Option<DType>,
    pub output_dtype: Option<DType>,
}

impl MixedPrecisionPolicy {
    /// bf16 compute, float32 gradient reduction and output: what large runs use.
    pub fn bf16_mixed() -> MixedPrecisionPolicy {
        MixedPrecisionPolicy {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::F32),
            output_dtype: Some(DType::F32),
        }
    }

    /// Checks the dtypes (see the type's documentation).
    pub fn validate(&self) -> Result<()> {
        if let Some(d) = self.param_dtype {
            if !matches!(d, DType::BF16 | DType::F16) {
                return Err(Error::dtype(
                    "MixedPrecisionPolicy",
                    format!("param_dtype must be bfloat16 or float16, got {d}"),
                ));
            }
        }
        if let Some(d) = self.reduce_dtype {
            if d != DType::F32 {
                return Err(Error::dtype(
                    "MixedPrecisionPolicy",
                    format!("reduce_dtype {d}: gradients of float32 master weights are reduced in float32"),
                ));
            }
        }
        if let Some(d) = self.output_dtype {
            if !d.is_float() || d.is_float8() {
                return Err(Error::dtype(
                    "MixedPrecisionPolicy",
                    format!("output_dtype must be a float dtype, got {d}"),
                ));
            }
        }
        Ok(())
    }

    /// Runs a forward `f` under the policy: autocast to `param_dtype`, the
    /// result cast to `output_dtype`.
    pub fn run(&self, f: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
        self.validate()?;
        let y = match self.param_dtype {
            Some(d) => {
                let _amp = autocast(d)?;
                f()?
            }
            None => f()?,
        };
        match self.output_dtype {
            Some(d) => y.to_dtype(d),
            None => Ok(y),
        }
    }

    /// Parses `f32` (no policy), `bf16-mixed` or `f16-mixed`.
    pub fn parse(s: &str) -> Result<Option<MixedPrecisionPolicy>> {
        Ok(match s {
            "f32" | "fp32" => None,
            "bf16-mixed" => Some(MixedPrecisionPolicy::bf16_mixed()),
            "f16-mixed" => {
                Some(MixedPrecisionPolicy { param_dtype: Some(DType::F16), ..MixedPrecisionPolicy::bf16_mixed() })
            }
            other => {
                return Err(Error::invalid("precision", format!("{other:?}: expected f32, bf16-mixed or f16-mixed")))
            }
        })
    }
}
