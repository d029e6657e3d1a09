//! Errors raised by the kernels.
//!
//! Kernels check their arguments once per call (not per row or element), so a
//! caller's shape mistake, or a tensor from a hostile file, is an error rather
//! than an out-of-bounds read.

use kvant_core::{CoreError, DType};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: {why}")]
    InvalidShape { op: &'static str, why: String },
    #[error("{what}: expected length {expected}, found {actual}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("{op} does not support {dtype}")]
    UnsupportedDType { op: &'static str, dtype: DType },
    #[error("{op} expects a 2-D tensor, found shape {shape:?}")]
    NotAMatrix { op: &'static str, shape: Vec<usize> },
    #[error("{op}: size {a} x {b} overflows")]
    SizeOverflow {
        op: &'static str,
        a: usize,
        b: usize,
    },
    #[error("{values} values are not whole units of a {dtype} KV cache ({unit} values each)")]
    KvUnits {
        dtype: &'static str,
        values: usize,
        unit: usize,
    },
    #[error(transparent)]
    Core(#[from] CoreError),
    #[error("router parameters: {what} is {value}, expected {min}..={max}")]
    RouterParams {
        what: &'static str,
        value: usize,
        min: usize,
        max: usize,
    },
    #[error("{what} {index} is out of range (there are {len})")]
    IndexOutOfRange {
        what: &'static str,
        index: usize,
        len: usize,
    },
    #[error("grouped gemm segment of tokens {start}..{end} is not inside {min}..{max} (a set's segments must ascend without overlapping)")]
    SegmentRange {
        start: usize,
        end: usize,
        min: usize,
        max: usize,
    },
    #[error("{what} matrix {matrix} is {actual:?}, expected {expected:?}")]
    MatrixShape {
        what: &'static str,
        matrix: usize,
        expected: [usize; 2],
        actual: [usize; 2],
    },
    #[error("{what} matrix {matrix} is packed for another kernel than matrix 0 (one stacked tensor should give one kind)")]
    MatrixKind { what: &'static str, matrix: usize },
}

/// Checks one length argument.
pub fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<(), KernelError> {
    if expected == actual {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch {
            what,
            expected,
            actual,
        })
    }
}

/// `a * b`, or an error naming the op.
pub fn checked_mul(op: &'static str, a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b)
        .ok_or(KernelError::SizeOverflow { op, a, b })
}
