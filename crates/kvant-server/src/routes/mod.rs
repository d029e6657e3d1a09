//! One module per endpoint family.

pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod models;
pub mod ops;
pub mod tokens;
