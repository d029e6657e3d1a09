//! One module per endpoint family.

pub mod chat;
pub mod completions;
pub mod models;
pub mod ops;
pub mod tokens;
