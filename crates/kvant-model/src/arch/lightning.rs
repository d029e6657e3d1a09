//! DeepSeek-V4's lightning indexer (CSA layers): its own compressor of
//! keys (`index_head_dim` wide, overlapping windows like the attention's),
//! queries from the query latent (`wq_b`, rotated by the compressed rope)
//! and per-head weights (`weights_proj · heads^-½`). A query scores each
//! compressed entry it may see by `Σ_h w_h · relu(q_h · k) · dim^-½` and
//! attends to the best `topk`.
//!
//! Scoring is the cost that grows with the context (every entry, every
//! head, every query), so it runs as tiles: four entries against up to
//! four queries of a sequence per [`dot_tile_f32_with`] call, one head at
//! a time, the heads summed in order. Every (query, entry, head) product
//! is that tile's arithmetic whatever the tile holds, so a query's scores
//! do not depend on its neighbours in the chunk, the chunk's length or
//! the split over the pool. Work items are (block of four queries, 256
//! entries), so a decode step's one query also spreads over the pool.

use super::compressor::Compressor;
use super::loader::Loader;
use crate::kv::Entries;
use crate::ModelError;
use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::dot::dot_tile_f32_with;
use kvant_kernels::linear::LinearWeight;
use kvant_kernels::pool::for_rows_mut_cost;

thread_local! {
    /// One pool task's (score, entry) pairs of a query, while it chooses.
    static RANKED: std::cell::RefCell<Vec<(f32, u32)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Queries per tile and scoring item.
const QB: usize = 4;
/// Entries per scoring item.
const EC: usize = 256;

pub(crate) struct Lightning {
    pub keys: Compressor,
    pub q_b: LinearWeight,
    pub weights: LinearWeight,
    pub heads: usize,
    pub dim: usize,
    pub topk: usize,
}

/// The indexer's buffers, reused across passes.
#[derive(Default)]
pub(crate) struct LightningScratch {
    /// One sequence's compressed keys, widened (`[count, dim]`).
    keys: Vec<f32>,
    /// Scores per item: `[query blocks][entry chunks][QB][EC]`.
    scores: Vec<f32>,
    /// Each query's chosen entries (`[n, kmax]`, best first).
    pub chosen: Vec<u32>,
}

/// A sequence's queries as the indexer sees them.
pub(crate) struct Queries<'a> {
    /// `[n, heads·dim]`, rotated; and the head weights `[n, heads]`.
    pub q: &'a [f32],
    pub w: &'a [f32],
    /// The position of the first, and how many.
    pub pos0: usize,
    pub n: usize,
}

impl Lightning {
    /// Loads the indexer by its names: `[kv, gate, ape, norm]` of its
    /// compressor, then `wq_b` and `weights_proj`.
    pub fn load(
        ld: &Loader<'_>,
        (compressor, q_b, weights): ([&str; 4], &str, &str),
        (rate, q_lora_rank, hidden): (usize, usize, usize),
        ix: crate::config::V4Indexer,
    ) -> Result<Self, ModelError> {
        Ok(Lightning {
            keys: Compressor::load(ld, compressor, (rate, ix.head_dim, true), hidden)?,
            q_b: ld.weight(q_b, ix.heads * ix.head_dim, q_lora_rank)?,
            weights: ld.exact_weight(weights, ix.heads, hidden)?,
            heads: ix.heads,
            dim: ix.head_dim,
            topk: ix.topk,
        })
    }

    pub fn byte_len(&self) -> usize {
        self.keys.byte_len() + self.q_b.byte_len() + self.weights.byte_len()
    }

    /// Each query's `min(topk, visible)` best entries into `s.chosen`
    /// (`[n, kmax]`, best first, ties to the earlier entry), where query
    /// `i` sees the first `(pos0 + i + 1) / rate` of the sequence's
    /// `count` entries (its keys in `store`'s layer `layer`).
    pub fn choose(
        &self,
        (store, layer, table): (&Entries<'_>, usize, &[u32]),
        qs: &Queries<'_>,
        (count, kmax): (usize, usize),
        s: &mut LightningScratch,
    ) {
        let (di, rate) = (self.dim, self.keys.rate());
        s.keys.clear();
        s.keys.resize(count * di, 0.0);
        for (w, e) in s.keys.chunks_exact_mut(di).enumerate() {
            store.load((layer, rate), table, (w, true), e);
        }
        s.chosen.clear();
        s.chosen.resize(qs.n * kmax, 0);
        if kmax == 0 {
            return;
        }
        let (blocks, chunks) = (qs.n.div_ceil(QB), count.div_ceil(EC));
        s.scores.clear();
        s.scores.resize(blocks * chunks * QB * EC, 0.0);
        let tier = cpu::tier();
        let keys = &s.keys[..];
        let cost = QB * EC * self.heads * di;
        for_rows_mut_cost(&mut s.scores, (QB * EC, cost), &|items, out| {
            for (item, o) in items.zip(out.chunks_exact_mut(QB * EC)) {
                let (b, c) = (item / chunks, item % chunks);
                let queries = b * QB..(b * QB + QB).min(qs.n);
                // The block's last query sees the most entries.
                let visible = (qs.pos0 + queries.end) / rate;
                let entries = c * EC..((c + 1) * EC).min(visible);
                self.score_tile(tier, (qs, queries), (keys, entries), o);
            }
        });
        let scores = &s.scores[..];
        for_rows_mut_cost(&mut s.chosen, (kmax, count), &|rows, out| {
            RANKED.with(|ranked| {
                let ranked = &mut *ranked.borrow_mut();
                for (i, out) in rows.zip(out.chunks_exact_mut(kmax)) {
                    let visible = (qs.pos0 + i + 1) / rate;
                    let (b, qi) = (i / QB, i % QB);
                    ranked.clear();
                    ranked.extend((0..visible).map(|e| {
                        let at = ((b * chunks + e / EC) * QB + qi) * EC + e % EC;
                        (scores[at], e as u32)
                    }));
                    let order =
                        |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
                    let keep = self.topk.min(visible);
                    if keep < ranked.len() {
                        ranked.select_nth_unstable_by(keep, order);
                        ranked.truncate(keep);
                    }
                    ranked.sort_unstable_by(order);
                    for (o, &(_, e)) in out.iter_mut().zip(ranked.iter()) {
                        *o = e;
                    }
                }
            })
        });
    }

    /// Scores of the entries `entries` for the queries `queries` into `o`
    /// (`[QB][EC]`, entry `e` at `e % EC`): tiles of four entries against
    /// the queries, head by head, summed in head order.
    fn score_tile(
        &self,
        tier: SimdTier,
        (qs, queries): (&Queries<'_>, std::ops::Range<usize>),
        (keys, entries): (&[f32], std::ops::Range<usize>),
        o: &mut [f32],
    ) {
        let (hi, di) = (self.heads, self.dim);
        let scale = (di as f32).powf(-0.5);
        let nq = queries.len();
        o.fill(0.0);
        let row = |e: usize| &keys[e * di..(e + 1) * di];
        let mut e = entries.start;
        while e < entries.end {
            // A short last group repeats its last entry (not stored).
            let last = entries.end - 1;
            let rows = [
                row(e),
                row((e + 1).min(last)),
                row((e + 2).min(last)),
                row((e + 3).min(last)),
            ];
            for h in 0..hi {
                let q = |t: usize| {
                    let r = queries.start + t.min(nq - 1);
                    &qs.q[(r * hi + h) * di..(r * hi + h + 1) * di]
                };
                let d: [[f32; QB]; 4] = match nq {
                    1 => dot_tile_f32_with::<1>(tier, rows, [q(0)]).map(|r| [r[0], 0.0, 0.0, 0.0]),
                    2 => dot_tile_f32_with::<2>(tier, rows, [q(0), q(1)])
                        .map(|r| [r[0], r[1], 0.0, 0.0]),
                    3 => dot_tile_f32_with::<3>(tier, rows, [q(0), q(1), q(2)])
                        .map(|r| [r[0], r[1], r[2], 0.0]),
                    _ => dot_tile_f32_with::<4>(tier, rows, [q(0), q(1), q(2), q(3)]),
                };
                for (j, dj) in d.iter().enumerate().take(entries.end - e) {
                    for (t, &v) in dj.iter().enumerate().take(nq) {
                        let w = qs.w[(queries.start + t) * hi + h];
                        o[t * EC + (e + j) % EC] += v.max(0.0) * scale * w;
                    }
                }
            }
            e += 4;
        }
    }
}
