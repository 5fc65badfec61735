//! Tool calls in chat completions (Note [Tool calls]): the request's `tools`
//! and `tool_choice` checked, the grammar that enforces a required call,
//! and the model's tool-call syntax parsed out of its text, whole or as it
//! streams.
use super::params::Refusal;
use super::{bad_request, ChatTemplate};
use crate::serve::structured::LlgCompiler;
use crate::serve::{Grammar, GrammarCompiler};
use serde_json::{json, Value};

// Note [Tool calls]
// ~~~~~~~~~~~~~~~~~
// The tools' definitions go to the chat template as its `tools`, as
// transformers' `apply_chat_template(messages, tools=tools)` passes them,
// and the template decides how the model sees them. What the model writes
// back follows the syntax its template taught it, recognized from the
// template's text: Hermes-style `<tool_call>{"name", "arguments"}</tool_call>`
// blocks (Qwen2.5, Qwen3), or Llama 3.1's JSON `{"name", "parameters"}`
// answer (optionally after `<|python_tag|>`). A template that shows neither
// does not render tools, and a request with tools is refused rather than
// answered as if it had none.
//
// `tool_choice`: `none` renders the tools and parses nothing; `auto` lets
// the model choose and parses what it wrote (a block that is not valid JSON
// stays text); `required` and a named function constrain the output
// (Note [Constrained decoding]) to exactly one call in the template's
// syntax whose `arguments` follow the function's `parameters` schema, of any
// tool or of the named one. Arguments come back as JSON text, as OpenAI
// sends them; assistant messages sent back with `tool_calls` have their
// arguments parsed to objects before rendering (templates print them with
// `tojson`), as vLLM does.

/// The tool-call syntax a chat template teaches.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Syntax {
    /// `<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>`.
    Hermes,
    /// `{"name": .., "parameters": ..}`, optionally after `<|python_tag|>`.
    Llama3,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's checked tools.
#[derive(Debug, Clone)]
pub(super) struct Tools {
    /// The definitions as sent (`{"type": "function", "function": {..}}`).
    pub defs: Vec<Value>,
    pub choice: Choice,
    syntax: Syntax,
    /// `parallel_tool_calls` (default true): more than one call per answer.
    parallel: bool,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ToolCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// As OpenAI sends it, the `index`-th call of its message.
    pub fn to_json(&self, index: Option<usize>) -> Value {
        let id = format!("call_{:024x}", rand_id());
        let mut v = json!({"id": id, "type": "function",
                           "function": {"name": self.name, "arguments": self.arguments}});
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

fn rand_id() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    ((h.finish() as u128) << 32) ^ t
}

fn refuse(msg: String, param: &str) -> Refusal {
    Box::new(bad_request(msg, Some(param)))
}

impl Tools {
    /// Checks `tools` and `tool_choice` against each other and the template.
    pub fn from_request(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
        template: &ChatTemplate,
        grammars: Option<&LlgCompiler>,
    ) -> Result<Option<Tools>, Refusal> {
        let Some(tools) = tools else {
            return match choice {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s == "none" => Ok(None),
                Some(_) => Err(refuse("tool_choice needs tools".into(), "tool_choice")),
            };
        };
        let defs = tools.as_array().ok_or_else(|| refuse("tools must be a list".into(), "tools"))?.clone();
        let mut names: Vec<String> = vec![];
        for (i, t) in defs.iter().enumerate() {
            let f = match (t.get("type").and_then(Value::as_str), t.get("function")) {
                (Some("function"), Some(f)) => f,
                _ => {
                    return Err(refuse(
                        format!("tools[{i}] must be {{\"type\": \"function\", \"function\": ..}}"),
                        "tools",
                    ))
                }
            };
            let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
            let name = name.ok_or_else(|| refuse(format!("tools[{i}].function.name is missing"), "tools"))?;
            if names.iter().any(|n| n == name) {
                return Err(refuse(format!("two tools are named {name:?}"), "tools"));
            }
            if let (Some(p), Some(grammars)) = (f.get("parameters"), grammars) {
                grammars
                    .compile(&Grammar::JsonSchema(p.clone()))
                    .map_err(|e| refuse(format!("tools[{i}] ({name}): its parameters schema: {e}"), "tools"))?;
            }
            names.push(name.to_string());
        }
        let choice = match choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => Choice::None,
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                _ => return Err(refuse(format!("tool_choice {s:?} is not none, auto or required"), "tool_choice")),
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(n) if v.get("type").and_then(Value::as_str) == Some("function") => {
                    if !names.iter().any(|x| x == n) {
                        return Err(refuse(
                            format!("tool_choice names the function {n:?}, which tools do not define"),
                            "tool_choice",
                        ));
                    }
                    Choice::Named(n.to_string())
                }
                _ => {
                    return Err(refuse(format!("tool_choice: expected a string or a function, got {v}"), "tool_choice"))
                }
            },
        };
        if defs.is_empty() {
            return match choice {
                Choice::Required => Err(refuse("tool_choice required needs at least one tool".into(), "tool_choice")),
                _ => Ok(None),
            };
        }
        let source = template.source();
        let syntax = if source.contains("<tool_call>") {
            Syntax::Hermes
        } else if source.contains("<|python_tag|>") {
            Syntax::Llama3
        } else {
            return Err(refuse("this model's chat template does not render tools".into(), "tools"));
        };
        Ok(Some(Tools { defs, choice, syntax, parallel: parallel.unwrap_or(true) }))
    }

    /// Whether the output is parsed for calls.
    pub fn parses(&self) -> bool {
        self.choice != Choice::None
    }

    /// The grammar of exactly one call, for `required` and a named choice.
    pub fn grammar(&self) -> Option<Grammar> {
        let wanted = |f: &&Value| match &self.choice {
            Choice::Named(n) => f.get("name").and_then(Value::as_str) == Some(n.as_str()),
            _ => true,
        };
        if !matches!(self.choice, Choice::Required | Choice::Named(_)) {
            return None;
        }
        let args = match self.syntax {
            Syntax::Hermes => "arguments",
            Syntax::Llama3 => "parameters",
        };
        let options: Vec<Value> = self
            .defs
            .iter()
            .filter_map(|t| t.get("function"))
            .filter(wanted)
            .map(|f| {
                let params = f.get("parameters").cloned().unwrap_or(json!({"type": "object"}));
                json!({"type": "object", "properties": {"name": {"const": f["name"]}, args: params},
                       "required": ["name", args], "additionalProperties": false})
            })
            .collect();
        // A schema inside a Lark grammar takes the layout of Note [JSON layout] too.
        let schema = json!({"anyOf": options, "x-guidance": crate::serve::structured::json_layout()});
        let call = format!("%json {schema}");
        Some(Grammar::Lark(match self.syntax {
            Syntax::Hermes => format!("start: \"<tool_call>\\n\" {call} \"\\n</tool_call>\""),
            Syntax::Llama3 => format!("start: {call}"),
        }))
    }

    /// The text and the calls of a whole answer.
    pub fn parse(&self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        let (content, calls) = match self.syntax {
            Syntax::Hermes => parse_hermes(text),
            Syntax::Llama3 => match parse_llama3(text) {
                Some(c) => (String::new(), vec![c]),
                None => (text.to_string(), vec![]),
            },
        };
        let mut calls = calls;
        if !self.parallel {
            calls.truncate(1);
        }
        let content = if calls.is_empty() { content } else { content.trim().to_string() };
        ((!content.is_empty() || calls.is_empty()).then_some(content), calls)
    }
}

/// One call from its JSON text: an object with a `name` and an object of
/// `args` (or `arguments`).
fn call_of(json: &str, args: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let a = v.get(args).or_else(|| v.get("arguments"))?;
    let arguments = match a {
        Value::Object(_) => a.to_string(),
        // Some models write the arguments as JSON text already.
        Value::String(s) if serde_json::from_str::<Value>(s).is_ok_and(|x| x.is_object()) => s.clone(),
        _ => return None,
    };
    Some(ToolCall { name, arguments })
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Hermes blocks out of `text`: the text between them and the calls; a block
/// that does not parse stays text.
fn parse_hermes(text: &str) -> (String, Vec<ToolCall>) {
    let (mut content, mut calls, mut rest) = (String::new(), vec![], text);
    while let Some(i) = rest.find(OPEN) {
        let after = &rest[i + OPEN.len()..];
        let (inner, next) = match after.find(CLOSE) {
            Some(j) => (&after[..j], &after[j + CLOSE.len()..]),
            None => (after, ""),
        };
        match call_of(inner, "arguments") {
            Some(c) => {
                content.push_str(&rest[..i]);
                calls.push(c);
            }
            None => content.push_str(&rest[..rest.len() - next.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    (content, calls)
}

fn parse_llama3(text: &str) -> Option<ToolCall> {
    let t = text.trim();
    let t = t.strip_prefix("<|python_tag|>").unwrap_or(t);
    call_of(t, "parameters")
}

/// Splits a streamed answer into text to show and calls, as it grows.
pub(super) struct ToolStream {
    tools: std::sync::Arc<Tools>,
    /// Text not yet shown: a call in progress, or what may start one.
    held: String,
    /// Llama 3.1: the answer looks like a call; everything waits for the end.
    whole: bool,
    started: bool,
    pub calls: usize,
}

impl ToolStream {
    pub fn new(tools: std::sync::Arc<Tools>) -> ToolStream {
        ToolStream { tools, held: String::new(), whole: false, started: false, calls: 0 }
    }

    /// Takes in `delta` (visible text); returns the text to show now and
    /// the calls completed by it. `done`: no more text follows.
    pub fn push(&mut self, delta: &str, done: bool) -> (String, Vec<ToolCall>) {
        self.held.push_str(delta);
        let (text, mut calls) = match self.tools.syntax {
            Syntax::Llama3 => self.push_llama3(done),
            Syntax::Hermes => self.push_hermes(done),
        };
        if !self.tools.parallel {
            calls.truncate(1 - self.calls.min(1));
        }
        self.calls += calls.len();
        (text, calls)
    }

    fn push_llama3(&mut self, done: bool) -> (String, Vec<ToolCall>) {
        if !self.started {
            let t = self.held.trim_start();
            if t.is_empty() && !done {
                return (String::new(), vec![]);
            }
            self.started = true;
            self.whole = t.starts_with('{') || "<|python_tag|>".starts_with(t) || t.starts_with("<|python_tag|>");
        }
        if !self.whole {
            return (std::mem::take(&mut self.held), vec![]);
        }
        if !done {
            return (String::new(), vec![]);
        }
        let held = std::mem::take(&mut self.held);
        match parse_llama3(&held) {
            Some(c) => (String::new(), vec![c]),
            None => (held, vec![]),
        }
    }

    fn push_hermes(&mut self, done: bool) -> (String, Vec<ToolCall>) {
        let (mut text, mut calls) = (String::new(), vec![]);
        loop {
            match self.held.find(OPEN) {
                Some(i) => {
                    let after = i + OPEN.len();
                    match self.held[after..].find(CLOSE) {
                        Some(j) => {
                            let end = after + j + CLOSE.len();
                            let block: String = self.held.drain(..end).collect();
                            match call_of(&block[after..after + j], "arguments") {
                                Some(c) => {
                                    text.push_str(&block[..i]);
                                    calls.push(c);
                                }
                                None => text.push_str(&block),
                            }
                        }
                        None if done => {
                            let block = std::mem::take(&mut self.held);
                            match call_of(&block[after..], "arguments") {
                                Some(c) => {
                                    text.push_str(&block[..i]);
                                    calls.push(c);
                                }
                                None => text.push_str(&block),
                            }
                            break;
                        }
                        None => {
                            // A call in progress: show what precedes it.
                            text.extend(self.held.drain(..i));
                            break;
                        }
                    }
                }
                None => {
                    // Keep back what could be the start of `<tool_call>`.
                    let keep = if done {
                        0
                    } else {
                        (1..OPEN.len()).rev().find(|&k| self.held.ends_with(&OPEN[..k])).unwrap_or(0)
                    };
                    let cut = self.held.len() - keep;
                    text.extend(self.held.drain(..cut));
                    break;
                }
            }
        }
        if self.calls + calls.len() > 0 {
            // Between and around calls, whitespace is layout, not content.
            if text.trim().is_empty() {
                text.clear();
            }
        }
        (text, calls)
    }
}

/// An OpenAI message's `tool_calls` with their `arguments` parsed to
/// objects, as templates print them with `tojson` (Note [Tool calls]).
pub(super) fn arguments_as_objects(calls: &mut [Value]) {
    for c in calls {
        let f = if c.get("function").is_some() { &mut c["function"] } else { c };
        if let Some(Value::String(s)) = f.get("arguments") {
            if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                f["arguments"] = v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(syntax: Syntax) -> std::sync::Arc<Tools> {
        std::sync::Arc::new(Tools { defs: vec![], choice: Choice::Auto, syntax, parallel: true })
    }

    #[test]
    fn hermes_blocks_parse_whole_and_streamed_alike() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let t = tools(Syntax::Hermes);
        let (content, calls) = t.parse(text);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0], ToolCall { name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() });
        // Streamed in pieces of every size: the same text and calls.
        for n in 1..8 {
            let mut s = ToolStream::new(t.clone());
            let (mut shown, mut got) = (String::new(), vec![]);
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(n) {
                let (a, b) = s.push(&piece.iter().collect::<String>(), false);
                shown += &a;
                got.extend(b);
            }
            let (a, b) = s.push("", true);
            shown += &a;
            got.extend(b);
            assert_eq!(shown.trim(), "Let me check.", "pieces of {n}");
            assert_eq!(got, calls, "pieces of {n}");
        }
        // A block that is not JSON stays text.
        let (content, calls) = t.parse("a <tool_call>not json</tool_call> b");
        assert!(calls.is_empty());
        assert_eq!(content.as_deref(), Some("a <tool_call>not json</tool_call> b"));
    }

    #[test]
    fn llama3_answers_are_calls_only_when_they_parse() {
        let t = tools(Syntax::Llama3);
        let (c, calls) = t.parse("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}");
        assert_eq!((c, calls.len()), (None, 1));
        assert_eq!(calls[0].arguments, "{\"x\":1}");
        let (c, calls) = t.parse("{not a call");
        assert_eq!((c.as_deref(), calls.len()), (Some("{not a call"), 0));
        let mut s = ToolStream::new(t.clone());
        assert_eq!(s.push("Hello", false).0, "Hello");
        assert_eq!(s.push(" there", true).0, " there");
    }
}
