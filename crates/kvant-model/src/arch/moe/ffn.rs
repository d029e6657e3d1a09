//! The MoE layer itself: its router, its routed experts (on this rank, or
//! spread over the ranks) and its shared experts, loaded from a checkpoint
//! and run over a batch of tokens.

use super::super::ctx::Step;
use super::super::loader::Loader;
use super::super::parallel::Net;
use super::super::shard::Shard;
use super::ep::ExpertParallel;
use super::experts::{all_ids, ExpertTensors};
use super::names::Names;
use super::routing::Router;
use super::scratch::MoeLayerScratch;
use super::shared::SharedExperts;
use crate::config::{ExpertsConfig, ModelConfig};
use crate::ModelError;
use kvant_core::Tensor;
use kvant_dist::layout::Placement;
use kvant_kernels::activation::Activation;
use kvant_kernels::cpu;
use kvant_kernels::moe::{moe_ffn, Experts, Routing};

pub(crate) struct MoeFfn {
    router: Router,
    routed: Routed,
    shared: Option<SharedExperts>,
}

/// The routed experts this rank computes.
enum Routed {
    /// All of them (one process), or every expert's share of the
    /// intermediate (tensor parallelism); `None` when the share is empty.
    Local(Option<Experts>),
    /// Its slots of the placement (expert parallelism), and what
    /// re-placing needs.
    Parallel(ExpertParallel),
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
            Some(s) => Some(SharedExperts::load(
                ld,
                &s,
                names.shared.each_ref().map(String::as_str),
                &names.shared_gate,
                h,
                shared_shard,
            )?),
        };
        let routed = match layout {
            ExpertLayout::Shared(s) if !s.is_split() => {
                Routed::Local(Some(all.prepare(&all_ids(ne))?))
            }
            ExpertLayout::Shared(s) => {
                let names = [names.gate.as_str(), names.up.as_str(), names.down.as_str()];
                Routed::Local(all.prepare_share(s, names)?)
            }
            ExpertLayout::Spread { placement, rank } => {
                let slots = all.prepare(placement.on_rank(rank))?;
                Routed::Parallel(ExpertParallel::new(placement.clone(), rank, all, slots))
            }
        };
        let table = match !names.table.is_empty() && ld.has(&names.table) {
            true => Some(expert_table(
                ld,
                &names.table,
                cfg.vocab,
                e.router.top_k,
                ne,
            )?),
            false => None,
        };
        let router = Router {
            params: e.router,
            weight: ld.exact_weight(&names.router, ne, h)?,
            bias,
            table,
        };
        Ok(MoeFfn {
            router,
            routed,
            shared,
        })
    }

    /// Whether the layer routes by token id (a hash-routed layer).
    pub fn routes_by_table(&self) -> bool {
        self.router.table.is_some()
    }

    /// The experts' placement, under expert parallelism.
    pub fn expert_parallel(&self) -> Option<&ExpertParallel> {
        match &self.routed {
            Routed::Parallel(ep) => Some(ep),
            Routed::Local(_) => None,
        }
    }

    /// Bytes of all weights this rank holds, and of what one token reads
    /// (router, its `top_k` experts at their average size, the shared
    /// experts).
    pub fn bytes(&self) -> (usize, usize) {
        let shared: usize = self.shared.iter().map(SharedExperts::byte_len).sum();
        let (experts, count) = match &self.routed {
            Routed::Local(Some(x)) => (x.byte_len(), x.n_experts()),
            Routed::Local(None) => (0, 0),
            Routed::Parallel(ep) => ep.slot_bytes(),
        };
        let per_expert = experts / count.max(1);
        let router = self.router.weight.byte_len();
        (
            router + experts + shared,
            router + self.router.params.top_k * per_expert + shared,
        )
    }

    /// `out = MoE(xn)` for `n` tokens (`[n, hidden]`, overwritten). Under
    /// tensor parallelism, summed over the group here; under expert
    /// parallelism, tokens dispatched to their experts' ranks and back.
    pub async fn forward(
        &self,
        act: Activation,
        tokens: &[u32],
        step: Step<'_, MoeLayerScratch>,
        net: &Net<'_>,
    ) -> Result<(), ModelError> {
        let experts = match &self.routed {
            Routed::Parallel(ep) => {
                let shared = self.shared.as_ref();
                return ep
                    .forward(&self.router, shared, (act, tokens), step, net)
                    .await;
            }
            Routed::Local(experts) => experts,
        };
        let Step { xn, n, q8, s, out } = step;
        if n > 0 {
            self.router.route(xn, tokens, n, q8, &mut s.routes)?;
            let k = self.router.params.top_k;
            let r = Routing {
                ids: &s.routes.ids[..n * k],
                weights: &s.routes.weights[..n * k],
                n_tokens: n,
                top_k: k,
            };
            match experts {
                Some(x) => moe_ffn(cpu::tier(), x, act, xn, &r, &mut s.kernel, out)?,
                None => out.fill(0.0),
            }
            if let Some(sh) = &self.shared {
                sh.run(act, xn, n, q8, &mut s.shared)?;
                sh.add(xn, n, &s.shared, out);
            }
        }
        net.tp_sum(out).await
    }
}

/// A hash-routed layer's `[vocab, top_k]` table of expert ids, checked.
fn expert_table(
    ld: &Loader<'_>,
    name: &str,
    vocab: usize,
    top_k: usize,
    n_experts: usize,
) -> Result<Vec<u32>, ModelError> {
    let (values, shape) = ld.ckpt.integers(name)?;
    if shape != [vocab, top_k] {
        return Err(ModelError::TensorShape {
            name: name.into(),
            expected: vec![vocab, top_k],
            actual: shape,
        });
    }
    values
        .into_iter()
        .map(|e| match u32::try_from(e) {
            Ok(e) if (e as usize) < n_experts => Ok(e),
            _ => Err(ModelError::BadTensor {
                name: name.into(),
                why: format!("expert id {e} outside 0..{n_experts}"),
            }),
        })
        .collect()
}
