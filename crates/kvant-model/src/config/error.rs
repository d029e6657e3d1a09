//! What reading a model configuration can fail with: a missing required
//! key, a value out of range, an architecture kvant does not run.

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("missing required config key `{0}`")]
    Missing(String),
    #[error("config key `{key}` has an invalid value: {why}")]
    Invalid { key: String, why: String },
    #[error(
        "unsupported architecture `{0}` (supported: llama, mistral, qwen2, qwen3, gemma3, \
         mixtral, qwen2moe, qwen3moe, deepseek2, deepseek3, deepseek32, qwen3next, qwen35, \
         qwen35moe, kimi_linear, deepseek4)"
    )]
    UnsupportedArch(String),
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
}

pub type Result<T> = std::result::Result<T, ConfigError>;

/// A value out of range: the key it came from and why.
pub(super) fn invalid(key: impl Into<String>, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        why: why.into(),
    }
}
