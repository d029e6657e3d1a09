//! One conversation's state on one model: its KV cache and the tokens it
//! holds, so a follow-up prompt that extends the previous one (a chat turn)
//! only computes the new tokens.

use crate::cluster::{forward_seq, save_state, truncate, Cluster, Row, Want};
use crate::continuation::{Continuation, FinishReason, RowRef, Taken};
use crate::error::EngineError;
use crate::logprobs::TokenLogprob;
use crate::request::EngineRequest;
use crate::speculative::{MtpDrafter, MtpState, Policy};
use kvant_model::arch::decoder::{DecoderModel, Hidden, Logits};
use kvant_model::kv::KvCache;
use kvant_model::tokenizer::Tokenizer;
use std::time::Instant;

/// Tokens per forward pass during prefill: bounds activation memory for
/// long prompts without hurting matmul efficiency.
const PREFILL_CHUNK: usize = 512;

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
    /// Each token's log-probability, when the request asked for them.
    pub logprobs: Vec<TokenLogprob>,
}

impl GenerateOutput {
    /// Records a taken token and streams its text to `on_text`.
    fn push(&mut self, taken: Taken, on_text: &mut dyn FnMut(&str)) {
        self.token_ids.push(taken.token);
        self.emit(&taken.text, on_text);
        self.logprobs.extend(taken.logprob);
    }

    /// Streams released text to `on_text` and keeps it.
    fn emit(&mut self, text: &str, on_text: &mut dyn FnMut(&str)) {
        if !text.is_empty() {
            on_text(text);
            self.text.push_str(text);
        }
    }
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
        let drafter = model.has_mtp().then(|| MtpDrafter::new(Policy::default()));
        Ok(Self::empty(
            model,
            None,
            tokenizer,
            model.new_cache(capacity)?,
            drafter,
        ))
    }

    /// A session whose forward passes run over the ranks of `cluster`
    /// (this is rank 0; the others run [`crate::cluster::run_worker`]).
    pub fn on_cluster(
        cluster: &'m Cluster,
        tokenizer: &'m Tokenizer,
        capacity: usize,
    ) -> Result<Self, EngineError> {
        let cache = cluster.cache(capacity)?;
        Ok(Self::empty(
            cluster.model(),
            Some(cluster),
            tokenizer,
            cache,
            None,
        ))
    }

    /// A session with nothing in its cache yet.
    fn empty(
        model: &'m DecoderModel,
        cluster: Option<&'m Cluster>,
        tokenizer: &'m Tokenizer,
        cache: KvCache,
        drafter: Option<MtpDrafter>,
    ) -> Self {
        Session {
            cache,
            drafter,
            model,
            cluster,
            tokenizer,
            tokens: Vec::new(),
        }
    }

    /// One pass over `tokens` (appended to the cache): the last row's
    /// logits (on a cluster, only its argmax when `argmax`) and, with a
    /// drafter, every token's hidden state.
    fn pass(&mut self, tokens: &[u32], argmax: bool) -> Result<(Row, Hidden), EngineError> {
        if let Some(c) = self.cluster {
            let want = match argmax {
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
        req: &EngineRequest,
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
        let mut cont = Continuation::new(self.tokenizer, req.clone())?;
        let common = self.reuse_prefix(prompt)?;
        let t0 = Instant::now();
        let argmax = cont.argmax_suffices();
        let mut row = Row::Logits(Vec::new());
        for chunk in prompt[common..].chunks(PREFILL_CHUNK) {
            let (l, h) = self.pass(chunk, argmax)?;
            row = l;
            if let Some(d) = &mut self.drafter {
                d.state.push_hidden(&h);
            }
            self.tokens.extend_from_slice(chunk);
        }
        let prefill_secs = t0.elapsed().as_secs_f64();
        // The next turn's prompt starts with this one.
        save_state(self.cluster, &mut self.cache)?;
        if let Some(d) = self.drafter.as_mut().filter(|_| self.cache.has_state()) {
            d.saved = Some((self.cache.len(), d.state.clone()));
        }

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
            logprobs: Vec::new(),
        };
        let t1 = Instant::now();
        let end = self.decode(&mut cont, row, argmax, &mut out, on_text)?;
        let (text, reason) = cont.finish(end.unwrap_or(FinishReason::Length));
        out.emit(&text, on_text);
        out.finish_reason = reason;
        out.decode_secs = t1.elapsed().as_secs_f64();
        Ok(out)
    }

    /// Cuts the cache back to the longest prefix it shares with `prompt`
    /// (never the whole prompt: the last token's logits are needed);
    /// returns the tokens it keeps.
    fn reuse_prefix(&mut self, prompt: &[u32]) -> Result<usize, EngineError> {
        let mut common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        let hidden = self.model.hidden_width();
        if let Some(d) = &mut self.drafter {
            common = d.state.truncate(common, hidden);
        }
        // A cache with a state per sequence may go back further (to the
        // state it saved, or its start): recompute from where it is, the
        // MTP module from where it was then.
        truncate(self.cluster, &mut self.cache, common)?;
        let got = self.cache.len();
        if let Some(d) = self.drafter.as_mut().filter(|_| got < common) {
            d.state = match &d.saved {
                Some((at, state)) if *at == got => state.clone(),
                _ => MtpState::default(),
            };
        }
        self.tokens.truncate(got);
        Ok(got)
    }

    /// Decode steps from the prompt's last row until the continuation ends
    /// (its reason) or the context is full (`None`): each takes a token,
    /// and feeds it back (with a draft to verify when the drafter drafts).
    fn decode(
        &mut self,
        cont: &mut Continuation<'_>,
        mut row: Row,
        argmax: bool,
        out: &mut GenerateOutput,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Option<FinishReason>, EngineError> {
        let (mut next, mut end) = advance(cont, row_ref(&mut row)?, &self.tokens, out, on_text)?;
        while end.is_none() {
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
            if let Some(draft) = draft {
                (next, end) = self.verify(cont, next, draft, step, out, on_text)?;
                continue;
            }
            let (mut row, h) = self.pass(&[next], argmax)?;
            if let Some(d) = &mut self.drafter {
                d.state.push_hidden(&h);
            }
            self.tokens.push(next);
            (next, end) = advance(cont, row_ref(&mut row)?, &self.tokens, out, on_text)?;
            if let Some(d) = &mut self.drafter {
                d.spec.record(step.elapsed().as_secs_f64(), 1);
            }
        }
        Ok(end)
    }

    /// One pass over the taken token `next` and the module's `draft`
    /// (started at `step`): the token after `next` comes from its row,
    /// and only if it equals the draft does the draft's row give the one
    /// after it. Returns the last token taken and the end, if reached.
    fn verify(
        &mut self,
        cont: &mut Continuation<'_>,
        next: u32,
        draft: u32,
        step: Instant,
        out: &mut GenerateOutput,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<(u32, Option<FinishReason>), EngineError> {
        let (mut l, h) = self
            .model
            .forward_hidden(&[next, draft], &mut self.cache, Logits::All)?;
        let vocab = l.len() / 2;
        let (l1, l2) = l.split_at_mut(vocab);
        self.tokens.push(next);
        let (second, end) = advance(cont, RowRef::Logits(l1), &self.tokens, out, on_text)?;
        let hit = second == draft;
        out.drafted += 1;
        out.accepted += usize::from(hit);
        let hidden = self.model.hidden_width();
        if let Some(d) = &mut self.drafter {
            // A rejected draft's row and keys are dropped (a state steps
            // back over it, see `StateShape::rewind`).
            d.state.push_hidden(if hit { &h } else { &h[..hidden] });
        }
        if !hit {
            truncate(self.cluster, &mut self.cache, self.tokens.len())?;
            if let Some(d) = &mut self.drafter {
                d.spec.record(step.elapsed().as_secs_f64(), 1);
            }
            return Ok((second, end));
        }
        self.tokens.push(draft);
        if end.is_some() {
            return Ok((second, end));
        }
        let taken = advance(cont, RowRef::Logits(l2), &self.tokens, out, on_text)?;
        if let Some(d) = &mut self.drafter {
            d.spec.record(step.elapsed().as_secs_f64(), 2);
        }
        Ok(taken)
    }
}

/// Samples the next token from `row` and takes it into `out`; returns it
/// and why the generation ends with it, if it does.
fn advance(
    cont: &mut Continuation<'_>,
    row: RowRef<'_>,
    history: &[u32],
    out: &mut GenerateOutput,
    on_text: &mut dyn FnMut(&str),
) -> Result<(u32, Option<FinishReason>), EngineError> {
    let sampled = cont.sample(row, history)?;
    let taken = cont.take(sampled)?;
    let (next, end) = (taken.token, taken.end);
    out.push(taken, on_text);
    Ok((next, end))
}

/// A pass's row to sample from: logits, or the argmax a cluster already
/// took (only when the continuation's argmax suffices).
fn row_ref(row: &mut Row) -> Result<RowRef<'_>, EngineError> {
    match row {
        Row::Logits(l) => Ok(RowRef::Logits(l)),
        Row::Argmax(t) => Ok(RowRef::Argmax(*t)),
        Row::Hidden(_) => Err(EngineError::Config(
            "hidden states where a logits row was asked for".into(),
        )),
    }
}
