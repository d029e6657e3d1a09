//! What the engine thread and its handles both see.

use super::metrics::Metrics;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

/// What the handle and the engine thread both see.
pub(super) struct Shared {
    pub metrics: Metrics,
    /// Submitted requests not yet admitted by the scheduler.
    pub waiting: AtomicUsize,
    pub closed: AtomicBool,
    pub next_id: AtomicU64,
    /// The model's context length, vocabulary, the tokens the KV cache
    /// holds, and the waiting requests allowed: what submissions are
    /// checked against on the caller's thread.
    pub context: usize,
    pub vocab: usize,
    pub cache_tokens: usize,
    pub max_waiting: usize,
}
