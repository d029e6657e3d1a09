//! Gated DeltaNet and Kimi Delta Attention: the linear-attention layers of
//! Qwen3-Next / Qwen3.5 and of Kimi Linear, an attention component beside
//! multi-head and latent attention.
//!
//! Per token: projections to `q`, `k`, `v` (the convolution's channels),
//! the output gate `z`, and per value head `b` and `a`; a causal depthwise
//! convolution of `[q, k, v]` over the last few tokens (SiLU); q and k
//! L2-normalised per head, q scaled by `1/√dk`; the gated delta rule with
//! `β = sigmoid(b)` and log decay `g = −exp(A_log) · softplus(a + dt_bias)`
//! (`kvant_kernels::delta`); a gated RMSNorm per value head
//! (`rms_norm(o) · w · silu(z)`) and the output projection.
//!
//! Kimi Delta Attention differs only in its gates: `q`, `k`, `v` come from
//! three projections (each with its conv: one depthwise conv over the
//! three), the decay is per key channel, `g = −exp(A_log[h]) ·
//! softplus(f_b(f_a(x)) + dt_bias)` through a low-rank pair, β =
//! sigmoid(b_proj(x)), and the output gate is another low-rank pair behind
//! a sigmoid (`rms_norm(o) · w · sigmoid(g_b(g_a(x)))`). The delta rule is
//! the same kernel with `channel_decay`.
//!
//! What a sequence carries between forward passes is fixed in size: the
//! convolution's last `K − 1` inputs and the delta rule's state, in the
//! pool's state slot of the sequence (`KvPool::states_mut`).

use super::ctx::{StateCtx, Step};
use super::loader::{check_shape, Loader};
use super::sized;
use crate::checkpoint::Checkpoint;
use crate::config::{LinearConfig, LinearLayout, ModelConfig};
use crate::ModelError;
use kvant_kernels::delta::{causal_conv1d, delta_rule, DeltaInputs, DeltaParams, DeltaSeq};
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};
use std::ops::Range;

/// Tokens per chunk of the delta rule's chunk-aligned form: its cost per
/// token is `3·dk·dv + 2·c·(dk + dv)` at position `c` of a chunk against
/// `4·dk·dv` for the token-by-token recurrence, so short chunks are
/// cheaper on a CPU (no parallelism across a chunk is needed here), and
/// 16 is a block of the paged cache: a prefix that ends on a block ends on
/// a chunk, where the state is one matrix per head.
pub const DELTA_CHUNK: usize = 16;

/// The L2 norm's epsilon (transformers' and FLA's `l2norm`).
const L2_EPS: f32 = 1e-6;

pub(crate) struct GatedDeltaNet {
    p: DeltaParams,
    kernel: usize,
    proj: Projections,
    /// `[conv_dim, K]`.
    conv: Vec<f32>,
    /// `−exp(A_log)` per value head.
    neg_a: Vec<f32>,
    /// Added to the decay's input: per value head (Gated DeltaNet) or per
    /// key channel of each head (KDA).
    dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight, `[dv]` (a plain weight: no `1 + w`).
    norm: Vec<f32>,
    out: LinearWeight,
}

/// The input projections, by layer kind.
// One per layer, inside the boxed layer: the size difference costs nothing.
#[allow(clippy::large_enum_variant)]
enum Projections {
    /// Gated DeltaNet: `[q; k; v]` (every head of each) in one weight,
    /// then the output gate `z`, `b` and the decay input `a`.
    Gdn {
        qkv: LinearWeight,
        z: LinearWeight,
        b: LinearWeight,
        a: LinearWeight,
    },
    /// Kimi Delta Attention: `q`, `k`, `v`, `b`, and the low-rank pairs of
    /// the forget gate (`f_a`, `f_b`) and of the output gate (`g_a`, `g_b`).
    Kda {
        q: LinearWeight,
        k: LinearWeight,
        v: LinearWeight,
        b: LinearWeight,
        f: [LinearWeight; 2],
        g: [LinearWeight; 2],
    },
}

/// A linear layer's activations, reused across passes.
#[derive(Default)]
pub(crate) struct GdnScratch {
    qkv: Vec<f32>,
    /// KDA's q, k, v before they are laid out as `[q, k, v]` rows, and its
    /// low-rank gates' inner activations.
    parts: [Vec<f32>; 3],
    low: [Vec<f32>; 2],
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
    mixed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    core: Vec<f32>,
    seqs: Vec<DeltaSeq>,
}

impl GatedDeltaNet {
    /// The delta rule's shape for `lc`.
    pub fn params(lc: &LinearConfig) -> DeltaParams {
        DeltaParams {
            n_k_heads: lc.n_k_heads,
            n_v_heads: lc.n_v_heads,
            dk: lc.k_dim,
            dv: lc.v_dim,
            chunk: DELTA_CHUNK,
            channel_decay: lc.layout == LinearLayout::Kda,
            sharing: lc.sharing,
        }
    }

    /// Loads the layer whose tensors start with `prefix`: Hugging Face
    /// names (`{prefix}linear_attn.…`) or llama.cpp's (`{prefix}ssm_…`,
    /// with `attn_qkv` / `attn_gate` split out of Qwen3-Next's `in_proj_qkvz`,
    /// `−exp(A_log)` stored as `ssm_a` and the conv kernel squeezed).
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        lc: &LinearConfig,
        prefix: &str,
    ) -> Result<Self, ModelError> {
        if lc.layout == LinearLayout::Kda {
            return Self::load_kda(ld, cfg, lc, prefix);
        }
        let h = cfg.hidden;
        let (nk, nv, dk, dv) = (lc.n_k_heads, lc.n_v_heads, lc.k_dim, lc.v_dim);
        let r = nv / nk;
        let gguf = matches!(ld.ckpt, Checkpoint::Gguf(_));
        let n = |hf: &str, gg: &str| match gguf {
            true => format!("{prefix}{gg}"),
            false => format!("{prefix}linear_attn.{hf}"),
        };
        // Per key head g: [b_g (r), a_g (r)] (Qwen3-Next's `in_proj_ba`).
        let grouped_ba = |name: &str| -> Result<(LinearWeight, LinearWeight), ModelError> {
            let ba = ld.matrix(name, 2 * nv, h)?;
            let part = |off: usize| -> Vec<Range<usize>> {
                (0..nk)
                    .map(|g| 2 * r * g + off..2 * r * g + off + r)
                    .collect()
            };
            Ok((
                LinearWeight::prepare(ba.rows_of(&part(0))?, false)?,
                LinearWeight::prepare(ba.rows_of(&part(r))?, false)?,
            ))
        };
        let split_qkvz = || -> Result<(LinearWeight, LinearWeight), ModelError> {
            Ok((
                ld.weight(
                    &n("in_proj_qkv.weight", "attn_qkv.weight"),
                    lc.conv_dim(),
                    h,
                )?,
                ld.weight(&n("in_proj_z.weight", "attn_gate.weight"), nv * dv, h)?,
            ))
        };
        let (qkv, z, b, a) = match (lc.layout, gguf) {
            (LinearLayout::Split, _) => {
                let (qkv, z) = split_qkvz()?;
                (
                    qkv,
                    z,
                    ld.exact_weight(&n("in_proj_b.weight", "ssm_beta.weight"), nv, h)?,
                    ld.exact_weight(&n("in_proj_a.weight", "ssm_alpha.weight"), nv, h)?,
                )
            }
            (LinearLayout::Grouped, true) => {
                let (qkv, z) = split_qkvz()?;
                let (b, a) = grouped_ba(&n("", "ssm_ba.weight"))?;
                (qkv, z, b, a)
            }
            (LinearLayout::Kda, _) => unreachable!("KDA layers load in load_kda"),
            (LinearLayout::Grouped, false) => {
                // Per key head g: [q_g (dk), k_g (dk), v_g (r·dv), z_g (r·dv)].
                let group = 2 * dk + 2 * r * dv;
                let part = |off: usize, len: usize| -> Vec<Range<usize>> {
                    (0..nk)
                        .map(|g| g * group + off..g * group + off + len)
                        .collect()
                };
                let qkv_runs: Vec<Range<usize>> = [part(0, dk), part(dk, dk), part(2 * dk, r * dv)]
                    .into_iter()
                    .flatten()
                    .collect();
                let qkvz = ld.matrix(&n("in_proj_qkvz.weight", ""), nk * group, h)?;
                let (b, a) = grouped_ba(&n("in_proj_ba.weight", ""))?;
                (
                    ld.prepare(qkvz.rows_of(&qkv_runs)?)?,
                    ld.prepare(qkvz.rows_of(&part(2 * dk + r * dv, r * dv))?)?,
                    b,
                    a,
                )
            }
        };
        let conv_name = n("conv1d.weight", "ssm_conv1d.weight");
        let conv_t = ld.tensor(&conv_name)?;
        let conv_shape: &[usize] = match gguf {
            true => &[lc.conv_dim(), lc.conv_kernel],
            false => &[lc.conv_dim(), 1, lc.conv_kernel],
        };
        check_shape(&conv_t, &conv_name, conv_shape)?;
        let conv = super::loader::to_f32(&conv_t)?;
        let a_name = n("A_log", "ssm_a");
        let neg_a = decay_rates(ld.raw_vector(&a_name, nv)?, gguf, &a_name)?;
        Ok(GatedDeltaNet {
            p: Self::params(lc),
            kernel: lc.conv_kernel,
            proj: Projections::Gdn { qkv, z, b, a },
            conv,
            neg_a,
            dt_bias: ld.raw_vector(&n("dt_bias", "ssm_dt.bias"), nv)?,
            norm: ld.raw_vector(&n("norm.weight", "ssm_norm.weight"), dv)?,
            out: ld.weight(&n("out_proj.weight", "ssm_out.weight"), h, nv * dv)?,
        })
    }

    /// A Kimi Delta Attention layer: Hugging Face names
    /// (`{prefix}self_attn.…`) or llama.cpp's (`attn_q`, `ssm_conv1d_q`,
    /// `ssm_f_a`, …; `ssm_a` holds `−exp(A_log)`).
    fn load_kda(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        lc: &LinearConfig,
        prefix: &str,
    ) -> Result<Self, ModelError> {
        let (h, nh, d) = (cfg.hidden, lc.n_v_heads, lc.k_dim);
        let gguf = matches!(ld.ckpt, Checkpoint::Gguf(_));
        let n = |hf: &str, gg: &str| match gguf {
            true => format!("{prefix}{gg}"),
            false => format!("{prefix}self_attn.{hf}"),
        };
        let w = |hf: &str, gg: &str, rows: usize, cols: usize| ld.weight(&n(hf, gg), rows, cols);
        // The gates' projections stay on f32 activations, as Gated
        // DeltaNet's `b` and `a` do: they feed exponentials.
        let exact =
            |hf: &str, gg: &str, rows: usize, cols: usize| ld.exact_weight(&n(hf, gg), rows, cols);
        let mut conv = Vec::with_capacity(3 * nh * d * lc.conv_kernel);
        for (hf, gg) in [
            ("q_conv1d.weight", "ssm_conv1d_q.weight"),
            ("k_conv1d.weight", "ssm_conv1d_k.weight"),
            ("v_conv1d.weight", "ssm_conv1d_v.weight"),
        ] {
            let name = n(hf, gg);
            let t = ld.tensor(&name)?;
            let shape: &[usize] = match gguf {
                true => &[1, nh * d, 1, lc.conv_kernel],
                false => &[nh * d, 1, lc.conv_kernel],
            };
            check_shape(&t, &name, shape)?;
            conv.extend(super::loader::to_f32(&t)?);
        }
        let a_name = n("A_log", "ssm_a");
        let a = ld.tensor(&a_name)?;
        check_shape(&a, &a_name, &[1, 1, nh, 1])?;
        let neg_a = decay_rates(super::loader::to_f32(&a)?, gguf, &a_name)?;
        Ok(GatedDeltaNet {
            p: Self::params(lc),
            kernel: lc.conv_kernel,
            proj: Projections::Kda {
                q: w("q_proj.weight", "attn_q.weight", nh * d, h)?,
                k: w("k_proj.weight", "attn_k.weight", nh * d, h)?,
                v: w("v_proj.weight", "attn_v.weight", nh * d, h)?,
                b: exact("b_proj.weight", "ssm_beta.weight", nh, h)?,
                f: [
                    exact("f_a_proj.weight", "ssm_f_a.weight", d, h)?,
                    exact("f_b_proj.weight", "ssm_f_b.weight", nh * d, d)?,
                ],
                g: [
                    w("g_a_proj.weight", "ssm_g_a.weight", d, h)?,
                    w("g_b_proj.weight", "ssm_g_b.weight", nh * d, d)?,
                ],
            },
            conv,
            neg_a,
            dt_bias: ld.raw_vector(&n("dt_bias", "ssm_dt.bias"), nh * d)?,
            norm: ld.raw_vector(&n("o_norm.weight", "ssm_norm.weight"), d)?,
            out: w("o_proj.weight", "attn_output.weight", h, nh * d)?,
        })
    }

    /// Bytes of the layer's weights (all of them are read per token).
    pub fn byte_len(&self) -> usize {
        let ws: Vec<&LinearWeight> = match &self.proj {
            Projections::Gdn { qkv, z, b, a } => vec![qkv, z, b, a],
            Projections::Kda { q, k, v, b, f, g } => vec![q, k, v, b, &f[0], &f[1], &g[0], &g[1]],
        };
        ws.iter().map(|w| w.byte_len()).sum::<usize>()
            + self.out.byte_len()
            + 4 * (self.conv.len() + self.neg_a.len() + self.dt_bias.len() + self.norm.len())
    }

    /// The layer's output (`[n, hidden]` into `out`) for the batch's `n`
    /// tokens (normed input `xn`), advancing each sequence's state.
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        ctx: StateCtx<'_, '_>,
        step: Step<'_, GdnScratch>,
    ) -> Result<(), ModelError> {
        let Step { xn, n, q8, s, out } = step;
        let p = &self.p;
        let (nk, nv, dk, dv) = (p.n_k_heads, p.n_v_heads, p.dk, p.dv);
        let conv_dim = 2 * nk * dk + nv * dv;
        let gd = p.g_dim();
        self.project(xn, n, q8, s)?;
        let qkv = &s.qkv[..n * conv_dim];
        let z = &s.z[..n * nv * dv];
        let b = &mut s.b[..n * nv];
        let a = &s.a[..n * nv * gd];
        // The convolution, each sequence from its own tail.
        let mixed = sized(&mut s.mixed, n * conv_dim);
        let (tails, states) = ctx.pool.states_mut(ctx.index)?;
        let tail_len = (self.kernel - 1) * conv_dim;
        for (sq, &slot) in ctx.seqs.iter().zip(ctx.slots) {
            let tail = tails
                .get_mut(slot * tail_len..(slot + 1) * tail_len)
                .ok_or(ModelError::StateSlot { slot })?;
            if sq.pos0 == 0 {
                tail.fill(0.0);
            }
            let rows = sq.rows.start * conv_dim..sq.rows.end * conv_dim;
            causal_conv1d(
                &qkv[rows.clone()],
                &self.conv,
                self.kernel,
                tail,
                true,
                &mut mixed[rows],
            )?;
        }
        // Queries and keys normalised per head, queries scaled.
        let (q, k, v) = (
            sized(&mut s.q, n * nk * dk),
            sized(&mut s.k, n * nk * dk),
            sized(&mut s.v, n * nv * dv),
        );
        let scale = (dk as f32).sqrt().recip();
        for t in 0..n {
            let row = &mixed[t * conv_dim..(t + 1) * conv_dim];
            let (qs, rest) = row.split_at(nk * dk);
            let (ks, vs) = rest.split_at(nk * dk);
            l2_norm_heads(qs, dk, scale, &mut q[t * nk * dk..(t + 1) * nk * dk]);
            l2_norm_heads(ks, dk, 1.0, &mut k[t * nk * dk..(t + 1) * nk * dk]);
            v[t * nv * dv..(t + 1) * nv * dv].copy_from_slice(vs);
        }
        // β and the log decay per token and value head.
        let g = sized(&mut s.g, n * nv * gd);
        for (i, g) in g.iter_mut().enumerate() {
            // `dt_bias` has one value per head (gd = 1) or per head and channel.
            let c = i % (nv * gd);
            *g = self.neg_a[c / gd] * softplus(a[i] + self.dt_bias[c]);
        }
        for b in b.iter_mut() {
            *b = 1.0 / (1.0 + (-*b).exp());
        }
        let core = sized(&mut s.core, n * nv * dv);
        s.seqs.clear();
        s.seqs
            .extend(ctx.seqs.iter().zip(ctx.slots).map(|(sq, &slot)| DeltaSeq {
                rows: sq.rows.clone(),
                pos0: sq.pos0,
                slot,
            }));
        let x = DeltaInputs {
            q,
            k,
            v,
            beta: b,
            g,
        };
        delta_rule(p, x, &s.seqs, states, core)?;
        // The gated norm per value head, then the output projection.
        self.gated_norm(core, z, cfg.rms_eps);
        self.out
            .forward(&LinearInput::new(core, n, q8, &[&self.out])?, out)?;
        Ok(())
    }

    /// The input projections of `n` tokens: `[q, k, v]` rows (the
    /// convolution's channels) into `s.qkv`, the output gate into `s.z`,
    /// `b` into `s.b` and the decay's input into `s.a`.
    fn project(
        &self,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut GdnScratch,
    ) -> Result<(), ModelError> {
        let p = &self.p;
        let (nk, nv, dk, dv) = (p.n_k_heads, p.n_v_heads, p.dk, p.dv);
        let conv_dim = 2 * nk * dk + nv * dv;
        let gd = p.g_dim();
        let qkv = sized(&mut s.qkv, n * conv_dim);
        let z = sized(&mut s.z, n * nv * dv);
        let b = sized(&mut s.b, n * nv);
        // The decay's input: per value head, or per key channel (KDA).
        let a = sized(&mut s.a, n * nv * gd);
        match &self.proj {
            Projections::Gdn {
                qkv: wqkv,
                z: wz,
                b: wb,
                a: wa,
            } => {
                let input = LinearInput::new(xn, n, q8, &[wqkv, wz, wb, wa])?;
                forward_batch(
                    &input,
                    &mut [
                        (wqkv, &mut *qkv),
                        (wz, &mut *z),
                        (wb, &mut *b),
                        (wa, &mut *a),
                    ],
                )?;
            }
            Projections::Kda {
                q,
                k,
                v,
                b: wb,
                f,
                g,
            } => {
                let d = nv * dv;
                let [pq, pk, pv] = &mut s.parts;
                let (pq, pk, pv) = (sized(pq, n * d), sized(pk, n * d), sized(pv, n * d));
                let [fl, gl] = &mut s.low;
                let (fl, gl) = (sized(fl, n * dk), sized(gl, n * dk));
                let input = LinearInput::new(xn, n, q8, &[q, k, v, wb, &f[0], &g[0]])?;
                forward_batch(
                    &input,
                    &mut [
                        (q, &mut *pq),
                        (k, &mut *pk),
                        (v, &mut *pv),
                        (wb, &mut *b),
                        (&f[0], &mut *fl),
                        (&g[0], &mut *gl),
                    ],
                )?;
                f[1].forward(&LinearInput::new(fl, n, q8, &[&f[1]])?, a)?;
                g[1].forward(&LinearInput::new(gl, n, q8, &[&g[1]])?, z)?;
                for (t, row) in qkv.chunks_exact_mut(conv_dim).enumerate() {
                    let src = t * d..(t + 1) * d;
                    row[..d].copy_from_slice(&pq[src.clone()]);
                    row[d..2 * d].copy_from_slice(&pk[src.clone()]);
                    row[2 * d..].copy_from_slice(&pv[src]);
                }
            }
        }
        Ok(())
    }

    /// The gated RMSNorm per value head of the delta rule's output `core`,
    /// in place: `rms_norm(o) · w · silu(z)` (Gated DeltaNet) or
    /// `rms_norm(o) · w · sigmoid(z)` (KDA, whose `z` is its output gate).
    fn gated_norm(&self, core: &mut [f32], z: &[f32], eps: f32) {
        let dv = self.p.dv;
        for (o, zh) in core.chunks_exact_mut(dv).zip(z.chunks_exact(dv)) {
            let ms = o.iter().map(|v| v * v).sum::<f32>() / dv as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            match self.proj {
                Projections::Gdn { .. } => {
                    for ((o, &w), &zv) in o.iter_mut().zip(&self.norm).zip(zh) {
                        *o = *o * inv * w * (zv / (1.0 + (-zv).exp()));
                    }
                }
                Projections::Kda { .. } => {
                    for ((o, &w), &zv) in o.iter_mut().zip(&self.norm).zip(zh) {
                        *o = *o * inv * w / (1.0 + (-zv).exp());
                    }
                }
            }
        }
    }
}

/// `−exp(A_log)` per head from tensor `name`'s values: `A_log` in Hugging
/// Face files, already negated and exponentiated in llama.cpp's
/// (`negated`). Each must be a finite rate of forgetting (≤ 0), or every
/// state would blow up.
fn decay_rates(values: Vec<f32>, negated: bool, name: &str) -> Result<Vec<f32>, ModelError> {
    let neg_a = match negated {
        true => values,
        false => values.iter().map(|x| -x.exp()).collect(),
    };
    match neg_a.iter().find(|a| !(a.is_finite() && **a <= 0.0)) {
        Some(bad) => Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("a decay rate of {bad} (−exp(A_log) must be finite and ≤ 0)"),
        }),
        None => Ok(neg_a),
    }
}

/// `log(1 + e^x)`, linear above 20 as PyTorch's `softplus`.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Each `d`-sized head of `x` divided by its L2 norm (`x · rsqrt(Σx² +
/// ε)`), times `scale`, into `out`.
fn l2_norm_heads(x: &[f32], d: usize, scale: f32, out: &mut [f32]) {
    for (xh, oh) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = scale / (xh.iter().map(|v| v * v).sum::<f32>() + L2_EPS).sqrt();
        for (o, &v) in oh.iter_mut().zip(xh) {
            *o = v * inv;
        }
    }
}
