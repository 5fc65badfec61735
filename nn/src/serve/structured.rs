//! Grammars compiled by llguidance (feature `server`): the
//! [`GrammarCompiler`] the OpenAI server gives its engine (Note [Constrained
//! decoding]).
use super::grammar::{Constraint, Grammar, GrammarCompiler};
use super::openai::Codec;
use kiln_tensor::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

// Note [JSON layout]
// ~~~~~~~~~~~~~~~~~~
// JSON schemas compile with one fixed layout: `", "` between items, `": "`
// between keys and values, no other whitespace (llguidance's
// `whitespace_flexible: false`). With free whitespace a small model can
// emit newlines or spaces until `max_tokens` runs out, which never parses;
// the fixed layout is still JSON, and it can contain no newline outside a
// string, so a byte-level model whose end token is "\n" ends only where
// its grammar does. A schema's own `x-guidance` options take precedence.

fn err(e: impl std::fmt::Display) -> Error {
    Error::invalid("grammar", e.to_string())
}

/// The tokenizer as llguidance sees it: each token's bytes in a trie, and
/// the model's tokenizer for text the grammar forces.
struct Env {
    trie: TokTrie,
    codec: Arc<Codec>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.codec.encode(text, false).unwrap_or_default().into_iter().map(|t| t as TokenId).collect()
        })
    }
}

/// Compiles grammars with llguidance over one model's tokenizer.
pub struct LlgCompiler {
    factory: ParserFactory,
    /// The grammar's end tokens.
    eos: Vec<i64>,
}

impl LlgCompiler {
    /// A compiler for `codec`'s tokens in a model vocabulary of `vocab`
    /// (larger than the tokenizer's when the embedding is padded; the extra
    /// ids are never allowed), ending where `eos` tokens are (the first of
    /// them is the grammar's end token). A byte-level codec, which has no
    /// end token of its own, gets one past the vocabulary that the model
    /// cannot produce: its outputs end when their grammar is complete.
    pub fn new(codec: Arc<Codec>, vocab: usize, eos: &[i64]) -> Result<LlgCompiler> {
        let mut words: Vec<Vec<u8>> = match codec.as_ref() {
            Codec::Bytes => (0..=255u8).map(|b| vec![b]).collect(),
            Codec::Hf(t) => {
                let json = serde_json::to_value(t.as_ref()).map_err(err)?;
                // llguidance asserts on vocabularies it cannot read.
                std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
                    .map_err(|_| err("llguidance cannot read this tokenizer's vocabulary"))?
                    .map_err(err)?
            }
        };
        if vocab >= u32::MAX as usize {
            return Err(err(format!("a vocabulary of {vocab} tokens does not fit llguidance's 32-bit token ids")));
        }
        if words.len() > vocab {
            return Err(err(format!("the tokenizer has {} tokens, the model {vocab}", words.len())));
        }
        let special = |id: usize| {
            let mut w = format!("<[{id}]>").into_bytes();
            w.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
            w
        };
        let virtual_eos = matches!(codec.as_ref(), Codec::Bytes) || eos.is_empty();
        let n = if virtual_eos { vocab + 1 } else { vocab };
        while words.len() < n {
            let id = words.len();
            words.push(special(id));
        }
        for w in words.iter_mut().filter(|w| w.is_empty()) {
            // An id the tokenizer does not use: never allowed.
            *w = vec![TokTrie::SPECIAL_TOKEN_MARKER, b'?'];
        }
        let eos_ids: Vec<TokenId> =
            if virtual_eos { vec![vocab as TokenId] } else { eos.iter().map(|&e| e as TokenId).collect() };
        if eos_ids.iter().any(|&e| e as usize >= n) {
            return Err(err(format!("end token {eos:?} outside the vocabulary of {vocab}")));
        }
        let info = TokRxInfo::new(n as u32, eos_ids[0]);
        let mut trie = TokTrie::from(&info, &words);
        if eos_ids.len() > 1 {
            trie = trie.with_eos_tokens(&eos_ids);
        }
        let env: TokEnv = Arc::new(Env { trie, codec });
        let mut factory = ParserFactory::new_simple(&env).map_err(err)?;
        factory.quiet();
        Ok(LlgCompiler { factory, eos: eos_ids.iter().map(|&e| e as i64).collect() })
    }

    /// The bytes of token `id` (a special token's text; empty for an id the
    /// tokenizer does not use or one past the vocabulary).
    pub fn token_bytes(&self, id: i64) -> Vec<u8> {
        let trie = self.factory.tok_env().tok_trie();
        let b = u32::try_from(id).map_or(&[][..], |i| trie.token(i));
        match b.split_first() {
            Some((&TokTrie::SPECIAL_TOKEN_MARKER, rest)) if rest != b"?" => rest.to_vec(),
            Some((&TokTrie::SPECIAL_TOKEN_MARKER, _)) => vec![],
            _ => b.to_vec(),
        }
    }
}

/// The `x-guidance` options of Note [JSON layout].
pub(crate) fn json_layout() -> serde_json::Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A JSON schema with the fixed layout of Note [JSON layout].
fn with_layout(mut schema: serde_json::Value) -> Result<serde_json::Value> {
    let obj = schema.as_object_mut().ok_or_else(|| err("a JSON schema must be an object"))?;
    let layout = json_layout();
    match obj.get_mut("x-guidance").and_then(|x| x.as_object_mut()) {
        Some(own) => {
            for (k, v) in layout.as_object().into_iter().flatten() {
                own.entry(k.clone()).or_insert(v.clone());
            }
        }
        None => {
            obj.insert("x-guidance".into(), layout);
        }
    }
    Ok(schema)
}

impl GrammarCompiler for LlgCompiler {
    fn compile(&self, grammar: &Grammar) -> Result<Box<dyn Constraint>> {
        let top = match grammar {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(serde_json::json!({"type": "object"}))?)
            }
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_layout(s.clone())?),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(err)?;
        Ok(Box::new(LlgConstraint { matcher: Matcher::new(Ok(parser)), eos: self.eos.clone() }))
    }
}

struct LlgConstraint {
    matcher: Matcher,
    eos: Vec<i64>,
}

impl Constraint for LlgConstraint {
    fn allowed(&mut self) -> Result<Vec<u32>> {
        Ok(self.matcher.compute_mask().map_err(err)?.as_slice().to_vec())
    }

    fn advance(&mut self, token: i64) -> Result<()> {
        let t = TokenId::try_from(token).map_err(err)?;
        self.matcher.consume_token(t).map_err(err)
    }

    fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn is_end(&self, token: i64) -> bool {
        self.eos.contains(&token)
    }
}
