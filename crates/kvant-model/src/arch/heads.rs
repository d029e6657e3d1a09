//! One small matrix per attention head, each applied to its own head's
//! rows: latent attention's query absorption (`attn_k_b`) and value
//! expansion (`attn_v_b`). The heads are the runs of one
//! [`MatrixGroup`], so int8 weights run all heads as one grouped product
//! (one quantization, one pool job), not one fork-join per head.

use crate::ModelError;
use kvant_kernels::cpu;
use kvant_kernels::group::MatrixGroup;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::LinearWeight;

pub(crate) struct PerHead(MatrixGroup);

impl PerHead {
    /// Groups `weights` (one `[rows, cols]` per head).
    pub fn new(
        what: &'static str,
        weights: Vec<LinearWeight>,
        shape: [usize; 2],
    ) -> Result<Self, ModelError> {
        Ok(PerHead(MatrixGroup::new(what, weights, shape)?))
    }

    /// Bytes read by one pass over every head's matrix.
    pub fn byte_len(&self) -> usize {
        self.0.byte_len()
    }

    /// `y[h] = x[h] · W_hᵀ` for `n` rows per head: `x` is head-major
    /// `[heads, n, cols]`, `y` `[heads, n, rows]`.
    pub fn forward(
        &self,
        x: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        y: &mut [f32],
    ) -> Result<(), ModelError> {
        let heads = (0..self.0.len()).map(|h| (h, h * n..(h + 1) * n));
        Ok(self.0.forward_runs(cpu::tier(), heads, x, q8, y)?)
    }
}
