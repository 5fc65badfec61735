//! What a server facing a network needs (Note [Facing a network]): API keys,
//! bounds on connections, requests, prompts and outputs, and timeouts.
use super::{error, ServerState};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use std::sync::Arc;
use std::time::Duration;

// Note [Facing a network]
// ~~~~~~~~~~~~~~~~~~~~~~~
// `serve` accepts at most `max_connections` connections at once (more wait
// in the listen queue until one closes) and closes a connection that has
// not sent a whole request header within `idle_timeout`: a slow client and
// an idle keep-alive connection alike (hyper's header read timeout), so
// idle or hostile clients cannot hold the server's sockets. Each request's
// generation has `request_timeout` (non-streaming: a 504 and the request
// cancelled; streaming: an error event, then the end), its prompt and output
// are bounded (`max_prompt_tokens`, `max_output_tokens`: a 400 naming the
// field) and its body by `max_body_bytes` (a 413). With an `api_key`, every
// `/v1` route wants `Authorization: Bearer KEY`, compared in constant time,
// and answers OpenAI's 401 otherwise; `/health` and `/metrics` stay open,
// as in vLLM. The example server binds 127.0.0.1 unless told otherwise.

/// The limits of a server facing a network (Note [Facing a network]).
#[derive(Debug, Clone)]
pub struct ServerLimits {
    /// Requests to `/v1` need `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    /// The longest a request's generation may take.
    pub request_timeout: Duration,
    /// At most this many prompt tokens per request.
    pub max_prompt_tokens: Option<usize>,
    /// At most this many new tokens per choice (`max_tokens` above it is
    /// refused; without `max_tokens`, a request gets at most this many).
    pub max_output_tokens: Option<usize>,
    /// The largest request body.
    pub max_body_bytes: usize,
    /// At most this many open connections ([`serve`]).
    pub max_connections: usize,
    /// A connection that sends no whole request header for this long is closed ([`serve`]).
    pub idle_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            api_key: None,
            request_timeout: Duration::from_secs(600),
            max_prompt_tokens: None,
            max_output_tokens: None,
            max_body_bytes: 8 << 20,
            max_connections: 512,
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Whether two byte strings are equal, in time that depends only on their lengths.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// The API-key check of every `/v1` route.
pub(super) async fn auth(State(st): State<Arc<ServerState>>, req: Request, next: Next) -> Response {
    let Some(key) = &st.limits.api_key else { return next.run(req).await };
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    match given.and_then(|v| v.strip_prefix("Bearer ")) {
        Some(k) if same_key(k.trim().as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect API key provided.",
            None,
            Some("invalid_api_key"),
        ),
        None => error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "You didn't provide an API key. Pass it in an Authorization header: Bearer YOUR_KEY.",
            None,
            Some("invalid_api_key"),
        ),
    }
}

/// Serves `app` on `listener` until an accept fails for good, within
/// `limits`' connection bound and idle timeout (Note [Facing a network]).
pub async fn serve(listener: tokio::net::TcpListener, app: Router, limits: &ServerLimits) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let idle = limits.idle_timeout;
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return Ok(()) };
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors or a connection reset before it was
                // taken: wait a little rather than spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(idle)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .with_upgrades();
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_compare_whole() {
        assert!(super::same_key(b"sk-abc", b"sk-abc"));
        assert!(!super::same_key(b"sk-abc", b"sk-abd"));
        assert!(!super::same_key(b"sk-ab", b"sk-abc"));
        assert!(!super::same_key(b"", b"sk"));
    }
}
