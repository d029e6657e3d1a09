//! Multi-head latent attention settings (DeepSeek-V2/V3, GigaChat3).
//!
//! Keys and values are compressed per token into a `kv_lora_rank` latent
//! plus a `qk_rope_head_dim` rotary key shared by all heads; each head
//! expands the latent into a `qk_nope_head_dim` key part and a
//! `v_head_dim` value. Queries come from a plain projection or through a
//! `q_lora_rank` bottleneck.

use super::error::{invalid, ConfigError, Result};
use super::json::{required, usize_at};
use crate::gguf::GgufFile;
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// `None`: a plain `q_proj` (DeepSeek-V2-Lite, `q_lora_rank: null`).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
    pub nope_dim: usize,
    pub v_dim: usize,
}

impl MlaConfig {
    /// Query/key size per head before absorption: `nope + rope`.
    pub fn qk_dim(&self) -> usize {
        self.nope_dim + self.rope_dim
    }

    /// What the cache holds per token and layer: the latent, then the
    /// rotary key.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }

    pub(super) fn validate(self) -> Result<Self> {
        let bad = |key: &str, why: &str| invalid(key, why);
        for (key, v) in [
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.rope_dim),
            ("qk_nope_head_dim", self.nope_dim),
            ("v_head_dim", self.v_dim),
            ("q_lora_rank", self.q_lora_rank.unwrap_or(1)),
        ] {
            if v == 0 || v > 1 << 16 {
                return Err(bad(key, "must be between 1 and 65536"));
            }
        }
        if !self.rope_dim.is_multiple_of(2) {
            return Err(bad("qk_rope_head_dim", "must be even"));
        }
        Ok(self)
    }

    /// From a transformers DeepSeek `config.json`.
    pub(super) fn from_hf(cfg: &Value) -> Result<Self> {
        let req = |k: &str| required(cfg, k);
        MlaConfig {
            q_lora_rank: usize_at(cfg, "q_lora_rank")?,
            kv_lora_rank: req("kv_lora_rank")?,
            rope_dim: req("qk_rope_head_dim")?,
            nope_dim: req("qk_nope_head_dim")?,
            v_dim: req("v_head_dim")?,
        }
        .validate()
    }

    /// From `deepseek2.*` metadata. llama.cpp's converter writes the
    /// absorbed (MQA) view as `key_length`/`value_length` and the per-head
    /// sizes as `key_length_mla`/`value_length_mla`; older files have only
    /// the latter meaning under the former names.
    pub(super) fn from_gguf(g: &GgufFile, arch: &str) -> Result<Self> {
        let key = |k: &str| format!("{arch}.{k}");
        let req = |k: &str| -> Result<usize> {
            g.get_usize(&key(k))?
                .ok_or_else(|| ConfigError::Missing(key(k)))
        };
        let rope_dim = req("rope.dimension_count")?;
        let (k_len, v_len) = match (
            g.get_usize(&key("attention.key_length_mla"))?,
            g.get_usize(&key("attention.value_length_mla"))?,
        ) {
            (Some(k), Some(v)) => (k, v),
            _ => (req("attention.key_length")?, req("attention.value_length")?),
        };
        MlaConfig {
            q_lora_rank: g.get_usize(&key("attention.q_lora_rank"))?,
            kv_lora_rank: req("attention.kv_lora_rank")?,
            rope_dim,
            nope_dim: k_len.checked_sub(rope_dim).ok_or_else(|| {
                invalid(
                    key("attention.key_length_mla"),
                    "is shorter than the rotary dimension",
                )
            })?,
            v_dim: v_len,
        }
        .validate()
    }
}
