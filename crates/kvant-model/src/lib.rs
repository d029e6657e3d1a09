//! kvant-model: checkpoint formats, tokenizers, chat templates and architectures.

pub mod chat;
pub mod gguf;
pub mod hf;
pub mod tokenizer;
