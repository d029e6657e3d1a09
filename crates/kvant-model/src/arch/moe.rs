//! A mixture-of-experts feed-forward layer: the router picks each token's
//! experts, the fused kernel (`kvant_kernels::moe`) runs every expert once
//! over its group of tokens, and shared experts (DeepSeek, Qwen2-MoE) run
//! on every token beside them.
//!
//! Across ranks the routed experts are either split like a dense layer
//! (tensor parallelism: each rank holds every expert's share of the
//! intermediate, and the layer's output is summed over the group), or
//! spread whole over the ranks (expert parallelism, [`super::moe_ep`]:
//! tokens travel to their experts and back, and the result is the same
//! bits as in one process).

use super::ffn::{DenseFfn, FfnScratch};
use super::loader::{block_after, cut_cols, quantized, Loader};
use super::moe_ep::{EpScratch, ExpertParallel};
use super::parallel::Net;
use super::shard::Shard;
use crate::checkpoint::Checkpoint;
use crate::config::{ExpertsConfig, ModelConfig};
use crate::ModelError;
use kvant_core::{DType, Tensor};
use kvant_dist::layout::Placement;
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
    pub params: RouterParams,
    /// `[n_experts, hidden]`, applied with f32 activations: expert choices
    /// are discontinuous, so they should not hinge on activation rounding.
    pub router: LinearWeight,
    /// DeepSeek-V3's selection bias (`e_score_correction_bias`).
    pub bias: Option<Vec<f32>>,
    /// The routed experts this rank computes: all of them (one process),
    /// every expert's share of the intermediate (tensor parallelism), or
    /// its slots of the placement (expert parallelism). `None` when the
    /// share is empty.
    pub experts: Option<Experts>,
    shared: Option<Shared>,
    /// Expert parallelism: the placement, and what re-placing needs.
    pub ep: Option<ExpertParallel>,
}

/// The router's outputs and the shared experts' activations.
#[derive(Default)]
pub(crate) struct MoeLayerScratch {
    pub logits: Vec<f32>,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
    pub shared: Vec<f32>,
    pub ffn: FfnScratch,
    pub kernel: MoeScratch,
    pub ep: EpScratch,
}

/// Every routed expert's unprepared weights (views of the checkpoint):
/// what a rank prepares its share or its slots from.
pub(crate) struct ExpertTensors {
    pub gate: Vec<Tensor>,
    pub up: Vec<Tensor>,
    pub down: Vec<Tensor>,
    /// Prepare for the int8 kernels.
    pub int8: bool,
    /// Quantize float experts to this type as they are prepared.
    pub quantize: Option<DType>,
}

impl ExpertTensors {
    /// The experts of `slots` (logical ids, in slot order), whole.
    pub fn prepare(&self, slots: &[u32]) -> Result<Experts, ModelError> {
        let pick = |v: &[Tensor]| -> Result<Vec<LinearWeight>, ModelError> {
            slots
                .iter()
                .map(|&e| {
                    let t = v.get(e as usize).ok_or_else(|| {
                        ModelError::Dist(kvant_dist::DistError::Mismatch(format!(
                            "expert {e} of {}",
                            v.len()
                        )))
                    })?;
                    self.weight(t.clone())
                })
                .collect()
        };
        Ok(Experts::new(
            pick(&self.gate)?,
            pick(&self.up)?,
            pick(&self.down)?,
        )?)
    }

    /// One expert matrix for its kernel, quantized first if the load asks.
    fn weight(&self, t: Tensor) -> Result<LinearWeight, ModelError> {
        Ok(LinearWeight::prepare(
            quantized(t, self.quantize)?,
            self.int8,
        )?)
    }

    /// Every expert's `shard` of the intermediate (`None` when empty).
    fn prepare_share(&self, shard: Shard, names: [&str; 3]) -> Result<Option<Experts>, ModelError> {
        let Some(d0) = self.down.first() else {
            return Ok(None);
        };
        let ff = d0.shape()[1];
        let cols = shard.cols(ff, block_after(d0, self.quantize));
        if cols.is_empty() {
            return Ok(None);
        }
        let prep = |t: Tensor| self.weight(t);
        let rows = |v: &[Tensor]| -> Result<Vec<LinearWeight>, ModelError> {
            v.iter().map(|t| prep(t.row_range(cols.clone())?)).collect()
        };
        let down: Result<Vec<LinearWeight>, ModelError> = self
            .down
            .iter()
            .map(|t| prep(cut_cols(t, names[2], cols.clone())?))
            .collect();
        Ok(Some(Experts::new(
            rows(&self.gate)?,
            rows(&self.up)?,
            down?,
        )?))
    }
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
            Checkpoint::Hf(_) if cfg.arch == crate::config::Arch::KimiLinear => Names {
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
                use crate::config::Arch;
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
                }
            }
        }
    }
}

/// How a MoE layer's routed experts are laid out over the ranks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ExpertLayout<'p> {
    /// Every expert whole on this rank, or (tensor parallel) every
    /// expert's share of the intermediate.
    Shared(Shard),
    /// Spread over the ranks: `placement`'s slots of `rank`.
    Spread {
        placement: &'p Placement,
        rank: usize,
    },
}

impl MoeFfn {
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        e: &ExpertsConfig,
        prefix: &str,
        layout: ExpertLayout<'_>,
    ) -> Result<Self, ModelError> {
        let names = Names::new(ld.ckpt, cfg, prefix);
        let (h, ne) = (cfg.hidden, e.router.n_experts);
        let tensors =
            |pattern: &str, rows: usize, cols: usize| -> Result<Vec<Tensor>, ModelError> {
                if pattern.contains("{e}") {
                    (0..ne)
                        .map(|i| ld.matrix(&pattern.replace("{e}", &i.to_string()), rows, cols))
                        .collect()
                } else {
                    ld.stacked(pattern, ne, rows, cols)
                }
            };
        let all = ExpertTensors {
            gate: tensors(&names.gate, e.ff, h)?,
            up: tensors(&names.up, e.ff, h)?,
            down: tensors(&names.down, h, e.ff)?,
            int8: ld.int8,
            quantize: ld.quantize,
        };
        let bias = match ld.has(&names.bias) {
            true => Some(ld.raw_vector(&names.bias, ne)?),
            false => None,
        };
        // Shared experts run with the routed ones: split like them under
        // tensor parallelism, whole on each rank's tokens under expert
        // parallelism.
        let shared_shard = match layout {
            ExpertLayout::Shared(s) => s,
            ExpertLayout::Spread { .. } => Shard::FULL,
        };
        let shared = match e.shared {
            None => None,
            Some(s) => Some(Shared {
                ffn: DenseFfn::load(
                    ld,
                    names.shared.each_ref().map(String::as_str),
                    h,
                    s.ff,
                    shared_shard,
                )?,
                gate: match s.gated {
                    true => Some(shared_gate(ld, &names.shared_gate, h)?),
                    false => None,
                },
            }),
        };
        let (experts, ep) = match layout {
            ExpertLayout::Shared(s) if !s.is_split() => (Some(all.prepare(&all_ids(ne))?), None),
            ExpertLayout::Shared(s) => {
                let names = [names.gate.as_str(), names.up.as_str(), names.down.as_str()];
                (all.prepare_share(s, names)?, None)
            }
            ExpertLayout::Spread { placement, rank } => {
                let slots = all.prepare(placement.on_rank(rank))?;
                let ep = ExpertParallel::new(placement.clone(), rank, all, slots);
                (None, Some(ep))
            }
        };
        Ok(MoeFfn {
            params: e.router,
            router: ld.exact_weight(&names.router, ne, h)?,
            bias,
            experts,
            shared,
            ep,
        })
    }

    /// Bytes of all weights this rank holds, and of what one token reads
    /// (router, its `top_k` experts at their average size, the shared
    /// experts).
    pub fn bytes(&self) -> (usize, usize) {
        let shared: usize = self.shared.iter().map(|s| s.ffn.byte_len()).sum();
        let (experts, count) = match (&self.experts, &self.ep) {
            (Some(x), _) => (x.byte_len(), x.n_experts()),
            (None, Some(ep)) => ep.slot_bytes(),
            (None, None) => (0, 0),
        };
        let per_expert = experts / count.max(1);
        let router = self.router.byte_len();
        (
            router + experts + shared,
            router + self.params.top_k * per_expert + shared,
        )
    }

    /// `out = MoE(xn)` for `n` tokens (`[n, hidden]`, overwritten). Under
    /// tensor parallelism, summed over the group here; under expert
    /// parallelism, tokens dispatched to their experts' ranks and back.
    #[allow(clippy::too_many_arguments)] // the layer's step, unpacked
    pub async fn forward(
        &self,
        act: Activation,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut MoeLayerScratch,
        out: &mut [f32],
        net: &Net<'_>,
    ) -> Result<(), ModelError> {
        if let Some(ep) = &self.ep {
            return ep.forward(self, act, xn, n, q8, s, out, net).await;
        }
        if n > 0 {
            self.route_tokens(xn, n, q8, s)?;
            let k = self.params.top_k;
            match &self.experts {
                Some(x) => moe_ffn(
                    x,
                    act,
                    xn,
                    n,
                    &s.ids[..n * k],
                    &s.weights[..n * k],
                    k,
                    &mut s.kernel,
                    out,
                )?,
                None => out.fill(0.0),
            }
            self.run_shared(act, xn, n, q8, s)?;
            self.add_shared(xn, n, s, out);
        }
        net.tp_sum(out).await
    }

    /// The router's choices for `n` tokens: `s.ids` and `s.weights`
    /// (`[n, top_k]`).
    pub fn route_tokens(
        &self,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut MoeLayerScratch,
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
        Ok(())
    }

    /// The shared experts' output of `n` tokens, into `s.shared` (nothing
    /// without shared experts).
    pub fn run_shared(
        &self,
        act: Activation,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut MoeLayerScratch,
    ) -> Result<(), ModelError> {
        let Some(sh) = self.shared.as_ref().filter(|_| n > 0) else {
            return Ok(());
        };
        let len = xn.len();
        s.shared.resize(len, 0.0);
        sh.ffn
            .forward(act, xn, n, q8, &mut s.ffn, &mut s.shared[..len])?;
        Ok(())
    }

    /// Adds [`Self::run_shared`]'s output for the rows `xn` to `out`, row
    /// by row, scaled by `sigmoid(x · gate)` for Qwen2-MoE's gated shared
    /// expert.
    pub fn add_shared(&self, xn: &[f32], n: usize, s: &MoeLayerScratch, out: &mut [f32]) {
        let Some(sh) = self.shared.as_ref().filter(|_| n > 0) else {
            return;
        };
        let h = xn.len() / n;
        let y = &s.shared[..xn.len()];
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
}

fn all_ids(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
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
