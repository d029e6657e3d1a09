//! The model layer's error type: one variant per source of failure.

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("no model at {0}: expected a .gguf file or a Hugging Face model directory")]
    NotFound(String),
    #[error("GGUF: {0}")]
    Gguf(#[from] crate::gguf::GgufError),
    #[error("Hugging Face checkpoint: {0}")]
    Hf(#[from] crate::hf::HfError),
    #[error("config: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("chat template: {0}")]
    Chat(#[from] crate::chat::ChatError),
    #[error(transparent)]
    Kernel(#[from] kvant_kernels::KernelError),
    #[error(transparent)]
    Core(#[from] kvant_core::CoreError),
    #[error("cannot quantize to {0:?}: kvant quantizes to Q8_0 and Q4_0")]
    QuantizeTarget(kvant_core::DType),
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint has no tokenizer ({0} missing)")]
    MissingTokenizer(String),
    #[error("checkpoint lacks tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor `{name}` holds {why}")]
    BadTensor { name: String, why: String },
    #[error("forward pass over zero tokens")]
    EmptyInput,
    #[error("sequence needs {needed} positions but the KV cache holds {capacity}")]
    ContextOverflow { needed: usize, capacity: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("a KV pool of {n_blocks} blocks of {block_size} tokens cannot be allocated")]
    KvTooLarge { block_size: usize, n_blocks: usize },
    #[error("{slots} linear-attention state slots of {bytes} bytes do not fit in memory")]
    StateTooLarge { slots: usize, bytes: usize },
    #[error(
        "linear-attention state slot {slot} is not in the pool (or is used twice in one batch)"
    )]
    StateSlot { slot: usize },
    #[error("a {dtype} KV cache stores rows in blocks of {block} values, but this model's {rows} rows have {row} values (not a multiple of {block}); use --kv-cache-type f16, bf16 or f32")]
    KvRowSize {
        dtype: kvant_kernels::attention::KvDType,
        rows: &'static str,
        row: usize,
        block: usize,
    },
    #[error("a KV block of {block_size} tokens cannot hold compressed entries of {compress} tokens (one must divide the other)")]
    KvBlockSize { block_size: usize, compress: usize },
    #[error("the KV pool was made for another model shape")]
    KvShape,
    #[error("block table entry {block} is outside the pool of {n_blocks} blocks")]
    BadBlock { block: u32, n_blocks: usize },
    #[error(transparent)]
    Dist(#[from] kvant_dist::DistError),
    #[error("cannot split tensor `{name}` at columns {at:?} across ranks: its {dtype} blocks hold {block} values each")]
    Split {
        name: String,
        at: std::ops::Range<usize>,
        dtype: &'static str,
        block: usize,
    },
    #[error("{0} is not supported with more than one rank yet")]
    NotParallel(&'static str),
    #[error("{0} is not split over tensor-parallel ranks (--tp); run it with --ep or --dp")]
    NotTensorParallel(&'static str),
    #[error("the model has no multi-token-prediction module loaded")]
    NoMtp,
    #[error(
        "the file holds only a multi-token-prediction module (llama.cpp's --mtp output): \
         load its main model and this file beside it (--mtp-model)"
    )]
    OnlyMtp,
    #[error("the MTP file does not fit the model: {0}")]
    MtpFile(String),
    #[error("multi-token prediction (--mtp) is not supported with {0}")]
    MtpUnsupported(&'static str),
    #[error(
        "MTP input: {tokens} tokens need {tokens} hidden rows of {hidden}, got {values} values"
    )]
    MtpHidden {
        tokens: usize,
        hidden: usize,
        values: usize,
    },
}

impl ModelError {
    /// Whether this comes from ranks of a parallel run that can no longer
    /// work together (see [`kvant_dist::DistError::is_communication`]).
    pub fn is_communication(&self) -> bool {
        matches!(self, ModelError::Dist(e) if e.is_communication())
    }
}
