//! Everything that can be wrong with a GGUF file, each error naming what and
//! where (key, tensor, byte offset), so a bad file can be diagnosed from the
//! message alone.

use kvant_core::CoreError;

/// Result alias for the GGUF module.
pub type Result<T> = std::result::Result<T, GgufError>;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot map GGUF file: {0}")]
    Storage(#[source] CoreError),
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: Vec<u8> },
    #[error("GGUF version {version} is not supported (kvant reads versions 2 and 3; re-convert the model with a current llama.cpp)")]
    UnsupportedVersion { version: u32 },
    #[error("GGUF file is big-endian (version field reads {version:#010x}); kvant reads little-endian files only")]
    BigEndian { version: u32 },
    #[error(
        "file truncated in {context} at offset {offset}: needs {needed} bytes, {available} left"
    )]
    Truncated {
        context: String,
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("{context} at offset {offset} claims {count} entries, but the {available} bytes left hold at most {max}")]
    CountTooLarge {
        context: String,
        offset: usize,
        count: u64,
        available: usize,
        max: usize,
    },
    #[error("{context} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { context: String, offset: usize },
    #[error("metadata key {key:?} at offset {offset}: unknown value type id {id}")]
    UnknownValueType { key: String, id: u32, offset: usize },
    #[error("metadata key {key:?} at offset {offset}: bool byte is {byte}, expected 0 or 1")]
    InvalidBool {
        key: String,
        byte: u8,
        offset: usize,
    },
    #[error("metadata key {key:?} at offset {offset}: arrays nested deeper than {max} levels")]
    NestingTooDeep {
        key: String,
        offset: usize,
        max: usize,
    },
    #[error("metadata key {key:?} appears twice (second at offset {offset})")]
    DuplicateKey { key: String, offset: usize },
    #[error("tensor {name:?} appears twice (second at offset {offset})")]
    DuplicateTensor { name: String, offset: usize },
    #[error("general.alignment is {value}; it must be a power of two between 1 and {max}")]
    BadAlignment { value: i128, max: usize },
    #[error(
        "tensor {tensor:?} at offset {offset} has {n_dims} dimensions; at most {max} are allowed"
    )]
    TooManyDims {
        tensor: String,
        n_dims: u32,
        offset: usize,
        max: usize,
    },
    #[error("tensor {tensor:?} at offset {offset} has unknown ggml type id {id}")]
    UnknownGgmlType {
        tensor: String,
        id: u32,
        offset: usize,
    },
    #[error("tensor {tensor:?} with shape {shape:?} is invalid: {source}")]
    BadShape {
        tensor: String,
        shape: Vec<u64>,
        #[source]
        source: CoreError,
    },
    #[error(
        "tensor {tensor:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: usize,
    },
    #[error("tensor {tensor:?}: data at file bytes {start}..{end} lies outside the file of {file_size} bytes")]
    TensorOutOfBounds {
        tensor: String,
        start: u128,
        end: u128,
        file_size: usize,
    },
    #[error("no tensor named {name:?} in the GGUF file")]
    MissingTensor { name: String },
    #[error("tensor {tensor:?}: {source}")]
    Tensor {
        tensor: String,
        #[source]
        source: CoreError,
    },
    #[error("required metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key:?} is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key {key:?}: value {value} does not fit in {target}")]
    OutOfRange {
        key: String,
        value: String,
        target: &'static str,
    },
    #[error("cannot write metadata key {key:?}: {reason}")]
    BadWriterValue { key: String, reason: String },
    #[error("cannot write tensor {tensor:?}: {reason}")]
    BadWriterTensor { tensor: String, reason: String },
    #[error("cannot write GGUF version {version}: only 2 and 3 are supported")]
    BadWriterVersion { version: u32 },
    #[error("write failed: {0}")]
    Write(#[source] std::io::Error),
}
