//! DeepSeek-V4's attention: an attention component beside multi-head,
//! latent and linear attention. Per layer, one of three kinds
//! ([`V4Attention`]): a sliding window alone, the window plus compressed
//! sparse attention (CSA: entries of 4 tokens from overlapping windows,
//! the lightning indexer's top-k of them per query), or the window plus
//! heavily compressed attention (HCA: entries of 128 tokens, all visible).
//!
//! As transformers' `DeepseekV4Attention` computes it:
//! - queries through a low-rank pair (`wq_a`, normed, `wq_b`), then a
//!   weightless RMSNorm per head; one K = V row per token (`wkv`, normed);
//!   both rotated on the last `rope_dim` values of each head (interleaved
//!   pairs; the `main` rotation on sliding-only layers, `compress` on the
//!   others);
//! - each query attends over the window's rows (its own and the
//!   `window − 1` before it) and the compressed entries it may see (entry
//!   `w` once its window has closed, `w < (pos + 1) / rate`), with a
//!   learned sink logit per head ([`sink_attention`]), scale `dim^-½`;
//! - the output's rope part is rotated back by its position, then the
//!   grouped low-rank projection: `o_groups` groups of heads, each through
//!   its own block of `wo_a`, then `wo_b`.
//!
//! A sequence's state slot holds the window's rows (a ring indexed by
//! position) and each compressor's tail ([`Compressor`]); the pool's
//! paged rows hold the compressed entries and the indexer's keys, one per
//! closed window, in the block of the window's last token.

use super::compressor::{rotate_tail, Compressor};
use super::ctx::{StateCtx, Step};
use super::lightning::{Lightning, LightningScratch, Queries};
use super::loader::{Loader, Part};
use super::sized;
use crate::checkpoint::Checkpoint;
use crate::config::{ModelConfig, V4Attention, V4Config};
use crate::kv::Entries;
use crate::ModelError;
use kvant_kernels::attention::{sink_attention, SeqAttn, SinkAttn, SinkRows};
use kvant_kernels::cpu;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};
use kvant_kernels::norm::rms_norm_inplace;
use std::cell::RefCell;

thread_local! {
    /// One pool task's scores of a query's heads over its rows.
    static TASK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Head groups per query for `n` queries: one group (every head reads a
/// row at once) when the queries alone fill the pool, else enough groups
/// (a divisor of `heads`) to give each thread a few items.
fn head_groups(heads: usize, n: usize) -> usize {
    let threads = kvant_kernels::pool::global().threads();
    let want = (2 * threads).div_ceil(n.max(1));
    (1..=heads)
        .find(|&g| heads.is_multiple_of(g) && g >= want)
        .unwrap_or(heads)
}

/// Tensor names of one layer's attention: DeepSeek's (Hugging Face
/// checkpoints, as published and as transformers saves them) or
/// llama.cpp's (`deepseek4` GGUF).
struct Names {
    q_a: String,
    q_norm: String,
    q_b: String,
    kv: String,
    kv_norm: String,
    o_a: String,
    o_b: String,
    sinks: String,
    /// `[kv, gate, ape, norm]` of the attention's and the indexer's
    /// compressors.
    compressor: [String; 4],
    index_compressor: [String; 4],
    index_q_b: String,
    index_weights: String,
}

impl Names {
    fn new(ckpt: &Checkpoint, prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}{s}");
        match ckpt {
            Checkpoint::Gguf(_) => Names {
                q_a: n("attn_q_a.weight"),
                q_norm: n("attn_q_a_norm.weight"),
                q_b: n("attn_q_b.weight"),
                kv: n("attn_kv.weight"),
                kv_norm: n("attn_kv_a_norm.weight"),
                o_a: n("attn_output_a.weight"),
                o_b: n("attn_output_b.weight"),
                sinks: n("attn_sinks.weight"),
                compressor: ["kv", "gate", "ape", "norm"]
                    .map(|s| n(&format!("attn_compressor_{s}.weight"))),
                index_compressor: ["kv", "gate", "ape", "norm"]
                    .map(|s| n(&format!("indexer_compressor_{s}.weight"))),
                index_q_b: n("indexer.attn_q_b.weight"),
                index_weights: n("indexer.proj.weight"),
            },
            Checkpoint::Hf(_) => Names {
                q_a: n("attn.wq_a.weight"),
                q_norm: n("attn.q_norm.weight"),
                q_b: n("attn.wq_b.weight"),
                kv: n("attn.wkv.weight"),
                // Published as `kv_norm`; transformers saves `norm`.
                kv_norm: match ckpt.has_tensor(&n("attn.kv_norm.weight")) {
                    true => n("attn.kv_norm.weight"),
                    false => n("attn.norm.weight"),
                },
                o_a: n("attn.wo_a.weight"),
                o_b: n("attn.wo_b.weight"),
                sinks: n("attn.attn_sink"),
                compressor: ["wkv.weight", "wgate.weight", "ape", "norm.weight"]
                    .map(|s| n(&format!("attn.compressor.{s}"))),
                index_compressor: ["wkv.weight", "wgate.weight", "ape", "norm.weight"]
                    .map(|s| n(&format!("attn.indexer.compressor.{s}"))),
                index_q_b: n("attn.indexer.wq_b.weight"),
                index_weights: n("attn.indexer.weights_proj.weight"),
            },
        }
    }
}

pub(crate) struct CompressedAttention {
    heads: usize,
    dim: usize,
    window: usize,
    eps: f32,
    q_a: LinearWeight,
    q_norm: Vec<f32>,
    q_b: LinearWeight,
    kv: LinearWeight,
    kv_norm: Vec<f32>,
    /// `wo_a`'s block per group of heads, `[o_lora_rank, heads·dim/groups]`.
    o_a: Vec<LinearWeight>,
    o_b: LinearWeight,
    sinks: Vec<f32>,
    /// The weightless per-head query norm's weight.
    ones: Vec<f32>,
    /// This layer's rotation, and the compressed one (entries, indexer).
    inv_freq: Vec<f32>,
    compress_freq: Vec<f32>,
    compressor: Option<Compressor>,
    indexer: Option<Box<Lightning>>,
    /// The layer's index among the compressing layers (its paged rows).
    cache: usize,
    /// Values of a sequence's state for this layer ([`V4Config::state_len`]:
    /// the ring, then the compressor's tail, then the indexer's).
    state_len: usize,
}

/// Activations of one layer, reused across passes.
#[derive(Default)]
pub(crate) struct CsaScratch {
    qa: Vec<f32>,
    q: Vec<f32>,
    kv: Vec<f32>,
    ckv: Vec<f32>,
    cgate: Vec<f32>,
    ikv: Vec<f32>,
    igate: Vec<f32>,
    iq: Vec<f32>,
    iw: Vec<f32>,
    attn: Vec<f32>,
    group_in: Vec<f32>,
    group_out: Vec<f32>,
    part: Vec<f32>,
    /// One sequence's compressed entries and indexer keys, widened.
    entries: Vec<f32>,
    /// The indexer's keys, scores and choices; which entries any query
    /// reads.
    lightning: LightningScratch,
    needed: Vec<bool>,
    pool_weights: Vec<f32>,
    entry: Vec<f32>,
}

impl CompressedAttention {
    /// Loads layer `layer` (tensors under `prefix`, DeepSeek's names or
    /// llama.cpp's).
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        v4: &V4Config,
        (layer, prefix): (usize, &str),
    ) -> Result<Self, ModelError> {
        let (h, heads, dim) = (cfg.hidden, cfg.n_heads, cfg.head_dim);
        let kind = v4.kind(layer);
        let n = Names::new(ld.ckpt, prefix);
        let (groups, rank) = (v4.o_groups, v4.o_lora_rank);
        if !heads.is_multiple_of(groups) {
            return Err(crate::config::ConfigError::Invalid {
                key: "o_groups".into(),
                why: format!("{groups} groups do not divide {heads} heads"),
            }
            .into());
        }
        let per_group = heads * dim / groups;
        let o_a = (0..groups)
            .map(|g| {
                let rows = Part::Rows(g * rank..(g + 1) * rank);
                ld.weight_part(&n.o_a, [groups * rank, per_group], rows)
            })
            .collect::<Result<_, _>>()?;
        let rate = v4.rate(layer);
        let compressor = match kind {
            V4Attention::Sliding => None,
            _ => Some(Compressor::load(
                ld,
                n.compressor.each_ref().map(String::as_str),
                (rate, dim, kind == V4Attention::Csa),
                h,
            )?),
        };
        let indexer = match kind {
            V4Attention::Csa => {
                let names = n.index_compressor.each_ref().map(String::as_str);
                let sizes = (rate, v4.q_lora_rank, h);
                let tensors = (names, n.index_q_b.as_str(), n.index_weights.as_str());
                Some(Box::new(Lightning::load(ld, tensors, sizes, v4.indexer)?))
            }
            _ => None,
        };
        let cache = (0..layer).filter(|&j| v4.rate(j) > 0).count();
        Ok(CompressedAttention {
            heads,
            dim,
            window: v4.window,
            eps: cfg.rms_eps,
            q_a: ld.weight(&n.q_a, v4.q_lora_rank, h)?,
            q_norm: ld.vector(&n.q_norm, v4.q_lora_rank)?,
            q_b: ld.weight(&n.q_b, heads * dim, v4.q_lora_rank)?,
            kv: ld.weight(&n.kv, dim, h)?,
            kv_norm: ld.vector(&n.kv_norm, dim)?,
            o_a,
            o_b: ld.weight(&n.o_b, h, groups * rank)?,
            sinks: ld.raw_vector(&n.sinks, heads)?,
            ones: vec![1.0; dim],
            inv_freq: v4.inv_freq(layer),
            compress_freq: v4.compress_inv_freq(),
            compressor,
            indexer,
            cache,
            state_len: v4.state_len(layer, dim),
        })
    }

    pub fn byte_len(&self) -> usize {
        let ws = [&self.q_a, &self.q_b, &self.kv, &self.o_b];
        let own: usize = ws
            .into_iter()
            .chain(&self.o_a)
            .map(LinearWeight::byte_len)
            .sum();
        let comp = self.compressor.as_ref().map_or(0, Compressor::byte_len);
        let ix = self.indexer.as_ref().map_or(0, |i| i.byte_len());
        own + comp + ix
    }

    /// Values of a sequence's state for this layer: the window's rows and
    /// the compressors' tails.
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// Runs the layer for the batch's tokens: `step.out` gets the
    /// attention's output rows (`[n, hidden]`).
    pub fn forward(
        &self,
        ctx: StateCtx<'_, '_>,
        step: Step<'_, CsaScratch>,
    ) -> Result<(), ModelError> {
        let Step { xn, n, q8, s, out } = step;
        self.project(xn, n, q8, s)?;
        let StateCtx {
            pool,
            index,
            seqs,
            slots,
        } = ctx;
        let len = self.state_len();
        // Queries and keys (= values) rotated at their positions, keys as
        // cached; the indexer's queries by the compressed rotation.
        let (d, hd) = (self.dim, self.heads * self.dim);
        let idim = self.indexer.as_ref().map_or(1, |ix| ix.dim);
        let iw = self.indexer.as_ref().map_or(0, |ix| ix.heads * ix.dim);
        for sq in seqs {
            for (i, r) in sq.rows.clone().enumerate() {
                let pos = sq.pos0 + i;
                rotate_tail(&mut s.kv[r * d..(r + 1) * d], &self.inv_freq, pos, false);
                for head in s.q[r * hd..(r + 1) * hd].chunks_exact_mut(d) {
                    rotate_tail(head, &self.inv_freq, pos, false);
                }
                for head in s.iq[r * iw..(r + 1) * iw].chunks_exact_mut(idim) {
                    rotate_tail(head, &self.compress_freq, pos, false);
                }
            }
        }
        // Slots are as wide as the widest layer's state (what a snapshot
        // copies); this layer uses the start of its sequence's.
        let stride = pool.state_shape().delta;
        let (states, mut entries) = pool.states_and_entries(index)?;
        for (sq, &slot) in seqs.iter().zip(slots) {
            let state = states
                .get_mut(slot * stride..slot * stride + len)
                .ok_or(ModelError::StateSlot { slot })?;
            self.compress(&mut entries, sq, state, s);
            self.attend(&entries, sq, state, s)?;
            self.keep_window(sq, state, &s.kv);
        }
        self.output(n, q8, s, out)
    }

    /// Queries, K = V rows and the compressors' and indexer's projections
    /// of the batch.
    fn project(
        &self,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut CsaScratch,
    ) -> Result<(), ModelError> {
        let (heads, d) = (self.heads, self.dim);
        let qa = sized(&mut s.qa, n * self.q_norm.len());
        let kv = sized(&mut s.kv, n * d);
        let input = LinearInput::new(xn, n, q8, &[&self.q_a, &self.kv])?;
        forward_batch(&input, &mut [(&self.q_a, qa), (&self.kv, kv)])?;
        rms_norm_inplace(qa, &self.q_norm, self.eps);
        rms_norm_inplace(kv, &self.kv_norm, self.eps);
        let q = sized(&mut s.q, n * heads * d);
        let qa = &s.qa[..n * self.q_norm.len()];
        self.q_b
            .forward(&LinearInput::new(qa, n, q8, &[&self.q_b])?, q)?;
        rms_norm_inplace(q, &self.ones, self.eps);
        sized(&mut s.attn, n * heads * d);
        if let Some(c) = &self.compressor {
            let w = c.width();
            let (ckv, cg) = (sized(&mut s.ckv, n * w), sized(&mut s.cgate, n * w));
            c.project(xn, n, q8, (ckv, cg))?;
        }
        if let Some(ix) = &self.indexer {
            let w = ix.keys.width();
            let (ikv, ig) = (sized(&mut s.ikv, n * w), sized(&mut s.igate, n * w));
            ix.keys.project(xn, n, q8, (ikv, ig))?;
            let iq = sized(&mut s.iq, n * ix.heads * ix.dim);
            ix.q_b
                .forward(&LinearInput::new(qa, n, q8, &[&ix.q_b])?, iq)?;
            let iw = sized(&mut s.iw, n * ix.heads);
            ix.weights
                .forward(&LinearInput::new(xn, n, q8, &[&ix.weights])?, iw)?;
            let scale = (ix.heads as f32).powf(-0.5);
            iw.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    /// Feeds a sequence's tokens to the compressors (in position order),
    /// storing every entry a window closes in the pool.
    fn compress(
        &self,
        entries: &mut Entries<'_>,
        sq: &SeqAttn<'_>,
        state: &mut [f32],
        s: &mut CsaScratch,
    ) {
        let Some(c) = &self.compressor else {
            return;
        };
        let ring = self.window * self.dim;
        let (tail, rest) = state[ring..].split_at_mut(c.state_len());
        let (w, d) = (c.width(), self.dim);
        let entry = sized(&mut s.entry, d + self.indexer.as_ref().map_or(0, |i| i.dim));
        let (entry, index_entry) = entry.split_at_mut(d);
        for (i, r) in sq.rows.clone().enumerate() {
            let pos = sq.pos0 + i;
            let closed = c.push(
                tail,
                pos,
                (&s.ckv[r * w..(r + 1) * w], &s.cgate[r * w..(r + 1) * w]),
            );
            let ix_closed = self.indexer.as_ref().and_then(|ix| {
                let iw = ix.keys.width();
                let rows = (&s.ikv[r * iw..(r + 1) * iw], &s.igate[r * iw..(r + 1) * iw]);
                ix.keys.push(rest, pos, rows)
            });
            let Some(e) = closed else { continue };
            let rope = (self.eps, &self.compress_freq[..]);
            c.entry(tail, e, rope, &mut s.pool_weights, entry);
            let index = match (&self.indexer, ix_closed) {
                (Some(ix), Some(_)) => {
                    ix.keys
                        .entry(rest, e, rope, &mut s.pool_weights, index_entry);
                    Some(&index_entry[..])
                }
                _ => None,
            };
            entries.store((self.cache, c.rate()), sq.table, e, (entry, index));
        }
    }

    /// Each of a sequence's queries over its window and compressed
    /// entries, rotated back, into `s.attn` (`[n, heads·dim]`), in three
    /// phases: the indexer's choices (a pool task per query), the entries
    /// any query reads widened once, then attention (a task per query and
    /// head). Each (query, head) is one arithmetic whatever the split.
    fn attend(
        &self,
        store: &Entries<'_>,
        sq: &SeqAttn<'_>,
        state: &[f32],
        s: &mut CsaScratch,
    ) -> Result<(), ModelError> {
        let (heads, d, win) = (self.heads, self.dim, self.window);
        let (r0, n) = (sq.rows.start, sq.rows.len());
        let rate = self.compressor.as_ref().map_or(0, Compressor::rate);
        // Entries visible to the chunk's last token.
        let count = (sq.pos0 + n).checked_div(rate).unwrap_or(0);
        let kmax = self.indexer.as_ref().map_or(0, |ix| ix.topk.min(count));
        s.needed.clear();
        s.needed.resize(count, self.indexer.is_none());
        if let Some(ix) = &self.indexer {
            let (hi, r0) = (ix.heads * ix.dim, sq.rows.start);
            let qs = Queries {
                q: &s.iq[r0 * hi..(r0 + n) * hi],
                w: &s.iw[r0 * ix.heads..(r0 + n) * ix.heads],
                pos0: sq.pos0,
                n,
            };
            ix.choose(
                (store, self.cache, sq.table),
                &qs,
                (count, kmax),
                &mut s.lightning,
            );
            for i in 0..n {
                let picked = ix.topk.min((sq.pos0 + i + 1) / rate);
                let row = &s.lightning.chosen[i * kmax..i * kmax + picked];
                for &w in row {
                    s.needed[w as usize] = true;
                }
                #[cfg(test)]
                tests::record(
                    self.cache,
                    sq.pos0 + i,
                    &row.iter().map(|&w| w as usize).collect::<Vec<_>>(),
                );
            }
        }
        let entries = sized(&mut s.entries, count * d);
        for (w, e) in entries.chunks_exact_mut(d).enumerate() {
            if s.needed[w] {
                store.load((self.cache, rate), sq.table, (w, false), e);
            }
        }
        let CsaScratch {
            q,
            kv,
            entries,
            lightning,
            attn,
            ..
        } = s;
        let chosen = &lightning.chosen;
        let (q, kv, entries, chosen) = (&q[..], &kv[..], &entries[..], &chosen[..]);
        let failed = std::sync::Mutex::new(None);
        let scale = 1.0 / (d as f32).sqrt();
        let tier = cpu::tier();
        let out = &mut attn[r0 * heads * d..(r0 + n) * heads * d];
        // Items of a query and a group of its heads (each row read once
        // per group): a prompt chunk's queries whole, a decode step's
        // heads split so that every thread has some.
        let groups = head_groups(heads, n);
        let per = heads / groups;
        let rows_max = win + kmax.max(if self.indexer.is_none() { count } else { 0 });
        let cost = rows_max * per * d;
        kvant_kernels::pool::for_rows_mut_cost(out, (per * d, cost), &|items, out| {
            TASK.with(|t| {
                let scores = &mut *t.borrow_mut();
                for (item, o) in items.zip(out.chunks_exact_mut(per * d)) {
                    let (i, g) = (item / groups, item % groups);
                    let pos = sq.pos0 + i;
                    let first = (pos + 1).saturating_sub(win);
                    let in_window = pos + 1 - first;
                    let visible = (pos + 1).checked_div(rate).unwrap_or(0);
                    let picked = match &self.indexer {
                        Some(ix) => ix.topk.min(visible),
                        None => visible,
                    };
                    let row = |j: usize| -> &[f32] {
                        if j < in_window {
                            let p = first + j;
                            return match p >= sq.pos0 {
                                true => &kv[(r0 + p - sq.pos0) * d..][..d],
                                false => &state[(p % win) * d..][..d],
                            };
                        }
                        let w = match self.indexer {
                            Some(_) => chosen[i * kmax + j - in_window] as usize,
                            None => j - in_window,
                        };
                        &entries[w * d..][..d]
                    };
                    let rows = SinkRows {
                        n: in_window + picked,
                        row: &row,
                    };
                    scores.resize(rows.n * per, 0.0);
                    let hs = g * per..(g + 1) * per;
                    let a = SinkAttn {
                        heads: per,
                        dim: d,
                        scale,
                        sinks: &self.sinks[hs.clone()],
                    };
                    let qg = &q[(r0 + i) * heads * d + hs.start * d..][..per * d];
                    if let Err(e) = sink_attention(tier, &a, (qg, rows), scores, o) {
                        *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    }
                    for head in o.chunks_exact_mut(d) {
                        rotate_tail(head, &self.inv_freq, pos, true);
                    }
                }
            })
        });
        match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Keeps the chunk's last `window` rows in the sequence's ring.
    fn keep_window(&self, sq: &SeqAttn<'_>, state: &mut [f32], kv: &[f32]) {
        let (d, win) = (self.dim, self.window);
        let len = sq.rows.len();
        for i in len.saturating_sub(win)..len {
            let pos = sq.pos0 + i;
            let r = sq.rows.start + i;
            state[(pos % win) * d..(pos % win + 1) * d].copy_from_slice(&kv[r * d..(r + 1) * d]);
        }
    }

    /// The grouped output projection of `s.attn` into `out`.
    fn output(
        &self,
        n: usize,
        q8: &mut Q8Activations,
        s: &mut CsaScratch,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let groups = self.o_a.len();
        let width = self.heads * self.dim;
        let per = width / groups;
        let rank = self.o_a.first().map_or(0, LinearWeight::rows);
        let gin = sized(&mut s.group_in, n * per);
        let gout = sized(&mut s.group_out, n * groups * rank);
        let part = sized(&mut s.part, n * rank);
        for (g, w) in self.o_a.iter().enumerate() {
            for t in 0..n {
                gin[t * per..(t + 1) * per]
                    .copy_from_slice(&s.attn[t * width + g * per..t * width + (g + 1) * per]);
            }
            w.forward(&LinearInput::new(gin, n, q8, &[w])?, part)?;
            for t in 0..n {
                gout[t * groups * rank + g * rank..][..rank]
                    .copy_from_slice(&part[t * rank..(t + 1) * rank]);
            }
        }
        let gout = &s.group_out[..n * groups * rank];
        self.o_b
            .forward(&LinearInput::new(gout, n, q8, &[&self.o_b])?, out)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::arch::decoder::{DecoderModel, LoadOptions, Logits};
    use crate::checkpoint::Checkpoint;
    use std::cell::RefCell;

    /// (compressing layer, position, chosen entries) of each query.
    type Choice = (usize, usize, Vec<usize>);

    thread_local! {
        static CHOICES: RefCell<Option<Vec<Choice>>> = const { RefCell::new(None) };
    }

    /// Keeps a query's choice while a test listens (the forward runs the
    /// attention on the calling thread).
    pub(super) fn record(layer: usize, pos: usize, chosen: &[usize]) {
        CHOICES.with(|c| {
            if let Some(v) = c.borrow_mut().as_mut() {
                v.push((layer, pos, chosen.to_vec()));
            }
        });
    }

    /// The indexer picks the entries transformers picked, for every
    /// prompt position of both CSA layers: the fixture's smallest gap
    /// between the k-th and (k+1)-th score is 1.8e-3, far above the f32
    /// rounding of these scores (~1e-6), so no choice is a near-tie.
    #[test]
    fn indexer_choices_equal_transformers() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/models/deepseek-v4");
        let r: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("reference.json")).expect("reference"),
        )
        .expect("json");
        let ckpt = Checkpoint::open(&dir).expect("checkpoint");
        let cfg = ckpt.config().expect("config");
        let v4 = cfg.v4.clone().expect("a V4 config");
        let m = DecoderModel::load(&ckpt, cfg, LoadOptions::F32, None).expect("load");
        let prompt: Vec<u32> = r["prompt_ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        CHOICES.with(|c| *c.borrow_mut() = Some(Vec::new()));
        let mut cache = m.new_cache(prompt.len()).expect("cache");
        m.forward(&prompt, &mut cache, Logits::None)
            .expect("forward");
        let got = CHOICES.with(|c| c.borrow_mut().take()).expect("choices");
        let mut compared = 0;
        for l in r["indexer"]["layers"].as_array().expect("layers") {
            let layer = l["layer"].as_u64().expect("layer") as usize;
            let cache_index = (0..layer).filter(|&j| v4.rate(j) > 0).count();
            for (pos, want) in l["selected"]
                .as_array()
                .expect("selected")
                .iter()
                .enumerate()
            {
                let mut want: Vec<usize> = want
                    .as_array()
                    .expect("entries")
                    .iter()
                    .map(|v| v.as_u64().expect("entry") as usize)
                    .collect();
                want.sort_unstable();
                let mut mine = got
                    .iter()
                    .find(|(c, p, _)| *c == cache_index && *p == pos)
                    .map(|(_, _, e)| e.clone())
                    .expect("a choice per position");
                mine.sort_unstable();
                assert_eq!(mine, want, "layer {layer} position {pos}");
                compared += 1;
            }
        }
        assert_eq!(compared, 2 * prompt.len());
    }
}
