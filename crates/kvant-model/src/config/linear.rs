//! Linear-attention settings: the Gated DeltaNet layers of Qwen3-Next and
//! Qwen3.5, which sit beside full-attention layers (`layer_types`), and
//! their fixed-size recurrent state.

use super::error::{invalid, ConfigError, Result};
use super::json::{required, usize_at};
use crate::gguf::GgufFile;
use kvant_kernels::delta::HeadSharing;
use serde_json::Value;

/// How a checkpoint stores a linear layer's input projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearLayout {
    /// Qwen3-Next: `in_proj_qkvz` holds `[q, k, v, z]` per key head group
    /// and `in_proj_ba` `[b, a]` per group. llama.cpp's converter splits
    /// the first into `attn_qkv` (`[q; k; v]`) and `attn_gate` but keeps
    /// `ssm_ba` grouped.
    Grouped,
    /// Qwen3.5: `in_proj_qkv` (`[q; k; v]`, each all heads), `in_proj_z`,
    /// `in_proj_b`, `in_proj_a` (GGUF: `attn_qkv`, `attn_gate`,
    /// `ssm_beta`, `ssm_alpha`).
    Split,
    /// Kimi Delta Attention (Kimi Linear): `q_proj`, `k_proj`, `v_proj`
    /// with a conv each, a low-rank forget gate per key channel
    /// (`f_a_proj`, `f_b_proj`), `b_proj`, a low-rank output gate
    /// (`g_a_proj`, `g_b_proj`) behind a sigmoid-gated norm; one value head
    /// per key head, `dk = dv`.
    Kda,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearConfig {
    /// Query / key heads and value heads (a multiple of them).
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// Taps of the causal depthwise convolution over `[q, k, v]`.
    pub conv_kernel: usize,
    /// Per layer: linear attention (else full attention).
    pub layers: Vec<bool>,
    pub layout: LinearLayout,
    /// The order of the value heads (every per-value-head tensor follows it).
    pub sharing: HeadSharing,
}

impl LinearConfig {
    pub fn is_linear(&self, layer: usize) -> bool {
        self.layers.get(layer).copied().unwrap_or(false)
    }

    /// Channels of the convolution: `[q, k, v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.n_k_heads * self.k_dim + self.n_v_heads * self.v_dim
    }

    fn validate(self, n_layers: usize) -> Result<Self> {
        let bad = |key: &str, why: String| invalid(key, why);
        for (key, v) in [
            ("linear_num_key_heads", self.n_k_heads),
            ("linear_num_value_heads", self.n_v_heads),
            ("linear_key_head_dim", self.k_dim),
            ("linear_value_head_dim", self.v_dim),
        ] {
            if v == 0 || v > 4096 {
                return Err(bad(key, format!("{v} (1 to 4096 allowed)")));
            }
        }
        if !self.n_v_heads.is_multiple_of(self.n_k_heads) {
            return Err(bad(
                "linear_num_value_heads",
                format!(
                    "{} is not a multiple of {} key heads",
                    self.n_v_heads, self.n_k_heads
                ),
            ));
        }
        if !(2..=16).contains(&self.conv_kernel) {
            return Err(bad(
                "linear_conv_kernel_dim",
                format!("{} (2 to 16 allowed)", self.conv_kernel),
            ));
        }
        if self.layers.len() != n_layers {
            return Err(bad(
                "layer_types",
                format!("{} entries for {n_layers} layers", self.layers.len()),
            ));
        }
        Ok(self)
    }

    /// From a Qwen3-Next / Qwen3.5 `config.json` (its `layer_types` say
    /// which layers are `linear_attention`).
    pub(super) fn from_hf(cfg: &Value, layout: LinearLayout, n_layers: usize) -> Result<Self> {
        let types = cfg
            .get("layer_types")
            .ok_or_else(|| ConfigError::Missing("layer_types".into()))?;
        let layers = hf_layer_types(types)?;
        LinearConfig {
            n_k_heads: required(cfg, "linear_num_key_heads")?,
            n_v_heads: required(cfg, "linear_num_value_heads")?,
            k_dim: required(cfg, "linear_key_head_dim")?,
            v_dim: required(cfg, "linear_value_head_dim")?,
            conv_kernel: usize_at(cfg, "linear_conv_kernel_dim")?.unwrap_or(4),
            layers,
            layout,
            sharing: HeadSharing::Grouped,
        }
        .validate(n_layers)
    }

    /// From a Kimi Linear `config.json`: transformers' `linear_num_heads`,
    /// `linear_head_dim`, `linear_conv_kernel_dim` and `layer_types`, or
    /// the published checkpoints' `linear_attn_config` (`num_heads`,
    /// `head_dim`, `short_conv_kernel_size`, 1-based `kda_layers` and
    /// `full_attn_layers`); without either list, every fourth layer from
    /// the second is full attention (transformers' default).
    pub(super) fn from_hf_kimi(cfg: &Value, n_layers: usize) -> Result<Self> {
        let lac = cfg.get("linear_attn_config").filter(|v| v.is_object());
        let key = |flat: &str, nested: &str| -> Result<Option<usize>> {
            match (usize_at(cfg, flat)?, lac) {
                (Some(v), _) => Ok(Some(v)),
                (None, Some(l)) => usize_at(l, nested),
                (None, None) => Ok(None),
            }
        };
        let heads = key("linear_num_heads", "num_heads")?.unwrap_or(32);
        let dim = key("linear_head_dim", "head_dim")?.unwrap_or(128);
        let layers = match (cfg.get("layer_types"), lac) {
            (Some(types), _) if types.is_array() => hf_layer_types(types)?,
            (_, Some(l)) => kimi_layer_lists(l, n_layers)?,
            (_, None) => (0..n_layers).map(|i| i == 0 || i % 4 != 0).collect(),
        };
        LinearConfig {
            n_k_heads: heads,
            n_v_heads: heads,
            k_dim: dim,
            v_dim: dim,
            conv_kernel: key("linear_conv_kernel_dim", "short_conv_kernel_size")?.unwrap_or(4),
            layers,
            layout: LinearLayout::Kda,
            sharing: HeadSharing::Grouped,
        }
        .validate(n_layers)
    }

    /// From `kimi-linear.*` metadata as llama.cpp's converter writes it:
    /// KDA heads are the attention heads, their size `kda.head_dim`, and a
    /// layer is linear where its `attention.head_count_kv` entry is 0.
    pub(super) fn from_gguf_kimi(g: &GgufFile, arch_name: &str, n_layers: usize) -> Result<Self> {
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<usize> {
            g.get_usize(&key(k))?
                .ok_or_else(|| ConfigError::Missing(key(k)))
        };
        let kv = g
            .get_i32_array(&key("attention.head_count_kv"))?
            .ok_or_else(|| ConfigError::Missing(key("attention.head_count_kv")))?;
        let (heads, dim) = (req("attention.head_count")?, req("kda.head_dim")?);
        LinearConfig {
            n_k_heads: heads,
            n_v_heads: heads,
            k_dim: dim,
            v_dim: dim,
            conv_kernel: req("ssm.conv_kernel")?,
            layers: kv.iter().take(n_layers).map(|&n| n == 0).collect(),
            layout: LinearLayout::Kda,
            sharing: HeadSharing::Grouped,
        }
        .validate(n_layers)
    }

    /// From `{arch}.ssm.*` metadata as llama.cpp's converter writes it:
    /// the key head size is `ssm.state_size`, the value heads' size follows
    /// from `ssm.inner_size` (llama.cpp itself assumes the two equal); the
    /// linear layers come from `attention.recurrent_layers` or else are
    /// every layer but each `full_attention_interval`-th (llama.cpp's
    /// fallback).
    pub(super) fn from_gguf(
        g: &GgufFile,
        arch_name: &str,
        layout: LinearLayout,
        n_layers: usize,
    ) -> Result<Self> {
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<usize> {
            g.get_usize(&key(k))?
                .ok_or_else(|| ConfigError::Missing(key(k)))
        };
        let k_dim = req("ssm.state_size")?;
        let (n_k_heads, n_v_heads) = (req("ssm.group_count")?, req("ssm.time_step_rank")?);
        let inner = req("ssm.inner_size")?;
        if n_v_heads == 0 || !inner.is_multiple_of(n_v_heads) {
            return Err(invalid(
                key("ssm.inner_size"),
                format!("{inner} is not a whole number of {n_v_heads} value heads"),
            ));
        }
        let layers = match g.get_bool_array(&key("attention.recurrent_layers"))? {
            // MTP blocks, counted in the block count, come last.
            Some(r) => r.iter().copied().take(n_layers).collect(),
            None => {
                let every = g
                    .get_usize(&key("full_attention_interval"))?
                    .unwrap_or(4)
                    .max(1);
                (0..n_layers).map(|i| (i + 1) % every != 0).collect()
            }
        };
        LinearConfig {
            n_k_heads,
            n_v_heads,
            k_dim,
            v_dim: inner / n_v_heads,
            conv_kernel: req("ssm.conv_kernel")?,
            layers,
            layout,
            // The Qwen3.5 converter tiles the value heads (when there are
            // more of them than key heads); the Qwen3-Next one does not.
            sharing: if layout == LinearLayout::Split {
                HeadSharing::Tiled
            } else {
                HeadSharing::Grouped
            },
        }
        .validate(n_layers)
    }
}

/// transformers' `layer_types`: which layers are `linear_attention`.
fn hf_layer_types(types: &Value) -> Result<Vec<bool>> {
    types
        .as_array()
        .ok_or_else(|| ConfigError::Missing("layer_types".into()))?
        .iter()
        .map(|t| match t.as_str() {
            Some("linear_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(invalid(
                "layer_types",
                format!("`{t}` is neither linear_attention nor full_attention"),
            )),
        })
        .collect()
}

/// Kimi's published `linear_attn_config`: 1-based `kda_layers` and
/// `full_attn_layers`, each layer in exactly one.
fn kimi_layer_lists(l: &Value, n_layers: usize) -> Result<Vec<bool>> {
    let list = |k: &str| -> Result<Vec<usize>> {
        l.get(k)
            .and_then(Value::as_array)
            .ok_or_else(|| ConfigError::Missing(format!("linear_attn_config.{k}")))?
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|v| v as usize)
                    .filter(|&v| (1..=n_layers).contains(&v))
                    .ok_or_else(|| {
                        invalid(
                            format!("linear_attn_config.{k}"),
                            format!("{v} is not a layer number from 1 to {n_layers}"),
                        )
                    })
            })
            .collect()
    };
    let (kda, full) = (list("kda_layers")?, list("full_attn_layers")?);
    (1..=n_layers)
        .map(|i| match (kda.contains(&i), full.contains(&i)) {
            (true, false) => Ok(true),
            (false, true) => Ok(false),
            _ => Err(invalid(
                "linear_attn_config",
                format!("layer {i} must be in exactly one of kda_layers and full_attn_layers"),
            )),
        })
        .collect()
}
