//! The engine on its own thread behind a handle that services share: submit
//! a request, get a stream of its tokens (Note [Engine thread]).
use super::engine::{Engine, EngineStats};
use super::request::{Event, FinishReason, Request};
use futures_core::Stream;
use kiln_tensor::Error;
use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

// Note [Engine thread]
// ~~~~~~~~~~~~~~~~~~~~
// One thread owns the `Engine` (model, KV pool, scheduler) and loops: take the
// requests submitted since the last step, drop those whose stream was
// dropped, run a step, send each event to its request's channel, publish the
// counters; it sleeps on a condition variable while there is nothing to do.
// Handles only touch a small mutex-guarded inbox, so `submit` never waits for
// a model step. Streams are tokio unbounded channels: they work from async
// code (`Stream`, `next().await`) and from plain threads (`Iterator`), need no
// runtime, and tell the engine thread when the receiver is gone (`is_closed`),
// which cancels the request at its next step. The queue is bounded:
// `max_queue` counts the requests in the inbox and those waiting in the
// engine, and a submission past it is refused at once (`SubmitError::QueueFull`)
// rather than queued without limit.

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The request itself is bad (empty prompt, unknown token, too long...).
    #[error("{0}")]
    Invalid(Error),
    /// `max_queue` requests are already waiting.
    #[error("the queue is full ({0} requests waiting); try again later")]
    QueueFull(usize),
    /// The engine has stopped (its model failed irrecoverably, or it was shut down).
    #[error("the engine has shut down")]
    ShutDown,
}

/// The tokens of one request as they are generated: a [`Stream`] for async
/// code and an [`Iterator`] for threads (the iterator blocks, so it must not
/// run inside an async runtime's worker). Dropping it cancels the request.
#[derive(Debug)]
pub struct TokenStream {
    rx: UnboundedReceiver<Event>,
}

impl TokenStream {
    /// The next event, awaiting it (`None` after `Finished`).
    pub async fn next_event(&mut self) -> Option<Event> {
        self.rx.recv().await
    }
}

impl Stream for TokenStream {
    type Item = Event;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.rx.poll_recv(cx)
    }
}

impl Iterator for TokenStream {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.rx.blocking_recv()
    }
}

/// What the engine reports (see [`EngineHandle::metrics`]).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// The engine's counters as of its last step.
    pub engine: EngineStats,
    /// Requests submitted and not yet taken by the engine thread.
    pub inbox: usize,
    /// Generated tokens per second since the first request.
    pub tokens_per_s: f64,
}

impl Metrics {
    /// Requests waiting (the inbox and the engine's queue).
    pub fn queue_depth(&self) -> usize {
        self.inbox + self.engine.waiting
    }

    /// The Prometheus text exposition of the metrics (`kiln_` names).
    pub fn to_prometheus(&self) -> String {
        let e = &self.engine;
        let mut s = String::new();
        let mut put = |name: &str, kind: &str, help: &str, v: f64| {
            s.push_str(&format!("# HELP kiln_{name} {help}\n# TYPE kiln_{name} {kind}\nkiln_{name} {v}\n"));
        };
        put("queue_depth", "gauge", "Requests waiting to run.", self.queue_depth() as f64);
        put("running_sequences", "gauge", "Sequences running.", e.running as f64);
        put("kv_blocks_used", "gauge", "KV cache blocks held by sequences.", e.kv_blocks_used as f64);
        put("kv_blocks_total", "gauge", "KV cache blocks in the pool.", e.kv_blocks_total as f64);
        put("generated_tokens_total", "counter", "Tokens generated.", e.generated_tokens as f64);
        put("prefill_tokens_total", "counter", "Prompt tokens computed.", e.prefill_tokens as f64);
        put("prefix_hit_tokens_total", "counter", "Prompt tokens found in shared blocks.", e.prefix_hit_tokens as f64);
        put("preemptions_total", "counter", "Sequences preempted.", e.preemptions as f64);
        put("steps_total", "counter", "Model steps run.", e.steps as f64);
        let spec = [
            ("spec_proposed_tokens_total", "Tokens proposed by speculative decoding.", e.spec_proposed_tokens),
            ("spec_accepted_tokens_total", "Proposed tokens the model kept.", e.spec_accepted_tokens),
            ("spec_verifications_total", "Sequence steps that verified a proposal.", e.spec_verifications),
            ("spec_emitted_tokens_total", "Tokens emitted by verifying steps.", e.spec_emitted_tokens),
        ];
        for (name, help, v) in spec {
            put(name, "counter", help, v as f64);
        }
        let nan = f64::NAN;
        put(
            "spec_acceptance_rate",
            "gauge",
            "Proposed tokens kept per proposed token.",
            e.spec_acceptance_rate().unwrap_or(nan),
        );
        put(
            "spec_tokens_per_step",
            "gauge",
            "Tokens per verifying step of a sequence.",
            e.spec_tokens_per_step().unwrap_or(nan),
        );
        put("tokens_per_second", "gauge", "Generated tokens per second since the first request.", self.tokens_per_s);
        s.push_str("# HELP kiln_time_to_first_token_seconds Time from submission to the first token.\n");
        s.push_str("# TYPE kiln_time_to_first_token_seconds summary\n");
        for q in [0.5, 0.99] {
            let v = e.ttft_quantile(q).map_or(f64::NAN, |d| d.as_secs_f64());
            s.push_str(&format!("kiln_time_to_first_token_seconds{{quantile=\"{q}\"}} {v}\n"));
        }
        s.push_str(&format!("kiln_time_to_first_token_seconds_sum {}\n", e.ttft_sum.as_secs_f64()));
        s.push_str(&format!("kiln_time_to_first_token_seconds_count {}\n", e.ttft_count));
        s
    }
}

struct Inbox {
    new: VecDeque<(Request, UnboundedSender<Event>)>,
    /// Requests waiting inside the engine, as of its last step.
    engine_waiting: usize,
    shutdown: bool,
    dead: bool,
}

struct Shared {
    inbox: Mutex<Inbox>,
    wake: Condvar,
    metrics: Mutex<Metrics>,
    max_queue: usize,
    /// Checks a request as the engine would (vocabulary, context, detokenizer).
    limits: (usize, usize, bool, bool),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A handle on an engine running on its own thread (Note [Engine thread]):
/// `Send + Sync`, cheap to clone. Dropping the last handle stops the thread;
/// requests still waiting or running then end with `FinishReason::Cancelled`.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
    _owner: Arc<Owner>,
}

/// Stops the thread when the last handle goes.
struct Owner {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        lock(&self.shared.inbox).shutdown = true;
        self.shared.wake.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl EngineHandle {
    /// Starts `engine` on a new thread.
    pub fn spawn(engine: Engine) -> std::io::Result<EngineHandle> {
        let c = engine.config();
        let limits =
            (engine.model().config().vocab_size, engine.max_context(), c.detokenizer.is_some(), c.grammars.is_some());
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox { new: VecDeque::new(), engine_waiting: 0, shutdown: false, dead: false }),
            wake: Condvar::new(),
            metrics: Mutex::new(Metrics { engine: engine.stats(), ..Default::default() }),
            max_queue: engine.config().max_queue,
            limits,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new().name("kiln-serve".into()).spawn(move || run(engine, &s))?;
        let owner = Arc::new(Owner { shared: shared.clone(), thread: Mutex::new(Some(thread)) });
        Ok(EngineHandle { shared, _owner: owner })
    }

    /// Queues `req` and returns the stream of its tokens. Refused at once when
    /// the request is bad or the queue is full.
    pub fn submit(&self, req: Request) -> Result<TokenStream, SubmitError> {
        let (vocab, ctx, detok, constrain) = self.shared.limits;
        req.check(vocab, ctx, detok, constrain).map_err(SubmitError::Invalid)?;
        let (tx, rx) = unbounded_channel();
        {
            let mut inbox = lock(&self.shared.inbox);
            if inbox.shutdown || inbox.dead {
                return Err(SubmitError::ShutDown);
            }
            let waiting = inbox.new.len() + inbox.engine_waiting;
            if waiting >= self.shared.max_queue {
                return Err(SubmitError::QueueFull(waiting));
            }
            inbox.new.push_back((req, tx));
        }
        self.shared.wake.notify_all();
        Ok(TokenStream { rx })
    }

    /// The latest metrics.
    pub fn metrics(&self) -> Metrics {
        let mut m = lock(&self.shared.metrics).clone();
        m.inbox = lock(&self.shared.inbox).new.len();
        m
    }

    /// The longest prompt + new tokens a request may ask for.
    pub fn max_context(&self) -> usize {
        self.shared.limits.1
    }

    /// The model's vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.shared.limits.0
    }
}

/// The engine thread's loop (Note [Engine thread]).
fn run(mut engine: Engine, shared: &Shared) {
    let mut streams: HashMap<u64, UnboundedSender<Event>> = HashMap::new();
    let mut started: Option<Instant> = None;
    let mut failure: Option<String> = None;
    loop {
        let new: Vec<(Request, UnboundedSender<Event>)> = {
            let mut inbox = lock(&shared.inbox);
            while inbox.new.is_empty() && !engine.has_work() && !inbox.shutdown {
                inbox = shared.wake.wait(inbox).unwrap_or_else(|e| e.into_inner());
            }
            if inbox.shutdown {
                break;
            }
            inbox.new.drain(..).collect()
        };
        for (req, tx) in new {
            started.get_or_insert_with(Instant::now);
            match engine.add_request(req) {
                Ok(id) => {
                    streams.insert(id, tx);
                }
                Err(e) => {
                    let _ = tx.send(Event::Finished(FinishReason::Error(e.to_string())));
                }
            }
        }
        // Requests whose stream was dropped: cancelled.
        let gone: Vec<u64> = streams.iter().filter(|(_, tx)| tx.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            engine.abort(id);
            streams.remove(&id);
        }
        // A panic in a step (a bug, or a constraint that panics) leaves the
        // engine in no known state: every request ends with the error and
        // the engine stops, rather than streams that end as if finished.
        let outputs = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.step())) {
            Ok(o) => o,
            Err(p) => {
                let what = p
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| p.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                failure = Some(format!("the engine failed and stopped: {what}"));
                break;
            }
        };
        for o in outputs {
            let end = matches!(o.event, Event::Finished(_));
            let sent = streams.get(&o.id).is_some_and(|tx| tx.send(o.event).is_ok());
            if end || !sent {
                if !end {
                    engine.abort(o.id);
                }
                streams.remove(&o.id);
            }
        }
        let stats = engine.stats();
        lock(&shared.inbox).engine_waiting = stats.waiting;
        let secs = started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let mut m = lock(&shared.metrics);
        m.tokens_per_s = if secs > 0.0 { stats.generated_tokens as f64 / secs } else { 0.0 };
        m.engine = stats;
    }
    let mut inbox = lock(&shared.inbox);
    inbox.dead = true;
    let queued = inbox.new.drain(..).map(|(_, tx)| tx);
    let why = failure.map_or(FinishReason::Cancelled, FinishReason::Error);
    for tx in streams.into_values().chain(queued) {
        let _ = tx.send(Event::Finished(why.clone()));
    }
}
