//! What a rank holds of each tensor-parallel weight: its query and KV
//! heads, its columns of a feed-forward block, its rows of the vocabulary
//! (the plans themselves are `kvant_dist::layout`'s).

use kvant_dist::layout::{head_shard, split_even, split_units, HeadShard};
use std::ops::Range;

/// Rank `t` of a tensor-parallel group of `tp` (`tp == 1`: everything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shard {
    pub tp: usize,
    pub t: usize,
}

impl Shard {
    /// The whole model: one rank, or a weight every rank holds in full.
    pub const FULL: Shard = Shard { tp: 1, t: 0 };

    pub fn is_split(&self) -> bool {
        self.tp > 1
    }

    /// Query and KV heads of grouped-query attention.
    pub fn heads(&self, heads: usize, kv_heads: usize) -> HeadShard {
        head_shard(heads, kv_heads, self.tp, self.t)
    }

    /// Heads of latent attention (its latent row is every head's).
    pub fn mla_heads(&self, heads: usize) -> Range<usize> {
        split_even(heads, self.tp, self.t)
    }

    /// Columns of an `n`-wide intermediate, in whole `unit`s: the row-
    /// parallel weight's quantization block, so that no block straddles
    /// two ranks; for int8 weights (blocks of 32 or 256) each 32-value
    /// block of the intermediate is then also quantized from the same
    /// values as in one process. A rank may get none (an intermediate of
    /// fewer blocks than ranks).
    pub fn cols(&self, n: usize, unit: usize) -> Range<usize> {
        split_units(n, unit, self.tp, self.t)
    }

    /// Rows of the vocabulary (embedding and output head).
    pub fn vocab(&self, vocab: usize) -> Range<usize> {
        split_even(vocab, self.tp, self.t)
    }
}
