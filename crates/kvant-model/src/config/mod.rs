//! The Llama-family configuration: one struct with switches for every
//! supported variant, read from GGUF metadata or a Hugging Face `config.json`.
//!
//! Unknown keys are ignored; a missing required key is an error naming it.

use crate::gguf::GgufFile;
use kvant_kernels::activation::Activation;
use kvant_kernels::rope::RopeStyle;
use rope::{apply_scaling, parse_gguf_scaling, parse_hf_scaling};
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("missing required config key `{0}`")]
    Missing(String),
    #[error("config key `{key}` has an invalid value: {why}")]
    Invalid { key: String, why: String },
    #[error(
        "unsupported architecture `{0}` (supported: llama, mistral, qwen2, qwen3, gemma3, \
         mixtral, qwen2moe, qwen3moe, deepseek2, deepseek3, deepseek32, qwen3next, qwen35, \
         qwen35moe, kimi_linear)"
    )]
    UnsupportedArch(String),
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
}

type Result<T> = std::result::Result<T, ConfigError>;

mod experts;
mod indexer;
mod linear;
mod mla;
mod rope;

pub use experts::{ExpertsConfig, SharedExperts};
pub use indexer::IndexerConfig;
pub use linear::{LinearConfig, LinearLayout};
pub use mla::MlaConfig;
pub use rope::RopeScaling;

/// Which member of the family; decides the defaults the switches take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    DeepseekV2,
    DeepseekV3,
    /// DeepSeek-V3 with indexer-selected sparse attention.
    DeepseekV32,
    /// Gated DeltaNet layers beside gated full attention, MoE (Qwen3-Next).
    Qwen3Next,
    /// The same hybrid with a dense FFN (Qwen3.5) or MoE (Qwen3.5-MoE).
    Qwen35,
    Qwen35Moe,
    /// Kimi Delta Attention layers beside latent attention without
    /// positions (NoPE), DeepSeek-V3-style MoE (Kimi Linear).
    KimiLinear,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Mixtral => "mixtral",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::DeepseekV2 => "deepseek2",
            Arch::DeepseekV3 => "deepseek3",
            Arch::DeepseekV32 => "deepseek32",
            Arch::Qwen3Next => "qwen3next",
            Arch::Qwen35 => "qwen35",
            Arch::Qwen35Moe => "qwen35moe",
            Arch::KimiLinear => "kimi_linear",
        }
    }
}

#[derive(Clone, Debug)]
pub struct RopeConfig {
    pub theta: f32,
    /// Rotated dimensions per head (≤ head_dim).
    pub dim: usize,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
    /// Base for sliding-window layers when it differs (Gemma 3's local rope).
    pub local_theta: Option<f32>,
    /// No positions at all (Kimi Linear's latent attention): every
    /// frequency is zero, so the rotation is the identity (cos 0 = 1 and
    /// sin 0 = 0 exactly) and the rope path runs unchanged.
    pub nope: bool,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_context: usize,
    pub rms_eps: f32,
    pub rope: RopeConfig,
    /// Attention window of sliding layers (all layers unless `sliding_layers` says otherwise).
    pub sliding_window: Option<usize>,
    /// Per layer: does it use the sliding window? Empty means "every layer, if a window is set".
    pub sliding_layers: Vec<bool>,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied_embeddings: bool,
    pub activation: Activation,
    /// Softmax scale `1/sqrt(d)`, with `d` = head_dim or Gemma's `query_pre_attn_scalar`.
    pub attn_scale: f32,
    /// Gemma multiplies embeddings by `sqrt(hidden)` and wraps FFN/attention in extra norms.
    pub gemma: bool,
    /// Routed experts in place of the dense FFN (in the layers it says).
    pub experts: Option<ExpertsConfig>,
    /// Multi-head latent attention in place of multi-head attention; then
    /// `n_kv_heads` is 1 (one latent per token) and `head_dim` is the
    /// per-head query/key size before absorption.
    pub mla: Option<MlaConfig>,
    /// DeepSeek sparse attention: every latent-attention layer's indexer.
    pub indexer: Option<IndexerConfig>,
    /// Multi-token-prediction layers stored after the main ones
    /// (DeepSeek-V3's `num_nextn_predict_layers`).
    pub mtp_layers: usize,
    /// Linear-attention (Gated DeltaNet) layers beside the full-attention
    /// ones, which `layers` of it leaves out.
    pub linear: Option<LinearConfig>,
    /// Full attention multiplies its output by `sigmoid(gate)`, a second
    /// query-sized projection stored interleaved with the query per head
    /// (Qwen3-Next, Qwen3.5).
    pub attn_output_gate: bool,
    /// Every RMSNorm scales by `1 + w` (Gemma 3, Qwen3-Next, Qwen3.5):
    /// Hugging Face checkpoints store `w`, GGUF converters add the 1.
    pub zero_centered_norms: bool,
}

impl ModelConfig {
    /// Whether layer `layer` is a linear-attention layer.
    pub fn is_linear(&self, layer: usize) -> bool {
        self.linear.as_ref().is_some_and(|l| l.is_linear(layer))
    }

    /// Layers with attention over cached rows (all but the linear ones).
    pub fn attention_layers(&self) -> usize {
        (0..self.n_layers).filter(|&i| !self.is_linear(i)).count()
    }

    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some() && self.sliding_layers.get(layer).copied().unwrap_or(true)
    }

    /// Inverse rotary frequencies for a layer, with scaling folded in.
    pub fn inv_freq(&self, layer: usize, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let theta = match (self.rope.local_theta, self.is_sliding(layer)) {
            (Some(local), true) => local,
            _ => self.rope.theta,
        };
        let d = self.rope.dim;
        if self.rope.nope {
            return vec![0.0; d / 2];
        }
        let mut inv: Vec<f32> = (0..d / 2)
            .map(|i| (1.0 / (theta as f64).powf((2 * i) as f64 / d as f64)) as f32)
            .collect();
        // Gemma 3 applies the global scaling only to full-attention layers.
        let scaled = !(self.rope.local_theta.is_some() && self.is_sliding(layer));
        if let Some(ff) = freq_factors {
            // GGUF stores Llama 3 scaling as per-frequency divisors.
            for (f, &div) in inv.iter_mut().zip(ff) {
                *f /= div;
            }
        } else if scaled {
            apply_scaling(&mut inv, &self.rope.scaling, d, theta);
        }
        inv
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    fn validate(self) -> Result<Self> {
        let bad = |key: &str, why: &str| ConfigError::Invalid {
            key: key.into(),
            why: why.into(),
        };
        for (key, v) in [
            ("hidden_size", self.hidden),
            ("num_hidden_layers", self.n_layers),
            ("num_attention_heads", self.n_heads),
            ("num_key_value_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate),
            ("vocab_size", self.vocab),
            ("max_position_embeddings", self.max_context),
        ] {
            if v == 0 {
                return Err(bad(key, "must be positive"));
            }
            if v > 1 << 24 {
                return Err(bad(key, "is implausibly large"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                "must divide the number of attention heads",
            ));
        }
        if self.rope.dim > self.head_dim || !self.rope.dim.is_multiple_of(2) {
            return Err(bad("rope dimension", "must be even and at most head_dim"));
        }
        if self.rope.dim / 2 > kvant_kernels::rope::MAX_ROPE_HALF {
            return Err(bad("rope dimension", "is larger than kvant supports (512)"));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 0.0) {
            return Err(bad("rope_theta", "must be a positive number"));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(bad("rms_norm_eps", "must be a non-negative number"));
        }
        if self.sliding_window == Some(0) {
            return Err(bad("sliding_window", "must be positive"));
        }
        if self.mtp_layers > 16 {
            return Err(bad("num_nextn_predict_layers", "is implausibly large"));
        }
        Ok(self)
    }

    /// Reads `{arch}.*` keys as llama.cpp's converter writes them.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.architecture()?.to_string();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            "qwen2moe" => Arch::Qwen2Moe,
            "qwen3moe" => Arch::Qwen3Moe,
            "deepseek2" => Arch::DeepseekV2,
            "deepseek32" => Arch::DeepseekV32,
            "qwen3next" => Arch::Qwen3Next,
            "qwen35" => Arch::Qwen35,
            "qwen35moe" => Arch::Qwen35Moe,
            "kimi-linear" => Arch::KimiLinear,
            other => return Err(ConfigError::UnsupportedArch(other.into())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        // llama.cpp counts multi-token-prediction (NextN) layers in
        // `block_count` and says how many of the last blocks they are.
        let mtp_layers = g.get_usize(&key("nextn_predict_layers"))?.unwrap_or(0);
        let n_layers = g
            .get_usize(&key("block_count"))?
            .ok_or_else(|| ConfigError::Missing(key("block_count")))?
            .checked_sub(mtp_layers)
            .ok_or_else(|| ConfigError::Invalid {
                key: key("nextn_predict_layers"),
                why: "is more than the block count".into(),
            })?;
        let experts = ExpertsConfig::from_gguf(g, &arch_name, n_layers)?;
        let arch = match (arch, &experts) {
            (Arch::Llama, Some(_)) => Arch::Mixtral,
            (a, _) => a,
        };
        let mla = match arch {
            Arch::DeepseekV2 | Arch::DeepseekV32 | Arch::KimiLinear => {
                Some(MlaConfig::from_gguf(g, &arch_name)?)
            }
            _ => None,
        };
        let indexer = match (arch, mla) {
            (Arch::DeepseekV32, Some(m)) => {
                Some(IndexerConfig::from_gguf(g, &arch_name, m.rope_dim)?)
            }
            _ => None,
        };
        let linear = match arch {
            Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe => {
                Some(LinearConfig::from_gguf(g, &arch_name, n_layers)?)
            }
            Arch::KimiLinear => Some(LinearConfig::from_gguf_kimi(g, &arch_name, n_layers)?),
            _ => None,
        };
        let qwen_hybrid = linear.is_some() && arch != Arch::KimiLinear;
        let req = |k: &str| -> Result<usize> {
            g.get_usize(&key(k))?
                .ok_or_else(|| ConfigError::Missing(key(k)))
        };
        let hidden = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        // Kimi Linear's converter writes one KV head count per layer (0
        // marks its linear layers; latent attention has one).
        let n_kv_heads = match arch {
            Arch::KimiLinear => 1,
            _ => g
                .get_usize(&key("attention.head_count_kv"))?
                .unwrap_or(n_heads),
        };
        let head_dim = match (mla, g.get_usize(&key("attention.key_length"))?) {
            (Some(m), _) => m.qk_dim(),
            (None, Some(d)) => d,
            (None, None) => split_heads(hidden, n_heads, &key("attention.head_count"))?,
        };
        let vocab = match g.get_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => g
                .get_str_array("tokenizer.ggml.tokens")?
                .map(|t| t.len())
                .ok_or_else(|| ConfigError::Missing(key("vocab_size")))?,
        };
        let scaling = parse_gguf_scaling(g, &arch_name)?;
        let softmax_factor = scaling.softmax_factor();
        let gemma = arch == Arch::Gemma3;
        let sliding_window = g.get_usize(&key("attention.sliding_window"))?;
        // llama.cpp hard-codes Gemma 3's pattern: every 6th layer is global.
        let sliding_layers = if gemma {
            (0..n_layers).map(|i| (i + 1) % 6 != 0).collect()
        } else {
            Vec::new()
        };
        let style = if matches!(
            arch,
            Arch::Llama | Arch::Mistral | Arch::Mixtral | Arch::DeepseekV2 | Arch::DeepseekV32
        ) {
            RopeStyle::Interleaved
        } else {
            RopeStyle::Neox
        };
        ModelConfig {
            arch,
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate: match (&experts, g.get_usize(&key("feed_forward_length"))?) {
                (_, Some(ff)) => ff,
                (Some(e), None) => e.ff,
                (None, None) => return Err(ConfigError::Missing(key("feed_forward_length"))),
            },
            vocab,
            max_context: req("context_length")?,
            rms_eps: g
                .get_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope: RopeConfig {
                theta: g.get_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
                dim: g
                    .get_usize(&key("rope.dimension_count"))?
                    .unwrap_or(head_dim),
                style,
                scaling,
                local_theta: gemma.then_some(10_000.0),
                nope: arch == Arch::KimiLinear,
            },
            sliding_window,
            sliding_layers,
            qkv_bias: false,
            qk_norm: qwen_hybrid || matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
            tied_embeddings: g.tensor_info("output.weight").is_none(),
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            attn_scale: softmax_factor / (head_dim as f32).sqrt(),
            gemma,
            experts,
            mla,
            indexer,
            mtp_layers,
            linear,
            attn_output_gate: qwen_hybrid,
            zero_centered_norms: gemma || qwen_hybrid,
        }
        .validate()
    }

    /// Reads a transformers `config.json` (either `rope_theta`/`rope_scaling`
    /// or transformers 5's `rope_parameters`).
    pub fn from_hf_json(cfg: &Value) -> Result<Self> {
        let model_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ConfigError::Missing("model_type".into()))?;
        // Qwen3.5 checkpoints are vision-language models whose text model
        // sits in `text_config` (with a `_text` model type of its own).
        if let ("qwen3_5" | "qwen3_5_moe", Some(text)) = (model_type, cfg.get("text_config")) {
            if text.get("model_type").and_then(Value::as_str) == Some(model_type) {
                return Err(ConfigError::Invalid {
                    key: "text_config.model_type".into(),
                    why: format!("`{model_type}` nests itself"),
                });
            }
            let mut text = text.clone();
            if let Some(obj) = text.as_object_mut() {
                obj.insert("model_type".into(), format!("{model_type}_text").into());
                // The text model's own keys win; shared ones live at the top.
                for (k, v) in cfg.as_object().into_iter().flatten() {
                    if k != "text_config" && k != "model_type" && !obj.contains_key(k) {
                        obj.insert(k.clone(), v.clone());
                    }
                }
            }
            return Self::from_hf_json(&text);
        }
        let arch = match model_type {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3_text" => Arch::Gemma3,
            "mixtral" => Arch::Mixtral,
            "qwen2_moe" => Arch::Qwen2Moe,
            "qwen3_moe" => Arch::Qwen3Moe,
            "deepseek_v2" => Arch::DeepseekV2,
            "deepseek_v3" => Arch::DeepseekV3,
            "deepseek_v32" => Arch::DeepseekV32,
            "qwen3_next" => Arch::Qwen3Next,
            "qwen3_5_text" => Arch::Qwen35,
            "qwen3_5_moe_text" => Arch::Qwen35Moe,
            "kimi_linear" => Arch::KimiLinear,
            other => return Err(ConfigError::UnsupportedArch(other.into())),
        };
        let n_layers_hint = json_usize(cfg, "num_hidden_layers")?.unwrap_or(0);
        let linear = match arch {
            Arch::Qwen3Next => Some(LinearConfig::from_hf(
                cfg,
                LinearLayout::Grouped,
                n_layers_hint,
            )?),
            Arch::Qwen35 | Arch::Qwen35Moe => Some(LinearConfig::from_hf(
                cfg,
                LinearLayout::Split,
                n_layers_hint,
            )?),
            Arch::KimiLinear => Some(LinearConfig::from_hf_kimi(cfg, n_layers_hint)?),
            _ => None,
        };
        let qwen_hybrid = linear.is_some() && arch != Arch::KimiLinear;
        let deepseek = matches!(
            arch,
            Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::DeepseekV32 | Arch::KimiLinear
        );
        let mla = match deepseek {
            true => Some(MlaConfig::from_hf(cfg)?),
            false => None,
        };
        let indexer = match (arch, mla) {
            (Arch::DeepseekV32, Some(m)) => {
                if m.q_lora_rank.is_none() {
                    // The indexer's queries come from the query latent.
                    return Err(ConfigError::Missing("q_lora_rank".into()));
                }
                Some(IndexerConfig::from_hf(cfg, m.rope_dim)?)
            }
            _ => None,
        };
        let usize_key = |k: &str| json_usize(cfg, k);
        let req = |k: &str| usize_key(k)?.ok_or_else(|| ConfigError::Missing(k.into()));
        let f32_in = |obj: &Value, k: &str| -> Result<Option<f32>> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(|v| Some(v as f32))
                    .ok_or_else(|| ConfigError::Invalid {
                        key: k.into(),
                        why: format!("expected a number, found {v}"),
                    }),
            }
        };
        let hidden = req("hidden_size")?;
        let n_heads = req("num_attention_heads")?;
        let n_kv_heads = match mla {
            Some(_) => 1,
            None => usize_key("num_key_value_heads")?.unwrap_or(n_heads),
        };
        let head_dim = match (mla, usize_key("head_dim")?) {
            (Some(m), _) => m.qk_dim(),
            (None, Some(d)) => d,
            (None, None) => split_heads(hidden, n_heads, "num_attention_heads")?,
        };
        let gemma = arch == Arch::Gemma3;
        // transformers 5 nests rope settings; older files keep them top-level.
        let rope_params = cfg.get("rope_parameters").filter(|v| v.is_object());
        let (theta, scaling_obj, local_theta) = match rope_params {
            Some(rp) if rp.get("full_attention").is_some() => {
                // Per-layer-type parameters (Gemma 3 in transformers 5).
                let full = &rp["full_attention"];
                let local = rp.get("sliding_attention");
                let local_theta = match local {
                    Some(l) => f32_in(l, "rope_theta")?,
                    None => None,
                };
                (f32_in(full, "rope_theta")?, Some(full.clone()), local_theta)
            }
            Some(rp) => (f32_in(rp, "rope_theta")?, Some(rp.clone()), None),
            None => (
                f32_in(cfg, "rope_theta")?,
                cfg.get("rope_scaling").cloned(),
                f32_in(cfg, "rope_local_base_freq")?,
            ),
        };
        let scaling = parse_hf_scaling(scaling_obj.as_ref())?;
        let sliding_window = usize_key("sliding_window")?;
        let use_sw = cfg.get("use_sliding_window").and_then(Value::as_bool);
        let n_layers = req("num_hidden_layers")?;
        let sliding_layers: Vec<bool> = match cfg.get("layer_types").and_then(Value::as_array) {
            Some(types) => types
                .iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect(),
            None if gemma => {
                let pattern = usize_key("sliding_window_pattern")?.unwrap_or(6).max(1);
                (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
            }
            None => Vec::new(),
        };
        // Qwen2 configs carry a window with `use_sliding_window: false`.
        let sliding_window = match (arch, use_sw) {
            (_, Some(false)) => None,
            (Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe, None) => None,
            _ => sliding_window,
        };
        let attn_bias = match arch {
            Arch::Qwen2Moe => cfg.get("qkv_bias").and_then(Value::as_bool).unwrap_or(true),
            // DeepSeek's attention biases sit on other projections; they
            // load when present.
            Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::DeepseekV32 | Arch::KimiLinear => false,
            _ => cfg
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(arch == Arch::Qwen2),
        };
        let activation = match cfg
            .get("hidden_act")
            .or_else(|| cfg.get("hidden_activation"))
            .and_then(Value::as_str)
        {
            None | Some("silu") | Some("swish") => Activation::Silu,
            Some("gelu_pytorch_tanh") | Some("gelu_tanh") => Activation::GeluTanh,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    key: "hidden_act".into(),
                    why: format!("`{other}` is not supported"),
                })
            }
        };
        let attn_scale = match (gemma, f32_in(cfg, "query_pre_attn_scalar")?) {
            (true, Some(s)) => 1.0 / s.sqrt(),
            _ => scaling.softmax_factor() / (head_dim as f32).sqrt(),
        };
        let partial = match f32_in(cfg, "partial_rotary_factor")? {
            Some(p) => p,
            None => match rope_params {
                Some(rp) => f32_in(rp, "partial_rotary_factor")?.unwrap_or(1.0),
                None => 1.0,
            },
        };
        let rope_dim = match mla {
            Some(m) => m.rope_dim,
            None => ((head_dim as f32 * partial) as usize) & !1,
        };
        // DeepSeek rotates interleaved pairs (V2 as complex numbers, V3
        // unless `rope_interleave` is false).
        // transformers' V3.2 always interleaves (its MLA has no switch).
        let interleaved = match arch {
            Arch::DeepseekV2 | Arch::DeepseekV32 => true,
            Arch::DeepseekV3 => cfg
                .get("rope_interleave")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            _ => false,
        };
        let experts = ExpertsConfig::from_hf(cfg, arch, n_layers)?;
        let mtp_layers = match arch {
            Arch::DeepseekV3 | Arch::DeepseekV32 => {
                usize_key("num_nextn_predict_layers")?.unwrap_or(0)
            }
            _ => 0,
        };
        ModelConfig {
            arch,
            hidden,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            intermediate: match (usize_key("intermediate_size")?, &experts) {
                (Some(ff), _) => ff,
                // Qwen3.5-MoE has no dense layer and no dense size.
                (None, Some(e)) if e.layers.iter().all(|&m| m) => e.ff,
                (None, _) => return Err(ConfigError::Missing("intermediate_size".into())),
            },
            vocab: req("vocab_size")?,
            // Kimi Linear's configs say `model_max_length`.
            max_context: match usize_key("max_position_embeddings")? {
                Some(n) => n,
                None => usize_key("model_max_length")?.unwrap_or(2048),
            },
            rms_eps: f32_in(cfg, "rms_norm_eps")?.unwrap_or(1e-6),
            rope: RopeConfig {
                theta: theta.unwrap_or(10_000.0),
                dim: rope_dim,
                style: if interleaved {
                    RopeStyle::Interleaved
                } else {
                    RopeStyle::Neox
                },
                scaling,
                local_theta: if gemma {
                    Some(local_theta.unwrap_or(10_000.0))
                } else {
                    None
                },
                nope: arch == Arch::KimiLinear,
            },
            sliding_window,
            sliding_layers,
            qkv_bias: attn_bias,
            qk_norm: qwen_hybrid || matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3),
            tied_embeddings: cfg
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(gemma),
            activation,
            attn_scale,
            gemma,
            experts,
            mla,
            indexer,
            mtp_layers,
            linear,
            attn_output_gate: qwen_hybrid,
            zero_centered_norms: gemma || qwen_hybrid,
        }
        .validate()
    }
}

/// `cfg[key]` as a count: absent or `null` is `None`, anything but a
/// non-negative integer an error naming the key.
fn json_usize(cfg: &Value, key: &str) -> Result<Option<usize>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .map(Some)
            .ok_or_else(|| ConfigError::Invalid {
                key: key.into(),
                why: format!("expected a non-negative integer, found {v}"),
            }),
    }
}

/// The head size when a config leaves it implicit: hidden / heads.
fn split_heads(hidden: usize, n_heads: usize, heads_key: &str) -> Result<usize> {
    hidden.checked_div(n_heads).ok_or(ConfigError::Invalid {
        key: heads_key.into(),
        why: "must be positive".into(),
    })
}
