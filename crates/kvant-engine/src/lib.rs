//! kvant-engine: sampling, stop conditions and the generation loop over a
//! model's KV cache. The paged cache and the continuous-batching scheduler
//! arrive here next.

pub mod error;
pub mod sampling;
pub mod session;
pub mod stop;

pub use error::EngineError;
pub use sampling::{Sampler, SamplingParams};
pub use session::{FinishReason, GenerateOutput, GenerateRequest, Session};
