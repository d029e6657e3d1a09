//! The gated feed-forward block, `down(act(gate(x)) ⊙ up(x))`: a dense
//! layer's FFN, and the shared experts of a mixture-of-experts layer.

use super::loader::Loader;
use crate::ModelError;
use kvant_kernels::activation::{gated, Activation};
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};

pub(crate) struct DenseFfn {
    gate: LinearWeight,
    up: LinearWeight,
    down: LinearWeight,
}

/// Intermediate activations of one FFN call.
#[derive(Default)]
pub(crate) struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl DenseFfn {
    /// Loads `gate`, `up` (`[ff, hidden]`) and `down` (`[hidden, ff]`) by
    /// their full tensor names.
    pub fn load(
        ld: &Loader<'_>,
        [gate, up, down]: [&str; 3],
        hidden: usize,
        ff: usize,
    ) -> Result<Self, ModelError> {
        Ok(DenseFfn {
            gate: ld.weight(gate, ff, hidden)?,
            up: ld.weight(up, ff, hidden)?,
            down: ld.weight(down, hidden, ff)?,
        })
    }

    pub fn weights(&self) -> [&LinearWeight; 3] {
        [&self.gate, &self.up, &self.down]
    }

    /// `out = FFN(xn)` for `n` tokens (`out` is `[n, hidden]`, overwritten).
    pub fn forward(
        &self,
        act: Activation,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut FfnScratch,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let ff = self.gate.rows();
        s.gate.resize(n * ff, 0.0);
        s.up.resize(n * ff, 0.0);
        let (g, u) = (&mut s.gate[..n * ff], &mut s.up[..n * ff]);
        let input = LinearInput::new(xn, n, q8, &[&self.gate, &self.up])?;
        forward_batch(&input, &mut [(&self.gate, &mut *g), (&self.up, &mut *u)])?;
        gated(act, g, u);
        self.down
            .forward(&LinearInput::new(g, n, q8, &[&self.down])?, out)?;
        Ok(())
    }
}
