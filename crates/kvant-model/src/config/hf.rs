//! Reads a model's settings from a transformers `config.json`, with
//! transformers' defaults for the keys it leaves out; a vision-language
//! checkpoint's text model comes out of its `text_config`.

use super::arch::Arch;
use super::error::{invalid, ConfigError, Result};
use super::experts::ExpertSettings;
use super::indexer::IndexerConfig;
use super::json::{f32_at, flag, required, usize_at};
use super::linear::{LinearConfig, LinearLayout};
use super::mla::MlaConfig;
use super::model::ModelConfig;
use super::rope::RopeSettings;
use super::settings::{layer_count, ModelSettings};
use super::v4::V4Config;
use kvant_kernels::activation::{Activation, Limit};
use serde_json::Value;

impl ModelConfig {
    /// Reads a transformers `config.json` (either `rope_theta`/`rope_scaling`
    /// or transformers 5's `rope_parameters`).
    pub fn from_hf_json(cfg: &Value) -> Result<Self> {
        let model_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ConfigError::Missing("model_type".into()))?;
        match (model_type, cfg.get("text_config")) {
            ("qwen3_5" | "qwen3_5_moe", Some(text)) => {
                Self::from_hf_json(&text_model(cfg, model_type, text)?)
            }
            _ => ModelSettings::from_hf(cfg, model_type)?.build(),
        }
    }
}

/// Qwen3.5 checkpoints are vision-language models whose text model sits in
/// `text_config` (with a `_text` model type of its own): its own keys
/// win, shared ones live at the top.
fn text_model(cfg: &Value, model_type: &str, text: &Value) -> Result<Value> {
    if text.get("model_type").and_then(Value::as_str) == Some(model_type) {
        return Err(invalid(
            "text_config.model_type",
            format!("`{model_type}` nests itself"),
        ));
    }
    let mut text = text.clone();
    if let Some(obj) = text.as_object_mut() {
        obj.insert("model_type".into(), format!("{model_type}_text").into());
        for (k, v) in cfg.as_object().into_iter().flatten() {
            if k != "text_config" && k != "model_type" && !obj.contains_key(k) {
                obj.insert(k.clone(), v.clone());
            }
        }
    }
    Ok(text)
}

impl ModelSettings {
    fn from_hf(cfg: &Value, model_type: &str) -> Result<Self> {
        let arch = Arch::from_hf(model_type)
            .ok_or_else(|| ConfigError::UnsupportedArch(model_type.into()))?;
        let n_layers_hint = match usize_at(cfg, "num_hidden_layers")? {
            Some(n) => layer_count("num_hidden_layers", n)?,
            None => 0,
        };
        let linear = match arch.linear_layout() {
            Some(LinearLayout::Kda) => Some(LinearConfig::from_hf_kimi(cfg, n_layers_hint)?),
            Some(layout) => Some(LinearConfig::from_hf(cfg, layout, n_layers_hint)?),
            None => None,
        };
        let mla = match arch.latent_attention() {
            true => Some(MlaConfig::from_hf(cfg)?),
            false => None,
        };
        let indexer = match (arch.sparse_indexer(), mla) {
            (true, Some(m)) => {
                if m.q_lora_rank.is_none() {
                    // The indexer's queries come from the query latent.
                    return Err(ConfigError::Missing("q_lora_rank".into()));
                }
                Some(IndexerConfig::from_hf(cfg, m.rope_dim)?)
            }
            _ => None,
        };
        let hidden = required(cfg, "hidden_size")?;
        let n_heads = required(cfg, "num_attention_heads")?;
        // transformers' DeepSeek configs count the expanded heads, which
        // the cache does not hold.
        let n_kv_heads = match arch.latent_attention() {
            true => None,
            false => Some(usize_at(cfg, "num_key_value_heads")?.unwrap_or(n_heads)),
        };
        let head_dim = usize_at(cfg, "head_dim")?;
        let rope = RopeSettings::from_hf(cfg, arch)?;
        let sliding_window = usize_at(cfg, "sliding_window")?;
        let n_layers = layer_count("num_hidden_layers", required(cfg, "num_hidden_layers")?)?;
        let sliding_layers = cfg
            .get("layer_types")
            .and_then(Value::as_array)
            .map(|types| {
                types
                    .iter()
                    .map(|t| t.as_str() == Some("sliding_attention"))
                    .collect()
            });
        let sliding_pattern = match (&sliding_layers, arch.gemma()) {
            (None, true) => usize_at(cfg, "sliding_window_pattern")?,
            _ => None,
        };
        // Qwen2 configs carry a window with `use_sliding_window: false`.
        let sliding_window = match (arch, flag(cfg, "use_sliding_window")) {
            (_, Some(false)) => None,
            (Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe, None) => None,
            _ => sliding_window,
        };
        let qkv_bias = match arch {
            Arch::Qwen2Moe => flag(cfg, "qkv_bias").unwrap_or(true),
            // DeepSeek's attention biases sit on other projections; they
            // load when present.
            Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::DeepseekV32 | Arch::KimiLinear => false,
            _ => flag(cfg, "attention_bias").unwrap_or(arch == Arch::Qwen2),
        };
        let v4 = match arch {
            Arch::DeepseekV4 => {
                let d = head_dim.ok_or_else(|| ConfigError::Missing("head_dim".into()))?;
                Some(V4Config::from_hf(cfg, d, n_layers)?)
            }
            _ => None,
        };
        // DeepSeek-V4 clamps every SwiGLU (routed and shared experts,
        // transformers' `swiglu_limit`).
        let activation = match (arch, activation(cfg)?) {
            (Arch::DeepseekV4, Activation::Silu) => {
                let limit = f32_at(cfg, "swiglu_limit")?.unwrap_or(10.0);
                if !(limit.is_finite() && limit > 0.0) {
                    return Err(invalid("swiglu_limit", format!("{limit}")));
                }
                Activation::SiluClamped(Limit::new(limit))
            }
            (_, a) => a,
        };
        let query_pre_attn_scalar = f32_at(cfg, "query_pre_attn_scalar")?;
        let experts = ExpertSettings::from_hf(cfg, arch, n_layers)?
            .map(ExpertSettings::build)
            .transpose()?;
        let mtp_layers = match arch {
            Arch::DeepseekV3 | Arch::DeepseekV32 | Arch::DeepseekV4 => {
                usize_at(cfg, "num_nextn_predict_layers")?.unwrap_or(0)
            }
            _ => 0,
        };
        let intermediate = match (usize_at(cfg, "intermediate_size")?, &experts) {
            (Some(ff), _) => ff,
            // Qwen3.5-MoE has no dense layer and no dense size.
            (None, Some(e)) if e.layers.iter().all(|&m| m) => e.ff,
            (None, _) => return Err(ConfigError::Missing("intermediate_size".into())),
        };
        Ok(ModelSettings {
            arch,
            heads_key: "num_attention_heads".into(),
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate,
            vocab: required(cfg, "vocab_size")?,
            // Kimi Linear's configs say `model_max_length`.
            max_context: match usize_at(cfg, "max_position_embeddings")? {
                Some(n) => n,
                None => usize_at(cfg, "model_max_length")?.unwrap_or(2048),
            },
            rms_eps: f32_at(cfg, "rms_norm_eps")?.unwrap_or(1e-6),
            rope,
            sliding_window,
            sliding_layers,
            sliding_pattern,
            qkv_bias,
            tied_embeddings: flag(cfg, "tie_word_embeddings"),
            activation: Some(activation),
            query_pre_attn_scalar,
            mtp_layers,
            experts,
            mla,
            indexer,
            linear,
            v4,
        })
    }
}

/// `hidden_act` (Gemma: `hidden_activation`); silu where neither is set.
fn activation(cfg: &Value) -> Result<Activation> {
    match cfg
        .get("hidden_act")
        .or_else(|| cfg.get("hidden_activation"))
        .and_then(Value::as_str)
    {
        None | Some("silu") | Some("swish") => Ok(Activation::Silu),
        Some("gelu_pytorch_tanh") | Some("gelu_tanh") => Ok(Activation::GeluTanh),
        Some(other) => Err(invalid("hidden_act", format!("`{other}` is not supported"))),
    }
}
