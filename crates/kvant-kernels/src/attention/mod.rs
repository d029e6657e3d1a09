//! Causal self-attention over a contiguous KV history: FlashAttention-style
//! tiles with the online softmax, GQA groups processed together, and the key
//! range split across threads (flash-decoding) when a call has too few
//! query rows to occupy the pool.
//!
//! Work items are a few query rows sharing one KV head (`rows`); each runs
//! over its keys in tiles, never materialising a score row. A decode step
//! has one item per KV head, fewer than the pool has threads, so the keys
//! are split into ranges whose partial states `(max, denominator, weighted
//! sum)` are merged afterwards, exactly as FlashDecoding does on a GPU.

mod kv;
mod reference;
mod rows;

pub use kv::{store_rows, KvElem, KvLayer};
pub use reference::attention_ref;

use crate::cpu::{self, SimdTier};
use crate::pool::{self, DisjointSlice};
use rows::{Item, State};
use std::cell::RefCell;

/// Shape and policy of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a query at position p sees keys in `(p - w, p]`.
    pub window: Option<usize>,
}

impl AttnParams {
    fn key_range(&self, pos: usize) -> std::ops::Range<usize> {
        let lo = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        lo..pos + 1
    }
}

/// Query rows per work item: a GQA group's heads times a few tokens, as
/// many as share each loaded (widened) key tile while the scores and
/// accumulators stay in L1.
const MAX_ROWS: usize = 24;

/// The fewest keys worth a split of their own.
const MIN_SPLIT_KEYS: usize = 128;

/// Work items wanted per pool thread, for balance (late rows see more keys).
const ITEMS_PER_THREAD: usize = 4;

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
    /// Partial states of split calls: per task `[m; R] [l; R] [acc; R·hd]`.
    static PARTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `q` is `[n_tokens, n_heads * head_dim]` for positions `q_pos0..q_pos0 + n_tokens`;
/// `kv` holds positions `0..kv.len` (including the query tokens' own keys);
/// `out` is shaped like `q`.
pub fn attention<T: KvElem>(
    p: &AttnParams,
    q: &[f32],
    q_pos0: usize,
    kv: &KvLayer<'_, T>,
    out: &mut [f32],
) {
    attention_with(cpu::tier(), p, q, q_pos0, kv, out)
}

/// [`attention`] on a given tier (lowered to one the CPU supports).
///
/// # Panics
/// If the slices disagree with `p` (a bug in the calling model code).
pub fn attention_with<T: KvElem>(
    tier: SimdTier,
    p: &AttnParams,
    q: &[f32],
    q_pos0: usize,
    kv: &KvLayer<'_, T>,
    out: &mut [f32],
) {
    let hd = p.head_dim;
    let group = p.n_heads / p.n_kv_heads.max(1);
    assert!(hd > 0 && group > 0 && p.n_heads == group * p.n_kv_heads);
    assert_eq!(q.len(), out.len());
    assert_eq!(kv.k.len(), p.n_kv_heads * kv.capacity * hd);
    assert_eq!(kv.v.len(), kv.k.len());
    assert!(kv.len <= kv.capacity);
    let n = q.len() / (p.n_heads * hd);
    let kv_len = kv.len;
    assert!(q_pos0 + n <= kv_len, "queries past the cached keys");
    if n == 0 {
        return;
    }
    let tier = cpu::clamp(tier);
    let hs = group.min(MAX_ROWS);
    let head_chunks = group.div_ceil(hs);
    let tq = (MAX_ROWS / hs).clamp(1, n);
    let token_blocks = n.div_ceil(tq);
    let items = p.n_kv_heads * head_chunks * token_blocks;
    let item = |i: usize| {
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
    };
    let threads = pool::global().threads();
    let wanted = threads * ITEMS_PER_THREAD;
    let splits = if items >= wanted {
        1
    } else {
        wanted.div_ceil(items).min(kv_len / MIN_SPLIT_KEYS).max(1)
    };
    let out = DisjointSlice::new(out);
    let write_row = |t: usize, h: usize, f: &mut dyn FnMut(&mut [f32])| {
        let o = (t * p.n_heads + h) * hd;
        // SAFETY: every (token, head) row belongs to exactly one item.
        f(unsafe { out.range(o..o + hd) });
    };
    if splits == 1 {
        pool::global().run(items, &|i| {
            let it = item(i);
            STATE.with_borrow_mut(|st| {
                rows::run(tier, p, q, q_pos0, kv, &it, 0..kv_len, st);
                for r in 0..it.rows() {
                    let (t, h) = it.row(r);
                    let (l, acc) = (st.l[r], &st.acc[r * hd..(r + 1) * hd]);
                    write_row(t, h, &mut |o| {
                        o.iter_mut().zip(acc).for_each(|(o, a)| *o = a / l);
                    });
                }
            });
        });
        return;
    }
    // Flash-decoding: split the keys, then merge the partial states.
    let stride = MAX_ROWS * (2 + hd);
    let span = kv_len.div_ceil(splits);
    PARTS.with_borrow_mut(|parts| {
        parts.resize(items * splits * stride, 0.0);
        let shared = DisjointSlice::new(parts);
        pool::global().run(items * splits, &|task| {
            let (it, sp) = (item(task / splits), task % splits);
            let keys = (sp * span).min(kv_len)..((sp + 1) * span).min(kv_len);
            // SAFETY: each task owns its own stride of the buffer.
            let part = unsafe { shared.range(task * stride..(task + 1) * stride) };
            STATE.with_borrow_mut(|st| {
                rows::run(tier, p, q, q_pos0, kv, &it, keys, st);
                let n_rows = it.rows();
                part[..n_rows].copy_from_slice(&st.m);
                part[MAX_ROWS..MAX_ROWS + n_rows].copy_from_slice(&st.l);
                part[2 * MAX_ROWS..2 * MAX_ROWS + n_rows * hd].copy_from_slice(&st.acc);
            });
        });
        let parts = &*parts;
        pool::global().run(items, &|i| {
            let it = item(i);
            let mine = &parts[i * splits * stride..(i + 1) * splits * stride];
            for r in 0..it.rows() {
                let (t, h) = it.row(r);
                write_row(t, h, &mut |o| merge(mine, stride, r, hd, o));
            }
        });
    });
}

/// Row `r` of an item from its splits' partial states: rescale each by
/// `e^(m_s - M)` to the common maximum `M`, then normalise.
fn merge(parts: &[f32], stride: usize, r: usize, hd: usize, out: &mut [f32]) {
    let m_all = parts
        .chunks_exact(stride)
        .map(|s| s[r])
        .fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut l_all = 0f32;
    for s in parts.chunks_exact(stride) {
        if s[r] == f32::NEG_INFINITY {
            continue;
        }
        let c = (s[r] - m_all).exp();
        l_all += s[MAX_ROWS + r] * c;
        let acc = &s[2 * MAX_ROWS + r * hd..2 * MAX_ROWS + (r + 1) * hd];
        out.iter_mut().zip(acc).for_each(|(o, a)| *o += a * c);
    }
    let inv = 1.0 / l_all;
    out.iter_mut().for_each(|o| *o *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Token-major `[kv_len, n_kv * hd]` keys/values as a head-major cache
    /// layer of element `T` with spare capacity, and the values `T` holds
    /// (what the reference must see).
    fn layer<T: KvElem + Default>(
        k: &[f32],
        v: &[f32],
        n_kv: usize,
        hd: usize,
    ) -> (Vec<T>, Vec<T>, usize, Vec<f32>, Vec<f32>) {
        let len = k.len() / (n_kv * hd);
        let cap = len + 3;
        let mut kc = vec![T::default(); n_kv * cap * hd];
        let mut vc = kc.clone();
        store_rows(k, &mut kc, cap, hd, 0);
        store_rows(v, &mut vc, cap, hd, 0);
        let round = |x: &[f32]| {
            let mut t = vec![T::default(); x.len()];
            T::narrow(x, &mut t);
            let mut back = vec![0f32; x.len()];
            T::widen(&t, &mut back);
            back
        };
        (kc, vc, cap, round(k), round(v))
    }

    /// Online softmax in f32 over ≤ 50 keys: errors ~1e-6; 1e-5 leaves margin.
    const TOL: f32 = 1e-5;

    /// Short and long histories (split across threads when few rows),
    /// many-token prefill tiles, GQA groups small and large, windows, odd
    /// head sizes, on every tier, for f32 and f16 caches.
    #[test]
    fn every_tier_matches_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        for (n_heads, n_kv, hd, window, n_tok, past) in [
            (4usize, 2usize, 16usize, None, 7usize, 0usize),
            (3, 1, 5, None, 1, 20),
            (6, 3, 8, Some(4), 9, 13),
            (2, 2, 3, Some(1), 5, 0),
            (9, 3, 64, None, 1, 700),
            (4, 1, 33, None, 1, 1000),
            (16, 1, 8, Some(300), 1, 900),
            (9, 3, 64, None, 37, 5),
            (8, 2, 17, Some(64), 70, 100),
            (24, 2, 12, None, 3, 260),
        ] {
            let p = AttnParams {
                n_heads,
                n_kv_heads: n_kv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window,
            };
            let kv_len = past + n_tok;
            let mut rand_vec =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
            let q = rand_vec(n_tok * n_heads * hd);
            let k = rand_vec(kv_len * n_kv * hd);
            let v = rand_vec(kv_len * n_kv * hd);
            let (kc, vc, capacity, _, _) = layer::<f32>(&k, &v, n_kv, hd);
            let (kh, vh, _, k16, v16) = layer::<half::f16>(&k, &v, n_kv, hd);
            let r = attention_ref(&p, &q, past, &k, &v);
            let r16 = attention_ref(&p, &q, past, &k16, &v16);
            for tier in cpu::available_tiers() {
                let mut out = vec![f32::NAN; q.len()];
                let kv = KvLayer {
                    k: &kc,
                    v: &vc,
                    capacity,
                    len: kv_len,
                };
                attention_with(tier, &p, &q, past, &kv, &mut out);
                for (a, b) in out.iter().zip(&r) {
                    assert!(
                        (a - b).abs() <= TOL,
                        "{tier} {n_heads}/{n_kv}x{hd} n={n_tok}: {a} vs {b}"
                    );
                }
                // f16 storage: the same arithmetic on the rounded keys and values.
                let kv = KvLayer {
                    k: &kh,
                    v: &vh,
                    capacity,
                    len: kv_len,
                };
                attention_with(tier, &p, &q, past, &kv, &mut out);
                for (a, b) in out.iter().zip(&r16) {
                    assert!((a - b).abs() <= TOL, "{tier} f16: {a} vs {b}");
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
            scale: 1.0,
            window: Some(1),
        };
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [5.0, 5.0, -3.0, 2.0];
        let v = [1.0, 2.0, 3.0, 4.0];
        let mut out = [0f32; 4];
        let (kc, vc, capacity, _, _) = layer::<f32>(&k, &v, 1, 2);
        attention(
            &p,
            &q,
            0,
            &KvLayer {
                k: &kc,
                v: &vc,
                capacity,
                len: 2,
            },
            &mut out,
        );
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }
}
