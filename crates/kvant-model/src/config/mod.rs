//! The Llama-family configuration: one struct with switches for every
//! supported variant, read from GGUF metadata or a Hugging Face `config.json`.
//!
//! Each format's reader (`gguf`, `hf`, and the sections' own readers) only
//! extracts what the checkpoint states into one vocabulary
//! (`settings::ModelSettings` and the sections' settings); the switches an
//! architecture implies are derived once, from it (`arch`, `settings`).
//! Unknown keys are ignored; a missing required key is an error naming it.

mod arch;
mod error;
mod experts;
mod gguf;
mod hf;
mod indexer;
mod json;
mod linear;
mod mla;
mod model;
mod rope;
mod settings;
mod v4;

pub use arch::Arch;
pub use error::ConfigError;
pub use experts::{ExpertsConfig, SharedExperts};
pub use indexer::IndexerConfig;
pub use linear::{LinearConfig, LinearLayout};
pub use mla::MlaConfig;
pub use model::ModelConfig;
pub use rope::{RopeConfig, RopeScaling};
pub(crate) use v4::compressor_tail_len;
pub use v4::{HyperConfig, V4Attention, V4Config, V4Indexer, V4Rope};
