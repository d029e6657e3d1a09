//! One work item of attention: a few query rows that share a KV head,
//! streamed over a range of keys in tiles with the online softmax.
//!
//! The rows are the heads of one GQA group for a few consecutive tokens,
//! so each key and value row is read once per tile for all of them (a
//! 4-key × 3-row dot tile loads every element once), and the per-row work
//! on a tile is vectorized over its keys: scale and mask, one shifted
//! exponential pass, one rescale of the accumulator when the running
//! maximum moves, and a probability-weighted sum of the value rows.

use super::kv::{KvElem, KvLayer};
use super::AttnParams;
use crate::cpu::SimdTier;
use crate::dot::{dot4_f32_with, dot_f32_with, dot_tile_f32_with};
use crate::vecops;
use std::ops::Range;

/// Keys per tile: the tile's scores stay in L1 next to the accumulators.
pub(super) const KEY_TILE: usize = 32;

/// Query rows `tokens t0..t0+tq` × `heads h0..h0+hs` (all of KV head `kvh`);
/// row `r` is token `t0 + r / hs`, head `h0 + r % hs`.
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

    /// (token, head) of row `r`.
    pub fn row(&self, r: usize) -> (usize, usize) {
        (self.t0 + r / self.hs, self.h0 + r % self.hs)
    }
}

/// The running softmax state of an item's rows over the keys seen so far.
#[derive(Default)]
pub(super) struct State {
    /// Running maximum score per row (`-inf` before any key).
    pub m: Vec<f32>,
    /// Running denominator per row, relative to `m`.
    pub l: Vec<f32>,
    /// Unnormalised weighted value sums, `rows × head_dim`.
    pub acc: Vec<f32>,
    /// Scores of the current tile, `rows × KEY_TILE`.
    s: Vec<f32>,
    /// The tile's keys and values widened to f32, `KEY_TILE × head_dim`.
    kt: Vec<f32>,
    vt: Vec<f32>,
}

impl State {
    fn reset(&mut self, rows: usize, hd: usize) {
        self.m.clear();
        self.m.resize(rows, f32::NEG_INFINITY);
        self.l.clear();
        self.l.resize(rows, 0.0);
        self.acc.clear();
        self.acc.resize(rows * hd, 0.0);
        self.s.resize(rows * KEY_TILE, 0.0);
        self.kt.resize(KEY_TILE * hd, 0.0);
        self.vt.resize(KEY_TILE * hd, 0.0);
    }
}

/// Runs `it`'s rows over the keys in `keys` (intersected with each row's
/// causal / sliding-window range), leaving the result in `st`.
#[allow(clippy::too_many_arguments)] // the attention call's operands, unpacked
pub(super) fn run<T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    q: &[f32],
    q_pos0: usize,
    kv: &KvLayer<'_, T>,
    it: &Item,
    keys: Range<usize>,
    st: &mut State,
) {
    let hd = p.head_dim;
    let n_rows = it.rows();
    st.reset(n_rows, hd);
    let row_keys = |r: usize| {
        let kr = p.key_range(q_pos0 + it.row(r).0);
        kr.start.max(keys.start)..kr.end.min(keys.end)
    };
    let lo = (0..n_rows).map(|r| row_keys(r).start).min().unwrap_or(0);
    let hi = (0..n_rows).map(|r| row_keys(r).end).max().unwrap_or(0);
    let qrow = |r: usize| {
        let (t, h) = it.row(r);
        &q[(t * p.n_heads + h) * hd..][..hd]
    };
    let mut j0 = lo;
    while j0 < hi {
        let tk = KEY_TILE.min(hi - j0);
        kv.widen_tile(hd, it.kvh, j0, tk, &mut st.kt, &mut st.vt);
        let kt = &st.kt;
        let krow = |jj: usize| &kt[jj * hd..(jj + 1) * hd];
        scores(tier, n_rows, &qrow, &krow, tk, &mut st.s);
        for r in 0..n_rows {
            let rk = row_keys(r);
            let s = &mut st.s[r * KEY_TILE..r * KEY_TILE + tk];
            let tile_max = if rk.start <= j0 && j0 + tk <= rk.end {
                // The whole tile is visible to this row (always, in decoding).
                vecops::scale_max(tier, p.scale, s)
            } else {
                let mut m = f32::NEG_INFINITY;
                for (j, x) in (j0..).zip(s.iter_mut()) {
                    if rk.contains(&j) {
                        *x *= p.scale;
                        m = m.max(*x);
                    } else {
                        *x = f32::NEG_INFINITY;
                    }
                }
                m
            };
            if tile_max == f32::NEG_INFINITY {
                continue;
            }
            let acc = &mut st.acc[r * hd..(r + 1) * hd];
            let m_old = st.m[r];
            let m_new = m_old.max(tile_max);
            if m_new > m_old && m_old != f32::NEG_INFINITY {
                // Rescale what was accumulated under the old maximum.
                let c = (m_old - m_new).exp();
                st.l[r] *= c;
                vecops::scale(tier, c, acc);
            }
            st.m[r] = m_new;
            st.l[r] += vecops::exp_shifted(tier, s, m_new);
            vecops::weighted_rows(tier, s, &st.vt, 0, hd, acc);
        }
        j0 += tk;
    }
}

/// `s[r * KEY_TILE + jj] = q_r · k_jj` for the tile's keys, in 4-key ×
/// 3-row dot tiles where they fit.
fn scores<'a, 'b>(
    tier: SimdTier,
    n_rows: usize,
    qrow: &impl Fn(usize) -> &'a [f32],
    krow: &impl Fn(usize) -> &'b [f32],
    tk: usize,
    s: &mut [f32],
) {
    let mut jj = 0;
    while jj + 4 <= tk {
        let ks = [krow(jj), krow(jj + 1), krow(jj + 2), krow(jj + 3)];
        let mut put = |r: usize, d: [f32; 4]| {
            s[r * KEY_TILE + jj..r * KEY_TILE + jj + 4].copy_from_slice(&d);
        };
        let mut r = 0;
        while r + 3 <= n_rows {
            let d = dot_tile_f32_with(tier, ks, [qrow(r), qrow(r + 1), qrow(r + 2)]);
            for t in 0..3 {
                put(r + t, d.map(|row| row[t]));
            }
            r += 3;
        }
        match n_rows - r {
            2 => {
                let d = dot_tile_f32_with(tier, ks, [qrow(r), qrow(r + 1)]);
                put(r, d.map(|row| row[0]));
                put(r + 1, d.map(|row| row[1]));
            }
            1 => put(r, dot4_f32_with(tier, ks, qrow(r))),
            _ => {}
        }
        jj += 4;
    }
    for jj in jj..tk {
        for r in 0..n_rows {
            s[r * KEY_TILE + jj] = dot_f32_with(tier, qrow(r), krow(jj));
        }
    }
}
