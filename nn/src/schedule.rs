//! Learning-rate schedules as functions of the step: constant, linear warmup,
//! warmup + cosine decay (to a minimum), warmup + linear decay, with the
//! formulas of Hugging Face transformers' `get_*_schedule_with_warmup`.
//!
//! A schedule gives a factor; the learning rate of each parameter group is its
//! initial learning rate times that factor (PyTorch's `LambdaLR`). Step `k`
//! (0-based: the `k`-th call of `optimizer.step()`) uses `factor(k)`, so with a
//! warmup the very first update has learning rate 0, as in transformers.
//!
//! ```
//! use kiln::nn::schedule::LrSchedule;
//! let s = LrSchedule::Cosine { warmup: 10, total: 110, min_lr_ratio: 0.1 };
//! assert_eq!(s.factor(0), 0.0);
//! assert_eq!(s.factor(5), 0.5);
//! assert_eq!(s.factor(10), 1.0);
//! assert!((s.factor(60) - 0.55).abs() < 1e-12); // halfway down: (1 + 0.1) / 2
//! assert!((s.factor(110) - 0.1).abs() < 1e-12);
//! ```
use crate::optim::Optimizer;
use kiln_tensor::{Error, Result};
use std::f64::consts::PI;

/// A learning-rate schedule (a multiplier of the initial learning rate per step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// Factor 1 throughout (`get_constant_schedule`).
    Constant,
    /// Linear warmup from 0 to 1 over `warmup` steps, then 1 (`get_constant_schedule_with_warmup`).
    ConstantWithWarmup { warmup: u64 },
    /// Linear warmup, then linear decay to 0 at step `total` (`get_linear_schedule_with_warmup`).
    Linear { warmup: u64, total: u64 },
    /// Linear warmup, then half a cosine from 1 down to `min_lr_ratio` at step `total`
    /// (`get_cosine_schedule_with_warmup`, or `get_cosine_with_min_lr_schedule_with_warmup`
    /// with `min_lr_rate = min_lr_ratio`); `min_lr_ratio` 0 decays to 0.
    Cosine { warmup: u64, total: u64, min_lr_ratio: f64 },
}

impl LrSchedule {
    /// The learning-rate factor at (0-based) step `step`.
    pub fn factor(&self, step: u64) -> f64 {
        let warm = |w: u64| step as f64 / w.max(1) as f64;
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::ConstantWithWarmup { warmup } => {
                if step < warmup {
                    warm(warmup)
                } else {
                    1.0
                }
            }
            LrSchedule::Linear { warmup, total } => {
                if step < warmup {
                    return warm(warmup);
                }
                let left = total as f64 - step as f64;
                (left / total.saturating_sub(warmup).max(1) as f64).max(0.0)
            }
            LrSchedule::Cosine { warmup, total, min_lr_ratio } => {
                if step < warmup {
                    return warm(warmup);
                }
                let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                let f = 0.5 * (1.0 + (PI * 0.5 * 2.0 * progress).cos());
                (f * (1.0 - min_lr_ratio) + min_lr_ratio).max(0.0)
            }
        }
    }

    /// Sets the optimizer's learning rates for (0-based) step `step`: each group's
    /// initial learning rate times [`LrSchedule::factor`]. Call it before `optimizer.step()`.
    pub fn apply(&self, optimizer: &mut dyn Optimizer, step: u64) -> f64 {
        let f = self.factor(step);
        optimizer.set_lr_factor(f);
        f
    }

    /// Parses `constant`, `constant_with_warmup`, `linear` or `cosine` (the names of
    /// transformers' `lr_scheduler_type`), with the warmup, total steps and minimum ratio given.
    pub fn from_name(name: &str, warmup: u64, total: u64, min_lr_ratio: f64) -> Result<LrSchedule> {
        Ok(match name {
            "constant" => LrSchedule::Constant,
            "constant_with_warmup" => LrSchedule::ConstantWithWarmup { warmup },
            "linear" => LrSchedule::Linear { warmup, total },
            "cosine" | "cosine_with_min_lr" => LrSchedule::Cosine { warmup, total, min_lr_ratio },
            _ => {
                return Err(Error::invalid(
                    "LrSchedule",
                    format!("unknown schedule {name:?} (expected constant, constant_with_warmup, linear or cosine)"),
                ))
            }
        })
    }
}
