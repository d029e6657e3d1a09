//! Where one tensor's bytes are, and how to read them.

use kvant_core::DType;

/// A tensor described in the header, already validated: the shape's element
/// count fits, rows are whole blocks, and the bytes lie inside the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    /// Row-major shape, last dimension contiguous (GGUF lists dimensions
    /// innermost first; they are reversed here).
    pub shape: Vec<usize>,
    /// Start of the data relative to the data section.
    pub offset: usize,
    /// Length of the data in bytes.
    pub byte_len: usize,
}

impl TensorInfo {
    /// Number of elements, as u64 so parameter totals over a whole model
    /// add up without casts. Cannot overflow: the product was checked to
    /// fit `usize` when the header was read.
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}
