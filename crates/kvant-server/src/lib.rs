//! kvant-server: an OpenAI-compatible HTTP API over the serving engine.
//!
//! `POST /v1/completions`, `POST /v1/chat/completions` (both streamed as
//! server-sent events on request), `GET /v1/models`, `POST /tokenize` and
//! `POST /detokenize`, `GET /health` and `GET /metrics` (Prometheus text). Every request field is validated before
//! the engine sees it, and every error is an OpenAI-style JSON object, so
//! the official clients raise their usual exception types.
//!
//! The engine runs on its own thread; handlers talk to it only through
//! [`kvant_engine::serving::EngineHandle`] and unbounded channels, so a slow
//! or vanished client never blocks a step. Dropping a response (a client
//! that disconnects) aborts its engine requests.

mod access_log;
mod api;
mod auth;
mod body;
mod constrain;
mod cors;
mod error;
mod generation;
mod logprobs;
pub mod memory;
mod metrics;
mod prompt;
mod router;
mod routes;
mod sse;
mod state;
mod tools;
mod validate;

pub use cors::{AllowedOrigins, InvalidOrigin};
pub use error::ApiError;
pub use router::router;
pub use state::{AppState, ServerConfig};

use kvant_engine::serving::Shutdown;
use std::future::Future;
use tokio::net::TcpListener;

/// Serves the API on `listener` until `shutdown` completes, then stops
/// accepting connections, lets the engine drain the requests in flight for
/// [`ServerConfig::shutdown_grace`], aborts whatever is left (each stream
/// still ends with its final chunk) and returns once every connection has
/// closed. The engine thread ends by itself once its work is done.
pub async fn serve<F>(listener: TcpListener, state: AppState, shutdown: F) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let engine = state.engine().clone();
    let grace = state.config().shutdown_grace;
    let app = router(std::sync::Arc::new(state));
    let on_shutdown = async move {
        shutdown.await;
        engine.shutdown(Shutdown::Drain);
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            engine.shutdown(Shutdown::Abort);
        });
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(on_shutdown)
        .await
}

/// SIGINT (Ctrl-C) and, on Unix, SIGTERM, taken over from the moment it
/// is made: make it before telling anyone the server is ready (a signal
/// between the ready line and the first poll of a lazily registered handler
/// killed the process with the default action; a CI run of the multi-rank
/// SIGTERM test did exactly that). Each [`Signals::recv`] waits for the next
/// one: the first starts a graceful shutdown, a second cuts it short.
/// Needs a tokio runtime with signals.
pub struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    pub fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Signals {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(Signals {})
    }

    /// Completes on the next SIGINT or SIGTERM.
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
        #[cfg(not(unix))]
        if let Err(e) = tokio::signal::ctrl_c().await {
            eprintln!("kvant: cannot listen for Ctrl-C: {e}");
            std::future::pending::<()>().await;
        }
    }
}
