//! A mixture-of-experts feed-forward layer ([`MoeFfn`]): the router picks
//! each token's experts ([`routing`]), the fused kernel
//! (`kvant_kernels::moe`) runs every expert once over its group of tokens,
//! and shared experts (DeepSeek, Qwen2-MoE) run on every token beside them
//! ([`shared`]).
//!
//! Across ranks the routed experts are either split like a dense layer
//! (tensor parallelism: each rank holds every expert's share of the
//! intermediate, and the layer's output is summed over the group), or
//! spread whole over the ranks (expert parallelism, [`ep`]: tokens travel
//! to their experts and back, and the result is the same bits as in one
//! process). Both prepare their experts from the checkpoint's tensors
//! ([`experts`], named per format in [`names`]).

mod ep;
mod experts;
mod ffn;
mod names;
mod routing;
mod scratch;
mod shared;

pub(crate) use ep::ExpertParallel;
pub(crate) use ffn::{ExpertLayout, MoeFfn};
pub(crate) use scratch::MoeLayerScratch;
