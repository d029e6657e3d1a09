//! The distributed layer's errors.

use std::time::Duration;

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DistError {
    /// A malformed collective, or ranks that disagree about one.
    #[error("collective mismatch: {0}")]
    Mismatch(String),
    /// A rank did not join a collective in time: it hangs, or died
    /// without the runtime noticing.
    #[error("{what}: no answer from every rank within {after:?} (a rank hangs or died)")]
    Timeout { what: String, after: Duration },
    /// A rank is known to be gone (it left, failed or aborted the job).
    #[error("rank {rank} is gone: {why}")]
    RankLost { rank: usize, why: String },
    /// The backend failed (an MPI error code, a refused thread).
    #[error("communication backend: {0}")]
    Backend(String),
    /// Flags that cannot be laid out on the ranks or the model.
    #[error(transparent)]
    Layout(#[from] crate::layout::LayoutError),
}

impl DistError {
    /// Whether the ranks can no longer work together (one is gone, hangs,
    /// or they disagree), as opposed to flags that do not fit, which every
    /// rank finds at start-up on its own.
    pub fn is_communication(&self) -> bool {
        !matches!(self, DistError::Layout(_))
    }
}
