//! The measuring method shared by every benchmark: warm up, pick a run count from
//! the warm-up time so each benchmark takes about `target` seconds, time each run,
//! report the median. (`benches/compare_torch.py` applies it in turns: bursts of
//! `kiln-bench serve` calls alternate with bursts of PyTorch calls.)
use std::time::Instant;

/// How long to measure and how many runs to allow.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Seconds the timed runs of one benchmark should take in total.
    pub target_s: f64,
    /// Fewest timed runs, however slow one run is.
    pub min_runs: usize,
    /// Most timed runs, however fast one run is.
    pub max_runs: usize,
}

/// Seconds of warm-up calls (after the first), at most [`MAX_WARMUP`] calls.
pub const WARMUP_S: f64 = 0.2;
pub const MAX_WARMUP: usize = 10;

/// The result of timing one benchmark.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Seconds per call, one entry per timed run, sorted.
    pub samples: Vec<f64>,
}

impl Stats {
    pub fn median(&self) -> f64 {
        median(&self.samples)
    }
    pub fn min(&self) -> f64 {
        self.samples.first().copied().unwrap_or(f64::NAN)
    }
    pub fn runs(&self) -> usize {
        self.samples.len()
    }
}

/// Median of a sorted slice (mean of the two middle values for an even count).
pub fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

/// The seconds of one call of `f`.
pub fn time_call<E>(f: impl FnOnce() -> Result<(), E>) -> Result<f64, E> {
    let t0 = Instant::now();
    f()?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Times `f`, which runs the measured work `inner` times per call (use `inner > 1`
/// for operations far shorter than the timer's resolution). Each sample is the
/// time of one call divided by `inner`.
///
/// Method: one call (its time is discarded: first-touch page faults, lazy
/// initialisation), then warm-up calls until [`WARMUP_S`] seconds or
/// [`MAX_WARMUP`] calls have passed (at least one); the median warm-up call sets
/// `runs = clamp(target_s / median, min_runs, max_runs)`; then `runs` timed calls.
pub fn measure<E>(plan: Plan, inner: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<Stats, E> {
    let mut time_call = || time_call(&mut f);
    let first = time_call()?;
    let mut warm = vec![];
    let mut spent = 0.0;
    while warm.is_empty() || (spent < WARMUP_S && warm.len() < MAX_WARMUP && first < WARMUP_S) {
        let t = time_call()?;
        spent += t;
        warm.push(t);
    }
    warm.sort_by(f64::total_cmp);
    let est = median(&warm).max(1e-9);
    let runs = ((plan.target_s / est).round() as usize).clamp(plan.min_runs.max(1), plan.max_runs.max(1));
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        samples.push(time_call()? / inner.max(1) as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(Stats { samples })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn run_count_is_clamped() {
        let plan = Plan { target_s: 0.0, min_runs: 4, max_runs: 7 };
        let mut calls = 0;
        let s = measure::<()>(plan, 1, || {
            calls += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(s.runs(), 4);
        assert!(calls >= 4 + 2);
        let plan = Plan { target_s: 10.0, min_runs: 1, max_runs: 7 };
        assert_eq!(measure::<()>(plan, 10, || Ok(())).unwrap().runs(), 7);
    }
}
