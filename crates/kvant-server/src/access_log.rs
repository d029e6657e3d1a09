//! The access log: one `tracing` event per request (target `kvant::access`)
//! when its response has been sent or abandoned, with its id, method, path,
//! status, and for generations the token counts, time to first token,
//! total time and finish reasons. Client and server errors, aborted
//! generations and clients gone before the end are logged at warn (5xx at
//! error); `/health` and `/metrics` polls at debug.
//!
//! The line is written when hyper drops the response body, so a streamed
//! response is logged at its end, not when its headers go out. The request
//! id is the client's `X-Request-Id` when it sends a usable one, else a fresh
//! one; either way the response echoes it.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use kvant_engine::serving::Usage;
use kvant_engine::FinishReason;
use std::cell::Cell;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

const REQUEST_ID: &str = "x-request-id";

/// What a generation reports into its request's log line.
#[derive(Debug, Default)]
pub struct RequestStats(Mutex<Stats>);

#[derive(Debug, Default)]
struct Stats {
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    first_token: Option<Instant>,
    finish: Vec<&'static str>,
}

impl RequestStats {
    fn with(&self, f: impl FnOnce(&mut Stats)) {
        // A poisoned lock only loses a log line's figures.
        if let Ok(mut s) = self.0.lock() {
            f(&mut s);
        }
    }

    pub fn token(&self) {
        self.with(|s| {
            s.first_token.get_or_insert_with(Instant::now);
        });
    }

    /// An embeddings request's prompts, all of them.
    pub fn prompts(&self, tokens: usize) {
        self.with(|s| {
            s.prompt_tokens += tokens;
            s.finish.push("stop");
        });
    }

    /// One choice ended. The prompt is counted once, as in the response's usage.
    pub fn finished(&self, reason: FinishReason, usage: &Usage) {
        self.with(|s| {
            if s.finish.is_empty() {
                s.prompt_tokens = usage.prompt_tokens;
                s.cached_tokens = usage.cached_tokens;
            }
            s.completion_tokens += usage.completion_tokens;
            s.finish.push(reason.as_str());
        });
    }
}

/// The middleware: gives the request its id and stats, and the response a
/// body that writes the line when dropped.
pub async fn layer(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| (1..=128).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(
            || format!("req-{:016x}", rand::random::<u64>()),
            str::to_string,
        );
    let stats = Arc::new(RequestStats::default());
    req.extensions_mut().insert(Arc::clone(&stats));
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let start = Instant::now();
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    let entry = Entry {
        id,
        method,
        path,
        status: resp.status(),
        start,
        stats,
        complete: Cell::new(false),
    };
    resp.map(|inner| Body::new(Logged { inner, entry }))
}

struct Entry {
    id: String,
    method: Method,
    path: String,
    status: StatusCode,
    start: Instant,
    stats: Arc<RequestStats>,
    /// The body was sent to its end.
    complete: Cell<bool>,
}

macro_rules! access {
    ($level:expr, $($fields:tt)*) => {
        match $level {
            tracing::Level::ERROR => tracing::error!(target: "kvant::access", $($fields)*),
            tracing::Level::WARN => tracing::warn!(target: "kvant::access", $($fields)*),
            tracing::Level::INFO => tracing::info!(target: "kvant::access", $($fields)*),
            _ => tracing::debug!(target: "kvant::access", $($fields)*),
        }
    };
}

impl Drop for Entry {
    fn drop(&mut self) {
        let ms = |t: Instant| (t - self.start).as_secs_f64() * 1e3;
        let total_ms = ms(Instant::now());
        let s = self.stats.0.lock().map(|s| {
            (
                s.prompt_tokens,
                s.completion_tokens,
                s.cached_tokens,
                s.first_token.map(ms),
                s.finish.join(","),
            )
        });
        let (prompt, completion, cached, ttft_ms, finish) =
            s.unwrap_or((0, 0, 0, None, String::new()));
        let complete = self.complete.get();
        let aborted = !complete || finish.split(',').any(|f| f == "abort");
        let level = if self.status.is_server_error() {
            tracing::Level::ERROR
        } else if self.status.is_client_error() || aborted {
            tracing::Level::WARN
        } else if matches!(self.path.as_str(), "/health" | "/metrics") {
            tracing::Level::DEBUG
        } else {
            tracing::Level::INFO
        };
        access!(
            level,
            id = %self.id,
            method = %self.method,
            path = %self.path,
            status = self.status.as_u16(),
            prompt_tokens = prompt,
            completion_tokens = completion,
            cached_tokens = cached,
            ttft_ms = ttft_ms.map(|t| (t * 10.0).round() / 10.0),
            total_ms = (total_ms * 10.0).round() / 10.0,
            finish = %finish,
            complete,
            "request"
        );
    }
}

/// The response body, passed through; knows when it was sent to its end.
struct Logged {
    inner: Body,
    entry: Entry,
}

impl http_body::Body for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.entry.complete.set(true);
        }
        polled
    }

    /// hyper stops polling a body that says it has ended (a whole JSON
    /// body after its one frame, an empty one at once).
    fn is_end_stream(&self) -> bool {
        let end = self.inner.is_end_stream();
        if end {
            self.entry.complete.set(true);
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
