//! What every completion response and stream chunk wraps its choices in:
//! the header, the choices, the token counts. Chat and text completions
//! differ only in their choices.

use super::usage::Usage;
use serde::Serialize;

/// Fields every response object and stream chunk starts with.
#[derive(Clone, Debug, Serialize)]
pub struct Header {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
}

impl Header {
    /// A fresh response id, e.g. `chatcmpl-3f2a…`, unique per response.
    pub fn new(id_prefix: &str, object: &'static str, created: u64, model: &str) -> Self {
        Header {
            id: format!("{id_prefix}-{:032x}", rand::random::<u128>()),
            object,
            created,
            model: model.to_string(),
        }
    }
}

/// A whole (non-streamed) response.
#[derive(Debug, Serialize)]
pub struct Response<C> {
    #[serde(flatten)]
    pub header: Header,
    pub choices: Vec<C>,
    pub usage: Usage,
}

impl<C> Response<C> {
    /// The response whose choice `i` is `choice(i, outputs[i])`.
    pub fn new<T>(
        header: Header,
        outputs: Vec<T>,
        usage: Usage,
        choice: impl FnMut((usize, T)) -> C,
    ) -> Self {
        let choices = outputs.into_iter().enumerate().map(choice).collect();
        Response {
            header,
            choices,
            usage,
        }
    }
}

/// One stream chunk.
#[derive(Debug, Serialize)]
pub struct Chunk<'a, C> {
    #[serde(flatten)]
    pub header: &'a Header,
    pub choices: Vec<C>,
    /// Absent unless `stream_options.include_usage`; then `null` in every
    /// chunk but the last, which has no choices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

impl<'a, C> Chunk<'a, C> {
    /// A chunk carrying one choice's delta (`usage: null` when the stream
    /// reports usage at its end).
    pub fn choice(header: &'a Header, choice: C, include_usage: bool) -> Self {
        Chunk {
            header,
            choices: vec![choice],
            usage: include_usage.then_some(None),
        }
    }

    /// The stream's last chunk under `include_usage`: no choices, the counts.
    pub fn usage(header: &'a Header, usage: Usage) -> Self {
        Chunk {
            header,
            choices: Vec::new(),
            usage: Some(Some(usage)),
        }
    }
}
