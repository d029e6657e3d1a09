//! The serving engine: continuous batching over a paged KV cache with
//! prefix reuse and chunked prefill, run on its own thread.

mod blocks;
mod config;
mod embedding;
mod engine;
mod handle;
mod metrics;
mod request;
mod scheduler;
mod sequence;
mod shared;
mod states;

pub use crate::logprobs::TokenLogprob;
pub use crate::request::EngineRequest;
pub use config::{EngineConfig, Rebalance};
pub use embedding::Pooling;
pub use handle::{EngineHandle, EngineThread, Shutdown, SubmitError};
pub use metrics::{Histogram, MetricsSnapshot, LATENCY_BUCKETS};
pub use request::{Event, EventSink, RequestId, Usage, MAX_TOP_LOGPROBS};
