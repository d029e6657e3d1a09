//! The wire types of OpenAI's API, with OpenAI's field names: what requests
//! may carry (`request`) and what responses and stream chunks look like.

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod models;
pub mod request;
pub mod usage;

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
