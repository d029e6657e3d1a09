//! Errors raised by the core types.

use crate::DType;

/// Result alias for the core crate.
pub type Result<T> = std::result::Result<T, CoreError>;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("tensor of {dtype} with {elements} elements: {elements} is not a multiple of the block size {block}")]
    PartialBlock {
        dtype: DType,
        elements: usize,
        block: usize,
    },
    #[error("shape {shape:?} has too many elements")]
    ShapeOverflow { shape: Vec<usize> },
    #[error("tensor needs {needed} bytes but its storage holds {available}")]
    StorageTooSmall { needed: usize, available: usize },
    #[error("byte range {start}..{end} is outside storage of {len} bytes")]
    OutOfBounds {
        start: usize,
        end: usize,
        len: usize,
    },
    #[error("expected {expected} but the tensor is {actual}")]
    WrongDType {
        expected: &'static str,
        actual: DType,
    },
    #[error("expected shape {expected:?}, found {actual:?}")]
    WrongShape {
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("io error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("expected a 3-D tensor of stacked matrices, found shape {shape:?}")]
    NotStacked { shape: Vec<usize> },
    #[error("matrix {index} of a stack of {count} is out of range")]
    MatrixOutOfRange { index: usize, count: usize },
}
