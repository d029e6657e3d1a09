//! Rotary position embeddings.
//!
//! The inverse frequencies (with any scaling already folded in) are computed
//! once per model; each call rotates the heads of one token. Angles are
//! `pos * inv_freq` in f32, as transformers computes them, so positions up to
//! the context length keep the reference's rounding.

use crate::pool::{self, DisjointSlice};

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
    let mut cs = [(0f32, 0f32); MAX_ROPE_HALF];
    let table = angles(&mut cs, pos, inv_freq);
    rotate(x, head_dim, table, style);
}

/// Rotates the rows of `q` and `k` (`rows` tokens each, any number of
/// heads of `head_dim`), row `i` being the token at `pos0 + i`, in place,
/// as [`rope_inplace`] on each row, bit for bit: one cos/sin table per
/// token for both, and many rows (a prefill chunk) split over the pool.
pub fn rope_rows(
    (q, k): (&mut [f32], &mut [f32]),
    rows: usize,
    head_dim: usize,
    pos0: usize,
    inv_freq: &[f32],
    style: RopeStyle,
) {
    let (Some(qw), Some(kw)) = (q.len().checked_div(rows), k.len().checked_div(rows)) else {
        return;
    };
    let (qs, ks) = (DisjointSlice::new(q), DisjointSlice::new(k));
    pool::for_rows(rows, qw + kw, &|r| {
        // SAFETY: `for_rows` hands out disjoint row ranges.
        let (q, k) = unsafe {
            (
                qs.range(r.start * qw..r.end * qw),
                ks.range(r.start * kw..r.end * kw),
            )
        };
        let mut cs = [(0f32, 0f32); MAX_ROPE_HALF];
        for (j, i) in r.enumerate() {
            let table = angles(&mut cs, pos0 + i, inv_freq);
            rotate(&mut q[j * qw..(j + 1) * qw], head_dim, table, style);
            rotate(&mut k[j * kw..(j + 1) * kw], head_dim, table, style);
        }
    });
}

/// cos/sin of `pos · inv_freq`, in f32 as transformers computes the angles.
fn angles<'a>(
    cs: &'a mut [(f32, f32); MAX_ROPE_HALF],
    pos: usize,
    inv_freq: &[f32],
) -> &'a [(f32, f32)] {
    let p = pos as f32;
    let table = &mut cs[..inv_freq.len().min(MAX_ROPE_HALF)];
    for (c, &f) in table.iter_mut().zip(inv_freq) {
        let a = p * f;
        *c = (a.cos(), a.sin());
    }
    table
}

/// Rotates each head of `x` by the angles in `table`.
fn rotate(x: &mut [f32], head_dim: usize, table: &[(f32, f32)], style: RopeStyle) {
    let half = table.len();
    debug_assert!(2 * half <= head_dim);
    for head in x.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::Interleaved => {
                for (p, &(c, s)) in head.chunks_exact_mut(2).zip(table) {
                    let (x0, x1) = (p[0], p[1]);
                    p[0] = x0 * c - x1 * s;
                    p[1] = x0 * s + x1 * c;
                }
            }
            RopeStyle::Neox => {
                let (lo, hi) = head[..2 * half].split_at_mut(half);
                for ((a, b), &(c, s)) in lo.iter_mut().zip(hi).zip(table) {
                    let (x0, x1) = (*a, *b);
                    *a = x0 * c - x1 * s;
                    *b = x0 * s + x1 * c;
                }
            }
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
    fn rows_rotate_as_each_token_alone() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let (head_dim, rot) = (80usize, 32usize);
        let inv: Vec<f32> = (0..rot / 2)
            .map(|i| 10000f32.powf(-(2.0 * i as f32) / rot as f32))
            .collect();
        // 3 q heads and 1 k head; 61 rows reach the pool (ROWS_MIN_PARALLEL).
        for rows in [1usize, 7, 61] {
            let mut q: Vec<f32> = (0..rows * 3 * head_dim).map(|_| rng.random()).collect();
            let mut k: Vec<f32> = (0..rows * head_dim).map(|_| rng.random()).collect();
            let (mut q1, mut k1) = (q.clone(), k.clone());
            for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
                rope_rows((&mut q, &mut k), rows, head_dim, 9, &inv, style);
                let q_rows = q1.chunks_exact_mut(3 * head_dim);
                for (i, (qt, kt)) in q_rows.zip(k1.chunks_exact_mut(head_dim)).enumerate() {
                    rope_inplace(qt, head_dim, 9 + i, &inv, style);
                    rope_inplace(kt, head_dim, 9 + i, &inv, style);
                }
                assert_eq!(q, q1, "{rows} rows {style:?}");
                assert_eq!(k, k1, "{rows} rows {style:?}");
            }
        }
    }

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
