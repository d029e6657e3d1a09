//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes: a client
//! counts a prompt's tokens (or renders a conversation) exactly as the
//! completion endpoints would, without generating.

use crate::api::request::MessageIn;
use crate::body::{fields, JsonObject};
use crate::error::ApiError;
use crate::prompt::{self, PromptInput};
use crate::state::AppState;
use crate::validate;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Deserialize)]
struct TokenizeFields {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<MessageIn>>,
    /// Text: BOS/EOS as the checkpoint asks (default true).
    add_special_tokens: Option<bool>,
    /// Conversation: end where the assistant's reply begins (default true).
    add_generation_prompt: Option<bool>,
    /// Also return each token's text.
    return_token_strs: Option<bool>,
}

/// `{"prompt": text}` or `{"messages": [...]}` → `{"count", "max_model_len",
/// "tokens"}` (and `"token_strs"` on request).
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<Value>, ApiError> {
    let f: TokenizeFields = fields(&body)?;
    validate::served_model(&state, f.model.as_deref())?;
    let (input, add_special) = match (f.prompt, f.messages) {
        (Some(p), None) => (PromptInput::Text(p), f.add_special_tokens.unwrap_or(true)),
        (None, Some(m)) => (
            PromptInput::Chat(validate::chat::conversation(Some(m))?, None),
            f.add_generation_prompt.unwrap_or(true),
        ),
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of `prompt` (a string) and `messages`",
            ))
        }
    };
    let ids = prompt::tokenize_with(&state, input, add_special).await?;
    let mut out = json!({
        "count": ids.len(),
        "max_model_len": state.engine().context_length(),
    });
    if f.return_token_strs == Some(true) {
        let strs: Vec<String> = ids
            .iter()
            .map(|&id| state.tokenizer().token_to_piece(id).unwrap_or_default())
            .collect();
        out["token_strs"] = json!(strs);
    }
    out["tokens"] = json!(ids);
    Ok(Json(out))
}

#[derive(Deserialize)]
struct DetokenizeFields {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

/// `{"tokens": [ids]}` → `{"prompt": text}`, control tokens included.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    JsonObject(body): JsonObject,
) -> Result<Json<Value>, ApiError> {
    let f: DetokenizeFields = fields(&body)?;
    validate::served_model(&state, f.model.as_deref())?;
    let ids = f
        .tokens
        .ok_or_else(|| ApiError::bad_param("tokens", "`tokens` is required"))?;
    let text = state
        .tokenizer()
        .decode(&ids, false)
        .map_err(|e| ApiError::bad_param("tokens", e.to_string()))?;
    Ok(Json(json!({ "prompt": text })))
}
