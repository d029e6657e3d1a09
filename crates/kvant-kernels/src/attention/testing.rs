//! Test helpers shared by the attention kernels' tests.

use super::kv::{self, KvBuffer, KvDType, KvElem, KvLayer};
use super::{AttnParams, SeqAttn};
use crate::cpu::SimdTier;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub(super) fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

/// One test case: heads, KV heads, (key, value) head sizes, latent
/// (values inside the keys), the kernel's own parameter `X` (a window, a
/// top-k), and per sequence (query tokens, earlier positions).
pub(super) type Case<X> = (usize, usize, (usize, usize), bool, X, Vec<(usize, usize)>);

/// `n_heads` query heads on `n_kv_heads` KV heads of `(hd, vd)` values.
pub(super) fn params(
    (n_heads, n_kv_heads): (usize, usize),
    (hd, vd): (usize, usize),
    scale: f32,
    window: Option<usize>,
) -> AttnParams {
    AttnParams {
        n_heads,
        n_kv_heads,
        head_dim: hd,
        v_dim: vd,
        scale,
        window,
    }
}

/// Random keys and values (token-major, `n_kv` heads of `(hd, vd)`) of
/// each sequence `(query tokens, earlier positions)` of `shape`.
pub(super) fn random_kvs(
    rng: &mut ChaCha8Rng,
    shape: &[(usize, usize)],
    n_kv: usize,
    (hd, vd): (usize, usize),
) -> Vec<(Vec<f32>, Vec<f32>)> {
    shape
        .iter()
        .map(|&(n, past)| {
            let len = (past + n) * n_kv;
            (rand_vec(rng, len * hd), rand_vec(rng, len * vd))
        })
        .collect()
}

/// `x` (whole units of `dtype`) as a `dtype` cache holds it: narrowed
/// then widened by the scalar codec.
pub(super) fn rounded(dtype: KvDType, x: &[f32]) -> Vec<f32> {
    kv::with_kv_elem!(dtype, T => {
        let mut t = vec![T::default(); x.len() / T::VALUES];
        T::narrow(x, &mut t);
        let mut back = vec![0f32; x.len()];
        T::widen(SimdTier::Scalar, &t, &mut back);
        back
    })
}

/// A block store holding several sequences' keys and values (token-major
/// `[len, n_kv * hd]` and `[len, n_kv * vd]` each) in shuffled blocks of
/// `dtype`, their tables, and the values the store holds after rounding
/// (what the reference sees). `latent`: no values are stored; they are
/// the keys' first `vd` elements (the given values are ignored).
pub(super) struct Store {
    pub k: KvBuffer,
    pub v: Option<KvBuffer>,
    pub block_size: usize,
    pub tables: Vec<Vec<u32>>,
    pub rounded: Vec<(Vec<f32>, Vec<f32>)>,
}

impl Store {
    pub fn new(
        rng: &mut ChaCha8Rng,
        dtype: KvDType,
        seqs: &[(Vec<f32>, Vec<f32>)],
        n_kv: usize,
        (hd, vd): (usize, usize),
        block_size: usize,
        latent: bool,
    ) -> Self {
        let lens: Vec<usize> = seqs.iter().map(|(k, _)| k.len() / (n_kv * hd)).collect();
        let n_blocks: usize = lens.iter().map(|l| l.div_ceil(block_size)).sum::<usize>() + 2;
        let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
        ids.shuffle(rng);
        let buf = |dim: usize| KvBuffer::zeroed(dtype, n_blocks * n_kv * block_size * dim);
        let mut k = buf(hd).expect("whole units");
        let mut v = (!latent).then(|| buf(vd).expect("whole units"));
        let mut tables = Vec::new();
        let mut next = ids.into_iter();
        for ((ks, vs), &len) in seqs.iter().zip(&lens) {
            let table: Vec<u32> = next.by_ref().take(len.div_ceil(block_size)).collect();
            k.store_rows(ks, (block_size, n_kv, hd), &table, 0);
            if let Some(v) = &mut v {
                v.store_rows(vs, (block_size, n_kv, vd), &table, 0);
            }
            tables.push(table);
        }
        let rounded = seqs
            .iter()
            .map(|(k, v)| {
                let k = rounded(dtype, k);
                let v = match latent {
                    true => k.chunks_exact(hd).flat_map(|r| &r[..vd]).copied().collect(),
                    false => rounded(dtype, v),
                };
                (k, v)
            })
            .collect();
        Store {
            k,
            v,
            block_size,
            tables,
            rounded,
        }
    }

    /// The sequences of a call over this store: per sequence `(query
    /// tokens, earlier positions)`, rows in order.
    pub fn seqs(&self, shape: &[(usize, usize)]) -> Vec<SeqAttn<'_>> {
        let mut row0 = 0;
        shape
            .iter()
            .zip(&self.tables)
            .map(|(&(n, past), t)| {
                row0 += n;
                SeqAttn {
                    rows: row0 - n..row0,
                    pos0: past,
                    table: t,
                }
            })
            .collect()
    }

    pub fn layer(&self) -> KvLayer<'_> {
        KvLayer {
            k: &self.k,
            v: self.v.as_ref(),
            block_size: self.block_size,
        }
    }
}

/// Whether rows of `hd` (and stored values of `vd`) values fit `dtype`.
pub(super) fn fits(dtype: KvDType, (hd, vd): (usize, usize), latent: bool) -> bool {
    let u = dtype.unit_values();
    hd.is_multiple_of(u) && (latent || vd.is_multiple_of(u))
}
