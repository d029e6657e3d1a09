//! Operational endpoints, open without an API key: `GET /health` for load
//! balancers and `GET /metrics` for Prometheus.

use crate::error::ApiError;
use crate::metrics;
use crate::state::AppState;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Json;
use std::sync::Arc;

/// 200 `{"status": "ok"}`, or 503 `{"status": "draining"}` once the engine
/// takes no more requests (a shutdown draining, or ranks lost), so a load
/// balancer polling over a kept-alive connection stops routing here.
pub async fn health(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    match state.engine().is_closed() {
        false => (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))),
        true => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "draining"})),
        ),
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(CONTENT_TYPE, metrics::CONTENT_TYPE)],
        metrics::render(&state.engine().metrics()),
    )
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}
