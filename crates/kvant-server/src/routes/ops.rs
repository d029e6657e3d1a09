//! Operational endpoints, open without an API key: `GET /health` for load
//! balancers and `GET /metrics` for Prometheus.

use crate::error::ApiError;
use crate::metrics;
use crate::state::AppState;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::Uri;
use axum::response::IntoResponse;
use axum::Json;
use std::sync::Arc;

pub async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
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
