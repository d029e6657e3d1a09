//! A MoE layer's shared experts (DeepSeek, Qwen2-MoE): a dense
//! feed-forward every token runs beside its routed experts, whose output
//! is added to theirs.

use super::super::ctx::Step;
use super::super::ffn::{DenseFfn, FfnScratch};
use super::super::loader::{to_f32, Loader};
use super::super::shard::Shard;
use crate::config::SharedExperts as SharedExpertsConfig;
use crate::ModelError;
use kvant_core::Tensor;
use kvant_kernels::activation::Activation;
use kvant_kernels::int8::Q8Activations;

pub(crate) struct SharedExperts {
    ffn: DenseFfn,
    /// Qwen2-MoE: the shared output is scaled by `sigmoid(x · gate)`.
    gate: Option<Vec<f32>>,
}

/// The shared experts' output and activations, reused across passes.
#[derive(Default)]
pub(crate) struct SharedScratch {
    y: Vec<f32>,
    ffn: FfnScratch,
}

impl SharedExperts {
    /// The shared experts of `s`, from `names` (gate, up, down) and the
    /// gate's `gate_name`, with `shard` of their intermediate.
    pub fn load(
        ld: &Loader<'_>,
        s: &SharedExpertsConfig,
        names: [&str; 3],
        gate_name: &str,
        h: usize,
        shard: Shard,
    ) -> Result<Self, ModelError> {
        Ok(SharedExperts {
            ffn: DenseFfn::load(ld, names, h, s.ff, shard)?,
            gate: match s.gated {
                true => Some(shared_gate(ld, gate_name, h)?),
                false => None,
            },
        })
    }

    pub fn byte_len(&self) -> usize {
        self.ffn.byte_len()
    }

    /// The output of `n` tokens, into `s` (nothing without tokens).
    pub fn run(
        &self,
        act: Activation,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut SharedScratch,
    ) -> Result<(), ModelError> {
        if n == 0 {
            return Ok(());
        }
        let len = xn.len();
        s.y.resize(len, 0.0);
        let out = &mut s.y[..len];
        let step = Step {
            xn,
            n,
            q8,
            s: &mut s.ffn,
            out,
        };
        self.ffn.forward(act, step)?;
        Ok(())
    }

    /// Adds [`Self::run`]'s output for the rows `xn` to `out`, row by row,
    /// scaled by `sigmoid(x · gate)` for Qwen2-MoE's gated shared expert.
    pub fn add(&self, xn: &[f32], n: usize, s: &SharedScratch, out: &mut [f32]) {
        if n == 0 {
            return;
        }
        let h = xn.len() / n;
        let y = &s.y[..xn.len()];
        for ((o, y), x) in out
            .chunks_exact_mut(h)
            .zip(y.chunks_exact(h))
            .zip(xn.chunks_exact(h))
        {
            let g = match &self.gate {
                Some(w) => {
                    let z: f32 = x.iter().zip(w).map(|(a, b)| a * b).sum();
                    1.0 / (1.0 + (-z).exp())
                }
                None => 1.0,
            };
            o.iter_mut().zip(y).for_each(|(o, y)| *o += g * y);
        }
    }
}

/// Qwen2-MoE's shared-expert gate: `[1, hidden]` in Hugging Face files,
/// `[hidden]` in GGUF.
fn shared_gate(ld: &Loader<'_>, name: &str, h: usize) -> Result<Vec<f32>, ModelError> {
    let t: Tensor = ld.tensor(name)?;
    if t.elements() != h || t.row_len() != h {
        return Err(ModelError::TensorShape {
            name: name.into(),
            expected: vec![1, h],
            actual: t.shape().to_vec(),
        });
    }
    to_f32(&t)
}
