//! Mixture-of-experts settings: how many experts, how a token picks its
//! `top_k` (the router), the shared experts, and which layers have experts.
//!
//! One shape covers Mixtral (softmax, renormalised), Qwen2-MoE (softmax,
//! a shared expert behind a sigmoid gate), Qwen3-MoE (softmax,
//! `norm_topk_prob`), DeepSeek-V2 (softmax, optional group-limited greedy,
//! scaling) and DeepSeek-V3 / GigaChat3 (sigmoid scores with a selection
//! bias, grouped top-k, renormalised and scaled).

use super::arch::Arch;
use super::error::{invalid, ConfigError, Result};
use super::json::{flag, required, usize_at};
use crate::gguf::GgufFile;
use kvant_kernels::moe::{GroupScore, RouterParams, Scoring};
use serde_json::Value;

/// Experts that every token runs besides its routed ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExperts {
    /// Intermediate size of the shared FFN (DeepSeek: experts × their size).
    pub ff: usize,
    /// Qwen2-MoE scales the shared output by `sigmoid(x · w)`.
    pub gated: bool,
}

#[derive(Clone, Debug)]
pub struct ExpertsConfig {
    pub router: RouterParams,
    /// Intermediate size of one routed expert.
    pub ff: usize,
    pub shared: Option<SharedExperts>,
    /// Per layer: experts (true) or the dense FFN of `intermediate` size.
    pub layers: Vec<bool>,
}

impl ExpertsConfig {
    pub fn is_moe(&self, layer: usize) -> bool {
        self.layers.get(layer).copied().unwrap_or(false)
    }

    fn validate(&self) -> Result<()> {
        let r = &self.router;
        let bad = |key: &str, why: &str| {
            Err(ConfigError::Invalid {
                key: key.into(),
                why: why.into(),
            })
        };
        if r.n_experts == 0 || r.n_experts > 1 << 16 {
            return bad("num_experts", "must be between 1 and 65536");
        }
        if r.top_k == 0 || r.top_k > r.n_experts {
            return bad(
                "num_experts_per_tok",
                "must be between 1 and the expert count",
            );
        }
        if self.ff == 0 || self.ff > 1 << 24 {
            return bad("moe_intermediate_size", "must be positive and plausible");
        }
        if r.n_group == 0 || !r.n_experts.is_multiple_of(r.n_group) {
            return bad("n_group", "must divide the number of experts");
        }
        if r.topk_group == 0 || r.topk_group > r.n_group {
            return bad("topk_group", "must be between 1 and n_group");
        }
        if r.top_k > r.topk_group * (r.n_experts / r.n_group) {
            return bad("topk_group", "keeps fewer experts than num_experts_per_tok");
        }
        if !(r.scale.is_finite() && r.scale > 0.0) {
            return bad("routed_scaling_factor", "must be a positive number");
        }
        Ok(())
    }
}

/// Experts every token runs, as a checkpoint states them.
pub(super) enum Shared {
    None,
    /// One FFN of this size behind a sigmoid gate (Qwen).
    Gated(usize),
    /// This many more routed experts' worth (DeepSeek).
    Copies(usize),
}

/// What a checkpoint states about its experts, in one vocabulary for both
/// formats (each reader applies its own format's defaults); `build`
/// derives the router and checks it.
pub(super) struct ExpertSettings {
    pub n_experts: usize,
    pub top_k: usize,
    /// Intermediate size of one routed expert.
    pub ff: usize,
    pub scoring: Scoring,
    pub norm_topk: bool,
    pub n_group: usize,
    pub topk_group: usize,
    pub scale: f32,
    pub shared: Shared,
    pub layers: Vec<bool>,
}

impl ExpertSettings {
    pub(super) fn build(self) -> Result<ExpertsConfig> {
        let out = ExpertsConfig {
            router: RouterParams {
                n_experts: self.n_experts,
                top_k: self.top_k,
                scoring: self.scoring,
                norm_topk: self.norm_topk,
                n_group: self.n_group,
                topk_group: self.topk_group,
                // Sigmoid routers (DeepSeek-V3 and after) rank groups by
                // their two best scores, softmax ones by the best.
                group_score: match self.scoring {
                    Scoring::Sigmoid | Scoring::SqrtSoftplus => GroupScore::SumTop2,
                    Scoring::Softmax => GroupScore::Max,
                },
                scale: self.scale,
            },
            ff: self.ff,
            shared: match self.shared {
                Shared::Gated(ff) if ff > 0 => Some(SharedExperts { ff, gated: true }),
                Shared::Copies(n) if n > 0 => Some(SharedExperts {
                    ff: n * self.ff,
                    gated: false,
                }),
                _ => None,
            },
            layers: self.layers,
        };
        out.validate()?;
        Ok(out)
    }

    /// From a transformers `config.json`; `None` for a dense architecture.
    pub(super) fn from_hf(cfg: &Value, arch: Arch, n_layers: usize) -> Result<Option<Self>> {
        // transformers 5 writes `num_local_experts` for every MoE family
        // (its attribute map); published Qwen checkpoints say `num_experts`.
        let n_experts = |k: &str| match usize_at(cfg, "num_local_experts")? {
            Some(n) => Ok(n),
            None => required(cfg, k),
        };
        Ok(Some(match arch {
            Arch::Mixtral => ExpertSettings {
                n_experts: n_experts("num_local_experts")?,
                top_k: required(cfg, "num_experts_per_tok")?,
                ff: required(cfg, "intermediate_size")?,
                norm_topk: true,
                layers: vec![true; n_layers],
                ..Self::softmax()
            },
            // Qwen3.5 is dense; its MoE sibling and Qwen3-Next route as
            // Qwen2-MoE does (a gated shared expert beside the experts).
            Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Qwen3Next | Arch::Qwen35Moe => ExpertSettings {
                n_experts: n_experts("num_experts")?,
                ..Self::hf_qwen(cfg, arch, n_layers)?
            },
            Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::DeepseekV32 => {
                match usize_at(cfg, "n_routed_experts")? {
                    Some(n) => Self::hf_deepseek(cfg, arch, n, n_layers)?,
                    None => return Ok(None),
                }
            }
            Arch::KimiLinear => Self::hf_kimi(cfg, n_layers)?,
            Arch::DeepseekV4 => ExpertSettings {
                n_experts: required(cfg, "n_routed_experts")?,
                top_k: required(cfg, "num_experts_per_tok")?,
                ff: required(cfg, "moe_intermediate_size")?,
                scoring: match cfg.get("scoring_func").and_then(Value::as_str) {
                    None | Some("sqrtsoftplus") => Scoring::SqrtSoftplus,
                    Some("sigmoid") => Scoring::Sigmoid,
                    Some("softmax") => Scoring::Softmax,
                    Some(other) => {
                        return Err(invalid(
                            "scoring_func",
                            format!("`{other}` is not supported"),
                        ))
                    }
                },
                norm_topk: flag(cfg, "norm_topk_prob").unwrap_or(true),
                n_group: 1,
                topk_group: 1,
                scale: number(cfg, "routed_scaling_factor", 1.5),
                shared: Shared::Copies(usize_at(cfg, "n_shared_experts")?.unwrap_or(1)),
                // Every V4 layer has experts; `mlp_layer_types` says how
                // each routes (V4Config::hash_layers).
                layers: vec![true; n_layers],
            },
            _ => return Ok(None),
        }))
    }

    /// Softmax routing over one group, unscaled: what Mixtral and Qwen
    /// leave implicit.
    fn softmax() -> Self {
        ExpertSettings {
            n_experts: 0,
            top_k: 0,
            ff: 0,
            scoring: Scoring::Softmax,
            norm_topk: false,
            n_group: 1,
            topk_group: 1,
            scale: 1.0,
            shared: Shared::None,
            layers: Vec::new(),
        }
    }

    /// Qwen's MoE keys (`decoder_sparse_step`, `mlp_only_layers`, the gated
    /// shared expert); the expert count is the caller's.
    fn hf_qwen(cfg: &Value, arch: Arch, n_layers: usize) -> Result<Self> {
        let step = usize_at(cfg, "decoder_sparse_step")?.unwrap_or(1).max(1);
        let dense: Vec<u64> = cfg
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let shared_ff = match arch {
            Arch::Qwen3Moe => 0,
            _ => usize_at(cfg, "shared_expert_intermediate_size")?.unwrap_or(0),
        };
        // Qwen3.5-MoE always renormalises the top-k.
        let norm_topk = arch == Arch::Qwen35Moe || flag(cfg, "norm_topk_prob").unwrap_or(false);
        Ok(ExpertSettings {
            top_k: required(cfg, "num_experts_per_tok")?,
            norm_topk,
            ff: required(cfg, "moe_intermediate_size")?,
            shared: Shared::Gated(shared_ff),
            layers: (0..n_layers)
                .map(|i| !dense.contains(&(i as u64)) && (i + 1) % step == 0)
                .collect(),
            ..Self::softmax()
        })
    }

    /// DeepSeek-V2/V3/V3.2 with `n` routed experts.
    fn hf_deepseek(cfg: &Value, arch: Arch, n: usize, n_layers: usize) -> Result<Self> {
        // V3.2 routes as V3 does.
        let v3 = arch != Arch::DeepseekV2;
        let grouped =
            v3 || cfg.get("topk_method").and_then(Value::as_str) == Some("group_limited_greedy");
        let (n_group, topk_group) = match grouped {
            true => (
                usize_at(cfg, "n_group")?.unwrap_or(1),
                usize_at(cfg, "topk_group")?.unwrap_or(1),
            ),
            false => (1, 1),
        };
        let ff = required(cfg, "moe_intermediate_size")?;
        let first_dense = usize_at(cfg, "first_k_dense_replace")?.unwrap_or(0);
        let freq = usize_at(cfg, "moe_layer_freq")?.unwrap_or(1).max(1);
        let n_shared = usize_at(cfg, "n_shared_experts")?.unwrap_or(0);
        Ok(ExpertSettings {
            n_experts: n,
            top_k: required(cfg, "num_experts_per_tok")?,
            ff,
            // transformers' DeepSeek-V3 router is sigmoid whatever
            // `scoring_func` says; V2's is softmax.
            scoring: if v3 {
                Scoring::Sigmoid
            } else {
                Scoring::Softmax
            },
            norm_topk: flag(cfg, "norm_topk_prob").unwrap_or(v3),
            n_group,
            topk_group,
            scale: number(cfg, "routed_scaling_factor", if v3 { 2.5 } else { 1.0 }),
            shared: Shared::Copies(n_shared),
            layers: (0..n_layers)
                .map(|i| i >= first_dense && i % freq == 0)
                .collect(),
        })
    }

    /// Kimi Linear routes as DeepSeek-V3; its config keeps Moonshot's
    /// names (transformers maps its own onto them).
    fn hf_kimi(cfg: &Value, n_layers: usize) -> Result<Self> {
        let either = |a: &str, b: &str| -> Result<Option<usize>> {
            Ok(usize_at(cfg, a)?.or(usize_at(cfg, b)?))
        };
        let reqe = |a: &str, b: &str| either(a, b)?.ok_or_else(|| ConfigError::Missing(a.into()));
        let n = reqe("num_experts", "num_local_experts")?;
        let ff = required(cfg, "moe_intermediate_size")?;
        let n_shared = either("num_shared_experts", "n_shared_experts")?.unwrap_or(0);
        let norm_topk = match flag(cfg, "moe_renormalize") {
            Some(v) => v,
            None => flag(cfg, "norm_topk_prob").unwrap_or(true),
        };
        let layers = match cfg.get("mlp_layer_types").and_then(Value::as_array) {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sparse") => Ok(true),
                    Some("dense") => Ok(false),
                    _ => Err(invalid(
                        "mlp_layer_types",
                        format!("`{t}` is neither dense nor sparse"),
                    )),
                })
                .collect::<Result<Vec<bool>>>()?,
            None => {
                let first_dense = usize_at(cfg, "first_k_dense_replace")?.unwrap_or(1);
                (0..n_layers).map(|i| i >= first_dense).collect()
            }
        };
        if layers.len() != n_layers {
            return Err(invalid(
                "mlp_layer_types",
                format!("{} entries for {n_layers} layers", layers.len()),
            ));
        }
        Ok(ExpertSettings {
            n_experts: n,
            top_k: reqe("num_experts_per_token", "num_experts_per_tok")?,
            ff,
            scoring: Scoring::Sigmoid,
            norm_topk,
            n_group: either("num_expert_group", "n_group")?.unwrap_or(1),
            topk_group: usize_at(cfg, "topk_group")?.unwrap_or(1),
            scale: number(cfg, "routed_scaling_factor", 2.446),
            shared: Shared::Copies(n_shared),
            layers,
        })
    }

    /// From `{arch}.expert_*` metadata as llama.cpp's converter writes it;
    /// `None` without experts. Which layers have experts is read from the
    /// tensors (`blk.N.ffn_gate_inp.weight`), so leading dense layers
    /// (`leading_dense_block_count`) and Qwen's `mlp_only_layers` need no
    /// per-architecture rule.
    pub(super) fn from_gguf(
        g: &GgufFile,
        arch_name: &str,
        n_layers: usize,
    ) -> Result<Option<Self>> {
        let key = |k: &str| format!("{arch_name}.{k}");
        let Some(n_experts) = g.get_usize(&key("expert_count"))?.filter(|&n| n > 0) else {
            return Ok(None);
        };
        let req = |k: &str| -> Result<usize> {
            g.get_usize(&key(k))?
                .ok_or_else(|| ConfigError::Missing(key(k)))
        };
        let ff = match g.get_usize(&key("expert_feed_forward_length"))? {
            Some(ff) => ff,
            None => req("feed_forward_length")?,
        };
        let scoring = match g.get_u32(&key("expert_gating_func"))? {
            // DeepSeek-V3.2 routes by sigmoid only (llama.cpp requires the key).
            None if arch_name == "deepseek32" => Scoring::Sigmoid,
            // Kimi Linear routes by sigmoid; its converter writes no key.
            None if arch_name == "kimi-linear" => Scoring::Sigmoid,
            None | Some(1) => Scoring::Softmax,
            Some(2) => Scoring::Sigmoid,
            // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS.
            Some(4) => Scoring::SqrtSoftplus,
            Some(other) => {
                return Err(invalid(
                    key("expert_gating_func"),
                    format!("gating function {other} is not supported"),
                ))
            }
        };
        // llama.cpp's defaults where the converter writes no key.
        let norm_default = matches!(
            arch_name,
            "llama" | "qwen3moe" | "qwen3next" | "qwen35moe" | "kimi-linear"
        );
        let shared = match arch_name {
            "qwen2moe" | "qwen3next" | "qwen35moe" => Shared::Gated(
                g.get_usize(&key("expert_shared_feed_forward_length"))?
                    .unwrap_or(0),
            ),
            _ => Shared::Copies(g.get_usize(&key("expert_shared_count"))?.unwrap_or(0)),
        };
        Ok(Some(ExpertSettings {
            n_experts,
            top_k: req("expert_used_count")?,
            ff,
            scoring,
            norm_topk: g
                .get_bool(&key("expert_weights_norm"))?
                .unwrap_or(norm_default),
            n_group: g.get_usize(&key("expert_group_count"))?.unwrap_or(1).max(1),
            topk_group: g
                .get_usize(&key("expert_group_used_count"))?
                .unwrap_or(1)
                .max(1),
            scale: g.get_f32(&key("expert_weights_scale"))?.unwrap_or(1.0),
            shared,
            layers: (0..n_layers)
                .map(|i| {
                    g.tensor_info(&format!("blk.{i}.ffn_gate_inp.weight"))
                        .is_some()
                })
                .collect(),
        }))
    }
}

/// `cfg[key]` as a number, `default` when it is absent or not a number.
fn number(cfg: &Value, key: &str, default: f32) -> f32 {
    cfg.get(key)
        .and_then(Value::as_f64)
        .map_or(default, |v| v as f32)
}
