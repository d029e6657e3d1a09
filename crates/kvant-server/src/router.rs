//! The routes, the API-key layer on `/v1/*`, `/tokenize` and `/detokenize`, and OpenAI-style
//! answers for unknown paths and methods.

use crate::routes::{chat, completions, embeddings, models, ops, tokens};
use crate::state::AppState;
use crate::{access_log, auth};
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;
use std::sync::Arc;

/// Largest request body: room for a prompt filling a long context many
/// times over, small enough that a hostile body cannot exhaust memory.
const MAX_BODY_BYTES: usize = 16 << 20;

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions::handle))
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/embeddings", post(embeddings::handle))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{id}", get(models::get))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            auth::require_key,
        ));
    let cors = state.config().allowed_origins.as_ref().map(|o| o.layer());
    let app = Router::new()
        .merge(v1)
        .route("/health", get(ops::health))
        .route("/metrics", get(ops::metrics))
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(access_log::layer))
        .with_state(state);
    match cors {
        Some(layer) => app.layer(layer),
        None => app,
    }
}
