//! A checkpoint of either format, opened from a path: the tensors by name and
//! where the configuration, tokenizer and chat template come from.

use crate::config::{Arch, ModelConfig};
use crate::gguf::GgufFile;
use crate::hf::HfDir;
use crate::ModelError;
use kvant_core::Tensor;
use std::path::Path;

pub enum Checkpoint {
    Gguf(GgufFile),
    Hf(HfDir),
}

impl Checkpoint {
    /// A `.gguf` file or a Hugging Face model directory.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        if path.is_dir() {
            Ok(Checkpoint::Hf(HfDir::open(path)?))
        } else if path.is_file() {
            Ok(Checkpoint::Gguf(GgufFile::open(path)?))
        } else {
            Err(ModelError::NotFound(path.display().to_string()))
        }
    }

    /// The model configuration, from GGUF metadata or `config.json`.
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        Ok(match self {
            Checkpoint::Gguf(g) => ModelConfig::from_gguf(g)?,
            Checkpoint::Hf(h) => ModelConfig::from_hf_json(h.config())?,
        })
    }

    /// Tensor `name`, of a type kvant computes with (an integer table
    /// where a weight belongs is an error; see [`Self::integers`]).
    pub fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        let t = match self {
            Checkpoint::Gguf(g) => g.tensor(name)?,
            Checkpoint::Hf(h) => h.tensor(name)?,
        };
        if t.dtype() == kvant_core::DType::I32 {
            return Err(ModelError::BadTensor {
                name: name.into(),
                why: "integers where a weight belongs".into(),
            });
        }
        Ok(t)
    }

    /// Tensor `name`'s integer values and shape (an index table, such as
    /// DeepSeek-V4's `tid2eid`).
    pub fn integers(&self, name: &str) -> Result<(Vec<i64>, Vec<usize>), ModelError> {
        match self {
            Checkpoint::Hf(h) => Ok(h.integers(name)?),
            Checkpoint::Gguf(g) => {
                let t = g.tensor(name)?;
                if t.dtype() != kvant_core::DType::I32 {
                    return Err(ModelError::BadTensor {
                        name: name.into(),
                        why: format!("{} values where integers belong", t.dtype().name()),
                    });
                }
                let values = t
                    .bytes()
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)
                    .collect();
                Ok((values, t.shape().to_vec()))
            }
        }
    }

    /// Drops this process's resident pages of the checkpoint's files once
    /// a model has copied out what it repacks (see
    /// [`kvant_core::Storage::release_all_resident_pages`]).
    #[cfg(unix)]
    pub fn release_resident_pages(&self) {
        match self {
            Checkpoint::Gguf(g) => g.release_resident_pages(),
            Checkpoint::Hf(h) => h.release_resident_pages(),
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        match self {
            Checkpoint::Gguf(g) => g.tensor_info(name).is_some(),
            Checkpoint::Hf(h) => h.has_tensor(name),
        }
    }

    /// Names of the tensors of one transformer layer, in this format's
    /// scheme: Gemma's four norms on Hugging Face files, and the norm
    /// before the FFN that llama.cpp names `post_attention_norm` in its
    /// Qwen3-Next / Qwen3.5 files.
    pub fn layer_names(&self, layer: usize, arch: Arch) -> LayerNames {
        let gemma = arch == Arch::Gemma3;
        let qwen_hybrid = matches!(arch, Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe);
        match self {
            Checkpoint::Gguf(_) => {
                let n = |s: &str| format!("blk.{layer}.{s}");
                LayerNames {
                    prefix: n(""),
                    attn_norm: n("attn_norm.weight"),
                    q: n("attn_q"),
                    k: n("attn_k"),
                    v: n("attn_v"),
                    o: n("attn_output"),
                    q_norm: n("attn_q_norm.weight"),
                    k_norm: n("attn_k_norm.weight"),
                    post_attn_norm: n("post_attention_norm.weight"),
                    ffn_norm: if qwen_hybrid {
                        n("post_attention_norm.weight")
                    } else {
                        n("ffn_norm.weight")
                    },
                    post_ffn_norm: n("post_ffw_norm.weight"),
                    gate: n("ffn_gate.weight"),
                    up: n("ffn_up.weight"),
                    down: n("ffn_down.weight"),
                }
            }
            // DeepSeek-V4 keeps DeepSeek's own names (transformers saves
            // them so), under `model.` or not.
            Checkpoint::Hf(_) if arch == Arch::DeepseekV4 => {
                LayerNames::deepseek_v4(&format!("{}layers.{layer}.", self.v4_root()))
            }
            Checkpoint::Hf(_) => {
                let n = |s: &str| format!("model.layers.{layer}.{s}");
                // transformers saves Kimi Linear's dense FFN where the
                // experts go; the published checkpoints say `mlp`.
                let ffn = match arch {
                    Arch::KimiLinear
                        if self.has_tensor(&n("block_sparse_moe.gate_proj.weight")) =>
                    {
                        "block_sparse_moe"
                    }
                    _ => "mlp",
                };
                LayerNames {
                    prefix: n(""),
                    attn_norm: n("input_layernorm.weight"),
                    q: n("self_attn.q_proj"),
                    k: n("self_attn.k_proj"),
                    v: n("self_attn.v_proj"),
                    o: n("self_attn.o_proj"),
                    q_norm: n("self_attn.q_norm.weight"),
                    k_norm: n("self_attn.k_norm.weight"),
                    post_attn_norm: n("post_attention_layernorm.weight"),
                    // Llama's "post_attention_layernorm" is the norm before its FFN.
                    ffn_norm: if gemma {
                        n("pre_feedforward_layernorm.weight")
                    } else {
                        n("post_attention_layernorm.weight")
                    },
                    post_ffn_norm: n("post_feedforward_layernorm.weight"),
                    gate: n(&format!("{ffn}.gate_proj.weight")),
                    up: n(&format!("{ffn}.up_proj.weight")),
                    down: n(&format!("{ffn}.down_proj.weight")),
                }
            }
        }
    }

    pub fn global_names(&self, arch: Arch) -> GlobalNames {
        match self {
            // transformers saves DeepSeek-V4's embedding and final norm
            // under its own names and the head under DeepSeek's; the
            // published checkpoints say `embed`, `norm` and `head`.
            Checkpoint::Hf(_) if arch == Arch::DeepseekV4 => match self.v4_root() {
                "model." => GlobalNames {
                    embed: "model.embed_tokens.weight",
                    final_norm: "model.norm.weight",
                    output: "head.weight",
                    rope_freqs: None,
                },
                _ => GlobalNames {
                    embed: "embed.weight",
                    final_norm: "norm.weight",
                    output: "head.weight",
                    rope_freqs: None,
                },
            },
            Checkpoint::Gguf(_) => GlobalNames {
                embed: "token_embd.weight",
                final_norm: "output_norm.weight",
                output: "output.weight",
                rope_freqs: Some("rope_freqs.weight"),
            },
            Checkpoint::Hf(_) => GlobalNames {
                embed: "model.embed_tokens.weight",
                final_norm: "model.norm.weight",
                output: "lm_head.weight",
                rope_freqs: None,
            },
        }
    }
}

/// Projection names are stems: append `.weight` / `.bias`.
pub struct LayerNames {
    /// What every tensor name of the layer starts with (`blk.3.`,
    /// `model.layers.3.`), for components that name their own tensors.
    pub prefix: String,
    pub attn_norm: String,
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    pub q_norm: String,
    pub k_norm: String,
    pub post_attn_norm: String,
    pub ffn_norm: String,
    pub post_ffn_norm: String,
    pub gate: String,
    pub up: String,
    pub down: String,
}

impl LayerNames {
    /// A DeepSeek-V4 block's names under `prefix` (`layers.3.`, or
    /// `mtp.0.` for the multi-token-prediction module's block).
    pub fn deepseek_v4(prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}{s}");
        LayerNames {
            prefix: n(""),
            attn_norm: n("attn_norm.weight"),
            q: n("attn.wq_a"),
            k: n("attn.wkv"),
            v: n("attn.wkv"),
            o: n("attn.wo_b"),
            q_norm: n("attn.q_norm.weight"),
            k_norm: n("attn.norm.weight"),
            post_attn_norm: String::new(),
            ffn_norm: n("ffn_norm.weight"),
            post_ffn_norm: String::new(),
            gate: n("ffn.shared_experts.w1.weight"),
            up: n("ffn.shared_experts.w3.weight"),
            down: n("ffn.shared_experts.w2.weight"),
        }
    }
}

impl Checkpoint {
    /// What DeepSeek-V4's layer names start with: `model.` as
    /// transformers saves them, nothing in the published checkpoints.
    pub(crate) fn v4_root(&self) -> &'static str {
        match self.has_tensor("model.layers.0.attn_norm.weight") {
            true => "model.",
            false => "",
        }
    }
}

pub struct GlobalNames {
    pub embed: &'static str,
    pub final_norm: &'static str,
    pub output: &'static str,
    pub rope_freqs: Option<&'static str>,
}
