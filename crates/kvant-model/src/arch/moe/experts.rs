//! The checkpoint's routed experts, unprepared, and what a rank prepares
//! from them: every expert whole (one process), every expert's share of
//! the intermediate (tensor parallelism), or the experts of its slots
//! (expert parallelism, again at each re-placement).

use super::super::loader::{block_after, cut_cols, quantized};
use super::super::shard::Shard;
use crate::ModelError;
use kvant_core::{DType, Tensor};
use kvant_kernels::linear::LinearWeight;
use kvant_kernels::moe::Experts;

/// Every routed expert's unprepared weights (views of the checkpoint):
/// what a rank prepares its share or its slots from.
pub(crate) struct ExpertTensors {
    pub gate: Vec<Tensor>,
    pub up: Vec<Tensor>,
    pub down: Vec<Tensor>,
    /// Prepare for the int8 kernels.
    pub int8: bool,
    /// Quantize float experts to this type as they are prepared.
    pub quantize: Option<DType>,
}

impl ExpertTensors {
    /// The experts of `slots` (logical ids, in slot order), whole.
    pub fn prepare(&self, slots: &[u32]) -> Result<Experts, ModelError> {
        let pick = |v: &[Tensor]| -> Result<Vec<LinearWeight>, ModelError> {
            slots
                .iter()
                .map(|&e| {
                    let t = v.get(e as usize).ok_or_else(|| {
                        ModelError::Dist(kvant_dist::DistError::Mismatch(format!(
                            "expert {e} of {}",
                            v.len()
                        )))
                    })?;
                    self.weight(t.clone())
                })
                .collect()
        };
        Ok(Experts::new(
            pick(&self.gate)?,
            pick(&self.up)?,
            pick(&self.down)?,
        )?)
    }

    /// One expert matrix for its kernel, quantized first if the load asks.
    fn weight(&self, t: Tensor) -> Result<LinearWeight, ModelError> {
        Ok(LinearWeight::prepare(
            quantized(t, self.quantize)?,
            self.int8,
        )?)
    }

    /// Every expert's `shard` of the intermediate (`None` when empty).
    pub fn prepare_share(
        &self,
        shard: Shard,
        names: [&str; 3],
    ) -> Result<Option<Experts>, ModelError> {
        let Some(d0) = self.down.first() else {
            return Ok(None);
        };
        let ff = d0.shape()[1];
        let cols = shard.cols(ff, block_after(d0, self.quantize));
        if cols.is_empty() {
            return Ok(None);
        }
        let prep = |t: Tensor| self.weight(t);
        let rows = |v: &[Tensor]| -> Result<Vec<LinearWeight>, ModelError> {
            v.iter().map(|t| prep(t.row_range(cols.clone())?)).collect()
        };
        let down: Result<Vec<LinearWeight>, ModelError> = self
            .down
            .iter()
            .map(|t| prep(cut_cols(t, names[2], cols.clone())?))
            .collect();
        Ok(Some(Experts::new(
            rows(&self.gate)?,
            rows(&self.up)?,
            down?,
        )?))
    }
}

/// Every expert's id, in order: the slots of a rank that holds them all.
pub(crate) fn all_ids(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}
