//! `/v1/embeddings` fields: `input` (the prompt shapes of `/v1/completions`,
//! up to OpenAI's 2,048 inputs), `encoding_format` and `dimensions`.

use super::completions::prompt_inputs;
use super::served_model;
use crate::api::request::EmbeddingFields;
use crate::body::fields;
use crate::error::ApiError;
use crate::prompt::PromptInput;
use crate::state::AppState;
use serde_json::Value;

/// OpenAI's limit on inputs per request. They run a window at a time (as
/// many as the queue takes), so a large batch waits rather than failing.
const MAX_INPUTS: usize = 2048;

/// A validated embeddings request, less its inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingPlan {
    /// Vectors as base64 of their little-endian f32 bytes, not arrays.
    pub base64: bool,
}

pub fn parse(
    body: &Value,
    state: &AppState,
) -> Result<(Vec<PromptInput>, EmbeddingPlan), ApiError> {
    let f: EmbeddingFields = fields(body)?;
    served_model(state, f.model.as_deref())?;
    let base64 = match f.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_param(
                "encoding_format",
                format!("`encoding_format` must be \"float\" or \"base64\", got {other:?}"),
            ))
        }
    };
    let size = state.engine().embedding_size();
    if let Some(d) = f.dimensions.filter(|&d| d != size as u64) {
        // Cutting a vector short is only meaningful for a model trained
        // for it (Matryoshka); vLLM refuses it for others too.
        return Err(ApiError::bad_param(
            "dimensions",
            format!(
                "this model's embeddings have {size} dimensions and cannot be shortened to {d}"
            ),
        ));
    }
    let input = f
        .input
        .ok_or_else(|| ApiError::bad_param("input", "`input` is required"))?;
    let inputs = prompt_inputs(input, "input", MAX_INPUTS)?;
    Ok((inputs, EmbeddingPlan { base64 }))
}
