//! Tensor names of a MoE layer's router, experts and shared experts, by
//! checkpoint format and architecture.

use crate::checkpoint::Checkpoint;
use crate::config::{Arch, ModelConfig};

/// Tensor names of one layer's experts, by format and architecture.
pub(crate) struct Names {
    pub router: String,
    pub bias: String,
    /// `[n, ff, hidden]` tensors holding every expert (GGUF), or a
    /// per-expert name pattern with `{e}` (Hugging Face).
    pub gate: String,
    pub up: String,
    pub down: String,
    pub shared: [String; 3],
    pub shared_gate: String,
    /// DeepSeek-V4's token-id → experts table of a hash-routed layer.
    pub table: String,
}

impl Names {
    pub fn new(ckpt: &Checkpoint, cfg: &ModelConfig, prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}{s}");
        match ckpt {
            Checkpoint::Gguf(_) => Names {
                router: n("ffn_gate_inp.weight"),
                bias: n("exp_probs_b.bias"),
                gate: n("ffn_gate_exps.weight"),
                up: n("ffn_up_exps.weight"),
                down: n("ffn_down_exps.weight"),
                shared: [
                    n("ffn_gate_shexp.weight"),
                    n("ffn_up_shexp.weight"),
                    n("ffn_down_shexp.weight"),
                ],
                shared_gate: n("ffn_gate_inp_shexp.weight"),
                table: n("ffn_gate_tid2eid.weight"),
            },
            // DeepSeek's own names (see `Checkpoint::layer_names`).
            Checkpoint::Hf(_) if cfg.arch == Arch::DeepseekV4 => Names {
                router: n("ffn.gate.weight"),
                bias: n("ffn.gate.bias"),
                table: n("ffn.gate.tid2eid"),
                gate: n("ffn.experts.{e}.w1.weight"),
                up: n("ffn.experts.{e}.w3.weight"),
                down: n("ffn.experts.{e}.w2.weight"),
                shared: [
                    n("ffn.shared_experts.w1.weight"),
                    n("ffn.shared_experts.w3.weight"),
                    n("ffn.shared_experts.w2.weight"),
                ],
                shared_gate: String::new(),
            },
            Checkpoint::Hf(_) if cfg.arch == Arch::KimiLinear => Names {
                router: n("block_sparse_moe.gate.weight"),
                bias: n("block_sparse_moe.gate.e_score_correction_bias"),
                gate: n("block_sparse_moe.experts.{e}.w1.weight"),
                up: n("block_sparse_moe.experts.{e}.w3.weight"),
                down: n("block_sparse_moe.experts.{e}.w2.weight"),
                shared: [
                    n("block_sparse_moe.shared_experts.gate_proj.weight"),
                    n("block_sparse_moe.shared_experts.up_proj.weight"),
                    n("block_sparse_moe.shared_experts.down_proj.weight"),
                ],
                shared_gate: String::new(),
                table: String::new(),
            },
            Checkpoint::Hf(_) if cfg.arch == Arch::Mixtral => Names {
                router: n("block_sparse_moe.gate.weight"),
                bias: String::new(),
                gate: n("block_sparse_moe.experts.{e}.w1.weight"),
                up: n("block_sparse_moe.experts.{e}.w3.weight"),
                down: n("block_sparse_moe.experts.{e}.w2.weight"),
                shared: Default::default(),
                shared_gate: String::new(),
                table: String::new(),
            },
            Checkpoint::Hf(_) => {
                // Qwen2-MoE names its one shared expert in the singular.
                let sh = match cfg.arch {
                    Arch::Qwen2Moe | Arch::Qwen3Next | Arch::Qwen35Moe => "mlp.shared_expert",
                    _ => "mlp.shared_experts",
                };
                Names {
                    router: n("mlp.gate.weight"),
                    bias: n("mlp.gate.e_score_correction_bias"),
                    gate: n("mlp.experts.{e}.gate_proj.weight"),
                    up: n("mlp.experts.{e}.up_proj.weight"),
                    down: n("mlp.experts.{e}.down_proj.weight"),
                    shared: [
                        n(&format!("{sh}.gate_proj.weight")),
                        n(&format!("{sh}.up_proj.weight")),
                        n(&format!("{sh}.down_proj.weight")),
                    ],
                    shared_gate: n("mlp.shared_expert_gate.weight"),
                    table: String::new(),
                }
            }
        }
    }
}
