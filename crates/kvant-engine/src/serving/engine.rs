//! The engine's step: schedule, run one forward pass over the ragged
//! batch, then sample, detokenize and report for every sequence that
//! produced logits.

use super::blocks::BlockManager;
use super::handle::{EngineConfig, Shared};
use super::logprobs::token_logprob;
use super::request::{EngineRequest, Event, EventSink, RequestId, Usage};
use super::scheduler::{schedule, Limits};
use super::sequence::Sequence;
use crate::sampling::Sampler;
use crate::session::FinishReason;
use crate::stop::StopMatcher;
use kvant_model::arch::decoder::{DecoderModel, Logits, SeqStep};
use kvant_model::kv::KvPool;
use kvant_model::tokenizer::Tokenizer;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

pub(super) struct Engine<'t> {
    model: Arc<DecoderModel>,
    tokenizer: &'t Tokenizer,
    pool: KvPool,
    blocks: BlockManager,
    limits: Limits,
    waiting: VecDeque<Sequence<'t>>,
    running: Vec<Sequence<'t>>,
    shared: Arc<Shared>,
}

impl<'t> Engine<'t> {
    pub fn new(
        model: Arc<DecoderModel>,
        tokenizer: &'t Tokenizer,
        pool: KvPool,
        cfg: &EngineConfig,
        shared: Arc<Shared>,
    ) -> Self {
        let blocks = BlockManager::new(pool.n_blocks(), pool.block_size(), cfg.prefix_caching);
        Engine {
            model,
            tokenizer,
            pool,
            blocks,
            limits: Limits {
                max_batch_tokens: cfg.max_batch_tokens,
                max_running: cfg.max_running,
            },
            waiting: VecDeque::new(),
            running: Vec::new(),
            shared,
        }
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a validated request.
    pub fn add(&mut self, id: RequestId, req: EngineRequest, mut sink: EventSink) {
        let sampler = match Sampler::new(req.sampling.clone()) {
            Ok(s) => s,
            Err(e) => {
                self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                sink(Event::Failed(e.to_string()));
                return;
            }
        };
        self.waiting.push_back(Sequence {
            id,
            tokens: req.prompt_ids.clone(),
            prompt_len: req.prompt_ids.len(),
            computed: 0,
            blocks: Vec::new(),
            cids: Vec::new(),
            cached_tokens: None,
            stops: StopMatcher::new(req.stop.clone()),
            stream: self.tokenizer.decode_stream(true),
            req,
            sampler,
            sink,
            closed: false,
            arrived: Instant::now(),
            last_token: None,
        });
    }

    /// Ends a request wherever it is; its blocks are free for the next step.
    pub fn abort(&mut self, id: RequestId) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                self.finish(s, FinishReason::Abort);
            }
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.finish(s, FinishReason::Abort);
        }
        self.publish();
    }

    pub fn abort_all(&mut self) {
        let ids: Vec<RequestId> = self
            .waiting
            .iter()
            .chain(&self.running)
            .map(|s| s.id)
            .collect();
        for id in ids {
            self.abort(id);
        }
    }

    /// One scheduling decision and one forward pass.
    pub fn step(&mut self) {
        let (plan, outcome) = schedule(
            &mut self.running,
            &mut self.waiting,
            &mut self.blocks,
            &self.limits,
        );
        let w = &self.shared.waiting;
        w.fetch_sub(outcome.admitted, Ordering::AcqRel);
        w.fetch_add(outcome.preempted, Ordering::AcqRel);
        self.shared.metrics.update(|m| {
            m.preemptions += outcome.preempted as u64;
            m.prefix_cache_queries += outcome.cache_queries as u64;
            m.prefix_cache_hits += outcome.cache_hits as u64;
            m.prompt_tokens += outcome.cache_queries as u64;
        });
        if plan.is_empty() {
            self.publish();
            return;
        }
        let steps: Vec<SeqStep<'_>> = plan
            .iter()
            .map(|p| {
                let s = &self.running[p.seq];
                let end = s.computed + p.n;
                SeqStep {
                    tokens: &s.tokens[s.computed..end],
                    pos0: s.computed,
                    table: &s.blocks,
                    logits: if end == s.tokens.len() {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                }
            })
            .collect();
        let wants: Vec<bool> = steps.iter().map(|s| s.logits == Logits::Last).collect();
        let result = self.model.forward_batch(&mut self.pool, &steps);
        drop(steps);
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                // Not reachable with engine-made batches; never leave
                // clients waiting if it happens.
                let msg = e.to_string();
                let mut idx: Vec<usize> = plan.iter().map(|p| p.seq).collect();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    let mut s = self.running.remove(i);
                    s.release_blocks(&mut self.blocks);
                    if !s.closed {
                        (s.sink)(Event::Failed(msg.clone()));
                    }
                }
                self.publish();
                return;
            }
        };
        let vocab = self.model.config().vocab;
        let mut done = Vec::new();
        let mut row = 0;
        for (p, &want) in plan.iter().zip(&wants) {
            let s = &mut self.running[p.seq];
            s.computed += p.n;
            s.register_full_blocks(&mut self.blocks);
            if !want {
                continue;
            }
            let l = &mut logits[row * vocab..(row + 1) * vocab];
            row += 1;
            if let Some(reason) = advance(s, l, self.tokenizer, &self.shared) {
                done.push((p.seq, reason));
            }
        }
        done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        for (i, reason) in done {
            let s = self.running.remove(i);
            self.finish(s, reason);
        }
        self.publish();
    }

    /// Releases a sequence's blocks and sends its last event.
    fn finish(&mut self, mut s: Sequence<'t>, mut reason: FinishReason) {
        s.release_blocks(&mut self.blocks);
        let mut text = String::new();
        if reason == FinishReason::Length {
            // A stop string the flushed tail completes ends the request as
            // a stop, as it does in `Session`.
            let (released, hit) = s.stops.finish_with(&s.stream.flush());
            text = released;
            if hit {
                reason = FinishReason::Stop;
            }
        }
        let usage = Usage {
            prompt_tokens: s.prompt_len,
            completion_tokens: s.generated(),
            cached_tokens: s.cached_tokens.unwrap_or(0),
        };
        self.shared.metrics.update(|m| {
            if reason == FinishReason::Abort {
                m.requests_aborted += 1;
            } else {
                m.requests_finished += 1;
            }
        });
        // Counters first, so a client that sees its last event sees them.
        self.publish();
        if !s.closed {
            (s.sink)(Event::Finished {
                reason,
                text,
                usage,
            });
        }
    }

    fn publish(&self) {
        let (running, used) = (self.running.len(), self.blocks.total() - self.blocks.free());
        self.shared.metrics.update(|m| {
            m.running = running;
            m.kv_blocks_used = used;
        });
    }
}

/// Samples `s`'s next token from `logits` and reports it; returns why the
/// sequence ends, if it does.
fn advance(
    s: &mut Sequence<'_>,
    logits: &mut [f32],
    tokenizer: &Tokenizer,
    shared: &Shared,
) -> Option<FinishReason> {
    let raw = s.req.logprobs.map(|_| logits.to_vec());
    let history = &s.tokens[s.prompt_len..];
    let next = match s.sampler.sample(logits, history) {
        Ok(t) => t,
        Err(e) => {
            (s.sink)(Event::Failed(e.to_string()));
            s.closed = true;
            return Some(FinishReason::Abort);
        }
    };
    let now = Instant::now();
    shared.metrics.update(|m| {
        m.generation_tokens += 1;
        match s.last_token {
            None => m
                .time_to_first_token
                .observe((now - s.arrived).as_secs_f64()),
            Some(t) => m.inter_token_latency.observe((now - t).as_secs_f64()),
        }
    });
    s.last_token = Some(now);
    s.tokens.push(next);
    let logprob = raw.map(|r| token_logprob(&r, next, s.req.logprobs.unwrap_or(0)));
    let eos = !s.req.ignore_eos && tokenizer.eos_ids().contains(&next);
    let (text, stop_hit) = if eos {
        (String::new(), false)
    } else {
        match s.stream.step(next) {
            Ok(Some(piece)) => s.stops.push(&piece),
            Ok(None) => (String::new(), false),
            Err(e) => {
                (s.sink)(Event::Failed(e.to_string()));
                s.closed = true;
                return Some(FinishReason::Abort);
            }
        }
    };
    if !(s.sink)(Event::Token {
        id: next,
        text,
        logprob,
    }) {
        s.closed = true;
        return Some(FinishReason::Abort);
    }
    if eos || stop_hit {
        Some(FinishReason::Stop)
    } else if s.generated() >= s.req.max_tokens {
        Some(FinishReason::Length)
    } else {
        None
    }
}
