//! Which sequences run in the next forward pass, and how many tokens each
//! contributes: continuous batching under a token budget.
//!
//! Each step, running sequences go first, in admission order: those
//! decoding take one token each (two with a draft to verify), then those still in their prompt take
//! chunks of what budget is left (chunked prefill), so a long prompt never
//! stalls the streams already running. Then waiting requests are admitted
//! first come, first served, each after a prefix-cache lookup, while budget,
//! the running limit and free blocks allow. When a running sequence needs a
//! block and none is free, the most recently admitted sequence is preempted:
//! its blocks are released and it returns to the head of the queue, to be
//! recomputed (its full blocks often still in the prefix cache). A waiting
//! request whose prompt shares blocks with a prompt still being computed
//! waits for them rather than computing them a second time. An embedding
//! request needs every position's hidden state, so it takes no cached
//! prefix (its blocks still go to the cache for later prompts).
//!
//! For a model with linear-attention layers, a cached prefix is usable
//! only as deep as a state snapshot reaches (see `states.rs`), and prompt
//! chunks end at block boundaries where they can, so that their states can
//! be kept.

use super::blocks::BlockManager;
use super::sequence::Sequence;
use super::states::StateSlots;
use std::collections::VecDeque;

/// One sequence's share of a step: `n` tokens of `running[seq]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Scheduled {
    pub seq: usize,
    pub n: usize,
}

/// What a step's scheduling did besides choosing tokens.
#[derive(Default, Debug, PartialEq, Eq)]
pub(super) struct Outcome {
    pub preempted: usize,
    pub admitted: usize,
    /// Prompt tokens looked up in the prefix cache at admission, and found.
    pub cache_queries: usize,
    pub cache_hits: usize,
}

pub(super) struct Limits {
    pub max_batch_tokens: usize,
    pub max_running: usize,
}

/// Plans the next step. Preempted sequences move from `running` to the
/// front of `waiting`; admitted ones move the other way. Every scheduled
/// sequence has blocks for all the positions it will write.
pub(super) fn schedule<'t>(
    running: &mut Vec<Sequence<'t>>,
    waiting: &mut VecDeque<Sequence<'t>>,
    bm: &mut BlockManager,
    limits: &Limits,
    states: Option<&StateSlots>,
) -> (Vec<Scheduled>, Outcome) {
    let snapshots = states.filter(|_| bm.caches());
    let mut out = Outcome::default();
    let mut plan: Vec<Scheduled> = Vec::new();
    let mut budget = limits.max_batch_tokens;
    let mut preempted = vec![false; running.len()];
    // Decoding sequences first, then prompts, each group in admission order.
    let mut order: Vec<usize> = (0..running.len()).collect();
    order.sort_by_key(|&i| running[i].remaining() > 1);
    for i in order {
        if preempted[i] || budget == 0 {
            continue;
        }
        // A draft rides along when the budget has room for it.
        let n = cut_at_block(&running[i], running[i].wanted().min(budget), bm, snapshots);
        loop {
            let need =
                blocks_for(bm, running[i].computed + n).saturating_sub(running[i].blocks.len());
            if need <= bm.free() {
                grow(&mut running[i], bm, need);
                plan.push(Scheduled { seq: i, n });
                budget -= n;
                break;
            }
            // The most recently admitted sequence not yet preempted.
            let Some(victim) = (0..running.len()).rev().find(|&v| !preempted[v]) else {
                break;
            };
            preempted[victim] = true;
            running[victim].release_blocks(bm);
            out.preempted += 1;
            if let Some(at) = plan.iter().position(|s| s.seq == victim) {
                budget += plan.remove(at).n;
            }
            if victim == i {
                break;
            }
        }
    }
    if out.preempted > 0 {
        // Back to the queue's head, earliest admitted first; indices in the
        // plan shift down past each removed sequence.
        let mut kept = Vec::with_capacity(running.len());
        let mut back = Vec::new();
        let mut new_index = vec![usize::MAX; running.len()];
        for (i, s) in std::mem::take(running).into_iter().enumerate() {
            if preempted[i] {
                back.push(s);
            } else {
                new_index[i] = kept.len();
                kept.push(s);
            }
        }
        *running = kept;
        for s in back.into_iter().rev() {
            waiting.push_front(s);
        }
        for s in &mut plan {
            s.seq = new_index[s.seq];
        }
        // A preemption means memory is short: admit nobody this step.
        return (plan, out);
    }
    while budget > 0 && running.len() < limits.max_running {
        let Some(s) = waiting.front_mut() else { break };
        // An embedding needs every position's hidden state: no reuse.
        let mut hits = match s.embed {
            Some(_) => Vec::new(),
            None => bm.lookup(&s.tokens),
        };
        // A hybrid model's prefix only as deep as a state snapshot.
        if let Some(st) = states {
            let usable = (0..=hits.len())
                .rev()
                .find(|&i| i == 0 || st.has_snapshot(hits[i - 1].1))
                .unwrap_or(0);
            hits.truncate(usable);
        }
        if bm.caches()
            && s.embed.is_none()
            && awaits_shared_prefill(s, hits.len(), running, bm.block_size())
        {
            // Strict FCFS: nobody overtakes it while it waits.
            break;
        }
        for &(b, _) in &hits {
            bm.acquire(b);
        }
        let cached = hits.len() * bm.block_size();
        let n = (s.tokens.len() - cached).min(budget);
        let n = match snapshots {
            Some(_) => cut_at(cached, n, bm.block_size()),
            None => n,
        };
        let need = blocks_for(bm, cached + n) - hits.len();
        if need > bm.free() {
            for &(b, _) in &hits {
                bm.release(b);
            }
            break;
        }
        let Some(mut s) = waiting.pop_front() else {
            break;
        };
        s.blocks = hits.iter().map(|h| h.0).collect();
        s.cids = hits.iter().map(|h| h.1).collect();
        s.restore = states.and(hits.last().map(|h| h.1));
        s.restart_at(cached);
        if s.cached_tokens.is_none() {
            s.cached_tokens = Some(cached);
            out.cache_queries += s.prompt_len;
            out.cache_hits += cached;
        }
        grow(&mut s, bm, need);
        plan.push(Scheduled {
            seq: running.len(),
            n,
        });
        running.push(s);
        budget -= n;
        out.admitted += 1;
    }
    (plan, out)
}

/// Whether `s` should wait for a running sequence that is still computing
/// at least one more full block of the prefix they share: once that block
/// is registered, `s` reuses it instead of computing it again (requests
/// that arrive together with one long system prompt compute it once, not
/// once each). `hits` full blocks of `s` are already cached.
fn awaits_shared_prefill(
    s: &Sequence<'_>,
    hits: usize,
    running: &[Sequence<'_>],
    bs: usize,
) -> bool {
    let usable = s.tokens.len().saturating_sub(1) / bs * bs;
    running.iter().any(|r| {
        let shared = r
            .tokens
            .iter()
            .zip(&s.tokens[..usable])
            .take_while(|(a, b)| a == b)
            .count()
            / bs
            * bs;
        shared > hits * bs && r.computed < shared
    })
}

/// `n` tokens of `s`'s prompt, cut to end at the last block boundary they
/// cross (see [`cut_at`]) when state snapshots are kept; decode steps as
/// they are.
fn cut_at_block(
    s: &Sequence<'_>,
    n: usize,
    bm: &BlockManager,
    snaps: Option<&StateSlots>,
) -> usize {
    match (snaps, s.remaining() > 1) {
        (Some(_), true) => cut_at(s.computed, n, bm.block_size()),
        _ => n,
    }
}

/// A prompt chunk of `n` tokens from position `at`, shortened to end at
/// the last block boundary inside it: the state there is what a later
/// prompt sharing the blocks can start from. A chunk that ends at a
/// boundary already, or crosses none, runs whole.
fn cut_at(at: usize, n: usize, bs: usize) -> usize {
    let end = at + n;
    let boundary = end / bs * bs;
    match boundary > at && boundary < end {
        true => boundary - at,
        false => n,
    }
}

fn blocks_for(bm: &BlockManager, positions: usize) -> usize {
    positions.div_ceil(bm.block_size())
}

/// Appends `need` fresh blocks to `s`'s table; the caller checked they are free.
fn grow(s: &mut Sequence<'_>, bm: &mut BlockManager, need: usize) {
    for _ in 0..need {
        match bm.allocate() {
            Some(b) => s.blocks.push(b),
            None => unreachable!("checked free blocks before growing"),
        }
    }
}
