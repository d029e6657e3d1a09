//! Mixture-of-experts feed-forward: routing, the expert-major plan and the
//! fused expert products (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3 compose
//! these).
//!
//! A layer runs [`route`] on its router logits (computed by the caller,
//! `x · W_gateᵀ` in f32), then [`moe_ffn`] with the ids and weights (a
//! [`Routing`]); shared experts are ordinary dense blocks, outside this
//! module.

mod experts;
mod plan;
mod reference;
mod route;
mod routing;

pub use experts::{combine, moe_ffn, moe_ffn_quantized, Experts, MoeScratch};
pub use plan::MoePlan;
pub use reference::{activation_f64, moe_ffn_ref, route_ref, up_f64};
pub use route::{route, route_by_table, GroupScore, RouterInput, RouterParams, Scoring};
pub use routing::Routing;
