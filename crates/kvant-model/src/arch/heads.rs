//! One small matrix per attention head, each applied to its own head's
//! rows: latent attention's query absorption (`attn_k_b`) and value
//! expansion (`attn_v_b`).
//!
//! With int8-packed weights all heads run as one grouped product (one
//! quantization of the head-major rows, one pool job whose units are
//! (head, row group) pairs, `kvant_kernels::int8::gemm_grouped`), not one
//! fork-join per head: a decode step of a 16-head model would otherwise
//! pay 32 per layer. Other weights run head by head.

use crate::ModelError;
use kvant_kernels::cpu;
use kvant_kernels::int8::{gemm_grouped, PackedMatrix, Q8Activations, Segment};
use kvant_kernels::linear::{LinearInput, LinearWeight};

pub(crate) struct PerHead {
    weights: Weights,
    /// Every head's matrix is `[rows, cols]`.
    rows: usize,
    cols: usize,
}

enum Weights {
    Packed(Vec<PackedMatrix>),
    Each(Vec<LinearWeight>),
}

impl PerHead {
    /// Groups `weights` (one `[rows, cols]` per head, equal shapes).
    pub fn new(weights: Vec<LinearWeight>) -> Self {
        let (rows, cols) = weights.first().map_or((0, 0), |w| (w.rows(), w.cols()));
        let weights = if weights.iter().all(|w| matches!(w, LinearWeight::Int8(_))) {
            let packed = weights
                .into_iter()
                .filter_map(|w| match w {
                    LinearWeight::Int8(p) => Some(p),
                    _ => None,
                })
                .collect();
            Weights::Packed(packed)
        } else {
            Weights::Each(weights)
        };
        PerHead {
            weights,
            rows,
            cols,
        }
    }

    /// Bytes read by one pass over every head's matrix.
    pub fn byte_len(&self) -> usize {
        match &self.weights {
            Weights::Packed(p) => p.iter().map(|m| m.byte_len()).sum(),
            Weights::Each(w) => w.iter().map(|m| m.byte_len()).sum(),
        }
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
        let (rows, cols) = (self.rows, self.cols);
        match &self.weights {
            Weights::Packed(p) => {
                let heads = p.len();
                q8.quantize(cpu::tier(), x, heads * n, cols)?;
                let segments: Vec<Segment> = (0..heads)
                    .map(|h| Segment {
                        set: 0,
                        matrix: h,
                        tokens: h * n..(h + 1) * n,
                    })
                    .collect();
                gemm_grouped(&[p], &segments, q8, &mut [y])?;
            }
            Weights::Each(w) => {
                for ((w, x), y) in w
                    .iter()
                    .zip(x.chunks_exact(n * cols))
                    .zip(y.chunks_exact_mut(n * rows))
                {
                    w.forward(&LinearInput::new(x, n, q8, &[w])?, y)?;
                }
            }
        }
        Ok(())
    }
}
