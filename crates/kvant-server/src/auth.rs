//! Optional bearer-token authentication for `/v1/*`.

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

/// Lets the request through if no key is configured or it carries
/// `Authorization: Bearer <key>`; otherwise answers 401.
pub async fn require_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(key) = &state.config().api_key {
        let given = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token);
        if !given.is_some_and(|g| same(g.as_bytes(), key.as_bytes())) {
            return Err(ApiError::unauthorized());
        }
    }
    Ok(next.run(req).await)
}

/// The token of a `Bearer <token>` header (the scheme is case-insensitive).
fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Equality whose time does not depend on where the inputs differ, so the
/// key cannot be guessed byte by byte from response times.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing_and_comparison() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer"), None);
        assert!(same(b"key-1", b"key-1"));
        assert!(!same(b"key-1", b"key-2"));
        assert!(!same(b"key", b"key-1"));
    }
}
