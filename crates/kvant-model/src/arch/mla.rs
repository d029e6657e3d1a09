//! Multi-head latent attention (DeepSeek-V2/V3, GigaChat3) with weight
//! absorption: the cache holds one latent row per token and layer (the
//! normalised compressed KV, `kv_lora_rank` values, then the rotary key,
//! `qk_rope_head_dim`), never per-head keys and values.
//!
//! Per head `h`, `kv_b` expands the latent `c` into a key part `K_h c` and a
//! value `V_h c`. Since `q_nope · K_h c = (K_hᵀ q_nope) · c`, each query is
//! mapped once into latent space (`K_hᵀ`, llama.cpp's `attn_k_b`) and
//! attends over the latent rows directly: one key/value head for all query
//! heads, whose values are the rows' first `kv_lora_rank` elements. The
//! per-head output latent is expanded by `V_h` (`attn_v_b`) afterwards.
//!
//! DeepSeek-V3.2 adds an [`Indexer`] per layer: each token then attends
//! only to the latent rows it selects (absorbed form, decode and prefill;
//! a token that sees no more rows than the top-k attends densely, which
//! is the same thing). A batch with any sparse token runs absorbed.
//!
//! Decode always runs absorbed. A prompt chunk runs in whichever form is
//! cheaper for it (`mla_expand`: expanded, a fresh prompt's attention
//! costs under a third), unless the model was loaded with
//! [`MlaPrefill::Absorbed`], which keeps every token on the absorbed path
//! so that results never depend on how batches were cut.

use super::ctx::{LayerCtx, Step};
use super::heads::PerHead;
use super::indexer::{Indexer, IndexerScratch};
use super::loader::{to_f32, transpose, Bias, Linear, Loader, Part};
use super::mla_expand::{Chunk, ExpandScratch, Expansion, MlaPrefill};
use super::sized;
use crate::checkpoint::Checkpoint;
use crate::config::{MlaConfig, ModelConfig};
use crate::kv::KvPool;
use crate::ModelError;
use kvant_core::Tensor;
use kvant_kernels::attention::{AttnParams, SeqAttn, TopK};
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{LinearInput, LinearWeight};
use kvant_kernels::norm::rms_norm_inplace;
use kvant_kernels::rope::rope_inplace;

/// The query projection: plain, or through the `q_lora_rank` bottleneck.
enum QProj {
    Plain(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

pub(crate) struct MlaAttention {
    /// This rank's heads (all of them in one process); the latent row is
    /// every head's, computed and cached on every rank.
    heads: usize,
    q: QProj,
    /// `hidden → kv_lora_rank + rope`: the latent and the rotary key.
    kv_a: Linear,
    kv_norm: Vec<f32>,
    /// Per head, `K_hᵀ`: `[kv_lora_rank, nope]`.
    k_b: PerHead,
    /// Per head, `V_h`: `[v_dim, kv_lora_rank]`.
    v_b: PerHead,
    /// Both, stacked for the expanded form (`None` when loaded with
    /// [`MlaPrefill::Absorbed`]).
    expansion: Option<Box<Expansion>>,
    /// DeepSeek sparse attention's indexer (V3.2).
    indexer: Option<Box<Indexer>>,
    o: Linear,
}

/// Activations of one MLA layer, reused across passes.
#[derive(Default)]
pub(crate) struct MlaScratch {
    qa: Vec<f32>,
    q: Vec<f32>,
    latent: Vec<f32>,
    pe: Vec<f32>,
    attn: Vec<f32>,
    absorb: AbsorbScratch,
    /// The absorbed sequences' rows when others run expanded.
    packed: Packed,
    expand: ExpandScratch,
    indexer: IndexerScratch,
}

#[derive(Default)]
struct AbsorbScratch {
    q_abs: Vec<f32>,
    out_lat: Vec<f32>,
    head_in: Vec<f32>,
    head_out: Vec<f32>,
}

#[derive(Default)]
struct Packed {
    q: Vec<f32>,
    latent: Vec<f32>,
    out: Vec<f32>,
}

/// Tokens for the absorbed form: their queries (`[n, heads, qk]`) and
/// latent rows (`[n, latent]`), and the sequences they belong to.
struct Rows<'a, 'b> {
    seqs: &'a [SeqAttn<'b>],
    q: &'a [f32],
    latent: &'a [f32],
    n: usize,
}

/// Tensor names of one layer's latent attention, by format.
struct Names {
    q: String,
    q_a: String,
    q_a_norm: String,
    q_b: String,
    kv_a: String,
    kv_a_norm: String,
    /// `kv_b` in one tensor (Hugging Face, older GGUF conversions)...
    kv_b: String,
    /// ...or split per head into `K_hᵀ` and `V_h` (llama.cpp's current
    /// conversions; Hugging Face checkpoints have no such names).
    split: Option<(String, String)>,
    o: String,
}

impl Names {
    fn new(ckpt: &Checkpoint, prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}{s}");
        match ckpt {
            Checkpoint::Gguf(_) => Names {
                q: n("attn_q"),
                q_a: n("attn_q_a"),
                q_a_norm: n("attn_q_a_norm.weight"),
                q_b: n("attn_q_b"),
                kv_a: n("attn_kv_a_mqa"),
                kv_a_norm: n("attn_kv_a_norm.weight"),
                kv_b: n("attn_kv_b.weight"),
                split: Some((n("attn_k_b.weight"), n("attn_v_b.weight"))),
                o: n("attn_output"),
            },
            Checkpoint::Hf(_) => Names {
                q: n("self_attn.q_proj"),
                q_a: n("self_attn.q_a_proj"),
                q_a_norm: n("self_attn.q_a_layernorm.weight"),
                q_b: n("self_attn.q_b_proj"),
                kv_a: n("self_attn.kv_a_proj_with_mqa"),
                kv_a_norm: n("self_attn.kv_a_layernorm.weight"),
                kv_b: n("self_attn.kv_b_proj.weight"),
                split: None,
                o: n("self_attn.o_proj"),
            },
        }
    }
}

impl MlaAttention {
    /// Loads the attention of the layer whose tensor names start with
    /// `prefix` (`blk.3.` or `model.layers.3.`).
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        m: &MlaConfig,
        prefix: &str,
        prefill: MlaPrefill,
    ) -> Result<Self, ModelError> {
        let names = Names::new(ld.ckpt, prefix);
        let (h, all) = (cfg.hidden, cfg.n_heads);
        let mine = ld.shard.mla_heads(all);
        let nh = mine.len();
        let (q_out, q_rows) = (
            all * m.qk_dim(),
            mine.start * m.qk_dim()..mine.end * m.qk_dim(),
        );
        let q = match m.q_lora_rank {
            None => QProj::Plain(ld.linear_part(
                &names.q,
                [q_out, h],
                Part::Rows(q_rows),
                Bias::IfPresent,
            )?),
            Some(r) => QProj::LowRank {
                a: ld.linear(&names.q_a, r, h, Bias::IfPresent)?,
                norm: ld.vector(&names.q_a_norm, r)?,
                b: ld.linear_part(&names.q_b, [q_out, r], Part::Rows(q_rows), Bias::IfPresent)?,
            },
        };
        let expanded = prefill == MlaPrefill::Auto;
        let split = names.split.as_ref().filter(|(k_b, _)| ld.has(k_b));
        let (k_b, v_b, expansion) = match split {
            Some((k_b, v_b)) => {
                // This rank's heads only.
                let heads = |v: Vec<Tensor>| -> Result<Vec<LinearWeight>, ModelError> {
                    v[mine.clone()]
                        .iter()
                        .map(|t| ld.prepare(t.clone()))
                        .collect()
                };
                (
                    heads(ld.stacked(k_b, all, m.kv_lora_rank, m.nope_dim)?)?,
                    heads(ld.stacked(v_b, all, m.v_dim, m.kv_lora_rank)?)?,
                    expanded
                        .then(|| {
                            Expansion::from_split(ld, (k_b, v_b), (all, mine.clone()), m)
                                .map(Box::new)
                        })
                        .transpose()?,
                )
            }
            None => {
                let per_head = (m.nope_dim + m.v_dim) * m.kv_lora_rank;
                let w = to_f32(&ld.matrix(
                    &names.kv_b,
                    all * (m.nope_dim + m.v_dim),
                    m.kv_lora_rank,
                )?)?;
                let w = &w[mine.start * per_head..mine.end * per_head];
                let (k_b, v_b) = split_kv_b(w, nh, m)?;
                let e = expanded
                    .then(|| Expansion::from_kv_b(w, nh, m).map(Box::new))
                    .transpose()?;
                (k_b, v_b, e)
            }
        };
        let o_cols = mine.start * m.v_dim..mine.end * m.v_dim;
        let indexer = match (&cfg.indexer, m.q_lora_rank) {
            (Some(ic), Some(r)) => Some(Box::new(Indexer::load(ld, cfg, ic, r, prefix)?)),
            // Configs reject an indexer without the query latent.
            _ => None,
        };
        Ok(MlaAttention {
            heads: nh,
            q,
            kv_a: ld.linear(&names.kv_a, m.latent_dim(), h, Bias::IfPresent)?,
            kv_norm: ld.vector(&names.kv_a_norm, m.kv_lora_rank)?,
            k_b: PerHead::new("attn_k_b head", k_b, [m.kv_lora_rank, m.nope_dim])?,
            v_b: PerHead::new("attn_v_b head", v_b, [m.v_dim, m.kv_lora_rank])?,
            expansion,
            indexer,
            o: ld.linear_part(
                &names.o,
                [h, all * m.v_dim],
                Part::Cols(o_cols),
                Bias::IfPresent,
            )?,
        })
    }

    /// Bytes of all weights (each read once per pass).
    pub fn byte_len(&self) -> usize {
        let q = match &self.q {
            QProj::Plain(q) => q.weight.byte_len(),
            QProj::LowRank { a, b, .. } => a.weight.byte_len() + b.weight.byte_len(),
        };
        q + self.kv_a.weight.byte_len()
            + self.o.weight.byte_len()
            + self.k_b.byte_len()
            + self.v_b.byte_len()
            + self.expansion.as_ref().map_or(0, |e| e.byte_len())
            + self.indexer.as_ref().map_or(0, |i| i.byte_len())
    }

    /// Attention of the batch's `n` tokens (normed input `xn`), storing
    /// their latent rows in layer `layer` of `pool`; the output projection
    /// goes to `out` (`[n, hidden]`).
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        m: &MlaConfig,
        inv_freq: &[f32],
        mut ctx: LayerCtx<'_, '_>,
        step: Step<'_, MlaScratch>,
    ) -> Result<(), ModelError> {
        let Step { xn, n, q8, s, out } = step;
        let nh = self.heads;
        let (qk, lat, rank, rope) = (m.qk_dim(), m.latent_dim(), m.kv_lora_rank, m.rope_dim);
        let MlaScratch {
            qa,
            q,
            latent,
            pe,
            attn,
            absorb,
            packed,
            expand,
            indexer,
        } = s;
        let q = sized(q, n * nh * qk);
        let latent = sized(latent, n * lat);
        match &self.q {
            QProj::Plain(p) => {
                let input = LinearInput::new(xn, n, q8, &[&p.weight, &self.kv_a.weight])?;
                p.forward(&input, q)?;
                self.kv_a.forward(&input, latent)?;
            }
            QProj::LowRank { a, norm, b } => {
                let qa = sized(qa, n * norm.len());
                let input = LinearInput::new(xn, n, q8, &[&a.weight, &self.kv_a.weight])?;
                a.forward(&input, qa)?;
                self.kv_a.forward(&input, latent)?;
                rms_norm_inplace(qa, norm, cfg.rms_eps);
                b.forward(&LinearInput::new(qa, n, q8, &[&b.weight])?, q)?;
            }
        }
        let factor = cfg.rope.scaling.attention_factor();
        let pe = sized(pe, nh * rope);
        for sq in ctx.seqs {
            for (i, t) in sq.rows.clone().enumerate() {
                let pos = sq.pos0 + i + ctx.rope_offset;
                let row = &mut latent[t * lat..(t + 1) * lat];
                rms_norm_inplace(&mut row[..rank], &self.kv_norm, cfg.rms_eps);
                rope_inplace(&mut row[rank..], rope, pos, inv_freq, cfg.rope.style);
                // Queries' rotary parts: gathered, rotated together, put back.
                let qt = &mut q[t * nh * qk..(t + 1) * nh * qk];
                for (p, head) in pe.chunks_exact_mut(rope).zip(qt.chunks_exact(qk)) {
                    p.copy_from_slice(&head[m.nope_dim..]);
                }
                rope_inplace(pe, rope, pos, inv_freq, cfg.rope.style);
                if factor != 1.0 {
                    pe.iter_mut().for_each(|v| *v *= factor);
                    row[rank..].iter_mut().for_each(|v| *v *= factor);
                }
                for (head, p) in qt.chunks_exact_mut(qk).zip(pe.chunks_exact(rope)) {
                    head[m.nope_dim..].copy_from_slice(p);
                }
            }
        }
        let sel = match (&self.indexer, &self.q) {
            (Some(ix), QProj::LowRank { norm, .. }) => {
                let qr = &qa[..n * norm.len()];
                ix.select(cfg, inv_freq, &mut ctx, (xn, qr), n, q8, indexer)?;
                Some(&indexer.sel).filter(|sel| sel.any_sparse())
            }
            _ => None,
        };
        let (qd, vd) = (nh * qk, nh * m.v_dim);
        let attn = sized(attn, n * vd);
        // Which sequences run expanded, asked again where needed rather
        // than partitioned into lists: this runs per layer and step.
        let expands = |sq: &&SeqAttn<'_>| {
            sel.is_none()
                && self.expansion.is_some()
                && Expansion::cheaper(m, nh, sq.rows.len(), sq.pos0)
        };
        let expanded = || ctx.seqs.iter().filter(expands);
        let absorbed = || ctx.seqs.iter().filter(|sq| !expands(sq));
        match self
            .expansion
            .as_ref()
            .filter(|_| expanded().next().is_some())
        {
            None => {
                let rows = Rows {
                    seqs: ctx.seqs,
                    q,
                    latent,
                    n,
                };
                let at = (&mut *ctx.pool, ctx.index, sel);
                self.absorbed(cfg, m, at, rows, q8, absorb, attn)?;
            }
            Some(e) => {
                for sq in expanded() {
                    ctx.pool
                        .store(ctx.index, std::slice::from_ref(sq), (latent, None));
                    let c = Chunk {
                        pool: &*ctx.pool,
                        layer: ctx.index,
                        seq: sq,
                        q: &q[sq.rows.start * qd..sq.rows.end * qd],
                        out: &mut attn[sq.rows.start * vd..sq.rows.end * vd],
                    };
                    e.attend(m, (nh, cfg.attn_scale), c, q8, expand)?;
                }
                if absorbed().next().is_some() {
                    // The other sequences' rows, packed together.
                    let mut seqs = Vec::with_capacity(absorbed().count());
                    packed.q.clear();
                    packed.latent.clear();
                    for sq in absorbed() {
                        let at = packed.latent.len() / lat;
                        packed
                            .q
                            .extend_from_slice(&q[sq.rows.start * qd..sq.rows.end * qd]);
                        packed
                            .latent
                            .extend_from_slice(&latent[sq.rows.start * lat..sq.rows.end * lat]);
                        seqs.push(SeqAttn {
                            rows: at..at + sq.rows.len(),
                            ..(*sq).clone()
                        });
                    }
                    let k = packed.latent.len() / lat;
                    let out = sized(&mut packed.out, k * vd);
                    let rows = Rows {
                        seqs: &seqs,
                        q: &packed.q,
                        latent: &packed.latent,
                        n: k,
                    };
                    let at = (&mut *ctx.pool, ctx.index, None);
                    self.absorbed(cfg, m, at, rows, q8, absorb, out)?;
                    for (sq, p) in absorbed().zip(&seqs) {
                        attn[sq.rows.start * vd..sq.rows.end * vd]
                            .copy_from_slice(&out[p.rows.start * vd..p.rows.end * vd]);
                    }
                }
            }
        }
        self.o
            .forward(&LinearInput::new(attn, n, q8, &[&self.o.weight])?, out)
    }

    /// The absorbed form for `r`'s tokens: stores their latent rows in the
    /// pool's layer and writes each head's attention output (expanded by
    /// `V_h`) to `attn` (`[n, heads, v]`); each token over the rows `sel`
    /// chose for it when given (its token indices are `r`'s rows).
    #[allow(clippy::too_many_arguments)] // one layer's step, unpacked
    fn absorbed(
        &self,
        cfg: &ModelConfig,
        m: &MlaConfig,
        (pool, layer, sel): (&mut KvPool, usize, Option<&TopK>),
        r: Rows<'_, '_>,
        q8: &mut Q8Activations,
        s: &mut AbsorbScratch,
        attn: &mut [f32],
    ) -> Result<(), ModelError> {
        // Absorb: every head's query into latent space (head-major rows
        // through the per-head matrices), then its rotary part.
        let (nh, n) = (self.heads, r.n);
        let (qk, lat, rank, rope, nope) = (
            m.qk_dim(),
            m.latent_dim(),
            m.kv_lora_rank,
            m.rope_dim,
            m.nope_dim,
        );
        let q_abs = sized(&mut s.q_abs, n * nh * lat);
        let head_in = sized(&mut s.head_in, nh * n * nope.max(rank));
        let head_out = sized(&mut s.head_out, nh * n * rank.max(m.v_dim));
        let (hin, hout) = (
            &mut head_in[..nh * n * nope],
            &mut head_out[..nh * n * rank],
        );
        for (i, dst) in hin.chunks_exact_mut(nope).enumerate() {
            let (hh, t) = (i / n, i % n);
            dst.copy_from_slice(&r.q[(t * nh + hh) * qk..][..nope]);
        }
        self.k_b.forward(hin, n, q8, hout)?;
        for (i, src) in hout.chunks_exact(rank).enumerate() {
            let (hh, t) = (i / n, i % n);
            let dst = &mut q_abs[(t * nh + hh) * lat..][..lat];
            dst[..rank].copy_from_slice(src);
            dst[rank..].copy_from_slice(&r.q[(t * nh + hh) * qk + nope..][..rope]);
        }
        let params = AttnParams {
            n_heads: nh,
            n_kv_heads: 1,
            head_dim: lat,
            v_dim: rank,
            scale: cfg.attn_scale,
            window: None,
        };
        let out_lat = sized(&mut s.out_lat, n * nh * rank);
        let kv = (r.latent, None);
        pool.store_and_attend(layer, r.seqs, kv, &params, q_abs, sel, out_lat);
        // Expand each head's output latent into its value.
        let vd = m.v_dim;
        let (hin, hout) = (&mut head_in[..nh * n * rank], &mut head_out[..nh * n * vd]);
        for (i, dst) in hin.chunks_exact_mut(rank).enumerate() {
            let (hh, t) = (i / n, i % n);
            dst.copy_from_slice(&out_lat[(t * nh + hh) * rank..][..rank]);
        }
        self.v_b.forward(hin, n, q8, hout)?;
        for (i, src) in hout.chunks_exact(vd).enumerate() {
            let (hh, t) = (i / n, i % n);
            attn[(t * nh + hh) * vd..][..vd].copy_from_slice(src);
        }
        Ok(())
    }
}

/// Splits Hugging Face's `kv_b_proj` (`w`, `[heads · (nope + v),
/// kv_lora_rank]` as f32) into each head's transposed key part
/// `[kv_lora_rank, nope]` and value part `[v, kv_lora_rank]`.
fn split_kv_b(
    w: &[f32],
    heads: usize,
    m: &MlaConfig,
) -> Result<(Vec<LinearWeight>, Vec<LinearWeight>), ModelError> {
    let (nope, v, rank) = (m.nope_dim, m.v_dim, m.kv_lora_rank);
    let mut k_b = Vec::with_capacity(heads);
    let mut v_b = Vec::with_capacity(heads);
    for head in w.chunks_exact((nope + v) * rank) {
        let (k, vv) = head.split_at(nope * rank);
        let kt = transpose(k, nope, rank);
        k_b.push(LinearWeight::prepare(
            Tensor::from_f32(vec![rank, nope], &kt)?,
            false,
        )?);
        v_b.push(LinearWeight::prepare(
            Tensor::from_f32(vec![v, rank], vv)?,
            false,
        )?);
    }
    Ok((k_b, v_b))
}
