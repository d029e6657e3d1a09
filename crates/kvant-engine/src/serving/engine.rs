//! The engine's step: schedule, run one forward pass over the ragged
//! batch, then sample, detokenize and report for every sequence that
//! produced logits. With an MTP module, the step ends with one batched
//! pass of the module drafting the next token of every sequence that just
//! sampled; the next pass verifies each draft alongside its sequence's
//! sampled token (self-speculative decoding, lossless as in `Session`:
//! the sampler sees only the main model's rows, which are the same
//! whether one or two tokens run).

use super::blocks::BlockManager;
use super::handle::{EngineConfig, Shared};
use super::logprobs::token_logprob;
use super::request::{EngineRequest, Event, EventSink, RequestId, Usage};
use super::scheduler::{schedule, Limits};
use super::sequence::Sequence;
use crate::sampling::Sampler;
use crate::session::FinishReason;
use crate::speculative::{argmax, MtpState, Speculation};
use crate::stop::StopMatcher;
use kvant_model::arch::decoder::{DecoderModel, Logits, MtpStep, SeqStep};
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
    /// Whether decode steps draft (models with an MTP module).
    spec: Option<Speculation>,
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
        let model_has_mtp = model.has_mtp();
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
            spec: model_has_mtp.then(|| Speculation::new(cfg.speculation)),
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
            mtp: self.spec.is_some().then(MtpState::default),
            draft: None,
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
        let started = Instant::now();
        let mtp = self.spec.is_some();
        // A sequence with a draft and two tokens of budget verifies it.
        let verify: Vec<Option<[u32; 2]>> = plan
            .iter()
            .map(|p| {
                let s = &self.running[p.seq];
                match s.draft {
                    Some(d) if p.n == 2 && s.remaining() == 1 => Some([s.tokens[s.computed], d]),
                    _ => None,
                }
            })
            .collect();
        let steps: Vec<SeqStep<'_>> = plan
            .iter()
            .zip(&verify)
            .map(|(p, v)| {
                let s = &self.running[p.seq];
                let end = s.computed + p.n;
                let (tokens, logits) = match v {
                    Some(pair) => (&pair[..], Logits::All),
                    None => (
                        &s.tokens[s.computed..end],
                        match (end == s.tokens.len(), mtp) {
                            (true, false) => Logits::Last,
                            (true, true) => Logits::LastAndHidden,
                            (false, false) => Logits::None,
                            (false, true) => Logits::Hidden,
                        },
                    ),
                };
                SeqStep {
                    tokens,
                    pos0: s.computed,
                    table: &s.blocks,
                    logits,
                }
            })
            .collect();
        let logit_rows: Vec<usize> = steps
            .iter()
            .map(|s| match s.logits {
                Logits::All => s.tokens.len(),
                Logits::Last | Logits::LastAndHidden => 1,
                Logits::None | Logits::Hidden => 0,
            })
            .collect();
        // Only steps of nothing but decodes measure the speculation policy.
        let decode_only = plan.iter().all(|p| self.running[p.seq].remaining() == 1);
        let result = self.model.forward_batch_hidden(&mut self.pool, &steps);
        drop(steps);
        let (mut logits, hidden) = match result {
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
        let (vocab, h) = (self.model.config().vocab, self.model.config().hidden);
        let mut done = Vec::new();
        let (mut row, mut hrow) = (0, 0);
        let mut produced = 0;
        for ((p, v), &rows) in plan.iter().zip(&verify).zip(&logit_rows) {
            let s = &mut self.running[p.seq];
            let hid = match mtp {
                true => &hidden[hrow * h..(hrow + p.n) * h],
                false => &[][..],
            };
            hrow += p.n * usize::from(mtp);
            let l = &mut logits[row * vocab..(row + rows) * vocab];
            row += rows;
            s.draft = None;
            let Some([_, draft]) = *v else {
                s.computed += p.n;
                if let Some(m) = &mut s.mtp {
                    m.push_hidden(hid);
                }
                s.register_full_blocks(&mut self.blocks);
                if rows == 0 {
                    continue;
                }
                produced += 1;
                if let Some(reason) = advance(s, l, self.tokenizer, &self.shared) {
                    done.push((p.seq, reason));
                }
                continue;
            };
            // Verify: the sampled token's row decides; the draft's row
            // counts only if the sample equals the draft.
            let (l0, l1) = l.split_at_mut(vocab);
            s.computed += 1;
            if let Some(m) = &mut s.mtp {
                m.push_hidden(&hid[..h]);
            }
            produced += 1;
            let mut end = advance(s, l0, self.tokenizer, &self.shared);
            let hit = s.tokens.last() == Some(&draft);
            self.shared.metrics.update(|m| {
                m.spec_drafted += 1;
                m.spec_accepted += u64::from(hit);
            });
            if end.is_none() && hit {
                s.computed += 1;
                if let Some(m) = &mut s.mtp {
                    m.push_hidden(&hid[h..]);
                }
                produced += 1;
                end = advance(s, l1, self.tokenizer, &self.shared);
            }
            s.register_full_blocks(&mut self.blocks);
            if let Some(reason) = end {
                done.push((p.seq, reason));
            }
        }
        done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        for (i, reason) in done {
            let s = self.running.remove(i);
            self.finish(s, reason);
        }
        self.draft();
        if let Some(spec) = self.spec.as_mut().filter(|_| decode_only && produced > 0) {
            spec.record(started.elapsed().as_secs_f64(), produced);
        }
        self.publish();
    }

    /// One pass of the MTP module for every sequence that has just sampled
    /// and may take two more tokens: each gets a draft for the next pass.
    fn draft(&mut self) {
        let Some(spec) = &self.spec else { return };
        if !spec.wants_draft() {
            return;
        }
        let who: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let s = &self.running[i];
                s.mtp.is_some()
                    && s.draft.is_none()
                    && s.remaining() == 1
                    && s.computed > 0
                    && s.generated() + 1 < s.req.max_tokens
            })
            .collect();
        if who.is_empty() {
            return;
        }
        let mut inputs = Vec::with_capacity(who.len());
        for &i in &who {
            let s = &self.running[i];
            let (last, before) = s.tokens.split_last().map_or((0, &[][..]), |(l, b)| (*l, b));
            if let Some(m) = &s.mtp {
                inputs.push(m.step(before, last, &s.blocks));
            }
        }
        let steps: Vec<MtpStep<'_>> = inputs.iter().map(|(t, i)| i.with(t)).collect();
        let result = self.model.mtp_forward(&mut self.pool, &steps);
        drop(steps);
        drop(inputs);
        // Drafts only ever cost speed: a failed pass (not reachable with
        // engine-made steps) just drafts nothing.
        let Ok(logits) = result else { return };
        let (vocab, h) = (self.model.config().vocab, self.model.config().hidden);
        for (&i, row) in who.iter().zip(logits.chunks_exact(vocab)) {
            let s = &mut self.running[i];
            if let Some(m) = &mut s.mtp {
                m.consumed(h);
            }
            s.draft = Some(argmax(row));
        }
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
