//! The engine's step, in its phases: plan (schedule), forward (one pass
//! over the ragged batch), sample (each sequence that produced logits
//! takes its token through its [`Continuation`] and reports it), draft.
//! With an MTP module, the step ends with one batched
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
use super::request::{Event, EventSink, RequestId, Usage};
use super::scheduler::{schedule, Limits, Outcome, Scheduled};
use super::sequence::Sequence;
use super::shared::{InFlight, Shared};
use super::states::StateSlots;
use crate::cluster::{Cluster, Row, Want};
use crate::continuation::{Continuation, FinishReason, RowRef};
use crate::error::EngineError;
use crate::request::EngineRequest;
use crate::speculative::{MtpState, Speculation};
use kvant_model::arch::decoder::{DecoderModel, Logits, MtpStep, SeqStep};
use kvant_model::kv::KvPool;
use kvant_model::kv::StateCopy;
use kvant_model::tokenizer::Tokenizer;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// One data-parallel group's share of the engine.
struct Group<'t> {
    blocks: BlockManager,
    running: Vec<Sequence<'t>>,
    /// State slots of the group's pools, for a model that keeps a state
    /// per sequence (linear-attention layers, DeepSeek-V4's windows).
    states: Option<StateSlots>,
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
}

/// A step's logits: one process's `[rows, vocab]`, or what each group's
/// ranks sent rank 0.
enum Rows {
    Local(Vec<f32>),
    Groups(Vec<Vec<Row>>),
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
                // Every group's pools have the slots rank 0's has.
                states: (pool.state_slots() > 0).then(|| {
                    let running = cfg.max_running.min(pool.state_slots());
                    StateSlots::new(running, pool.state_slots() - running)
                }),
            })
            .collect();
        let model_has_mtp = model.has_mtp();
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
        mut req: EngineRequest,
        embed: Option<Pooling>,
        mut sink: EventSink,
    ) {
        let prompt_ids = std::mem::take(&mut req.prompt_ids);
        let cont = match Continuation::new(self.tokenizer, req) {
            Ok(c) => c,
            Err(e) => {
                self.shared.waiting.fetch_sub(1, Ordering::AcqRel);
                self.shared.release_place();
                sink(Event::Failed(e.to_string()));
                return;
            }
        };
        self.waiting.push_back(Sequence {
            id,
            prompt_len: prompt_ids.len(),
            tokens: prompt_ids,
            computed: 0,
            blocks: Vec::new(),
            cids: Vec::new(),
            cached_tokens: None,
            cont,
            sink,
            closed: false,
            arrived: Instant::now(),
            last_token: None,
            mtp: (self.spec.is_some() && embed.is_none()).then(MtpState::default),
            draft: None,
            state: None,
            state_group: 0,
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
                group.states.as_ref(),
            );
            plans[g] = plan;
            total.preempted += o.preempted;
            total.admitted += o.admitted;
            total.cache_queries += o.cache_queries;
            total.cache_hits += o.cache_hits;
        }
        (plans, total)
    }

    /// One scheduling decision and one forward pass: plan, forward, sample,
    /// draft. An error means the ranks of a parallel run can no longer
    /// work together: the engine must stop.
    pub fn step(&mut self) -> Result<(), EngineError> {
        let Some(plan) = self.plan() else {
            self.publish();
            return Ok(());
        };
        let started = Instant::now();
        let Some(mut pass) = self.forward(&plan)? else {
            return Ok(());
        };
        let produced = self.sample(&plan, &mut pass);
        self.draft();
        if let Some(spec) = self
            .spec
            .as_mut()
            .filter(|_| plan.decode_only && produced > 0)
        {
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

    /// The step's plan: every group's scheduled sequences, and which of
    /// them verify a draft; `None` when nothing runs.
    fn plan(&mut self) -> Option<Plan> {
        let (groups, outcome) = self.schedule_all();
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
        if groups.iter().all(Vec::is_empty) {
            return None;
        }
        // A sequence with a draft and two tokens of budget verifies it
        // (one process only: the MTP module does not run over ranks).
        let verify = groups
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
        // Only steps of nothing but decodes measure the speculation policy.
        let decode_only = groups
            .iter()
            .zip(&self.groups)
            .all(|(plan, g)| plan.iter().all(|p| g.running[p.seq].remaining() == 1));
        Some(Plan {
            groups,
            verify,
            decode_only,
        })
    }

    /// The forward pass of every group's planned steps. `None` when it
    /// failed in this process (every planned sequence then failed too);
    /// an error when the ranks lost one another.
    fn forward(&mut self, plan: &Plan) -> Result<Option<Pass>, EngineError> {
        let (mtp, on_cluster) = (self.spec.is_some(), self.cluster.is_some());
        let steps: Vec<Vec<(SeqStep<'_>, Want)>> = plan
            .groups
            .iter()
            .zip(&plan.verify)
            .zip(&self.groups)
            .map(|((plan, verify), g)| {
                plan.iter()
                    .zip(verify)
                    .map(|(p, v)| seq_step(&g.running[p.seq], p.n, v.as_ref(), mtp, on_cluster))
                    .collect()
            })
            .collect();
        let wants = steps
            .iter()
            .map(|g| {
                g.iter()
                    .map(|(s, w)| (*w, s.logits, s.tokens.len()))
                    .collect()
            })
            .collect();
        let hidden_rows = steps[0]
            .iter()
            .map(|(s, _)| s.logits.hidden_rows(s.tokens.len()))
            .collect();
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
        match result {
            Ok((rows, hidden)) => Ok(Some(Pass {
                rows,
                hidden,
                wants,
                hidden_rows,
            })),
            // Over ranks a failed collective ends the engine: the caller
            // fails every request (`Engine::fail`).
            Err(e) if e.is_communication() => Err(e),
            Err(e) => {
                // Not reachable with engine-made batches in one process;
                // never leave clients waiting if it happens.
                self.fail_planned(plan, &e.to_string());
                Ok(None)
            }
        }
    }

    /// Fails every sequence of `plan` with `msg`.
    fn fail_planned(&mut self, plan: &Plan, msg: &str) {
        for (g, plan) in plan.groups.iter().enumerate() {
            let mut idx: Vec<usize> = plan.iter().map(|p| p.seq).collect();
            idx.sort_unstable_by(|a, b| b.cmp(a));
            for i in idx {
                let group = &mut self.groups[g];
                let mut s = group.running.remove(i);
                s.release_blocks(&mut group.blocks);
                if let (Some(st), Some(slot)) = (&mut group.states, s.state.take()) {
                    st.give_back(slot);
                }
                s.fail(msg);
            }
        }
        self.publish();
    }

    /// After the pass: every planned sequence moves past the tokens it ran
    /// and, where it has a logits row, samples and reports; those that end
    /// are finished. Returns the tokens produced.
    fn sample(&mut self, plan: &Plan, pass: &mut Pass) -> usize {
        let (vocab, h) = (self.model.config().vocab, self.model.hidden_width());
        let mtp = self.spec.is_some();
        let mut produced = 0;
        let mut hrow = 0;
        for (g, (seqs, verify)) in plan.groups.iter().zip(&plan.verify).enumerate() {
            let mut done = Vec::new();
            let mut row = 0;
            for (k, ((p, v), &(want, logits, n))) in
                seqs.iter().zip(verify).zip(&pass.wants[g]).enumerate()
            {
                // This process's hidden rows (group 0 only over ranks).
                let hn = match g {
                    0 => pass.hidden_rows.get(k).copied().unwrap_or(0),
                    _ => 0,
                };
                let at = hrow * h;
                hrow += hn;
                let first = row;
                row += pass.rows.taken(want, logits, n);
                let group = &mut self.groups[g];
                let mut share = Share {
                    rows: &mut pass.rows,
                    g,
                    first,
                    any: row > first,
                    want,
                    n,
                    hidden: &pass.hidden,
                    at,
                    mine: match mtp {
                        true => pass.hidden.get(at..at + hn * h).unwrap_or(&[]),
                        false => &[][..],
                    },
                    vocab,
                    h,
                    blocks: &mut group.blocks,
                    states: &mut group.states,
                    pool: &mut self.pool,
                    cluster: self.cluster.as_deref(),
                    shared: &self.shared,
                };
                let s = &mut group.running[p.seq];
                let (made, end) = match (s.embed.is_some(), v) {
                    (true, _) => (0, pooled(s, p.n, &mut share)),
                    (false, Some([_, draft])) => verified(s, *draft, &mut share),
                    (false, None) => decoded(s, p.n, &mut share),
                };
                produced += made;
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
        produced
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
                    && s.cont.left() > 1
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
                inputs.push(m.step(before, last, (&s.blocks, s.state.unwrap_or(0))));
            }
        }
        let steps: Vec<MtpStep<'_>> = inputs.iter().map(|(t, i)| i.with(t)).collect();
        let result = self.model.mtp_forward(&mut self.pool, &steps);
        drop(steps);
        drop(inputs);
        // Drafts only ever cost speed: a failed pass (not reachable with
        // engine-made steps) just drafts nothing.
        let Ok(logits) = result else { return };
        let (vocab, h) = (self.model.config().vocab, self.model.hidden_width());
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
    fn finish(&mut self, g: usize, mut s: Sequence<'t>, reason: FinishReason) {
        // Before the blocks go: releasing them restarts the pooling.
        let embedding = match (&s.embed, reason) {
            (Some(e), FinishReason::Stop) => Some(e.finish()),
            _ => None,
        };
        s.release_blocks(&mut self.groups[g].blocks);
        s.in_flight = None;
        let states = &mut self
            .groups
            .get_mut(s.state_group)
            .and_then(|g| g.states.as_mut());
        if let (Some(st), Some(slot)) = (states, s.state.take()) {
            st.give_back(slot);
        }
        // A stop string the flushed tail completes ends the request as a
        // stop, as it does in `Session`.
        let (text, reason) = s.cont.finish(reason);
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

    /// State slots after scheduling (models that keep a state per
    /// sequence): preempted sequences (back in the queue) give theirs back
    /// to their group, newly admitted ones take one of their group's,
    /// starting from the snapshot their cached prefix reaches, if any (a
    /// copy every rank of the group makes).
    fn place_states(&mut self) {
        for s in self.waiting.iter_mut() {
            let group = self.groups.get_mut(s.state_group);
            if let (Some(st), Some(slot)) = (group.and_then(|g| g.states.as_mut()), s.state.take())
            {
                st.give_back(slot);
            }
        }
        let cluster = self.cluster.as_deref();
        for (g, group) in self.groups.iter_mut().enumerate() {
            let Some(st) = &mut group.states else {
                continue;
            };
            for s in group.running.iter_mut().filter(|s| s.state.is_none()) {
                s.state = st.take();
                s.state_group = g;
                let (Some(slot), Some(cid)) = (s.state, s.restore.take()) else {
                    continue;
                };
                // The scheduler saw the snapshot; nothing evicts one before
                // the forward pass, but recompute from the start rather than
                // from a wrong state if it were gone.
                let restored = st.snapshot(cid).is_some_and(|snap| {
                    let copy = StateCopy {
                        from: snap,
                        to: slot,
                    };
                    copy_state(&mut self.pool, cluster, g, copy).is_ok()
                });
                if !restored {
                    // Recomputing from the start rewrites the shared blocks
                    // with the bits they hold (a sequence's keys do not depend
                    // on its batch): never someone else's data.
                    s.restart_at(0);
                }
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

/// What a step runs: each group's scheduled sequences and, for each, the
/// sampled token and draft it verifies, if it does.
struct Plan {
    groups: Vec<Vec<Scheduled>>,
    verify: Vec<Vec<Option<[u32; 2]>>>,
    /// Every planned sequence decodes (such steps measure the speculation
    /// policy).
    decode_only: bool,
}

/// What a step's forward pass gave back.
struct Pass {
    rows: Rows,
    /// This process's hidden states (`[rows, hidden]`).
    hidden: Vec<f32>,
    /// Each group's steps: what rank 0 wanted, the logits the model
    /// computed, and the tokens run.
    wants: Vec<Vec<(Want, Logits, usize)>>,
    /// Group 0's steps' rows in `hidden`.
    hidden_rows: Vec<usize>,
}

/// Sequence `s`'s part of the pass: its next `n` tokens (with `verify`,
/// its sampled token and draft instead), and what rank 0 wants back.
fn seq_step<'a>(
    s: &'a Sequence<'_>,
    n: usize,
    verify: Option<&'a [u32; 2]>,
    mtp: bool,
    on_cluster: bool,
) -> (SeqStep<'a>, Want) {
    let end = s.computed + n;
    let last = end == s.tokens.len();
    let (tokens, logits, want) = if let Some(e) = &s.embed {
        let (logits, want) = match e.pooling().reads(s.computed, end, s.prompt_len) {
            true => (Logits::Hidden, Want::Hidden),
            false => (Logits::None, Want::None),
        };
        (&s.tokens[s.computed..end], logits, want)
    } else {
        let (tokens, logits) = match verify {
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
        // Over ranks, a plain greedy request needs only its argmax: no
        // logits row crosses the ranks.
        let argmax_only = on_cluster && s.cont.argmax_suffices();
        let want = match (last, argmax_only) {
            (false, _) => Want::None,
            (true, true) => Want::LastArgmax,
            (true, false) => Want::Last,
        };
        (tokens, logits, want)
    };
    let step = SeqStep {
        tokens,
        pos0: s.computed,
        table: &s.blocks,
        logits,
        state: s.state.unwrap_or(0),
    };
    (step, want)
}

/// A sequence's share of a step's outputs, and the engine state its
/// bookkeeping updates.
struct Share<'a> {
    rows: &'a mut Rows,
    /// Its group, and its first entry in the group's rows.
    g: usize,
    first: usize,
    /// Whether it has any entry (a chunk of prompt before the last has
    /// none).
    any: bool,
    /// What rank 0 wanted of it, and the tokens it ran.
    want: Want,
    n: usize,
    /// This process's hidden states, and where the sequence's start.
    hidden: &'a [f32],
    at: usize,
    /// Its hidden states for the MTP module (empty without one).
    mine: &'a [f32],
    vocab: usize,
    h: usize,
    blocks: &'a mut BlockManager,
    states: &'a mut Option<StateSlots>,
    cluster: Option<&'a Cluster>,
    pool: &'a mut KvPool,
    shared: &'a Shared,
}

impl Share<'_> {
    /// The sequence's `i`th logits row.
    fn row(&mut self, i: usize) -> RowRef<'_> {
        self.rows
            .get(self.g, self.first + i, self.vocab)
            .unwrap_or(RowRef::Argmax(None))
    }

    /// Offers `s`'s newly full blocks to the prefix cache and, at a block
    /// boundary, keeps a snapshot of its state.
    fn settle(&mut self, s: &mut Sequence<'_>) {
        s.register_full_blocks(self.blocks);
        let bs = self.blocks.block_size();
        keep_snapshot(s, (self.states, self.g), (self.pool, self.cluster), bs);
    }
}

/// An embedding request after the pass that ran `ran` of its tokens:
/// pools the hidden states it read; ends when its prompt has run.
fn pooled(s: &mut Sequence<'_>, ran: usize, sh: &mut Share<'_>) -> Option<FinishReason> {
    if let Some(e) = &mut s.embed {
        if sh.want == Want::Hidden {
            let rows = sh.rows.hidden(sh.g, sh.first, sh.hidden, sh.at);
            let rows = rows.get(..sh.n * sh.h).unwrap_or(rows);
            e.push(rows, sh.h, s.computed, s.computed + sh.n, s.prompt_len);
        }
    }
    s.computed += ran;
    sh.settle(s);
    (s.computed >= s.prompt_len).then_some(FinishReason::Stop)
}

/// A sequence that ran `ran` tokens without a draft: moves past them and,
/// with a logits row (its last chunk of prompt, or a decode), samples.
/// Returns the tokens produced and why it ends, if it does.
fn decoded(s: &mut Sequence<'_>, ran: usize, sh: &mut Share<'_>) -> (usize, Option<FinishReason>) {
    s.draft = None;
    s.computed += ran;
    if let Some(m) = &mut s.mtp {
        m.push_hidden(sh.mine);
    }
    sh.settle(s);
    if !sh.any {
        return (0, None);
    }
    let shared = sh.shared;
    (1, advance(s, sh.row(0), shared))
}

/// A sequence that ran its sampled token and `draft`: the sampled token's
/// row decides; the draft's row counts only if the sample equals the
/// draft. Returns the tokens produced and why it ends, if it does.
fn verified(s: &mut Sequence<'_>, draft: u32, sh: &mut Share<'_>) -> (usize, Option<FinishReason>) {
    s.draft = None;
    let shared = sh.shared;
    s.computed += 1;
    if let Some(m) = &mut s.mtp {
        m.push_hidden(&sh.mine[..sh.h]);
    }
    let mut end = advance(s, sh.row(0), shared);
    let hit = s.tokens.last() == Some(&draft);
    shared.metrics.update(|m| {
        m.spec_drafted += 1;
        m.spec_accepted += u64::from(hit);
    });
    let mut produced = 1;
    if end.is_none() && hit {
        s.computed += 1;
        if let Some(m) = &mut s.mtp {
            m.push_hidden(&sh.mine[sh.h..]);
        }
        produced += 1;
        end = advance(s, sh.row(1), shared);
    }
    s.register_full_blocks(sh.blocks);
    (produced, end)
}

/// Samples `s`'s next token from `row` and reports it; returns why the
/// sequence ends, if it does.
fn advance(s: &mut Sequence<'_>, row: RowRef<'_>, shared: &Shared) -> Option<FinishReason> {
    let sampled = match s.cont.sample(row, &s.tokens[s.prompt_len..]) {
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
    s.tokens.push(sampled.token);
    let taken = match s.cont.take(sampled) {
        Ok(t) => t,
        Err(e) => {
            s.fail(&e.to_string());
            return Some(FinishReason::Abort);
        }
    };
    if !(s.sink)(Event::Token {
        id: taken.token,
        text: taken.text,
        logprob: taken.logprob,
    }) {
        s.closed = true;
        return Some(FinishReason::Abort);
    }
    taken.end
}

/// After a step: if `s` now ends at a block boundary whose block is in the
/// prefix cache, keeps a snapshot of its state there (models with
/// linear-attention layers).
fn keep_snapshot(
    s: &Sequence<'_>,
    (states, g): (&mut Option<StateSlots>, usize),
    (pool, cluster): (&mut KvPool, Option<&Cluster>),
    bs: usize,
) {
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
        // a later prompt its reuse (a lost rank fails the next step).
        let copy = StateCopy {
            from: slot,
            to: snap,
        };
        let _ = copy_state(pool, cluster, g, copy);
    }
}

/// Copies a state slot to another in data-parallel group `g`'s pools:
/// rank 0's own (group 0's) and, over ranks, the group's others.
fn copy_state(
    pool: &mut KvPool,
    cluster: Option<&Cluster>,
    g: usize,
    copy: StateCopy,
) -> Result<(), EngineError> {
    if g == 0 {
        pool.copy_state(copy.from, copy.to)?;
    }
    if let Some(c) = cluster {
        c.copy_state(g, copy)?;
    }
    Ok(())
}
