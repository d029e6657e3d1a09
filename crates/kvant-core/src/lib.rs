//! kvant-core: the vocabulary every other layer speaks.
//!
//! Data types (including GGML block-quantized formats), shapes, tensors that
//! borrow their bytes from an mmap'd checkpoint or own them, and the error
//! type for everything below the model layer.

pub mod dtype;
pub mod error;
pub mod huge;
pub mod storage;
pub mod tensor;

pub use dtype::DType;
pub use error::{CoreError, Result};
pub use huge::{HugeSlice, HugeZeroed};
pub use storage::Storage;
pub use tensor::Tensor;
