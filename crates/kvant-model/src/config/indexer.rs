//! DeepSeek sparse attention (DSA, DeepSeek-V3.2) indexer settings: per
//! layer a "lightning indexer" of `index_n_heads` heads of `index_head_dim`
//! scores every earlier token, and latent attention reads only the
//! `index_topk` best.

use super::error::{invalid, ConfigError, Result};
use super::json::required;
use crate::gguf::GgufFile;
use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerConfig {
    pub n_heads: usize,
    /// Size of an indexer query head and of the one key per token; its
    /// first `qk_rope_head_dim` values rotate (half-split pairs).
    pub head_dim: usize,
    /// Positions each query attends to once it sees more.
    pub topk: usize,
}

impl IndexerConfig {
    /// Checks the sizes against the rotary part they must hold.
    pub(super) fn validate(self, rope_dim: usize) -> Result<Self> {
        let bad = |key: &str, why: &str| invalid(key, why);
        for (key, v) in [
            ("index_n_heads", self.n_heads),
            ("index_head_dim", self.head_dim),
            ("index_topk", self.topk),
        ] {
            if v == 0 || v > 1 << 20 {
                return Err(bad(key, "must be between 1 and 2^20"));
            }
        }
        if rope_dim > self.head_dim {
            return Err(bad(
                "index_head_dim",
                "must hold the rotary part (qk_rope_head_dim)",
            ));
        }
        Ok(self)
    }

    /// From a transformers `deepseek_v32` `config.json`.
    pub(super) fn from_hf(cfg: &Value, rope_dim: usize) -> Result<Self> {
        let req = |k: &str| required(cfg, k);
        IndexerConfig {
            n_heads: req("index_n_heads")?,
            head_dim: req("index_head_dim")?,
            topk: req("index_topk")?,
        }
        .validate(rope_dim)
    }

    /// From `{arch}.attention.indexer.*` as llama.cpp's converter writes it.
    pub(super) fn from_gguf(g: &GgufFile, arch: &str, rope_dim: usize) -> Result<Self> {
        let req = |k: &str| -> Result<usize> {
            let key = format!("{arch}.attention.indexer.{k}");
            g.get_usize(&key)?.ok_or(ConfigError::Missing(key))
        };
        IndexerConfig {
            n_heads: req("head_count")?,
            head_dim: req("key_length")?,
            topk: req("top_k")?,
        }
        .validate(rope_dim)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{ConfigError, ModelConfig};
    use serde_json::Value;

    fn fixture() -> Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/models/deepseek-v32/config.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).expect("config")).expect("json")
    }

    #[test]
    fn reads_the_fixture() {
        let c = ModelConfig::from_hf_json(&fixture()).expect("config");
        let ix = c.indexer.expect("indexer");
        assert_eq!((ix.n_heads, ix.head_dim, ix.topk), (8, 32, 8));
        assert_eq!(c.arch.name(), "deepseek32");
    }

    /// Bad indexer settings are errors naming the key, never a panic later.
    #[test]
    fn rejects_bad_indexer_settings() {
        for (key, value, want) in [
            ("index_topk", Value::from(0), "index_topk"),
            ("index_head_dim", Value::from(8), "index_head_dim"),
            ("index_n_heads", Value::from(-1), "index_n_heads"),
            ("index_topk", Value::Null, "index_topk"),
            ("q_lora_rank", Value::Null, "q_lora_rank"),
        ] {
            let mut cfg = fixture();
            cfg[key] = value;
            let err = ModelConfig::from_hf_json(&cfg).expect_err(key);
            assert!(
                matches!(&err, ConfigError::Invalid { .. } | ConfigError::Missing(_))
                    && err.to_string().contains(want),
                "{key}: {err}"
            );
        }
    }
}
