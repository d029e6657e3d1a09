//! `/v1/completions` fields: the prompt, `logprobs`, and the legacy
//! options this server does not implement.

use super::{common, Plan};
use crate::api::request::{CommonFields, CompletionFields};
use crate::body::fields;
use crate::error::ApiError;
use crate::prompt::PromptInput;
use crate::state::AppState;
use kvant_engine::serving::MAX_TOP_LOGPROBS;
use serde_json::Value;

/// Tokens generated when `max_tokens` is omitted: OpenAI's and vLLM's
/// default for this endpoint (filling the context instead held a slot for
/// minutes, 8191 tokens with the default model).
pub const DEFAULT_MAX_TOKENS: usize = 16;

pub fn parse(body: &Value, state: &AppState) -> Result<(PromptInput, Plan), ApiError> {
    let c: CommonFields = fields(body)?;
    let f: CompletionFields = fields(body)?;
    let mut plan = common(c, state)?;
    plan.default_max_tokens = Some(DEFAULT_MAX_TOKENS);
    if f.echo == Some(true) {
        return Err(ApiError::unsupported("echo"));
    }
    if f.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix"));
    }
    match f.best_of {
        Some(b) if b > plan.n as u64 => return Err(ApiError::unsupported("best_of")),
        Some(b) if b < plan.n as u64 => {
            return Err(ApiError::bad_param(
                "best_of",
                "`best_of` must be at least `n`",
            ))
        }
        _ => {}
    }
    plan.logprobs = match f.logprobs {
        None => None,
        Some(k) if k <= MAX_TOP_LOGPROBS as u64 => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("`logprobs` must be at most {MAX_TOP_LOGPROBS}, got {k}"),
            ))
        }
    };
    let prompt = f
        .prompt
        .ok_or_else(|| ApiError::bad_param("prompt", "`prompt` is required"))?;
    Ok((prompt_input(prompt)?, plan))
}

const PROMPT_SHAPES: &str =
    "`prompt` must be a string, an array of one string, or an array of token ids";

/// A string, `[string]`, `[id, ...]` or `[[id, ...]]`; several prompts in
/// one request are refused (send one request each).
fn prompt_input(v: Value) -> Result<PromptInput, ApiError> {
    let bad = |msg: &str| ApiError::bad_param("prompt", msg);
    let empty = || bad("the prompt is empty");
    match v {
        Value::String(s) if s.is_empty() => Err(empty()),
        Value::String(s) => Ok(PromptInput::Text(s)),
        Value::Array(mut items) => {
            let nested = items
                .iter()
                .filter(|v| v.is_string() || v.is_array())
                .count();
            match (items.len(), nested) {
                (0, _) => Err(empty()),
                (1, 1) => match items.pop() {
                    Some(Value::String(s)) => prompt_input(Value::String(s)),
                    Some(Value::Array(ids)) => token_ids(&ids).ok_or_else(|| bad(PROMPT_SHAPES)),
                    _ => Err(bad(PROMPT_SHAPES)),
                },
                (_, 0) => token_ids(&items).ok_or_else(|| bad(PROMPT_SHAPES)),
                (len, nested) if len == nested => Err(bad(
                    "only one prompt per request is supported; send each prompt as its own request",
                )),
                _ => Err(bad(PROMPT_SHAPES)),
            }
        }
        _ => Err(bad(PROMPT_SHAPES)),
    }
}

/// Token ids as u32; `None` if any is not a non-negative integer in range.
/// (The engine checks them against the vocabulary.)
fn token_ids(items: &[Value]) -> Option<PromptInput> {
    let ids = items
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect::<Option<Vec<u32>>>()?;
    if ids.is_empty() {
        return None;
    }
    Some(PromptInput::Tokens(ids))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        let text = |s: &str| Some(PromptInput::Text(s.into()));
        assert_eq!(prompt_input(json!("hi")).ok(), text("hi"));
        assert_eq!(prompt_input(json!(["hi"])).ok(), text("hi"));
        assert_eq!(
            prompt_input(json!([3, 4])).ok(),
            Some(PromptInput::Tokens(vec![3, 4]))
        );
        assert_eq!(
            prompt_input(json!([[5]])).ok(),
            Some(PromptInput::Tokens(vec![5]))
        );
        for bad in [
            json!(""),
            json!([]),
            json!([[]]),
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!([1, "a"]),
            json!([-1]),
            json!([4294967296u64]),
            json!([1.5]),
            json!({"a": 1}),
            json!(7),
            json!([""]),
        ] {
            let e = prompt_input(bad.clone()).err();
            assert_eq!(e.and_then(|e| e.param).as_deref(), Some("prompt"), "{bad}");
        }
    }
}
