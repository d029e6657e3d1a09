//! A MoE layer's router: the logits of every expert for each token, and
//! the `top_k` it picks with their weights.

use crate::ModelError;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{LinearInput, LinearWeight};
use kvant_kernels::moe::{route, route_by_table, RouterInput, RouterParams};

pub(crate) struct Router {
    pub params: RouterParams,
    /// `[n_experts, hidden]`, applied with f32 activations: expert choices
    /// are discontinuous, so they should not hinge on activation rounding.
    pub weight: LinearWeight,
    /// DeepSeek-V3's selection bias (`e_score_correction_bias`).
    pub bias: Option<Vec<f32>>,
    /// DeepSeek-V4's hash-routed layers: each token's `top_k` experts by
    /// token id (`tid2eid`, `[vocab, top_k]`), in place of a selection.
    pub table: Option<Vec<u32>>,
}

/// The router's outputs, reused across passes: the logits, and each
/// token's `top_k` experts and weights (`[n, top_k]`).
#[derive(Default)]
pub(crate) struct Routes {
    pub logits: Vec<f32>,
    pub ids: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Router {
    /// The width of the rows it routes (the model's hidden size).
    pub fn hidden(&self) -> usize {
        self.weight.cols()
    }

    /// The router's choices for `n` tokens (`tokens`, their ids, for a
    /// hash-routed layer): `r.ids` and `r.weights` (`[n, top_k]`).
    pub fn route(
        &self,
        xn: &[f32],
        tokens: &[u32],
        n: usize,
        q8: &mut Q8Activations,
        r: &mut Routes,
    ) -> Result<(), ModelError> {
        let (ne, k) = (self.params.n_experts, self.params.top_k);
        r.logits.resize(n * ne, 0.0);
        r.ids.resize(n * k, 0);
        r.weights.resize(n * k, 0.0);
        let logits = &mut r.logits[..n * ne];
        self.weight
            .forward(&LinearInput::new(xn, n, q8, &[&self.weight])?, logits)?;
        let (ids, weights) = (&mut r.ids[..n * k], &mut r.weights[..n * k]);
        let input = RouterInput::new(&self.params, logits, self.bias.as_deref());
        match &self.table {
            Some(table) => route_by_table(&input, (table, tokens), ids, weights)?,
            None => route(&input, ids, weights)?,
        }
        Ok(())
    }
}
