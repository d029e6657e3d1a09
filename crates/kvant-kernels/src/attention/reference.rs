//! The f64 reference: an explicit softmax over each full score row.

use super::AttnParams;

/// f64 reference with an explicit softmax over the full score row. `k` is
/// `[len, n_kv_heads * head_dim]` and `v` `[len, n_kv_heads * v_dim]`
/// (for latent attention, the keys' first `v_dim` values copied out);
/// the result is `[n_tokens, n_heads * v_dim]`.
pub fn attention_ref(p: &AttnParams, q: &[f32], q_pos0: usize, k: &[f32], v: &[f32]) -> Vec<f32> {
    let (hd, vd) = (p.head_dim, p.v_dim);
    let kv_dim = p.n_kv_heads * hd;
    let group = p.n_heads / p.n_kv_heads;
    let n = q.len() / (p.n_heads * hd);
    let mut out = vec![0f32; n * p.n_heads * vd];
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
            for d in 0..vd {
                let acc: f64 = range
                    .clone()
                    .zip(&e)
                    .map(|(j, w)| w * v[(j * p.n_kv_heads + kvh) * vd + d] as f64)
                    .sum();
                out[(t * p.n_heads + h) * vd + d] = (acc / z) as f32;
            }
        }
    }
    out
}
