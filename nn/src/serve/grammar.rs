//! Structured output: a request's grammar and the constraint that follows
//! its output token by token (Note [Constrained decoding]).
use kiln_tensor::Result;

// Note [Constrained decoding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A request with a `Grammar` (a JSON schema, any JSON object, a regular
// expression, a Lark grammar) gets a `Constraint` when it is added, compiled
// by the engine's `GrammarCompiler` (llguidance behind the OpenAI server,
// `serve::structured`); a grammar that does not compile refuses the request.
// Before each step that samples for it, the constraint computes the set of
// tokens its grammar allows next; those masks are computed on a thread of
// their own while the model runs the step (they depend only on the tokens
// already chosen), and applied last among the logit processors (Note [Logit
// processing]): every token outside the set gets -inf, so greedy and
// sampled decoding alike can only choose an allowed one. The chosen token
// advances the constraint. A sequence ends when its grammar is complete
// and allows nothing more (the constraint is finished: `Stop`, no end token
// is produced), when it produces a stop token that is one of its grammar's
// end tokens (a stop token the grammar takes as text, such as the "\n" that
// ends a byte-level model's outputs, is text here), or
// at `max_new_tokens` (`Length`: the output is then a prefix of a valid one,
// as with every peer). Preemption keeps the constraint: it has seen exactly
// the tokens the sequence keeps.

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid against this JSON schema (`json_schema`).
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's dialect).
    Lark(String),
}

/// The allowed-token state of one sequence's output.
pub trait Constraint: Send {
    /// The tokens allowed next: bit `t % 32` of word `t / 32` for token `t`;
    /// tokens past the end of the set are not allowed.
    fn allowed(&mut self) -> Result<Vec<u32>>;
    /// Takes in the token chosen.
    fn advance(&mut self, token: i64) -> Result<()>;
    /// True once the grammar is complete and allows no further token.
    fn is_finished(&self) -> bool;
    /// Whether `token` is one of the grammar's end tokens (allowed only where
    /// the output may end) rather than text it may contain.
    fn is_end(&self, token: i64) -> bool;
}

/// Turns grammars into constraints over one tokenizer's vocabulary.
pub trait GrammarCompiler: Send + Sync {
    /// A fresh constraint for `grammar`; an error when it does not compile
    /// (the message says why).
    fn compile(&self, grammar: &Grammar) -> Result<Box<dyn Constraint>>;
}

/// Whether token `t` is in the allowed set `mask`.
pub(crate) fn allows(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}
