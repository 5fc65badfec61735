//! A job's answer: every choice's tokens turned into OpenAI's response body,
//! or into its stream of server-sent events.
use super::params::{Job, Kind};
use super::text::{IncrementalText, Visible};
use super::tools::ToolStream;
use super::{error, now, ServerState};
use crate::serve::{Event, FinishReason, SubmitError, TokenLogprobs, TokenStream};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::Arc;

/// A log-probability as JSON: vLLM's floor for one too small for a float.
fn lp_value(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        -9999.0
    }
}

/// A token as logprobs show it: its text, or OpenAI's `bytes:\xNN..` for
/// bytes that are not text on their own; and its bytes.
fn token_text(st: &ServerState, t: i64) -> (String, Vec<u8>) {
    let b = match &st.grammars {
        Ok(g) => g.token_bytes(t),
        Err(_) => st.codec.decode(&[t]).into_bytes(),
    };
    let text = match std::str::from_utf8(&b) {
        Ok(s) => s.to_string(),
        Err(_) => b.iter().fold("bytes:".to_string(), |acc, x| acc + &format!("\\x{x:02x}")),
    };
    (text, b)
}

/// The `logprobs` object of a choice for `items` (token, its log-probabilities),
/// which follow `tokens_before` of the choice's tokens.
fn logprobs_json(kind: Kind, st: &ServerState, items: &[(i64, TokenLogprobs)], tokens_before: &[i64]) -> Value {
    let codec = &st.codec;
    let piece = |t: i64| token_text(st, t).0;
    match kind {
        Kind::Chat => {
            let entry = |t: i64, lp: f32| {
                let (text, bytes) = token_text(st, t);
                json!({"token": text, "logprob": lp_value(lp), "bytes": bytes})
            };
            let content: Vec<Value> = items
                .iter()
                .map(|(t, l)| {
                    let mut e = entry(*t, l.logprob);
                    e["top_logprobs"] = l.top.iter().map(|&(u, x)| entry(u, x)).collect();
                    e
                })
                .collect();
            json!({"content": content})
        }
        Kind::Completion => {
            let mut seen = tokens_before.to_vec();
            let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
            for (t, l) in items {
                offsets.push(codec.decode(&seen).chars().count());
                seen.push(*t);
                tokens.push(piece(*t));
                lps.push(lp_value(l.logprob));
                let top: serde_json::Map<String, Value> =
                    l.top.iter().map(|&(u, x)| (piece(u), json!(lp_value(x)))).collect();
                tops.push(top);
            }
            json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
        }
    }
}

/// The `finish_reason` of an end; `called`: the answer holds tool calls.
fn finish_name(r: &FinishReason, called: bool) -> &'static str {
    match r {
        FinishReason::Length => "length",
        _ if called => "tool_calls",
        _ => "stop",
    }
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

fn object(kind: Kind, stream: bool) -> &'static str {
    match (kind, stream) {
        (Kind::Chat, false) => "chat.completion",
        (Kind::Chat, true) => "chat.completion.chunk",
        (Kind::Completion, _) => "text_completion",
    }
}

fn submit_error(e: SubmitError) -> Response {
    match e {
        SubmitError::Invalid(e) => super::bad_request(e.to_string(), None),
        e @ SubmitError::QueueFull(_) => {
            error(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", e.to_string(), None, Some("rate_limit_exceeded"))
        }
        e @ SubmitError::ShutDown => error(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string(), None, None),
    }
}

/// One choice's tokens (a final stop token left out: it shows no text) and end.
struct Choice {
    tokens: Vec<i64>,
    logprobs: Vec<(i64, TokenLogprobs)>,
    generated: usize,
    end: FinishReason,
}

/// Holds back a stop token until the next event says whether it ended the
/// output (then it shows no text) or was text after all (a grammar took it
/// as text: Note [Constrained decoding]).
#[derive(Default)]
struct StopHold(Option<(i64, Option<TokenLogprobs>)>);

impl StopHold {
    /// The tokens that are text now that `t` arrived (`None`: the end).
    fn next(&mut self, st: &ServerState, t: Option<(i64, Option<TokenLogprobs>)>) -> Vec<(i64, Option<TokenLogprobs>)> {
        let mut out: Vec<_> = if t.is_some() { self.0.take().into_iter().collect() } else { vec![] };
        match t {
            Some(x) if st.stop_token_ids.contains(&x.0) => self.0 = Some(x),
            Some(x) => out.push(x),
            None => self.0 = None,
        }
        out
    }
}

async fn collect(st: &ServerState, mut stream: TokenStream) -> Choice {
    let mut c = Choice { tokens: vec![], logprobs: vec![], generated: 0, end: FinishReason::Cancelled };
    let mut hold = StopHold::default();
    while let Some(e) = stream.next_event().await {
        let text = match e {
            Event::Token(t, lp) => {
                c.generated += 1;
                hold.next(st, Some((t, lp)))
            }
            Event::Finished(f) => {
                c.end = f;
                hold.next(st, None)
            }
        };
        for (t, lp) in text {
            c.tokens.push(t);
            c.logprobs.extend(lp.map(|l| (t, l)));
        }
    }
    c
}

/// Submits the job's choices and answers with them, whole or streamed.
pub(super) async fn answer(st: Arc<ServerState>, mut job: Job) -> Response {
    let mut streams = Vec::with_capacity(job.choices.len());
    for r in std::mem::take(&mut job.choices) {
        match st.engine.submit(r) {
            Ok(s) => streams.push(s),
            // Dropping the streams submitted so far cancels them.
            Err(e) => return submit_error(e),
        }
    }
    let stops = job.stop_strings.clone();
    if job.stream {
        return sse(st, streams, job, stops);
    }
    let limit = st.limits.request_timeout;
    let all = futures_util::future::join_all(streams.into_iter().map(|s| collect(&st, s)));
    // Past the limit the streams are dropped, which cancels the choices.
    let Ok(choices) = tokio::time::timeout(limit, all).await else {
        let msg = format!("the request did not finish within {} s", limit.as_secs_f64());
        return error(StatusCode::GATEWAY_TIMEOUT, "server_error", msg, None, Some("timeout"));
    };
    if let Some(FinishReason::Error(m)) = choices.iter().map(|c| &c.end).find(|e| matches!(e, FinishReason::Error(_))) {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m.clone(), None, None);
    }
    if choices.iter().any(|c| c.end == FinishReason::Cancelled) {
        // The engine shut down under the request: no answer, not a short one.
        let msg = "the engine stopped before the request finished";
        return error(StatusCode::SERVICE_UNAVAILABLE, "server_error", msg, None, None);
    }
    let mut body = vec![];
    let mut generated = 0;
    for (i, c) in choices.iter().enumerate() {
        generated += c.generated;
        let mut text = Visible::new(&stops).delta(&st.codec.decode(&c.tokens), true);
        if let Some(p) = &job.echo {
            text = format!("{p}{text}");
        }
        let lp = match job.logprobs {
            false => Value::Null,
            true => logprobs_json(job.kind, &st, &c.logprobs, &[]),
        };
        body.push(match job.kind {
            Kind::Completion => {
                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": finish_name(&c.end, false)})
            }
            Kind::Chat => {
                let (content, calls) = match job.tools.as_ref() {
                    Some(t) => t.parse(&text),
                    None => (Some(text), vec![]),
                };
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    message["tool_calls"] = calls.iter().map(|c| c.to_json(None)).collect();
                }
                json!({"index": i, "message": message, "logprobs": lp,
                       "finish_reason": finish_name(&c.end, !calls.is_empty())})
            }
        });
    }
    let usage = json!({"prompt_tokens": job.prompt_tokens, "completion_tokens": generated,
                       "total_tokens": job.prompt_tokens + generated});
    Json(json!({"id": id(job.kind), "object": object(job.kind, false), "created": now(), "model": job.model,
                "choices": body, "usage": usage}))
    .into_response()
}

/// What one choice's stream produces.
enum Out {
    /// A choice object of a chunk.
    Chunk(Value),
    /// The choice ended after generating this many tokens.
    Done(usize),
    /// The engine failed.
    Error(String),
}

/// One choice's stream state.
struct ChoiceStream {
    index: usize,
    stream: TokenStream,
    tokens: Vec<i64>,
    pending: Vec<(i64, TokenLogprobs)>,
    /// The tokens whose logprobs were sent (for completions' text offsets).
    scored: Vec<i64>,
    generated: usize,
    text: IncrementalText,
    visible: Visible,
    first: Option<String>,
    done: bool,
    tools: Option<ToolStream>,
    hold: StopHold,
}

impl ChoiceStream {
    fn chunk(&mut self, st: &ServerState, kind: Kind, text: Option<String>, finish: Option<&str>) -> Value {
        let lp = if self.pending.is_empty() {
            Value::Null
        } else {
            let items = std::mem::take(&mut self.pending);
            let v = logprobs_json(kind, st, &items, &self.scored);
            self.scored.extend(items.iter().map(|(t, _)| *t));
            v
        };
        match kind {
            Kind::Completion => {
                json!({"index": self.index, "text": text.unwrap_or_default(), "logprobs": lp, "finish_reason": finish})
            }
            Kind::Chat => {
                let mut d = serde_json::Map::new();
                if let Some(t) = text {
                    d.insert("content".into(), json!(t));
                }
                json!({"index": self.index, "delta": d, "logprobs": lp, "finish_reason": finish})
            }
        }
    }

    /// The chunks that show newly visible text `d`: as content, or through
    /// the tool-call splitter (Note [Tool calls]). `done`: nothing follows.
    fn pieces(&mut self, st: &ServerState, kind: Kind, d: String, done: bool) -> Vec<Value> {
        let Some(ts) = &mut self.tools else {
            return if d.is_empty() { vec![] } else { vec![self.chunk(st, kind, Some(d), None)] };
        };
        let before = ts.calls;
        let (text, calls) = ts.push(&d, done);
        if text.is_empty() && calls.is_empty() {
            return vec![];
        }
        let mut c = self.chunk(st, kind, (!text.is_empty()).then_some(text), None);
        if !calls.is_empty() {
            c["delta"]["tool_calls"] = calls.iter().enumerate().map(|(j, x)| x.to_json(Some(before + j))).collect();
        }
        vec![c]
    }

    /// The next pieces of this choice: at least one unless it has ended.
    async fn next(&mut self, st: &ServerState, kind: Kind) -> Vec<Out> {
        let mut out = vec![];
        if let Some(first) = self.first.take() {
            out.push(Out::Chunk(match kind {
                Kind::Chat => json!({"index": self.index, "delta": {"role": "assistant", "content": first},
                                     "logprobs": null, "finish_reason": null}),
                Kind::Completion => self.chunk(st, kind, Some(first), None),
            }));
            return out;
        }
        if self.done {
            return out;
        }
        loop {
            match self.stream.next_event().await {
                Some(Event::Token(t, lp)) => {
                    self.generated += 1;
                    let text = self.hold.next(st, Some((t, lp)));
                    if text.is_empty() {
                        continue;
                    }
                    for (t, lp) in text {
                        self.tokens.push(t);
                        self.pending.extend(lp.map(|l| (t, l)));
                    }
                    self.text.update(&st.codec, &self.tokens, false);
                    let d = self.visible.delta(self.text.text(), false);
                    let pieces = self.pieces(st, kind, d, false);
                    if !pieces.is_empty() {
                        out.extend(pieces.into_iter().map(Out::Chunk));
                        return out;
                    }
                }
                Some(Event::Finished(FinishReason::Error(m))) => {
                    self.done = true;
                    out.push(Out::Error(m));
                    return out;
                }
                Some(Event::Finished(FinishReason::Cancelled)) | None => {
                    self.done = true;
                    out.push(Out::Error("the engine stopped before the request finished".into()));
                    return out;
                }
                Some(Event::Finished(f)) => {
                    self.text.update(&st.codec, &self.tokens, true);
                    let d = self.visible.delta(self.text.text(), true);
                    let pieces = self.pieces(st, kind, d, true);
                    out.extend(pieces.into_iter().map(Out::Chunk));
                    let empty = if kind == Kind::Chat { None } else { Some(String::new()) };
                    let called = self.tools.as_ref().is_some_and(|t| t.calls > 0);
                    out.push(Out::Chunk(self.chunk(st, kind, empty, Some(finish_name(&f, called)))));
                    out.push(Out::Done(self.generated));
                    self.done = true;
                    return out;
                }
            }
        }
    }
}

/// The streaming answer: chunks of each choice as their text grows (their
/// `index` tells them apart), each choice's last chunk with its finish
/// reason, a usage chunk if `stream_options.include_usage`, then `[DONE]`.
/// Dropping the connection drops the token streams, which cancels the choices.
fn sse(st: Arc<ServerState>, streams: Vec<TokenStream>, job: Job, stops: Vec<String>) -> Response {
    let (cid, created, kind, model) = (id(job.kind), now(), job.kind, job.model.clone());
    let deadline = tokio::time::Instant::now() + st.limits.request_timeout;
    let first = match kind {
        Kind::Chat => Some(String::new()),
        Kind::Completion => job.echo.clone(),
    };
    let choices = streams.into_iter().enumerate().map(|(index, stream)| {
        let c = ChoiceStream {
            index,
            stream,
            tokens: vec![],
            pending: vec![],
            scored: vec![],
            generated: 0,
            text: IncrementalText::new(),
            visible: Visible::new(&stops),
            first: first.clone(),
            done: false,
            tools: job.tools.clone().map(ToolStream::new),
            hold: StopHold::default(),
        };
        let st = st.clone();
        futures_util::stream::unfold(c, move |mut c| {
            let st = st.clone();
            async move {
                let out = match tokio::time::timeout_at(deadline, c.next(&st, kind)).await {
                    Ok(out) => out,
                    Err(_) if c.done => vec![],
                    Err(_) => {
                        c.done = true;
                        let s = st.limits.request_timeout.as_secs_f64();
                        vec![Out::Error(format!("the request did not finish within {s} s"))]
                    }
                };
                (!out.is_empty()).then_some((futures_util::stream::iter(out), c))
            }
        })
        .flatten()
        .boxed()
    });
    let n = job.n;
    let all = futures_util::stream::select_all(choices);
    let wrap = move |choices: Value, usage: Option<Value>| -> SseEvent {
        let mut body =
            json!({"id": cid, "object": object(kind, true), "created": created, "model": model, "choices": choices});
        if let Some(u) = usage {
            body["usage"] = u;
        }
        SseEvent::default().data(body.to_string())
    };
    let (prompt_tokens, include_usage) = (job.prompt_tokens, job.include_usage);
    struct Tail {
        done: usize,
        generated: usize,
        over: bool,
    }
    let events = all
        .scan(Tail { done: 0, generated: 0, over: false }, move |t, o| {
            if t.over {
                return futures_util::future::ready(None);
            }
            let mut ev = vec![];
            match o {
                Out::Chunk(c) => ev.push(wrap(json!([c]), None)),
                Out::Error(m) => {
                    let body = json!({"error": {"message": m, "type": "server_error", "param": null, "code": null}});
                    ev.push(SseEvent::default().data(body.to_string()));
                    ev.push(SseEvent::default().data("[DONE]"));
                    t.over = true;
                }
                Out::Done(g) => {
                    t.done += 1;
                    t.generated += g;
                    if t.done == n {
                        if include_usage {
                            let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": t.generated,
                                               "total_tokens": prompt_tokens + t.generated});
                            ev.push(wrap(json!([]), Some(usage)));
                        }
                        ev.push(SseEvent::default().data("[DONE]"));
                        t.over = true;
                    }
                }
            }
            futures_util::future::ready(Some(futures_util::stream::iter(
                ev.into_iter().map(Ok::<_, std::convert::Infallible>),
            )))
        })
        .flatten();
    Sse::new(events).into_response()
}
