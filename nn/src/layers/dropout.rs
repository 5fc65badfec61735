//! `Dropout`: zeroes elements with probability `p` in training mode.
use crate::module::Module;
use kiln_tensor::trace::{ConstantScope, Watch};
use kiln_tensor::{Error, Result, Tensor};

/// Dropout (`torch.nn.Dropout`): in training mode each element is zeroed with
/// probability `p` and the others scaled by `1 / (1 - p)`; in evaluation mode
/// it is the identity. Starts in training mode, like PyTorch modules. The
/// mask comes from the default generator of the input's device.
///
/// Under `kiln::compile`, `p` and the training mode are watched settings
/// (Note [Host values]): a compiled step traced in training mode traces again
/// if it is called in evaluation mode, and replays again once training is
/// back on.
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
#[derive(Debug)]
pub struct Dropout {
    p: f64,
    training: bool,
    /// What traced functions see of `p` and the mode.
    watch: Watch,
}

impl Clone for Dropout {
    fn clone(&self) -> Dropout {
        // A clone changes its own mode: it gets its own watch.
        Dropout { p: self.p, training: self.training, watch: Watch::new("Dropout", self.watch.peek()) }
    }
}

fn check_p(p: f64) -> Result<()> {
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::invalid("Dropout", format!("dropout probability has to be between 0 and 1, but got {p}")));
    }
    Ok(())
}

/// The watched value: `p`'s bits in training mode, a value no probability has otherwise.
fn watched(p: f64, training: bool) -> u64 {
    if training {
        p.to_bits()
    } else {
        u64::MAX
    }
}

impl Dropout {
    /// Dropout with probability `p` (in `[0, 1]`).
    pub fn new(p: f64) -> Result<Dropout> {
        check_p(p)?;
        Ok(Dropout { p, training: true, watch: Watch::new("Dropout", watched(p, true)) })
    }

    /// The probability of zeroing an element.
    pub fn p(&self) -> f64 {
        self.p
    }

    /// Changes the probability (in `[0, 1]`).
    pub fn set_p(&mut self, p: f64) -> Result<()> {
        check_p(p)?;
        self.p = p;
        self.watch.set(watched(p, self.training));
        Ok(())
    }

    /// Whether `forward` drops anything (training mode and `p > 0`).
    pub fn is_active(&self) -> bool {
        self.watch.get();
        self.training && self.p > 0.0
    }

    /// Applies dropout when in training mode.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _c = ConstantScope::enter();
        self.watch.get();
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
        self.watch.set(watched(self.p, on));
    }

    fn is_training(&self) -> bool {
        self.training
    }
}
