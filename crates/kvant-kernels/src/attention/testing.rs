//! Test helpers shared by the attention kernels' tests.

use super::{store_rows, KvBlocks, KvElem};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub(super) fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

/// A block store holding several sequences' keys and values (token-major
/// `[len, n_kv * hd]` and `[len, n_kv * vd]` each) in shuffled blocks,
/// their tables, and the values the store holds after rounding to `T`
/// (what the reference sees). `latent`: no values are stored; they are
/// the keys' first `vd` elements (the given values are ignored).
pub(super) struct Store<T> {
    pub k: Vec<T>,
    pub v: Option<Vec<T>>,
    pub block_size: usize,
    pub tables: Vec<Vec<u32>>,
    pub rounded: Vec<(Vec<f32>, Vec<f32>)>,
}

impl<T: KvElem + Default> Store<T> {
    pub fn new(
        rng: &mut ChaCha8Rng,
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
        let mut k = vec![T::default(); n_blocks * n_kv * block_size * hd];
        let mut v = (!latent).then(|| vec![T::default(); n_blocks * n_kv * block_size * vd]);
        let mut tables = Vec::new();
        let mut next = ids.into_iter();
        for ((ks, vs), &len) in seqs.iter().zip(&lens) {
            let table: Vec<u32> = next.by_ref().take(len.div_ceil(block_size)).collect();
            store_rows(ks, &mut k, block_size, n_kv, hd, &table, 0);
            if let Some(v) = &mut v {
                store_rows(vs, v, block_size, n_kv, vd, &table, 0);
            }
            tables.push(table);
        }
        let round = |x: &[f32]| {
            let mut t = vec![T::default(); x.len()];
            T::narrow(x, &mut t);
            let mut back = vec![0f32; x.len()];
            T::widen(&t, &mut back);
            back
        };
        let rounded = seqs
            .iter()
            .map(|(k, v)| {
                let k = round(k);
                let v = match latent {
                    true => k.chunks_exact(hd).flat_map(|r| &r[..vd]).copied().collect(),
                    false => round(v),
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

    pub fn blocks(&self) -> KvBlocks<'_, T> {
        KvBlocks {
            k: &self.k,
            v: self.v.as_deref(),
            block_size: self.block_size,
        }
    }
}
