//! Which member of the family a checkpoint is: its names in each format
//! and the switches that follow from the architecture alone. A new
//! architecture adds its names and its switches here.

use super::linear::LinearLayout;

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
    /// Sliding-window, compressed sparse (CSA) and heavily compressed
    /// (HCA) attention over one wide K = V head, mHC residual streams,
    /// hash-routed and sqrt-softplus MoE (DeepSeek-V4).
    DeepseekV4,
}

/// An architecture's names: kvant's own, llama.cpp's
/// `general.architecture` and transformers' `model_type`.
struct Names {
    kvant: &'static str,
    gguf: Option<&'static str>,
    hf: &'static str,
}

impl Arch {
    const ALL: [Arch; 16] = [
        Arch::Llama,
        Arch::Mistral,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Gemma3,
        Arch::Mixtral,
        Arch::Qwen2Moe,
        Arch::Qwen3Moe,
        Arch::DeepseekV2,
        Arch::DeepseekV3,
        Arch::DeepseekV32,
        Arch::Qwen3Next,
        Arch::Qwen35,
        Arch::Qwen35Moe,
        Arch::KimiLinear,
        Arch::DeepseekV4,
    ];

    fn names(self) -> Names {
        let n = |kvant, gguf, hf| Names { kvant, gguf, hf };
        match self {
            Arch::Llama => n("llama", Some("llama"), "llama"),
            Arch::Mistral => n("mistral", Some("mistral"), "mistral"),
            Arch::Qwen2 => n("qwen2", Some("qwen2"), "qwen2"),
            Arch::Qwen3 => n("qwen3", Some("qwen3"), "qwen3"),
            Arch::Gemma3 => n("gemma3", Some("gemma3"), "gemma3_text"),
            // llama.cpp writes Mixtral as `llama` with experts.
            Arch::Mixtral => n("mixtral", None, "mixtral"),
            Arch::Qwen2Moe => n("qwen2moe", Some("qwen2moe"), "qwen2_moe"),
            Arch::Qwen3Moe => n("qwen3moe", Some("qwen3moe"), "qwen3_moe"),
            Arch::DeepseekV2 => n("deepseek2", Some("deepseek2"), "deepseek_v2"),
            // llama.cpp writes DeepSeek-V3 as `deepseek2`; its metadata
            // says how it routes.
            Arch::DeepseekV3 => n("deepseek3", None, "deepseek_v3"),
            Arch::DeepseekV32 => n("deepseek32", Some("deepseek32"), "deepseek_v32"),
            Arch::Qwen3Next => n("qwen3next", Some("qwen3next"), "qwen3_next"),
            // Qwen3.5's text model, out of its `text_config`.
            Arch::Qwen35 => n("qwen35", Some("qwen35"), "qwen3_5_text"),
            Arch::Qwen35Moe => n("qwen35moe", Some("qwen35moe"), "qwen3_5_moe_text"),
            Arch::KimiLinear => n("kimi_linear", Some("kimi-linear"), "kimi_linear"),
            Arch::DeepseekV4 => n("deepseek4", Some("deepseek4"), "deepseek_v4"),
        }
    }

    pub fn name(self) -> &'static str {
        self.names().kvant
    }

    /// From llama.cpp's `general.architecture`.
    pub(super) fn from_gguf(name: &str) -> Option<Arch> {
        Self::ALL.into_iter().find(|a| a.names().gguf == Some(name))
    }

    /// From transformers' `model_type`.
    pub(super) fn from_hf(model_type: &str) -> Option<Arch> {
        Self::ALL.into_iter().find(|a| a.names().hf == model_type)
    }

    /// Gemma: embeddings times `sqrt(hidden)`, extra norms around the
    /// FFN and attention, a local rope base for sliding layers.
    pub(super) fn gemma(self) -> bool {
        self == Arch::Gemma3
    }

    /// Multi-head latent attention in place of multi-head attention.
    pub(super) fn latent_attention(self) -> bool {
        matches!(
            self,
            Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::DeepseekV32 | Arch::KimiLinear
        )
    }

    /// Latent attention reads only the tokens an indexer selects.
    pub(super) fn sparse_indexer(self) -> bool {
        self == Arch::DeepseekV32
    }

    /// Linear-attention layers beside the attention ones, stored so.
    pub(super) fn linear_layout(self) -> Option<LinearLayout> {
        match self {
            Arch::Qwen3Next => Some(LinearLayout::Grouped),
            Arch::Qwen35 | Arch::Qwen35Moe => Some(LinearLayout::Split),
            Arch::KimiLinear => Some(LinearLayout::Kda),
            _ => None,
        }
    }

    /// The Qwen hybrids (Qwen3-Next, Qwen3.5): gated attention output,
    /// zero-centred norms.
    pub(super) fn qwen_hybrid(self) -> bool {
        matches!(self, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe)
    }

    /// RMS-normed queries and keys per head.
    pub(super) fn qk_norm(self) -> bool {
        self.qwen_hybrid() || matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3)
    }

    /// Rotates interleaved pairs as transformers' code does (DeepSeek: V2
    /// as complex numbers, V3 unless `rope_interleave` is false, V3.2
    /// always); the rest rotate halves.
    pub(super) fn interleaved_rope(self) -> bool {
        matches!(
            self,
            Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::DeepseekV32
        )
    }

    /// No positions at all (Kimi Linear's latent attention).
    pub(super) fn nope(self) -> bool {
        self == Arch::KimiLinear
    }
}
