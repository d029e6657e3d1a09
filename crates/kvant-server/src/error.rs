//! OpenAI-style error responses: `{"error": {"message", "type", "param",
//! "code"}}` with a matching HTTP status, which the official clients turn
//! into `BadRequestError`, `AuthenticationError`, `NotFoundError`,
//! `RateLimitError` and so on.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvant_engine::sampling::SamplingError;
use kvant_engine::serving::SubmitError;

/// One error answer. Built by validation, by the engine's refusals, and by
/// the routing layer (unknown paths, bad keys).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: "invalid_request_error", "rate_limit_error", ...
    pub kind: &'static str,
    pub message: String,
    /// The offending request field, e.g. "temperature" or "messages[1].role".
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

const INVALID_REQUEST: &str = "invalid_request_error";

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400 about the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, INVALID_REQUEST, message)
    }

    /// 400 about one field.
    pub fn bad_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::bad_request(message)
        }
    }

    /// 400 for a known OpenAI parameter this server does not implement, sent
    /// with a value that would change the result.
    pub fn unsupported(param: &str) -> Self {
        Self::bad_param(
            param,
            format!("`{param}` is not supported by this server; omit it or send its default"),
        )
        .with_code("unsupported_parameter")
    }

    pub fn model_not_found(name: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                INVALID_REQUEST,
                format!("the model `{name}` does not exist"),
            )
        }
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            INVALID_REQUEST,
            "missing or incorrect API key: send `Authorization: Bearer <key>`",
        )
        .with_code("invalid_api_key")
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            INVALID_REQUEST,
            format!("no such endpoint: {path}"),
        )
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            INVALID_REQUEST,
            "this endpoint does not accept that HTTP method",
        )
    }

    /// 500: the engine failed a request (a bug or an internal limit).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// An error whose status comes from elsewhere (axum's body rejections).
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, INVALID_REQUEST, message)
    }

    fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// A refusal by [`kvant_engine::serving::EngineHandle::submit`]; prompt
    /// errors name `prompt_param` ("prompt" or "messages").
    pub fn from_submit(e: SubmitError, prompt_param: &str) -> Self {
        let msg = e.to_string();
        match e {
            SubmitError::EmptyPrompt | SubmitError::TokenOutOfRange { .. } => {
                Self::bad_param(prompt_param, msg)
            }
            SubmitError::PromptTooLong { .. } | SubmitError::PromptBeyondCache { .. } => {
                Self::bad_param(prompt_param, msg).with_code("context_length_exceeded")
            }
            SubmitError::NoTokens | SubmitError::BeyondCache { .. } => {
                Self::bad_param("max_tokens", msg)
            }
            SubmitError::BeyondContext { .. } => {
                Self::bad_param("max_tokens", msg).with_code("context_length_exceeded")
            }
            SubmitError::TooManyLogprobs(_) => Self::bad_param("logprobs", msg),
            SubmitError::BadLogitBias { .. } => Self::bad_param("logit_bias", msg),
            SubmitError::Sampling(SamplingError::OutOfRange { name, .. }) => {
                Self::bad_param(name, msg)
            }
            SubmitError::Sampling(SamplingError::NoFiniteLogit) => Self::bad_request(msg),
            SubmitError::QueueFull => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", msg)
                    .with_code("queue_full")
            }
            SubmitError::ShuttingDown => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", msg)
                    .with_code("shutting_down")
            }
        }
    }

    /// The JSON body, also sent as a server-sent event when a stream fails.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// Seconds a client told 429 (a full queue) waits before retrying: a
/// queued request usually starts within one.
const RETRY_AFTER_SECS: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submit_errors_name_the_field_and_status() {
        let e = ApiError::from_submit(
            SubmitError::PromptTooLong {
                prompt: 9,
                context: 8,
            },
            "messages",
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(e.code, Some("context_length_exceeded"));
        let q = ApiError::from_submit(SubmitError::QueueFull, "prompt");
        assert_eq!(q.status, StatusCode::TOO_MANY_REQUESTS);
        let s = ApiError::from_submit(SubmitError::ShuttingDown, "prompt");
        assert_eq!(s.status, StatusCode::SERVICE_UNAVAILABLE);
        let b = ApiError::from_submit(
            SubmitError::Sampling(SamplingError::OutOfRange {
                name: "top_p",
                rule: "in (0, 1]",
                value: 0.0,
            }),
            "prompt",
        );
        assert_eq!(b.param.as_deref(), Some("top_p"));
    }

    #[test]
    fn body_has_openai_shape() {
        let v = ApiError::unsupported("tools").body();
        let e = &v["error"];
        assert_eq!(e["type"], "invalid_request_error");
        assert_eq!(e["param"], "tools");
        assert_eq!(e["code"], "unsupported_parameter");
        assert!(e["message"].as_str().is_some_and(|m| m.contains("tools")));
    }
}
