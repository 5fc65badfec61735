//! What a request asks for and what comes back.
use crate::generate::Sampling;
use kiln_tensor::{Error, Result};

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

    /// Checks the request against a vocabulary and a context length.
    pub(crate) fn check(&self, vocab: usize, max_context: usize, can_detokenize: bool) -> Result<()> {
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
    /// A new token.
    Token(i64),
    /// The end: no more events follow.
    Finished(FinishReason),
}
