//! One work item of attention: a few query rows that share a KV head,
//! streamed over one partition of keys in tiles with the online softmax.
//!
//! The rows are the heads of one GQA group for a few consecutive tokens,
//! so each key and value row is read once per tile for all of them (a
//! 4-key × 3-row dot tile loads every element once), and the per-row work
//! on a tile is vectorized over its keys: scale and mask, one shifted
//! exponential pass, one rescale of the accumulator when the running
//! maximum moves, and a probability-weighted sum of the value rows.
//!
//! **Batch invariance.** A row's result depends only on the row (its
//! query, position and window) and its sequence's keys, never on which
//! other rows, tokens or sequences share the call, nor on the thread
//! count: tiles start at absolute multiples of [`KEY_TILE`], partitions at
//! multiples of [`PARTITION`], every score is one canonical per-pair dot
//! product, each row's tile is cut at its own last visible key, and
//! partitions are folded left to right by [`fold`] whether they ran in one
//! task or in several. So a request decodes the same tokens alone, in a
//! batch of 64, after a chunked prefill or after a prefix-cache hit.

use super::kv::{KvBlocks, KvElem};
use super::AttnParams;
use crate::cpu::SimdTier;
use crate::dot::dot_keys_f32_with;
use crate::vecops;
use std::ops::Range;

/// Keys per tile: the tile's scores stay in L1 next to the accumulators.
pub(super) const KEY_TILE: usize = 32;

/// Keys per partition: the unit of the key split (flash-decoding). Fixed,
/// so that splitting never changes the arithmetic; small enough that a
/// decode step at a few hundred positions still has work for every thread,
/// large enough that the per-partition fold (one exp and one pass over the
/// accumulator per row) is ~1% of the partition's work.
pub(super) const PARTITION: usize = 128;

/// Query rows `tokens t0..t0+tq` × `heads h0..h0+hs` (all of KV head `kvh`)
/// of one sequence; row `r` is token `t0 + r / hs`, head `h0 + r % hs`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Item {
    pub kvh: usize,
    pub h0: usize,
    pub hs: usize,
    pub t0: usize,
    pub tq: usize,
}

impl Item {
    pub fn rows(&self) -> usize {
        self.tq * self.hs
    }

    /// (token, head) of row `r`, the token relative to its sequence.
    pub fn row(&self, r: usize) -> (usize, usize) {
        (self.t0 + r / self.hs, self.h0 + r % self.hs)
    }
}

/// One sequence's operands: its queries (`[n, n_heads * head_dim]`), the
/// position of the first, and its keys and values.
pub(super) struct SeqOperands<'a, T> {
    pub q: &'a [f32],
    pub pos0: usize,
    pub kv: &'a KvBlocks<'a, T>,
    pub table: &'a [u32],
}

impl<T> SeqOperands<'_, T> {
    /// Keys row `r` of `it` may see.
    fn row_keys(&self, p: &AttnParams, it: &Item, r: usize) -> Range<usize> {
        p.key_range(self.pos0 + it.row(r).0)
    }

    /// The partitions that hold keys some row of `it` sees.
    pub fn partitions(&self, p: &AttnParams, it: &Item) -> Range<usize> {
        let lo = (0..it.rows())
            .map(|r| self.row_keys(p, it, r).start)
            .min()
            .unwrap_or(0);
        let hi = (0..it.rows())
            .map(|r| self.row_keys(p, it, r).end)
            .max()
            .unwrap_or(0);
        lo / PARTITION..hi.div_ceil(PARTITION)
    }
}

/// The softmax state of some rows: running maximum, denominator relative
/// to it, and the unnormalised weighted value sums (`rows × v_dim`).
#[derive(Default)]
pub(super) struct Partial {
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub acc: Vec<f32>,
}

impl Partial {
    pub fn reset(&mut self, rows: usize, vd: usize) {
        self.m.clear();
        self.m.resize(rows, f32::NEG_INFINITY);
        self.l.clear();
        self.l.resize(rows, 0.0);
        self.acc.clear();
        self.acc.resize(rows * vd, 0.0);
    }
}

/// Scratch of one running item: the partition being computed and the
/// tile buffers.
#[derive(Default)]
pub(super) struct State {
    pub part: Partial,
    /// Scores of the current tile, `rows × KEY_TILE`.
    pub s: Vec<f32>,
    /// The tile's keys and (stored) values widened to f32, `KEY_TILE ×
    /// head_dim` and `KEY_TILE × v_dim`.
    pub kt: Vec<f32>,
    pub vt: Vec<f32>,
    /// Each row's cut of the current tile (0: the row sees none of it).
    pub lens: Vec<usize>,
}

/// Where a partition's key and value tiles come from.
#[derive(Clone, Copy)]
pub(super) enum Tiles<'a> {
    /// Widened from the cache tile by tile into the state's buffers (an
    /// item alone on its KV head, as in decode; for heads of 256 the two
    /// f32 tiles are 64 KiB, past a 32 KiB L1).
    Cache,
    /// Already widened once for every item of a sweep (`super::run_sweep`):
    /// keys (rows of `head_dim`) and stored values (rows of `v_dim`) from
    /// position `at` on.
    Widened {
        at: usize,
        k: &'a [f32],
        v: &'a [f32],
    },
}

/// Runs `it`'s rows over the keys of partition `part` (intersected with
/// each row's causal / sliding-window range), leaving the state in `st.part`.
pub(super) fn run_partition<T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    seq: &SeqOperands<'_, T>,
    it: &Item,
    (part, tiles): (usize, Tiles<'_>),
    st: &mut State,
) {
    let (hd, vd) = (p.head_dim, p.v_dim);
    let n_rows = it.rows();
    st.part.reset(n_rows, vd);
    st.s.resize(n_rows * KEY_TILE, 0.0);
    if let Tiles::Cache = tiles {
        st.kt.resize(KEY_TILE * hd, 0.0);
        if seq.kv.v.is_some() {
            st.vt.resize(KEY_TILE * vd, 0.0);
        }
    }
    let keys = part * PARTITION..(part + 1) * PARTITION;
    let row_keys = |r: usize| {
        let kr = seq.row_keys(p, it, r);
        kr.start.max(keys.start)..kr.end.min(keys.end)
    };
    let lo = (0..n_rows).map(|r| row_keys(r).start).min().unwrap_or(0);
    let hi = (0..n_rows).map(|r| row_keys(r).end).max().unwrap_or(0);
    let qrow = |r: usize| {
        let (t, h) = it.row(r);
        &seq.q[(t * p.n_heads + h) * hd..][..hd]
    };
    // Tiles start at absolute multiples of KEY_TILE (see the module doc).
    let mut j0 = lo / KEY_TILE * KEY_TILE;
    while j0 < hi {
        let tk = KEY_TILE.min(hi - j0);
        let (kt, vt): (&[f32], &[f32]) = match tiles {
            Tiles::Cache => {
                seq.kv.widen_tile(
                    tier,
                    seq.table,
                    p.n_kv_heads,
                    (hd, vd),
                    it.kvh,
                    j0,
                    tk,
                    &mut st.kt,
                    &mut st.vt,
                );
                (&st.kt, &st.vt)
            }
            Tiles::Widened { at, k, v } => {
                let v = if seq.kv.v.is_some() {
                    &v[(j0 - at) * vd..]
                } else {
                    &[]
                };
                (&k[(j0 - at) * hd..], v)
            }
        };
        scores(tier, n_rows, &qrow, (kt, hd), tk, &mut st.s);
        st.lens.clear();
        for r in 0..n_rows {
            let rk = row_keys(r);
            // The row's own cut of the tile: up to its last visible key.
            let len = rk.end.min(j0 + tk).saturating_sub(j0);
            if len == 0 || rk.start >= j0 + len {
                st.lens.push(0);
                continue;
            }
            st.lens.push(len);
            let s = &mut st.s[r * KEY_TILE..r * KEY_TILE + len];
            let tile_max = if rk.start <= j0 {
                vecops::scale_max(tier, p.scale, s)
            } else {
                let mut m = f32::NEG_INFINITY;
                for (j, x) in (j0..).zip(s.iter_mut()) {
                    if j >= rk.start {
                        *x *= p.scale;
                        m = m.max(*x);
                    } else {
                        *x = f32::NEG_INFINITY;
                    }
                }
                m
            };
            absorb_scores(tier, s, tile_max, &mut st.part, r, vd);
        }
        // Latent attention reads its values from the key rows.
        let values = match seq.kv.v {
            Some(_) => (vt, vd),
            None => (kt, hd),
        };
        weigh_values(tier, (&st.s, &st.lens), values, &mut st.part, vd);
        j0 += tk;
    }
}

/// Folds one tile into row `r` of `part`: `s` holds the row's scaled
/// scores of the tile's first `s.len()` keys (`-inf` where masked), whose
/// largest is `tile_max`, and `values` the tile's value rows (`stride`
/// apart, the first `vd` of each). Rescales what was accumulated when the
/// running maximum moves, then adds the tile's exponentials and weighted
/// values: the one update every attention kernel here shares.
pub(super) fn absorb_tile(
    tier: SimdTier,
    s: &mut [f32],
    tile_max: f32,
    (values, stride): (&[f32], usize),
    part: &mut Partial,
    r: usize,
    vd: usize,
) {
    absorb_scores(tier, s, tile_max, part, r, vd);
    let acc = &mut part.acc[r * vd..(r + 1) * vd];
    vecops::weighted_rows(tier, s, values, 0, stride, acc);
}

/// The first half of [`absorb_tile`]: the rescale, and the tile's
/// exponentials left in `s` for [`weigh_values`] to add.
fn absorb_scores(
    tier: SimdTier,
    s: &mut [f32],
    tile_max: f32,
    part: &mut Partial,
    r: usize,
    vd: usize,
) {
    let acc = &mut part.acc[r * vd..(r + 1) * vd];
    let m_old = part.m[r];
    let m_new = m_old.max(tile_max);
    if m_new > m_old && m_old != f32::NEG_INFINITY {
        // Rescale what was accumulated under the old maximum.
        let c = (m_old - m_new).exp();
        part.l[r] *= c;
        vecops::scale(tier, c, acc);
    }
    part.m[r] = m_new;
    part.l[r] += vecops::exp_shifted(tier, s, m_new);
}

/// The second half of [`absorb_tile`] for every row of a tile: row `r`
/// adds its first `lens[r]` probabilities (`s`, rows of [`KEY_TILE`])
/// times the value rows into its accumulator (nothing where `lens[r]` is
/// 0). Runs of rows with the same cut go through one
/// [`vecops::weighted_rows_group`] call, which shares each value-row load
/// among them and leaves every row's bits as alone: the heads of a token
/// always share a cut, and away from the chunk's diagonal all rows do.
fn weigh_values(
    tier: SimdTier,
    (s, lens): (&[f32], &[usize]),
    (values, stride): (&[f32], usize),
    part: &mut Partial,
    vd: usize,
) {
    let mut r = 0;
    while r < lens.len() {
        let len = lens[r];
        let n = lens[r..].iter().take_while(|&&l| l == len).count();
        if len > 0 {
            vecops::weighted_rows_group(
                tier,
                (&s[r * KEY_TILE..], KEY_TILE, len),
                values,
                stride,
                &mut part.acc[r * vd..(r + n) * vd],
                vd,
            );
        }
        r += n;
    }
}

/// Folds partition state `b` (one row: max, denominator, sums) into the
/// running state `a`, rescaling both to their common maximum. Both the
/// one-task and the split paths fold partitions left to right through
/// this one function, so they round identically.
pub(super) fn fold(
    a_m: &mut f32,
    a_l: &mut f32,
    a_acc: &mut [f32],
    b_m: f32,
    b_l: f32,
    b_acc: &[f32],
) {
    if b_m == f32::NEG_INFINITY {
        return;
    }
    if *a_m == f32::NEG_INFINITY {
        *a_m = b_m;
        *a_l = b_l;
        a_acc.copy_from_slice(b_acc);
        return;
    }
    let m = a_m.max(b_m);
    let (ca, cb) = ((*a_m - m).exp(), (b_m - m).exp());
    *a_m = m;
    *a_l = *a_l * ca + b_l * cb;
    for (a, &b) in a_acc.iter_mut().zip(b_acc) {
        *a = *a * ca + b * cb;
    }
}

/// `s[r * KEY_TILE + jj] = q_r · k_jj` for the tile's `tk` keys (`kt`,
/// rows of `hd`). Every pair goes through the same 4-key dot tile (one
/// accumulator per pair), whatever the row and key counts: a short last
/// group repeats its last key, odd rows use a narrower tile. That makes
/// each score independent of its neighbours (batch invariance). The
/// scores are written in place, three rows at a time (through a copy of
/// each tile's results, this was a quarter of prefill attention's time at
/// depth 4096: stores forwarded to mismatched loads).
pub(super) fn scores<'a>(
    tier: SimdTier,
    n_rows: usize,
    qrow: &impl Fn(usize) -> &'a [f32],
    (kt, hd): (&[f32], usize),
    tk: usize,
    s: &mut [f32],
) {
    let keys = &kt[..tk * hd];
    let mut r = 0;
    while r < n_rows {
        let out = &mut s[r * KEY_TILE..];
        match n_rows - r {
            1 => dot_keys_f32_with(tier, keys, tk, [qrow(r)], out, KEY_TILE),
            2 => dot_keys_f32_with(tier, keys, tk, [qrow(r), qrow(r + 1)], out, KEY_TILE),
            _ => dot_keys_f32_with(
                tier,
                keys,
                tk,
                [qrow(r), qrow(r + 1), qrow(r + 2)],
                out,
                KEY_TILE,
            ),
        }
        r += (n_rows - r).min(3);
    }
}
