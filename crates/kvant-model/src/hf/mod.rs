//! Hugging Face model directories: config.json, (sharded) safetensors, tokenizer files.
//!
//! Safetensors headers are parsed here rather than trusted to a library so
//! that every range is validated against the mapped file and tensors borrow
//! the map without copying.

mod dir;
mod error;
mod files;
mod index;
mod safetensors;
mod scaled;
mod st_dtype;

pub use dir::{
    HfDir, CHAT_TEMPLATE_FILE, CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE, WEIGHTS_FILE,
};
pub use error::{HfError, Result};
pub use files::MAX_SIDE_FILE_LEN;
pub use index::INDEX_FILE;
pub use safetensors::{SafetensorsFile, MAX_HEADER_LEN};
