//! GGUF v2/v3 reader over an mmap: metadata, tensor infos, typed tensor views;
//! and a writer for crafting and converting files.
//!
//! The reader treats every header field as hostile: counts and lengths are
//! checked against the bytes left before anything is allocated, tensor byte
//! ranges are checked against the file, and each error names the key or
//! tensor and the offset where the file went wrong.

mod alignment;
mod cursor;
mod error;
mod file;
mod metadata;
mod reader;
mod tensor_info;
mod value;
mod value_reader;
mod writer;

pub use alignment::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ALIGNMENT};
pub use error::{GgufError, Result};
pub use file::GgufFile;
pub use metadata::ARCHITECTURE_KEY;
pub use reader::{MAGIC, MAX_DIMS};
pub use tensor_info::TensorInfo;
pub use value::{Array, Value, ValueType};
pub use value_reader::MAX_ARRAY_DEPTH;
pub use writer::{GgufWriter, DEFAULT_VERSION, MAX_TENSOR_NAME_LEN};
