//! What the serving engine reports about a request (its request itself,
//! [`crate::request::EngineRequest`], is `Session`'s too), and the limits
//! it checks at submission.

use crate::continuation::FinishReason;
use crate::logprobs::TokenLogprob;

/// OpenAI's limit on `top_logprobs`.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Identifies a submitted request, for [`crate::serving::EngineHandle::abort`].
pub type RequestId = u64;

/// What the engine reports about one request, in order: any number of
/// `Token`s (an embedding request: one `Embedding`), then exactly one
/// `Finished` (or `Failed`).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// One generated token and the text it releases, which may be empty
    /// while a UTF-8 character or a possible stop string is incomplete.
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// An embedding request's pooled hidden state (see
    /// [`super::Pooling`]), not normalized: sent once, then `Finished`.
    Embedding(Vec<f32>),
    Finished {
        reason: FinishReason,
        /// Text held back until the end (never part of a stop string).
        text: String,
        usage: Usage,
    },
    /// The engine could not run the request (an internal error); nothing
    /// more follows.
    Failed(String),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
}

/// Receives a request's events on the engine thread. Returns `false` when
/// the client is gone, which aborts the request and frees its blocks.
pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;
