//! DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2), the
//! component that turns latent attention sparse: per token it computes
//! indexer queries from MLA's normalised query latent (`wq_b`), one
//! indexer key from the layer input (`wk`, then LayerNorm with bias), the
//! rotary part of both rotated with half-split pairs (MLA's own rotary
//! part is interleaved), and per-head weights (`weights_proj`, times
//! `heads^-1/2`). Keys go to the paged cache beside the latent rows; each
//! query keeps the `index_topk` positions of highest
//! `Σ_h w_h · ReLU(q_h · k / sqrt(head_dim))` (the kernel,
//! `kvant_kernels::attention::indexer`), and latent attention then reads
//! only those rows.
//!
//! Under tensor parallelism every rank runs the whole indexer (its
//! weights are small next to the attention's): the selection is the same
//! arithmetic on every rank, so no scores cross the network.
//!
//! The projections keep f32 activations whatever the load options say:
//! 8-bit activations would move index scores by ~1%, enough to swap the
//! positions around the top-k cut (the same reason routers stay exact).

use super::ctx::LayerCtx;
use super::loader::Loader;
use super::sized;
use crate::checkpoint::Checkpoint;
use crate::config::{IndexerConfig, ModelConfig};
use crate::ModelError;
use kvant_kernels::attention::{IndexerParams, TopK};
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{LinearInput, LinearWeight};
use kvant_kernels::norm::layer_norm_inplace;
use kvant_kernels::rope::{rope_rows, RopeStyle};

/// The LayerNorm epsilon of the indexer's keys (fixed in DeepSeek's code
/// and transformers'; no config key carries it).
const K_NORM_EPS: f32 = 1e-6;

pub(crate) struct Indexer {
    /// `[heads · head_dim, q_lora_rank]`.
    q_b: LinearWeight,
    /// `[head_dim, hidden]`.
    k: LinearWeight,
    k_norm: (Vec<f32>, Vec<f32>),
    /// `[heads, hidden]`.
    weights: LinearWeight,
    p: IndexerParams,
}

/// The indexer's activations, reused across passes, and its selection.
#[derive(Default)]
pub(crate) struct IndexerScratch {
    q: Vec<f32>,
    k: Vec<f32>,
    w: Vec<f32>,
    pub sel: TopK,
}

impl Indexer {
    /// Loads the indexer of the layer whose names start with `prefix`.
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        ic: &IndexerConfig,
        q_lora_rank: usize,
        prefix: &str,
    ) -> Result<Self, ModelError> {
        let n = |hf: &str, gguf: &str| match ld.ckpt {
            Checkpoint::Gguf(_) => format!("{prefix}indexer.{gguf}"),
            Checkpoint::Hf(_) => format!("{prefix}self_attn.indexer.{hf}"),
        };
        let (h, d) = (cfg.hidden, ic.head_dim);
        Ok(Indexer {
            q_b: ld.exact_weight(
                &n("wq_b.weight", "attn_q_b.weight"),
                ic.n_heads * d,
                q_lora_rank,
            )?,
            k: ld.exact_weight(&n("wk.weight", "attn_k.weight"), d, h)?,
            k_norm: (
                ld.raw_vector(&n("k_norm.weight", "k_norm.weight"), d)?,
                ld.raw_vector(&n("k_norm.bias", "k_norm.bias"), d)?,
            ),
            weights: ld.exact_weight(&n("weights_proj.weight", "proj.weight"), ic.n_heads, h)?,
            p: IndexerParams {
                n_heads: ic.n_heads,
                head_dim: d,
                topk: ic.topk,
                scale: 1.0 / (d as f32).sqrt(),
            },
        })
    }

    /// Bytes of its weights (each read once per pass).
    pub fn byte_len(&self) -> usize {
        self.q_b.byte_len() + self.k.byte_len() + self.weights.byte_len()
    }

    /// Stores the keys of the batch's `n` tokens (normed layer input `xn`,
    /// normed query latent `qr`) in layer `ctx.index` of the pool and
    /// selects every token's positions into `s.sel`. `inv_freq` is the
    /// layer's rotary frequencies (MLA's, `rope_dim / 2` of them).
    #[allow(clippy::too_many_arguments)] // one layer's selection, unpacked
    pub fn select(
        &self,
        cfg: &ModelConfig,
        inv_freq: &[f32],
        ctx: &mut LayerCtx<'_, '_>,
        (xn, qr): (&[f32], &[f32]),
        n: usize,
        q8: &mut Q8Activations,
        s: &mut IndexerScratch,
    ) -> Result<(), ModelError> {
        let (nh, d) = (self.p.n_heads, self.p.head_dim);
        let rope = 2 * inv_freq.len();
        let q = sized(&mut s.q, n * nh * d);
        let k = sized(&mut s.k, n * d);
        let w = sized(&mut s.w, n * nh);
        self.q_b
            .forward(&LinearInput::new(qr, n, q8, &[&self.q_b])?, q)?;
        let input = LinearInput::new(xn, n, q8, &[&self.k, &self.weights])?;
        self.k.forward(&input, k)?;
        self.weights.forward(&input, w)?;
        layer_norm_inplace(k, &self.k_norm.0, &self.k_norm.1, K_NORM_EPS);
        let head_scale = 1.0 / (nh as f32).sqrt();
        w.iter_mut().for_each(|v| *v *= head_scale);
        // transformers scales cos and sin by YaRN's attention factor.
        let factor = cfg.rope.scaling.attention_factor();
        for sq in ctx.seqs {
            let r = &sq.rows;
            let (qs, ks) = (
                &mut q[r.start * nh * d..r.end * nh * d],
                &mut k[r.start * d..r.end * d],
            );
            let pos0 = sq.pos0 + ctx.rope_offset;
            rope_rows(
                (&mut *qs, &mut *ks),
                r.len(),
                d,
                pos0,
                inv_freq,
                RopeStyle::Neox,
            );
            if factor != 1.0 {
                for head in qs.chunks_exact_mut(d).chain(ks.chunks_exact_mut(d)) {
                    head[..rope].iter_mut().for_each(|v| *v *= factor);
                }
            }
        }
        ctx.pool
            .store_and_select(ctx.index, ctx.seqs, k, &self.p, q, w, &mut s.sel);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::shard::Shard;
    use crate::kv::{KvDType, KvPool, KvShape};
    use kvant_kernels::attention::SeqAttn;
    use serde_json::Value;
    use std::path::Path;

    fn rows(v: &Value) -> Vec<f32> {
        let rows = v.as_array().expect("rows");
        rows.iter()
            .flat_map(|r| r.as_array().expect("row").iter())
            .map(|x| x.as_f64().expect("number") as f32)
            .collect()
    }

    /// Every layer's indexer, fed transformers' own inputs (its normed
    /// hidden states and query latents over prompt + greedy tokens), picks
    /// exactly the positions transformers picked, for every position past
    /// the top-k, from the HF checkpoint and from llama.cpp's GGUF (whose
    /// reference holds the dequantized weights' selections). The fixture's
    /// smallest k-th/(k+1)-th score gap is 1e-3, far above f32 noise
    /// (~1e-6), so ties cannot excuse a difference.
    #[test]
    fn selects_what_transformers_selects() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
        for (ckpt, refp) in [
            (
                root.join("deepseek-v32"),
                root.join("deepseek-v32/reference.json"),
            ),
            (
                root.join("gguf/deepseek-v32.Q8_0.gguf"),
                root.join("gguf/deepseek-v32.Q8_0.reference.json"),
            ),
        ] {
            let r: Value =
                serde_json::from_str(&std::fs::read_to_string(&refp).expect("reference"))
                    .expect("json");
            let ckpt = Checkpoint::open(&ckpt).expect("checkpoint");
            let cfg = ckpt.config().expect("config");
            let (ic, m) = (cfg.indexer.expect("indexer"), cfg.mla.expect("mla"));
            let q_lora = m.q_lora_rank.expect("q lora");
            let ld = Loader {
                ckpt: &ckpt,
                int8: false,
                quantize: None,
                norm_offset: 0.0,
                shard: Shard::FULL,
            };
            let n = r["indexer"]["positions"].as_u64().expect("positions") as usize;
            let shape = KvShape {
                n_layers: cfg.n_layers,
                n_kv_heads: 1,
                head_dim: m.latent_dim(),
                latent: true,
                index_dim: ic.head_dim,
                dtype: KvDType::F32,
            };
            let mut pool = KvPool::new(shape, 4, n.div_ceil(4)).expect("pool");
            let table: Vec<u32> = (0..n.div_ceil(4) as u32).rev().collect();
            let seqs = [SeqAttn {
                rows: 0..n,
                pos0: 0,
                table: &table,
            }];
            let layers = r["indexer"]["layers"].as_array().expect("layers");
            for (l, want) in layers.iter().enumerate() {
                let prefix = ckpt.layer_names(l, cfg.arch).prefix;
                let ix = Indexer::load(&ld, &cfg, &ic, q_lora, &prefix).expect("indexer");
                let (xn, qr) = (rows(&want["xn"]), rows(&want["q_resid"]));
                assert_eq!((xn.len(), qr.len()), (n * cfg.hidden, n * q_lora));
                let mut ctx = LayerCtx {
                    pool: &mut pool,
                    index: l,
                    seqs: &seqs,
                    rope_offset: 0,
                };
                let mut s = IndexerScratch::default();
                let mut q8 = Q8Activations::default();
                let inv_freq = cfg.inv_freq(l, None);
                ix.select(&cfg, &inv_freq, &mut ctx, (&xn, &qr), n, &mut q8, &mut s)
                    .expect("select");
                let first = want["first_sparse_pos"].as_u64().expect("first") as usize;
                assert_eq!(first, ic.topk);
                let picked = want["selected"].as_array().expect("selected");
                for t in 0..n {
                    let got = s.sel.get(t);
                    if t < first {
                        assert!(got.is_none(), "layer {l} pos {t}: dense expected");
                        continue;
                    }
                    let expect: Vec<u32> = picked[t - first]
                        .as_array()
                        .expect("positions")
                        .iter()
                        .map(|x| x.as_u64().expect("position") as u32)
                        .collect();
                    assert_eq!(got, Some(&expect[..]), "{refp:?} layer {l} pos {t}");
                }
            }
        }
    }
}
