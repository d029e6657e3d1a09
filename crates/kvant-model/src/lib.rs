//! kvant-model: checkpoint formats, tokenizers, chat templates and architectures.

pub mod arch;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gguf;
pub mod hf;
pub mod kv;
pub mod load;
pub mod quantize;
pub mod tokenizer;

pub use arch::decoder::{LoadOptions, MlaPrefill};
pub use arch::parallel::Parallel;
pub use error::ModelError;
pub use load::{load, load_files, load_parallel, load_with, LoadedModel, ModelInfo};
