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

use super::kv::{HeadRows, KvBlocks, KvElem};
use super::params::{AttnParams, MAX_ROWS};
use crate::cpu::SimdTier;
use crate::dot::dot_keys_with;
use crate::lanes::{Lanes, RowSet};
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

    /// Keys row `r` of `it` may see in partition `part` (empty if none).
    fn row_keys_in(&self, p: &AttnParams, it: &Item, r: usize, part: usize) -> Range<usize> {
        let kr = self.row_keys(p, it, r);
        kr.start.max(part * PARTITION)..kr.end.min((part + 1) * PARTITION)
    }

    /// The keys some row of `it` sees in partition `part` (empty if none).
    fn partition_keys(&self, p: &AttnParams, it: &Item, part: usize) -> Range<usize> {
        let row = |r: usize| self.row_keys_in(p, it, r, part);
        let lo = (0..it.rows()).map(|r| row(r).start).min().unwrap_or(0);
        let hi = (0..it.rows()).map(|r| row(r).end).max().unwrap_or(0);
        lo..hi
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
    /// head_dim` and `KEY_TILE × v_dim`, for the cache types attention
    /// cannot read as stored (the quantized blocks).
    pub kt: Vec<f32>,
    pub vt: Vec<f32>,
    /// Each row's cut of the current tile (0: the row sees none of it).
    pub lens: Vec<usize>,
}

/// Where a partition's key and value tiles come from.
#[derive(Clone, Copy)]
pub(super) enum Tiles<'a> {
    /// The cache itself (an item alone on its KV head, as in decode): f32,
    /// f16 and bf16 rows are read as stored, every value widened in
    /// registers where it is used; the quantized blocks are widened tile
    /// by tile into the state's buffers. Widening f16 tiles into buffers
    /// was half of a Gemma 3 decode step's attention at 32k positions
    /// (two 32 KiB f32 tiles written and read back per 32 keys).
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

/// The key rows and value rows of one tile (at most [`KEY_TILE`] each).
type TileRows<'a, E> = ([&'a [E]; KEY_TILE], [&'a [E]; KEY_TILE]);

/// The next tile's key and value rows (or none), prefetched while a tile runs.
type Ahead<'s, 'a, E> = (&'s [&'a [E]], &'s [&'a [E]]);

/// A tile's key and value rows.
type TileSet<'s, 'a, E> = (RowSet<'s, 'a, E>, RowSet<'s, 'a, E>);

/// The rows of `tk` keys from row `at` of widened f32 buffers (keys of
/// `hd` values, stored values of `vd`; `latent`: the values are the keys'
/// first `vd`).
fn widened_rows<'a>(
    (k, v): (&'a [f32], &'a [f32]),
    (hd, vd): (usize, usize),
    latent: bool,
    (at, tk): (usize, usize),
) -> TileSet<'a, 'a, f32> {
    let keys = &k[at * hd..];
    let values = match latent {
        true => RowSet::strided(keys, hd, tk, vd),
        false => RowSet::strided(&v[at * vd..], vd, tk, vd),
    };
    (RowSet::strided(keys, hd, tk, hd), values)
}

/// What every tile of one item's partition shares: its query rows and
/// each row's visible keys.
pub(super) struct Rows<'s, 'a> {
    pub q: &'s [&'a [f32]],
    /// Each row's visible keys `(start, end)`.
    pub keys: &'s [(usize, usize)],
}

impl Rows<'_, '_> {
    pub fn n(&self) -> usize {
        self.q.len()
    }
}

/// The keys of one tile read from the cache: a run of `len` positions
/// from `j0` (dense attention), or the selected positions of sparse
/// attention, all visible.
#[derive(Clone, Copy)]
pub(super) enum Keys<'a> {
    Run { j0: usize, len: usize },
    Picked(&'a [u32]),
}

impl Keys<'_> {
    fn len(self) -> usize {
        match self {
            Keys::Run { len, .. } => len,
            Keys::Picked(ps) => ps.len(),
        }
    }

    fn pos(self, i: usize) -> usize {
        match self {
            Keys::Run { j0, .. } => j0 + i,
            Keys::Picked(ps) => ps[i] as usize,
        }
    }

    /// The position each row's visible range is cut against
    /// ([`run_tile`]'s `j0`): the run's first; for picked keys 0, with
    /// rows that see every key.
    fn cut(self) -> usize {
        match self {
            Keys::Run { j0, .. } => j0,
            Keys::Picked(_) => 0,
        }
    }
}

/// Items of at most this many rows read f32, f16 and bf16 rows as stored
/// (see [`run_cached`]). The kernels widen a stored row once per group of
/// up to three rows, so a prompt item of 24 rows (the last items of a
/// chunk run alone, not in sweeps) would widen every key eight times:
/// that made prefill attention 10–15% slower than widening each tile
/// once (one thread, 128 tokens after 2048, SmolLM2's and Gemma 3's
/// shapes). Up to four rows (two groups) reading as stored is faster.
const STORED_ROWS: usize = 4;

/// Runs the rows over tiles of keys of KV head `kvh` read from the cache
/// (each tile's `Keys`), leaving the state in `st.part` (which the caller
/// has reset): for items of at most [`STORED_ROWS`] rows (decode) f32,
/// f16 and bf16 rows as stored, else (and for the block types) widened
/// tile by tile into `st.kt` and `st.vt`. `then`: the tile the caller
/// runs next (the next partition's first), prefetched during the last.
pub(super) fn run_cached<'k, T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    rows: &Rows<'_, '_>,
    (kv, table, kvh): (&KvBlocks<'_, T>, &[u32], usize),
    (tiles, then): (impl Iterator<Item = Keys<'k>>, Option<Keys<'k>>),
    st: &mut State,
) {
    let (hd, vd) = (p.head_dim, p.v_dim);
    let latent = kv.v.is_none();
    let State {
        part,
        s,
        kt,
        vt,
        lens,
    } = st;
    let mut state = (part, &mut s[..], lens);
    macro_rules! as_stored {
        ($($e:ty),*) => {$(
            if let Some(kv) = kv.cast::<$e>() {
                return run_stored(tier, p, rows, (&kv, table, kvh), (tiles, then), &mut state);
            }
        )*};
    }
    if rows.n() <= STORED_ROWS {
        as_stored!(half::f16, half::bf16, f32);
    }
    kt.resize(KEY_TILE * hd, 0.0);
    if !latent {
        vt.resize(KEY_TILE * vd, 0.0);
    }
    let _ = then; // widened tile by tile: nothing read ahead
    let at = HeadRows {
        table,
        n_kv_heads: p.n_kv_heads,
        dims: (hd, vd),
        h: kvh,
    };
    for keys in tiles {
        let tk = keys.len();
        match keys {
            Keys::Run { j0, len } => kv.widen_tile(tier, &at, (j0, len), (kt, vt)),
            Keys::Picked(ps) => kv.widen_rows(tier, &at, ps, (kt, vt)),
        }
        let t = widened_rows((kt, vt), (hd, vd), latent, (0, tk));
        run_tile(tier, p, rows, (keys.cut(), tk), (t, (&[], &[])), &mut state);
    }
}

/// [`run_cached`] for a cache whose units are values (f32, f16, bf16):
/// each tile's rows are read as stored, while the next tile's are
/// prefetched into L2 (see [`run_tile`]), the last tile prefetching
/// `then`'s. A decode step runs its partitions one after another, and
/// without `then` the first tile of each (one in four) started cold:
/// SmolLM2 Q8_0 decoding after 2048 positions read its cache at about 7
/// GB/s against 12 in L2.
fn run_stored<'k, E: KvElem + Lanes>(
    tier: SimdTier,
    p: &AttnParams,
    rows: &Rows<'_, '_>,
    (kv, table, kvh): (&KvBlocks<'_, E>, &[u32], usize),
    (tiles, then): (impl Iterator<Item = Keys<'k>>, Option<Keys<'k>>),
    state: &mut (&mut Partial, &mut [f32], &mut Vec<usize>),
) {
    let dims = (p.head_dim, p.v_dim);
    let mut bufs: [TileRows<'_, E>; 2] = [([&[]; KEY_TILE], [&[]; KEY_TILE]); 2];
    let mut tiles = tiles.peekable();
    if let Some(&first) = tiles.peek() {
        stored_rows(kv, (table, p.n_kv_heads, dims, kvh), first, &mut bufs[0]);
    }
    let mut cur = 0;
    while let Some(keys) = tiles.next() {
        let next = tiles.peek().copied().or(then);
        if let Some(next) = next {
            stored_rows(
                kv,
                (table, p.n_kv_heads, dims, kvh),
                next,
                &mut bufs[1 - cur],
            );
        }
        let (a, t, tk) = (&bufs[1 - cur], &bufs[cur], keys.len());
        let n = next.map_or(0, |k| k.len());
        let ahead = (&a.0[..n], &a.1[..n]);
        // SAFETY: `stored_rows` cut every key row to `head_dim` values and
        // every value row to `v_dim` (whole units of the cache's rows).
        let set = unsafe {
            (
                RowSet::gathered_unchecked(&t.0[..tk], p.head_dim),
                RowSet::gathered_unchecked(&t.1[..tk], p.v_dim),
            )
        };
        run_tile(tier, p, rows, (keys.cut(), tk), (set, ahead), state);
        cur = 1 - cur;
    }
}

/// The stored rows of `keys` into `t`, one contiguous run per block
/// crossed (for latent attention the values are the keys' first `v_dim`).
fn stored_rows<'a, E: KvElem>(
    kv: &KvBlocks<'a, E>,
    (table, n_kv_heads, (hd, vd), kvh): (&[u32], usize, (usize, usize), usize),
    keys: Keys<'_>,
    t: &mut TileRows<'a, E>,
) {
    let (ku, vu) = (hd / E::VALUES, vd / E::VALUES);
    let latent = kv.v.is_none();
    let mut i = 0;
    while i < keys.len() {
        let max = match keys {
            Keys::Run { len, .. } => len - i,
            Keys::Picked(_) => 1,
        };
        let (k, v, run) = kv.rows_from(table, n_kv_heads, (hd, vd), kvh, (keys.pos(i), max));
        let (tk, tv) = (&mut t.0[i..i + run], &mut t.1[i..i + run]);
        for (dst, key) in tk.iter_mut().zip(k.chunks_exact(ku)) {
            *dst = key;
        }
        match latent {
            true => {
                for (dst, key) in tv.iter_mut().zip(k.chunks_exact(ku)) {
                    *dst = &key[..vu];
                }
            }
            false => {
                for (dst, value) in tv.iter_mut().zip(v.chunks_exact(vu)) {
                    *dst = value;
                }
            }
        }
        i += run;
    }
}

/// Runs `it`'s rows over the keys of partition `part` (intersected with
/// each row's causal / sliding-window range), leaving the state in `st.part`.
pub(super) fn run_partition<T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    seq: &SeqOperands<'_, T>,
    it: &Item,
    (part, next, tiles): (usize, Option<usize>, Tiles<'_>),
    st: &mut State,
) {
    let (hd, vd) = (p.head_dim, p.v_dim);
    let n_rows = it.rows();
    st.part.reset(n_rows, vd);
    st.s.resize(n_rows * KEY_TILE, 0.0);
    let mut qs: [&[f32]; MAX_ROWS] = [&[]; MAX_ROWS];
    let mut ks = [(0, 0); MAX_ROWS];
    for r in 0..n_rows {
        let (t, h) = it.row(r);
        qs[r] = &seq.q[(t * p.n_heads + h) * hd..][..hd];
        let kr = seq.row_keys_in(p, it, r, part);
        ks[r] = (kr.start, kr.end);
    }
    let lo = ks[..n_rows].iter().map(|k| k.0).min().unwrap_or(0);
    let hi = ks[..n_rows].iter().map(|k| k.1).max().unwrap_or(0);
    let rows = Rows {
        q: &qs[..n_rows],
        keys: &ks[..n_rows],
    };
    let runs = tile_runs(lo..hi);
    match tiles {
        Tiles::Widened { at, k, v } => {
            let mut state = (&mut st.part, &mut st.s[..], &mut st.lens);
            for (j0, tk) in runs {
                let t = widened_rows((k, v), (hd, vd), seq.kv.v.is_none(), (j0 - at, tk));
                run_tile(tier, p, &rows, (j0, tk), (t, (&[], &[])), &mut state);
            }
        }
        Tiles::Cache => {
            let tiles = runs.map(|(j0, len)| Keys::Run { j0, len });
            // The next partition's first tile, as its own call will cut it.
            let then = next
                .map(|np| seq.partition_keys(p, it, np))
                .filter(|k| !k.is_empty())
                .and_then(|k| tile_runs(k).next())
                .map(|(j0, len)| Keys::Run { j0, len });
            run_cached(
                tier,
                p,
                &rows,
                (seq.kv, seq.table, it.kvh),
                (tiles, then),
                st,
            );
        }
    }
}

/// The tiles `(first key, keys)` over `keys`: tiles start at absolute
/// multiples of [`KEY_TILE`] (see the module doc), the last cut at the end.
fn tile_runs(keys: Range<usize>) -> impl Iterator<Item = (usize, usize)> {
    (keys.start / KEY_TILE * KEY_TILE..keys.end)
        .step_by(KEY_TILE)
        .map(move |j0| (j0, KEY_TILE.min(keys.end - j0)))
}

/// One tile of [`run_partition`]: the `tk` keys from `j0` (their key and
/// value rows) against every row, the online softmax, and the weighted
/// values, while the rows `ahead` (the next tile's keys and values, read
/// from DRAM) are prefetched into L2, a line for each line of the tile
/// read. A decode step streams its cache once, and the hardware prefetchers
/// lose rows read side by side: Gemma 3's global layer at 32k positions (32
/// MB of f16) took 4.8 / 6.0 / 6.1 ms without the prefetches, 3.8 / 4.8 /
/// 4.6 with them one tile ahead and 5.4 / 5.1 / 4.9 two tiles ahead (three
/// alternated rounds on a noisy Zen 3 VM, 2 threads); into L1
/// (`prefetcht0`) they evicted the tile being read (4.25 ms against 3.6).
///
/// Tried and dropped: kernels for few rows that read the rows two at a
/// time front to back (keys two at a time into `2·R` accumulators, values
/// with the accumulators in L1), the order a bare read streams fastest in
/// (11.6–11.9 GB/s on one thread, against 7.6–8.3 for four rows side by
/// side and 6.3–6.7 for the value tile's column blocks). A whole decode
/// step (`benches/attention.rs`, `decode step`, 2 threads, three
/// alternated rounds) was no faster: Gemma 3 8.8 / 7.5 / 8.6 GiB/s against
/// 7.9 / 6.8 / 7.4, SmolLM2 7.9 / 7.4 / 9.4 against 9.6 / 7.9 / 9.3. The
/// step is bound by its arithmetic per byte as much as by its reads (one
/// thread: 3.9 GiB/s for Gemma 3, where a bare read gets 12).
fn run_tile<E: Lanes>(
    tier: SimdTier,
    p: &AttnParams,
    rows: &Rows<'_, '_>,
    (j0, tk): (usize, usize),
    ((keys, values), ahead): (TileSet<'_, '_, E>, Ahead<'_, '_, E>),
    (part, s, lens): &mut (&mut Partial, &mut [f32], &mut Vec<usize>),
) {
    let vd = p.v_dim;
    scores(
        tier,
        (rows.n(), |r| rows.q[r]),
        (keys, ahead.0),
        (s, KEY_TILE),
    );
    lens.clear();
    for (r, &(start, end)) in rows.keys.iter().enumerate() {
        let rk = start..end;
        // The row's own cut of the tile: up to its last visible key.
        let len = rk.end.min(j0 + tk).saturating_sub(j0);
        if len == 0 || rk.start >= j0 + len {
            lens.push(0);
            continue;
        }
        lens.push(len);
        let s = &mut s[r * KEY_TILE..r * KEY_TILE + len];
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
        absorb_scores(tier, s, tile_max, part, r, vd);
    }
    weigh_values(tier, (s, lens), (values, ahead.1), part, vd);
}

/// Folds a tile's scores into row `r` of `part`: `s` holds the row's
/// scaled scores of the tile's first `s.len()` keys (`-inf` where masked),
/// whose largest is `tile_max`. Rescales what was accumulated when the
/// running maximum moves and leaves the tile's exponentials in `s` for
/// [`weigh_values`] to add: the one update every attention kernel here
/// shares.
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

/// The weighted values of [`absorb_scores`]' exponentials for every row of a tile: row `r`
/// adds its first `lens[r]` probabilities (`s`, rows of [`KEY_TILE`])
/// times the value rows into its accumulator (nothing where `lens[r]` is
/// 0). Runs of rows with the same cut go through one
/// [`vecops::weighted_rows_group`] call, which shares each value-row load
/// among them and leaves every row's bits as alone: the heads of a token
/// always share a cut, and away from the chunk's diagonal all rows do.
fn weigh_values<E: Lanes>(
    tier: SimdTier,
    (s, lens): (&[f32], &[usize]),
    (values, mut ahead): (RowSet<'_, '_, E>, &[&[E]]),
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
                (&s[r * KEY_TILE..], KEY_TILE),
                (values.head(len), ahead),
                &mut part.acc[r * vd..(r + n) * vd],
                vd,
            );
            ahead = &[];
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

/// `s[r * stride + jj] = q_r · k_jj` for the key rows `keys`
/// (f32, or f16 / bf16 as stored). Every pair goes through the same 4-key
/// dot tile (one accumulator per pair), whatever the row and key counts: a
/// short last group repeats its last key, odd rows use a narrower tile.
/// That makes each score independent of its neighbours (batch invariance).
/// The scores are written in place, up to three rows at a time (six on
/// AVX-512, whose 32 registers hold 24 accumulators), four rows as two and
/// two ([`vecops::rows_per_pass`]: each pass converts the keys again; a
/// lone row loads a key vector per FMA). Through a copy of each tile's results, this was a
/// quarter of prefill attention's time at depth 4096: stores forwarded to
/// mismatched loads.
pub(super) fn scores<'q, E: Lanes>(
    tier: SimdTier,
    (n_rows, qrow): (usize, impl Fn(usize) -> &'q [f32]),
    (keys, ahead): (RowSet<'_, '_, E>, &[&[E]]),
    (s, stride): (&mut [f32], usize),
) {
    let most = vecops::rows_per_tile(tier);
    let mut r = 0;
    while r < n_rows {
        let out = &mut s[r * stride..];
        let g = vecops::rows_per_pass(n_rows - r, most);
        // The first pass prefetches the rows ahead; later ones find them requested.
        let k = (keys, if r == 0 { ahead } else { &[] });
        let q = |i: usize| qrow(r + i);
        match g {
            1 => dot_keys_with(tier, k, [q(0)], out, stride),
            2 => dot_keys_with(tier, k, [q(0), q(1)], out, stride),
            3 => dot_keys_with(tier, k, [q(0), q(1), q(2)], out, stride),
            4 => dot_keys_with(tier, k, [q(0), q(1), q(2), q(3)], out, stride),
            5 => dot_keys_with(tier, k, [q(0), q(1), q(2), q(3), q(4)], out, stride),
            _ => dot_keys_with(tier, k, [q(0), q(1), q(2), q(3), q(4), q(5)], out, stride),
        }
        r += g;
    }
}
