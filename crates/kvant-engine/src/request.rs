//! What a generation is asked for: a tokenized prompt and how to continue
//! it. `Session` and the serving engine take the same request.

use crate::grammar::Constraint;
use crate::sampling::SamplingParams;

/// One generation request: a tokenized prompt and how to continue it, for
/// a [`crate::Session`] or the serving engine.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub prompt_ids: Vec<u32>,
    /// Generated tokens at most (the context length also ends a
    /// sequence); the first is always generated, see
    /// [`crate::continuation::MIN_TOKENS`].
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks, reference checks).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many
    /// alternatives (the serving engine takes
    /// 0..=[`crate::serving::MAX_TOP_LOGPROBS`]); `None` reports nothing.
    pub logprobs: Option<usize>,
    /// A grammar the output must match (structured output): a token mask
    /// before every sample. Each sequence needs its own (they are cloned
    /// fresh from a compiled grammar).
    pub constraint: Option<Constraint>,
    /// Added to these tokens' logits before every sample (OpenAI's
    /// `logit_bias`; -100 all but bans a token). Ids inside the vocabulary,
    /// biases finite (the serving engine refuses others; ids outside are
    /// ignored).
    pub logit_bias: Vec<(u32, f32)>,
    /// Leave control tokens (`<|im_end|>`, DeepSeek's tool-call markers)
    /// out of the text, as vLLM's `skip_special_tokens` does by default;
    /// `false` keeps their spelling (end-of-sequence ends the text either
    /// way).
    pub skip_special_tokens: bool,
}

impl EngineRequest {
    /// A continuation of `prompt_ids` for at most `max_tokens` tokens with
    /// `sampling`, with nothing else asked for (no stop strings, logprobs,
    /// grammar or biases; control tokens left out of the text): the base
    /// that callers set their fields on.
    pub fn new(prompt_ids: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        EngineRequest {
            prompt_ids,
            max_tokens,
            sampling,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
            logit_bias: Vec::new(),
            skip_special_tokens: true,
        }
    }

    /// [`Self::new`] with greedy sampling.
    pub fn greedy(prompt_ids: Vec<u32>, max_tokens: usize) -> Self {
        Self::new(prompt_ids, max_tokens, SamplingParams::greedy())
    }
}
