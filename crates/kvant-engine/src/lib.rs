//! kvant-engine: sampling, stop conditions, the single-stream generation
//! loop, and the serving engine (paged KV blocks with prefix caching, a
//! continuous-batching scheduler, and its thread and handle).

pub mod cluster;
pub mod continuation;
pub mod error;
pub mod grammar;
pub mod logprobs;
pub mod request;
pub mod sampling;
pub mod serving;
pub mod session;
pub mod speculative;
pub mod stop;

pub use continuation::FinishReason;
pub use error::EngineError;
pub use request::EngineRequest;
pub use sampling::{Sampler, SamplingParams};
pub use session::{GenerateOutput, Session};
