//! Request fields → what the engine runs. Every field is range-checked here,
//! with a 400 that names it, and omitted fields get OpenAI's defaults
//! (temperature 1, no top-k, top-p 1, no min-p, no penalties), not the
//! llama.cpp defaults of kvant's command line.

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod format;
pub mod tools;

use crate::api::request::CommonFields;
use crate::error::ApiError;
use crate::state::AppState;
use format::OutputGrammar;
use kvant_engine::SamplingParams;
use serde_json::{Map, Value};

/// Choices one request may ask for: each is a sequence with its own KV
/// blocks, so `n` multiplies a request's cost.
const MAX_CHOICES: usize = 16;
/// OpenAI's limit on stop sequences.
const MAX_STOP: usize = 4;
/// OpenAI's range for `temperature`.
const MAX_TEMPERATURE: f64 = 2.0;
/// OpenAI's range for the presence and frequency penalties: ±this.
const MAX_PENALTY: f64 = 2.0;
/// OpenAI's range for a logit bias: ±this.
const MAX_BIAS: f64 = 100.0;
/// Tokens one `logit_bias` may name (each costs an add per sampled token).
const MAX_LOGIT_BIAS: usize = 1024;

/// A validated request, less its prompt.
#[derive(Clone, Debug)]
pub struct Plan {
    pub n: usize,
    /// `None`: fill what the context leaves after the prompt, up to
    /// `default_max_tokens` when that is set.
    pub max_tokens: Option<usize>,
    /// The endpoint's default for an omitted `max_tokens` (`/v1/completions`:
    /// 16), capped by the context; `None` (chat) fills the context.
    pub default_max_tokens: Option<usize>,
    /// Sampling of choice 0; choice `i` adds `i` to the seed.
    pub sampling: SamplingParams,
    /// `None`: a random seed.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Alternatives reported per token; `None` reports no logprobs.
    pub logprobs: Option<usize>,
    /// `Some` for a streamed response.
    pub stream: Option<StreamPlan>,
    /// Structured output: the grammar every choice must match.
    pub grammar: Option<OutputGrammar>,
    /// Added to these tokens' logits before each sample.
    pub logit_bias: Vec<(u32, f32)>,
    /// `/v1/chat/completions` with tools: read each choice's calls back in
    /// this format.
    pub tools: Option<crate::tools::ToolFormat>,
    /// `/v1/completions`: each choice's text starts with its prompt's.
    pub echo: bool,
    /// `/v1/completions`: sequences run per prompt, of which the `n` with
    /// the highest mean log-probability per token are returned; `None`: `n`.
    pub best_of: Option<usize>,
    /// Leave control tokens out of the text (vLLM's field; default true).
    /// Tool formats written in control tokens (DeepSeek-V3's) turn it off.
    pub skip_special_tokens: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamPlan {
    /// Send a last chunk with the usage and no choices.
    pub include_usage: bool,
}

/// Checks the fields both endpoints share.
pub fn common(mut c: CommonFields, state: &AppState) -> Result<Plan, ApiError> {
    served_model(state, c.model.as_deref())?;
    let grammar = format::parse(&mut c)?;
    let stream = match (c.stream.unwrap_or(false), c.stream_options) {
        (true, opts) => Some(StreamPlan {
            include_usage: opts.and_then(|o| o.include_usage).unwrap_or(false),
        }),
        (false, Some(_)) => {
            return Err(ApiError::bad_param(
                "stream_options",
                "`stream_options` is only allowed when `stream` is true",
            ))
        }
        (false, None) => None,
    };
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::bad_param(
                "n",
                format!("`n` must be between 1 and {MAX_CHOICES}, got {n}"),
            ))
        }
    };
    let max_tokens = match c.max_tokens {
        None => None,
        Some(0) => {
            return Err(ApiError::bad_param(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ))
        }
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
    };
    let temperature = checked(
        "temperature",
        c.temperature,
        1.0,
        |t| (0.0..=MAX_TEMPERATURE).contains(&t),
        "between 0 and 2",
    )?;
    let top_p = checked("top_p", c.top_p, 1.0, |p| p > 0.0 && p <= 1.0, "in (0, 1]")?;
    let min_p = checked(
        "min_p",
        c.min_p,
        0.0,
        |p| (0.0..=1.0).contains(&p),
        "in [0, 1]",
    )?;
    let penalty = |t: f64| (-MAX_PENALTY..=MAX_PENALTY).contains(&t);
    let presence_penalty = checked(
        "presence_penalty",
        c.presence_penalty,
        0.0,
        penalty,
        "between -2 and 2",
    )?;
    let frequency_penalty = checked(
        "frequency_penalty",
        c.frequency_penalty,
        0.0,
        penalty,
        "between -2 and 2",
    )?;
    let repeat_penalty = checked(
        "repetition_penalty",
        c.repetition_penalty,
        1.0,
        |r| r.is_finite() && r > 0.0,
        "a finite number > 0",
    )?;
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::bad_param(
                "top_k",
                format!("`top_k` must be positive, or -1 or 0 to disable it; got {k}"),
            ))
        }
    };
    let sampling = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        presence_penalty,
        frequency_penalty,
        // OpenAI's penalties look at the whole text, not a recent window.
        penalty_last_n: state.engine().context_length(),
        seed: 0,
    };
    Ok(Plan {
        n,
        max_tokens,
        default_max_tokens: None,
        sampling,
        // Negative seeds are valid in OpenAI's API; any i64 names one stream.
        seed: c.seed.map(|s| s as u64),
        stop: stop_strings(c.stop)?,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        logprobs: None,
        stream,
        grammar,
        logit_bias: logit_bias(c.logit_bias)?,
        tools: None,
        echo: false,
        best_of: None,
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
    })
}

/// `logit_bias`: `{"token id": bias}`, biases in [-100, 100] (OpenAI's
/// range); the engine checks the ids against the vocabulary.
fn logit_bias(map: Option<Map<String, Value>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = map.unwrap_or_default();
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::bad_param(
            "logit_bias",
            format!("`logit_bias` may name at most {MAX_LOGIT_BIAS} tokens"),
        ));
    }
    map.into_iter()
        .map(|(k, v)| {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::bad_param(
                    "logit_bias",
                    format!("`logit_bias` keys are token ids, got {k:?}"),
                )
            })?;
            match v.as_f64() {
                Some(b) if (-MAX_BIAS..=MAX_BIAS).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::bad_param(
                    format!("logit_bias.{k}"),
                    format!("a bias must be a number between -100 and 100, got {v}"),
                )),
            }
        })
        .collect()
}

/// A request's `model`: absent, or the name this server serves.
pub fn served_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.config().model_name => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// `value` (or `default` when absent) as f32, if `ok` accepts it.
fn checked(
    name: &str,
    value: Option<f64>,
    default: f32,
    ok: impl Fn(f64) -> bool,
    rule: &str,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if ok(v) => Ok(v as f32),
        Some(v) => Err(ApiError::bad_param(
            name,
            format!("`{name}` must be {rule}, got {v}"),
        )),
    }
}

/// `stop`: null, a string, or an array of at most [`MAX_STOP`] strings; none empty.
fn stop_strings(stop: Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = |msg: &str| ApiError::bad_param("stop", msg);
    let list = match stop {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(bad(&format!(
                    "at most {MAX_STOP} stop sequences are allowed"
                )));
            }
            items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(bad("`stop` must be a string or an array of strings")),
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => return Err(bad("`stop` must be a string or an array of strings")),
    };
    if list.iter().any(String::is_empty) {
        return Err(bad("stop sequences must not be empty"));
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stop_accepts_the_documented_shapes_only() {
        assert_eq!(stop_strings(None).ok(), Some(vec![]));
        assert_eq!(
            stop_strings(Some(json!("x"))).ok(),
            Some(vec!["x".to_string()])
        );
        let four = json!(["a", "b", "c", "d"]);
        assert_eq!(stop_strings(Some(four)).map(|v| v.len()).ok(), Some(4));
        for bad in [
            json!(["a", "b", "c", "d", "e"]),
            json!([1]),
            json!(""),
            json!(7),
        ] {
            let e = stop_strings(Some(bad.clone())).err();
            assert_eq!(e.and_then(|e| e.param).as_deref(), Some("stop"), "{bad}");
        }
    }

    #[test]
    fn checked_applies_default_and_range() {
        let ok = |t: f64| (0.0..=2.0).contains(&t);
        assert_eq!(checked("t", None, 1.0, ok, "r").ok(), Some(1.0));
        assert_eq!(checked("t", Some(0.25), 1.0, ok, "r").ok(), Some(0.25));
        assert!(checked("t", Some(2.5), 1.0, ok, "r").is_err());
        assert!(checked("t", Some(f64::NAN), 1.0, ok, "r").is_err());
    }
}
