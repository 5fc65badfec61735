//! The tokenizer inside a GGUF file (Note [GGUF tokenizers]): as a Hugging
//! Face `tokenizer.json` ([`tokenizer_json`], which `HfTokenizer::from_gguf`
//! parses) and back ([`tokenizer_metadata`], which `save_gguf` callers pass).
//!
// Note [GGUF tokenizers]
// ~~~~~~~~~~~~~~~~~~~~~~
// llama.cpp's converter stores a byte-level BPE tokenizer (Llama 3, Qwen2/3,
// GPT-2: `tokenizer.ggml.model = "gpt2"`) as
//
// * `tokenizer.ggml.tokens`: every token string, indexed by id (ids the
//   vocabulary skips are `[PAD{id}]`, type UNUSED);
// * `tokenizer.ggml.token_type`: 1 normal, 3 control (special added tokens),
//   4 user-defined (other added tokens), 5 unused;
// * `tokenizer.ggml.merges`: the merge rules as `"a b"`;
// * `tokenizer.ggml.pre`: the name of the pre-tokenizer's split regex, which
//   llama.cpp hard-codes per name rather than storing it.
//
// So a tokenizer.json is rebuilt from the name: the regex (`PRE_TOKENIZERS`,
// the patterns of the tokenizer.json files those names stand for, with their
// normalizer: Qwen2's NFC), a byte-level BPE over `tokens` and `merges`,
// control tokens as special added tokens. Writing goes the other way and
// names the regex by matching it against the same table; a pattern not in the
// table, or a tokenizer that is not byte-level BPE (SentencePiece's
// `"llama"` model, WordPiece, Unigram), is an error rather than a tokenizer
// that splits text differently.
use super::{GgufFile, GgufValue, GgufValueType};
use kiln_tensor::{Error, Result};
use serde_json::{json, Value};

fn err(msg: impl Into<String>) -> Error {
    Error::invalid("gguf tokenizer", msg)
}

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `tokenizer.ggml.pre` names, their split regex, and whether text is
/// NFC-normalized first.
const PRE_TOKENIZERS: [(&str, &str, bool); 4] =
    [("gpt-2", GPT2, false), ("llama-bpe", LLAMA3, false), ("qwen2", QWEN2, true), ("default", GPT2, false)];

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

/// The tokenizer of GGUF file `f` as the JSON of a Hugging Face
/// `tokenizer.json` (Note [GGUF tokenizers]).
pub fn tokenizer_json(f: &GgufFile) -> Result<Value> {
    let get = |k: &str| f.get(&format!("tokenizer.ggml.{k}"));
    let model = get("model").and_then(|v| v.as_str()).ok_or_else(|| err("the file has no tokenizer.ggml.model"))?;
    if model != "gpt2" {
        return Err(err(format!(
            "tokenizer model {model:?}: kiln reads byte-level BPE tokenizers (\"gpt2\") from GGUF files"
        )));
    }
    let strings = |k: &str| -> Result<Vec<&str>> {
        let items = get(k).and_then(|v| v.as_array()).ok_or_else(|| err(format!("no tokenizer.ggml.{k} array")))?;
        items.iter().map(|v| v.as_str().ok_or_else(|| err(format!("tokenizer.ggml.{k} holds a non-string")))).collect()
    };
    let tokens = strings("tokens")?;
    let merges = strings("merges")?;
    let types: Vec<i32> = match get("token_type").and_then(|v| v.as_array()) {
        None => vec![NORMAL; tokens.len()],
        Some(a) => a.iter().map(|v| v.as_i128().map(|t| t as i32).unwrap_or(NORMAL)).collect(),
    };
    if types.len() != tokens.len() {
        return Err(err(format!("{} token types for {} tokens", types.len(), tokens.len())));
    }
    let pre = get("pre").and_then(|v| v.as_str()).unwrap_or("default");
    let (_, regex, nfc) = PRE_TOKENIZERS.iter().find(|(n, _, _)| *n == pre).ok_or_else(|| {
        let known: Vec<&str> = PRE_TOKENIZERS.iter().map(|p| p.0).collect();
        err(format!("pre-tokenizer {pre:?} is not one kiln knows ({known:?})"))
    })?;
    let mut vocab = serde_json::Map::new();
    let mut added = vec![];
    for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
        match *ty {
            CONTROL | USER_DEFINED => added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": *ty == USER_DEFINED, "special": *ty == CONTROL,
            })),
            UNUSED => continue,
            _ => {}
        }
        vocab.insert(tok.to_string(), json!(id));
    }
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": if *nfc { json!({"type": "NFC"}) } else { Value::Null },
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": pre == "llama-bpe",
            "vocab": vocab, "merges": merges,
        },
    }))
}

/// The `tokenizer.ggml.*` metadata of a byte-level BPE `tokenizer.json`
/// (Note [GGUF tokenizers]), to pass to `save_gguf`.
pub fn tokenizer_metadata(tokenizer: &Value) -> Result<Vec<(String, GgufValue)>> {
    let model = &tokenizer["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(err(format!("a {} tokenizer: GGUF files hold byte-level BPE ones", model["type"])));
    }
    let pattern = split_regex(&tokenizer["pre_tokenizer"])
        .ok_or_else(|| err("the pre-tokenizer is not a byte-level split by a regex"))?;
    let (pre, _, _) = PRE_TOKENIZERS
        .iter()
        .find(|(_, r, _)| *r == pattern)
        .ok_or_else(|| err(format!("the split regex {pattern:?} is not one llama.cpp names")))?;
    let vocab = model["vocab"].as_object().ok_or_else(|| err("the BPE model has no vocab"))?;
    let mut by_id: Vec<Option<(String, i32)>> = vec![];
    let mut put = |id: usize, tok: &str, ty: i32| {
        if by_id.len() <= id {
            by_id.resize(id + 1, None);
        }
        by_id[id] = Some((tok.to_string(), ty));
    };
    for (tok, id) in vocab {
        put(id.as_u64().ok_or_else(|| err(format!("vocab[{tok:?}] is not an id")))? as usize, tok, NORMAL);
    }
    for a in tokenizer["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(tok)) = (a["id"].as_u64(), a["content"].as_str()) else {
            return Err(err(format!("an added token without an id or content: {a}")));
        };
        put(id as usize, tok, if a["special"].as_bool() == Some(true) { CONTROL } else { USER_DEFINED });
    }
    let (tokens, types): (Vec<String>, Vec<i32>) =
        by_id.into_iter().enumerate().map(|(id, t)| t.unwrap_or_else(|| (format!("[PAD{id}]"), UNUSED))).unzip();
    let merges: Vec<String> = model["merges"]
        .as_array()
        .ok_or_else(|| err("the BPE model has no merges"))?
        .iter()
        .map(|m| match m {
            Value::String(s) => Ok(s.clone()),
            Value::Array(p) if p.len() == 2 && p.iter().all(|x| x.is_string()) => {
                Ok(format!("{} {}", p[0].as_str().unwrap_or_default(), p[1].as_str().unwrap_or_default()))
            }
            other => Err(err(format!("a merge that is neither \"a b\" nor [a, b]: {other}"))),
        })
        .collect::<Result<_>>()?;
    Ok(vec![
        ("tokenizer.ggml.model".into(), GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), GgufValue::String(pre.to_string())),
        ("tokenizer.ggml.tokens".into(), GgufValue::strings(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            GgufValue::Array(GgufValueType::I32, types.into_iter().map(GgufValue::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), GgufValue::strings(merges)),
    ])
}

/// The regex of a `Sequence[Split(regex), ByteLevel(use_regex=false)]`
/// pre-tokenizer (or a lone ByteLevel with its built-in regex: GPT-2's).
fn split_regex(pre: &Value) -> Option<&str> {
    match pre["type"].as_str()? {
        "ByteLevel" if pre["use_regex"].as_bool() != Some(false) => Some(GPT2),
        "Sequence" => match pre["pretokenizers"].as_array()?.as_slice() {
            [split, byte_level]
                if split["type"] == "Split"
                    && byte_level["type"] == "ByteLevel"
                    && byte_level["use_regex"].as_bool() == Some(false) =>
            {
                split["pattern"]["Regex"].as_str()
            }
            _ => None,
        },
        _ => None,
    }
}
