//! RMSNorm, the normalisation of the Llama family, and LayerNorm (with
//! bias), which DeepSeek-V3.2's indexer applies to its keys.
//!
//! Computed in f32 with the mean of squares accumulated in f32, matching
//! PyTorch's `hidden.pow(2).mean(-1)` in float32 (transformers upcasts to f32).

use crate::pool::{self, DisjointSlice};

/// `out[i] = x[i] / sqrt(mean(x²) + eps) * weight[i]` for each row of `x`.
///
/// `x` and `out` are `[rows, dim]` with `dim == weight.len()`; many rows
/// (a prefill chunk) are split over the pool ([`pool::for_rows`]).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    debug_assert_eq!(x.len(), out.len());
    debug_assert_eq!(x.len() % dim.max(1), 0);
    pool::for_rows_mut(out, dim, &|r, out| {
        norm_rows(&x[r.start * dim..r.end * dim], weight, eps, out)
    });
}

/// [`rms_norm`] of `x`'s rows into `out`, on the calling thread.
fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let scale = inv_rms(xr, eps);
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// In-place variant for per-head norms (Qwen3 / Gemma 3 q/k norm): every
/// `weight.len()`-sized chunk of `x` is normalised on its own.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    pool::for_rows_mut(x, dim, &|_, x| {
        for xr in x.chunks_exact_mut(dim) {
            let scale = inv_rms(xr, eps);
            for (v, &w) in xr.iter_mut().zip(weight) {
                *v = *v * scale * w;
            }
        }
    });
}

/// The residual add between a layer's blocks, fused with the norms around
/// it (vLLM's `fused_add_rms_norm`, plus Gemma's post-norms): for each row
/// of `dim` values, `x += post ? rms_norm(y, post) : y`, then with `next`,
/// `out = rms_norm(x, next)`. One pass and one pool job ([`pool::for_rows`])
/// where the separate operations were three, the add on one thread; the
/// same bits as [`rms_norm_inplace`] on `y`, the add, then [`rms_norm`].
pub fn add_rms_norm(
    x: &mut [f32],
    y: &[f32],
    dim: usize,
    post: Option<&[f32]>,
    next: Option<(&[f32], &mut [f32])>,
    eps: f32,
) {
    debug_assert_eq!(x.len(), y.len());
    debug_assert!(post.is_none_or(|w| w.len() == dim));
    let (next_w, out) = match next {
        Some((w, out)) => (Some(w), out),
        None => (None, &mut [][..]),
    };
    debug_assert!(next_w.is_none_or(|w| w.len() == dim && out.len() == x.len()));
    let out = DisjointSlice::new(out);
    pool::for_rows_mut(x, dim, &|r, x| {
        let y = &y[r.start * dim..r.end * dim];
        for (xr, yr) in x.chunks_exact_mut(dim).zip(y.chunks_exact(dim)) {
            match post {
                Some(w) => {
                    let scale = inv_rms(yr, eps);
                    for ((a, &v), &w) in xr.iter_mut().zip(yr).zip(w) {
                        *a += v * scale * w;
                    }
                }
                None => xr.iter_mut().zip(yr).for_each(|(a, &v)| *a += v),
            }
        }
        if let Some(w) = next_w {
            // SAFETY: `for_rows_mut` hands out disjoint row ranges, and
            // `out` has as many rows as `x`.
            norm_rows(x, w, eps, unsafe { out.range(r.start * dim..r.end * dim) });
        }
    });
}

/// Partial sums of squares kept in this many lanes, folded in a fixed
/// order: one f32 accumulator is a chain of dependent adds (640 of them,
/// ~4 cycles each, per row of Gemma 3), which the compiler may not reorder;
/// separate lanes it vectorizes. Plain code, so every tier and every batch
/// gets the same bits.
const LANES: usize = 16;

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut blocks = x.chunks_exact(LANES);
    for b in &mut blocks {
        for (a, &v) in acc.iter_mut().zip(b) {
            *a += v * v;
        }
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        let (lo, hi) = acc.split_at_mut(width);
        lo.iter_mut().zip(&hi[..width]).for_each(|(a, b)| *a += b);
    }
    let sum_sq = blocks.remainder().iter().fold(acc[0], |s, v| s + v * v);
    1.0 / (sum_sq / x.len() as f32 + eps).sqrt()
}

/// LayerNorm of every `weight.len()`-sized row of `x`, in place:
/// `(x - mean) / sqrt(var + eps) * weight + bias`, the biased variance as
/// PyTorch's `nn.LayerNorm` computes it (mean first, then the mean of
/// squared deviations, in f32).
pub fn layer_norm_inplace(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let dim = weight.len();
    debug_assert_eq!(bias.len(), dim);
    for xr in x.chunks_exact_mut(dim) {
        let mean = xr.iter().sum::<f32>() / dim as f32;
        let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
        let scale = 1.0 / (var + eps).sqrt();
        for ((v, &w), &b) in xr.iter_mut().zip(weight).zip(bias) {
            *v = (*v - mean) * scale * w + b;
        }
    }
}

/// f64 reference of [`layer_norm_inplace`].
pub fn layer_norm_ref(x: &[f32], weight: &[f32], bias: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    x.chunks_exact(dim)
        .flat_map(|r| {
            let mean = r.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
            let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
            let s = 1.0 / (var + eps as f64).sqrt();
            r.iter()
                .zip(weight)
                .zip(bias)
                .map(move |((&v, &w), &b)| ((v as f64 - mean) * s * w as f64 + b as f64) as f32)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// f64 reference for tests.
pub fn rms_norm_ref(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    x.chunks_exact(dim)
        .flat_map(|r| {
            let ms = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
            let s = 1.0 / (ms + eps as f64).sqrt();
            r.iter()
                .zip(weight)
                .map(move |(&v, &w)| (v as f64 * s * w as f64) as f32)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// f32 sums of a few hundred squares carry ~1e-6 relative error.
    const TOL: f32 = 1e-5;

    #[test]
    fn matches_reference_on_odd_sizes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        // 100 rows of 577 reach the pool (`pool::ROWS_MIN_PARALLEL`).
        for (dim, rows) in [
            (1usize, 3usize),
            (3, 3),
            (17, 3),
            (65, 3),
            (577, 3),
            (577, 100),
        ] {
            let x: Vec<f32> = (0..dim * rows)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let w: Vec<f32> = (0..dim).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut out = vec![f32::NAN; x.len()];
            rms_norm(&x, &w, 1e-5, &mut out);
            let r = rms_norm_ref(&x, &w, 1e-5);
            for (a, b) in out.iter().zip(&r) {
                assert!(
                    (a - b).abs() <= TOL * (1.0 + b.abs()),
                    "dim {dim}: {a} vs {b}"
                );
            }
            let mut y = x.clone();
            rms_norm_inplace(&mut y, &w, 1e-5);
            assert_eq!(y, out);
            // Batch invariance: each row alone gives the same bits.
            for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact(dim)) {
                let mut alone = vec![f32::NAN; dim];
                rms_norm(xr, &w, 1e-5, &mut alone);
                assert_eq!(alone, or);
            }
        }
    }

    #[test]
    fn fused_residual_add_is_the_separate_operations_bit_for_bit() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        // 3 rows stay on the caller; 90 rows of 257 reach the pool.
        for (dim, rows) in [(1usize, 3usize), (17, 3), (257, 90)] {
            let mut r =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0..3.0)).collect() };
            let (x, y, post, next) = (r(dim * rows), r(dim * rows), r(dim), r(dim));
            for (with_post, with_next) in
                [(false, false), (true, false), (false, true), (true, true)]
            {
                // The separate operations.
                let (mut want_x, mut yp) = (x.clone(), y.clone());
                if with_post {
                    rms_norm_inplace(&mut yp, &post, 1e-6);
                }
                want_x.iter_mut().zip(&yp).for_each(|(a, b)| *a += b);
                let mut want_out = vec![f32::NAN; x.len()];
                if with_next {
                    rms_norm(&want_x, &next, 1e-6, &mut want_out);
                }
                let (mut got_x, mut got_out) = (x.clone(), vec![f32::NAN; x.len()]);
                let post_w = with_post.then_some(post.as_slice());
                let next_w = with_next.then_some((next.as_slice(), got_out.as_mut_slice()));
                add_rms_norm(&mut got_x, &y, dim, post_w, next_w, 1e-6);
                assert_eq!(got_x, want_x, "dim {dim} rows {rows}");
                if with_next {
                    assert_eq!(got_out, want_out, "dim {dim} rows {rows}");
                } else {
                    assert!(got_out.iter().all(|v| v.is_nan()));
                }
            }
        }
    }

    #[test]
    fn layer_norm_matches_reference_on_odd_sizes() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        for dim in [1usize, 3, 17, 128, 577] {
            // An offset mean, as the indexer's projected keys have.
            let x: Vec<f32> = (0..dim * 3).map(|_| rng.random_range(2.0..5.0)).collect();
            let w: Vec<f32> = (0..dim).map(|_| rng.random_range(-2.0..2.0)).collect();
            let b: Vec<f32> = (0..dim).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut y = x.clone();
            layer_norm_inplace(&mut y, &w, &b, 1e-6);
            for (a, r) in y.iter().zip(layer_norm_ref(&x, &w, &b, 1e-6)) {
                assert!(
                    (a - r).abs() <= 1e-4 * (1.0 + r.abs()),
                    "dim {dim}: {a} vs {r}"
                );
            }
        }
    }
}
