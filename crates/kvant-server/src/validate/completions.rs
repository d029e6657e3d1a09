//! `/v1/completions` fields: the prompt (or a batch of them), `logprobs`,
//! `echo`, `best_of`, and `suffix`, which this server does not implement.

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
const DEFAULT_MAX_TOKENS: usize = 16;

/// Prompts one request may carry.
const MAX_PROMPTS: usize = 64;
/// Sequences one request may start: prompts × (`best_of` or `n`).
const MAX_SEQUENCES: usize = 128;

pub fn parse(body: &Value, state: &AppState) -> Result<(Vec<PromptInput>, Plan), ApiError> {
    let c: CommonFields = fields(body)?;
    let f: CompletionFields = fields(body)?;
    let mut plan = common(c, state)?;
    plan.default_max_tokens = Some(DEFAULT_MAX_TOKENS);
    if f.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix"));
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
    plan.echo = f.echo.unwrap_or(false);
    if plan.echo && plan.logprobs.is_some() {
        return Err(ApiError::bad_param(
            "echo",
            "`echo` together with `logprobs` is not supported: the prompt's own \
             log-probabilities are not computed",
        ));
    }
    plan.best_of = match f.best_of {
        None => None,
        Some(b) if b < plan.n as u64 => {
            return Err(ApiError::bad_param(
                "best_of",
                "`best_of` must be at least `n`",
            ))
        }
        Some(b) if b == plan.n as u64 => None,
        Some(_) if plan.stream.is_some() => {
            return Err(ApiError::bad_param(
                "best_of",
                "`best_of` greater than `n` cannot be streamed",
            ))
        }
        Some(b) if b <= MAX_SEQUENCES as u64 => Some(b as usize),
        Some(b) => {
            return Err(ApiError::bad_param(
                "best_of",
                format!("`best_of` must be at most {MAX_SEQUENCES}, got {b}"),
            ))
        }
    };
    let prompt = f
        .prompt
        .ok_or_else(|| ApiError::bad_param("prompt", "`prompt` is required"))?;
    let prompts = prompt_inputs(prompt, "prompt", MAX_PROMPTS)?;
    let sequences = prompts.len() * plan.best_of.unwrap_or(plan.n);
    if sequences > MAX_SEQUENCES {
        return Err(ApiError::bad_param(
            "prompt",
            format!(
                "{} prompts × {} choices is {sequences} sequences; at most {MAX_SEQUENCES} per request",
                prompts.len(),
                plan.best_of.unwrap_or(plan.n)
            ),
        ));
    }
    Ok((prompts, plan))
}

/// Field `param` as a string, `[string, ...]`, `[id, ...]` or
/// `[[id, ...], ...]`: one prompt or a batch of at most `max` (LangChain's
/// `batch()` sends one request with a list; embedding clients send their
/// documents in one).
pub(crate) fn prompt_inputs(
    v: Value,
    param: &'static str,
    max: usize,
) -> Result<Vec<PromptInput>, ApiError> {
    let bad = |msg: &str| ApiError::bad_param(param, msg);
    let shapes = format!(
        "`{param}` must be a string, an array of strings, an array of token ids, \
         or an array of such arrays"
    );
    let text = |s: String| match s.is_empty() {
        true => Err(bad("the prompt is empty")),
        false => Ok(PromptInput::Text(s)),
    };
    match v {
        Value::String(s) => Ok(vec![text(s)?]),
        Value::Array(items) if items.is_empty() => Err(bad("the prompt is empty")),
        Value::Array(items) if items.iter().all(|v| v.is_string() || v.is_array()) => {
            if items.len() > max {
                return Err(bad(&format!(
                    "at most {max} prompts per request, got {}",
                    items.len()
                )));
            }
            items
                .into_iter()
                .map(|item| match item {
                    Value::String(s) => text(s),
                    Value::Array(ids) => token_ids(&ids).ok_or_else(|| bad(&shapes)),
                    _ => Err(bad(&shapes)),
                })
                .collect()
        }
        Value::Array(items) => Ok(vec![token_ids(&items).ok_or_else(|| bad(&shapes))?]),
        _ => Err(bad(&shapes)),
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

    fn inputs(v: Value) -> Result<Vec<PromptInput>, ApiError> {
        prompt_inputs(v, "prompt", MAX_PROMPTS)
    }

    #[test]
    fn prompt_shapes() {
        let text = |s: &str| PromptInput::Text(s.into());
        assert_eq!(inputs(json!("hi")).ok(), Some(vec![text("hi")]));
        assert_eq!(inputs(json!(["hi"])).ok(), Some(vec![text("hi")]));
        assert_eq!(
            inputs(json!(["a", [7]])).ok(),
            Some(vec![text("a"), PromptInput::Tokens(vec![7])])
        );
        assert_eq!(
            inputs(json!([3, 4])).ok(),
            Some(vec![PromptInput::Tokens(vec![3, 4])])
        );
        assert_eq!(
            inputs(json!([[5], [6, 7]])).ok(),
            Some(vec![
                PromptInput::Tokens(vec![5]),
                PromptInput::Tokens(vec![6, 7])
            ])
        );
        let many: Vec<Value> = (0..=MAX_PROMPTS).map(|_| json!("a")).collect();
        assert!(inputs(Value::Array(many)).is_err());
        for bad in [
            json!(""),
            json!([]),
            json!([[]]),
            json!(["a", ""]),
            json!([[1], []]),
            json!([1, "a"]),
            json!([-1]),
            json!([4294967296u64]),
            json!([1.5]),
            json!({"a": 1}),
            json!(7),
            json!([""]),
        ] {
            let e = inputs(bad.clone()).err();
            assert_eq!(e.and_then(|e| e.param).as_deref(), Some("prompt"), "{bad}");
        }
    }
}
