//! What a client hands the serving engine and what it gets back.

use crate::continuation::{FinishReason, Spec};
use crate::grammar::Constraint;
use crate::logprobs::TokenLogprob;
use crate::sampling::SamplingParams;

/// One generation request: a tokenized prompt and how to continue it.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub prompt_ids: Vec<u32>,
    /// Generated tokens at most (the context length also ends a sequence).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many
    /// alternatives (0..=[`MAX_TOP_LOGPROBS`]); `None` reports nothing.
    pub logprobs: Option<usize>,
    /// A grammar the output must match (structured output): a token mask
    /// before every sample. Each sequence needs its own (they are cloned
    /// fresh from a compiled grammar).
    pub constraint: Option<Constraint>,
    /// Added to these tokens' logits before every sample (OpenAI's
    /// `logit_bias`; -100 all but bans a token). Ids inside the vocabulary,
    /// biases finite.
    pub logit_bias: Vec<(u32, f32)>,
    /// Leave control tokens (`<|im_end|>`, DeepSeek's tool-call markers)
    /// out of the text, as vLLM's `skip_special_tokens` does by default;
    /// `false` keeps their spelling (end-of-sequence ends the text either
    /// way).
    pub skip_special_tokens: bool,
}

impl EngineRequest {
    /// A greedy continuation of `prompt_ids` for at most `max_tokens`
    /// tokens, with nothing else asked for (no stop strings, logprobs,
    /// grammar or biases; control tokens left out of the text): the base
    /// that callers set their fields on.
    pub fn greedy(prompt_ids: Vec<u32>, max_tokens: usize) -> Self {
        EngineRequest {
            prompt_ids,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
            logit_bias: Vec::new(),
            skip_special_tokens: true,
        }
    }

    /// The prompt, and what its continuation is asked for.
    pub(crate) fn into_parts(self) -> (Vec<u32>, Spec) {
        let spec = Spec {
            max_tokens: self.max_tokens,
            sampling: self.sampling,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            constraint: self.constraint,
            logit_bias: self.logit_bias,
            skip_special_tokens: self.skip_special_tokens,
        };
        (self.prompt_ids, spec)
    }
}

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
