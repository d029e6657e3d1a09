//! DeepSeek-V4's attention and residual settings: which attention each
//! layer runs (a sliding window alone, or beside compressed entries: CSA
//! with an indexer's top-k, HCA without), the compression rates, the
//! grouped low-rank output projection, the two rotary embeddings (`main`
//! for sliding-only layers, `compress` with YaRN for the others), the
//! hyper-connection streams (mHC) and which MoE layers route by a
//! token-id table.
//!
//! Read from transformers' `deepseek_v4` config (transformers 5's
//! `layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`
//! keyed `main` / `compress`) or the published checkpoints' older keys
//! (`compress_ratios` per layer, `compress_rate_csa`/`_hca`,
//! `num_hash_layers`, `qk_rope_head_dim`, `rope_theta` with
//! `compress_rope_theta` and a `rope_scaling` that applies to the
//! compressed layers only), as transformers' own `__post_init__` folds
//! them.

use super::error::{invalid, ConfigError, Result};
use super::json::{f32_at, required, usize_at};
use super::rope::{apply_scaling, parse_gguf_scaling, parse_hf_scaling, RopeScaling};
use crate::gguf::GgufFile;
use serde_json::Value;

/// What a layer attends over besides its sliding window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum V4Attention {
    /// The window only (`sliding_attention`, compress ratio 0).
    Sliding,
    /// Compressed sparse attention: entries of `csa_rate` tokens from
    /// overlapping windows, the indexer's top-k of them per query.
    Csa,
    /// Heavily compressed attention: entries of `hca_rate` tokens, all
    /// of them visible once closed.
    Hca,
}

/// The lightning indexer of CSA layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct V4Indexer {
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

/// Manifold-constrained hyper-connections: `mult` residual streams, the
/// Sinkhorn iterations and epsilon of the mixing matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HyperConfig {
    pub mult: usize,
    pub iters: usize,
    pub eps: f32,
}

/// One rotary embedding: its base and scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct V4Rope {
    pub theta: f32,
    pub scaling: RopeScaling,
}

#[derive(Clone, Debug, PartialEq)]
pub struct V4Config {
    pub layers: Vec<V4Attention>,
    /// The attention of the multi-token-prediction layer after the main
    /// ones: the published per-layer lists' entry past the main layers
    /// (a sliding window where the list stops at them).
    pub mtp: V4Attention,
    /// Per layer: experts chosen by `tid2eid[token]` (else by the router).
    pub hash_layers: Vec<bool>,
    pub csa_rate: usize,
    pub hca_rate: usize,
    /// Positions a query sees through the window, itself included.
    pub window: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    /// Rotated dimensions: the last `rope_dim` of each head.
    pub rope_dim: usize,
    pub main_rope: V4Rope,
    pub compress_rope: V4Rope,
    pub indexer: V4Indexer,
    pub hc: HyperConfig,
}

impl V4Config {
    /// Layer `layer`'s attention; a layer past the main ones is the MTP
    /// module's.
    pub fn kind(&self, layer: usize) -> V4Attention {
        self.layers.get(layer).copied().unwrap_or(self.mtp)
    }

    /// The compression rate of a layer (0 for a sliding-only one).
    pub fn rate(&self, layer: usize) -> usize {
        match self.kind(layer) {
            V4Attention::Csa => self.csa_rate,
            V4Attention::Hca => self.hca_rate,
            V4Attention::Sliding => 0,
        }
    }

    /// The smallest compression rate any layer uses (what a block of the
    /// paged cache holds entries for), 0 if no layer compresses.
    pub fn min_rate(&self) -> usize {
        (0..self.layers.len())
            .map(|i| self.rate(i))
            .filter(|&r| r > 0)
            .min()
            .unwrap_or(0)
    }

    /// f32 values a sequence keeps for layer `layer` (heads of
    /// `head_dim`): the window's rows (a ring), and each compressor's
    /// projected kv and gate rows of the positions its open windows need
    /// (`rate` of them, `2·rate` of twice the width for CSA's overlapping
    /// windows, the indexer's likewise at its width).
    pub fn state_len(&self, layer: usize, head_dim: usize) -> usize {
        let tail = compressor_tail_len;
        let ring = self.window * head_dim;
        match self.kind(layer) {
            V4Attention::Csa => {
                ring + tail(self.csa_rate, head_dim, true)
                    + tail(self.csa_rate, self.indexer.head_dim, true)
            }
            V4Attention::Hca => ring + tail(self.hca_rate, head_dim, false),
            V4Attention::Sliding => ring,
        }
    }

    /// Inverse frequencies of a layer's rotation: `main` for sliding-only
    /// layers, `compress` (YaRN where configured) for the others, whose
    /// compressed entries and indexer use the same.
    pub fn inv_freq(&self, layer: usize) -> Vec<f32> {
        let rope = match self.rate(layer) {
            0 => &self.main_rope,
            _ => &self.compress_rope,
        };
        rope_inv_freq(rope, self.rope_dim)
    }

    /// The compressed rotation's inverse frequencies.
    pub fn compress_inv_freq(&self) -> Vec<f32> {
        rope_inv_freq(&self.compress_rope, self.rope_dim)
    }

    /// From a transformers `deepseek_v4` config (see the module docs for
    /// the two forms), with `head_dim` and `n_layers` already read.
    pub(super) fn from_hf(cfg: &Value, head_dim: usize, n_layers: usize) -> Result<Self> {
        let mut layers = attention_layers(cfg, n_layers)?;
        let mtp = layers
            .get(n_layers)
            .copied()
            .unwrap_or(V4Attention::Sliding);
        layers.truncate(n_layers);
        let hash_layers = hash_layers(cfg, n_layers)?;
        let rates = cfg.get("compress_rates");
        let rate = |kind: &str, legacy: &str, default: usize| -> Result<usize> {
            match rates.and_then(|r| r.get(kind)) {
                Some(v) => v
                    .as_u64()
                    .map(|v| v as usize)
                    .ok_or_else(|| invalid(format!("compress_rates.{kind}"), "not a count")),
                None => Ok(usize_at(cfg, legacy)?.unwrap_or(default)),
            }
        };
        let rope_dim = match (
            usize_at(cfg, "qk_rope_head_dim")?,
            f32_at(cfg, "partial_rotary_factor")?,
        ) {
            (Some(d), _) => d,
            (None, Some(p)) => (head_dim as f32 * p).round() as usize,
            (None, None) => head_dim / 8,
        };
        let (main_rope, compress_rope) = ropes(cfg)?;
        let out = V4Config {
            layers,
            mtp,
            hash_layers,
            csa_rate: rate("compressed_sparse_attention", "compress_rate_csa", 4)?,
            hca_rate: rate("heavily_compressed_attention", "compress_rate_hca", 128)?,
            window: usize_at(cfg, "sliding_window")?.unwrap_or(128),
            q_lora_rank: required(cfg, "q_lora_rank")?,
            o_groups: usize_at(cfg, "o_groups")?.unwrap_or(8),
            o_lora_rank: required(cfg, "o_lora_rank")?,
            rope_dim,
            main_rope,
            compress_rope,
            indexer: V4Indexer {
                heads: usize_at(cfg, "index_n_heads")?.unwrap_or(64),
                head_dim: usize_at(cfg, "index_head_dim")?.unwrap_or(128),
                topk: usize_at(cfg, "index_topk")?.unwrap_or(512),
            },
            hc: HyperConfig {
                mult: usize_at(cfg, "hc_mult")?.unwrap_or(4),
                iters: usize_at(cfg, "hc_sinkhorn_iters")?.unwrap_or(20),
                eps: f32_at(cfg, "hc_eps")?.unwrap_or(1e-6),
            },
        };
        out.validate(head_dim)
    }

    /// From `deepseek4.*` metadata as llama.cpp's converter writes it
    /// (per-layer `attention.compress_ratios`, `hash_layer_count`, the
    /// YaRN of `rope.scaling.*` for the compressed layers only).
    pub(super) fn from_gguf(
        g: &GgufFile,
        arch: &str,
        head_dim: usize,
        n_layers: usize,
    ) -> Result<Self> {
        let key = |k: &str| format!("{arch}.{k}");
        let opt = |k: &str| g.get_usize(&key(k));
        let req =
            |k: &str| -> Result<usize> { opt(k)?.ok_or_else(|| ConfigError::Missing(key(k))) };
        let ratios = g
            .get_i32_array(&key("attention.compress_ratios"))?
            .ok_or_else(|| ConfigError::Missing(key("attention.compress_ratios")))?;
        if ratios.len() < n_layers {
            return Err(invalid(
                key("attention.compress_ratios"),
                format!("{} entries for {n_layers} layers", ratios.len()),
            ));
        }
        // The smallest positive rate is CSA's, a larger one HCA's.
        let positive = || {
            ratios[..n_layers]
                .iter()
                .filter(|&&r| r > 0)
                .map(|&r| r as usize)
        };
        let csa_rate = positive().min().unwrap_or(4);
        let hca_rate = positive().filter(|&r| r != csa_rate).max().unwrap_or(128);
        let mut layers = ratios[..ratios.len().min(n_layers + 1)]
            .iter()
            .map(|&r| match r {
                0 => Ok(V4Attention::Sliding),
                r if r as usize == csa_rate && r as usize != hca_rate => Ok(V4Attention::Csa),
                r if r as usize == hca_rate => Ok(V4Attention::Hca),
                _ => Err(invalid(key("attention.compress_ratios"), format!("{r}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        let mtp = layers
            .get(n_layers)
            .copied()
            .unwrap_or(V4Attention::Sliding);
        layers.truncate(n_layers);
        let hashed = opt("hash_layer_count")?.unwrap_or(0);
        let theta = g.get_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let out = V4Config {
            layers,
            mtp,
            hash_layers: (0..n_layers).map(|i| i < hashed).collect(),
            csa_rate,
            hca_rate,
            window: req("attention.sliding_window")?,
            q_lora_rank: req("attention.q_lora_rank")?,
            o_groups: req("attention.output_group_count")?,
            o_lora_rank: req("attention.output_lora_rank")?,
            rope_dim: req("rope.dimension_count")?,
            main_rope: V4Rope {
                theta,
                scaling: RopeScaling::None,
            },
            compress_rope: V4Rope {
                theta: g
                    .get_f32(&key("attention.compress_rope_freq_base"))?
                    .unwrap_or(160_000.0),
                scaling: parse_gguf_scaling(g, arch)?,
            },
            indexer: V4Indexer {
                heads: opt("attention.indexer.head_count")?.unwrap_or(64),
                head_dim: opt("attention.indexer.key_length")?.unwrap_or(128),
                topk: opt("attention.indexer.top_k")?.unwrap_or(512),
            },
            hc: HyperConfig {
                mult: req("hyper_connection.count")?,
                iters: opt("hyper_connection.sinkhorn_iterations")?.unwrap_or(20),
                eps: g.get_f32(&key("hyper_connection.epsilon"))?.unwrap_or(1e-6),
            },
        };
        out.validate(head_dim)
    }

    /// The sizes the forward relies on, each within range.
    fn validate(self, head_dim: usize) -> Result<Self> {
        let bad = |key: &str, why: String| Err(invalid(key, why));
        for (key, v) in [
            ("compress_rates.compressed_sparse_attention", self.csa_rate),
            ("compress_rates.heavily_compressed_attention", self.hca_rate),
        ] {
            if !v.is_power_of_two() || v > 1 << 12 {
                return bad(key, format!("{v} (a power of two up to 4096 allowed)"));
            }
        }
        for (key, v) in [
            ("sliding_window", self.window),
            ("q_lora_rank", self.q_lora_rank),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
            ("index_n_heads", self.indexer.heads),
            ("index_head_dim", self.indexer.head_dim),
            ("index_topk", self.indexer.topk),
            ("hc_mult", self.hc.mult),
            ("hc_sinkhorn_iters", self.hc.iters),
        ] {
            if v == 0 || v > 1 << 20 {
                return bad(key, format!("{v} (1 to 2^20 allowed)"));
            }
        }
        if self.hc.mult > 16 {
            return bad("hc_mult", format!("{} (at most 16 streams)", self.hc.mult));
        }
        if self.rope_dim == 0 || self.rope_dim > head_dim || !self.rope_dim.is_multiple_of(2) {
            return bad(
                "qk_rope_head_dim",
                format!("{} (even, at most head_dim {head_dim})", self.rope_dim),
            );
        }
        if self.rope_dim > self.indexer.head_dim {
            return bad(
                "index_head_dim",
                format!("{} is narrower than the rotation", self.indexer.head_dim),
            );
        }
        if self.rope_dim / 2 > kvant_kernels::rope::MAX_ROPE_HALF {
            return bad("qk_rope_head_dim", "is larger than kvant supports".into());
        }
        for r in [&self.main_rope, &self.compress_rope] {
            if !(r.theta.is_finite() && r.theta > 0.0) {
                return bad(
                    "rope_theta",
                    format!("{} is not a positive number", r.theta),
                );
            }
        }
        if !(self.hc.eps.is_finite() && self.hc.eps >= 0.0) {
            return bad("hc_eps", format!("{}", self.hc.eps));
        }
        Ok(self)
    }
}

/// f32 values of a compressor's tail: kv and gate projections (`dim`
/// wide, twice that with CSA's two series) of the `rate` positions of the
/// open window, `2·rate` with overlapping windows.
pub(crate) fn compressor_tail_len(rate: usize, dim: usize, overlap: bool) -> usize {
    match overlap {
        true => 2 * rate * 2 * (2 * dim),
        false => rate * 2 * dim,
    }
}

fn rope_inv_freq(rope: &V4Rope, dim: usize) -> Vec<f32> {
    let mut inv: Vec<f32> = (0..dim / 2)
        .map(|i| (1.0 / (rope.theta as f64).powf((2 * i) as f64 / dim as f64)) as f32)
        .collect();
    apply_scaling(&mut inv, &rope.scaling, dim, rope.theta);
    inv
}

/// `layer_types` by name, or the published `compress_ratios` (0, 4, 128).
fn attention_layers(cfg: &Value, n_layers: usize) -> Result<Vec<V4Attention>> {
    let layers: Vec<V4Attention> = match (cfg.get("layer_types"), cfg.get("compress_ratios")) {
        (Some(Value::Array(types)), _) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(V4Attention::Sliding),
                Some("compressed_sparse_attention") => Ok(V4Attention::Csa),
                Some("heavily_compressed_attention") => Ok(V4Attention::Hca),
                _ => Err(invalid(
                    "layer_types",
                    format!("`{t}` is not a V4 layer type"),
                )),
            })
            .collect::<Result<_>>()?,
        (_, Some(Value::Array(ratios))) => ratios
            .iter()
            .map(|r| match r.as_u64() {
                Some(0) => Ok(V4Attention::Sliding),
                Some(4) => Ok(V4Attention::Csa),
                Some(128) => Ok(V4Attention::Hca),
                _ => Err(invalid(
                    "compress_ratios",
                    format!("`{r}` is not 0, 4 or 128"),
                )),
            })
            .collect::<Result<_>>()?,
        // transformers' default: two HCA layers, then CSA and HCA in turn.
        _ => (0..n_layers)
            .map(|i| match i < 2 || i % 2 == 0 {
                true => V4Attention::Hca,
                false => V4Attention::Csa,
            })
            .collect(),
    };
    // transformers keeps the first `num_hidden_layers` entries (the
    // published lists also describe the MTP layers after them: the
    // caller keeps the first of those).
    if layers.len() < n_layers {
        return Err(invalid(
            "layer_types",
            format!("{} entries for {n_layers} layers", layers.len()),
        ));
    }
    Ok(layers)
}

/// `mlp_layer_types` (`hash_moe` / `moe`), or the first `num_hash_layers`
/// (3 by default).
fn hash_layers(cfg: &Value, n_layers: usize) -> Result<Vec<bool>> {
    let out: Vec<bool> = match cfg.get("mlp_layer_types") {
        Some(Value::Array(types)) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("hash_moe") => Ok(true),
                Some("moe") => Ok(false),
                _ => Err(invalid(
                    "mlp_layer_types",
                    format!("`{t}` is neither hash_moe nor moe"),
                )),
            })
            .collect::<Result<_>>()?,
        _ => {
            let n = usize_at(cfg, "num_hash_layers")?.unwrap_or(3);
            (0..n_layers).map(|i| i < n).collect()
        }
    };
    if out.len() < n_layers {
        return Err(invalid(
            "mlp_layer_types",
            format!("{} entries for {n_layers} layers", out.len()),
        ));
    }
    Ok(out[..n_layers].to_vec())
}

/// The `main` and `compress` rotations: transformers 5 nests them in
/// `rope_parameters`; older configs give `rope_theta`,
/// `compress_rope_theta` and a `rope_scaling` for the compressed layers
/// (YaRN there never scales the rotated values: transformers forces its
/// attention factor to 1).
fn ropes(cfg: &Value) -> Result<(V4Rope, V4Rope)> {
    let rp = cfg.get("rope_parameters").filter(|v| v.is_object());
    let nested = |key: &str| rp.and_then(|r| r.get(key)).filter(|v| v.is_object());
    let rope = |obj: &Value, fallback: f32| -> Result<V4Rope> {
        Ok(V4Rope {
            theta: f32_at(obj, "rope_theta")?.unwrap_or(fallback),
            scaling: parse_hf_scaling(Some(obj))?,
        })
    };
    match (nested("main"), nested("compress")) {
        (Some(main), Some(compress)) => Ok((rope(main, 10_000.0)?, rope(compress, 160_000.0)?)),
        (None, None) => {
            let theta = f32_at(cfg, "rope_theta")?.unwrap_or(10_000.0);
            let compress_theta = f32_at(cfg, "compress_rope_theta")?.unwrap_or(160_000.0);
            let scaling = parse_hf_scaling(cfg.get("rope_scaling").or(rp))?;
            Ok((
                V4Rope {
                    theta,
                    scaling: RopeScaling::None,
                },
                V4Rope {
                    theta: compress_theta,
                    scaling,
                },
            ))
        }
        _ => Err(ConfigError::Missing(
            "rope_parameters.main and rope_parameters.compress".into(),
        )),
    }
}
