//! Request bodies: a JSON object, then typed fields read from it.
//!
//! The body is parsed once into a `serde_json::Value`; each endpoint then
//! reads the fields it knows (unknown ones are ignored, as OpenAI's API
//! does) and a wrong type is reported with its path as the error's `param`.
//! Axum's own rejections (body too large, unreadable) become OpenAI errors
//! too, never its plain-text default.

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The request body, known to be a JSON object.
pub struct JsonObject(pub Value);

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|r| ApiError::with_status(r.status(), r.body_text()))?;
        let value: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(ApiError::bad_request("the body must be a JSON object"));
        }
        Ok(JsonObject(value))
    }
}

/// Reads the fields `T` declares from `body`; a field of the wrong type is
/// a 400 that names it.
pub fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::bad_request(inner.to_string())
        } else {
            ApiError::bad_param(path.clone(), format!("invalid `{path}`: {inner}"))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Sample {
        temperature: Option<f64>,
    }

    #[test]
    fn type_errors_name_the_field() {
        let body = serde_json::json!({"temperature": "hot", "unknown": 1});
        let e = fields::<Sample>(&body).err().map(|e| e.param);
        assert_eq!(e, Some(Some("temperature".to_string())));
        let ok = serde_json::json!({"temperature": 0.5, "unknown": [1, 2]});
        let t = fields::<Sample>(&ok).ok().and_then(|s| s.temperature);
        assert_eq!(t, Some(0.5));
    }
}
