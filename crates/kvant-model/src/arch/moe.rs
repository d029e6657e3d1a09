//! A mixture-of-experts feed-forward layer: the router picks each token's
//! experts, the fused kernel (`kvant_kernels::moe`) runs every expert once
//! over its group of tokens, and shared experts (DeepSeek, Qwen2-MoE) run
//! on every token beside them.

use super::ffn::{DenseFfn, FfnScratch};
use super::loader::Loader;
use crate::checkpoint::Checkpoint;
use crate::config::{ExpertsConfig, ModelConfig};
use crate::ModelError;
use kvant_core::Tensor;
use kvant_kernels::activation::Activation;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{LinearInput, LinearWeight};
use kvant_kernels::moe::{moe_ffn, route, Experts, MoeScratch, RouterParams};

struct Shared {
    ffn: DenseFfn,
    /// Qwen2-MoE: the shared output is scaled by `sigmoid(x · gate)`.
    gate: Option<Vec<f32>>,
}

pub(crate) struct MoeFfn {
    params: RouterParams,
    /// `[n_experts, hidden]`, applied with f32 activations: expert choices
    /// are discontinuous, so they should not hinge on activation rounding.
    router: LinearWeight,
    /// DeepSeek-V3's selection bias (`e_score_correction_bias`).
    bias: Option<Vec<f32>>,
    experts: Experts,
    shared: Option<Shared>,
}

/// The router's outputs and the shared experts' activations.
#[derive(Default)]
pub(crate) struct MoeLayerScratch {
    logits: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
    shared: Vec<f32>,
    ffn: FfnScratch,
    kernel: MoeScratch,
}

/// Tensor names of one layer's experts, by format and architecture.
struct Names {
    router: String,
    bias: String,
    /// `[n, ff, hidden]` tensors holding every expert (GGUF), or a
    /// per-expert name pattern with `{e}` (Hugging Face).
    gate: String,
    up: String,
    down: String,
    shared: [String; 3],
    shared_gate: String,
}

impl Names {
    fn new(ckpt: &Checkpoint, cfg: &ModelConfig, prefix: &str) -> Self {
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
            },
            Checkpoint::Hf(_) if cfg.arch == crate::config::Arch::Mixtral => Names {
                router: n("block_sparse_moe.gate.weight"),
                bias: String::new(),
                gate: n("block_sparse_moe.experts.{e}.w1.weight"),
                up: n("block_sparse_moe.experts.{e}.w3.weight"),
                down: n("block_sparse_moe.experts.{e}.w2.weight"),
                shared: Default::default(),
                shared_gate: String::new(),
            },
            Checkpoint::Hf(_) => {
                // Qwen2-MoE names its one shared expert in the singular.
                let sh = match cfg.arch {
                    crate::config::Arch::Qwen2Moe => "mlp.shared_expert",
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
                }
            }
        }
    }
}

impl MoeFfn {
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        e: &ExpertsConfig,
        prefix: &str,
    ) -> Result<Self, ModelError> {
        let names = Names::new(ld.ckpt, cfg, prefix);
        let (h, ne) = (cfg.hidden, e.router.n_experts);
        let experts =
            |pattern: &str, rows: usize, cols: usize| -> Result<Vec<LinearWeight>, ModelError> {
                if pattern.contains("{e}") {
                    (0..ne)
                        .map(|i| ld.weight(&pattern.replace("{e}", &i.to_string()), rows, cols))
                        .collect()
                } else {
                    ld.stacked(pattern, ne, rows, cols)
                }
            };
        let bias = match ld.has(&names.bias) {
            true => Some(ld.raw_vector(&names.bias, ne)?),
            false => None,
        };
        let shared = match e.shared {
            None => None,
            Some(s) => Some(Shared {
                ffn: DenseFfn::load(ld, names.shared.each_ref().map(String::as_str), h, s.ff)?,
                gate: match s.gated {
                    true => Some(shared_gate(ld, &names.shared_gate, h)?),
                    false => None,
                },
            }),
        };
        Ok(MoeFfn {
            params: e.router,
            router: ld.exact_weight(&names.router, ne, h)?,
            bias,
            experts: Experts::new(
                experts(&names.gate, e.ff, h)?,
                experts(&names.up, e.ff, h)?,
                experts(&names.down, h, e.ff)?,
            )?,
            shared,
        })
    }

    /// Bytes of all weights, and of what one token reads (router, its
    /// `top_k` experts at their average size, the shared experts).
    pub fn bytes(&self) -> (usize, usize) {
        let shared: usize = self
            .shared
            .iter()
            .flat_map(|s| s.ffn.weights())
            .map(|w| w.byte_len())
            .sum();
        let all = self.router.byte_len() + self.experts.byte_len() + shared;
        let per_expert = self.experts.byte_len() / self.experts.n_experts().max(1);
        (
            all,
            self.router.byte_len() + self.params.top_k * per_expert + shared,
        )
    }

    /// `out = MoE(xn)` for `n` tokens (`[n, hidden]`, overwritten).
    pub fn forward(
        &self,
        act: Activation,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut MoeLayerScratch,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let (ne, k) = (self.params.n_experts, self.params.top_k);
        s.logits.resize(n * ne, 0.0);
        s.ids.resize(n * k, 0);
        s.weights.resize(n * k, 0.0);
        let logits = &mut s.logits[..n * ne];
        self.router
            .forward(&LinearInput::new(xn, n, q8, &[&self.router])?, logits)?;
        let (ids, weights) = (&mut s.ids[..n * k], &mut s.weights[..n * k]);
        route(&self.params, logits, self.bias.as_deref(), ids, weights)?;
        moe_ffn(
            &self.experts,
            act,
            xn,
            n,
            ids,
            weights,
            k,
            &mut s.kernel,
            out,
        )?;
        if let Some(sh) = &self.shared {
            let h = xn.len() / n.max(1);
            s.shared.resize(n * h, 0.0);
            let y = &mut s.shared[..n * h];
            sh.ffn.forward(act, xn, n, q8, &mut s.ffn, y)?;
            for ((o, y), x) in out
                .chunks_exact_mut(h)
                .zip(y.chunks_exact(h))
                .zip(xn.chunks_exact(h))
            {
                let g = match &sh.gate {
                    Some(w) => {
                        let z: f32 = x.iter().zip(w).map(|(a, b)| a * b).sum();
                        1.0 / (1.0 + (-z).exp())
                    }
                    None => 1.0,
                };
                o.iter_mut().zip(y).for_each(|(o, y)| *o += g * y);
            }
        }
        Ok(())
    }
}

/// Qwen2-MoE's shared-expert gate: `[1, hidden]` in Hugging Face files,
/// `[hidden]` in GGUF.
fn shared_gate(ld: &Loader<'_>, name: &str, h: usize) -> Result<Vec<f32>, ModelError> {
    let t: Tensor = ld.tensor(name)?;
    if t.elements() != h || t.row_len() != h {
        return Err(ModelError::TensorShape {
            name: name.into(),
            expected: vec![1, h],
            actual: t.shape().to_vec(),
        });
    }
    super::loader::to_f32(&t)
}
