//! The engine's step: schedule, run one forward pass over the ragged
//! batch, then sample, detokenize and report for every sequence that
//! produced logits. With an MTP module, the step ends with one batched
//! pass of the module drafting the next token of every sequence that just
//! sampled; the next pass verifies each draft alongside its sequence's
//! sampled token (self-speculative decoding, lossless as in `Session`:
//! the sampler sees only the main model's rows, which are the same
//! whether one or two tokens run).
//!
//! Over several ranks (a [`Cluster`]) the engine runs on rank 0 and keeps
//! one [`Group`] per data-parallel group: its own block manager (the
//! group's ranks hold its pool) and running sequences, scheduled under
//! the same limits as a single engine. Waiting requests go to the least
//! busy group. One step is one forward pass of every group together
//! (a group with nothing to run still joins it).

use super::blocks::BlockManager;
use super::config::{EngineConfig, Rebalance};
use super::embedding::{Pooled, Pooling};
use super::logprobs::token_logprob;
use super::request::{EngineRequest, Event, EventSink, RequestId, Usage};
use super::scheduler::{schedule, Limits, Outcome, Scheduled};
use super::sequence::Sequence;
use super::shared::{InFlight, Shared};
use super::states::StateSlots;
use crate::cluster::{Cluster, Row, Want};
use crate::error::EngineError;
use crate::sampling::{Sampler, SamplingError};
use crate::session::FinishReason;
use crate::speculative::{MtpState, Speculation};
use crate::stop::StopMatcher;
use kvant_model::arch::decoder::{DecoderModel, Logits, MtpStep, SeqStep};
use kvant_model::kv::KvPool;
use kvant_model::tokenizer::Tokenizer;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// One data-parallel group's share of the engine.
struct Group<'t> {
    blocks: BlockManager,
    running: Vec<Sequence<'t>>,
}

pub(super) struct Engine<'t> {
    model: Arc<DecoderModel>,
    /// The other ranks, when the model runs over several.
    cluster: Option<Arc<Cluster>>,
    tokenizer: &'t Tokenizer,
    /// Group 0's pool (this rank's); the other groups' live on their ranks.
    pool: KvPool,
    groups: Vec<Group<'t>>,
    limits: Limits,
    waiting: VecDeque<Sequence<'t>>,
    shared: Arc<Shared>,
    /// Whether decode steps draft (models with an MTP module).
    spec: Option<Speculation>,
    rebalance: Option<Rebalance>,
    /// Steps that ran a forward pass.
    steps: usize,
    /// Recurrent-state slots, for a model with linear-attention layers
    /// (one process: such models do not run over ranks yet).
    states: Option<StateSlots>,
}

/// A step's logits: one process's `[rows, vocab]`, or what each group's
/// ranks sent rank 0.
enum Rows {
    Local(Vec<f32>),
    Groups(Vec<Vec<Row>>),
}

/// One row of [`Rows`].
enum RowRef<'a> {
    Logits(&'a mut [f32]),
    Argmax(Option<u32>),
}

impl Rows {
    /// Group `g`'s row `i`.
    fn get(&mut self, g: usize, i: usize, vocab: usize) -> Option<RowRef<'_>> {
        match self {
            Rows::Local(l) => l.get_mut(i * vocab..(i + 1) * vocab).map(RowRef::Logits),
            Rows::Groups(gs) => match gs.get_mut(g)?.get_mut(i)? {
                Row::Logits(l) => Some(RowRef::Logits(l)),
                Row::Argmax(t) => Some(RowRef::Argmax(*t)),
                Row::Hidden(_) => None,
            },
        }
    }

    /// Entries a step of `n` tokens takes in a group's rows: its logits
    /// rows (in one process, what the model computed; over ranks, what
    /// rank 0 asked for), and over ranks one for a sequence's hidden
    /// states.
    fn taken(&self, want: Want, logits: Logits, n: usize) -> usize {
        match (self, want) {
            (Rows::Local(_), _) => logits.rows(n),
            (Rows::Groups(_), Want::Hidden) => 1,
            (Rows::Groups(_), _) => want.rows(n),
        }
    }

    /// A [`Want::Hidden`] sequence's hidden states: over ranks its entry
    /// `i` of group `g`, in one process `local[at..]`.
    fn hidden<'a>(&'a self, g: usize, i: usize, local: &'a [f32], at: usize) -> &'a [f32] {
        match self {
            Rows::Local(_) => local.get(at..).unwrap_or(&[]),
            Rows::Groups(gs) => match gs.get(g).and_then(|r| r.get(i)) {
                Some(Row::Hidden(h)) => h,
                _ => &[],
            },
        }
    }
}

impl<'t> Engine<'t> {
    pub fn new(
        model: Arc<DecoderModel>,
        cluster: Option<Arc<Cluster>>,
        tokenizer: &'t Tokenizer,
        pool: KvPool,
        cfg: &EngineConfig,
        shared: Arc<Shared>,
    ) -> Self {
        let n_groups = cluster.as_ref().map_or(1, |c| c.layout().dp);
        let groups = (0..n_groups)
            .map(|_| Group {
                blocks: BlockManager::new(pool.n_blocks(), pool.block_size(), cfg.prefix_caching),
                running: Vec::new(),
            })
            .collect();
        let model_has_mtp = model.has_mtp();
        let states = (pool.state_slots() > 0).then(|| {
            let running = cfg.max_running.min(pool.state_slots());
            StateSlots::new(running, pool.state_slots() - running)
        });
        Engine {
            model,
            cluster,
            tokenizer,
            pool,
            groups,
            limits: Limits {
                max_batch_tokens: cfg.max_batch_tokens,
                max_running: cfg.max_running,
            },
            waiting: VecDeque::new(),
            shared,
            spec: model_has_mtp.then(|| Speculation::new(cfg.speculation)),
            rebalance: cfg.rebalance,
            steps: 0,
            states,
        }
    }

    /// The cluster, to prove the ranks alive while idle.
    pub fn cluster(&self) -> Option<&Cluster> {
        self.cluster.as_deref()
    }

    /// Stops after `e` (ranks that lost one another): every request fails
    /// with it, and no new one is accepted. Returns `e`.
    pub fn fail(&mut self, e: EngineError) -> EngineError {
        self.shared.closed.store(true, Ordering::Release);
        let msg = e.to_string();
        while let Some(mut s) = self.waiting.pop_front() {
            self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
            s.fail(&msg);
        }
        for g in &mut self.groups {
            for mut s in std::mem::take(&mut g.running) {
                s.release_blocks(&mut g.blocks);
                s.fail(&msg);
            }
        }
        self.publish();
        e
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || self.groups.iter().any(|g| !g.running.is_empty())
    }

    /// Queues a validated request; with `embed`, an embedding of its prompt.
    pub fn add(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        embed: Option<Pooling>,
        mut sink: EventSink,
    ) {
        let sampler = match Sampler::new(req.sampling.clone()) {
            Ok(s) => s,
            Err(e) => {
                self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                self.shared.release_place();
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
            stream: self.tokenizer.decode_stream(req.skip_special_tokens),
            req,
            sampler,
            sink,
            closed: false,
            arrived: Instant::now(),
            last_token: None,
            mtp: (self.spec.is_some() && embed.is_none()).then(MtpState::default),
            draft: None,
            state: None,
            restore: None,
            in_flight: Some(InFlight(Arc::clone(&self.shared))),
            embed: embed.map(Pooled::new),
        });
    }

    /// Ends a request wherever it is; its blocks are free for the next step.
    pub fn abort(&mut self, id: RequestId) {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                self.finish(0, s, FinishReason::Abort);
            }
        } else {
            for g in 0..self.groups.len() {
                if let Some(i) = self.groups[g].running.iter().position(|s| s.id == id) {
                    let s = self.groups[g].running.remove(i);
                    self.finish(g, s, FinishReason::Abort);
                    break;
                }
            }
        }
        self.publish();
    }

    pub fn abort_all(&mut self) {
        let ids: Vec<RequestId> = self
            .waiting
            .iter()
            .chain(self.groups.iter().flat_map(|g| &g.running))
            .map(|s| s.id)
            .collect();
        for id in ids {
            self.abort(id);
        }
    }

    /// Every group's scheduling decision, least busy group first (so that
    /// it admits the head of the queue).
    fn schedule_all(&mut self) -> (Vec<Vec<Scheduled>>, Outcome) {
        let mut order: Vec<usize> = (0..self.groups.len()).collect();
        order.sort_by_key(|&g| self.groups[g].running.len());
        let mut plans = vec![Vec::new(); self.groups.len()];
        let mut total = Outcome::default();
        for g in order {
            let group = &mut self.groups[g];
            let (plan, o) = schedule(
                &mut group.running,
                &mut self.waiting,
                &mut group.blocks,
                &self.limits,
                self.states.as_ref(),
            );
            plans[g] = plan;
            total.preempted += o.preempted;
            total.admitted += o.admitted;
            total.cache_queries += o.cache_queries;
            total.cache_hits += o.cache_hits;
        }
        (plans, total)
    }

    /// One scheduling decision and one forward pass. An error means the
    /// ranks of a parallel run can no longer work together: the engine
    /// must stop.
    pub fn step(&mut self) -> Result<(), EngineError> {
        let (plans, outcome) = self.schedule_all();
        self.place_states();
        let w = &self.shared.waiting;
        w.fetch_sub(outcome.admitted, Ordering::AcqRel);
        w.fetch_add(outcome.preempted, Ordering::AcqRel);
        self.shared.metrics.update(|m| {
            m.preemptions += outcome.preempted as u64;
            m.prefix_cache_queries += outcome.cache_queries as u64;
            m.prefix_cache_hits += outcome.cache_hits as u64;
            m.prompt_tokens += outcome.cache_queries as u64;
        });
        if plans.iter().all(Vec::is_empty) {
            self.publish();
            return Ok(());
        }
        let started = Instant::now();
        let mtp = self.spec.is_some();
        // A sequence with a draft and two tokens of budget verifies it
        // (one process only: the MTP module does not run over ranks).
        let verify: Vec<Vec<Option<[u32; 2]>>> = plans
            .iter()
            .zip(&self.groups)
            .map(|(plan, g)| {
                plan.iter()
                    .map(|p| {
                        let s = &g.running[p.seq];
                        match s.draft {
                            Some(d) if p.n == 2 && s.remaining() == 1 => {
                                Some([s.tokens[s.computed], d])
                            }
                            _ => None,
                        }
                    })
                    .collect()
            })
            .collect();
        let on_cluster = self.cluster.is_some();
        let steps: Vec<Vec<(SeqStep<'_>, Want)>> = plans
            .iter()
            .zip(&verify)
            .zip(&self.groups)
            .map(|((plan, verify), g)| {
                plan.iter()
                    .zip(verify)
                    .map(|(p, v)| {
                        let s = &g.running[p.seq];
                        let end = s.computed + p.n;
                        let last = end == s.tokens.len();
                        if let Some(e) = &s.embed {
                            let reads = e.pooling().reads(s.computed, end, s.prompt_len);
                            let (logits, want) = match reads {
                                true => (Logits::Hidden, Want::Hidden),
                                false => (Logits::None, Want::None),
                            };
                            let step = SeqStep {
                                tokens: &s.tokens[s.computed..end],
                                pos0: s.computed,
                                table: &s.blocks,
                                logits,
                                state: s.state.unwrap_or(0),
                            };
                            return (step, want);
                        }
                        let (tokens, logits) = match v {
                            Some(pair) => (&pair[..], Logits::All),
                            None => (
                                &s.tokens[s.computed..end],
                                match (last, mtp) {
                                    (true, false) => Logits::Last,
                                    (true, true) => Logits::LastAndHidden,
                                    (false, false) => Logits::None,
                                    (false, true) => Logits::Hidden,
                                },
                            ),
                        };
                        // Over ranks, a plain greedy request needs only
                        // its argmax: no logits row crosses the ranks.
                        let argmax_only = on_cluster
                            && s.req.logprobs.is_none()
                            && s.req.constraint.is_none()
                            && s.req.logit_bias.is_empty()
                            && s.req.sampling.is_plain_greedy();
                        let want = match (last, argmax_only) {
                            (false, _) => Want::None,
                            (true, true) => Want::LastArgmax,
                            (true, false) => Want::Last,
                        };
                        let step = SeqStep {
                            tokens,
                            pos0: s.computed,
                            table: &s.blocks,
                            logits,
                            state: s.state.unwrap_or(0),
                        };
                        (step, want)
                    })
                    .collect()
            })
            .collect();
        // Each step's want, logits and tokens, and its rows of this
        // process's hidden states.
        let wants: Vec<Vec<(Want, Logits, usize)>> = steps
            .iter()
            .map(|g| {
                g.iter()
                    .map(|(s, w)| (*w, s.logits, s.tokens.len()))
                    .collect()
            })
            .collect();
        let hidden_rows: Vec<usize> = steps[0]
            .iter()
            .map(|(s, _)| s.logits.hidden_rows(s.tokens.len()))
            .collect();
        // Only steps of nothing but decodes measure the speculation policy.
        let decode_only = plans
            .iter()
            .zip(&self.groups)
            .all(|(plan, g)| plan.iter().all(|p| g.running[p.seq].remaining() == 1));
        let result = match &self.cluster {
            Some(c) => c
                .step(&mut self.pool, &steps)
                .map(|r| (Rows::Groups(r), Vec::new())),
            None => {
                let mine: Vec<SeqStep<'_>> = steps[0].iter().map(|(s, _)| *s).collect();
                self.model
                    .forward_batch_hidden(&mut self.pool, &mine)
                    .map(|(l, h)| (Rows::Local(l), h))
                    .map_err(EngineError::from)
            }
        };
        drop(steps);
        let (mut logits, hidden) = match result {
            Ok(l) => l,
            // Over ranks a failed collective ends the engine: the caller
            // fails every request (`Engine::fail`).
            Err(e) if e.is_communication() => return Err(e),
            Err(e) => {
                // Not reachable with engine-made batches in one process;
                // never leave clients waiting if it happens.
                let msg = e.to_string();
                for (g, plan) in plans.iter().enumerate() {
                    let mut idx: Vec<usize> = plan.iter().map(|p| p.seq).collect();
                    idx.sort_unstable_by(|a, b| b.cmp(a));
                    for i in idx {
                        let group = &mut self.groups[g];
                        let mut s = group.running.remove(i);
                        s.release_blocks(&mut group.blocks);
                        if let (Some(st), Some(slot)) = (&mut self.states, s.state.take()) {
                            st.give_back(slot);
                        }
                        s.fail(&msg);
                    }
                }
                self.publish();
                return Ok(());
            }
        };
        let (vocab, h) = (self.model.config().vocab, self.model.config().hidden);
        let mut produced = 0;
        let mut hrow = 0;
        for (g, (plan, verify)) in plans.iter().zip(&verify).enumerate() {
            let mut done = Vec::new();
            let mut row = 0;
            for (k, ((p, v), &(want, step_logits, n))) in
                plan.iter().zip(verify).zip(&wants[g]).enumerate()
            {
                let group = &mut self.groups[g];
                let s = &mut group.running[p.seq];
                // This process's hidden rows (group 0 only over ranks).
                let hn = match g {
                    0 => hidden_rows.get(k).copied().unwrap_or(0),
                    _ => 0,
                };
                let at = hrow * h;
                hrow += hn;
                let first = row;
                row += logits.taken(want, step_logits, n);
                if let Some(e) = &mut s.embed {
                    if want == Want::Hidden {
                        let rows = logits.hidden(g, first, &hidden, at);
                        let rows = rows.get(..n * h).unwrap_or(rows);
                        e.push(rows, h, s.computed, s.computed + n, s.prompt_len);
                    }
                    s.computed += p.n;
                    s.register_full_blocks(&mut group.blocks);
                    keep_snapshot(
                        s,
                        &mut self.states,
                        &mut self.pool,
                        group.blocks.block_size(),
                    );
                    if s.computed >= s.prompt_len {
                        done.push((p.seq, FinishReason::Stop));
                    }
                    continue;
                }
                let hid = match mtp {
                    true => hidden.get(at..at + hn * h).unwrap_or(&[]),
                    false => &[][..],
                };
                s.draft = None;
                let Some([_, draft]) = *v else {
                    s.computed += p.n;
                    if let Some(m) = &mut s.mtp {
                        m.push_hidden(hid);
                    }
                    s.register_full_blocks(&mut group.blocks);
                    keep_snapshot(
                        s,
                        &mut self.states,
                        &mut self.pool,
                        group.blocks.block_size(),
                    );
                    if row == first {
                        continue;
                    }
                    produced += 1;
                    let r = logits.get(g, first, vocab);
                    if let Some(reason) = advance(s, r, self.tokenizer, &self.shared) {
                        done.push((p.seq, reason));
                    }
                    continue;
                };
                // Verify: the sampled token's row decides; the draft's row
                // counts only if the sample equals the draft.
                s.computed += 1;
                if let Some(m) = &mut s.mtp {
                    m.push_hidden(&hid[..h]);
                }
                produced += 1;
                let mut end = advance(s, logits.get(g, first, vocab), self.tokenizer, &self.shared);
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
                    let r = logits.get(g, first + 1, vocab);
                    end = advance(s, r, self.tokenizer, &self.shared);
                }
                s.register_full_blocks(&mut group.blocks);
                if let Some(reason) = end {
                    done.push((p.seq, reason));
                }
            }
            done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
            for (i, reason) in done {
                let s = self.groups[g].running.remove(i);
                self.finish(g, s, reason);
            }
        }
        self.draft();
        if let Some(spec) = self.spec.as_mut().filter(|_| decode_only && produced > 0) {
            spec.record(started.elapsed().as_secs_f64(), produced);
        }
        self.publish();
        self.steps += 1;
        if let (Some(r), Some(c)) = (self.rebalance, &self.cluster) {
            if self.steps.is_multiple_of(r.every) {
                c.rebalance(r.redundant)?;
                self.shared.metrics.update(|m| m.expert_rebalances += 1);
            }
        }
        Ok(())
    }

    /// One pass of the MTP module for every sequence that has just sampled
    /// and may take two more tokens: each gets a draft for the next pass.
    fn draft(&mut self) {
        let Some(spec) = &self.spec else { return };
        if !spec.wants_draft() {
            return;
        }
        let running = &self.groups[0].running;
        let who: Vec<usize> = (0..running.len())
            .filter(|&i| {
                let s = &running[i];
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
            let s = &self.groups[0].running[i];
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
            let s = &mut self.groups[0].running[i];
            if let Some(m) = &mut s.mtp {
                m.consumed(h);
            }
            s.draft = crate::sampling::argmax(row);
        }
    }

    /// Releases a sequence's blocks (in group `g`; a waiting one has
    /// none) and sends its last event.
    fn finish(&mut self, g: usize, mut s: Sequence<'t>, mut reason: FinishReason) {
        // Before the blocks go: releasing them restarts the pooling.
        let embedding = match (&s.embed, reason) {
            (Some(e), FinishReason::Stop) => Some(e.finish()),
            _ => None,
        };
        s.release_blocks(&mut self.groups[g].blocks);
        s.in_flight = None;
        if let (Some(st), Some(slot)) = (&mut self.states, s.state.take()) {
            st.give_back(slot);
        }
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
            if let Some(v) = embedding {
                if !(s.sink)(Event::Embedding(v)) {
                    return;
                }
            }
            (s.sink)(Event::Finished {
                reason,
                text,
                usage,
            });
        }
    }

    /// Linear-attention state slots after scheduling: preempted sequences
    /// (back in the queue) give theirs back, newly admitted ones take one,
    /// starting from the snapshot their cached prefix reaches, if any.
    fn place_states(&mut self) {
        let Some(st) = &mut self.states else { return };
        for s in self.waiting.iter_mut() {
            if let Some(slot) = s.state.take() {
                st.give_back(slot);
            }
        }
        for s in self.groups.iter_mut().flat_map(|g| g.running.iter_mut()) {
            if s.state.is_some() {
                continue;
            }
            s.state = st.take();
            let (Some(slot), Some(cid)) = (s.state, s.restore.take()) else {
                continue;
            };
            // The scheduler saw the snapshot; nothing evicts one before
            // the forward pass, but recompute from the start rather than
            // from a wrong state if it were gone.
            let restored = st
                .snapshot(cid)
                .is_some_and(|snap| self.pool.copy_state(snap, slot).is_ok());
            if !restored {
                // Recomputing from the start rewrites the shared blocks
                // with the bits they hold (a sequence's keys do not depend
                // on its batch): never someone else's data.
                s.restart_at(0);
            }
        }
    }

    fn publish(&self) {
        let running = self.groups.iter().map(|g| g.running.len()).sum();
        let used = self
            .groups
            .iter()
            .map(|g| g.blocks.total() - g.blocks.free())
            .sum();
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
    row: Option<RowRef<'_>>,
    tokenizer: &Tokenizer,
    shared: &Shared,
) -> Option<FinishReason> {
    let (raw, sampled) = match row {
        Some(RowRef::Logits(logits)) => {
            let raw = s.req.logprobs.map(|_| logits.to_vec());
            for &(id, bias) in &s.req.logit_bias {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l += bias;
                }
            }
            if let Some(c) = &mut s.req.constraint {
                if let Err(e) = c.mask(logits) {
                    s.fail(&e.to_string());
                    return Some(FinishReason::Abort);
                }
            }
            let history = &s.tokens[s.prompt_len..];
            (raw, s.sampler.sample(logits, history))
        }
        // Plain greedy over ranks: the argmax is the sample.
        Some(RowRef::Argmax(t)) => (None, t.ok_or(SamplingError::NoFiniteLogit)),
        None => (None, Err(SamplingError::NoFiniteLogit)),
    };
    let next = match sampled {
        Ok(t) => t,
        Err(e) => {
            s.fail(&e.to_string());
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
    // A constrained output ends where its grammar allows nothing but
    // end-of-sequence, `ignore_eos` or not.
    let constrained = s.req.constraint.is_some();
    let eos = (!s.req.ignore_eos || constrained) && tokenizer.eos_ids().contains(&next);
    let mut complete = false;
    if let (Some(c), false) = (&mut s.req.constraint, eos) {
        match c.commit(next) {
            Ok(done) => complete = done,
            Err(e) => {
                s.fail(&e.to_string());
                return Some(FinishReason::Abort);
            }
        }
    }
    let (mut text, mut stop_hit) = if eos {
        (String::new(), false)
    } else {
        match s.stream.step(next) {
            Ok(Some(piece)) => s.stops.push(&piece),
            Ok(None) => (String::new(), false),
            Err(e) => {
                s.fail(&e.to_string());
                return Some(FinishReason::Abort);
            }
        }
    };
    if complete && !stop_hit {
        // The grammar admits nothing more: this is the last token, and
        // what the detokenizer and the stop strings hold back goes with it.
        let (tail, hit) = s.stops.finish_with(&s.stream.flush());
        text.push_str(&tail);
        stop_hit = hit;
    }
    if !(s.sink)(Event::Token {
        id: next,
        text,
        logprob,
    }) {
        s.closed = true;
        return Some(FinishReason::Abort);
    }
    if eos || stop_hit || complete {
        Some(FinishReason::Stop)
    } else if s.generated() >= s.req.max_tokens {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// After a step: if `s` now ends at a block boundary whose block is in the
/// prefix cache, keeps a snapshot of its state there (models with
/// linear-attention layers).
fn keep_snapshot(s: &Sequence<'_>, states: &mut Option<StateSlots>, pool: &mut KvPool, bs: usize) {
    let (Some(st), Some(slot)) = (states.as_mut(), s.state) else {
        return;
    };
    if s.computed == 0 || !s.computed.is_multiple_of(bs) {
        return;
    }
    let Some(&cid) = s.cids.get(s.computed / bs - 1) else {
        return;
    };
    if let Some(snap) = st.keep(cid) {
        // Slots the engine made itself: a failure is a bug, and only costs
        // a later prompt its reuse.
        let _ = pool.copy_state(slot, snap);
    }
}
