//! RMSNorm, the normalisation of the Llama family, and LayerNorm (with
//! bias), which DeepSeek-V3.2's indexer applies to its keys.
//!
//! Computed in f32 with the mean of squares accumulated in f32, matching
//! PyTorch's `hidden.pow(2).mean(-1)` in float32 (transformers upcasts to f32).

/// `out[i] = x[i] / sqrt(mean(x²) + eps) * weight[i]` for each row of `x`.
///
/// `x` and `out` are `[rows, dim]` with `dim == weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    debug_assert_eq!(x.len(), out.len());
    debug_assert_eq!(x.len() % dim.max(1), 0);
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
    for xr in x.chunks_exact_mut(dim) {
        let scale = inv_rms(xr, eps);
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let sum_sq: f32 = x.iter().map(|v| v * v).sum();
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
        for dim in [1usize, 3, 17, 65, 577] {
            let rows = 3;
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
