//! One conversation's state on one model: its KV cache and the tokens it
//! holds, so a follow-up prompt that extends the previous one (a chat turn)
//! only computes the new tokens.

use crate::error::EngineError;
use crate::sampling::{Sampler, SamplingParams};
use crate::stop::StopMatcher;
use kvant_model::arch::llama::{LlamaModel, Logits};
use kvant_model::kv::KvCache;
use kvant_model::tokenizer::Tokenizer;
use std::time::Instant;

/// Tokens per forward pass during prefill: bounds activation memory for
/// long prompts without hurting matmul efficiency.
const PREFILL_CHUNK: usize = 512;

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks, reference checks).
    pub ignore_eos: bool,
}

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

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Prompt tokens actually computed (the rest came from the cache).
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    /// Forward passes after the prompt, and their time.
    pub decode_steps: usize,
    pub decode_secs: f64,
}

pub struct Session<'m> {
    model: &'m LlamaModel,
    tokenizer: &'m Tokenizer,
    cache: KvCache,
    /// Tokens whose keys and values `cache` holds.
    tokens: Vec<u32>,
}

impl<'m> Session<'m> {
    /// A session whose cache holds up to `capacity` tokens (capped at the
    /// model's context length). Memory is committed as it is used.
    pub fn new(
        model: &'m LlamaModel,
        tokenizer: &'m Tokenizer,
        capacity: usize,
    ) -> Result<Self, EngineError> {
        Ok(Session {
            cache: model.new_cache(capacity)?,
            model,
            tokenizer,
            tokens: Vec::new(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Generates a continuation of `req.prompt_ids`, calling `on_text` with
    /// each piece of text as soon as it is complete UTF-8 and cannot be part
    /// of a stop string.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput, EngineError> {
        let prompt = &req.prompt_ids;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= self.cache.capacity() {
            return Err(EngineError::PromptTooLong {
                prompt: prompt.len(),
                context: self.cache.capacity(),
            });
        }
        let mut sampler = Sampler::new(req.sampling.clone())?;
        // Reuse the cached prefix, but always recompute the last prompt
        // token: its logits are needed.
        let common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        self.cache.truncate(common);
        self.tokens.truncate(common);

        let t0 = Instant::now();
        let mut logits = Vec::new();
        for chunk in prompt[common..].chunks(PREFILL_CHUNK) {
            logits = self.model.forward(chunk, &mut self.cache, Logits::Last)?;
            self.tokens.extend_from_slice(chunk);
        }
        let prefill_secs = t0.elapsed().as_secs_f64();

        let eos = self.tokenizer.eos_ids();
        let mut stream = self.tokenizer.decode_stream(true);
        let mut stops = StopMatcher::new(req.stop.clone());
        let mut out = GenerateOutput {
            token_ids: Vec::new(),
            text: String::new(),
            finish_reason: FinishReason::Length,
            prefill_tokens: prompt.len() - common,
            prefill_secs,
            decode_steps: 0,
            decode_secs: 0.0,
        };
        let mut emit = |s: &str, out: &mut GenerateOutput| {
            if !s.is_empty() {
                on_text(s);
                out.text.push_str(s);
            }
        };
        let t1 = Instant::now();
        while out.token_ids.len() < req.max_tokens {
            let next = sampler.sample(&mut logits, &self.tokens)?;
            out.token_ids.push(next);
            if !req.ignore_eos && eos.contains(&next) {
                out.finish_reason = FinishReason::Stop;
                break;
            }
            if let Some(piece) = stream.step(next)? {
                let (released, hit) = stops.push(&piece);
                emit(&released, &mut out);
                if hit {
                    out.finish_reason = FinishReason::Stop;
                    break;
                }
            }
            if out.token_ids.len() == req.max_tokens {
                break;
            }
            if self.tokens.len() + 1 >= self.cache.capacity() {
                // The context is full: the token is produced but not fed back.
                break;
            }
            logits = self.model.forward(&[next], &mut self.cache, Logits::Last)?;
            self.tokens.push(next);
            out.decode_steps += 1;
        }
        if out.finish_reason == FinishReason::Length {
            let tail = stream.flush();
            let (released, hit) = stops.push(&tail);
            emit(&released, &mut out);
            if hit {
                out.finish_reason = FinishReason::Stop;
            } else {
                emit(&stops.finish(), &mut out);
            }
        }
        out.decode_secs = t1.elapsed().as_secs_f64();
        Ok(out)
    }
}
