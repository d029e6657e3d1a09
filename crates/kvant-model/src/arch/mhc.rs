//! Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual
//! stream is `m` streams per token (`[n, m, hidden]`), and each block (an
//! attention or a feed-forward) sits between two mixes computed from the
//! streams themselves, as transformers' `DeepseekV4HyperConnection` does:
//!
//! - `mix = rms(flat) · fnᵀ` over the flattened streams (unweighted
//!   RMSNorm, f32), split into `pre` (`m`), `post` (`m`) and `comb` (`m×m`);
//! - `pre = σ(mix·s₀ + b) + ε` collapses the streams into the block's input
//!   `Σₖ preₖ·xₖ`;
//! - `post = 2σ(mix·s₁ + b)` spreads the block's output over the streams;
//! - `comb = softmax_row(mix·s₂ + b) + ε`, normalised by its columns once,
//!   then `iters − 1` rounds of rows then columns (Sinkhorn), mixes them:
//!   `x'ₖ = postₖ·out + Σⱼ comb[j][k]·xⱼ`. There is no residual add.
//!
//! [`HyperHead`] collapses the streams once more after the last layer
//! (`σ(mix·s + b) + ε`, no `post`, no `comb`) before the final norm.

use super::loader::Loader;
use super::sized;
use crate::config::HyperConfig;
use crate::ModelError;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{LinearInput, LinearWeight};
use kvant_kernels::norm::rms_norm;

/// One site's mixes (before attention, or before the feed-forward).
pub(crate) struct HyperConnection {
    hc: HyperConfig,
    /// `[(2 + m)·m, m·hidden]`, applied in f32.
    mix: LinearWeight,
    base: Vec<f32>,
    scale: [f32; 3],
    /// Ones, the unweighted norm's weight over `m·hidden`.
    ones: Vec<f32>,
    eps: f32,
}

/// The mixes of a batch, between [`HyperConnection::pre`] and
/// [`HyperConnection::post`]; reused across layers.
#[derive(Default)]
pub(crate) struct HyperScratch {
    normed: Vec<f32>,
    mixes: Vec<f32>,
    /// `[n, m]` and `[n, m, m]`.
    post: Vec<f32>,
    comb: Vec<f32>,
    row: Vec<f32>,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl HyperConnection {
    /// Loads `{stem}_fn`, `{stem}_base`, `{stem}_scale` (e.g.
    /// `layers.3.hc_attn`; llama.cpp's names add `.weight`).
    pub fn load(
        ld: &Loader<'_>,
        stem: &str,
        hc: HyperConfig,
        hidden: usize,
        eps: f32,
    ) -> Result<Self, ModelError> {
        let m = hc.mult;
        let rows = (2 + m) * m;
        let [f, b, s] = hyper_names(ld, stem);
        let mix = ld.exact_weight(&f, rows, m * hidden)?;
        let base = ld.raw_vector(&b, rows)?;
        let s = ld.raw_vector(&s, 3)?;
        Ok(HyperConnection {
            hc,
            mix,
            base,
            scale: [s[0], s[1], s[2]],
            ones: vec![1.0; m * hidden],
            eps,
        })
    }

    pub fn byte_len(&self) -> usize {
        self.mix.byte_len()
    }

    /// The mixes of the `n` rows of streams `x` (`[n, m·hidden]`), kept in
    /// `s` for [`Self::post`]; writes the block's input, the collapsed
    /// streams `Σₖ preₖ·xₖ`, to `collapsed` (`[n, hidden]`).
    pub fn pre(
        &self,
        x: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut HyperScratch,
        collapsed: &mut [f32],
    ) -> Result<(), ModelError> {
        let m = self.hc.mult;
        let width = self.ones.len();
        let h = width / m;
        let rows = (2 + m) * m;
        let normed = sized(&mut s.normed, n * width);
        rms_norm(x, &self.ones, self.eps, normed);
        let mixes = sized(&mut s.mixes, n * rows);
        let input = LinearInput::new(normed, n, q8, &[&self.mix])?;
        self.mix.forward(&input, mixes)?;
        let post = sized(&mut s.post, n * m);
        let comb = sized(&mut s.comb, n * m * m);
        let (b, [s0, s1, s2]) = (&self.base, self.scale);
        let eps = self.hc.eps;
        for t in 0..n {
            let mix = &mixes[t * rows..(t + 1) * rows];
            let (pre_w, rest) = mix.split_at(m);
            let (post_w, comb_w) = rest.split_at(m);
            for (k, p) in post[t * m..(t + 1) * m].iter_mut().enumerate() {
                *p = 2.0 * sigmoid(post_w[k] * s1 + b[m + k]);
            }
            let c = &mut comb[t * m * m..(t + 1) * m * m];
            sinkhorn(c, comb_w, (&b[2 * m..], s2), m, (self.hc.iters, eps));
            let out = &mut collapsed[t * h..(t + 1) * h];
            out.fill(0.0);
            let xs = &x[t * width..(t + 1) * width];
            for (k, stream) in xs.chunks_exact(h).enumerate() {
                let pre = sigmoid(pre_w[k] * s0 + b[k]) + eps;
                out.iter_mut().zip(stream).for_each(|(o, &v)| *o += pre * v);
            }
        }
        Ok(())
    }

    /// `x'ₖ = postₖ·out + Σⱼ comb[j][k]·xⱼ` for every row, in place, with
    /// the mixes [`Self::pre`] left in `s` (`out`: the block's output,
    /// `[n, hidden]`).
    pub fn post(&self, x: &mut [f32], out: &[f32], n: usize, s: &mut HyperScratch) {
        let m = self.hc.mult;
        let width = self.ones.len();
        let h = width / m;
        let row = sized(&mut s.row, width);
        for t in 0..n {
            let xs = &mut x[t * width..(t + 1) * width];
            row.copy_from_slice(xs);
            let (post, comb) = (&s.post[t * m..(t + 1) * m], &s.comb[t * m * m..]);
            let o = &out[t * h..(t + 1) * h];
            for (k, dst) in xs.chunks_exact_mut(h).enumerate() {
                for (i, d) in dst.iter_mut().enumerate() {
                    let mut acc = post[k] * o[i];
                    for j in 0..m {
                        acc += comb[j * m + k] * row[j * h + i];
                    }
                    *d = acc;
                }
            }
        }
    }
}

/// `{stem}_fn`, `{stem}_base` and `{stem}_scale`, with `.weight` in a
/// GGUF file.
pub(crate) fn hyper_names(ld: &Loader<'_>, stem: &str) -> [String; 3] {
    let tail = match ld.ckpt {
        crate::checkpoint::Checkpoint::Gguf(_) => ".weight",
        crate::checkpoint::Checkpoint::Hf(_) => "",
    };
    ["fn", "base", "scale"].map(|p| format!("{stem}_{p}{tail}"))
}

/// `comb = softmax_row(w·scale + b) + ε`, then its columns normalised,
/// then `iters − 1` rounds of rows and columns, in f32 in transformers'
/// order (each division by the sum plus ε).
fn sinkhorn(
    c: &mut [f32],
    w: &[f32],
    (b, scale): (&[f32], f32),
    m: usize,
    (iters, eps): (usize, f32),
) {
    for (r, row) in c.chunks_exact_mut(m).enumerate() {
        let logits = (0..m).map(|j| w[r * m + j] * scale + b[r * m + j]);
        let max = logits.clone().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for (v, l) in row.iter_mut().zip(logits) {
            *v = (l - max).exp();
            sum += *v;
        }
        row.iter_mut().for_each(|v| *v = *v / sum + eps);
    }
    let columns = |c: &mut [f32]| {
        for j in 0..m {
            let sum: f32 = (0..m).map(|r| c[r * m + j]).sum::<f32>() + eps;
            (0..m).for_each(|r| c[r * m + j] /= sum);
        }
    };
    columns(c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(m) {
            let sum = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= sum);
        }
        columns(c);
    }
}

/// The collapse after the last layer: `Σₖ (σ(mixₖ·s + bₖ) + ε)·xₖ`.
pub(crate) struct HyperHead {
    hc: HyperConfig,
    mix: LinearWeight,
    base: Vec<f32>,
    scale: f32,
    ones: Vec<f32>,
    eps: f32,
}

impl HyperHead {
    /// Loads `fn`, `base` and `scale` by their full names.
    pub fn load(
        ld: &Loader<'_>,
        [f, b, s]: [&String; 3],
        hc: HyperConfig,
        hidden: usize,
        eps: f32,
    ) -> Result<Self, ModelError> {
        let m = hc.mult;
        Ok(HyperHead {
            hc,
            mix: ld.exact_weight(f, m, m * hidden)?,
            base: ld.raw_vector(b, m)?,
            scale: ld.raw_vector(s, 1)?[0],
            ones: vec![1.0; m * hidden],
            eps,
        })
    }

    /// Collapses the rows of streams `x` (`[n, m·hidden]`) into the first
    /// `n·hidden` values of `x` itself.
    pub fn collapse(
        &self,
        x: &mut [f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut HyperScratch,
    ) -> Result<(), ModelError> {
        let m = self.hc.mult;
        let width = self.ones.len();
        let h = width / m;
        let normed = sized(&mut s.normed, n * width);
        rms_norm(&x[..n * width], &self.ones, self.eps, normed);
        let mixes = sized(&mut s.mixes, n * m);
        let input = LinearInput::new(normed, n, q8, &[&self.mix])?;
        self.mix.forward(&input, mixes)?;
        let row = sized(&mut s.row, h);
        // Row t's result lands at or before its own streams, and after
        // every earlier row's: in order, nothing is overwritten unread.
        for t in 0..n {
            row.fill(0.0);
            for k in 0..m {
                let pre = sigmoid(mixes[t * m + k] * self.scale + self.base[k]) + self.hc.eps;
                let stream = &x[t * width + k * h..t * width + (k + 1) * h];
                row.iter_mut().zip(stream).for_each(|(o, &v)| *o += pre * v);
            }
            x[t * h..(t + 1) * h].copy_from_slice(row);
        }
        Ok(())
    }
}
