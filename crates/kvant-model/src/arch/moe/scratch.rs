//! The buffers a MoE layer reuses across passes: the router's outputs, the
//! shared experts', the fused kernel's, and those of expert parallelism's
//! dispatch and combine (kept here beside the others so that the layer and
//! its expert-parallel step share one scratch without importing each
//! other).

use super::routing::Routes;
use super::shared::SharedScratch;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::moe::MoeScratch;

/// Every buffer of a MoE layer.
#[derive(Default)]
pub(crate) struct MoeLayerScratch {
    pub routes: Routes,
    pub shared: SharedScratch,
    pub kernel: MoeScratch,
    pub ep: EpScratch,
}

/// The buffers of one dispatch and combine, reused across passes.
#[derive(Default)]
pub(crate) struct EpScratch {
    /// Per destination rank: rows and assignments sent, and assignments
    /// per expert slot there.
    pub rows_to: Vec<usize>,
    pub assigns_to: Vec<usize>,
    pub slot_counts: Vec<Vec<u32>>,
    /// Assignments per slot of this rank, as the counts announce them.
    pub slot_expected: Vec<usize>,
    /// Per (token, slot) of the share: its destination rank, and its
    /// place among that rank's assignments.
    pub dest: Vec<usize>,
    pub place: Vec<usize>,
    /// Per (token, slot): its result's row among those that came back.
    pub positions: Vec<usize>,
    /// The share's tokens routed to this rank's own slots, and their
    /// experts' results.
    pub own_tokens: Vec<usize>,
    pub y_own: Vec<f32>,
    /// One combine part's assignments: slots and rows.
    pub part_ids: Vec<u32>,
    pub part_rows: Vec<usize>,
    pub meta: Vec<u32>,
    pub x_dup: Vec<f32>,
    /// 8-bit dispatch: the share quantized, the rows received, and one
    /// row per assignment.
    pub xq: Q8Activations,
    pub got_q8: Q8Activations,
    pub dup_q8: Q8Activations,
    pub rows_at: Vec<usize>,
    pub ids: Vec<u32>,
    pub ones: Vec<f32>,
    pub y: Vec<f32>,
    pub kernel: MoeScratch,
}
