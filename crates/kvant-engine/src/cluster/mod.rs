//! One model over several ranks (processes under MPI, or threads): rank 0
//! runs the scheduler (or the single-stream loop) and, each step,
//! broadcasts the plan ([`wire::Msg`]); every rank runs its share of the
//! forward pass, the data-parallel group of each sequence computing it;
//! the ranks holding the output head's vocabulary slices send rank 0
//! what it samples from: whole logits rows, or, for a greedy request, one
//! (value, id) pair per slice, so no logits row crosses the ranks.
//!
//! A rank that does not answer within the communicator's timeout (it
//! hangs, or died without the launcher noticing) fails the step on the
//! others, which then end the job with that error. Rank 0 sends a
//! heartbeat, joined by every rank, while it is idle, so that idle ranks
//! also notice a lost peer.

pub(crate) mod wire;

pub use wire::{encode_step, Msg, SeqPlan, Want, WireError};

use crate::error::EngineError;
use kvant_dist::layout::split_even;
use kvant_dist::{Buffer, Collective, CommExt, Layout};
use kvant_model::arch::decoder::{DecoderModel, SeqStep};
use kvant_model::kv::{KvCache, KvPool, StateCopy, STATE_SLOTS};
use kvant_model::Parallel;
use std::sync::Arc;

/// Rows every data-parallel group needs in a step for it to run as two
/// micro-batches (with `--two-batch-overlap`).
const MIN_OVERLAP_ROWS: usize = 2;

/// One logits row as rank 0 gets it back.
#[derive(Clone, Debug, PartialEq)]
pub enum Row {
    /// The whole row.
    Logits(Vec<f32>),
    /// Only its argmax ([`Want::LastArgmax`]); `None` when no logit is finite.
    Argmax(Option<u32>),
    /// A [`Want::Hidden`] sequence's hidden states, `[tokens, hidden]`:
    /// one entry for the whole sequence.
    Hidden(Vec<f32>),
}

/// Rank 0's side of a parallel run.
pub struct Cluster {
    model: Arc<DecoderModel>,
    par: Arc<Parallel>,
}

impl Cluster {
    /// Rank 0's handle over `model`, loaded with a [`Parallel`] of rank 0.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a model loaded without one, or on
    /// another rank.
    pub fn new(model: Arc<DecoderModel>) -> Result<Cluster, EngineError> {
        match model.parallel().cloned() {
            Some(par) if par.rank() == 0 => Ok(Cluster { model, par }),
            Some(_) => Err(EngineError::Config(
                "only rank 0 drives a parallel run".into(),
            )),
            None => Err(EngineError::Config(
                "the model was loaded without ranks".into(),
            )),
        }
    }

    pub fn model(&self) -> &Arc<DecoderModel> {
        &self.model
    }

    pub fn layout(&self) -> Layout {
        self.par.layout
    }

    /// How long a collective may wait for a rank before it counts as lost.
    pub fn timeout(&self) -> std::time::Duration {
        kvant_dist::Comm::timeout(&*self.par.world)
    }

    fn send(&self, msg: &Msg) -> Result<(), EngineError> {
        let words = msg.encode()?;
        self.par.world.broadcast_words(Some(words), 0)?;
        Ok(())
    }

    /// A KV pool of `n_blocks` blocks of `block_size` tokens and `slots`
    /// state slots on every rank (each sized for its shard); rank 0's is
    /// returned.
    ///
    /// # Errors
    /// A communication or model error.
    pub fn pool(
        &self,
        block_size: usize,
        n_blocks: usize,
        slots: usize,
    ) -> Result<KvPool, EngineError> {
        self.send(&Msg::Pool {
            block_size,
            n_blocks,
            slots,
        })?;
        Ok(self.model.new_pool(block_size, n_blocks, slots)?)
    }

    /// Makes in data-parallel group `group`'s pools on the other ranks the
    /// state copy rank 0 made in its own (group 0's), or would make in
    /// that group's.
    ///
    /// # Errors
    /// A communication error.
    pub fn copy_state(&self, group: usize, copy: StateCopy) -> Result<(), EngineError> {
        self.send(&Msg::CopyState {
            group,
            from: copy.from,
            to: copy.to,
        })
    }

    /// A one-sequence cache of `capacity` tokens on every rank.
    ///
    /// # Errors
    /// As [`Cluster::pool`].
    pub fn cache(&self, capacity: usize) -> Result<KvCache, EngineError> {
        let capacity = capacity.min(self.model.config().max_context).max(1);
        let cache = self.model.new_cache(capacity)?;
        self.send(&Msg::Pool {
            block_size: capacity,
            n_blocks: 1,
            slots: if cache.has_state() { STATE_SLOTS } else { 0 },
        })?;
        Ok(cache)
    }

    /// One forward pass: `groups[d]` are data-parallel group `d`'s
    /// sequences (group 0's run on `pool`, rank 0's; the others' on their
    /// ranks' pools). Returns each group's rows in order: its logits
    /// rows, and one [`Row::Hidden`] per [`Want::Hidden`] sequence.
    ///
    /// # Errors
    /// A communication error (a lost rank), or the model's.
    pub fn step(
        &self,
        pool: &mut KvPool,
        groups: &[Vec<(SeqStep<'_>, Want)>],
    ) -> Result<Vec<Vec<Row>>, EngineError> {
        let layout = self.layout();
        if groups.len() != layout.dp {
            return Err(EngineError::Config(format!(
                "a step for {} data-parallel groups on {}",
                groups.len(),
                layout.dp
            )));
        }
        // Two micro-batches only where every group has rows for both: a
        // micro-batch without rows would double the step's collectives
        // and hide nothing (a batch of one decoded token).
        let rows =
            |g: &Vec<(SeqStep<'_>, Want)>| g.iter().map(|(s, _)| s.tokens.len()).sum::<usize>();
        let overlap =
            self.par.two_batch_overlap && groups.iter().all(|g| rows(g) >= MIN_OVERLAP_ROWS);
        self.par
            .world
            .broadcast_words(Some(encode_step(overlap, groups)?), 0)?;
        let mine: Vec<SeqStep<'_>> = groups[0].iter().map(|(s, _)| *s).collect();
        let wants: Vec<Vec<(Want, usize)>> = groups
            .iter()
            .map(|g| g.iter().map(|(s, w)| (*w, s.tokens.len())).collect())
            .collect();
        let (logits, hidden) = self.model.forward_step(pool, &mine, Some(overlap))?;
        exchange_rows(&self.model, &wants, &logits, &hidden)?
            .ok_or_else(|| EngineError::Config("rank 0 received no logits".into()))
    }

    /// Proves every rank alive while rank 0 is idle (a broadcast, then a
    /// barrier: a hung rank fails it within the timeout).
    ///
    /// # Errors
    /// A communication error.
    pub fn heartbeat(&self) -> Result<(), EngineError> {
        self.send(&Msg::Heartbeat)?;
        self.par.world.barrier()?;
        Ok(())
    }

    /// Re-places every MoE layer's experts on every rank from the loads
    /// seen since the last re-placement, with `redundant` extra replicas
    /// per layer (EPLB). Outputs do not change.
    ///
    /// # Errors
    /// A communication or model error.
    pub fn rebalance(&self, redundant: usize) -> Result<(), EngineError> {
        self.send(&Msg::Rebalance { redundant })?;
        Ok(self.model.rebalance_experts(redundant)?)
    }

    /// Tells the other ranks to stop.
    ///
    /// # Errors
    /// A communication error.
    pub fn shutdown(&self) -> Result<(), EngineError> {
        self.send(&Msg::Shutdown)
    }

    /// Ends every rank after an unrecoverable error (MPI aborts the job).
    pub fn abort(&self) {
        self.par.world.abort(1);
    }
}

/// The loop of every rank but 0: run what rank 0 broadcasts until it says
/// stop. Returns an error (after which the caller should abort the job)
/// when a collective fails.
///
/// # Errors
/// A communication error (a lost or hung rank), a malformed message, or
/// the model's.
pub fn run_worker(model: &DecoderModel) -> Result<(), EngineError> {
    let Some(par) = model.parallel() else {
        return Err(EngineError::Config(
            "the model was loaded without ranks".into(),
        ));
    };
    let dp = par.coords.dp;
    let mut pool: Option<KvPool> = None;
    loop {
        let words = par.world.broadcast_words(None, 0)?;
        match Msg::decode(&words)? {
            Msg::Shutdown => return Ok(()),
            Msg::Heartbeat => par.world.barrier()?,
            Msg::Pool {
                block_size,
                n_blocks,
                slots,
            } => {
                // The old pool goes before the new one is allocated.
                drop(pool.take());
                pool = Some(model.new_pool(block_size, n_blocks, slots)?);
            }
            Msg::CopyState { group, from, to } if group == dp => pool
                .as_mut()
                .ok_or_else(|| EngineError::Config("a state copy before any KV pool".into()))?
                .copy_state(from, to)?,
            Msg::CopyState { .. } => {}
            Msg::Rebalance { redundant } => model.rebalance_experts(redundant)?,
            Msg::Step { overlap, groups } => {
                let pool = pool
                    .as_mut()
                    .ok_or_else(|| EngineError::Config("a step before any KV pool".into()))?;
                let wants: Vec<Vec<(Want, usize)>> = groups
                    .iter()
                    .map(|g| g.iter().map(|s| (s.want, s.tokens.len())).collect())
                    .collect();
                let mine: Vec<SeqStep<'_>> = groups
                    .get(dp)
                    .map(|g| g.iter().map(SeqPlan::step).collect())
                    .unwrap_or_default();
                let (logits, hidden) = model.forward_step(pool, &mine, Some(overlap))?;
                exchange_rows(model, &wants, &logits, &hidden)?;
            }
        }
    }
}

/// Sends rank 0 this rank's share of the step's logits rows, and on rank 0
/// assembles every group's: the tensor-parallel ranks of a group hold
/// vocabulary slices in order; replicas stay silent. Hidden states are
/// whole on every rank of a group: its first rank sends them. `local` is
/// this rank's `[rows, slice]` from the forward pass, `hidden` its hidden
/// states.
fn exchange_rows(
    model: &DecoderModel,
    wants: &[Vec<(Want, usize)>],
    local: &[f32],
    hidden: &[f32],
) -> Result<Option<Vec<Vec<Row>>>, EngineError> {
    let Some(par) = model.parallel() else {
        return Err(EngineError::Config(
            "the model was loaded without ranks".into(),
        ));
    };
    let layout = par.layout;
    let vocab = model.config().vocab;
    let h = model.config().hidden;
    let slice = |rank: usize| split_even(vocab, layout.tp, layout.coords(rank).tp);
    let reports_hidden = |q: usize| layout.group_leader(layout.coords(q).dp) == q;
    // Words rank `q` sends: per row, its slice or one (value, id) pair;
    // per hidden sequence, its rows (the group's first rank).
    let words_of = |q: usize| -> usize {
        if !layout.reports_logits(q) {
            return 0;
        }
        let d = layout.coords(q).dp;
        wants[d]
            .iter()
            .map(|&(w, n)| match w {
                Want::LastArgmax => 2,
                Want::Hidden if reports_hidden(q) => n * h,
                w => w.rows(n) * slice(q).len(),
            })
            .sum()
    };
    let rank = par.rank();
    let mut send = Vec::with_capacity(words_of(rank));
    if layout.reports_logits(rank) {
        let width = slice(rank).len();
        let base = slice(rank).start as u32;
        let mut rows = local.chunks_exact(width.max(1));
        let mut hidden_at = 0;
        for &(w, n) in &wants[par.coords.dp] {
            let at = hidden_at * h;
            hidden_at += w.logits().hidden_rows(n);
            if w == Want::Hidden && reports_hidden(rank) {
                let part = hidden.get(at..at + n * h).ok_or_else(|| {
                    EngineError::Config("the forward pass returned too few hidden rows".into())
                })?;
                send.extend(part.iter().map(|v| v.to_bits()));
            }
            for _ in 0..w.rows(n) {
                let row = rows.next().ok_or_else(|| {
                    EngineError::Config("the forward pass returned too few rows".into())
                })?;
                match w {
                    Want::LastArgmax => match crate::sampling::argmax(row) {
                        Some(i) => send.extend([row[i as usize].to_bits(), base + i]),
                        None => send.extend([f32::NAN.to_bits(), u32::MAX]),
                    },
                    _ => send.extend(row.iter().map(|v| v.to_bits())),
                }
            }
        }
    }
    let w = layout.world;
    let mut send_counts = vec![0; w];
    send_counts[0] = send.len();
    let recv_counts: Vec<usize> = (0..w)
        .map(|q| if rank == 0 { words_of(q) } else { 0 })
        .collect();
    let got = par
        .world
        .run(Collective::AllToAllV {
            send: Buffer::U32(send),
            send_counts,
            recv_counts: recv_counts.clone(),
        })?
        .into_u32()?;
    if rank != 0 {
        return Ok(None);
    }
    // Each rank's words, then each group's rows from its slices.
    let mut from = Vec::with_capacity(w);
    let mut at = 0;
    for &c in &recv_counts {
        from.push(&got[at..at + c]);
        at += c;
    }
    let mut out = Vec::with_capacity(layout.dp);
    for (d, seqs) in wants.iter().enumerate() {
        let reporters: Vec<usize> = (0..layout.tp).map(|t| layout.group_leader(d) + t).collect();
        let mut cursor = vec![0usize; reporters.len()];
        let mut rows = Vec::new();
        for &(want, n) in seqs {
            if want == Want::Hidden {
                let part = &from[reporters[0]][cursor[0]..cursor[0] + n * h];
                cursor[0] += n * h;
                rows.push(Row::Hidden(
                    part.iter().map(|&b| f32::from_bits(b)).collect(),
                ));
            }
            for _ in 0..want.rows(n) {
                if want == Want::LastArgmax {
                    // The best over the slices; ties to the lower id, as
                    // `argmax` over the whole row.
                    let mut best: Option<(f32, u32)> = None;
                    for (i, &q) in reporters.iter().enumerate() {
                        let pair = &from[q][cursor[i]..cursor[i] + 2];
                        cursor[i] += 2;
                        let (v, id) = (f32::from_bits(pair[0]), pair[1]);
                        if id != u32::MAX && best.is_none_or(|(b, _)| v > b) {
                            best = Some((v, id));
                        }
                    }
                    rows.push(Row::Argmax(best.map(|b| b.1)));
                } else {
                    let mut row = Vec::with_capacity(vocab);
                    for (i, &q) in reporters.iter().enumerate() {
                        let width = slice(q).len();
                        let part = &from[q][cursor[i]..cursor[i] + width];
                        cursor[i] += width;
                        row.extend(part.iter().map(|&b| f32::from_bits(b)));
                    }
                    rows.push(Row::Logits(row));
                }
            }
        }
        out.push(rows);
    }
    Ok(Some(out))
}

/// One forward pass of the sequence in `cache` over `tokens` (appended to
/// it), on this process or across `cluster`: the rows `want` asks for.
///
/// # Errors
/// The model's, or a communication error.
pub fn forward_seq(
    model: &DecoderModel,
    cluster: Option<&Cluster>,
    cache: &mut KvCache,
    tokens: &[u32],
    want: Want,
) -> Result<Vec<Row>, EngineError> {
    let Some(cluster) = cluster else {
        let logits = model.forward(tokens, cache, want.logits())?;
        let vocab = model.config().vocab;
        return Ok(logits
            .chunks_exact(vocab)
            .map(|l| match want {
                Want::LastArgmax => Row::Argmax(crate::sampling::argmax(l)),
                _ => Row::Logits(l.to_vec()),
            })
            .collect());
    };
    let layout = cluster.layout();
    let (pool, table, pos0) = cache.parts();
    let step = SeqStep {
        tokens,
        pos0,
        table,
        logits: want.logits(),
        state: 0,
    };
    let mut groups = vec![Vec::new(); layout.dp];
    groups[0].push((step, want));
    let mut rows = cluster.step(pool, &groups)?;
    cache.commit(tokens.len());
    Ok(rows.swap_remove(0))
}

/// [`KvCache::save_state`] on this process, and across `cluster` in the
/// other ranks' caches.
///
/// # Errors
/// A communication error.
pub fn save_state(cluster: Option<&Cluster>, cache: &mut KvCache) -> Result<(), EngineError> {
    mirror(cluster, cache.save_state())
}

/// [`KvCache::truncate`] on this process, and across `cluster` in the
/// other ranks' caches (a state it goes back to is copied there too).
///
/// # Errors
/// A communication error.
pub fn truncate(
    cluster: Option<&Cluster>,
    cache: &mut KvCache,
    len: usize,
) -> Result<(), EngineError> {
    mirror(cluster, cache.truncate(len))
}

fn mirror(cluster: Option<&Cluster>, copy: Option<StateCopy>) -> Result<(), EngineError> {
    match (cluster, copy) {
        (Some(c), Some(copy)) => c.copy_state(0, copy),
        _ => Ok(()),
    }
}
