//! One conversation's state on one model: its KV cache and the tokens it
//! holds, so a follow-up prompt that extends the previous one (a chat turn)
//! only computes the new tokens.

use crate::cluster::{forward_seq, Cluster, Row, Want};
use crate::error::EngineError;
use crate::sampling::{Sampler, SamplingError, SamplingParams};
use crate::speculative::{MtpDrafter, Policy};
use crate::stop::StopMatcher;
use kvant_model::arch::decoder::{DecoderModel, Hidden, Logits};
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
    /// Tokens drafted by the MTP module and accepted (self-speculative
    /// decoding; both 0 without it).
    pub drafted: usize,
    pub accepted: usize,
}

pub struct Session<'m> {
    model: &'m DecoderModel,
    /// Rank 0's handle when the model runs over several ranks.
    cluster: Option<&'m Cluster>,
    tokenizer: &'m Tokenizer,
    cache: KvCache,
    /// Tokens whose keys and values `cache` holds.
    tokens: Vec<u32>,
    /// Present when the model's MTP module is loaded: every decode step
    /// then drafts a second token (see [`crate::speculative`]).
    drafter: Option<MtpDrafter>,
}

impl<'m> Session<'m> {
    /// A session whose cache holds up to `capacity` tokens (capped at the
    /// model's context length). Memory is committed as it is used.
    pub fn new(
        model: &'m DecoderModel,
        tokenizer: &'m Tokenizer,
        capacity: usize,
    ) -> Result<Self, EngineError> {
        Ok(Session {
            cache: model.new_cache(capacity)?,
            drafter: model.has_mtp().then(|| MtpDrafter::new(Policy::default())),
            model,
            cluster: None,
            tokenizer,
            tokens: Vec::new(),
        })
    }

    /// A session whose forward passes run over the ranks of `cluster`
    /// (this is rank 0; the others run [`crate::cluster::run_worker`]).
    pub fn on_cluster(
        cluster: &'m Cluster,
        tokenizer: &'m Tokenizer,
        capacity: usize,
    ) -> Result<Self, EngineError> {
        Ok(Session {
            cache: cluster.cache(capacity)?,
            drafter: None,
            model: cluster.model(),
            cluster: Some(cluster),
            tokenizer,
            tokens: Vec::new(),
        })
    }

    /// One pass over `tokens` (appended to the cache): the last row's
    /// logits (on a cluster, only its argmax when `greedy`) and, with a
    /// drafter, every token's hidden state.
    fn pass(&mut self, tokens: &[u32], greedy: bool) -> Result<(Row, Hidden), EngineError> {
        if let Some(c) = self.cluster {
            let want = match greedy {
                true => Want::LastArgmax,
                false => Want::Last,
            };
            let mut rows = forward_seq(self.model, Some(c), &mut self.cache, tokens, want)?;
            let row = rows
                .pop()
                .ok_or(EngineError::Config("no logits row came back".into()))?;
            return Ok((row, Vec::new()));
        }
        let want = match self.drafter {
            Some(_) => Logits::LastAndHidden,
            None => Logits::Last,
        };
        let (l, h) = self.model.forward_hidden(tokens, &mut self.cache, want)?;
        Ok((Row::Logits(l), h))
    }

    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// When decode steps draft with the model's MTP module (no effect on
    /// a model without one; never on the tokens produced).
    pub fn set_speculation(&mut self, policy: Policy) {
        if let Some(d) = &mut self.drafter {
            d.spec.set_policy(policy);
        }
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
        let mut common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        let hidden = self.model.config().hidden;
        if let Some(d) = &mut self.drafter {
            common = d.state.truncate(common, hidden);
        }
        // A cache of linear-attention layers may go back further (to the
        // state it saved, or its start): recompute from where it is.
        self.cache.truncate(common);
        let common = self.cache.len();
        self.tokens.truncate(common);

        let t0 = Instant::now();
        let greedy = req.sampling.is_plain_greedy();
        let mut logits = Row::Logits(Vec::new());
        for chunk in prompt[common..].chunks(PREFILL_CHUNK) {
            let (l, h) = self.pass(chunk, greedy)?;
            logits = l;
            if let Some(d) = &mut self.drafter {
                d.state.push_hidden(&h);
            }
            self.tokens.extend_from_slice(chunk);
        }
        let prefill_secs = t0.elapsed().as_secs_f64();
        // The next turn's prompt starts with this one.
        self.cache.save_state();

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
            drafted: 0,
            accepted: 0,
        };
        let mut emit = |s: &str, out: &mut GenerateOutput| {
            if !s.is_empty() {
                on_text(s);
                out.text.push_str(s);
            }
        };
        let t1 = Instant::now();
        // Takes a sampled token: records and streams it; false when it ends
        // the generation.
        let mut take = |next: u32, out: &mut GenerateOutput| -> Result<bool, EngineError> {
            out.token_ids.push(next);
            if !req.ignore_eos && eos.contains(&next) {
                out.finish_reason = FinishReason::Stop;
                return Ok(false);
            }
            if let Some(piece) = stream.step(next)? {
                let (released, hit) = stops.push(&piece);
                emit(&released, out);
                if hit {
                    out.finish_reason = FinishReason::Stop;
                    return Ok(false);
                }
            }
            Ok(out.token_ids.len() < req.max_tokens)
        };
        let mut next = sample(&mut sampler, logits, &self.tokens)?;
        while take(next, &mut out)? {
            let room = self.cache.capacity() - self.tokens.len();
            if room < 2 {
                // The context is full: the token is produced but not fed back.
                break;
            }
            out.decode_steps += 1;
            let step = Instant::now();
            let draft = match &mut self.drafter {
                Some(d) if room >= 3 && d.spec.wants_draft() => {
                    Some(d.draft(self.model, &mut self.cache, &self.tokens, next)?)
                }
                _ => None,
            };
            let Some(draft) = draft else {
                let (l, h) = self.pass(&[next], greedy)?;
                if let Some(d) = &mut self.drafter {
                    d.state.push_hidden(&h);
                }
                self.tokens.push(next);
                next = sample(&mut sampler, l, &self.tokens)?;
                if let Some(d) = &mut self.drafter {
                    d.spec.record(step.elapsed().as_secs_f64(), 1);
                }
                continue;
            };
            // Verify: one pass over the sampled token and the draft.
            let (l, h) = self
                .model
                .forward_hidden(&[next, draft], &mut self.cache, Logits::All)?;
            let vocab = l.len() / 2;
            let (mut l1, mut l2) = (l[..vocab].to_vec(), l[vocab..].to_vec());
            self.tokens.push(next);
            let second = sampler.sample(&mut l1, &self.tokens)?;
            let hit = second == draft;
            out.drafted += 1;
            out.accepted += usize::from(hit);
            if let Some(d) = &mut self.drafter {
                // A rejected draft's row and keys are dropped.
                d.state.push_hidden(if hit { &h } else { &h[..hidden] });
            }
            if !hit {
                self.cache.truncate(self.tokens.len());
                if let Some(d) = &mut self.drafter {
                    d.spec.record(step.elapsed().as_secs_f64(), 1);
                }
                next = second;
                continue;
            }
            self.tokens.push(draft);
            if !take(second, &mut out)? {
                break;
            }
            next = sampler.sample(&mut l2, &self.tokens)?;
            if let Some(d) = &mut self.drafter {
                d.spec.record(step.elapsed().as_secs_f64(), 2);
            }
        }
        if out.finish_reason == FinishReason::Length {
            let (text, hit) = stops.finish_with(&stream.flush());
            emit(&text, &mut out);
            if hit {
                out.finish_reason = FinishReason::Stop;
            }
        }
        out.decode_secs = t1.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// The next token from a logits row, or the argmax a cluster already took
/// (only for plain greedy sampling, which is the argmax).
fn sample(sampler: &mut Sampler, row: Row, history: &[u32]) -> Result<u32, EngineError> {
    match row {
        Row::Logits(mut l) => Ok(sampler.sample(&mut l, history)?),
        Row::Argmax(t) => Ok(t.ok_or(SamplingError::NoFiniteLogit)?),
        Row::Hidden(_) => Err(EngineError::Config(
            "hidden states where a logits row was asked for".into(),
        )),
    }
}
