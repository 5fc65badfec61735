//! `Dropout`: zeroes elements with probability `p` in training mode.
use crate::module::Module;
use kiln_tensor::{Error, Result, Tensor};

/// Dropout (`torch.nn.Dropout`): in training mode each element is zeroed with
/// probability `p` and the others scaled by `1 / (1 - p)`; in evaluation mode
/// it is the identity. Starts in training mode, like PyTorch modules.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::layers::Dropout;
/// use kiln::nn::module::Module;
/// let mut d = Dropout::new(0.5)?;
/// d.eval();
/// let x = Tensor::ones(&[4], DType::F32)?;
/// assert_eq!(d.forward(&x)?.to_vec::<f32>()?, vec![1.0; 4]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Dropout {
    /// The probability of zeroing an element.
    pub p: f64,
    training: bool,
}

impl Dropout {
    /// Dropout with probability `p` (in `[0, 1]`).
    pub fn new(p: f64) -> Result<Dropout> {
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid(
                "Dropout",
                format!("dropout probability has to be between 0 and 1, but got {p}"),
            ));
        }
        Ok(Dropout { p, training: true })
    }

    /// Applies dropout when in training mode (the mask comes from the global generator).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.dropout(self.p, self.training)
    }
}

impl Module for Dropout {
    fn visit_params(&self, _prefix: &str, _f: &mut dyn FnMut(&str, &Tensor)) {}

    fn visit_params_mut(&mut self, _prefix: &str, _f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        Ok(())
    }

    fn train(&mut self, on: bool) {
        self.training = on;
    }

    fn is_training(&self) -> bool {
        self.training
    }
}
