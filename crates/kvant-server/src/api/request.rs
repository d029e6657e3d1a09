//! Request fields. Every field is optional here so that a missing one gets
//! its documented default and a wrong type is reported by name; fields that
//! accept several shapes (`prompt`, `stop`, message `content`) stay JSON
//! values and are checked in `validate`. Fields not listed are ignored.

use serde::Deserialize;
use serde_json::{Map, Value};

/// Fields both completion endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    pub max_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extension (vLLM, llama.cpp): -1 or 0 disables.
    pub top_k: Option<i64>,
    /// Extension: 0 disables.
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Extension (vLLM's name for llama.cpp's repeat penalty): 1 disables.
    pub repetition_penalty: Option<f64>,
    pub stop: Option<Value>,
    /// Extension: keep generating past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<Map<String, Value>>,
    /// OpenAI's structured outputs: `{"type": "text" | "json_object" |
    /// "json_schema", ...}` (vLLM takes it on both endpoints).
    pub response_format: Option<Value>,
    /// vLLM's extensions: a JSON schema (object or string), a regular
    /// expression, a list of allowed outputs, a Lark grammar.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    /// Extension (vLLM): false keeps control tokens' text in the output.
    pub skip_special_tokens: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields only `/v1/completions` reads.
#[derive(Debug, Default, Deserialize)]
pub struct CompletionFields {
    pub prompt: Option<Value>,
    /// How many alternatives to report per token (the chosen one is always reported).
    pub logprobs: Option<u64>,
    pub echo: Option<bool>,
    pub best_of: Option<u64>,
    pub suffix: Option<String>,
}

/// Fields only `/v1/chat/completions` reads.
#[derive(Debug, Default, Deserialize)]
pub struct ChatFields {
    pub messages: Option<Vec<MessageIn>>,
    /// Chat's newer name for `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
}

/// `/v1/embeddings` fields (`input` is checked in `validate`; `user` is
/// ignored).
#[derive(Debug, Default, Deserialize)]
pub struct EmbeddingFields {
    pub model: Option<String>,
    pub input: Option<Value>,
    pub encoding_format: Option<String>,
    pub dimensions: Option<u64>,
}

#[derive(Debug, Deserialize)]
pub struct MessageIn {
    pub role: String,
    /// A string, an array of content parts, or null.
    pub content: Option<Value>,
    pub tool_calls: Option<Value>,
    pub function_call: Option<Value>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}
