//! Prompts → token ids: text is tokenized with the checkpoint's special
//! tokens (BOS where the model wants one), a conversation is rendered by the
//! chat template (which writes its own special tokens) and then tokenized,
//! with control-token spellings inside message contents kept as plain text
//! unless `--parse-special-in-content`; token ids pass through (the engine
//! checks them against the vocabulary).

use crate::error::ApiError;
use crate::state::AppState;
use kvant_model::chat::ChatMessage;

#[derive(Debug, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    /// A conversation and the tools its template renders.
    Chat(Vec<ChatMessage>, Option<serde_json::Value>),
}

impl PromptInput {
    /// The request field errors about this prompt refer to.
    pub fn param(&self) -> &'static str {
        match self {
            PromptInput::Chat(..) => "messages",
            PromptInput::Text(_) | PromptInput::Tokens(_) => "prompt",
        }
    }
}

/// The prompt's token ids. Rendering and tokenizing run on tokio's blocking
/// pool, so a long prompt or a slow template never stalls the tasks that
/// stream other responses.
pub async fn tokenize(state: &AppState, input: PromptInput) -> Result<Vec<u32>, ApiError> {
    tokenize_with(state, input, true).await
}

/// As [`tokenize`]; `add_special` (BOS/EOS for a text, the generation
/// prompt for a conversation) may be turned off (`/tokenize`).
pub async fn tokenize_with(
    state: &AppState,
    input: PromptInput,
    add_special: bool,
) -> Result<Vec<u32>, ApiError> {
    let tokenizer = state.tokenizer().clone();
    match input {
        PromptInput::Tokens(ids) => Ok(ids),
        PromptInput::Text(text) => {
            blocking(move || {
                tokenizer.encode(&text, add_special).map_err(|e| {
                    ApiError::bad_param("prompt", format!("cannot tokenize the prompt: {e}"))
                })
            })
            .await
        }
        PromptInput::Chat(messages, tools) => {
            let template = state.chat_template().cloned().ok_or_else(|| {
                ApiError::bad_request(
                    "this model has no chat template; use /v1/completions with a plain prompt",
                )
            })?;
            let literal = !state.config().parse_special_in_content;
            blocking(move || {
                template
                    .encode(&tokenizer, &messages, add_special, tools.as_ref(), literal)
                    .map_err(|e| ApiError::bad_param("messages", e.to_string()))
            })
            .await
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}
