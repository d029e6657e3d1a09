//! One sequence's continuation, token by token, as `Session` and the
//! serving engine both run it: a logits row becomes a token (logit bias,
//! the grammar's mask, the sampler, the log-probability of the raw row),
//! and a token becomes text and perhaps the end (end-of-sequence, the
//! grammar's completion, stop strings, the token limit).
//!
//! A continuation always takes its first token: the limit is checked after
//! each token, so `max_tokens` 0 yields one token like 1 does (the serving
//! engine refuses it at submission; see [`MIN_TOKENS`]).

use crate::grammar::{Constraint, GrammarError};
use crate::logprobs::{token_logprob, TokenLogprob};
use crate::request::EngineRequest;
use crate::sampling::{Sampler, SamplingError};
use crate::stop::StopMatcher;
use kvant_model::tokenizer::{DecodeStream, Tokenizer, TokenizerError};

/// The fewest tokens a generation produces, and so the smallest
/// `max_tokens` worth asking for: a request's default is never below it.
pub const MIN_TOKENS: usize = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// Aborted: by its client, at shutdown, or by an internal error.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Why a continuation cannot go on; its message is its cause's.
#[derive(Debug, thiserror::Error)]
pub enum ContinuationError {
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// A logits row to sample from, or the argmax a cluster already took
/// (only for a continuation whose [`Continuation::argmax_suffices`]).
pub(crate) enum RowRef<'a> {
    Logits(&'a mut [f32]),
    Argmax(Option<u32>),
}

/// A sampled token, not yet taken, with its raw row when its
/// log-probability is reported.
pub(crate) struct Sampled {
    pub token: u32,
    raw: Option<Vec<f32>>,
}

/// A taken token: the text it releases (empty while a UTF-8 character or
/// a possible stop string is incomplete), its log-probability when asked
/// for, and why the continuation ends with it, if it does.
pub(crate) struct Taken {
    pub token: u32,
    pub text: String,
    pub logprob: Option<TokenLogprob>,
    pub end: Option<FinishReason>,
}

pub(crate) struct Continuation<'t> {
    sampler: Sampler,
    stops: StopMatcher,
    stream: DecodeStream<'t>,
    eos: &'t [u32],
    ignore_eos: bool,
    max_tokens: usize,
    /// Tokens taken so far.
    generated: usize,
    logprobs: Option<usize>,
    constraint: Option<Constraint>,
    logit_bias: Vec<(u32, f32)>,
}

impl<'t> Continuation<'t> {
    /// The continuation `req` asks for (its prompt is not needed here).
    pub fn new(tokenizer: &'t Tokenizer, req: EngineRequest) -> Result<Self, SamplingError> {
        Ok(Continuation {
            sampler: Sampler::new(req.sampling)?,
            stops: StopMatcher::new(req.stop),
            stream: tokenizer.decode_stream(req.skip_special_tokens),
            eos: tokenizer.eos_ids(),
            ignore_eos: req.ignore_eos,
            max_tokens: req.max_tokens,
            generated: 0,
            logprobs: req.logprobs,
            constraint: req.constraint,
            logit_bias: req.logit_bias,
        })
    }

    /// Whether the argmax of a row is all this continuation needs of it:
    /// plain greedy sampling, nothing that changes or reports the row
    /// (over ranks, no logits row then crosses them).
    pub fn argmax_suffices(&self) -> bool {
        self.logprobs.is_none()
            && self.constraint.is_none()
            && self.logit_bias.is_empty()
            && self.sampler.params().is_plain_greedy()
    }

    /// Tokens the limit still allows.
    pub fn left(&self) -> usize {
        self.max_tokens.saturating_sub(self.generated)
    }

    /// Samples the next token from `row` (biased, then masked by the
    /// grammar); `history` is what the sampler's penalties look at.
    pub fn sample(
        &mut self,
        row: RowRef<'_>,
        history: &[u32],
    ) -> Result<Sampled, ContinuationError> {
        match row {
            RowRef::Logits(logits) => {
                let raw = self.logprobs.map(|_| logits.to_vec());
                for &(id, bias) in &self.logit_bias {
                    if let Some(l) = logits.get_mut(id as usize) {
                        *l += bias;
                    }
                }
                if let Some(c) = &mut self.constraint {
                    c.mask(logits)?;
                }
                let token = self.sampler.sample(logits, history)?;
                Ok(Sampled { token, raw })
            }
            // Plain greedy over ranks: the argmax is the sample.
            RowRef::Argmax(t) => Ok(Sampled {
                token: t.ok_or(SamplingError::NoFiniteLogit)?,
                raw: None,
            }),
        }
    }

    /// Takes a sampled token: its text past the detokenizer and the stop
    /// strings, and whether it ends the continuation.
    pub fn take(&mut self, sampled: Sampled) -> Result<Taken, ContinuationError> {
        let next = sampled.token;
        self.generated += 1;
        let logprob = sampled
            .raw
            .map(|r| token_logprob(&r, next, self.logprobs.unwrap_or(0)));
        // A constrained output ends where its grammar allows nothing but
        // end-of-sequence, `ignore_eos` or not.
        let constrained = self.constraint.is_some();
        let eos = (!self.ignore_eos || constrained) && self.eos.contains(&next);
        let mut complete = false;
        if let (Some(c), false) = (&mut self.constraint, eos) {
            complete = c.commit(next)?;
        }
        let (mut text, mut stop_hit) = match eos {
            true => (String::new(), false),
            false => match self.stream.step(next)? {
                Some(piece) => self.stops.push(&piece),
                None => (String::new(), false),
            },
        };
        if complete && !stop_hit {
            // The grammar admits nothing more: this is the last token, and
            // what the detokenizer and the stop strings hold back goes with it.
            let (tail, hit) = self.stops.finish_with(&self.stream.flush());
            text.push_str(&tail);
            stop_hit = hit;
        }
        let end = if eos || stop_hit || complete {
            Some(FinishReason::Stop)
        } else if self.generated >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        Ok(Taken {
            token: next,
            text,
            logprob,
            end,
        })
    }

    /// Ends the continuation for `reason`: the text still held back, and
    /// the reason it ends with. At the limit (`Length`), what the
    /// detokenizer and the stop strings hold back is released, and a stop
    /// string the flushed tail completes makes it a stop.
    pub fn finish(&mut self, reason: FinishReason) -> (String, FinishReason) {
        if reason != FinishReason::Length {
            return (String::new(), reason);
        }
        match self.stops.finish_with(&self.stream.flush()) {
            (text, true) => (text, FinishReason::Stop),
            (text, false) => (text, reason),
        }
    }
}
