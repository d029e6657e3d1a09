//! Where a layer's tokens live, as the attention components see them: the
//! pool of cached rows and states, the layer's index in it, and the
//! batch's sequences; and [`Step`], the rows one component of a layer
//! reads and writes. Its own module so that the layer, which builds these,
//! and the components, which read them, do not import each other.

use crate::kv::KvPool;
use kvant_kernels::attention::SeqAttn;
use kvant_kernels::int8::Q8Activations;
use std::cell::RefCell;

/// Where a layer's tokens live: the pool, the layer's index in it, the
/// batch's sequences, and what to add to a slot to get its rotary
/// position (1 for the MTP module, 0 otherwise).
pub(crate) struct LayerCtx<'a, 'b> {
    pub pool: &'a mut KvPool,
    pub index: usize,
    pub seqs: &'a [SeqAttn<'b>],
    pub rope_offset: usize,
}

/// Where a linear layer's sequences keep their state: the pool, the
/// layer's index among the linear layers, the batch's sequences and each
/// one's state slot.
pub(crate) struct StateCtx<'a, 'b> {
    pub pool: &'a mut KvPool,
    pub index: usize,
    pub seqs: &'a [SeqAttn<'b>],
    pub slots: &'a [usize],
}

/// One component's step over a batch (attention, dense FFN, MoE): `n`
/// normed token rows in (`xn`, `[n, hidden]`), its output rows out
/// (`out`, `[n, hidden]`, overwritten), the 8-bit activations and the
/// component's scratch it reuses between steps. The rows and their count
/// travel together, so no component is handed one without the other.
pub(crate) struct Step<'a, S> {
    pub xn: &'a [f32],
    pub n: usize,
    pub q8: &'a mut Q8Activations,
    pub s: &'a mut S,
    pub out: &'a mut [f32],
}

/// A [`LayerCtx`] whose pool is shared by the micro-batches of a pass
/// (each borrows it for its attention only): `index` is the layer's place
/// in the pass (the micro-batches' order), `cache` its index in the pool
/// (see `Layer::cache`), `slots` each sequence's state slot, `tokens`
/// the rows' token ids.
pub(crate) struct Place<'a, 'p, 'b> {
    pub pool: &'a RefCell<&'p mut KvPool>,
    /// The micro-batch's token ids, one per row (hash-routed experts).
    pub tokens: &'a [u32],
    pub index: usize,
    pub cache: usize,
    pub seqs: &'a [SeqAttn<'b>],
    pub slots: &'a [usize],
    pub rope_offset: usize,
}
