//! Reads a model's settings from GGUF metadata: `{arch}.*` keys as
//! llama.cpp's converter writes them, with llama.cpp's defaults for the
//! keys it leaves out.

use super::arch::Arch;
use super::error::{invalid, ConfigError, Result};
use super::experts::ExpertSettings;
use super::indexer::IndexerConfig;
use super::linear::{LinearConfig, LinearLayout};
use super::mla::MlaConfig;
use super::model::ModelConfig;
use super::rope::RopeSettings;
use super::settings::{layer_count, ModelSettings};
use super::v4::V4Config;
use crate::gguf::GgufFile;
use kvant_kernels::activation::{Activation, Limit};

impl ModelConfig {
    /// Reads `{arch}.*` keys as llama.cpp's converter writes them.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        ModelSettings::from_gguf(g)?.build()
    }
}

impl ModelSettings {
    fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.architecture()?.to_string();
        let arch = Arch::from_gguf(&arch_name)
            .ok_or_else(|| ConfigError::UnsupportedArch(arch_name.clone()))?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let opt = |k: &str| g.get_usize(&key(k));
        let req =
            |k: &str| -> Result<usize> { opt(k)?.ok_or_else(|| ConfigError::Missing(key(k))) };
        // llama.cpp counts multi-token-prediction (NextN) layers in
        // `block_count` and says how many of the last blocks they are.
        let mtp_layers = opt("nextn_predict_layers")?.unwrap_or(0);
        let n_layers = layer_count(key("block_count"), req("block_count")?)?
            .checked_sub(mtp_layers)
            .ok_or_else(|| invalid(key("nextn_predict_layers"), "is more than the block count"))?;
        let experts = ExpertSettings::from_gguf(g, &arch_name, n_layers)?
            .map(ExpertSettings::build)
            .transpose()?;
        let mla = match arch.latent_attention() {
            true => Some(MlaConfig::from_gguf(g, &arch_name)?),
            false => None,
        };
        let indexer = match (arch.sparse_indexer(), mla) {
            (true, Some(m)) => Some(IndexerConfig::from_gguf(g, &arch_name, m.rope_dim)?),
            _ => None,
        };
        let linear = match arch.linear_layout() {
            Some(LinearLayout::Kda) => Some(LinearConfig::from_gguf_kimi(g, &arch_name, n_layers)?),
            Some(layout) => Some(LinearConfig::from_gguf(g, &arch_name, layout, n_layers)?),
            None => None,
        };
        let hidden = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        // Kimi Linear's converter writes one KV head count per layer (0
        // marks its linear layers; latent attention has one).
        let n_kv_heads = match arch {
            Arch::KimiLinear => None,
            _ => Some(opt("attention.head_count_kv")?.unwrap_or(n_heads)),
        };
        let head_dim = opt("attention.key_length")?;
        let vocab = match opt("vocab_size")? {
            Some(v) => v,
            None => g
                .get_str_array("tokenizer.ggml.tokens")?
                .map(|t| t.len())
                .ok_or_else(|| ConfigError::Missing(key("vocab_size")))?,
        };
        let rope = RopeSettings::from_gguf(g, &arch_name)?;
        let sliding_window = opt("attention.sliding_window")?;
        let v4 = match arch {
            Arch::DeepseekV4 => {
                let d =
                    head_dim.ok_or_else(|| ConfigError::Missing(key("attention.key_length")))?;
                Some(V4Config::from_gguf(g, &arch_name, d, n_layers)?)
            }
            _ => None,
        };
        let activation = match arch {
            Arch::DeepseekV4 => Some(v4_activation(g, &arch_name)?),
            _ => None,
        };
        let intermediate = match (&experts, opt("feed_forward_length")?) {
            (_, Some(ff)) => ff,
            (Some(e), None) => e.ff,
            (None, None) => return Err(ConfigError::Missing(key("feed_forward_length"))),
        };
        Ok(ModelSettings {
            arch,
            heads_key: key("attention.head_count"),
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate,
            vocab,
            max_context: req("context_length")?,
            rms_eps: g
                .get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope,
            sliding_window,
            // llama.cpp hard-codes Gemma 3's pattern (every 6th layer is global).
            sliding_layers: None,
            sliding_pattern: None,
            // GGUF promises no attention biases; they load where present.
            qkv_bias: false,
            tied_embeddings: Some(g.tensor_info("output.weight").is_none()),
            activation,
            query_pre_attn_scalar: None,
            mtp_layers,
            experts,
            mla,
            indexer,
            linear,
            v4,
        })
    }
}

/// DeepSeek-V4's SwiGLU clamps: llama.cpp's converter writes one limit
/// per layer for the routed experts (`swiglu_clamp_exp`) and one for the
/// shared expert (`swiglu_clamp_shexp`, the routed ones when absent), all
/// `swiglu_limit`; kvant runs one limit for every expert of every layer,
/// so differing limits are refused rather than run wrong. A limit of 0
/// (or none) clamps nothing, as in llama.cpp.
fn v4_activation(g: &GgufFile, arch: &str) -> Result<Activation> {
    let key = |k: &str| format!("{arch}.{k}");
    let exp = g.get_f32_array(&key("swiglu_clamp_exp"))?;
    let shexp = g.get_f32_array(&key("swiglu_clamp_shexp"))?;
    let all: Vec<f32> = exp
        .iter()
        .chain(&shexp)
        .flat_map(|a| a.iter().copied())
        .collect();
    match all.first() {
        None => Ok(Activation::Silu),
        Some(&l) if all.iter().any(|&x| x != l) => Err(invalid(
            key("swiglu_clamp_shexp"),
            "per-layer or per-expert-kind clamp limits that differ are not supported",
        )),
        Some(&l) if l <= 1e-6 => Ok(Activation::Silu),
        Some(&l) if l.is_finite() => Ok(Activation::SiluClamped(Limit::new(l))),
        Some(l) => Err(invalid(key("swiglu_clamp_exp"), format!("{l}"))),
    }
}
