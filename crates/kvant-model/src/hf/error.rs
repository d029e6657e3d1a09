//! Everything that can be wrong with a Hugging Face model directory; each
//! error names the file and, where there is one, the tensor.

use kvant_core::CoreError;
use std::path::PathBuf;

/// Result alias for the Hugging Face module.
pub type Result<T> = std::result::Result<T, HfError>;

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot map {}: {source}", path.display())]
    Map {
        path: PathBuf,
        #[source]
        source: CoreError,
    },
    #[error("{} is missing from {}", name, dir.display())]
    MissingFile { dir: PathBuf, name: &'static str },
    #[error("{} holds no weights: expected model.safetensors or model.safetensors.index.json", dir.display())]
    NoWeights { dir: PathBuf },
    #[error("{} is {len} bytes; at most {max} are read", path.display())]
    FileTooLarge { path: PathBuf, len: u64, max: u64 },
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: {what} must be a JSON object", path.display())]
    NotAnObject { path: PathBuf, what: &'static str },
    #[error("{} is not valid UTF-8", path.display())]
    NotUtf8 { path: PathBuf },
    #[error("{}: file of {len} bytes is too short for the 8-byte safetensors header length", path.display())]
    Truncated { path: PathBuf, len: usize },
    #[error("{}: header claims {header_len} bytes but only {available} follow the length field (limit {max})", path.display())]
    HeaderTooLong {
        path: PathBuf,
        header_len: u64,
        available: usize,
        max: usize,
    },
    #[error("{}: bad safetensors header: {reason}", path.display())]
    BadHeader { path: PathBuf, reason: String },
    #[error("{}: tensor {tensor:?}: {reason}", path.display())]
    BadEntry {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{}: tensor {tensor:?} has unknown safetensors dtype {dtype:?}", path.display())]
    UnknownDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },
    #[error("unsupported safetensors dtype {dtype} for tensor {tensor:?} (kvant reads F32, F16 and BF16, F8_E4M3 with block scales, and FP4 codes in I8/U8/F4 with e8m0 scales)")]
    UnsupportedDtype { tensor: String, dtype: &'static str },
    #[error("{}: tensor {tensor:?} data_offsets [{begin}, {end}] are not an ordered range inside the {data_len}-byte data section", path.display())]
    OffsetsOutOfRange {
        path: PathBuf,
        tensor: String,
        begin: u64,
        end: u64,
        data_len: usize,
    },
    #[error("{}: tensor {tensor:?} ({dtype} {shape:?}) needs {expected} bytes but data_offsets span {actual}", path.display())]
    SizeMismatch {
        path: PathBuf,
        tensor: String,
        dtype: &'static str,
        shape: Vec<u64>,
        expected: u128,
        actual: u64,
    },
    #[error("{}: shard name {shard:?} is not a plain file name in the model directory", index.display())]
    BadShardName { index: PathBuf, shard: String },
    #[error("{}: weight_map names shard {shard:?}, which is missing from the directory", index.display())]
    MissingShard { index: PathBuf, shard: String },
    #[error("{}: weight_map names {tensor:?} in {shard}, which does not contain it", index.display())]
    NotInShard {
        index: PathBuf,
        tensor: String,
        shard: String,
    },
    #[error("tensor {tensor:?} appears in both {} and {}", first.display(), second.display())]
    DuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },
    #[error("tensor {tensor:?}: {reason}")]
    ScaledWeight { tensor: String, reason: String },
    #[error("no tensor named {name:?} in the model directory")]
    MissingTensor { name: String },
    #[error("tensor {tensor:?}: {source}")]
    Tensor {
        tensor: String,
        #[source]
        source: CoreError,
    },
}
