//! The gated feed-forward block, `down(act(gate(x)) ⊙ up(x))`: a dense
//! layer's FFN, and the shared experts of a mixture-of-experts layer.

use super::ctx::Step;
use super::loader::{block_after, Loader, Part};
use super::shard::Shard;
use crate::ModelError;
use kvant_kernels::activation::{gated, Activation};
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};

pub(crate) struct DenseFfn {
    /// Gate, up and down; `None` for a rank whose share of the
    /// intermediate is empty (it adds nothing to the sum).
    w: Option<[LinearWeight; 3]>,
}

/// Intermediate activations of one FFN call.
#[derive(Default)]
pub(crate) struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl DenseFfn {
    /// Loads `gate`, `up` (`[ff, hidden]`) and `down` (`[hidden, ff]`) by
    /// their full tensor names: `shard`'s columns of the intermediate
    /// (gate and up rows, down columns; all of them for [`Shard::FULL`]),
    /// cut between `down`'s quantization blocks.
    pub fn load(
        ld: &Loader<'_>,
        [gate, up, down]: [&str; 3],
        hidden: usize,
        ff: usize,
        shard: Shard,
    ) -> Result<Self, ModelError> {
        let block = block_after(&ld.tensor(down)?, ld.quantize);
        let cols = shard.cols(ff, block);
        if cols.is_empty() {
            return Ok(DenseFfn { w: None });
        }
        Ok(DenseFfn {
            w: Some([
                ld.weight_part(gate, [ff, hidden], Part::Rows(cols.clone()))?,
                ld.weight_part(up, [ff, hidden], Part::Rows(cols.clone()))?,
                ld.weight_part(down, [hidden, ff], Part::Cols(cols))?,
            ]),
        })
    }

    /// Bytes of the weights (each read once per pass).
    pub fn byte_len(&self) -> usize {
        self.w.iter().flatten().map(LinearWeight::byte_len).sum()
    }

    /// `out = FFN(xn)` for `n` tokens (`out` is `[n, hidden]`, overwritten).
    pub fn forward(&self, act: Activation, step: Step<'_, FfnScratch>) -> Result<(), ModelError> {
        let Step { xn, n, q8, s, out } = step;
        let Some([gate, up, down]) = &self.w else {
            out.fill(0.0);
            return Ok(());
        };
        let ff = gate.rows();
        s.gate.resize(n * ff, 0.0);
        s.up.resize(n * ff, 0.0);
        let (g, u) = (&mut s.gate[..n * ff], &mut s.up[..n * ff]);
        let input = LinearInput::new(xn, n, q8, &[gate, up])?;
        forward_batch(&input, &mut [(gate, &mut *g), (up, &mut *u)])?;
        gated(act, g, u);
        down.forward(&LinearInput::new(g, n, q8, &[down])?, out)?;
        Ok(())
    }
}
