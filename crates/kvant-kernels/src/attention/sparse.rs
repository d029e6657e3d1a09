//! Attention over selected key positions: each query token of DeepSeek
//! sparse attention attends only to the `topk` positions its indexer chose
//! ([`super::indexer`]), gathered from the paged cache tile by tile.
//!
//! The arithmetic is the dense kernel's: the same 4-key dot tile per
//! (row, key) pair, the same online-softmax tile update
//! ([`super::rows::run_cached`]), over the selected positions in ascending
//! order in tiles of [`KEY_TILE`]. A token's result therefore depends only
//! on its query and its selected rows (batch invariance), and the work of
//! a token is `O(topk)` whatever the context.

use super::indexer::TopK;
use super::kv::{self, KvBlocks, KvElem, KvLayer};
use super::rows::{run_cached, Item, Keys, Rows, State, KEY_TILE, PARTITION};
use super::{execute, AttnParams, Planned, SeqAttn, MAX_ROWS, PLAN};
use crate::cpu::{self, SimdTier};
use crate::pool::DisjointSlice;

/// Attention of the query tokens that `sel` marks sparse, each over its
/// selected positions only, on the start-up tier; rows of other tokens in
/// `out` are left as they are. Shapes as [`super::attention`]; `p.window`
/// is not applied (the selection decides which keys a token sees).
pub fn sparse_attention<T: KvElem>(
    p: &AttnParams,
    q: &[f32],
    kv: &KvBlocks<'_, T>,
    seqs: &[SeqAttn<'_>],
    sel: &TopK,
    out: &mut [f32],
) {
    sparse_attention_with(cpu::tier(), p, q, kv, seqs, sel, out)
}

/// [`sparse_attention`] over a layer whose element type is chosen at run
/// time (a pool's buffers), on the start-up tier.
pub fn sparse_attention_dyn(
    p: &AttnParams,
    q: &[f32],
    kv: &KvLayer<'_>,
    seqs: &[SeqAttn<'_>],
    sel: &TopK,
    out: &mut [f32],
) {
    sparse_attention_dyn_with(cpu::tier(), p, q, kv, seqs, sel, out)
}

/// [`sparse_attention_dyn`] on a given tier.
pub fn sparse_attention_dyn_with(
    tier: SimdTier,
    p: &AttnParams,
    q: &[f32],
    kv: &KvLayer<'_>,
    seqs: &[SeqAttn<'_>],
    sel: &TopK,
    out: &mut [f32],
) {
    kv::with_kv_elem!(kv.dtype(), T => {
        sparse_attention_with(tier, p, q, &kv.blocks::<T>(), seqs, sel, out)
    })
}

/// [`sparse_attention`] on a given tier (lowered to one the CPU supports).
///
/// Work items are one token's heads of one KV head (at most `MAX_ROWS`);
/// an item's selected positions are cut into partitions of [`PARTITION`]
/// that run in one task or, for a decode step with too few items to
/// occupy the pool, across tasks, folded in order either way (as the
/// dense kernel does).
///
/// # Panics
/// If the slices, tables or selections disagree with `p` and `kv`, or a
/// token selected a position it cannot see (bugs in the caller).
pub fn sparse_attention_with<T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    q: &[f32],
    kv: &KvBlocks<'_, T>,
    seqs: &[SeqAttn<'_>],
    sel: &TopK,
    out: &mut [f32],
) {
    let (hd, vd) = (p.head_dim, p.v_dim);
    let group = p.n_heads / p.n_kv_heads.max(1);
    assert!(hd > 0 && vd > 0 && group > 0 && p.n_heads == group * p.n_kv_heads);
    let qd = p.n_heads * hd;
    let n = q.len() / qd;
    assert_eq!(n * p.n_heads * vd, out.len());
    assert_eq!(sel.n_tokens(), n);
    if kv.v.is_none() {
        assert!(vd <= hd, "latent values longer than the keys");
    }
    let tier = cpu::clamp(tier);
    PLAN.with_borrow_mut(|(plan, tasks)| {
        plan.clear();
        let mut off = 0;
        let hs = group.min(MAX_ROWS);
        for (si, s) in seqs.iter().enumerate() {
            for (i, row) in s.rows.clone().enumerate() {
                let Some(picked) = sel.get(row) else { continue };
                let pos = s.pos0 + i;
                assert!(picked.iter().all(|&j| (j as usize) <= pos), "a future key");
                let last = picked.last().map_or(0, |&j| j as usize);
                assert!(
                    s.table.len() * kv.block_size > last,
                    "block table too short"
                );
                for kvh in 0..p.n_kv_heads {
                    for h0 in (kvh * group..(kvh + 1) * group).step_by(hs) {
                        let item = Item {
                            kvh,
                            h0,
                            hs: hs.min((kvh + 1) * group - h0),
                            t0: i,
                            tq: 1,
                        };
                        let parts = picked.len().div_ceil(PARTITION);
                        plan.push(Planned {
                            seq: si,
                            item,
                            parts: (0, parts),
                            off,
                        });
                        off += parts * item.rows() * (2 + vd);
                    }
                }
            }
        }
        let out = DisjointSlice::new(out);
        let rows_of = |seq: usize| seqs[seq].rows.start;
        let run = |pl: &Planned, (part, _): (usize, _), st: &mut State, _: Option<&_>| {
            let s = &seqs[pl.seq];
            let row = s.rows.start + pl.item.t0;
            let picked = sel.get(row).unwrap_or(&[]);
            let picked = &picked[part * PARTITION..((part + 1) * PARTITION).min(picked.len())];
            run_partition(tier, p, (q, row), kv, s.table, &pl.item, picked, st);
        };
        execute(
            (plan, tasks, off),
            (p.n_heads, vd),
            &run,
            None,
            &rows_of,
            &out,
        );
    });
}

/// Runs `it`'s rows (heads of token `row` of the call) over the gathered
/// rows at `picked`, leaving the partition's state in `st.part`.
#[allow(clippy::too_many_arguments)] // one partition's operands, unpacked
fn run_partition<T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    (q, row): (&[f32], usize),
    kv: &KvBlocks<'_, T>,
    table: &[u32],
    it: &Item,
    picked: &[u32],
    st: &mut State,
) {
    let (hd, vd, hs) = (p.head_dim, p.v_dim, it.hs);
    let mut qs: [&[f32]; MAX_ROWS] = [&[]; MAX_ROWS];
    for (r, qr) in qs[..hs].iter_mut().enumerate() {
        *qr = &q[(row * p.n_heads + it.h0 + r) * hd..][..hd];
    }
    // Every selected key is visible to every head of the token.
    let every = [(0, usize::MAX); MAX_ROWS];
    let rows = Rows {
        q: &qs[..hs],
        keys: &every[..hs],
    };
    st.part.reset(hs, vd);
    st.s.resize(hs * KEY_TILE, 0.0);
    let tiles = picked.chunks(KEY_TILE).map(Keys::Picked);
    run_cached(tier, p, &rows, (kv, table, it.kvh), (tiles, None), st);
}

#[cfg(test)]
mod tests {
    use super::super::testing::{fits, params, rand_vec, random_kvs, Case, Store};
    use super::super::{attention_dyn_with, attention_ref, KvDType};
    use super::*;
    use rand::seq::index::sample;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// Online softmax in f32 over ≤ 64 keys: errors ~1e-6 (as the dense test).
    const TOL: f32 = 1e-5;

    /// The cases of the sparse kernel: their parameter is the top-k.
    fn cases() -> Vec<Case<usize>> {
        vec![
            (16, 1, (40, 32), true, 8, vec![(1, 300), (5, 2), (9, 20)]),
            (4, 1, (72, 64), true, 37, vec![(3, 100)]),
            (32, 1, (24, 16), true, 64, vec![(2, 129)]),
            (6, 3, (8, 8), false, 5, vec![(9, 13)]),
            (4, 2, (24, 16), false, 33, vec![(3, 40), (1, 7)]),
            // Whole 32-value blocks: every cache type (DeepSeek-V3's 576 is 18).
            (16, 1, (96, 64), true, 40, vec![(1, 300), (4, 41)]),
            (4, 2, (32, 32), false, 9, vec![(5, 30)]),
        ]
    }

    /// Random selections (positions ≤ the token's own) on every tier, for
    /// f32 and f16 caches: each sparse token against the f64 reference over
    /// its gathered rows; dense tokens' rows are left untouched.
    #[test]
    fn every_tier_matches_reference_on_gathered_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        for (case, (nh, n_kv, (hd, vd), latent, k, shape)) in cases().into_iter().enumerate() {
            let p = params((nh, n_kv), (hd, vd), 1.0 / (hd as f32).sqrt(), None);
            let kvs = random_kvs(&mut rng, &shape, n_kv, (hd, vd));
            let n_tok: usize = shape.iter().map(|s| s.0).sum();
            let q = rand_vec(&mut rng, n_tok * nh * hd);
            let mut picks = Vec::new();
            for &(n, past) in &shape {
                for i in 0..n {
                    let visible = past + i + 1;
                    picks.push((visible > k).then(|| {
                        let mut v: Vec<u32> = sample(&mut rng, visible, k)
                            .into_iter()
                            .map(|j| j as u32)
                            .collect();
                        v.sort_unstable();
                        v
                    }));
                }
            }
            let sel = TopK::from_rows(k, &picks);
            let bs = [1, 5, 16, 32][case % 4];
            for dtype in KvDType::ALL
                .into_iter()
                .filter(|&d| fits(d, (hd, vd), latent))
            {
                let store = Store::new(&mut rng, dtype, &kvs, n_kv, (hd, vd), bs, latent);
                for tier in cpu::available_tiers() {
                    let ops = (&p, &q[..], &shape[..], &sel);
                    check_store(tier, ops, &store, &format!("{tier} {dtype} case {case}"));
                }
            }
        }
    }

    fn check_store(
        tier: SimdTier,
        (p, q, shape, sel): (&AttnParams, &[f32], &[(usize, usize)], &TopK),
        store: &Store,
        what: &str,
    ) {
        let (nh, hd, vd, n_kv) = (p.n_heads, p.head_dim, p.v_dim, p.n_kv_heads);
        let seqs = store.seqs(shape);
        let n_tok: usize = shape.iter().map(|s| s.0).sum();
        let mut out = vec![f32::NAN; n_tok * nh * vd];
        sparse_attention_dyn_with(tier, p, q, &store.layer(), &seqs, sel, &mut out);
        for (s, (k, v)) in seqs.iter().zip(&store.rounded) {
            for row in s.rows.clone() {
                let got = &out[row * nh * vd..(row + 1) * nh * vd];
                let Some(picked) = sel.get(row) else {
                    assert!(got.iter().all(|x| x.is_nan()), "{what}: dense row written");
                    continue;
                };
                // The reference over the gathered rows, all visible.
                let gk: Vec<f32> = picked
                    .iter()
                    .flat_map(|&j| &k[j as usize * n_kv * hd..][..n_kv * hd])
                    .copied()
                    .collect();
                let gv: Vec<f32> = picked
                    .iter()
                    .flat_map(|&j| &v[j as usize * n_kv * vd..][..n_kv * vd])
                    .copied()
                    .collect();
                let qr = &q[row * nh * hd..(row + 1) * nh * hd];
                let want = attention_ref(p, qr, picked.len() - 1, &gk, &gv);
                for (a, b) in got.iter().zip(&want) {
                    assert!((a - b).abs() <= TOL, "{what} row {row}: {a} vs {b}");
                }
            }
        }
    }

    /// Selecting every visible position is dense attention: equal within
    /// rounding (the tiles are cut at other places).
    #[test]
    fn selecting_everything_is_dense_attention() {
        let mut rng = ChaCha8Rng::seed_from_u64(32);
        let (nh, hd, vd, past) = (8, 40, 32, 70);
        let p = params((nh, 1), (hd, vd), 0.2, None);
        let kv = vec![(rand_vec(&mut rng, (past + 1) * hd), vec![])];
        let store = Store::new(&mut rng, KvDType::F32, &kv, 1, (hd, vd), 16, true);
        let q = rand_vec(&mut rng, nh * hd);
        let seqs = [SeqAttn {
            rows: 0..1,
            pos0: past,
            table: &store.tables[0],
        }];
        let all: Vec<u32> = (0..=past as u32).collect();
        let sel = TopK::from_rows(past + 1, &[Some(all)]);
        for tier in cpu::available_tiers() {
            let mut dense = vec![0f32; nh * vd];
            attention_dyn_with(tier, &p, &q, &store.layer(), &seqs, &mut dense);
            let mut sparse = vec![0f32; nh * vd];
            sparse_attention_dyn_with(tier, &p, &q, &store.layer(), &seqs, &sel, &mut sparse);
            for (a, b) in dense.iter().zip(&sparse) {
                assert!((a - b).abs() <= TOL, "{tier}: {a} vs {b}");
            }
        }
    }

    /// A token's rows are bit for bit the same when its selection's
    /// partitions run spread over tasks (a lone decode step) and when they
    /// run in one task (among many tokens).
    #[test]
    fn results_do_not_depend_on_the_split() {
        let mut rng = ChaCha8Rng::seed_from_u64(33);
        let (nh, hd, vd, k, past, n) = (16, 64, 32, 700, 3000, 40);
        let p = params((nh, 1), (hd, vd), 0.2, None);
        let kv = vec![(rand_vec(&mut rng, (past + n) * hd), vec![])];
        let store = Store::new(&mut rng, KvDType::Q8_0, &kv, 1, (hd, vd), 16, true);
        let q = rand_vec(&mut rng, n * nh * hd);
        let picks: Vec<Option<Vec<u32>>> = (0..n)
            .map(|i| {
                let mut v: Vec<u32> = sample(&mut rng, past + i + 1, k)
                    .into_iter()
                    .map(|j| j as u32)
                    .collect();
                v.sort_unstable();
                Some(v)
            })
            .collect();
        for tier in cpu::available_tiers() {
            let all = TopK::from_rows(k, &picks);
            let seqs = [SeqAttn {
                rows: 0..n,
                pos0: past,
                table: &store.tables[0],
            }];
            let mut together = vec![0f32; n * nh * vd];
            sparse_attention_dyn_with(tier, &p, &q, &store.layer(), &seqs, &all, &mut together);
            for t in [0, 17, n - 1] {
                let one = TopK::from_rows(k, &picks[t..t + 1]);
                let seqs = [SeqAttn {
                    rows: 0..1,
                    pos0: past + t,
                    table: &store.tables[0],
                }];
                let mut alone = vec![0f32; nh * vd];
                let qt = &q[t * nh * hd..(t + 1) * nh * hd];
                sparse_attention_dyn_with(tier, &p, qt, &store.layer(), &seqs, &one, &mut alone);
                assert_eq!(
                    alone,
                    together[t * nh * vd..(t + 1) * nh * vd],
                    "{tier} token {t}"
                );
            }
        }
    }
}
