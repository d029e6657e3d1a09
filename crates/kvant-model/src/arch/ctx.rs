//! Where a layer's tokens live, as the attention components see them: the
//! pool of cached rows and states, the layer's index in it, and the
//! batch's sequences. Its own module so that the layer, which builds these,
//! and the attention components, which read them, do not import each
//! other.

use crate::kv::KvPool;
use kvant_kernels::attention::SeqAttn;
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

/// A [`LayerCtx`] whose pool is shared by the micro-batches of a pass
/// (each borrows it for its attention only): `index` is the layer's place
/// in the pass (the micro-batches' order), `cache` its index in the pool
/// (see `Layer::cache`), `slots` each sequence's state slot.
pub(crate) struct Place<'a, 'p, 'b> {
    pub pool: &'a RefCell<&'p mut KvPool>,
    pub index: usize,
    pub cache: usize,
    pub seqs: &'a [SeqAttn<'b>],
    pub slots: &'a [usize],
    pub rope_offset: usize,
}
