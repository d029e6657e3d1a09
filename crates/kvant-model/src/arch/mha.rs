//! Multi-head attention with grouped KV heads (MHA, GQA, MQA): q/k/v
//! projections with optional biases (Qwen2) and per-head q/k RMSNorm
//! (Qwen3, Gemma 3), rotary embedding, paged attention, an optional output
//! gate (Qwen3-Next, Qwen3.5: `sigmoid(gate) ⊙ attention`, the gate a second
//! query-sized projection), output projection.

use super::ctx::{LayerCtx, Step};
use super::loader::{Bias, Linear, Loader, Part};
use super::sized;
use crate::checkpoint::LayerNames;
use crate::config::ModelConfig;
use crate::ModelError;
use kvant_kernels::attention::AttnParams;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};
use kvant_kernels::norm::rms_norm_inplace;
use kvant_kernels::rope::rope_rows;

pub(crate) struct MhaAttention {
    /// This rank's query and KV heads (all of them in one process).
    heads: usize,
    kv_heads: usize,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// The output gate's projection, when the model has one.
    gate: Option<Linear>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
}

/// The projections' outputs, reused across passes.
#[derive(Default)]
pub(crate) struct MhaScratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    gate: Vec<f32>,
    attn: Vec<f32>,
}

impl MhaAttention {
    pub fn load(ld: &Loader<'_>, cfg: &ModelConfig, n: &LayerNames) -> Result<Self, ModelError> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let share = ld.shard.heads(cfg.n_heads, cfg.n_kv_heads);
        let (qr, kvr) = (
            share.q.start * hd..share.q.end * hd,
            share.kv.start * hd..share.kv.end * hd,
        );
        // Biases load when present; a config that promises them must have them.
        let bias = match cfg.qkv_bias {
            true => Bias::Required,
            false => Bias::IfPresent,
        };
        let req_norm = |name: &str| -> Result<Option<Vec<f32>>, ModelError> {
            match cfg.qk_norm {
                true => ld.vector(name, cfg.head_dim).map(Some),
                false => Ok(None),
            }
        };
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        // A gated query projection stores `[q_h; gate_h]` per head: this
        // rank's heads' halves, regrouped.
        let (q, gate) = match cfg.attn_output_gate {
            false => (
                ld.linear_part(&n.q, [qd, h], Part::Rows(qr.clone()), bias)?,
                None,
            ),
            true => {
                let half = |g: usize| -> Vec<_> {
                    share
                        .q
                        .clone()
                        .map(|i| (2 * i + g) * hd..(2 * i + g + 1) * hd)
                        .collect()
                };
                let (q, gate) = (half(0), half(1));
                (
                    ld.linear_runs(&n.q, [2 * qd, h], &q, bias)?,
                    Some(ld.linear_runs(&n.q, [2 * qd, h], &gate, bias)?),
                )
            }
        };
        Ok(MhaAttention {
            heads: share.q.len(),
            kv_heads: share.kv.len(),
            q,
            gate,
            k: ld.linear_part(&n.k, [kvd, h], Part::Rows(kvr.clone()), bias)?,
            v: ld.linear_part(&n.v, [kvd, h], Part::Rows(kvr), bias)?,
            o: Linear {
                weight: ld.weight_part(&format!("{}.weight", n.o), [h, qd], Part::Cols(qr))?,
                bias: None,
            },
            q_norm: req_norm(&n.q_norm)?,
            k_norm: req_norm(&n.k_norm)?,
        })
    }

    pub fn weights(&self) -> Vec<&LinearWeight> {
        let mut w = vec![
            &self.q.weight,
            &self.k.weight,
            &self.v.weight,
            &self.o.weight,
        ];
        w.extend(self.gate.as_ref().map(|g| &g.weight));
        w
    }

    /// KV heads this rank caches.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Attention of the batch's `n` tokens (normed input `xn`), storing
    /// their keys and values in layer `layer` of `pool`; the output
    /// projection goes to `out` (`[n, hidden]`): under tensor parallelism,
    /// this rank's heads' share of it, which the layer sums over the ranks.
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        (inv_freq, window): (&[f32], Option<usize>),
        ctx: LayerCtx<'_, '_>,
        step: Step<'_, MhaScratch>,
    ) -> Result<(), ModelError> {
        let Step { xn, n, q8, s, out } = step;
        let (qd, kvd) = (self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim);
        let q = sized(&mut s.q, n * qd);
        let k = sized(&mut s.k, n * kvd);
        let v = sized(&mut s.v, n * kvd);
        let gate = sized(&mut s.gate, self.gate.as_ref().map_or(0, |_| n * qd));
        // Arrays, not `Vec`s: this runs per layer and step (the arena).
        let gate_w = self.gate.as_ref().map(|g| &g.weight);
        let m = 3 + usize::from(gate_w.is_some());
        let ws = [
            &self.q.weight,
            &self.k.weight,
            &self.v.weight,
            // Without a gate, a placeholder past `m`.
            gate_w.unwrap_or(&self.q.weight),
        ];
        let input = LinearInput::new(xn, n, q8, &ws[..m])?;
        let mut outs = [
            (ws[0], &mut *q),
            (ws[1], &mut *k),
            (ws[2], &mut *v),
            (ws[3], &mut *gate),
        ];
        forward_batch(&input, &mut outs[..m])?;
        if let Some(g) = &self.gate {
            g.add_bias(gate);
        }
        self.q.add_bias(q);
        self.k.add_bias(k);
        self.v.add_bias(v);
        if let Some(w) = &self.q_norm {
            rms_norm_inplace(q, w, cfg.rms_eps);
        }
        if let Some(w) = &self.k_norm {
            rms_norm_inplace(k, w, cfg.rms_eps);
        }
        let factor = cfg.rope.scaling.attention_factor();
        for sq in ctx.seqs {
            let r = &sq.rows;
            let (qs, ks) = (
                &mut q[r.start * qd..r.end * qd],
                &mut k[r.start * kvd..r.end * kvd],
            );
            let pos0 = sq.pos0 + ctx.rope_offset;
            rope_rows(
                (&mut *qs, &mut *ks),
                r.len(),
                cfg.head_dim,
                pos0,
                inv_freq,
                cfg.rope.style,
            );
            if factor != 1.0 {
                scale_rotated(qs, cfg.head_dim, cfg.rope.dim, factor);
                scale_rotated(ks, cfg.head_dim, cfg.rope.dim, factor);
            }
        }
        let params = AttnParams {
            n_heads: self.heads,
            n_kv_heads: self.kv_heads,
            head_dim: cfg.head_dim,
            v_dim: cfg.head_dim,
            scale: cfg.attn_scale,
            window,
        };
        let attn = sized(&mut s.attn, n * qd);
        ctx.pool
            .store_and_attend(ctx.index, ctx.seqs, (k, Some(v)), &params, q, None, attn);
        if self.gate.is_some() {
            for (a, &g) in attn.iter_mut().zip(gate.iter()) {
                *a *= 1.0 / (1.0 + (-g).exp());
            }
        }
        self.o
            .forward(&LinearInput::new(attn, n, q8, &[&self.o.weight])?, out)
    }
}

/// YaRN's attention factor on the rotated part of each head (transformers
/// multiplies cos and sin by it).
fn scale_rotated(x: &mut [f32], head_dim: usize, rot: usize, factor: f32) {
    for head in x.chunks_exact_mut(head_dim) {
        head[..rot].iter_mut().for_each(|v| *v *= factor);
    }
}
