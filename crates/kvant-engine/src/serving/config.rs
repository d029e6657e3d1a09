//! A serving engine's sizes and limits.

use kvant_model::arch::decoder::DecoderModel;

/// Sizes and limits of one serving engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool (see [`EngineConfig::blocks_for_bytes`]).
    pub kv_blocks: usize,
    /// Tokens one forward pass may carry (prefill chunks plus decodes).
    pub max_batch_tokens: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Requests waiting to start; more are refused at once (counted with
    /// the running ones: `max_running + max_waiting` accepted at a time).
    pub max_waiting: usize,
    /// Reuse the KV blocks of earlier prompts that share a prefix.
    pub prefix_caching: bool,
    /// Models with linear-attention layers: state snapshots kept for
    /// prefix caching (see `states.rs`), each the size of one sequence's
    /// state, besides one state per running sequence.
    pub state_snapshots: usize,
    /// When decode steps draft with the model's MTP module (models loaded
    /// with one; see [`crate::speculative`]).
    pub speculation: crate::speculative::Policy,
    /// Over ranks with expert parallelism: re-place the experts from the
    /// loads seen, every so many steps (EPLB).
    pub rebalance: Option<Rebalance>,
}

/// Periodic expert re-placement (see [`crate::cluster::Cluster::rebalance`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rebalance {
    /// Engine steps between re-placements.
    pub every: usize,
    /// Extra replicas of the hottest experts per layer.
    pub redundant: usize,
}

impl EngineConfig {
    /// Blocks of `block_size` tokens that fit in `bytes` for `model`.
    pub fn blocks_for_bytes(model: &DecoderModel, block_size: usize, bytes: usize) -> usize {
        bytes / model.kv_bytes_per_block(block_size.max(1)).max(1)
    }

    /// Recurrent-state slots the pool needs for a model with
    /// linear-attention layers: one per running sequence, and the
    /// snapshots (none for other models).
    pub fn state_slots(&self, model: &DecoderModel) -> usize {
        match model.state_shape().layers {
            0 => 0,
            _ => self.max_running + self.state_snapshots,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_blocks: 1024,
            max_batch_tokens: 512,
            max_running: 64,
            max_waiting: 256,
            prefix_caching: true,
            state_snapshots: 64,
            speculation: crate::speculative::Policy::Adaptive,
            rebalance: None,
        }
    }
}
