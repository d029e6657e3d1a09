//! The KV caches the forward pass writes and attention reads.
//!
//! [`KvPool`] is the serving engine's paged cache: per layer, one store of
//! fixed-size blocks allocated up front, `[n_blocks, n_kv_heads,
//! block_size, head_dim]` (see `kvant_kernels::attention::KvBlocks`), into
//! which each sequence's block table points. Which blocks a sequence owns
//! is the engine's business; the pool only holds the numbers. Elements are
//! f16 by default, which halves what each decode step streams; f32 keeps
//! keys and values exactly as computed.
//!
//! [`KvCache`] is one sequence's cache for the single-stream paths (CLI
//! generation, perplexity, benchmarks): a pool of one block as long as the
//! sequence may grow, so both paths run the same kernels.

use crate::ModelError;
use half::slice::HalfBitsSliceExt;
use kvant_kernels::attention::{
    attention, load_rows, select_topk, sparse_attention, store_rows, AttnParams, IndexerParams,
    KvBlocks, KvElem, SeqAttn, TopK,
};

/// The element type of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDType {
    F16,
    F32,
}

impl KvDType {
    pub fn bytes(self) -> usize {
        match self {
            KvDType::F16 => 2,
            KvDType::F32 => 4,
        }
    }
}

/// Every layer's key and value blocks, as element type `T` (f16 values
/// are held as their bits, `u16`: zeroed vectors of primitive types come
/// from the allocator already zero, so a large pool costs no start-up time
/// and its pages are committed only when first written).
struct Layers<T> {
    keys: Vec<Vec<T>>,
    /// Empty for a latent cache (values are part of the key rows).
    values: Vec<Vec<T>>,
    /// Sparse attention's indexer keys, one row per position (blocks of
    /// `[block_size, index_dim]`); empty without an indexer.
    index: Vec<Vec<T>>,
}

impl<T: Clone + Default> Layers<T> {
    fn new(shape: &KvShape, per_layer: usize, index_per_layer: usize) -> Self {
        let alloc = |n, len| (0..n).map(|_| vec![T::default(); len]).collect();
        let n = shape.n_layers;
        Layers {
            keys: alloc(n, per_layer),
            values: alloc(if shape.latent { 0 } else { n }, per_layer),
            index: alloc(if shape.index_dim > 0 { n } else { 0 }, index_per_layer),
        }
    }
}

enum Store {
    F16(Layers<u16>),
    F32(Layers<f32>),
}

/// The shape of a pool: what every block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    /// Key row size per KV head (the latent row for latent attention).
    pub head_dim: usize,
    /// Only keys are stored: multi-head latent attention reads its values
    /// from the latent rows (see `kvant_kernels::attention::KvBlocks`).
    pub latent: bool,
    /// Size of the indexer key each position keeps for sparse attention
    /// (DeepSeek-V3.2); 0 without an indexer.
    pub index_dim: usize,
    pub dtype: KvDType,
}

impl KvShape {
    /// Bytes one token occupies across all layers (keys and values, and
    /// indexer keys).
    pub fn bytes_per_token(&self) -> usize {
        let arrays = if self.latent { 1 } else { 2 };
        let row = arrays * self.n_kv_heads * self.head_dim + self.index_dim;
        self.n_layers * row * self.dtype.bytes()
    }
}

/// Fixed-size blocks of keys and values for every layer.
pub struct KvPool {
    store: Store,
    shape: KvShape,
    block_size: usize,
    n_blocks: usize,
}

impl KvPool {
    /// A pool of `n_blocks` blocks of `block_size` tokens, allocated now
    /// (pages are committed by the OS as blocks are first written).
    pub fn new(shape: KvShape, block_size: usize, n_blocks: usize) -> Result<Self, ModelError> {
        let too_large = ModelError::KvTooLarge {
            block_size,
            n_blocks,
        };
        let per_layer = |row: usize| {
            row.checked_mul(block_size)
                .and_then(|x| x.checked_mul(n_blocks))
                .filter(|&x| {
                    x.checked_mul(2 * shape.n_layers * shape.dtype.bytes())
                        .is_some_and(|b| b <= isize::MAX as usize)
                })
        };
        let (per_layer, index_per_layer) = shape
            .n_kv_heads
            .checked_mul(shape.head_dim)
            .and_then(per_layer)
            .zip(per_layer(shape.index_dim))
            .ok_or(too_large)?;
        if block_size == 0 || n_blocks == 0 || n_blocks > u32::MAX as usize {
            return Err(ModelError::KvTooLarge {
                block_size,
                n_blocks,
            });
        }
        Ok(KvPool {
            store: match shape.dtype {
                KvDType::F16 => Store::F16(Layers::new(&shape, per_layer, index_per_layer)),
                KvDType::F32 => Store::F32(Layers::new(&shape, per_layer, index_per_layer)),
            },
            shape,
            block_size,
            n_blocks,
        })
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn dtype(&self) -> KvDType {
        self.shape.dtype
    }

    /// Bytes held, for memory reports.
    pub fn bytes(&self) -> usize {
        self.shape.bytes_per_token() * self.block_size * self.n_blocks
    }

    /// Whether `table` (block ids) covers `positions` positions of this pool.
    pub(crate) fn check_table(&self, table: &[u32], positions: usize) -> Result<(), ModelError> {
        let needed = positions.div_ceil(self.block_size);
        if table.len() < needed {
            return Err(ModelError::ContextOverflow {
                needed: positions,
                capacity: table.len() * self.block_size,
            });
        }
        match table[..needed]
            .iter()
            .find(|&&b| b as usize >= self.n_blocks)
        {
            Some(&b) => Err(ModelError::BadBlock {
                block: b,
                n_blocks: self.n_blocks,
            }),
            None => Ok(()),
        }
    }

    /// Stores `k` and `v` (`[n_tokens, kv_dim]`, the batch's new tokens;
    /// `v` is `None` for a latent pool) in one layer at each sequence's
    /// positions. The caller has checked every table with
    /// [`Self::check_table`].
    pub(crate) fn store(
        &mut self,
        layer: usize,
        seqs: &[SeqAttn<'_>],
        kv: (&[f32], Option<&[f32]>),
    ) {
        let (bs, nk, hd) = (self.block_size, self.shape.n_kv_heads, self.shape.head_dim);
        match &mut self.store {
            Store::F16(l) => {
                let k = l.keys[layer].reinterpret_cast_mut::<half::f16>();
                let v = l
                    .values
                    .get_mut(layer)
                    .map(|v| v.reinterpret_cast_mut::<half::f16>());
                store_seqs(k, v, (bs, nk, hd), seqs, kv)
            }
            Store::F32(l) => {
                let v = l.values.get_mut(layer).map(|v| v.as_mut_slice());
                store_seqs(&mut l.keys[layer], v, (bs, nk, hd), seqs, kv)
            }
        }
    }

    /// [`Self::store`], then attention for the queries `q` (the same
    /// tokens) over each sequence's history including them.
    pub(crate) fn store_and_attend(
        &mut self,
        layer: usize,
        seqs: &[SeqAttn<'_>],
        kv: (&[f32], Option<&[f32]>),
        p: &AttnParams,
        q: &[f32],
        out: &mut [f32],
    ) {
        debug_assert!(p.n_kv_heads == self.shape.n_kv_heads && p.head_dim == self.shape.head_dim);
        self.store(layer, seqs, kv);
        let block_size = self.block_size;
        match &self.store {
            Store::F16(l) => {
                let blocks = KvBlocks {
                    k: l.keys[layer].reinterpret_cast::<half::f16>(),
                    v: l.values
                        .get(layer)
                        .map(|v| v.reinterpret_cast::<half::f16>()),
                    block_size,
                };
                attention(p, q, &blocks, seqs, out)
            }
            Store::F32(l) => {
                let blocks = KvBlocks {
                    k: &l.keys[layer],
                    v: l.values.get(layer).map(Vec::as_slice),
                    block_size,
                };
                attention(p, q, &blocks, seqs, out)
            }
        }
    }

    /// Stores the batch's indexer keys (`[n_tokens, index_dim]`) in one
    /// layer, then selects each query token's top-k positions (`q`
    /// `[n_tokens, heads * index_dim]`, head weights `w` `[n_tokens,
    /// heads]`). The caller has checked every table.
    #[allow(clippy::too_many_arguments)] // one layer's selection, unpacked
    pub(crate) fn store_and_select(
        &mut self,
        layer: usize,
        seqs: &[SeqAttn<'_>],
        keys: &[f32],
        p: &IndexerParams,
        q: &[f32],
        w: &[f32],
        out: &mut TopK,
    ) {
        let (bs, d) = (self.block_size, self.shape.index_dim);
        debug_assert_eq!(p.head_dim, d);
        match &mut self.store {
            Store::F16(l) => {
                let k = l.index[layer].reinterpret_cast_mut::<half::f16>();
                store_seqs(k, None, (bs, 1, d), seqs, (keys, None));
                let blocks = KvBlocks {
                    k: l.index[layer].reinterpret_cast::<half::f16>(),
                    v: None,
                    block_size: bs,
                };
                select_topk(p, q, w, &blocks, seqs, out)
            }
            Store::F32(l) => {
                store_seqs(&mut l.index[layer], None, (bs, 1, d), seqs, (keys, None));
                let blocks = KvBlocks {
                    k: &l.index[layer],
                    v: None,
                    block_size: bs,
                };
                select_topk(p, q, w, &blocks, seqs, out)
            }
        }
    }

    /// [`Self::store`], then attention for the queries `q` over each
    /// sequence's history, every token over the positions `sel` chose for
    /// it (dense attention for those it reports dense).
    #[allow(clippy::too_many_arguments)] // one layer's step, unpacked
    pub(crate) fn store_and_attend_sparse(
        &mut self,
        layer: usize,
        seqs: &[SeqAttn<'_>],
        kv: (&[f32], Option<&[f32]>),
        p: &AttnParams,
        q: &[f32],
        sel: &TopK,
        out: &mut [f32],
    ) {
        self.store(layer, seqs, kv);
        // Each sequence's leading dense rows (a token sees no more
        // positions than the top-k only near the start).
        let dense: Vec<SeqAttn<'_>> = seqs
            .iter()
            .filter_map(|s| {
                let n = s.rows.clone().take_while(|&r| sel.get(r).is_none()).count();
                (n > 0).then(|| SeqAttn {
                    rows: s.rows.start..s.rows.start + n,
                    ..s.clone()
                })
            })
            .collect();
        let block_size = self.block_size;
        match &self.store {
            Store::F16(l) => {
                let blocks = KvBlocks {
                    k: l.keys[layer].reinterpret_cast::<half::f16>(),
                    v: l.values
                        .get(layer)
                        .map(|v| v.reinterpret_cast::<half::f16>()),
                    block_size,
                };
                attention(p, q, &blocks, &dense, out);
                sparse_attention(p, q, &blocks, seqs, sel, out)
            }
            Store::F32(l) => {
                let blocks = KvBlocks {
                    k: &l.keys[layer],
                    v: l.values.get(layer).map(Vec::as_slice),
                    block_size,
                };
                attention(p, q, &blocks, &dense, out);
                sparse_attention(p, q, &blocks, seqs, sel, out)
            }
        }
    }

    /// Widens the keys one layer holds for positions `pos..` of the
    /// sequence whose blocks are `table` into `out` (token-major, as many
    /// rows as it holds): for a latent pool, the latent rows, which the
    /// expanded form of latent attention recomputes keys and values from.
    pub(crate) fn load_keys(&self, layer: usize, table: &[u32], pos: usize, out: &mut [f32]) {
        let (bs, nk, hd) = (self.block_size, self.shape.n_kv_heads, self.shape.head_dim);
        match &self.store {
            Store::F16(l) => {
                let k = l.keys[layer].reinterpret_cast::<half::f16>();
                load_rows(k, out, bs, nk, hd, table, pos)
            }
            Store::F32(l) => load_rows(&l.keys[layer], out, bs, nk, hd, table, pos),
        }
    }
}

/// Writes each sequence's rows of `k` (and `v`) at its positions.
fn store_seqs<T: KvElem>(
    keys: &mut [T],
    mut values: Option<&mut [T]>,
    (block_size, nk, hd): (usize, usize, usize),
    seqs: &[SeqAttn<'_>],
    (k, v): (&[f32], Option<&[f32]>),
) {
    for s in seqs {
        let rows = s.rows.start * nk * hd..s.rows.end * nk * hd;
        store_rows(&k[rows.clone()], keys, block_size, nk, hd, s.table, s.pos0);
        if let (Some(dst), Some(v)) = (values.as_deref_mut(), v) {
            store_rows(&v[rows], dst, block_size, nk, hd, s.table, s.pos0);
        }
    }
}

/// Keys and values of one sequence: a pool of one block of `capacity`
/// positions.
pub struct KvCache {
    pool: KvPool,
    len: usize,
}

/// The one block of a [`KvCache`].
pub(crate) const SINGLE_TABLE: [u32; 1] = [0];

impl KvCache {
    pub fn new(shape: KvShape, capacity: usize) -> Result<Self, ModelError> {
        Ok(KvCache {
            pool: KvPool::new(shape, capacity.max(1), 1)?,
            len: 0,
        })
    }

    /// Tokens already stored (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.pool.block_size
    }

    pub fn dtype(&self) -> KvDType {
        self.pool.dtype()
    }

    /// Bytes held, for memory reports.
    pub fn bytes(&self) -> usize {
        self.pool.bytes()
    }

    pub(crate) fn pool_mut(&mut self) -> &mut KvPool {
        &mut self.pool
    }

    /// Commits the tokens appended to every layer by one forward pass.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The pool, the block table and the length, for a forward pass that
    /// runs through something other than [`crate::arch::decoder::DecoderModel::forward`]
    /// (rank 0 of a parallel run); [`KvCache::commit`] its tokens after it.
    pub fn parts(&mut self) -> (&mut KvPool, &'static [u32], usize) {
        (&mut self.pool, &SINGLE_TABLE, self.len)
    }

    /// Commits `n` tokens a forward pass over [`KvCache::parts`] stored.
    pub fn commit(&mut self, n: usize) {
        self.len = (self.len + n).min(self.capacity());
    }

    /// Forgets everything after the first `len` tokens (e.g. a new window).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}
