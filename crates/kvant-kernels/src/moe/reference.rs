//! Scalar references for tests: routing by sorting every candidate, and
//! the experts as a per-token loop over slots with the weights dequantized
//! exactly and every sum in f64. Obviously correct, allocating freely.

use super::route::{GroupScore, RouterInput, Scoring};
use super::routing::Routing;
use crate::activation::Activation;
use crate::error::{check_len, KernelError};
use crate::quant::dequantize_row_ref;
use kvant_core::Tensor;
use std::cmp::Ordering;

/// [`super::route`] by sorting: the same f32 scores (softmax as
/// `exp(l - max) · (1 / Σ)`, as the kernel and PyTorch compute it),
/// groups and candidates sorted by (value descending, id ascending).
///
/// # Errors
/// As [`super::route`].
pub fn route_ref(
    r: &RouterInput<'_>,
    ids: &mut [u32],
    weights: &mut [f32],
) -> Result<(), KernelError> {
    r.check(ids, weights)?;
    let RouterInput {
        params: p,
        logits,
        bias,
    } = *r;
    let n = p.n_experts;
    let outs = ids
        .chunks_exact_mut(p.top_k)
        .zip(weights.chunks_exact_mut(p.top_k));
    for (row, (ids, weights)) in logits.chunks_exact(n).zip(outs) {
        let score: Vec<f32> = match p.scoring {
            Scoring::Softmax => {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = row.iter().map(|&l| (l - max).exp()).collect();
                let sum = e.iter().fold(0f32, |a, &b| a + b);
                e.iter().map(|&v| v * (1.0 / sum)).collect()
            }
            Scoring::Sigmoid => row.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
            Scoring::SqrtSoftplus => row
                .iter()
                .map(|&l| super::route::sqrt_softplus(l))
                .collect(),
        };
        let key: Vec<f32> = (0..n)
            .map(|e| score[e] + bias.map_or(0.0, |b| b[e]))
            .map(|v| if v.is_nan() { f32::NEG_INFINITY } else { v })
            .collect();
        let desc = |a: (usize, f32), b: (usize, f32)| {
            b.1.partial_cmp(&a.1)
                .unwrap_or(Ordering::Equal)
                .then(a.0.cmp(&b.0))
        };
        let gs = p.group_size();
        let mut candidates: Vec<usize> = (0..n).collect();
        if p.n_group > 1 {
            let mut groups: Vec<(usize, f32)> = key
                .chunks(gs)
                .map(|k| {
                    let mut k = k.to_vec();
                    k.sort_by(|a, b| b.partial_cmp(a).unwrap_or(Ordering::Equal));
                    match p.group_score {
                        GroupScore::Max => k[0],
                        GroupScore::SumTop2 => k[0] + k[1],
                    }
                })
                .enumerate()
                .collect();
            groups.sort_by(|&a, &b| desc(a, b));
            let kept: Vec<usize> = groups[..p.topk_group].iter().map(|g| g.0).collect();
            candidates.retain(|e| kept.contains(&(e / gs)));
        }
        let mut ranked: Vec<(usize, f32)> = candidates.iter().map(|&e| (e, key[e])).collect();
        ranked.sort_by(|&a, &b| desc(a, b));
        for ((id, w), &(e, _)) in ids.iter_mut().zip(weights.iter_mut()).zip(&ranked) {
            *id = e as u32;
            *w = score[e];
        }
        if p.norm_topk {
            let denom = weights.iter().fold(0f32, |a, &b| a + b) + 1e-20;
            weights.iter_mut().for_each(|w| *w /= denom);
        }
        weights.iter_mut().for_each(|w| *w *= p.scale);
    }
    Ok(())
}

/// The activation of a gate value in f64 (clamped first by
/// [`Activation::SiluClamped`]; [`up_f64`] clamps the up value).
pub fn activation_f64(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::SiluClamped(l) => {
            let x = x.min(l.get() as f64);
            x / (1.0 + (-x).exp())
        }
        Activation::GeluTanh => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044_715 * x * x * x)).tanh())
        }
    }
}

/// The up projection's value as the product sees it, in f64.
pub fn up_f64(act: Activation, u: f64) -> f64 {
    match act {
        Activation::SiluClamped(l) => u.clamp(-(l.get() as f64), l.get() as f64),
        _ => u,
    }
}

/// A stored `[rows, cols]` weight, dequantized by the reference kernels.
fn dequantized(w: &Tensor, rows: usize, cols: usize) -> Result<Vec<f32>, KernelError> {
    w.ensure_shape(&[rows, cols])?;
    let mut out = vec![0f32; rows * cols];
    dequantize_row_ref(w.dtype(), w.bytes(), &mut out)?;
    Ok(out)
}

/// `y = W x` in f64 for a dequantized `[rows, cols]` weight.
fn product(w: &[f32], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len().max(1))
        .map(|r| r.iter().zip(x).map(|(&a, &b)| a as f64 * b).sum())
        .collect()
}

/// [`super::moe_ffn`] as the definition reads, from the stored weights
/// (`gate[e]`, `up[e]` `[ff, hidden]`, `down[e]` `[hidden, ff]`): the f64
/// output `[n_tokens, hidden]`, with f32 activations throughout.
///
/// # Errors
/// [`KernelError::LengthMismatch`] or a shape error if the arguments
/// disagree, [`KernelError::IndexOutOfRange`] for an id of no expert.
pub fn moe_ffn_ref(
    gate: &[Tensor],
    up: &[Tensor],
    down: &[Tensor],
    act: Activation,
    x: &[f32],
    r: &Routing<'_>,
) -> Result<Vec<f64>, KernelError> {
    let Routing {
        ids,
        weights,
        n_tokens,
        top_k,
    } = *r;
    let n_experts = gate.len();
    check_len(
        "reference experts (at least one)",
        n_experts.max(1),
        n_experts,
    )?;
    check_len("reference up weights", n_experts, up.len())?;
    check_len("reference down weights", n_experts, down.len())?;
    let &[ff, h] = gate[0].shape() else {
        return Err(KernelError::NotAMatrix {
            op: "moe_ffn_ref",
            shape: gate[0].shape().to_vec(),
        });
    };
    r.check_rows("reference x", h, x.len())?;
    r.check()?;
    let mut w = Vec::new();
    for e in 0..n_experts {
        w.push([
            dequantized(&gate[e], ff, h)?,
            dequantized(&up[e], ff, h)?,
            dequantized(&down[e], h, ff)?,
        ]);
    }
    let mut out = vec![0f64; n_tokens * h];
    for (t, o) in out.chunks_exact_mut(h.max(1)).enumerate() {
        let xt: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
        for slot in 0..top_k {
            let e = ids[t * top_k + slot] as usize;
            let [wg, wu, wd] = w.get(e).ok_or(KernelError::IndexOutOfRange {
                what: "expert id",
                index: e,
                len: n_experts,
            })?;
            let g = product(wg, &xt);
            let u = product(wu, &xt);
            let a: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| activation_f64(act, g) * up_f64(act, u))
                .collect();
            let y = product(wd, &a);
            let wt = weights[t * top_k + slot] as f64;
            for (o, y) in o.iter_mut().zip(y) {
                *o += wt * y;
            }
        }
    }
    Ok(out)
}
