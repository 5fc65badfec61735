//! Counters and gauges of the engine's work ([`EngineStats`]).
use std::collections::VecDeque;
use std::time::Duration;

/// Counters of the engine's work.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    /// Requests waiting.
    pub waiting: usize,
    /// Sequences running.
    pub running: usize,
    /// KV blocks held by sequences.
    pub kv_blocks_used: usize,
    /// KV blocks in the pool.
    pub kv_blocks_total: usize,
    /// Tokens generated since the start.
    pub generated_tokens: u64,
    /// Prompt tokens computed since the start (recomputation included).
    pub prefill_tokens: u64,
    /// Prompt tokens whose keys were found in shared blocks instead.
    pub prefix_hit_tokens: u64,
    /// Sequences preempted since the start.
    pub preemptions: u64,
    /// Steps run.
    pub steps: u64,
    /// Requests that produced a first token.
    pub ttft_count: u64,
    /// The sum of their times to first token.
    pub ttft_sum: Duration,
    /// The latest times to first token (at most [`TTFT_WINDOW`]), oldest first.
    pub ttft_recent: VecDeque<Duration>,
    /// Traces of the captured decode step (PJRT; Note [Step programs]).
    pub decode_traces: u64,
    /// Replays of the captured decode step.
    pub decode_replays: u64,
    /// Traces of the captured prompt-chunk step (PJRT; Note [Step programs]).
    pub chunk_traces: u64,
    /// Replays of the captured prompt-chunk step.
    pub chunk_replays: u64,
    /// Tokens proposed for verification (Note [Speculative decoding]).
    pub spec_proposed_tokens: u64,
    /// Proposed tokens the target kept.
    pub spec_accepted_tokens: u64,
    /// Verifications: sequence steps that checked a proposal.
    pub spec_verifications: u64,
    /// Tokens those steps emitted (kept proposals and the target's own).
    pub spec_emitted_tokens: u64,
}

/// How many recent times to first token [`EngineStats`] keeps.
pub const TTFT_WINDOW: usize = 1024;

impl EngineStats {
    /// The share of proposed tokens kept (none before any proposal).
    pub fn spec_acceptance_rate(&self) -> Option<f64> {
        (self.spec_proposed_tokens > 0).then(|| self.spec_accepted_tokens as f64 / self.spec_proposed_tokens as f64)
    }

    /// Tokens emitted per verifying target step of a sequence (none before any).
    pub fn spec_tokens_per_step(&self) -> Option<f64> {
        (self.spec_verifications > 0).then(|| self.spec_emitted_tokens as f64 / self.spec_verifications as f64)
    }

    /// The `q` quantile (0 to 1) of the recent times to first token.
    pub fn ttft_quantile(&self, q: f64) -> Option<Duration> {
        let mut v: Vec<Duration> = self.ttft_recent.iter().copied().collect();
        v.sort();
        let i = ((v.len() as f64 - 1.0) * q.clamp(0.0, 1.0)).round() as usize;
        v.get(i).copied()
    }
}
