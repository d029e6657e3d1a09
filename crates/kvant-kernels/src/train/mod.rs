//! Training kernels: forward and backward passes, in the style of
//! Liger-Kernel and FlashAttention, for f32 and bf16 tensors.
//!
//! Each op lives in its own file with a scalar reference (`*_ref`, f64 or
//! f32 accumulation, obviously correct), fast paths per SIMD tier and one
//! dispatch, as the inference kernels do. What they share:
//! - element types are [`Elem`]: read widened to f32 exactly, written back
//!   rounded to nearest even (bf16) — torch's own rounding;
//! - every sum is accumulated in f32 (weight gradients across rows too),
//!   in a fixed order: the result does not depend on the thread count;
//! - gradients are computed where the forward already holds the data
//!   (cross-entropy writes its gradient into the logits, GLU backward
//!   writes into its inputs), so nothing the size of the logits is kept;
//! - arguments are checked once per call and a mismatch is a
//!   [`KernelError`](crate::KernelError), never an out-of-bounds access.
//!
//! The Python package (`crates/kvant-py`) hands torch tensors to these
//! functions as slices; torch allocates every output.

use crate::lanes::Lanes;

/// A tensor element type the training kernels read and write.
pub trait Elem: Lanes + Default {
    /// `v` rounded to this type (round to nearest even; NaN stays NaN).
    fn from_f32(v: f32) -> Self;
}

impl Elem for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Elem for half::bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

/// How a loss over rows is reduced, as torch's `reduction=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Per-row losses, no reduction.
    None,
    /// Sum over the rows that count.
    Sum,
    /// Sum divided by the number of rows that count (not ignored).
    Mean,
}

pub mod cross_entropy;
pub mod distill;
pub mod flash;
pub mod gemm;
pub mod glu;
pub mod linear_ce;
pub mod norm;
pub mod rope;
