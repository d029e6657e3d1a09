//! The lightning indexer of DeepSeek sparse attention (DSA, DeepSeek-V3.2):
//! each query token scores every key position it may see with
//! `I = Σ_h w_h · ReLU(scale · q_h · k)` (one shared indexer key per
//! position, `n_heads` indexer query heads with per-token weights `w`) and
//! keeps the `topk` best; latent attention then reads only those rows.
//!
//! A token that sees no more than `topk` positions selects all of them,
//! which is dense attention: it is reported as such and never scored.
//! Otherwise its keys are scored in tiles of [`KEY_TILE`] and fed to a
//! streaming top-k (a candidate buffer pruned to `topk` whenever it holds
//! `2·topk`, with the `topk`-th best as the admission bar), so memory is
//! `O(topk)` per task whatever the context: a prompt chunk never builds a
//! `[chunk × context]` score matrix. A long context is split into key
//! ranges scored by different tasks, whose survivors are merged.
//!
//! **Determinism.** Every score is one canonical per-pair dot product (the
//! 4-key tile of `rows::scores`) and one fixed-order sum over heads, and
//! candidates are ranked by a total order (higher score first, then the
//! earlier position; `-0` counts as `0`), so the selected set depends only
//! on the token and its keys: not on the split, the batch or the threads.
//! Ties at the cut therefore go to earlier positions (PyTorch's `topk`
//! leaves tie order unspecified).

use super::kv::{self, HeadRows, KvBlocks, KvElem, KvLayer};
use super::rows::{scores, KEY_TILE};
use super::SeqAttn;
use crate::cpu::{self, SimdTier};
use crate::lanes::RowSet;
use crate::pool::{self, DisjointSlice};
use std::cell::RefCell;
use std::cmp::Ordering;

/// Shape of the indexer of one layer.
#[derive(Clone, Copy, Debug)]
pub struct IndexerParams {
    pub n_heads: usize,
    pub head_dim: usize,
    /// Positions each query keeps.
    pub topk: usize,
    /// Multiplies `q_h · k` inside the ReLU (`head_dim^-0.5`).
    pub scale: f32,
}

/// Each query token's selection: `None` for a token that sees no more
/// than `topk` positions (it attends to all of them), else its `topk`
/// positions in ascending order.
#[derive(Default, Debug)]
pub struct TopK {
    k: usize,
    /// `[n_tokens, k]`; rows of dense tokens are unused.
    rows: Vec<u32>,
    sparse: Vec<bool>,
}

impl TopK {
    pub fn get(&self, token: usize) -> Option<&[u32]> {
        match self.sparse[token] {
            true => Some(&self.rows[token * self.k..(token + 1) * self.k]),
            false => None,
        }
    }

    pub fn n_tokens(&self) -> usize {
        self.sparse.len()
    }

    /// Whether any token is sparse.
    pub fn any_sparse(&self) -> bool {
        self.sparse.iter().any(|&s| s)
    }

    /// A selection made by hand: per token, `None` (dense) or `k` ascending
    /// positions.
    #[cfg(test)]
    pub(super) fn from_rows(k: usize, rows: &[Option<Vec<u32>>]) -> Self {
        let mut t = TopK::default();
        t.reset(k, rows.len());
        for (i, r) in rows.iter().enumerate() {
            if let Some(r) = r {
                t.sparse[i] = true;
                t.rows[i * k..(i + 1) * k].copy_from_slice(r);
            }
        }
        t
    }

    fn reset(&mut self, k: usize, n: usize) {
        self.k = k;
        self.rows.clear();
        self.rows.resize(n * k, 0);
        self.sparse.clear();
        self.sparse.resize(n, false);
    }
}

/// A scored position. Ranked by [`better`].
#[derive(Clone, Copy, Debug, Default)]
struct Cand {
    score: f32,
    pos: u32,
}

/// The total order of candidates: higher score first, then the earlier
/// position. Scores are normalised (`+0.0` for `-0.0`) when made.
fn better(a: &Cand, b: &Cand) -> Ordering {
    b.score.total_cmp(&a.score).then(a.pos.cmp(&b.pos))
}

/// Keeps the best `k` of `c` (in no particular order).
fn prune(c: &mut Vec<Cand>, k: usize) {
    if c.len() > k {
        c.select_nth_unstable_by(k - 1, better);
        c.truncate(k);
    }
}

/// A streaming top-k: push candidates in any order, read the best `k`.
struct Stream<'a> {
    c: &'a mut Vec<Cand>,
    k: usize,
    /// The `k`-th best so far once `k` are held: anything not better is out.
    bar: Option<Cand>,
}

impl<'a> Stream<'a> {
    fn new(c: &'a mut Vec<Cand>, k: usize) -> Self {
        c.clear();
        Stream { c, k, bar: None }
    }

    fn push(&mut self, x: Cand) {
        if let Some(bar) = &self.bar {
            if better(&x, bar) != Ordering::Less {
                return;
            }
        }
        self.c.push(x);
        if self.c.len() >= 2 * self.k {
            prune(self.c, self.k);
            self.bar = self.c.iter().copied().max_by(better);
        }
    }

    fn finish(self) {
        prune(self.c, self.k);
    }
}

/// Keys per scoring task at the least: a task's fixed costs (a query's
/// rows loaded, a top-k pruned) stay small next to its scoring.
const MIN_TASK_KEYS: usize = 1024;

/// Tasks wanted per pool thread, for balance.
const TASKS_PER_THREAD: usize = 4;

thread_local! {
    /// Per thread: tile scores (heads × KEY_TILE), widened key tile,
    /// index scores of a tile, candidates.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
    /// The call's tasks (token, key range), their survivors and counts,
    /// and the merge buffer.
    static TASKS: RefCell<Tasks> = RefCell::new(Tasks::default());
}

type Scratch = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<Cand>);

#[derive(Default)]
struct Tasks {
    tasks: Vec<(usize, usize, usize)>,
    survivors: Vec<Cand>,
    counts: Vec<usize>,
    merged: Vec<Cand>,
    sorted: Vec<u32>,
}

/// Selects each query token's top-k key positions on the start-up tier.
/// `q` is `[n_tokens, n_heads * head_dim]` (rotated), `w` `[n_tokens,
/// n_heads]` (the head weights, already scaled), `keys` the indexer keys
/// (one head of `head_dim` per position, no values), `seqs` where each
/// token sits. Keys of every query token must be stored already.
pub fn select_topk<T: KvElem>(
    p: &IndexerParams,
    q: &[f32],
    w: &[f32],
    keys: &KvBlocks<'_, T>,
    seqs: &[SeqAttn<'_>],
    out: &mut TopK,
) {
    select_topk_with(cpu::tier(), p, q, w, keys, seqs, out)
}

/// [`select_topk`] over keys whose element type is chosen at run time (a
/// pool's buffer; `keys.v` is `None`), on the start-up tier.
pub fn select_topk_dyn(
    p: &IndexerParams,
    q: &[f32],
    w: &[f32],
    keys: &KvLayer<'_>,
    seqs: &[SeqAttn<'_>],
    out: &mut TopK,
) {
    select_topk_dyn_with(cpu::tier(), p, q, w, keys, seqs, out)
}

/// [`select_topk_dyn`] on a given tier.
pub fn select_topk_dyn_with(
    tier: SimdTier,
    p: &IndexerParams,
    q: &[f32],
    w: &[f32],
    keys: &KvLayer<'_>,
    seqs: &[SeqAttn<'_>],
    out: &mut TopK,
) {
    kv::with_kv_elem!(keys.dtype(), T => {
        select_topk_with(tier, p, q, w, &keys.blocks::<T>(), seqs, out)
    })
}

/// [`select_topk`] on a given tier (lowered to one the CPU supports).
///
/// # Panics
/// If the slices or block tables disagree with `p` (a bug in the caller).
fn select_topk_with<T: KvElem>(
    tier: SimdTier,
    p: &IndexerParams,
    q: &[f32],
    w: &[f32],
    keys: &KvBlocks<'_, T>,
    seqs: &[SeqAttn<'_>],
    out: &mut TopK,
) {
    let (nh, hd, k) = (p.n_heads, p.head_dim, p.topk);
    assert!(nh > 0 && hd > 0 && k > 0 && keys.v.is_none());
    let n = q.len() / (nh * hd);
    assert_eq!(w.len(), n * nh);
    let n_blocks = keys.n_blocks(1, hd);
    for s in seqs {
        let len = s.pos0 + s.rows.len();
        assert!(s.rows.end <= n && s.table.len() * keys.block_size >= len);
        assert!(s.table[..len.div_ceil(keys.block_size)]
            .iter()
            .all(|&b| (b as usize) < n_blocks));
    }
    let tier = cpu::clamp(tier);
    out.reset(k, n);
    // The sparse tokens: (row, sequence, visible positions).
    let mut todo = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for (i, row) in s.rows.clone().enumerate() {
            let visible = s.pos0 + i + 1;
            if visible > k {
                out.sparse[row] = true;
                todo.push((row, si, visible));
            }
        }
    }
    if todo.is_empty() {
        return;
    }
    let total: usize = todo.iter().map(|t| t.2).sum();
    let wanted = pool::global().threads() * TASKS_PER_THREAD;
    let per_task = total
        .div_ceil(wanted)
        .max(MIN_TASK_KEYS)
        .next_multiple_of(KEY_TILE);
    TASKS.with_borrow_mut(|buf| {
        let Tasks {
            tasks,
            survivors,
            counts,
            merged,
            sorted,
        } = buf;
        tasks.clear();
        for (ti, &(_, _, visible)) in todo.iter().enumerate() {
            let mut a = 0;
            while a < visible {
                let b = (a + per_task).min(visible);
                tasks.push((ti, a, b));
                a = b;
            }
        }
        // Each task's survivors: at most k candidates at `task * k`.
        survivors.clear();
        survivors.resize(tasks.len() * k, Cand::default());
        counts.clear();
        counts.resize(tasks.len(), 0);
        {
            let cands = DisjointSlice::new(survivors);
            let lens = DisjointSlice::new(counts);
            let (tasks, todo) = (&*tasks, &todo);
            pool::global().run(tasks.len(), &|t| {
                let (ti, a, b) = tasks[t];
                let (row, si, _) = todo[ti];
                let s = &seqs[si];
                SCRATCH.with_borrow_mut(|(st, kt, idx, c)| {
                    let mut stream = Stream::new(c, k);
                    score_range(
                        tier,
                        p,
                        (&q[row * nh * hd..(row + 1) * nh * hd], &w[row * nh..]),
                        keys,
                        s.table,
                        a..b,
                        (st, kt, idx),
                        &mut stream,
                    );
                    stream.finish();
                    // SAFETY: task `t` alone writes survivors `t * k..(t + 1)
                    // * k` (it keeps at most k) and count `t`.
                    let (dst, len) =
                        unsafe { (cands.range(t * k..t * k + c.len()), lens.range(t..t + 1)) };
                    dst.copy_from_slice(c);
                    len[0] = c.len();
                });
            });
        }
        // Merge each token's tasks' survivors (tasks of a token are
        // consecutive), keep the best k, in ascending position order.
        let mut t = 0;
        for (ti, &(row, _, _)) in todo.iter().enumerate() {
            merged.clear();
            while t < tasks.len() && tasks[t].0 == ti {
                merged.extend_from_slice(&survivors[t * k..t * k + counts[t]]);
                t += 1;
            }
            prune(merged, k);
            sorted.clear();
            sorted.extend(merged.iter().map(|c| c.pos));
            sorted.sort_unstable();
            out.rows[row * k..(row + 1) * k].copy_from_slice(sorted);
        }
    });
}

/// Scores positions `range` of one query token (its rows `q`, `[n_heads,
/// head_dim]`, and head weights `w`) into `stream`.
#[allow(clippy::too_many_arguments)] // one task's operands, unpacked
fn score_range<T: KvElem>(
    tier: SimdTier,
    p: &IndexerParams,
    (q, w): (&[f32], &[f32]),
    keys: &KvBlocks<'_, T>,
    table: &[u32],
    range: std::ops::Range<usize>,
    (st, kt, idx): (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>),
    stream: &mut Stream<'_>,
) {
    let (nh, hd) = (p.n_heads, p.head_dim);
    st.resize(nh * KEY_TILE, 0.0);
    kt.resize(KEY_TILE * hd, 0.0);
    idx.resize(KEY_TILE, 0.0);
    let qrow = |h: usize| &q[h * hd..(h + 1) * hd];
    // The indexer's keys: one head, no values.
    let at = HeadRows {
        table,
        n_kv_heads: 1,
        dims: (hd, hd),
        h: 0,
    };
    let mut j0 = range.start;
    while j0 < range.end {
        let tk = KEY_TILE.min(range.end - j0);
        keys.widen_tile(tier, &at, (j0, tk), (kt, &mut []));
        let rows = RowSet::strided(&kt[..], hd, tk, hd);
        scores(tier, (nh, qrow), (rows, &[]), (st, KEY_TILE));
        combine_heads(p.scale, &st[..], &w[..nh], &mut idx[..tk]);
        for (jj, &score) in idx[..tk].iter().enumerate() {
            stream.push(Cand {
                score: score + 0.0,
                pos: (j0 + jj) as u32,
            });
        }
        j0 += tk;
    }
}

/// `idx[j] = Σ_h w[h] · max(scale · s[h][j], 0)` over a tile's scores
/// (`s` rows of [`KEY_TILE`]), heads summed in order.
fn combine_heads(scale: f32, s: &[f32], w: &[f32], idx: &mut [f32]) {
    idx.fill(0.0);
    for (h, &wh) in w.iter().enumerate() {
        let row = &s[h * KEY_TILE..h * KEY_TILE + idx.len()];
        for (o, &x) in idx.iter_mut().zip(row) {
            *o += wh * (scale * x).max(0.0);
        }
    }
}

/// The scalar reference: every visible position's index score in f64 for
/// one query token at `pos` (`q` `[n_heads, head_dim]`, `w` `[n_heads]`,
/// `keys` `[≥ pos + 1, head_dim]`).
pub fn index_scores_ref(
    p: &IndexerParams,
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    pos: usize,
) -> Vec<f64> {
    let hd = p.head_dim;
    (0..=pos)
        .map(|j| {
            let k = &keys[j * hd..(j + 1) * hd];
            (0..p.n_heads)
                .map(|h| {
                    let d: f64 = q[h * hd..(h + 1) * hd]
                        .iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    w[h] as f64 * (p.scale as f64 * d).max(0.0)
                })
                .sum()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fits, rand_vec, Store};
    use super::super::KvDType;
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Checks `got` is a top-k of `scores`: every chosen score at least the
    /// k-th best and every other at most it, within `tol` (f32 scoring
    /// against the f64 reference can swap near-ties; nothing else).
    fn assert_topk(scores: &[f64], k: usize, got: &[u32], tol: f64, what: &str) {
        assert_eq!(got.len(), k, "{what}");
        assert!(got.windows(2).all(|w| w[0] < w[1]), "{what}: not ascending");
        let mut sorted: Vec<f64> = scores.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        let chosen: std::collections::HashSet<u32> = got.iter().copied().collect();
        for (j, &s) in scores.iter().enumerate() {
            match chosen.contains(&(j as u32)) {
                true => assert!(s >= kth - tol, "{what}: chose {j} ({s} < {kth})"),
                false => assert!(s <= kth + tol, "{what}: left {j} ({s} > {kth})"),
            }
        }
    }

    type Case = (usize, usize, usize, usize, Vec<(usize, usize)>);
    /// Per sequence: (query tokens, earlier positions).
    type Shape<'a> = &'a [(usize, usize)];

    fn cases() -> Vec<Case> {
        // (heads, head dim, top-k, block size, per sequence (tokens, past)).
        vec![
            (4, 16, 4, 5, vec![(9, 0)]),
            (3, 7, 8, 16, vec![(1, 40), (5, 2), (12, 0)]),
            (8, 32, 16, 32, vec![(1, 3000)]),
            (5, 24, 64, 1024, vec![(2, 5000), (1, 63), (1, 64)]),
            (2, 8, 1, 4, vec![(6, 3)]),
            // Whole 32-value blocks: every cache type, 8-bit keys included.
            (6, 64, 12, 16, vec![(3, 900), (20, 0)]),
        ]
    }

    /// Selections on every tier, for f32 and f16 keys, against the f64
    /// reference: dense tokens reported dense, sparse ones a top-k of the
    /// reference scores (near-ties within 1e-4 of the score scale).
    #[test]
    fn every_tier_selects_a_reference_topk() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for (case, (nh, hd, k, bs, shape)) in cases().into_iter().enumerate() {
            let p = IndexerParams {
                n_heads: nh,
                head_dim: hd,
                topk: k,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let keys: Vec<(Vec<f32>, Vec<f32>)> = shape
                .iter()
                .map(|&(n, past)| (rand_vec(&mut rng, (n + past) * hd), vec![]))
                .collect();
            let n_tok: usize = shape.iter().map(|s| s.0).sum();
            let q = rand_vec(&mut rng, n_tok * nh * hd);
            let w = rand_vec(&mut rng, n_tok * nh);
            for dtype in KvDType::ALL
                .into_iter()
                .filter(|&d| fits(d, (hd, hd), true))
            {
                let store = Store::new(&mut rng, dtype, &keys, 1, (hd, 1), bs, true);
                for tier in cpu::available_tiers() {
                    let ops = (&p, &q[..], &w[..], &shape[..]);
                    check_store(tier, ops, &store, &format!("{tier} {dtype} case {case}"));
                }
            }
        }
    }

    /// One store's selections against the reference (see above).
    fn check_store(
        tier: SimdTier,
        (p, q, w, shape): (&IndexerParams, &[f32], &[f32], Shape<'_>),
        store: &Store,
        what: &str,
    ) {
        let (nh, hd, k) = (p.n_heads, p.head_dim, p.topk);
        let seqs = store.seqs(shape);
        let mut out = TopK::default();
        select_topk_dyn_with(tier, p, q, w, &store.layer(), &seqs, &mut out);
        for (s, (keys, _)) in seqs.iter().zip(&store.rounded) {
            for (i, row) in s.rows.clone().enumerate() {
                let pos = s.pos0 + i;
                let what = format!("{what} pos {pos}");
                let qr = &q[row * nh * hd..(row + 1) * nh * hd];
                let scores = index_scores_ref(p, qr, &w[row * nh..], keys, pos);
                match out.get(row) {
                    None => assert!(pos < k, "{what}: dense"),
                    Some(got) => {
                        let scale = scores.iter().fold(1.0f64, |m, s| m.max(s.abs()));
                        assert_topk(&scores, k, got, 1e-4 * scale, &what);
                    }
                }
            }
        }
    }

    /// A token's selection is the same alone, behind another sequence, in
    /// chunks, and one token at a time (the key split changes with each).
    #[test]
    fn selection_does_not_depend_on_the_batch() {
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        let (nh, hd, k) = (4, 16, 32);
        let p = IndexerParams {
            n_heads: nh,
            head_dim: hd,
            topk: k,
            scale: 0.25,
        };
        let (past, n) = (2500, 40);
        let keys = vec![
            (rand_vec(&mut rng, (past + n) * hd), vec![]),
            (rand_vec(&mut rng, 4000 * hd), vec![]),
        ];
        let store = Store::new(&mut rng, KvDType::F16, &keys, 1, (hd, 1), 16, true);
        let q = rand_vec(&mut rng, n * nh * hd);
        let w = rand_vec(&mut rng, n * nh);
        let (qo, wo) = (rand_vec(&mut rng, 2 * nh * hd), rand_vec(&mut rng, 2 * nh));
        for tier in cpu::available_tiers() {
            let run = |a: usize, b: usize, crowd: bool| -> Vec<Vec<u32>> {
                let (mut qs, mut ws, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
                if crowd {
                    qs.extend_from_slice(&qo);
                    ws.extend_from_slice(&wo);
                    seqs.push(SeqAttn {
                        rows: 0..2,
                        pos0: 3998,
                        table: &store.tables[1],
                    });
                }
                let r0 = ws.len() / nh;
                qs.extend_from_slice(&q[a * nh * hd..b * nh * hd]);
                ws.extend_from_slice(&w[a * nh..b * nh]);
                seqs.push(SeqAttn {
                    rows: r0..r0 + b - a,
                    pos0: past + a,
                    table: &store.tables[0],
                });
                let mut out = TopK::default();
                select_topk_dyn_with(tier, &p, &qs, &ws, &store.layer(), &seqs, &mut out);
                (r0..r0 + b - a)
                    .map(|r| out.get(r).expect("sparse").to_vec())
                    .collect()
            };
            let alone = run(0, n, false);
            assert_eq!(alone, run(0, n, true), "{tier}: crowded");
            let mut one = Vec::new();
            for t in 0..n {
                one.extend(run(t, t + 1, t % 3 == 0));
            }
            assert_eq!(alone, one, "{tier}: one at a time");
        }
    }

    /// Equal scores go to the earlier positions: a zero query scores every
    /// key 0, so the first k positions win; ReLU zeroes make ties too.
    #[test]
    fn ties_go_to_earlier_positions() {
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        let (nh, hd, k, len) = (2, 8, 5, 300);
        let p = IndexerParams {
            n_heads: nh,
            head_dim: hd,
            topk: k,
            scale: 1.0,
        };
        let keys = vec![(rand_vec(&mut rng, len * hd), vec![])];
        let store = Store::new(&mut rng, KvDType::F32, &keys, 1, (hd, 1), 8, true);
        let seqs = [SeqAttn {
            rows: 0..1,
            pos0: len - 1,
            table: &store.tables[0],
        }];
        for tier in cpu::available_tiers() {
            let mut out = TopK::default();
            let q = vec![0f32; nh * hd];
            let w: Vec<f32> = (0..nh).map(|_| rng.random_range(-1.0..1.0)).collect();
            select_topk_dyn_with(tier, &p, &q, &w, &store.layer(), &seqs, &mut out);
            assert_eq!(out.get(0), Some(&[0, 1, 2, 3, 4][..]), "{tier}");
        }
    }
}
