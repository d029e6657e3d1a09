//! An opened GGUF file: validated header plus the mapped bytes tensors
//! borrow from.

use super::error::{GgufError, Result};
use super::reader::{self, Header};
use super::tensor_info::TensorInfo;
use super::value::Value;
use kvant_core::{Storage, Tensor};
use std::path::Path;

/// A parsed GGUF file. Tensors are views into its storage (no copies), so
/// opening a multi-gigabyte model costs only the header parse.
pub struct GgufFile {
    storage: Storage,
    pub(super) header: Header,
}

impl GgufFile {
    /// Maps `path` read-only and parses its header.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let storage = Storage::map_file(path).map_err(GgufError::Storage)?;
        GgufFile::from_storage(storage)
    }

    /// Parses a GGUF image already in memory (tests, fuzzing, embedded data).
    pub fn from_storage(storage: Storage) -> Result<GgufFile> {
        let header = reader::parse(storage.as_bytes())?;
        Ok(GgufFile { storage, header })
    }

    /// Format version: 2 or 3.
    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn file_size(&self) -> usize {
        self.storage.len()
    }

    /// Alignment of the data section and of every tensor in it.
    pub fn alignment(&self) -> usize {
        self.header.alignment
    }

    /// File offset where the data section (and tensor offsets) start.
    pub fn data_offset(&self) -> usize {
        self.header.data_offset
    }

    /// Metadata entries in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.header.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Tensor infos in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        let &i = self.header.tensor_index.get(name)?;
        self.header.tensors.get(i)
    }

    /// Drops this process's resident pages of the file (see
    /// [`Storage::release_all_resident_pages`]).
    #[cfg(unix)]
    pub fn release_resident_pages(&self) {
        self.storage.release_all_resident_pages();
    }

    /// A view of tensor `name` in its stored type, borrowing the file bytes.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_string(),
            })?;
        let wrap = |source| GgufError::Tensor {
            tensor: name.to_string(),
            source,
        };
        // Cannot overflow: the range was checked against the file at parse time.
        let start = self
            .header
            .data_offset
            .checked_add(info.offset)
            .ok_or_else(|| {
                wrap(kvant_core::CoreError::OutOfBounds {
                    start: info.offset,
                    end: usize::MAX,
                    len: self.storage.len(),
                })
            })?;
        Tensor::new(info.dtype, info.shape.clone(), self.storage.clone(), start).map_err(wrap)
    }
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.header.version)
            .field("file_size", &self.storage.len())
            .field("metadata", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}
