//! Structured output through the serving engine (Note [Constrained
//! decoding]): with llguidance's masks, every output of a JSON schema, a
//! regular expression or a Lark grammar is in its language, greedy and
//! sampled, for a byte-level model and for a byte-level BPE tokenizer with
//! merges and a special end token; grammars that do not compile are refused.
use kiln::nn::generate::Sampling;
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::serve::openai::Codec;
use kiln::nn::serve::structured::LlgCompiler;
use kiln::nn::serve::{Engine, EngineConfig, Event, FinishReason, Grammar, Request};
use kiln::prelude::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

mod common;

/// GPT-2's byte-to-character map of byte-level BPE vocabularies.
fn byte_chars() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec![' '; 256];
    for (b, c) in printable.into_iter().zip(chars) {
        map[b as usize] = char::from_u32(c).unwrap();
    }
    map
}

/// A byte-level BPE tokenizer: the 256 bytes, a few merges, and `<|im_end|>`
/// (id 264); returns its `tokenizer.json`.
fn bpe_tokenizer() -> Value {
    let m = byte_chars();
    let mut vocab: BTreeMap<String, usize> = (0..256).map(|b| (m[b].to_string(), b)).collect();
    let sp = m[b' ' as usize];
    let merges = [("t", "r"), ("u", "e"), ("tr", "ue"), ("\"", ":"), (&*sp.to_string(), "\""), (",", &*sp.to_string())];
    let mut list = vec![];
    for (a, b) in merges {
        let id = vocab.len();
        vocab.insert(format!("{a}{b}"), id);
        list.push(format!("{a} {b}"));
    }
    // Pad to 264: two more merges.
    for (a, b) in [("{", "\""), ("a", "b")] {
        let id = vocab.len();
        vocab.insert(format!("{a}{b}"), id);
        list.push(format!("{a} {b}"));
    }
    assert_eq!(vocab.len(), 264);
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 264, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": list}
    })
}

/// A model of `vocab` tokens ending with `eos`, and its codec.
fn setup(vocab: usize, eos: i64, tokenizer: Option<Value>) -> (LlamaForCausalLM, Arc<Codec>) {
    let cfg = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "llama", "vocab_size": {vocab}, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "eos_token_id": {eos}}}"#
    ))
    .unwrap();
    kiln::manual_seed(21);
    let m = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    let codec = match tokenizer {
        None => Codec::Bytes,
        Some(t) => {
            let dir = std::env::temp_dir().join(format!("kiln-structured-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("tokenizer.json"), t.to_string()).unwrap();
            let c = Codec::for_model(&dir).unwrap();
            std::fs::remove_dir_all(&dir).ok();
            c
        }
    };
    (m, Arc::new(codec))
}

/// Runs every request to its end: its text (without a final end token) and
/// why it ended.
fn run(m: &LlamaForCausalLM, codec: &Arc<Codec>, eos: i64, reqs: &[Request]) -> Vec<(String, FinishReason)> {
    let grammars = Arc::new(LlgCompiler::new(codec.clone(), m.config().vocab_size, &[eos]).unwrap());
    let cfg = EngineConfig { block_size: 8, max_num_seqs: 8, grammars: Some(grammars), ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    let ids: Vec<u64> = reqs.iter().map(|r| engine.add_request(r.clone().with_stop_tokens(&[eos])).unwrap()).collect();
    let mut got: BTreeMap<u64, (Vec<i64>, Option<FinishReason>)> = BTreeMap::new();
    while engine.has_work() {
        for o in engine.step() {
            let e = got.entry(o.id).or_default();
            match o.event {
                Event::Token(t, _) if t == eos => {}
                Event::Token(t, _) => e.0.push(t),
                Event::Finished(f) => e.1 = Some(f),
            }
        }
    }
    ids.iter().map(|id| got.remove(id).unwrap()).map(|(t, f)| (codec.decode(&t), f.unwrap())).collect()
}

/// A schema whose every instance is short, and a check of an instance that
/// does not rely on the engine's grammar machinery.
fn schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["name", "age", "colour", "flags"], "additionalProperties": false})
}

fn valid(v: &Value) -> bool {
    let o = v.as_object().unwrap();
    let keys: Vec<&str> = o.keys().map(|k| k.as_str()).collect();
    keys.len() == 4
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
        && o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a))
        && ["red", "green", "blue"].contains(&o["colour"].as_str().unwrap_or(""))
        && o["flags"].as_array().is_some_and(|a| a.len() <= 3 && a.iter().all(|b| b.is_boolean()))
}

fn requests(prompt: Vec<i64>) -> Vec<Request> {
    let mut reqs = vec![];
    for s in [None, Some(1u64), Some(2), Some(3)] {
        let sampling = match s {
            None => Sampling::greedy(),
            Some(seed) => Sampling::sample(1.0).with_seed(seed),
        };
        let base = Request::new(prompt.clone(), 160).with_sampling(sampling);
        reqs.push(base.clone().with_grammar(Grammar::JsonSchema(schema())));
        reqs.push(base.clone().with_grammar(Grammar::Regex("[a-z]{3}-[0-9]{2,4}".into())));
        reqs.push(
            base.with_grammar(Grammar::Lark(
                r#"start: "(" item ("," item)* ")"
item: /[xyz]/ | start"#
                    .into(),
            )),
        );
    }
    reqs
}

fn check_outputs(what: &str, got: &[(String, FinishReason)]) {
    // `[a-z]{3}-[0-9]{2,4}`, checked by hand.
    let matches = |t: &str| {
        let b = t.as_bytes();
        b.len() >= 6
            && b.len() <= 8
            && b[..3].iter().all(u8::is_ascii_lowercase)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_digit)
    };
    for (i, (text, why)) in got.iter().enumerate() {
        match i % 3 {
            0 => {
                assert_eq!(*why, FinishReason::Stop, "{what}: {text:?}");
                let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: {text:?}: {e}"));
                assert!(valid(&v), "{what}: {text} does not follow the schema");
            }
            1 => assert!(matches(text), "{what}: {text:?} does not match the regex"),
            _ => {
                // Balanced parentheses around comma-separated x, y, z or groups.
                let mut depth = 0i32;
                let ok = text.starts_with('(')
                    && text.chars().all(|c| {
                        depth += (c == '(') as i32 - (c == ')') as i32;
                        depth >= 0 && "()xyz,".contains(c)
                    });
                assert!(ok && (depth == 0 || *why == FinishReason::Length), "{what}: {text:?} is not in the grammar");
                assert!(!text.contains("(,") && !text.contains(",,") && !text.contains(",)"), "{what}: {text:?}");
            }
        }
    }
}

#[test]
fn constrained_outputs_are_in_their_grammars_language() {
    let _invariant = common::batch_invariance(true);
    // Bytes: the end token is "\n", a byte a JSON layout never emits (Note [JSON layout]).
    let (m, codec) = setup(256, 10, None);
    let got = run(&m, &codec, 10, &requests(b"Answer: ".iter().map(|&b| b as i64).collect()));
    check_outputs("bytes", &got);
    eprintln!("bytes: {:?}", got.iter().take(3).map(|g| &g.0).collect::<Vec<_>>());
    // A BPE tokenizer with merges, a special end token and a padded vocabulary.
    let (m, codec) = setup(272, 264, Some(bpe_tokenizer()));
    let prompt = codec.encode("Answer: ", false).unwrap();
    let got = run(&m, &codec, 264, &requests(prompt));
    check_outputs("bpe", &got);
    eprintln!("bpe: {:?}", got.iter().take(3).map(|g| &g.0).collect::<Vec<_>>());
}

#[test]
fn json_objects_are_objects_and_bad_grammars_are_refused() {
    let (m, codec) = setup(256, 10, None);
    let prompt: Vec<i64> = b"{".iter().map(|&b| b as i64).collect();
    let reqs: Vec<Request> = (0..4)
        .map(|s| Request::new(prompt.clone(), 200).with_sampling(Sampling::sample(0.8).with_seed(s)))
        .map(|r| r.with_grammar(Grammar::JsonObject))
        .collect();
    for (text, why) in run(&m, &codec, 10, &reqs) {
        // Any object may be long: one that ran out of tokens is a prefix of one.
        if why == FinishReason::Stop {
            assert!(serde_json::from_str::<Value>(&text).unwrap().is_object(), "{text}");
        } else {
            assert!(text.starts_with('{') && serde_json::from_str::<Value>(&text).is_err(), "{text}");
        }
    }
    // A vocabulary past 32-bit token ids: an error, not an allocation of billions.
    let e = LlgCompiler::new(codec.clone(), u32::MAX as usize, &[10]).err().expect("refused");
    assert!(e.to_string().contains("32-bit"), "{e}");
    let grammars = Arc::new(LlgCompiler::new(codec, 256, &[10]).unwrap());
    let cfg = EngineConfig { grammars: Some(grammars), ..Default::default() };
    let mut engine = Engine::new(m.clone(), cfg).unwrap();
    for g in [
        Grammar::Regex("[a-".into()),
        Grammar::Lark("start: (".into()),
        Grammar::JsonSchema(json!({"type": "nonsense"})),
        Grammar::JsonSchema(json!({"$ref": "#/definitions/missing"})),
    ] {
        let e = engine.add_request(Request::new(vec![1], 4).with_grammar(g.clone())).unwrap_err();
        assert!(e.to_string().contains("grammar"), "{g:?}: {e}");
    }
    // Without a compiler, a grammar is refused rather than ignored.
    let mut plain = Engine::new(m, EngineConfig::default()).unwrap();
    let e = plain.add_request(Request::new(vec![1], 4).with_grammar(Grammar::JsonObject)).unwrap_err();
    assert!(e.to_string().contains("grammar compiler"), "{e}");
}

/// A tokenizer llguidance cannot read (a word-level vocabulary with a
/// Metaspace decoder) is an error from the compiler, not a panic, and the
/// server still starts: without structured output, which it then refuses.
#[test]
fn tokenizers_llguidance_cannot_read_leave_the_server_without_grammars() {
    let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": true},
        "model": {"type": "WordLevel", "unk_token": "<unk>",
                  "vocab": {"hello": 0, "world": 1, "<unk>": 2, "!": 3}}}"#;
    let dir = std::env::temp_dir().join(format!("kiln-structured-wordlevel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json).unwrap();
    let cfg = LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "eos_token_id": 3}"#,
    )
    .unwrap();
    LlamaForCausalLM::new(&cfg, DType::F32).unwrap().save_pretrained(&dir).unwrap();
    let codec = Arc::new(Codec::for_model(&dir).unwrap());
    let e = LlgCompiler::new(codec, 8, &[3]).err().expect("llguidance reads no Metaspace word-level vocabulary");
    assert!(e.to_string().contains("grammar"), "{e}");
    let state =
        kiln::nn::serve::openai::ServerState::from_dir(&dir, DType::F32, EngineConfig::default(), None).unwrap();
    assert!(state.grammars.is_err());
    let e = state.engine.submit(Request::new(vec![0, 1], 2).with_grammar(Grammar::JsonObject)).unwrap_err();
    assert!(e.to_string().contains("grammar compiler"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A constraint that panics when advanced: the engine thread's step panics.
struct Panicking;

impl kiln::nn::serve::Constraint for Panicking {
    fn allowed(&mut self) -> kiln::Result<Vec<u32>> {
        Ok(vec![u32::MAX; 8])
    }
    fn advance(&mut self, _: i64) -> kiln::Result<()> {
        panic!("a constraint's bug")
    }
    fn is_finished(&self) -> bool {
        false
    }
    fn is_end(&self, _: i64) -> bool {
        false
    }
}

struct PanickingCompiler;

impl kiln::nn::serve::GrammarCompiler for PanickingCompiler {
    fn compile(&self, _: &Grammar) -> kiln::Result<Box<dyn kiln::nn::serve::Constraint>> {
        Ok(Box::new(Panicking))
    }
}

/// A panic in the engine's step ends every request with the error (never a
/// stream that ends as if it had finished) and stops the engine: later
/// submissions are refused.
#[test]
fn a_panicking_step_ends_requests_with_an_error_and_stops_the_engine() {
    use kiln::nn::serve::{EngineHandle, SubmitError};
    let (m, _) = setup(256, 10, None);
    let cfg = EngineConfig { grammars: Some(Arc::new(PanickingCompiler)), ..Default::default() };
    let handle = EngineHandle::spawn(Engine::new(m, cfg).unwrap()).unwrap();
    let plain = handle.submit(Request::new(vec![1, 2, 3], 200)).unwrap();
    let constrained = handle.submit(Request::new(vec![1, 2], 5).with_grammar(Grammar::JsonObject)).unwrap();
    for (what, stream) in [("constrained", constrained), ("plain", plain)] {
        let last = stream.last();
        assert!(
            matches!(&last, Some(Event::Finished(FinishReason::Error(m))) if m.contains("a constraint's bug")),
            "{what}: {last:?}"
        );
    }
    let mut refused = false;
    for _ in 0..100 {
        match handle.submit(Request::new(vec![1], 2)) {
            Err(SubmitError::ShutDown) => {
                refused = true;
                break;
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
    assert!(refused, "the engine still takes requests after its step panicked");
}
