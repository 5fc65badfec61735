//! An OpenAI-compatible HTTP API over the serving engine (feature `server`):
//! `/v1/completions` and `/v1/chat/completions` (with server-sent-event
//! streaming), `/v1/models`, `/health` and `/metrics` (Prometheus text), on
//! axum. [`router`] gives the routes to mount in a service's own axum app;
//! `examples/serve.rs` runs them as a server.
//!
//! Requests and answers follow the OpenAI API: `max_tokens` (and
//! `max_completion_tokens`), `temperature` (default 1; 0 is greedy), `top_p`,
//! `seed`, `stop` (a string or a list), `n` (choices sharing the prompt's KV
//! blocks; choice `i` draws from `seed + i`), `presence_penalty`,
//! `frequency_penalty`, `logit_bias`, `logprobs` (a count for completions;
//! `logprobs` and `top_logprobs` for chat), `echo` (completions), `stream`
//! with `stream_options.include_usage`, and vLLM's `top_k`, `min_p` and
//! `repetition_penalty` extensions (Note [Logit processing]), and structured
//! output (Note [Constrained decoding]): `response_format` (`json_object`,
//! `json_schema`) or vLLM's `structured_outputs` (`json`, `regex`, `grammar`
//! in Lark, `choice`). Any other field
//! is refused, never ignored (Note [Every field honoured or refused]).
//! Errors come back with OpenAI's status codes and
//! `{"error": {"message", "type", "param", "code"}}` body: 400 for malformed
//! JSON and bad values (`context_length_exceeded` when the prompt and
//! `max_tokens` exceed the context), 404 `model_not_found`, 429 when the
//! engine's queue is full, 500 when the model fails, 503 once it has shut down.
mod answer;
mod net;
mod params;
mod text;
mod tools;

pub use crate::chat::{ChatTemplate, Message};
pub use net::{serve, ServerLimits};
pub use text::{Codec, IncrementalText, Visible};

use super::EngineHandle;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use params::{Kind, Params};
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
    /// Compiles the grammars of structured output (the engine's, shared),
    /// or why this model's tokenizer cannot have them (the server then
    /// refuses structured output and required tool calls, and serves the rest).
    pub grammars: std::result::Result<Arc<crate::serve::structured::LlgCompiler>, String>,
    /// API key, timeouts and bounds (Note [Facing a network]).
    pub limits: ServerLimits,
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
        let vocab = model.config().vocab_size;
        let grammars = crate::serve::structured::LlgCompiler::new(codec.clone(), vocab, &stop_token_ids)
            .map(Arc::new)
            .map_err(|e| e.to_string());
        match &grammars {
            Ok(g) => cfg.grammars = Some(g.clone()),
            Err(e) => tracing::warn!(error = %e, "structured output is off for this model"),
        }
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
        Ok(ServerState {
            engine,
            codec,
            chat,
            model_name,
            adapters,
            stop_token_ids,
            created: now(),
            grammars,
            limits: ServerLimits::default(),
        })
    }
}

/// The routes, for `axum::serve` or to nest in a service's router.
pub fn router(state: Arc<ServerState>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .layer(axum::middleware::from_fn_with_state(state.clone(), net::auth))
        .layer(axum::extract::DefaultBodyLimit::max(state.limits.max_body_bytes));
    Router::new().route("/health", get(|| async { "ok" })).route("/metrics", get(metrics)).merge(v1).with_state(state)
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
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
    name: Option<String>,
}

impl ChatMessageBody {
    /// The message as the chat template sees it (Note [Tool calls]).
    fn into_template_value(self) -> Value {
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                parts.iter().filter_map(|p| p.get("text").and_then(|t| t.as_str())).collect::<Vec<_>>().join("")
            }
        };
        let mut m = json!({"role": self.role, "content": content});
        if let Some(mut calls) = self.tool_calls {
            tools::arguments_as_objects(&mut calls);
            m["tool_calls"] = Value::from(calls);
        }
        if let Some(id) = self.tool_call_id {
            m["tool_call_id"] = json!(id);
        }
        if let Some(n) = self.name {
            m["name"] = json!(n);
        }
        m
    }
}

#[derive(Debug, Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessageBody>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    params: Params,
}

fn json_error(e: JsonRejection) -> Response {
    let status = match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    error(status, "invalid_request_error", format!("invalid JSON body: {}", e.body_text()), None, None)
}

/// The body as `T` once its fields are checked (Note [Every field honoured or refused]).
fn body<T: serde::de::DeserializeOwned>(
    body: Result<Json<Value>, JsonRejection>,
    own: &[&str],
) -> Result<T, Box<Response>> {
    let Json(body) = body.map_err(|e| Box::new(json_error(e)))?;
    params::check_fields(&body, own)?;
    params::parse(body)
}

async fn completions(State(st): State<Arc<ServerState>>, b: Result<Json<Value>, JsonRejection>) -> Response {
    let body: CompletionBody = match body(b, params::COMPLETION) {
        Ok(b) => b,
        Err(r) => return *r,
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
    match params::job(&st, &body.params, ids, Kind::Completion, Some(16)) {
        Ok(j) => answer::answer(st, j).await,
        Err(r) => *r,
    }
}

async fn chat_completions(State(st): State<Arc<ServerState>>, b: Result<Json<Value>, JsonRejection>) -> Response {
    let body: ChatBody = match body(b, params::CHAT) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if body.messages.is_empty() {
        return bad_request("messages must not be empty", Some("messages"));
    }
    let tools = tools::Tools::from_request(
        body.tools.as_ref(),
        body.tool_choice.as_ref(),
        body.parallel_tool_calls,
        &st.chat,
        st.grammars.as_deref().ok(),
    );
    let tools = match tools {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let messages: Vec<Value> = body.messages.into_iter().map(ChatMessageBody::into_template_value).collect();
    let defs = tools.as_ref().map(|t| t.defs.as_slice());
    let ids = st.chat.render_with_tools(&messages, defs, true).and_then(|text| st.codec.encode(&text, false));
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return bad_request(e.to_string(), Some("messages")),
    };
    let job = params::job(&st, &body.params, ids, Kind::Chat, None);
    let job = match (job, tools) {
        (Ok(j), Some(t)) => j.with_tools(&st, t),
        (j, None) => j,
        (Err(r), _) => Err(r),
    };
    match job {
        Ok(j) => answer::answer(st, j).await,
        Err(r) => *r,
    }
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs()
}
