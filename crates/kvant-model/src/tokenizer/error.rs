//! Why a tokenizer could not be built or could not run.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "unsupported tokenizer model \"{0}\" (tokenizer.ggml.model); kvant reads \"gpt2\" \
         (byte-level BPE) and \"llama\" (SentencePiece)"
    )]
    UnsupportedModel(String),
    #[error(
        "unknown BPE pre-tokenizer \"{0}\" (tokenizer.ggml.pre); kvant does not guess how \
         this vocabulary splits text"
    )]
    UnknownPreTokenizer(String),
    #[error("invalid tokenizer metadata: {0}")]
    InvalidSpec(String),
    #[error("unsupported tokenizer.json: {0}")]
    UnsupportedHf(String),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("tokenizer engine: {0}")]
    Engine(#[source] tokenizers::Error),
    #[error("token id {id} is outside the vocabulary of {vocab_size}")]
    IdOutOfRange { id: u32, vocab_size: usize },
}
