//! DeepSeek-V4's KV compressor: every `rate` tokens of a layer become one
//! compressed entry, a per-channel softmax-weighted sum of the window's
//! projected rows (`kv_proj`), weighted by a gate projection plus a learned
//! bias per position in the window (`ape`), then RMS-normed and rotated at
//! the window's first position (transformers' `DeepseekV4HCACompressor`
//! and `DeepseekV4CSACompressor`).
//!
//! HCA windows are disjoint. CSA projects two series per token, `Ca` (the
//! first `dim` channels) and `Cb`: entry `w` pools `Ca` of window `w − 1`
//! with `Cb` of window `w`, `2·rate` slots wide (window 0 only its `Cb`).
//! The lightning indexer compresses its keys the same way, at its own
//! width.
//!
//! A sequence keeps the projected rows of its last `rate` (HCA) or
//! `2·rate` (CSA) positions in its state slot (the "tail", indexed by
//! position), so an entry is computed when its window's last token
//! arrives, whichever pass that is: results do not depend on how a prompt
//! is chunked.

use super::loader::Loader;
use crate::ModelError;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};
use kvant_kernels::norm::rms_norm_inplace;

pub(crate) struct Compressor {
    rate: usize,
    /// An entry's width.
    dim: usize,
    /// CSA's overlapping windows (two series per token).
    overlap: bool,
    /// `[c·dim, hidden]` each (`c` = 2 with overlap), applied in f32.
    kv: LinearWeight,
    gate: LinearWeight,
    /// `[rate, c·dim]`.
    bias: Vec<f32>,
    norm: Vec<f32>,
}

impl Compressor {
    /// Loads the projections, the window bias and the norm, by name
    /// (`[kv, gate, ape, norm]`, in the checkpoint's format).
    pub fn load(
        ld: &Loader<'_>,
        [kv, gate, ape, norm]: [&str; 4],
        (rate, dim, overlap): (usize, usize, bool),
        hidden: usize,
    ) -> Result<Self, ModelError> {
        let width = if overlap { 2 * dim } else { dim };
        let bias = ld.tensor(ape)?;
        super::loader::check_shape(&bias, ape, &[rate, width])?;
        Ok(Compressor {
            rate,
            dim,
            overlap,
            kv: ld.exact_weight(kv, width, hidden)?,
            gate: ld.exact_weight(gate, width, hidden)?,
            bias: super::loader::to_f32(&bias)?,
            norm: ld.vector(norm, dim)?,
        })
    }

    pub fn rate(&self) -> usize {
        self.rate
    }

    pub fn byte_len(&self) -> usize {
        self.kv.byte_len() + self.gate.byte_len()
    }

    /// Projected channels per token (both series with overlap).
    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }

    /// Positions the tail keeps.
    fn tail_rows(&self) -> usize {
        if self.overlap {
            2 * self.rate
        } else {
            self.rate
        }
    }

    /// Values of a sequence's tail: per kept position, its kv then gate
    /// projections.
    pub fn state_len(&self) -> usize {
        crate::config::compressor_tail_len(self.rate, self.dim, self.overlap)
    }

    /// The projections of `n` rows of `xn`: `kv` and `gate`, `[n, width]`.
    pub fn project(
        &self,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        (kv, gate): (&mut [f32], &mut [f32]),
    ) -> Result<(), ModelError> {
        let input = LinearInput::new(xn, n, q8, &[&self.kv, &self.gate])?;
        forward_batch(&input, &mut [(&self.kv, kv), (&self.gate, gate)])?;
        Ok(())
    }

    /// Keeps position `pos`'s projections in `tail`; returns the entry
    /// its window closes, if it is the window's last position.
    pub fn push(
        &self,
        tail: &mut [f32],
        pos: usize,
        (kv, gate): (&[f32], &[f32]),
    ) -> Option<usize> {
        let w = self.width();
        let slot = pos % self.tail_rows();
        let row = &mut tail[slot * 2 * w..(slot + 1) * 2 * w];
        row[..w].copy_from_slice(kv);
        row[w..].copy_from_slice(gate);
        ((pos + 1).is_multiple_of(self.rate)).then_some(pos / self.rate)
    }

    /// Entry `w` from the tail (its window just closed): pooled, normed
    /// and rotated at position `w·rate` (the last `rope` of `inv_freq`'s
    /// dimensions) into `out` (`[dim]`). `scratch` holds the window's
    /// weights.
    pub fn entry(
        &self,
        tail: &[f32],
        w: usize,
        (eps, inv_freq): (f32, &[f32]),
        scratch: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let (m, d, width) = (self.rate, self.dim, self.width());
        let rows = self.tail_rows();
        // Each slot: (position, offset of its series in the row).
        let previous = (self.overlap && w > 0).then(|| ((w - 1) * m, 0));
        let current = (w * m, if self.overlap { d } else { 0 });
        let slots = previous
            .into_iter()
            .chain([current])
            .flat_map(|(p0, off)| (0..m).map(move |j| (p0 + j, j, off)));
        scratch.clear();
        scratch.resize(2 * m, 0.0);
        for (i, o) in out.iter_mut().enumerate() {
            let mut max = f32::NEG_INFINITY;
            for (s, (p, j, off)) in slots.clone().enumerate() {
                let row = &tail[(p % rows) * 2 * width..];
                scratch[s] = row[width + off + i] + self.bias[j * width + off + i];
                max = max.max(scratch[s]);
            }
            let used = slots.clone().count();
            let sum: f32 = scratch[..used]
                .iter_mut()
                .map(|g| {
                    *g = (*g - max).exp();
                    *g
                })
                .sum();
            *o = slots
                .clone()
                .zip(&scratch[..used])
                .map(|((p, _, off), &e)| tail[(p % rows) * 2 * width + off + i] * (e / sum))
                .sum();
        }
        rms_norm_inplace(out, &self.norm, eps);
        rotate_tail(out, inv_freq, w * m, false);
    }
}

/// Rotates the last `2·inv_freq.len()` values of `x` as interleaved
/// pairs at position `pos` (DeepSeek-V4's `[nope | rope]` heads), or by
/// `−pos` with `inverse` (the attention output's de-rotation): angles
/// `pos · inv_freq` in f32, as transformers computes them.
pub(crate) fn rotate_tail(x: &mut [f32], inv_freq: &[f32], pos: usize, inverse: bool) {
    let r = 2 * inv_freq.len();
    let start = x.len() - r;
    for (pair, &f) in x[start..].chunks_exact_mut(2).zip(inv_freq) {
        let angle = pos as f32 * f;
        let (sin, cos) = angle.sin_cos();
        let sin = if inverse { -sin } else { sin };
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * cos - b * sin;
        pair[1] = b * cos + a * sin;
    }
}
