//! `GET /v1/models`.

use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// Extension (vLLM's name): prompt plus output tokens per request.
    pub max_model_len: usize,
}
