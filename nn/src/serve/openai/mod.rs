//! An OpenAI-compatible HTTP API over the serving engine (feature `server`):
//! `/v1/completions` and `/v1/chat/completions` (with server-sent-event
//! streaming), `/v1/models`, `/health` and `/metrics` (Prometheus text), on
//! axum. [`router`] gives the routes to mount in a service's own axum app;
//! `examples/serve.rs` runs them as a server.
//!
//! Requests and answers follow the OpenAI API: `max_tokens` (and
//! `max_completion_tokens`), `temperature` (default 1; 0 is greedy), `top_p`,
//! `seed`, `stop` (a string or a list), `stream`, and vLLM's `top_k` and
//! `min_p` extensions; `n` must be 1. Errors come back with OpenAI's status codes and
//! `{"error": {"message", "type", "param", "code"}}` body: 400 for malformed
//! JSON and bad values (`context_length_exceeded` when the prompt and
//! `max_tokens` exceed the context), 404 `model_not_found`, 429 when the
//! engine's queue is full, 500 when the model fails, 503 once it has shut down.
mod text;

pub use crate::chat::{ChatTemplate, Message};
pub use text::{Codec, IncrementalText, Visible};

use super::{EngineHandle, Event, FinishReason, Request, SubmitError, TokenStream};
use crate::generate::Sampling;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// What the routes share.
pub struct ServerState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's tokenizer.
    pub codec: Arc<Codec>,
    /// Its chat template.
    pub chat: ChatTemplate,
    /// The name clients ask for (`model`).
    pub model_name: String,
    /// The LoRA adapters served beside the base model, by the names clients
    /// ask for (Note [Serving adapters]).
    pub adapters: Vec<String>,
    /// Tokens that end a generation (the config's `eos_token_id`).
    pub stop_token_ids: Vec<i64>,
    /// When the server started (seconds since the epoch).
    pub created: u64,
}

impl ServerState {
    /// Loads a model directory (`config.json`, the weights, `tokenizer.json`
    /// if any, `tokenizer_config.json`'s chat template if any), or a repo id
    /// in the Hugging Face cache, onto the CPU and starts its engine; the
    /// model is named `name`, else the repo id, else after the directory.
    /// Stop strings are matched on the tokenizer's text.
    pub fn from_dir(
        dir: &std::path::Path,
        dtype: kiln_tensor::DType,
        cfg: super::EngineConfig,
        name: Option<String>,
    ) -> std::result::Result<ServerState, Box<dyn std::error::Error + Send + Sync>> {
        ServerState::from_dir_with_adapters(dir, dtype, cfg, name, &[])
    }

    /// [`ServerState::from_dir`], also serving each PEFT adapter directory
    /// of `adapters` under its name (`model` in a request), batched with the
    /// base model's requests (Note [Serving adapters]).
    pub fn from_dir_with_adapters(
        dir: &std::path::Path,
        dtype: kiln_tensor::DType,
        mut cfg: super::EngineConfig,
        name: Option<String>,
        adapters: &[(String, std::path::PathBuf)],
    ) -> std::result::Result<ServerState, Box<dyn std::error::Error + Send + Sync>> {
        let resolved = crate::io::hub::resolve_model(dir, "main")?;
        let name = match name {
            None if resolved != dir => Some(dir.display().to_string()),
            n => n,
        };
        let dir = resolved.as_path();
        let model = crate::models::LlamaForCausalLM::from_pretrained(dir, dtype, kiln_tensor::Device::Cpu)?;
        let codec = Arc::new(Codec::for_model(dir)?);
        let chat = ChatTemplate::for_model(dir)?;
        let c = codec.clone();
        cfg.detokenizer = Some(Arc::new(move |ids: &[i64]| c.decode(ids)));
        let stop_token_ids = model.config().eos_token_ids.clone();
        let model_name = name.unwrap_or_else(|| {
            let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
            canonical.file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned())
        });
        let mut engine = super::Engine::new(model, cfg)?;
        for (n, d) in adapters {
            if *n == model_name {
                return Err(format!("the adapter {n:?} has the base model's name").into());
            }
            engine.load_adapter(n, d)?;
        }
        let adapters = engine.adapters().to_vec();
        let engine = EngineHandle::spawn(engine)?;
        Ok(ServerState { engine, codec, chat, model_name, adapters, stop_token_ids, created: now() })
    }
}

/// The routes, for `axum::serve` or to nest in a service's router.
pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(state)
}

/// An OpenAI error response.
fn error(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    let body = json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}});
    (status, Json(body)).into_response()
}

fn bad_request(message: impl Into<String>, param: Option<&str>) -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message, param, None)
}

async fn metrics(State(st): State<Arc<ServerState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.engine.metrics().to_prometheus()).into_response()
}

async fn models(State(st): State<Arc<ServerState>>) -> Response {
    let base = json!({"id": st.model_name, "object": "model", "created": st.created, "owned_by": "kiln"});
    let adapters = st.adapters.iter().map(
        |a| json!({"id": a, "object": "model", "created": st.created, "owned_by": "kiln", "parent": st.model_name}),
    );
    Json(json!({"object": "list", "data": std::iter::once(base).chain(adapters).collect::<Vec<_>>()})).into_response()
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The sampling fields both endpoints take.
#[derive(Debug, Deserialize)]
struct Params {
    model: String,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    n: Option<i64>,
    stream: Option<bool>,
    stop: Option<Stop>,
    seed: Option<u64>,
}

/// A completion prompt: text or token ids (one prompt per request).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Ids(Vec<i64>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    #[serde(flatten)]
    params: Params,
}

/// A chat message's content: text, or a list of parts of which the text ones count.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct ChatMessageBody {
    role: String,
    content: Option<Content>,
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessageBody>,
    #[serde(flatten)]
    params: Params,
}

/// Which endpoint answers.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// A checked request, ready for the engine.
struct Job {
    request: Request,
    stream: bool,
    kind: Kind,
    prompt_tokens: usize,
}

fn json_error(e: JsonRejection) -> Response {
    bad_request(format!("invalid JSON body: {}", e.body_text()), None)
}

fn job(
    st: &ServerState,
    p: &Params,
    prompt: Vec<i64>,
    kind: Kind,
    default_max: Option<usize>,
) -> Result<Job, Box<Response>> {
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
    if p.n.is_some_and(|n| n != 1) {
        return Err(Box::new(bad_request("only n = 1 is supported", Some("n"))));
    }
    if prompt.is_empty() {
        return Err(Box::new(bad_request("the prompt is empty", Some("prompt"))));
    }
    let ctx = st.engine.max_context();
    let max = p.max_completion_tokens.or(p.max_tokens);
    let max = match max {
        Some(m) if m < 1 => {
            return Err(Box::new(bad_request(format!("max_tokens must be at least 1, got {m}"), Some("max_tokens"))))
        }
        Some(m) => m as u64,
        None => default_max.unwrap_or(ctx.saturating_sub(prompt.len())).max(1) as u64,
    };
    if prompt.len() as u64 + max > ctx as u64 {
        let msg = format!(
            "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({} in the {}, {max} in the completion). Please reduce the length of the {} or completion.",
            prompt.len() as u64 + max,
            prompt.len(),
            if kind == Kind::Chat { "messages" } else { "prompt" },
            if kind == Kind::Chat { "messages" } else { "prompt" },
        );
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            msg,
            Some("max_tokens"),
            Some("context_length_exceeded"),
        )));
    }
    let t = p.temperature.unwrap_or(1.0);
    if !t.is_finite() || !(0.0..=2.0).contains(&t) {
        return Err(Box::new(bad_request(
            format!("temperature must be between 0 and 2, got {t}"),
            Some("temperature"),
        )));
    }
    let top_p = p.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(Box::new(bad_request(format!("top_p must be in (0, 1], got {top_p}"), Some("top_p"))));
    }
    let top_k = match p.top_k {
        Some(k) if k < -1 => {
            return Err(Box::new(bad_request(format!("top_k must be -1, 0 or positive, got {k}"), Some("top_k"))))
        }
        Some(k) => k.max(0) as usize,
        None => 0,
    };
    let min_p = p.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(Box::new(bad_request(format!("min_p must be in [0, 1], got {min_p}"), Some("min_p"))));
    }
    let mut sampling = if t == 0.0 {
        Sampling::greedy()
    } else {
        Sampling::sample(t).with_top_p(top_p).with_top_k(top_k).with_min_p(min_p)
    };
    sampling.seed = p.seed;
    let stops: Vec<String> = match &p.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
    let prompt_tokens = prompt.len();
    let request = Request {
        prompt,
        sampling,
        max_new_tokens: max as usize,
        stop_token_ids: st.stop_token_ids.clone(),
        stop_strings: stops,
        adapter,
    };
    Ok(Job { request, stream: p.stream.unwrap_or(false), kind, prompt_tokens })
}

async fn completions(
    State(st): State<Arc<ServerState>>,
    body: Result<Json<CompletionBody>, JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return json_error(e),
    };
    let ids = match body.prompt {
        Prompt::Text(t) => st.codec.encode(&t, true),
        Prompt::Ids(ids) => Ok(ids),
        Prompt::Texts(v) if v.len() == 1 => st.codec.encode(&v[0], true),
        Prompt::IdLists(mut v) if v.len() == 1 => Ok(v.remove(0)),
        _ => return bad_request("only one prompt per request is supported", Some("prompt")),
    };
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return bad_request(e.to_string(), Some("prompt")),
    };
    match job(&st, &body.params, ids, Kind::Completion, Some(16)) {
        Ok(j) => run(st, j).await,
        Err(r) => *r,
    }
}

async fn chat_completions(State(st): State<Arc<ServerState>>, body: Result<Json<ChatBody>, JsonRejection>) -> Response {
    let Json(body) = match body {
        Ok(b) => b,
        Err(e) => return json_error(e),
    };
    if body.messages.is_empty() {
        return bad_request("messages must not be empty", Some("messages"));
    }
    let messages: Vec<Message> = body
        .messages
        .into_iter()
        .map(|m| Message {
            role: m.role,
            content: match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    parts.iter().filter_map(|p| p.get("text").and_then(|t| t.as_str())).collect::<Vec<_>>().join("")
                }
            },
        })
        .collect();
    let ids = st.chat.render(&messages).and_then(|text| st.codec.encode(&text, false));
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return bad_request(e.to_string(), Some("messages")),
    };
    match job(&st, &body.params, ids, Kind::Chat, None) {
        Ok(j) => run(st, j).await,
        Err(r) => *r,
    }
}

fn finish_name(r: &FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

/// The text of `tokens` without a trailing stop token.
fn text_of(st: &ServerState, tokens: &[i64]) -> String {
    let n = match tokens.last() {
        Some(t) if st.stop_token_ids.contains(t) => tokens.len() - 1,
        _ => tokens.len(),
    };
    st.codec.decode(&tokens[..n])
}

fn id(kind: Kind) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    match kind {
        Kind::Completion => format!("cmpl-{t:x}{n:x}"),
        Kind::Chat => format!("chatcmpl-{t:x}{n:x}"),
    }
}

async fn run(st: Arc<ServerState>, job: Job) -> Response {
    let stops = job.request.stop_strings.clone();
    // Answers name the model the request asked for: the base or an adapter.
    let model = job.request.adapter.clone().unwrap_or_else(|| st.model_name.clone());
    let stream = match st.engine.submit(job.request) {
        Ok(s) => s,
        Err(SubmitError::Invalid(e)) => return bad_request(e.to_string(), None),
        Err(e @ SubmitError::QueueFull(_)) => {
            return error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                e.to_string(),
                None,
                Some("rate_limit_exceeded"),
            )
        }
        Err(e @ SubmitError::ShutDown) => {
            return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string(), None, None)
        }
    };
    if job.stream {
        return sse(st, stream, job.kind, stops, model);
    }
    let mut stream = stream;
    let (mut tokens, mut end) = (vec![], FinishReason::Cancelled);
    while let Some(e) = stream.next_event().await {
        match e {
            Event::Token(t) => tokens.push(t),
            Event::Finished(f) => end = f,
        }
    }
    if let FinishReason::Error(m) = &end {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m.clone(), None, None);
    }
    let text = Visible::new(&stops).delta(&text_of(&st, &tokens), true);
    let usage = json!({"prompt_tokens": job.prompt_tokens, "completion_tokens": tokens.len(),
                       "total_tokens": job.prompt_tokens + tokens.len()});
    let choice = match job.kind {
        Kind::Completion => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_name(&end)}),
        Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null,
                             "finish_reason": finish_name(&end)}),
    };
    let object = if job.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
    Json(json!({"id": id(job.kind), "object": object, "created": now(), "model": model,
                "choices": [choice], "usage": usage}))
    .into_response()
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs()
}

/// The streaming answer: one chunk per piece of visible text, a last chunk
/// with the finish reason, then `[DONE]`. Dropping the connection drops the
/// token stream, which cancels the request.
fn sse(st: Arc<ServerState>, stream: TokenStream, kind: Kind, stops: Vec<String>, model: String) -> Response {
    let (cid, created) = (id(kind), now());
    let chunk = move |delta: Option<String>, finish: Option<&str>, first: bool| -> SseEvent {
        let choice = match kind {
            Kind::Completion => {
                json!({"index": 0, "text": delta.unwrap_or_default(), "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut d = serde_json::Map::new();
                if first {
                    d.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = delta {
                    d.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": finish})
            }
        };
        let object = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let body = json!({"id": cid, "object": object, "created": created, "model": model, "choices": [choice]});
        SseEvent::default().data(body.to_string())
    };
    struct S {
        stream: TokenStream,
        tokens: Vec<i64>,
        text: IncrementalText,
        visible: Visible,
        first: bool,
        done: bool,
    }
    let init = S {
        stream,
        tokens: vec![],
        text: IncrementalText::new(),
        visible: Visible::new(&stops),
        first: true,
        done: false,
    };
    let events = futures_util::stream::unfold((init, st), move |(mut s, st)| {
        let chunk = chunk.clone();
        async move {
            if s.done {
                return None;
            }
            let mut out: Vec<SseEvent> = vec![];
            if s.first && kind == Kind::Chat {
                out.push(chunk(Some(String::new()), None, true));
                s.first = false;
            }
            loop {
                match s.stream.next_event().await {
                    Some(Event::Token(t)) => {
                        // A stop token ends the stream and shows no text (see `text_of`).
                        if st.stop_token_ids.contains(&t) {
                            continue;
                        }
                        s.tokens.push(t);
                        s.text.update(&st.codec, &s.tokens, false);
                        let d = s.visible.delta(s.text.text(), false);
                        if !d.is_empty() {
                            out.push(chunk(Some(d), None, false));
                            return Some((out, (s, st)));
                        }
                    }
                    Some(Event::Finished(FinishReason::Error(m))) => {
                        let body =
                            json!({"error": {"message": m, "type": "server_error", "param": null, "code": null}});
                        out.push(SseEvent::default().data(body.to_string()));
                        out.push(SseEvent::default().data("[DONE]"));
                        s.done = true;
                        return Some((out, (s, st)));
                    }
                    Some(Event::Finished(f)) => {
                        s.text.update(&st.codec, &s.tokens, true);
                        let d = s.visible.delta(s.text.text(), true);
                        if !d.is_empty() {
                            out.push(chunk(Some(d), None, false));
                        }
                        let empty = if kind == Kind::Chat { None } else { Some(String::new()) };
                        out.push(chunk(empty, Some(finish_name(&f)), false));
                        out.push(SseEvent::default().data("[DONE]"));
                        s.done = true;
                        return Some((out, (s, st)));
                    }
                    None => {
                        s.done = true;
                        return Some((out, (s, st)));
                    }
                }
            }
        }
    });
    let events = events.flat_map(|v| futures_util::stream::iter(v.into_iter().map(Ok::<_, std::convert::Infallible>)));
    Sse::new(events).into_response()
}
