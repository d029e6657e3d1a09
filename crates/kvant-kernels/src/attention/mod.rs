//! Causal self-attention over a paged KV cache (PagedAttention) for a
//! ragged batch of sequences: FlashAttention-style tiles with the online
//! softmax, GQA groups processed together, and the key range split across
//! threads (flash-decoding) when a call has too few query rows to occupy
//! the pool.
//!
//! Work items are a few query rows of one sequence sharing one KV head
//! (`rows`); each runs over its keys partition by partition, in tiles,
//! never materialising a score row. A decode step of one sequence has one
//! item per KV head, fewer than the pool has threads, so its partitions are
//! spread over tasks whose partial states `(max, denominator, weighted sum)`
//! are folded afterwards, as FlashDecoding does on a GPU; its items read
//! an f16, bf16 or f32 cache as stored (each value widened in registers)
//! and prefetch the next tile while a tile runs. A prefill chunk has many
//! items per KV head: they run in sweeps, key partition outer, so each
//! partition of the cache is widened to f32 once for all of a sweep's
//! items rather than once per item. How the work is split or read never
//! changes a result (see `rows`' batch invariance).

pub mod indexer;
mod kv;
mod params;
mod reference;
mod rows;
mod sinks;
mod sparse;
#[cfg(test)]
mod testing;

pub use indexer::{select_topk, select_topk_dyn, select_topk_dyn_with, IndexerParams, TopK};
pub use kv::{
    load_rows, store_rows, BlockQ4_0, BlockQ8_0, KvBlocks, KvBuffer, KvDType, KvElem, KvLayer,
};
pub use params::{AttnParams, SeqAttn};
pub use reference::attention_ref;
pub use sinks::{sink_attention, sink_attention_ref, SinkAttn, SinkRows};
pub use sparse::{
    sparse_attention, sparse_attention_dyn, sparse_attention_dyn_with, sparse_attention_with,
};

use crate::cpu::{self, SimdTier};
use crate::pool::{self, DisjointSlice};
use kv::HeadRows;
use params::MAX_ROWS;
use rows::{fold, Item, Partial, SeqOperands, State, Tiles, PARTITION};
use std::cell::RefCell;
use std::ops::Range;

/// Work items wanted per pool thread, for balance (late rows see more keys).
const ITEMS_PER_THREAD: usize = 4;

/// Sweeps wanted per pool thread. A sweep is the items of one sequence
/// and KV head that one task runs key-partition-outer: each partition of
/// keys is widened to f32 once for all of them, where an item alone widens
/// every tile it reads (with 24-row items, a 128-token chunk of Gemma 3's
/// 4:1 GQA re-widened its layer's cache 22 times: 30% of prefill
/// attention's time). Its items are interleaved over the chunk (every
/// `n`-th), so sweeps cost alike although late tokens see more keys.
const SWEEPS_PER_THREAD: usize = 4;

/// An item of a call and where its partitions' states go when split.
#[derive(Clone, Copy)]
struct Planned {
    seq: usize,
    item: Item,
    parts: (usize, usize),
    /// Offset of its partition states in the split buffer.
    off: usize,
}

/// A task of a split call: an item (index into the plan) and the
/// partitions `a..b` it runs.
type Task = (usize, usize, usize);

/// The items `start, start + step, ..` (below `end`) of the plan, all of
/// one sequence and KV head, run by one task.
#[derive(Clone, Copy)]
struct Sweep {
    start: usize,
    end: usize,
    step: usize,
}

impl Sweep {
    fn items(self) -> impl Iterator<Item = usize> {
        (self.start..self.end).step_by(self.step)
    }
}

/// One partition's keys and stored values of one KV head, widened to f32
/// once for the items of a sweep (rows of `head_dim` and `v_dim` from
/// position `at`).
#[derive(Default)]
struct Widened {
    at: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Runs an item over one partition into `state.part`, reading the
/// partition's keys from the [`Widened`] buffer when given. The partition
/// comes with the one the same thread runs next for the same item, if
/// any, whose first tile is prefetched while the last one runs.
type RunPartition<'a> =
    dyn Fn(&Planned, (usize, Option<usize>), &mut State, Option<&Widened>) + Sync + 'a;

/// Widens partition `part` of KV head `kvh` of sequence `seq` into a [`Widened`].
type Widen<'a> = dyn Fn(usize, usize, usize, &mut Widened) + Sync + 'a;

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
    static MERGED: RefCell<Partial> = RefCell::new(Partial::default());
    /// The call's items, and its tasks when split.
    static PLAN: RefCell<(Vec<Planned>, Vec<Task>)> =
        const { RefCell::new((Vec::new(), Vec::new())) };
    /// Partial states of split calls: per item and partition `[m; R] [l; R] [acc; R·hd]`.
    static PARTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The call's sweeps (calls that are not split).
    static SWEEPS: RefCell<Vec<Sweep>> = const { RefCell::new(Vec::new()) };
    /// A sweep's widened partition and its items' running states.
    static WIDENED: RefCell<Widened> = RefCell::new(Widened::default());
    static SWEEP_STATES: RefCell<Vec<Partial>> = const { RefCell::new(Vec::new()) };
}

/// Attention of every sequence in `seqs` on the start-up tier. `q` is
/// `[n_tokens, n_heads * head_dim]` and `out` `[n_tokens, n_heads *
/// v_dim]`, the sequences' rows concatenated.
pub fn attention<T: KvElem>(
    p: &AttnParams,
    q: &[f32],
    kv: &KvBlocks<'_, T>,
    seqs: &[SeqAttn<'_>],
    out: &mut [f32],
) {
    attention_with(cpu::tier(), p, q, kv, seqs, out)
}

/// [`attention`] over a layer whose element type is chosen at run time
/// (a pool's buffers), on the start-up tier.
pub fn attention_dyn(
    p: &AttnParams,
    q: &[f32],
    kv: &KvLayer<'_>,
    seqs: &[SeqAttn<'_>],
    out: &mut [f32],
) {
    attention_dyn_with(cpu::tier(), p, q, kv, seqs, out)
}

/// [`attention_dyn`] on a given tier.
///
/// # Panics
/// As [`attention_with`], and if the keys and values differ in type.
pub fn attention_dyn_with(
    tier: SimdTier,
    p: &AttnParams,
    q: &[f32],
    kv: &KvLayer<'_>,
    seqs: &[SeqAttn<'_>],
    out: &mut [f32],
) {
    kv::with_kv_elem!(kv.dtype(), T => {
        attention_with(tier, p, q, &kv.blocks::<T>(), seqs, out)
    })
}

/// [`attention`] on a given tier (lowered to one the CPU supports).
///
/// # Panics
/// If the slices, block tables or rows disagree with `p` and `kv` (a bug in
/// the calling model or engine code: block tables are engine-made).
fn attention_with<T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    q: &[f32],
    kv: &KvBlocks<'_, T>,
    seqs: &[SeqAttn<'_>],
    out: &mut [f32],
) {
    let (hd, vd) = (p.head_dim, p.v_dim);
    let group = p.n_heads / p.n_kv_heads.max(1);
    assert!(hd > 0 && vd > 0 && group > 0 && p.n_heads == group * p.n_kv_heads);
    let qd = p.n_heads * hd;
    assert_eq!(q.len() / qd * p.n_heads * vd, out.len());
    assert!(kv.block_size > 0);
    assert!(
        hd % T::VALUES == 0,
        "key rows are not whole {} units",
        T::DTYPE
    );
    let n_blocks = kv.n_blocks(p.n_kv_heads, hd);
    assert_eq!(kv.k.len(), n_blocks * kv.block_units(p.n_kv_heads, hd));
    match kv.v {
        Some(v) => {
            assert!(
                vd % T::VALUES == 0,
                "value rows are not whole {} units",
                T::DTYPE
            );
            assert_eq!(v.len(), n_blocks * kv.block_units(p.n_kv_heads, vd))
        }
        None => assert!(vd <= hd, "latent values longer than the keys"),
    }
    for s in seqs {
        let len = s.pos0 + s.rows.len();
        assert!(s.rows.end * qd <= q.len(), "rows past the queries");
        assert!(
            s.table.len() * kv.block_size >= len,
            "block table too short"
        );
        assert!(s.table[..len.div_ceil(kv.block_size)]
            .iter()
            .all(|&b| (b as usize) < n_blocks));
    }
    let tier = cpu::clamp(tier);
    let operands = |si: usize| {
        let s = &seqs[si];
        SeqOperands {
            q: &q[s.rows.start * qd..s.rows.end * qd],
            pos0: s.pos0,
            kv,
            table: s.table,
        }
    };
    PLAN.with_borrow_mut(|(plan, tasks)| {
        plan.clear();
        let mut off = 0;
        for (si, s) in seqs.iter().enumerate() {
            let ops = operands(si);
            for item in items(p, s.rows.len()) {
                let parts = ops.partitions(p, &item);
                plan.push(Planned {
                    seq: si,
                    item,
                    parts: (parts.start, parts.end),
                    off,
                });
                off += parts.len() * item.rows() * (2 + vd);
            }
        }
        let out = DisjointSlice::new(out);
        let rows_of = |seq: usize| seqs[seq].rows.start;
        let widen = |seq: usize, kvh: usize, part: usize, w: &mut Widened| {
            let s = &seqs[seq];
            let keys = part * PARTITION..((part + 1) * PARTITION).min(s.pos0 + s.rows.len());
            w.at = keys.start;
            w.k.resize(keys.len() * hd, 0.0);
            w.v.resize(if kv.v.is_some() { keys.len() * vd } else { 0 }, 0.0);
            let at = HeadRows {
                table: s.table,
                n_kv_heads: p.n_kv_heads,
                dims: (hd, vd),
                h: kvh,
            };
            kv.widen_tile(tier, &at, (keys.start, keys.len()), (&mut w.k, &mut w.v));
        };
        execute(
            (plan, tasks, off),
            (p.n_heads, vd),
            &|pl, (part, next), st, w| {
                let tiles = match w {
                    Some(w) => Tiles::Widened {
                        at: w.at,
                        k: &w.k,
                        v: &w.v,
                    },
                    None => Tiles::Cache,
                };
                rows::run_partition(
                    tier,
                    p,
                    &operands(pl.seq),
                    &pl.item,
                    (part, next, tiles),
                    st,
                )
            },
            Some(&widen),
            &rows_of,
            &out,
        );
    });
}

/// Runs the items of `plan` (each over its partitions, the states folded
/// left to right) and writes each row's normalised result into `out`
/// (`[tokens, heads, vd]`; an item's token `t` is row `row0(seq) + t`).
/// `run(item, partition, state, widened)` leaves a partition's state in
/// `state.part`, reading its keys from `widened` when given. With `widen`,
/// items of one sequence and KV head run in sweeps that share each
/// widened partition ([`SWEEPS_PER_THREAD`]). When the items are too few
/// for the pool, their partitions are spread over tasks whose states are
/// kept and folded afterwards in the same order (flash-decoding): the
/// result is the same either way.
fn execute(
    (plan, tasks, off): (&[Planned], &mut Vec<Task>, usize),
    (n_heads, vd): (usize, usize),
    run: &RunPartition<'_>,
    widen: Option<&Widen<'_>>,
    row0: &(dyn Fn(usize) -> usize + Sync),
    out: &DisjointSlice<'_, f32>,
) {
    let finish = |pl: &Planned, m: &Partial| {
        for r in 0..pl.item.rows() {
            let (t, h) = pl.item.row(r);
            let (l, acc) = (m.l[r], &m.acc[r * vd..(r + 1) * vd]);
            let o = ((row0(pl.seq) + t) * n_heads + h) * vd;
            // SAFETY: every (sequence, token, head) row belongs to exactly
            // one item, and sequences' rows do not overlap (checked by the
            // caller's construction; out-of-range panics in `range`).
            let dst = unsafe { out.range(o..o + vd) };
            dst.iter_mut().zip(acc).for_each(|(o, a)| *o = a / l);
        }
    };
    let wanted = pool::global().threads() * ITEMS_PER_THREAD;
    let total_parts: usize = plan.iter().map(|pl| pl.parts.1 - pl.parts.0).sum();
    if plan.len() >= wanted || total_parts <= plan.len() {
        SWEEPS.with_borrow_mut(|sweeps| {
            let per_thread = if widen.is_some() {
                SWEEPS_PER_THREAD
            } else {
                0
            };
            let threads = pool::global().threads();
            plan_sweeps(
                plan,
                (threads * per_thread, threads * ITEMS_PER_THREAD),
                sweeps,
            );
            let sweeps = &*sweeps;
            pool::global().run(sweeps.len(), &|i| {
                let sweep = sweeps[i];
                STATE.with_borrow_mut(|st| match widen {
                    Some(widen) if sweep.items().nth(1).is_some() => {
                        run_sweep(plan, sweep, vd, (run, widen), st, &finish)
                    }
                    _ => MERGED.with_borrow_mut(|m| {
                        for pl in sweep.items().map(|i| &plan[i]) {
                            m.reset(pl.item.rows(), vd);
                            for part in pl.parts.0..pl.parts.1 {
                                let next = (part + 1 < pl.parts.1).then_some(part + 1);
                                run(pl, (part, next), st, None);
                                fold_rows(m, &st.part, vd);
                            }
                            finish(pl, m);
                        }
                    }),
                });
            });
        });
        return;
    }
    // Flash-decoding: spread each item's partitions over tasks, keep
    // every partition's state, then fold them in order per item.
    let per_item = wanted.div_ceil(plan.len());
    tasks.clear();
    for (i, pl) in plan.iter().enumerate() {
        let n = pl.parts.1 - pl.parts.0;
        let chunk = n.div_ceil(per_item.min(n).max(1));
        let mut a = pl.parts.0;
        while a < pl.parts.1 {
            let b = (a + chunk).min(pl.parts.1);
            tasks.push((i, a, b));
            a = b;
        }
    }
    PARTS.with_borrow_mut(|parts| {
        parts.resize(off, 0.0);
        let shared = DisjointSlice::new(parts);
        let tasks = &*tasks;
        pool::global().run(tasks.len(), &|task| {
            let (i, a, b) = tasks[task];
            let pl = &plan[i];
            let rows = pl.item.rows();
            let stride = rows * (2 + vd);
            let at = pl.off + (a - pl.parts.0) * stride;
            // SAFETY: each (item, partition) owns its own stride of the
            // buffer, and tasks cover disjoint partition ranges.
            let mine = unsafe { shared.range(at..at + (b - a) * stride) };
            STATE.with_borrow_mut(|st| {
                for (part, dst) in (a..b).zip(mine.chunks_exact_mut(stride)) {
                    run(pl, (part, (part + 1 < b).then_some(part + 1)), st, None);
                    dst[..rows].copy_from_slice(&st.part.m);
                    dst[rows..2 * rows].copy_from_slice(&st.part.l);
                    dst[2 * rows..].copy_from_slice(&st.part.acc);
                }
            });
        });
        let parts = &*parts;
        pool::global().run(plan.len(), &|i| {
            let pl = &plan[i];
            let rows = pl.item.rows();
            let stride = rows * (2 + vd);
            let n = pl.parts.1 - pl.parts.0;
            MERGED.with_borrow_mut(|m| {
                m.reset(rows, vd);
                for s in parts[pl.off..pl.off + n * stride].chunks_exact(stride) {
                    for r in 0..rows {
                        fold(
                            &mut m.m[r],
                            &mut m.l[r],
                            &mut m.acc[r * vd..(r + 1) * vd],
                            s[r],
                            s[rows + r],
                            &s[2 * rows + r * vd..2 * rows + (r + 1) * vd],
                        );
                    }
                }
                finish(pl, m);
            });
        });
    });
}

/// Groups the plan's items into about `wanted` sweeps and a tail of
/// single items (every item alone when `wanted` is 0). Per sequence and KV
/// head (items consecutive in the plan), the last of its items by its
/// share of `tail` run alone, the others in sweeps by their share of
/// `wanted`, item `k` going to sweep `k % n`. The pool hands tasks out in
/// order, so the sweeps go first and the single items last fill in where a
/// thread finishes early: whole sweeps alone left one thread idle for
/// ~11% of a Gemma 3 prefill call on two threads.
fn plan_sweeps(plan: &[Planned], (wanted, tail): (usize, usize), sweeps: &mut Vec<Sweep>) {
    sweeps.clear();
    let groups = || {
        let mut start = 0;
        std::iter::from_fn(move || {
            let first = plan.get(start)?;
            let key = |pl: &Planned| (pl.seq, pl.item.kvh);
            let n = plan[start..]
                .iter()
                .take_while(|pl| key(pl) == key(first))
                .count();
            start += n;
            Some(start - n..start)
        })
    };
    let n = plan.len();
    let split = |g: &Range<usize>| {
        let alone = if wanted == 0 {
            g.len()
        } else {
            (g.len() * tail).div_ceil(n).min(g.len())
        };
        g.end - alone
    };
    for g in groups() {
        let rest = split(&g) - g.start;
        if rest > 0 {
            let k = (rest * wanted).div_ceil(n).clamp(1, rest);
            sweeps.extend((0..k).map(|i| Sweep {
                start: g.start + i,
                end: g.start + rest,
                step: k,
            }));
        }
    }
    for g in groups() {
        sweeps.extend((split(&g)..g.end).map(|i| Sweep {
            start: i,
            end: i + 1,
            step: 1,
        }));
    }
}

/// Runs a sweep key-partition-outer: each partition some item sees is
/// widened once, then every item that sees it runs over it, its state
/// folded into the item's running state. An item's partitions still fold
/// left to right through [`fold_rows`], so its rows round exactly as when
/// it runs alone.
fn run_sweep(
    plan: &[Planned],
    sweep: Sweep,
    vd: usize,
    (run, widen): (&RunPartition<'_>, &Widen<'_>),
    st: &mut State,
    finish: &dyn Fn(&Planned, &Partial),
) {
    let first = &plan[sweep.start];
    let (seq, kvh) = (first.seq, first.item.kvh);
    let lo = sweep.items().map(|i| plan[i].parts.0).min().unwrap_or(0);
    let hi = sweep.items().map(|i| plan[i].parts.1).max().unwrap_or(0);
    WIDENED.with_borrow_mut(|w| {
        SWEEP_STATES.with_borrow_mut(|states| {
            let n = sweep.items().count();
            if states.len() < n {
                states.resize_with(n, Partial::default);
            }
            for (m, i) in states.iter_mut().zip(sweep.items()) {
                m.reset(plan[i].item.rows(), vd);
            }
            for part in lo..hi {
                let sees = |i: &usize| (plan[*i].parts.0..plan[*i].parts.1).contains(&part);
                if !sweep.items().any(|i| sees(&i)) {
                    continue;
                }
                widen(seq, kvh, part, w);
                for (m, i) in states.iter_mut().zip(sweep.items()) {
                    if sees(&i) {
                        run(&plan[i], (part, None), st, Some(w));
                        fold_rows(m, &st.part, vd);
                    }
                }
            }
            for (m, i) in states.iter().zip(sweep.items()) {
                finish(&plan[i], m);
            }
        });
    });
}

/// Folds every row of partition state `b` into `m`.
fn fold_rows(m: &mut Partial, b: &Partial, vd: usize) {
    for r in 0..b.m.len() {
        fold(
            &mut m.m[r],
            &mut m.l[r],
            &mut m.acc[r * vd..(r + 1) * vd],
            b.m[r],
            b.l[r],
            &b.acc[r * vd..(r + 1) * vd],
        );
    }
}

/// The work items of a sequence with `n` query tokens: per KV head, the
/// group's heads (at most `MAX_ROWS`) times as many tokens as fit.
fn items(p: &AttnParams, n: usize) -> impl Iterator<Item = Item> {
    let group = p.n_heads / p.n_kv_heads;
    let hs = group.min(MAX_ROWS);
    let head_chunks = group.div_ceil(hs);
    let tq = (MAX_ROWS / hs).clamp(1, n.max(1));
    let token_blocks = n.div_ceil(tq);
    (0..p.n_kv_heads * head_chunks * token_blocks).map(move |i| {
        let (kvh, rest) = (
            i / (head_chunks * token_blocks),
            i % (head_chunks * token_blocks),
        );
        let (hc, tb) = (rest / token_blocks, rest % token_blocks);
        let h0 = kvh * group + hc * hs;
        let t0 = tb * tq;
        Item {
            kvh,
            h0,
            hs: hs.min((kvh + 1) * group - h0),
            t0,
            tq: tq.min(n - t0),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::testing::{fits, params, rand_vec, random_kvs, Case, Store};
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// `load_rows` reads back exactly what `store_rows` wrote (after the
    /// element type's rounding), from any position through shuffled
    /// blocks, for every element type.
    #[test]
    fn load_rows_inverts_store_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for dtype in KvDType::ALL {
            for (n_kv, hd, bs, len) in [
                (1, 37, 5, 23),
                (3, 8, 4, 9),
                (2, 3, 16, 1),
                (1, 96, 3, 11),
                (3, 32, 7, 20),
                (2, 64, 1, 5),
            ] {
                if !fits(dtype, (hd, hd), true) {
                    continue;
                }
                let keys = rand_vec(&mut rng, len * n_kv * hd);
                let s = Store::new(&mut rng, dtype, &[(keys, vec![])], n_kv, (hd, 1), bs, true);
                for pos in [0, len / 2, len - 1] {
                    let mut got = vec![0f32; (len - pos) * n_kv * hd];
                    s.k.load_rows(&mut got, (bs, n_kv, hd), &s.tables[0], pos);
                    assert_eq!(
                        got,
                        s.rounded[0].0[pos * n_kv * hd..],
                        "{dtype} {n_kv} {hd} {bs} {pos}"
                    );
                }
            }
        }
    }

    /// Online softmax in f32 over ≤ 1000 keys: errors ~1e-6; 1e-5 leaves margin.
    const TOL: f32 = 1e-5;

    /// The cases of the dense kernel: their parameter is the window.
    fn cases() -> Vec<Case<Option<usize>>> {
        vec![
            (4, 2, (16, 16), false, None, vec![(7, 0)]),
            (3, 1, (5, 5), false, None, vec![(1, 20), (4, 3)]),
            (6, 3, (8, 8), false, Some(4), vec![(9, 13)]),
            (2, 2, (3, 3), false, Some(1), vec![(5, 0), (1, 0)]),
            (9, 3, (64, 64), false, None, vec![(1, 700)]),
            (
                4,
                1,
                (33, 33),
                false,
                None,
                vec![(1, 1000), (1, 5), (2, 300)],
            ),
            (16, 1, (8, 8), false, Some(300), vec![(1, 900)]),
            (9, 3, (64, 64), false, None, vec![(37, 5), (1, 129), (3, 0)]),
            (8, 2, (17, 17), false, Some(64), vec![(70, 100)]),
            (24, 2, (12, 12), false, None, vec![(3, 260)]),
            // Values narrower than keys, stored apart.
            (4, 2, (24, 16), false, None, vec![(3, 40), (1, 7)]),
            // Latent attention (MLA): one KV head whose rows hold the
            // compressed KV then the rotary part; values are the former.
            (16, 1, (40, 32), true, None, vec![(1, 300), (5, 2)]),
            (5, 1, (72, 64), true, Some(100), vec![(9, 150), (1, 0)]),
            (32, 1, (24, 16), true, None, vec![(2, 129)]),
            // Whole 32-value blocks, for the quantized types too.
            (4, 2, (32, 32), false, None, vec![(7, 0), (1, 45)]),
            (3, 3, (32, 32), false, Some(20), vec![(1, 31), (2, 0)]),
            (6, 2, (96, 64), false, Some(40), vec![(5, 50), (1, 33)]),
            (8, 1, (64, 48), true, None, vec![(1, 200), (3, 17)]),
            (16, 1, (96, 64), true, None, vec![(2, 75), (1, 0)]),
        ]
    }

    /// Ragged batches (prefill chunks next to decodes), short and long
    /// histories, windows, GQA groups small and large, odd head sizes,
    /// block sizes from 1 to contiguous, on every tier, for every cache
    /// type whose units the rows fill: each sequence's rows against the
    /// f64 reference over the values the store holds.
    #[test]
    fn every_tier_matches_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        for (case, (n_heads, n_kv, (hd, vd), latent, window, shape)) in
            cases().into_iter().enumerate()
        {
            let p = params((n_heads, n_kv), (hd, vd), 1.0 / (hd as f32).sqrt(), window);
            let kvs = random_kvs(&mut rng, &shape, n_kv, (hd, vd));
            let n_tok: usize = shape.iter().map(|s| s.0).sum();
            let q = rand_vec(&mut rng, n_tok * n_heads * hd);
            let n_out = n_tok * n_heads * vd;
            let block_size = [1, 5, 16, 32, 1024][case % 5];
            let qd = n_heads * hd;
            for dtype in KvDType::ALL {
                if !fits(dtype, (hd, vd), latent) {
                    continue;
                }
                let store = Store::new(&mut rng, dtype, &kvs, n_kv, (hd, vd), block_size, latent);
                let mut row0 = 0;
                let mut seqs = Vec::new();
                let mut refs = Vec::new();
                for (i, &(n, past)) in shape.iter().enumerate() {
                    let rows = row0..row0 + n;
                    let qs = &q[rows.start * qd..rows.end * qd];
                    let (k, v) = &store.rounded[i];
                    refs.extend(attention_ref(&p, qs, past, k, v));
                    seqs.push(SeqAttn {
                        rows,
                        pos0: past,
                        table: &store.tables[i],
                    });
                    row0 += n;
                }
                for tier in cpu::available_tiers() {
                    let mut out = vec![f32::NAN; n_out];
                    attention_dyn_with(tier, &p, &q, &store.layer(), &seqs, &mut out);
                    for (a, b) in out.iter().zip(&refs) {
                        assert!(
                            (a - b).abs() <= TOL,
                            "{tier} {dtype} case {case}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// A sequence's rows come out bit for bit the same alone, next to other
    /// sequences (which changes the key split), in prefill chunks of any
    /// size, and one token at a time, for every cache type: what lets a
    /// served request's output not depend on its neighbours.
    #[test]
    fn results_do_not_depend_on_the_batch() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for (n_heads, n_kv, (hd, vd), latent, window, n, past) in [
            (9usize, 3usize, (64, 64), false, None, 45usize, 300usize),
            (4, 1, (24, 24), false, Some(50), 70, 10),
            (6, 2, (7, 7), false, None, 33, 0),
            (16, 1, (40, 32), true, None, 21, 140),
            (4, 2, (32, 32), false, Some(70), 37, 90),
            (8, 1, (64, 48), true, None, 19, 170),
        ] {
            let p = params((n_heads, n_kv), (hd, vd), 0.3, window);
            let len = past + n;
            let me = (
                rand_vec(&mut rng, len * n_kv * hd),
                rand_vec(&mut rng, len * n_kv * vd),
            );
            let other = (
                rand_vec(&mut rng, 500 * n_kv * hd),
                rand_vec(&mut rng, 500 * n_kv * vd),
            );
            let (qd, od) = (n_heads * hd, n_heads * vd);
            let q = rand_vec(&mut rng, n * qd);
            let q_other = rand_vec(&mut rng, 3 * qd);
            let seqs = [me, other];
            for dtype in KvDType::ALL {
                if dtype == KvDType::F32 || !fits(dtype, (hd, vd), latent) {
                    continue;
                }
                let store = Store::new(&mut rng, dtype, &seqs, n_kv, (hd, vd), 16, latent);
                for tier in cpu::available_tiers() {
                    // Rows `a..b` of the sequence, optionally behind another sequence's 3 rows.
                    let run = |a: usize, b: usize, crowd: bool| -> Vec<f32> {
                        let mut qs = Vec::new();
                        let mut seqs = Vec::new();
                        if crowd {
                            qs.extend_from_slice(&q_other);
                            seqs.push(SeqAttn {
                                rows: 0..3,
                                pos0: 497,
                                table: &store.tables[1],
                            });
                        }
                        let r0 = qs.len() / qd;
                        qs.extend_from_slice(&q[a * qd..b * qd]);
                        seqs.push(SeqAttn {
                            rows: r0..r0 + b - a,
                            pos0: past + a,
                            table: &store.tables[0],
                        });
                        let mut out = vec![f32::NAN; qs.len() / qd * od];
                        attention_dyn_with(tier, &p, &qs, &store.layer(), &seqs, &mut out);
                        out[r0 * od..].to_vec()
                    };
                    let alone = run(0, n, false);
                    assert_eq!(alone, run(0, n, true), "{tier} {dtype}: crowded");
                    for chunk in [1, 7, 16] {
                        let mut pieces = Vec::new();
                        for a in (0..n).step_by(chunk) {
                            pieces.extend(run(a, (a + chunk).min(n), a % 2 == 0));
                        }
                        assert_eq!(alone, pieces, "{tier} {dtype}: chunks of {chunk}");
                    }
                }
            }
        }
    }

    #[test]
    fn window_of_one_returns_own_value() {
        let p = AttnParams {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            v_dim: 2,
            scale: 1.0,
            window: Some(1),
        };
        let q = [1.0, 0.0, 0.0, 1.0];
        let (k, v) = ([5.0, 5.0, -3.0, 2.0], [1.0, 2.0, 3.0, 4.0]);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let store = Store::new(
            &mut rng,
            KvDType::F32,
            &[(k.to_vec(), v.to_vec())],
            1,
            (2, 2),
            1,
            false,
        );
        let mut out = [0f32; 4];
        let seqs = [SeqAttn {
            rows: 0..2,
            pos0: 0,
            table: &store.tables[0],
        }];
        attention(&p, &q, &store.layer().blocks::<f32>(), &seqs, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }
}
