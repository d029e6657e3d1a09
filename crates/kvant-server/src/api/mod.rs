//! The wire types of OpenAI's API, with OpenAI's field names: what requests
//! may carry (`request`) and what responses and stream chunks look like.

pub mod chat;
pub mod completions;
pub mod embeddings;
mod envelope;
pub mod models;
pub mod request;
pub mod usage;

pub use envelope::{Chunk, Header, Response};
