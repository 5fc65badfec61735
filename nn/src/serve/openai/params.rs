//! A request body, checked field by field, into the engine requests it asks
//! for (Note [Every field honoured or refused]).
use super::{bad_request, error, ServerState};
use crate::generate::Sampling;
use crate::serve::{Grammar, GrammarCompiler, Penalties, Request};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Map, Value};

// Note [Every field honoured or refused]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A request field the server does not act on must not be dropped silently:
// a client that asks for `response_format`, `tools` or `logprobs` and gets
// an answer has every reason to believe it was honoured. So each endpoint
// lists the fields it honours (`COMMON` and its own), and a body with any
// other top-level field is refused with a 400 naming it
// (`Unrecognized request argument supplied: X`, as OpenAI words it). A
// field the OpenAI API defines that changes nothing here (`user`, an
// end-user id for the provider's abuse monitoring) is listed as honoured.

/// The fields both endpoints honour.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "response_format",
    "structured_outputs",
    "user",
];

/// The fields only completions honour.
pub(super) const COMPLETION: &[&str] = &["prompt", "echo"];

/// The fields only chat completions honour.
pub(super) const CHAT: &[&str] = &["messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"];

/// At most this many choices per request (OpenAI's limit).
const MAX_N: i64 = 128;

/// At most this many top log-probabilities per token (OpenAI's chat limit).
const MAX_TOP_LOGPROBS: i64 = 20;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The sampling fields both endpoints take.
#[derive(Debug, Deserialize)]
pub(super) struct Params {
    pub model: String,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    n: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    stop: Option<Stop>,
    seed: Option<u64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    logit_bias: Option<Map<String, Value>>,
    /// A count (completions) or a flag (chat, with `top_logprobs`).
    logprobs: Option<Value>,
    top_logprobs: Option<i64>,
    echo: Option<bool>,
    response_format: Option<Value>,
    structured_outputs: Option<Value>,
    #[allow(dead_code)]
    user: Option<String>,
}

/// Which endpoint answers.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    /// What the request's prompt is called in messages.
    fn prompt_name(self) -> &'static str {
        match self {
            Kind::Completion => "prompt",
            Kind::Chat => "messages",
        }
    }
}

/// A checked request, ready for the engine: one engine request per choice.
pub(super) struct Job {
    pub choices: Vec<Request>,
    pub stream: bool,
    pub include_usage: bool,
    pub kind: Kind,
    pub prompt_tokens: usize,
    /// `echo`: the prompt's text, shown before each choice's.
    pub echo: Option<String>,
    /// The model's name as the answers give it (the base or an adapter).
    pub model: String,
    /// How many choices (`choices.len()` until they are submitted).
    pub n: usize,
    /// The stop strings (of every choice).
    pub stop_strings: Vec<String>,
    /// Whether the answers carry log-probabilities.
    pub logprobs: bool,
    /// Chat: the tools whose calls are parsed out of the answers (Note [Tool calls]).
    pub tools: Option<std::sync::Arc<super::tools::Tools>>,
}

pub(super) type Refusal = Box<Response>;

fn refuse(message: String, param: &str) -> Refusal {
    Box::new(bad_request(message, Some(param)))
}

/// Refuses `body` if it is not an object or has a field neither `COMMON`
/// nor `own` lists (Note [Every field honoured or refused]).
pub(super) fn check_fields(body: &Value, own: &[&str]) -> Result<(), Refusal> {
    let Some(obj) = body.as_object() else {
        return Err(Box::new(bad_request("the request body must be a JSON object", None)));
    };
    match obj.keys().find(|k| !COMMON.contains(&k.as_str()) && !own.contains(&k.as_str())) {
        Some(k) => Err(refuse(format!("Unrecognized request argument supplied: {k}"), k)),
        None => Ok(()),
    }
}

/// `body` as `T`, or the 400 that says why not.
pub(super) fn parse<T: serde::de::DeserializeOwned>(body: Value) -> Result<T, Refusal> {
    serde_json::from_value(body).map_err(|e| Box::new(bad_request(format!("invalid request: {e}"), None)))
}

/// The checked job for `prompt` (`default_max`: `max_tokens` when not given;
/// `None`: up to the context).
pub(super) fn job(
    st: &ServerState,
    p: &Params,
    prompt: Vec<i64>,
    kind: Kind,
    default_max: Option<usize>,
) -> Result<Job, Refusal> {
    let adapter = st.adapters.iter().find(|a| **a == p.model).cloned();
    if p.model != st.model_name && adapter.is_none() {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{}` does not exist.", p.model),
            Some("model"),
            Some("model_not_found"),
        )));
    }
    let n = p.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(refuse(format!("n must be between 1 and {MAX_N}, got {n}"), "n"));
    }
    if prompt.is_empty() {
        return Err(refuse("the prompt is empty".into(), kind.prompt_name()));
    }
    if let Some(m) = st.limits.max_prompt_tokens.filter(|&m| prompt.len() > m) {
        let what = kind.prompt_name();
        return Err(refuse(format!("{} tokens of {what}; this server takes at most {m}", prompt.len()), what));
    }
    let max = max_new_tokens(st, p, prompt.len(), kind, default_max)?;
    let sampling = sampling(p)?;
    let penalties = penalties(p)?;
    let logit_bias = logit_bias(p, st.engine.vocab_size())?;
    let logprobs = logprobs(p, kind)?;
    let grammar = grammar(st, p)?;
    let stream = p.stream.unwrap_or(false);
    let include_usage = match &p.stream_options {
        Some(_) if !stream => {
            return Err(refuse("stream_options is only allowed when stream is true".into(), "stream_options"))
        }
        Some(o) => o.include_usage.unwrap_or(false),
        None => false,
    };
    let echo = p.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        // The prompt's log-probabilities would need every prompt position's
        // logits, which the engine's prefill does not keep.
        return Err(refuse("echo together with logprobs is not supported".into(), "echo"));
    }
    let stops: Vec<String> = match &p.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
    let prompt_tokens = prompt.len();
    let echo = echo.then(|| st.codec.decode(&prompt));
    let base = Request {
        prompt,
        sampling,
        max_new_tokens: max,
        stop_token_ids: st.stop_token_ids.clone(),
        stop_strings: stops.clone(),
        adapter: adapter.clone(),
        penalties,
        logit_bias,
        logprobs,
        grammar,
    };
    // Choice i draws from seed + i (vLLM's rule), so a seeded request with
    // n choices is as reproducible as n requests.
    let choices = (0..n as u64)
        .map(|i| {
            let mut r = base.clone();
            r.sampling.seed = base.sampling.seed.map(|s| s.wrapping_add(i));
            r
        })
        .collect();
    let model = adapter.unwrap_or_else(|| st.model_name.clone());
    let n = n as usize;
    let logprobs = logprobs.is_some();
    Ok(Job {
        choices,
        stream,
        include_usage,
        kind,
        prompt_tokens,
        echo,
        model,
        n,
        stop_strings: stops,
        logprobs,
        tools: None,
    })
}

fn max_new_tokens(
    st: &ServerState,
    p: &Params,
    prompt: usize,
    kind: Kind,
    default_max: Option<usize>,
) -> Result<usize, Refusal> {
    let ctx = st.engine.max_context();
    let (max, name) = match (p.max_completion_tokens, p.max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    let cap = st.limits.max_output_tokens.unwrap_or(usize::MAX) as u64;
    let max = match max {
        Some(m) if m < 1 => return Err(refuse(format!("{name} must be at least 1, got {m}"), name)),
        Some(m) if m as u64 > cap => {
            return Err(refuse(format!("{name} is {m}; this server generates at most {cap} tokens"), name))
        }
        Some(m) => m as u64,
        None => (default_max.unwrap_or(ctx.saturating_sub(prompt)).max(1) as u64).min(cap),
    };
    if prompt as u64 + max > ctx as u64 {
        let what = kind.prompt_name();
        let msg = format!(
            "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt} in the {what}, {max} in the completion). Please reduce the length of the {what} or completion.",
            prompt as u64 + max,
        );
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            msg,
            Some(name),
            Some("context_length_exceeded"),
        )));
    }
    Ok(max as usize)
}

fn sampling(p: &Params) -> Result<Sampling, Refusal> {
    let t = p.temperature.unwrap_or(1.0);
    if !t.is_finite() || !(0.0..=2.0).contains(&t) {
        return Err(refuse(format!("temperature must be between 0 and 2, got {t}"), "temperature"));
    }
    let top_p = p.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(refuse(format!("top_p must be in (0, 1], got {top_p}"), "top_p"));
    }
    let top_k = match p.top_k {
        Some(k) if k < -1 => return Err(refuse(format!("top_k must be -1, 0 or positive, got {k}"), "top_k")),
        Some(k) => k.max(0) as usize,
        None => 0,
    };
    let min_p = p.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(refuse(format!("min_p must be in [0, 1], got {min_p}"), "min_p"));
    }
    let mut sampling = if t == 0.0 {
        Sampling::greedy()
    } else {
        Sampling::sample(t).with_top_p(top_p).with_top_k(top_k).with_min_p(min_p)
    };
    sampling.seed = p.seed;
    Ok(sampling)
}

fn penalties(p: &Params) -> Result<Penalties, Refusal> {
    for (v, name) in [(p.presence_penalty, "presence_penalty"), (p.frequency_penalty, "frequency_penalty")] {
        if let Some(v) = v.filter(|v| !(-2.0..=2.0).contains(v)) {
            return Err(refuse(format!("{name} must be between -2 and 2, got {v}"), name));
        }
    }
    if let Some(r) = p.repetition_penalty.filter(|r| !(r.is_finite() && *r > 0.0)) {
        return Err(refuse(format!("repetition_penalty must be positive, got {r}"), "repetition_penalty"));
    }
    Ok(Penalties {
        repetition: p.repetition_penalty.unwrap_or(1.0),
        presence: p.presence_penalty.unwrap_or(0.0),
        frequency: p.frequency_penalty.unwrap_or(0.0),
    })
}

/// OpenAI's `logit_bias`: token ids (as strings) to biases in [-100, 100].
fn logit_bias(p: &Params, vocab: usize) -> Result<Vec<(i64, f32)>, Refusal> {
    let Some(m) = &p.logit_bias else { return Ok(vec![]) };
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let t = k.parse::<i64>().ok().filter(|&t| t >= 0 && (t as u64) < vocab as u64).ok_or_else(|| {
            refuse(format!("logit_bias: {k:?} is not a token id of this model's vocabulary of {vocab}"), "logit_bias")
        })?;
        let b = v.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            refuse(
                format!("logit_bias: the bias of token {k} must be a number between -100 and 100, got {v}"),
                "logit_bias",
            )
        })?;
        out.push((t, b as f32));
    }
    Ok(out)
}

/// How many top log-probabilities each token comes with, if any: `logprobs`
/// a count for completions; `logprobs: true` with `top_logprobs` for chat.
fn logprobs(p: &Params, kind: Kind) -> Result<Option<usize>, Refusal> {
    let range = |v: i64, name: &str| -> Result<usize, Refusal> {
        if !(0..=MAX_TOP_LOGPROBS).contains(&v) {
            return Err(refuse(format!("{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {v}"), name));
        }
        Ok(v as usize)
    };
    match kind {
        Kind::Completion => match &p.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_i64() {
                Some(k) => range(k, "logprobs").map(Some),
                None => Err(refuse(format!("logprobs must be an integer for completions, got {v}"), "logprobs")),
            },
        },
        Kind::Chat => {
            let on = match &p.logprobs {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(refuse(format!("logprobs must be a boolean, got {v}"), "logprobs")),
            };
            match (on, p.top_logprobs) {
                (false, Some(_)) => Err(refuse("top_logprobs needs logprobs set to true".into(), "top_logprobs")),
                (false, None) => Ok(None),
                (true, k) => range(k.unwrap_or(0), "top_logprobs").map(Some),
            }
        }
    }
}

/// The grammar `response_format` (OpenAI's `json_object` and `json_schema`)
/// or `structured_outputs` (vLLM's `json`, `regex`, `grammar` or `choice`)
/// asks for, compiled once here so that a bad one is refused naming its field.
fn grammar(st: &ServerState, p: &Params) -> Result<Option<Grammar>, Refusal> {
    let (g, param) = match (&p.response_format, &p.structured_outputs) {
        (Some(_), Some(_)) => {
            return Err(refuse("give response_format or structured_outputs, not both".into(), "response_format"))
        }
        (Some(rf), None) => (response_format(rf)?, "response_format"),
        (None, Some(so)) => (structured_outputs(so)?, "structured_outputs"),
        (None, None) => return Ok(None),
    };
    if let Some(g) = &g {
        compiler(st, param)?.compile(g).map_err(|e| refuse(format!("{param}: {e}"), param))?;
    }
    Ok(g)
}

/// The server's grammar compiler, or the 400 that says why it has none.
fn compiler<'a>(st: &'a ServerState, param: &str) -> Result<&'a crate::serve::structured::LlgCompiler, Refusal> {
    st.grammars.as_deref().map_err(|e| refuse(format!("{param}: this model cannot constrain its output: {e}"), param))
}

fn response_format(rf: &Value) -> Result<Option<Grammar>, Refusal> {
    let bad = |m: String| refuse(format!("response_format: {m}"), "response_format");
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            let js = rf.get("json_schema").ok_or_else(|| bad("json_schema is missing".into()))?;
            match js.get("schema") {
                Some(s) if s.is_object() => Ok(Some(Grammar::JsonSchema(s.clone()))),
                Some(s) => Err(bad(format!("json_schema.schema must be an object, got {s}"))),
                None => Err(bad("json_schema.schema is missing".into())),
            }
        }
        Some(t) => Err(bad(format!("unknown type {t:?} (text, json_object or json_schema)"))),
        None => Err(bad("an object with a type is expected".into())),
    }
}

fn structured_outputs(so: &Value) -> Result<Option<Grammar>, Refusal> {
    let bad = |m: String| refuse(format!("structured_outputs: {m}"), "structured_outputs");
    let obj = so.as_object().ok_or_else(|| bad("an object is expected".into()))?;
    if obj.len() != 1 {
        return Err(bad("exactly one of json, regex, grammar or choice is expected".into()));
    }
    let (k, v) = obj.iter().next().ok_or_else(|| bad("empty".into()))?;
    let text = |v: &Value| v.as_str().map(str::to_string).ok_or_else(|| bad(format!("{k} must be a string")));
    match k.as_str() {
        "json" => match v {
            Value::Object(_) => Ok(Some(Grammar::JsonSchema(v.clone()))),
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(schema @ Value::Object(_)) => Ok(Some(Grammar::JsonSchema(schema))),
                _ => Err(bad("json must be a JSON schema (an object, or its text)".into())),
            },
            _ => Err(bad("json must be a JSON schema".into())),
        },
        "regex" => Ok(Some(Grammar::Regex(text(v)?))),
        "grammar" => Ok(Some(Grammar::Lark(text(v)?))),
        "choice" => {
            let choices: Option<Vec<&str>> =
                v.as_array().map(|a| a.iter().map(Value::as_str).collect()).unwrap_or(None);
            match choices {
                Some(c) if !c.is_empty() => {
                    Ok(Some(Grammar::Regex(c.iter().map(|x| regex::escape(x)).collect::<Vec<_>>().join("|"))))
                }
                _ => Err(bad("choice must be a non-empty list of strings".into())),
            }
        }
        other => Err(bad(format!("unknown key {other:?} (json, regex, grammar or choice)"))),
    }
}

impl Job {
    /// With `tools`: a required or named call constrains every choice (a
    /// grammar of its own is then refused, as the two cannot both hold).
    pub(super) fn with_tools(mut self, st: &ServerState, tools: super::tools::Tools) -> Result<Job, Refusal> {
        if let Some(g) = tools.grammar() {
            if self.choices.iter().any(|r| r.grammar.is_some()) {
                return Err(refuse(
                    "a required tool call and a response_format cannot both apply".into(),
                    "tool_choice",
                ));
            }
            let c = compiler(st, "tool_choice")?;
            c.compile(&g).map_err(|e| refuse(format!("the tools' call grammar: {e}"), "tools"))?;
            for r in &mut self.choices {
                r.grammar = Some(g.clone());
            }
        }
        // `tool_choice: none`: the tools were rendered; nothing is parsed.
        self.tools = tools.parses().then(|| std::sync::Arc::new(tools));
        Ok(self)
    }
}
