//! Causal self-attention over a contiguous KV history, with online softmax.
//!
//! Each (query token, head) pair streams over its allowed keys once, keeping
//! the running max, the running denominator and the weighted value sum
//! (FlashAttention's recurrence), so no score matrix is materialised. Query
//! heads map to KV heads by GQA grouping (`head / (n_heads / n_kv_heads)`).

use crate::dot::dot_f32;
use rayon::prelude::*;

/// Shape and policy of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys in `(p - w, p]`.
    pub window: Option<usize>,
}

impl AttnParams {
    fn key_range(&self, pos: usize) -> std::ops::Range<usize> {
        let lo = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        lo..pos + 1
    }
}

/// `q` is `[n_tokens, n_heads * head_dim]` for positions `q_pos0..q_pos0 + n_tokens`;
/// `k` and `v` are `[kv_len, n_kv_heads * head_dim]` for positions `0..kv_len`
/// (they must already hold the query tokens' own keys); `out` is shaped like `q`.
pub fn attention(p: &AttnParams, q: &[f32], q_pos0: usize, k: &[f32], v: &[f32], out: &mut [f32]) {
    let hd = p.head_dim;
    let kv_dim = p.n_kv_heads * hd;
    let group = p.n_heads / p.n_kv_heads;
    let kv_len = k.len() / kv_dim;
    debug_assert_eq!(q.len(), out.len());
    debug_assert!(q_pos0 + q.len() / (p.n_heads * hd) <= kv_len);
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (t, h) = (idx / p.n_heads, idx % p.n_heads);
        let qh = &q[idx * hd..(idx + 1) * hd];
        let kvh = h / group;
        let mut max = f32::NEG_INFINITY;
        let mut denom = 0f32;
        o.fill(0.0);
        for j in p.key_range(q_pos0 + t) {
            let kr = &k[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
            let s = p.scale * dot_f32(qh, kr);
            let vr = &v[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
            if s > max {
                // Rescale what was accumulated under the old max.
                let c = (max - s).exp();
                denom *= c;
                for x in o.iter_mut() {
                    *x *= c;
                }
                max = s;
            }
            let w = (s - max).exp();
            denom += w;
            for (x, &vv) in o.iter_mut().zip(vr) {
                *x += w * vv;
            }
        }
        let inv = 1.0 / denom;
        for x in o.iter_mut() {
            *x *= inv;
        }
    });
}

/// f64 reference with an explicit softmax over the full score row.
pub fn attention_ref(p: &AttnParams, q: &[f32], q_pos0: usize, k: &[f32], v: &[f32]) -> Vec<f32> {
    let hd = p.head_dim;
    let kv_dim = p.n_kv_heads * hd;
    let group = p.n_heads / p.n_kv_heads;
    let n = q.len() / (p.n_heads * hd);
    let mut out = vec![0f32; q.len()];
    for t in 0..n {
        for h in 0..p.n_heads {
            let qh = &q[(t * p.n_heads + h) * hd..][..hd];
            let kvh = h / group;
            let range = p.key_range(q_pos0 + t);
            let scores: Vec<f64> = range
                .clone()
                .map(|j| {
                    let kr = &k[j * kv_dim + kvh * hd..][..hd];
                    p.scale as f64
                        * qh.iter()
                            .zip(kr)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let acc: f64 = range
                    .clone()
                    .zip(&e)
                    .map(|(j, w)| w * v[j * kv_dim + kvh * hd + d] as f64)
                    .sum();
                out[(t * p.n_heads + h) * hd + d] = (acc / z) as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Online softmax in f32 over ≤ 50 keys: errors ~1e-6; 1e-5 leaves margin.
    const TOL: f32 = 1e-5;

    #[test]
    fn matches_reference_gqa_window_and_offsets() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for (n_heads, n_kv, hd, window, n_tok, past) in [
            (4usize, 2usize, 16usize, None, 7usize, 0usize),
            (3, 1, 5, None, 1, 20),
            (6, 3, 8, Some(4), 9, 13),
            (2, 2, 3, Some(1), 5, 0),
        ] {
            let p = AttnParams {
                n_heads,
                n_kv_heads: n_kv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
            };
            let kv_len = past + n_tok;
            let rand_vec = |rng: &mut rand_chacha::ChaCha8Rng, n: usize| -> Vec<f32> {
                (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
            };
            let q = rand_vec(&mut rng, n_tok * n_heads * hd);
            let k = rand_vec(&mut rng, kv_len * n_kv * hd);
            let v = rand_vec(&mut rng, kv_len * n_kv * hd);
            let mut out = vec![f32::NAN; q.len()];
            attention(&p, &q, past, &k, &v, &mut out);
            let r = attention_ref(&p, &q, past, &k, &v);
            for (a, b) in out.iter().zip(&r) {
                assert!((a - b).abs() <= TOL, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn window_of_one_returns_own_value() {
        let p = AttnParams {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
            window: Some(1),
        };
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [5.0, 5.0, -3.0, 2.0];
        let v = [1.0, 2.0, 3.0, 4.0];
        let mut out = [0f32; 4];
        attention(&p, &q, 0, &k, &v, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }
}
