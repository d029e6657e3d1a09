//! What one attention call is: its shape and policy ([`AttnParams`]),
//! each sequence's query rows and block table ([`SeqAttn`]), and the
//! largest work item the kernels are written for.

use std::ops::Range;

/// Shape and policy of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Query and key size per head.
    pub head_dim: usize,
    /// Value (and output) size per head: `head_dim`, except in latent
    /// attention, whose values are the first `v_dim` key elements.
    pub v_dim: usize,
    /// Multiplies q·k (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys in `(p - w, p]`.
    pub window: Option<usize>,
}

impl AttnParams {
    pub(super) fn key_range(&self, pos: usize) -> Range<usize> {
        let lo = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        lo..pos + 1
    }
}

/// One sequence of a batched call: its query rows (`rows`, token indices
/// into the call's `q` and `out`), the position of the first, and where its
/// keys live. The table must cover `pos0 + rows.len()` positions, whose
/// keys and values (the query tokens' own included) are already stored.
#[derive(Clone, Debug)]
pub struct SeqAttn<'a> {
    pub rows: Range<usize>,
    pub pos0: usize,
    pub table: &'a [u32],
}

/// Query rows per work item: a GQA group's heads times a few tokens, as
/// many as share each loaded (widened) key tile while the scores and
/// accumulators stay in L1.
pub(super) const MAX_ROWS: usize = 24;
