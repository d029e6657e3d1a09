//! What the engine thread and its handles both see.

use super::metrics::Metrics;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// What the handle and the engine thread both see.
pub(super) struct Shared {
    pub metrics: Metrics,
    /// Submitted requests not yet admitted by the scheduler.
    pub waiting: AtomicUsize,
    /// Accepted requests not yet ended (waiting, running or preempted):
    /// submissions are admitted while this is under `capacity`.
    pub in_flight: AtomicUsize,
    /// Requests accepted at once: the waiting ones allowed plus every
    /// running slot, so a burst fills the running slots and then
    /// `max_waiting` before any is refused (counting only the waiting,
    /// a burst of 10 at 2 running + 2 waiting was refused after 2–3:
    /// none had been admitted yet).
    pub capacity: usize,
    pub closed: AtomicBool,
    pub next_id: AtomicU64,
    /// The model's context length, vocabulary, the tokens the KV cache
    /// holds: what submissions are checked against on the caller's
    /// thread; and the model's hidden size (an embedding's length).
    pub context: usize,
    pub vocab: usize,
    pub cache_tokens: usize,
    pub hidden: usize,
}

impl Shared {
    /// Gives back one accepted request's place in [`Shared::in_flight`].
    pub fn release_place(&self) {
        let n = &self.in_flight;
        let _ = n.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| v.checked_sub(1));
    }
}

/// One accepted request's place in [`Shared::in_flight`], given back when
/// dropped: the engine drops it just before the request's last event (a
/// client that saw the end may submit again at once), and a sequence
/// dropped any other way gives it back with it.
pub(super) struct InFlight(pub Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.release_place();
    }
}
