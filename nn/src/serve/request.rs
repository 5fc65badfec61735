//! What a request asks for and what comes back.
use super::grammar::Grammar;
use crate::generate::Sampling;
use kiln_tensor::{Error, Result};

/// Penalties on tokens already seen (Note [Logit processing]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// transformers' `RepetitionPenaltyLogitsProcessor`: the logit of every
    /// token of the prompt or the output so far is divided by it when
    /// positive, multiplied when negative (1: off; must be > 0).
    pub repetition: f32,
    /// OpenAI's `presence_penalty`: subtracted once from the logit of every
    /// token the output holds (0: off).
    pub presence: f32,
    /// OpenAI's `frequency_penalty`: subtracted from a token's logit once per
    /// time the output holds it (0: off).
    pub frequency: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties { repetition: 1.0, presence: 0.0, frequency: 0.0 }
    }
}

impl Penalties {
    /// True when no penalty changes a logit.
    pub fn is_off(&self) -> bool {
        self.repetition == 1.0 && self.presence == 0.0 && self.frequency == 0.0
    }
}

/// The log-probabilities reported with a token (`Request::logprobs`).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability under the model's distribution
    /// (`log_softmax` of the step's logits, before any processing).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first
    /// (as many as the request asked for).
    pub top: Vec<(i64, f32)>,
}

/// One generation request: a prompt of token ids and how to continue it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<i64>,
    /// Temperature, top-k, top-p and seed, as [`crate::generate::generate`]
    /// takes them (`eos_token_ids` and `use_cache` are not used here: see
    /// `stop_token_ids`).
    pub sampling: Sampling,
    /// At most this many new tokens (at least 1).
    pub max_new_tokens: usize,
    /// Generation stops after any of these tokens (it is the last one sent).
    pub stop_token_ids: Vec<i64>,
    /// Generation stops once the text of the new tokens contains one of these
    /// (needs the engine's detokenizer).
    pub stop_strings: Vec<String>,
    /// The LoRA adapter to serve it with, by the name the engine loaded it
    /// under (`Engine::load_adapter`); `None`: the base model.
    pub adapter: Option<String>,
    /// Repetition, presence and frequency penalties.
    pub penalties: Penalties,
    /// Added to the logits of these tokens before sampling (OpenAI's
    /// `logit_bias`; -100 bans a token in practice, 100 all but forces it).
    pub logit_bias: Vec<(i64, f32)>,
    /// `Some(k)`: every token comes with its log-probability and the `k`
    /// most likely tokens' ([`Event::Token`]).
    pub logprobs: Option<usize>,
    /// What the output must match (Note [Constrained decoding]); needs an
    /// engine with a grammar compiler (`EngineConfig::grammars`).
    pub grammar: Option<Grammar>,
}

impl Request {
    /// Greedy decoding of up to `max_new_tokens` after `prompt`.
    pub fn new(prompt: Vec<i64>, max_new_tokens: usize) -> Request {
        Request {
            prompt,
            sampling: Sampling::greedy(),
            max_new_tokens,
            stop_token_ids: vec![],
            stop_strings: vec![],
            adapter: None,
            penalties: Penalties::default(),
            logit_bias: vec![],
            logprobs: None,
            grammar: None,
        }
    }

    /// With these sampling settings.
    pub fn with_sampling(mut self, s: Sampling) -> Request {
        self.sampling = s;
        self
    }

    /// Stopping after any of these tokens.
    pub fn with_stop_tokens(mut self, ids: &[i64]) -> Request {
        self.stop_token_ids = ids.to_vec();
        self
    }

    /// Stopping at any of these strings.
    pub fn with_stop_strings(mut self, s: &[&str]) -> Request {
        self.stop_strings = s.iter().map(|x| x.to_string()).collect();
        self
    }

    /// Served with the adapter loaded as `name`.
    pub fn with_adapter(mut self, name: &str) -> Request {
        self.adapter = Some(name.to_string());
        self
    }

    /// With these penalties.
    pub fn with_penalties(mut self, p: Penalties) -> Request {
        self.penalties = p;
        self
    }

    /// With these biases added to the logits of these tokens.
    pub fn with_logit_bias(mut self, bias: &[(i64, f32)]) -> Request {
        self.logit_bias = bias.to_vec();
        self
    }

    /// Reporting each token's log-probability and the `top` most likely ones.
    pub fn with_logprobs(mut self, top: usize) -> Request {
        self.logprobs = Some(top);
        self
    }

    /// Constrained to `grammar`.
    pub fn with_grammar(mut self, grammar: Grammar) -> Request {
        self.grammar = Some(grammar);
        self
    }

    /// Checks the request against a vocabulary and a context length.
    pub(crate) fn check(
        &self,
        vocab: usize,
        max_context: usize,
        can_detokenize: bool,
        can_constrain: bool,
    ) -> Result<()> {
        let bad = |m: String| Err(Error::invalid("serve", m));
        if self.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if let Some(t) = self.prompt.iter().find(|&&t| t < 0 || t as u64 >= vocab as u64) {
            return bad(format!("prompt token {t} is outside the vocabulary of {vocab}"));
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens must be at least 1".into());
        }
        let total = self.prompt.len().saturating_add(self.max_new_tokens);
        if total > max_context {
            return bad(format!(
                "the prompt ({} tokens) and max_new_tokens ({}) exceed the context of {max_context} positions",
                self.prompt.len(),
                self.max_new_tokens
            ));
        }
        if !self.stop_strings.is_empty() && !can_detokenize {
            return bad("stop strings need an engine with a detokenizer".into());
        }
        if self.stop_strings.iter().any(|s| s.is_empty()) {
            return bad("stop strings must not be empty".into());
        }
        if self.grammar.is_some() && !can_constrain {
            return bad("a grammar needs an engine with a grammar compiler (EngineConfig::grammars)".into());
        }
        let p = &self.penalties;
        if !(p.repetition.is_finite() && p.repetition > 0.0) {
            return bad(format!("the repetition penalty must be positive, got {}", p.repetition));
        }
        if !p.presence.is_finite() || !p.frequency.is_finite() {
            return bad(format!("penalties must be finite, got presence {} and frequency {}", p.presence, p.frequency));
        }
        for &(t, b) in &self.logit_bias {
            if t < 0 || t as u64 >= vocab as u64 {
                return bad(format!("logit_bias token {t} is outside the vocabulary of {vocab}"));
            }
            if !b.is_finite() {
                return bad(format!("the logit bias of token {t} is {b}"));
            }
        }
        if self.logprobs.is_some_and(|k| k > vocab) {
            return bad(format!("{} top logprobs asked of a vocabulary of {vocab}", self.logprobs.unwrap_or(0)));
        }
        self.sampling.check_for("serve")
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced `max_new_tokens`.
    Length,
    /// It produced a stop token or a stop string.
    Stop,
    /// Its receiver went away or it was aborted.
    Cancelled,
    /// The engine could not run it (the message says why).
    Error(String),
}

/// One event of a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token, with its log-probabilities when the request asked for them.
    Token(i64, Option<TokenLogprobs>),
    /// The end: no more events follow.
    Finished(FinishReason),
}
