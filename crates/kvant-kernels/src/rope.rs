//! Rotary position embeddings.
//!
//! The inverse frequencies (with any scaling already folded in) are computed
//! once per model; each call rotates the heads of one token. Angles are
//! `pos * inv_freq` in f32, as transformers computes them, so positions up to
//! the context length keep the reference's rounding.

/// How the rotated dimensions are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i+1)`: llama.cpp's "normal" rope, used by GGUF Llama
    /// files whose q/k rows the converter permuted.
    Interleaved,
    /// Pairs `(i, i + rot/2)`: `rotate_half` in transformers; Qwen, Gemma,
    /// and every Hugging Face checkpoint.
    Neox,
}

/// Rotates `n_heads` heads of `head_dim` values each, in place, for one
/// token at `pos`. Only the first `2 * inv_freq.len()` dims of a head rotate.
pub fn rope_inplace(
    x: &mut [f32],
    head_dim: usize,
    pos: usize,
    inv_freq: &[f32],
    style: RopeStyle,
) {
    let half = inv_freq.len();
    debug_assert!(2 * half <= head_dim);
    let p = pos as f32;
    // cos/sin once per token, shared by all heads.
    let mut cs = [(0f32, 0f32); 256];
    let table = &mut cs[..half.min(256)];
    for (c, &f) in table.iter_mut().zip(inv_freq) {
        let a = p * f;
        *c = (a.cos(), a.sin());
    }
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(c, s)) in table.iter().enumerate() {
            let (a, b) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
}

/// The largest rotary half-dimension `rope_inplace` accepts (head_dim 512).
pub const MAX_ROPE_HALF: usize = 256;

/// f64 reference: rotates with angles computed in double precision.
pub fn rope_ref(
    x: &[f32],
    head_dim: usize,
    pos: usize,
    inv_freq: &[f32],
    style: RopeStyle,
) -> Vec<f32> {
    let half = inv_freq.len();
    let mut out = x.to_vec();
    for (h, head) in out.chunks_exact_mut(head_dim).enumerate() {
        let src = &x[h * head_dim..(h + 1) * head_dim];
        for (i, &f) in inv_freq.iter().enumerate() {
            let a = pos as f64 * f as f64;
            let (c, s) = (a.cos(), a.sin());
            let (ia, ib) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + half),
            };
            let (x0, x1) = (src[ia] as f64, src[ib] as f64);
            head[ia] = (x0 * c - x1 * s) as f32;
            head[ib] = (x0 * s + x1 * c) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn matches_reference_and_preserves_norm() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for (head_dim, rot) in [(8usize, 8usize), (64, 64), (80, 32), (6, 2)] {
            let half = rot / 2;
            let inv: Vec<f32> = (0..half)
                .map(|i| 10000f32.powf(-(2.0 * i as f32) / rot as f32))
                .collect();
            for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
                for pos in [0usize, 1, 17, 4095] {
                    let x: Vec<f32> = (0..head_dim * 3)
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect();
                    let mut y = x.clone();
                    rope_inplace(&mut y, head_dim, pos, &inv, style);
                    let r = rope_ref(&x, head_dim, pos, &inv, style);
                    // f32 angle rounding at pos 4095 is ~4095 * 2^-24 rad.
                    for (a, b) in y.iter().zip(&r) {
                        assert!((a - b).abs() < 1e-3, "{style:?} pos {pos}: {a} vs {b}");
                    }
                    let n0: f32 = x.iter().map(|v| v * v).sum();
                    let n1: f32 = y.iter().map(|v| v * v).sum();
                    assert!((n0 - n1).abs() < 1e-4 * n0.max(1.0));
                    if pos == 0 {
                        assert_eq!(x, y);
                    }
                }
            }
        }
    }
}
