//! The KV caches the forward pass writes and attention reads.
//!
//! [`KvPool`] is the serving engine's paged cache: per layer, one store of
//! fixed-size blocks allocated up front, `[n_blocks, n_kv_heads,
//! block_size, head_dim]` (see `kvant_kernels::attention::KvBlocks`), into
//! which each sequence's block table points. Which blocks a sequence owns
//! is the engine's business; the pool only holds the numbers. Elements are
//! f16 by default, which halves what each decode step streams; f32 keeps
//! keys and values exactly as computed; bf16 has f32's range at f16's
//! size; Q8_0 and Q4_0 (ggml's blocks of 32 values, 34 and 18 bytes) cut
//! f16's bytes to 53% and 28%, and attention reads their blocks directly.
//!
//! [`KvCache`] is one sequence's cache for the single-stream paths (CLI
//! generation, perplexity, benchmarks): a pool of one block as long as the
//! sequence may grow, so both paths run the same kernels.
//!
//! Linear-attention layers (Gated DeltaNet) cache no rows per token: each
//! sequence has a fixed-size state per such layer (the convolution's tail
//! and the delta rule's matrices, [`StateShape`]) in one of the pool's
//! state slots, which the engine hands out per sequence as it does blocks.

use crate::config::{V4Attention, V4Config};
use crate::ModelError;
use kvant_kernels::attention::{
    attention_dyn, select_topk_dyn, sparse_attention_dyn, AttnParams, IndexerParams, KvBuffer,
    KvLayer, SeqAttn, TopK,
};

pub use kvant_kernels::attention::KvDType;

/// One per-layer array of a pool: for every layer, blocks of `heads` rows
/// of `dim` values in one element type, laid out as attention reads them
/// (`[n_blocks, heads, block_size, dim]`, see
/// `kvant_kernels::attention::KvBlocks`). A pool holds keys and values as
/// two of these, a latent pool one; any other rows a layer caches per
/// token (an indexer's keys, say) would be one more, stored and read
/// through the same calls, whatever its element type.
struct LayerRows {
    heads: usize,
    dim: usize,
    layers: Vec<KvBuffer>,
}

impl LayerRows {
    /// Zeroed rows for `n_layers` layers of `n_blocks` blocks of
    /// `block_size` tokens.
    ///
    /// # Errors
    /// [`ModelError::KvTooLarge`] if the sizes overflow; a kernel error if
    /// `dim` is not whole units of `dtype` (callers check the shape first
    /// for a clearer error, [`KvShape::check`]).
    fn new(
        dtype: KvDType,
        (n_layers, heads, dim): (usize, usize, usize),
        (block_size, n_blocks): (usize, usize),
    ) -> Result<Self, ModelError> {
        let values = heads
            .checked_mul(dim)
            .and_then(|x| x.checked_mul(block_size))
            .and_then(|x| x.checked_mul(n_blocks))
            .ok_or(ModelError::KvTooLarge {
                block_size,
                n_blocks,
            })?;
        let layers = (0..n_layers)
            .map(|_| KvBuffer::zeroed(dtype, values))
            .collect::<Result<_, _>>()?;
        Ok(LayerRows { heads, dim, layers })
    }

    /// Writes each sequence's rows of `rows` (`[n_tokens, heads * dim]`,
    /// the batch's new tokens) at its positions in layer `layer`.
    fn store(&mut self, layer: usize, block_size: usize, seqs: &[SeqAttn<'_>], rows: &[f32]) {
        let (heads, dim) = (self.heads, self.dim);
        let buf = &mut self.layers[layer];
        for s in seqs {
            let r = s.rows.start * heads * dim..s.rows.end * heads * dim;
            buf.store_rows(&rows[r], (block_size, heads, dim), s.table, s.pos0);
        }
    }

    /// Widens layer `layer`'s rows for positions `pos..` of the sequence
    /// whose blocks are `table` into `out` (token-major).
    fn load(&self, layer: usize, block_size: usize, table: &[u32], pos: usize, out: &mut [f32]) {
        self.layers[layer].load_rows(out, (block_size, self.heads, self.dim), table, pos);
    }
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
    /// Per-layer arrays a pool of this shape holds.
    fn arrays(&self) -> usize {
        if self.latent {
            1
        } else {
            2
        }
    }

    /// The element type of the indexer keys: 8-bit (Q8_0) under the
    /// quantized cache types (the indexer only ranks positions, and
    /// DeepSeek itself scores in FP8), the cache's own type otherwise.
    fn index_dtype(&self) -> KvDType {
        index_dtype(self.dtype)
    }

    /// Whether the element types can store this shape's rows: the block
    /// types hold rows of whole 32-value blocks only.
    ///
    /// # Errors
    /// [`ModelError::KvRowSize`] naming the type and the row size.
    pub fn check(&self) -> Result<(), ModelError> {
        let rows = if self.latent {
            "latent"
        } else {
            "key and value"
        };
        for (dtype, rows, row) in [
            (self.dtype, rows, self.head_dim),
            (self.index_dtype(), "indexer key", self.index_dim),
        ] {
            if dtype.row_bytes(row).is_none() {
                return Err(ModelError::KvRowSize {
                    dtype,
                    rows,
                    row,
                    block: dtype.unit_values(),
                });
            }
        }
        Ok(())
    }

    /// Bytes one token occupies across all layers (keys and values, and
    /// indexer keys): 4 per value for f32, 2 for f16 and bf16, 34/32 for
    /// Q8_0 and 18/32 for Q4_0 (a shape [`Self::check`] rejects counts its
    /// last block whole).
    pub fn bytes_per_token(&self) -> usize {
        let row = self.dtype.bytes_rounded_up(self.head_dim);
        let index = self.index_dtype().bytes_rounded_up(self.index_dim);
        self.n_layers * (self.arrays() * self.n_kv_heads * row + index)
    }

    /// Bytes of one layer's indexer key per position (0 without one).
    pub fn index_bytes(&self) -> usize {
        self.index_dtype().bytes_rounded_up(self.index_dim)
    }
}

/// The element type of indexer keys: 8-bit (Q8_0) under the quantized
/// cache types (an indexer only ranks, and DeepSeek itself scores in FP8),
/// the cache's own type otherwise.
fn index_dtype(dtype: KvDType) -> KvDType {
    match dtype {
        KvDType::Q8_0 | KvDType::Q4_0 => KvDType::Q8_0,
        other => other,
    }
}

impl KvShape {
    /// DeepSeek-V4 caches no row per token: its window rows live in state
    /// slots and its compressed entries per layer ([`EntryShape`]); the
    /// shape still says the entries' width and element type.
    pub fn deepseek_v4(head_dim: usize, dtype: KvDType) -> Self {
        KvShape {
            n_layers: 0,
            n_kv_heads: 1,
            head_dim,
            latent: true,
            index_dim: 0,
            dtype,
        }
    }
}

/// DeepSeek-V4's compressed entries: for each compressing layer its
/// compression rate and whether the indexer keeps a key beside each entry
/// (CSA), the entries' width (K = V) and the indexer keys'. Each layer's
/// blocks hold one row per window its tokens close, so a layer that
/// compresses 128 tokens holds 1/128 of a row per token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EntryShape {
    pub layers: Vec<(usize, bool)>,
    pub dim: usize,
    pub index_dim: usize,
}

impl EntryShape {
    /// Over the first `layers` layers (the main ones, and the MTP
    /// module's when it is loaded).
    pub fn deepseek_v4(v4: &V4Config, head_dim: usize, layers: usize) -> Self {
        EntryShape {
            layers: (0..layers)
                .filter(|&i| v4.rate(i) > 0)
                .map(|i| (v4.rate(i), v4.kind(i) == V4Attention::Csa))
                .collect(),
            dim: head_dim,
            index_dim: v4.indexer.head_dim,
        }
    }

    /// Rows a block of `block_size` tokens holds for a layer compressing
    /// `rate` tokens: the windows it closes (at least one slot).
    fn block_rows(rate: usize, block_size: usize) -> usize {
        (block_size / rate.max(1)).max(1)
    }

    /// Bytes of entries (and indexer keys) a block of `block_size` tokens
    /// holds over every layer, in `dtype` (a window longer than the block
    /// still takes a row in each).
    pub fn bytes_per_block(&self, block_size: usize, dtype: KvDType) -> usize {
        let row = dtype.bytes_rounded_up(self.dim);
        let index = index_dtype(dtype).bytes_rounded_up(self.index_dim);
        self.layers
            .iter()
            .map(|&(rate, ix)| {
                Self::block_rows(rate, block_size) * (row + if ix { index } else { 0 })
            })
            .sum()
    }

    /// Bytes one decoded token at position `pos` reads over the main
    /// layers of `v4` (heads of `head_dim`): each layer's window rows (f32,
    /// in the sequence's state), and the entries it sees, in `dtype`: every
    /// closed one in an HCA layer; in a CSA layer every indexer key and the
    /// indexer's top-k of the entries.
    pub fn bytes_read(
        &self,
        v4: &V4Config,
        (pos, head_dim): (usize, usize),
        dtype: KvDType,
    ) -> usize {
        let row = dtype.bytes_rounded_up(self.dim);
        let index = index_dtype(dtype).bytes_rounded_up(self.index_dim);
        let window = 4 * head_dim * v4.window.min(pos + 1);
        (0..v4.layers.len())
            .map(|l| {
                let visible = (pos + 1).checked_div(v4.rate(l)).unwrap_or(0);
                window
                    + match v4.layers[l] {
                        V4Attention::Sliding => 0,
                        V4Attention::Hca => visible * row,
                        V4Attention::Csa => visible * index + v4.indexer.topk.min(visible) * row,
                    }
            })
            .sum()
    }

    /// Bytes of entries (and indexer keys) per token over every layer, in
    /// `dtype` (each layer's rounded up to a whole byte).
    pub fn bytes_per_token(&self, dtype: KvDType) -> usize {
        let row = dtype.bytes_rounded_up(self.dim);
        let index = index_dtype(dtype).bytes_rounded_up(self.index_dim);
        self.layers
            .iter()
            .map(|&(rate, ix)| (row + if ix { index } else { 0 }).div_ceil(rate.max(1)))
            .sum()
    }
}

/// The entries of every compressing layer, for `n_blocks` blocks.
struct EntryRows {
    shape: EntryShape,
    keys: Vec<KvBuffer>,
    index: Vec<Option<KvBuffer>>,
}

impl EntryRows {
    /// Zeroed entries; in a pool of several blocks each layer's windows
    /// must tile its blocks (a block holds whole windows, or a window
    /// whole blocks), so that an entry sits in the block of its window's
    /// last token.
    fn new(
        shape: EntryShape,
        dtype: KvDType,
        (block_size, n_blocks): (usize, usize),
    ) -> Result<Self, ModelError> {
        for &(rate, _) in &shape.layers {
            let tiles = block_size.is_multiple_of(rate) || rate.is_multiple_of(block_size);
            if rate == 0 || (n_blocks > 1 && !tiles) {
                return Err(ModelError::KvBlockSize {
                    block_size,
                    compress: rate,
                });
            }
        }
        let buffer = |dtype, dim, rate| {
            let values = dim
                * EntryShape::block_rows(rate, block_size)
                    .checked_mul(n_blocks)
                    .ok_or(ModelError::KvTooLarge {
                        block_size,
                        n_blocks,
                    })?;
            Ok::<_, ModelError>(KvBuffer::zeroed(dtype, values)?)
        };
        let keys = shape
            .layers
            .iter()
            .map(|&(rate, _)| buffer(dtype, shape.dim, rate))
            .collect::<Result<_, _>>()?;
        let index = shape
            .layers
            .iter()
            .map(|&(rate, ix)| match ix {
                true => buffer(index_dtype(dtype), shape.index_dim, rate).map(Some),
                false => Ok(None),
            })
            .collect::<Result<_, _>>()?;
        Ok(EntryRows { shape, keys, index })
    }

    fn bytes(&self) -> usize {
        let index = self.index.iter().flatten();
        self.keys.iter().chain(index).map(KvBuffer::bytes).sum()
    }
}

impl StateShape {
    /// DeepSeek-V4's per-sequence state over its first `layers` layers
    /// (the main ones, and the MTP module's when it is loaded): every
    /// layer's window ring and compressor tails (the largest layer's size
    /// for all, see [`V4Config::state_len`]).
    ///
    /// It steps back one token for free: a ring or tail keeps rows by
    /// position, and the row a token overwrote (`window`, `rate` or
    /// `2·rate` positions back) is one that no token from it on reads; an
    /// entry its window closed is recomputed before it is read again.
    pub fn deepseek_v4(v4: &V4Config, head_dim: usize, layers: usize) -> Self {
        StateShape {
            layers,
            conv: 0,
            delta: (0..layers)
                .map(|i| v4.state_len(i, head_dim))
                .max()
                .unwrap_or(0),
            rewind: 1,
        }
    }
}

/// The per-sequence state of a model's linear-attention layers: per
/// layer, `conv` values of convolution tail and `delta` of delta-rule
/// state (f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateShape {
    pub layers: usize,
    pub conv: usize,
    pub delta: usize,
    /// Tokens a sequence can be cut back by while its state stays valid
    /// (a rejected speculative token): 0 for a delta-rule state, which
    /// cannot run backwards.
    pub rewind: usize,
}

impl StateShape {
    /// Bytes of one sequence's state over all layers.
    pub fn bytes_per_slot(&self) -> usize {
        4 * self.layers * (self.conv + self.delta)
    }
}

/// Every linear layer's state for `slots` sequences.
struct States {
    shape: StateShape,
    slots: usize,
    /// Per layer: `[slots, conv]` and `[slots, delta]`.
    conv: Vec<Vec<f32>>,
    delta: Vec<Vec<f32>>,
}

impl States {
    fn new(shape: StateShape, slots: usize) -> Result<Self, ModelError> {
        let too_large = ModelError::StateTooLarge {
            slots,
            bytes: shape.bytes_per_slot(),
        };
        let len = |per: usize| {
            per.checked_mul(slots).ok_or(ModelError::StateTooLarge {
                slots,
                bytes: shape.bytes_per_slot(),
            })
        };
        if shape
            .bytes_per_slot()
            .checked_mul(slots)
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(too_large);
        }
        let (conv, delta) = (len(shape.conv)?, len(shape.delta)?);
        Ok(States {
            shape,
            slots,
            conv: (0..shape.layers).map(|_| vec![0.0; conv]).collect(),
            delta: (0..shape.layers).map(|_| vec![0.0; delta]).collect(),
        })
    }

    /// Slot `slot`'s values of every layer, in order.
    fn read(&self, slot: usize) -> Vec<f32> {
        let (c, d) = (self.shape.conv, self.shape.delta);
        let mut out = Vec::with_capacity(self.shape.layers * (c + d));
        for (conv, delta) in self.conv.iter().zip(&self.delta) {
            out.extend_from_slice(&conv[slot * c..(slot + 1) * c]);
            out.extend_from_slice(&delta[slot * d..(slot + 1) * d]);
        }
        out
    }

    /// Writes what [`Self::read`] returned into slot `slot`.
    fn write(&mut self, slot: usize, values: &[f32]) {
        let (c, d) = (self.shape.conv, self.shape.delta);
        for (l, (conv, delta)) in self.conv.iter_mut().zip(&mut self.delta).enumerate() {
            let v = &values[l * (c + d)..(l + 1) * (c + d)];
            conv[slot * c..(slot + 1) * c].copy_from_slice(&v[..c]);
            delta[slot * d..(slot + 1) * d].copy_from_slice(&v[c..]);
        }
    }
}

/// Fixed-size blocks of keys and values for every layer.
pub struct KvPool {
    keys: LayerRows,
    /// `None` for a latent pool (values are part of the key rows).
    values: Option<LayerRows>,
    /// Sparse attention's indexer keys, one row per position.
    index: Option<LayerRows>,
    /// Linear-attention layers' per-sequence states.
    states: Option<States>,
    /// DeepSeek-V4's compressed entries.
    entries: Option<EntryRows>,
    shape: KvShape,
    block_size: usize,
    n_blocks: usize,
}

impl KvPool {
    /// A pool of `n_blocks` blocks of `block_size` tokens, allocated now
    /// (pages are committed by the OS as blocks are first written).
    ///
    /// # Errors
    /// [`ModelError::KvRowSize`] if the element type cannot store the
    /// shape's rows, [`ModelError::KvTooLarge`] if the sizes overflow.
    pub fn new(shape: KvShape, block_size: usize, n_blocks: usize) -> Result<Self, ModelError> {
        Self::with_states(shape, StateShape::default(), 0, block_size, n_blocks)
    }

    /// [`Self::new`] with `slots` state slots of `states` for a model with
    /// linear-attention layers (no slots when `states` has no layers).
    ///
    /// # Errors
    /// As [`Self::new`], and [`ModelError::StateTooLarge`] if the states
    /// overflow.
    pub fn with_states(
        shape: KvShape,
        states: StateShape,
        slots: usize,
        block_size: usize,
        n_blocks: usize,
    ) -> Result<Self, ModelError> {
        shape.check()?;
        let too_large = ModelError::KvTooLarge {
            block_size,
            n_blocks,
        };
        let total = shape
            .bytes_per_token()
            .checked_mul(block_size)
            .and_then(|x| x.checked_mul(n_blocks));
        if total.is_none_or(|b| b > isize::MAX as usize)
            || block_size == 0
            || n_blocks == 0
            || n_blocks > u32::MAX as usize
        {
            return Err(too_large);
        }
        let rows = (shape.n_layers, shape.n_kv_heads, shape.head_dim);
        let array = || LayerRows::new(shape.dtype, rows, (block_size, n_blocks));
        Ok(KvPool {
            keys: array()?,
            values: match shape.latent {
                true => None,
                false => Some(array()?),
            },
            index: match shape.index_dim {
                0 => None,
                _ => Some(LayerRows::new(
                    shape.index_dtype(),
                    (shape.n_layers, 1, shape.index_dim),
                    (block_size, n_blocks),
                )?),
            },
            states: match states.layers {
                0 => None,
                _ => Some(States::new(states, slots)?),
            },
            entries: None,
            shape,
            block_size,
            n_blocks,
        })
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Adds DeepSeek-V4's compressed entries to the pool.
    ///
    /// # Errors
    /// [`ModelError::KvBlockSize`] if a layer's windows do not tile the
    /// blocks, [`ModelError::KvTooLarge`] if the sizes overflow.
    pub fn with_entries(mut self, shape: EntryShape) -> Result<Self, ModelError> {
        let sizes = (self.block_size, self.n_blocks);
        self.entries = Some(EntryRows::new(shape, self.shape.dtype, sizes)?);
        Ok(self)
    }

    /// Whether the pool holds compressed entries of exactly `shape` (none
    /// for an empty one).
    pub(crate) fn has_entries(&self, shape: &EntryShape) -> bool {
        match &self.entries {
            Some(e) => e.shape == *shape,
            None => shape.layers.is_empty(),
        }
    }

    /// The compressed entries' shape (empty without them).
    pub fn entry_shape(&self) -> EntryShape {
        self.entries
            .as_ref()
            .map_or(EntryShape::default(), |e| e.shape.clone())
    }

    /// The linear layers' state per slot (no layers without them).
    pub fn state_shape(&self) -> StateShape {
        self.states
            .as_ref()
            .map_or(StateShape::default(), |s| s.shape)
    }

    /// Sequences that can hold a linear-attention state at once.
    pub fn state_slots(&self) -> usize {
        self.states.as_ref().map_or(0, |s| s.slots)
    }

    /// Linear layer `layer`'s convolution tails and delta-rule states, every
    /// slot's (`[slots, conv]` and `[slots, delta]`).
    pub(crate) fn states_mut(
        &mut self,
        layer: usize,
    ) -> Result<(&mut [f32], &mut [f32]), ModelError> {
        let s = self.states.as_mut().ok_or(ModelError::KvShape)?;
        match (s.conv.get_mut(layer), s.delta.get_mut(layer)) {
            (Some(c), Some(d)) => Ok((c, d)),
            _ => Err(ModelError::KvShape),
        }
    }

    /// Linear layer `layer`'s states of every slot, read-only.
    pub(crate) fn states(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        let s = self.states.as_ref()?;
        Some((s.conv.get(layer)?, s.delta.get(layer)?))
    }

    /// Copies slot `from`'s state to slot `to` (a snapshot of a sequence's
    /// state, or a sequence continuing from one).
    ///
    /// # Errors
    /// [`ModelError::StateSlot`] for a slot the pool does not have.
    pub fn copy_state(&mut self, from: usize, to: usize) -> Result<(), ModelError> {
        let s = self
            .states
            .as_mut()
            .ok_or(ModelError::StateSlot { slot: from })?;
        for slot in [from, to] {
            if slot >= s.slots {
                return Err(ModelError::StateSlot { slot });
            }
        }
        let v = s.read(from);
        s.write(to, &v);
        Ok(())
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
        let arrays = std::iter::once(&self.keys)
            .chain(&self.values)
            .chain(&self.index);
        let rows: usize = arrays
            .flat_map(|a| &a.layers)
            .map(KvBuffer::bytes)
            .sum::<usize>()
            + self.entries.as_ref().map_or(0, EntryRows::bytes);
        let states = self
            .states
            .as_ref()
            .map_or(0, |s| s.slots * s.shape.bytes_per_slot());
        rows + states
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
        (k, v): (&[f32], Option<&[f32]>),
    ) {
        let bs = self.block_size;
        self.keys.store(layer, bs, seqs, k);
        if let (Some(values), Some(v)) = (&mut self.values, v) {
            values.store(layer, bs, seqs, v);
        }
    }

    /// [`Self::store`], then attention for the queries `q` (the same
    /// tokens) over each sequence's history including them: every
    /// position, or under sparse attention each token's positions in
    /// `sel` (dense attention for the tokens it reports dense).
    #[allow(clippy::too_many_arguments)] // one layer's step, unpacked
    pub(crate) fn store_and_attend(
        &mut self,
        layer: usize,
        seqs: &[SeqAttn<'_>],
        kv: (&[f32], Option<&[f32]>),
        p: &AttnParams,
        q: &[f32],
        sel: Option<&TopK>,
        out: &mut [f32],
    ) {
        debug_assert!(p.n_kv_heads == self.shape.n_kv_heads && p.head_dim == self.shape.head_dim);
        self.store(layer, seqs, kv);
        let kv = self.layer(layer);
        let Some(sel) = sel else {
            return attention_dyn(p, q, &kv, seqs, out);
        };
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
        attention_dyn(p, q, &kv, &dense, out);
        sparse_attention_dyn(p, q, &kv, seqs, sel, out)
    }

    /// A linear or DeepSeek-V4 layer's states of every slot (`[slots,
    /// delta]`; DeepSeek-V4 keeps no convolution tail) beside the pool's
    /// compressed entries, borrowed together.
    pub(crate) fn states_and_entries(
        &mut self,
        layer: usize,
    ) -> Result<(&mut [f32], Entries<'_>), ModelError> {
        let s = self.states.as_mut().ok_or(ModelError::KvShape)?;
        let states = s.delta.get_mut(layer).ok_or(ModelError::KvShape)?;
        let rows = self.entries.as_mut().ok_or(ModelError::KvShape)?;
        let entries = Entries {
            rows,
            block_size: self.block_size,
        };
        Ok((states, entries))
    }

    /// One layer's keys and values, as attention reads them.
    fn layer(&self, layer: usize) -> KvLayer<'_> {
        KvLayer {
            k: &self.keys.layers[layer],
            v: self.values.as_ref().map(|v| &v.layers[layer]),
            block_size: self.block_size,
        }
    }

    /// Stores the batch's indexer keys (`[n_tokens, index_dim]`) in one
    /// layer, then selects each query token's top-k positions (`q`
    /// `[n_tokens, heads * index_dim]`, head weights `w` `[n_tokens,
    /// heads]`). The caller has checked every table.
    ///
    /// # Panics
    /// If the pool has no indexer keys (a bug in the model code: the shape
    /// comes from the model's config).
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
        let bs = self.block_size;
        let index = self.index.as_mut().expect("a pool with indexer keys");
        index.store(layer, bs, seqs, keys);
        let keys = KvLayer {
            k: &index.layers[layer],
            v: None,
            block_size: bs,
        };
        select_topk_dyn(p, q, w, &keys, seqs, out)
    }

    /// Widens the keys one layer holds for positions `pos..` of the
    /// sequence whose blocks are `table` into `out` (token-major, as many
    /// rows as it holds): for a latent pool, the latent rows, which the
    /// expanded form of latent attention recomputes keys and values from.
    pub(crate) fn load_keys(&self, layer: usize, table: &[u32], pos: usize, out: &mut [f32]) {
        self.keys.load(layer, self.block_size, table, pos, out)
    }
}

/// DeepSeek-V4's compressed entries (and the indexer's keys beside them)
/// in a pool's blocks: entry `w` of a layer compressing `rate` tokens
/// lives in the block that holds its window's last position, at its place
/// among that block's closed windows. A block's rows thus depend only on
/// its own and earlier positions, so a full block can be shared through
/// the prefix cache.
pub(crate) struct Entries<'a> {
    rows: &'a mut EntryRows,
    block_size: usize,
}

impl Entries<'_> {
    /// Entry `w`'s place among a sequence's rows of a layer compressing
    /// `rate` tokens (see the type), and the layer's rows per block.
    fn pos(&self, w: usize, rate: usize) -> (usize, usize) {
        let bs = self.block_size;
        let last = (w + 1) * rate - 1;
        let rows = EntryShape::block_rows(rate, bs);
        ((last / bs) * rows + (last % bs) / rate, rows)
    }

    /// Stores compressed entry `w` (`row`, `[dim]`) of compressing layer
    /// `layer`, and its indexer key (`[index_dim]`) if given, for the
    /// sequence whose blocks are `table` (checked by the caller).
    pub(crate) fn store(
        &mut self,
        (layer, rate): (usize, usize),
        table: &[u32],
        w: usize,
        (row, index): (&[f32], Option<&[f32]>),
    ) {
        let (pos, br) = self.pos(w, rate);
        let (dim, index_dim) = (self.rows.shape.dim, self.rows.shape.index_dim);
        self.rows.keys[layer].store_rows(row, (br, 1, dim), table, pos);
        if let (Some(Some(ix)), Some(index)) = (self.rows.index.get_mut(layer), index) {
            ix.store_rows(index, (br, 1, index_dim), table, pos);
        }
    }

    /// Widens compressed entry `w` of layer `layer` into `out` (`[dim]`),
    /// or its indexer key (`[index_dim]`) with `index`.
    pub(crate) fn load(
        &self,
        (layer, rate): (usize, usize),
        table: &[u32],
        (w, index): (usize, bool),
        out: &mut [f32],
    ) {
        let (pos, br) = self.pos(w, rate);
        let shape = &self.rows.shape;
        match (index, self.rows.index.get(layer)) {
            (true, Some(Some(ix))) => ix.load_rows(out, (br, 1, shape.index_dim), table, pos),
            _ => self.rows.keys[layer].load_rows(out, (br, 1, shape.dim), table, pos),
        }
    }
}

/// Keys and values of one sequence: a pool of one block of `capacity`
/// positions.
pub struct KvCache {
    pool: KvPool,
    len: usize,
    /// The length at which the state in [`SAVED_SLOT`] was saved, which
    /// [`KvCache::truncate`] can go back to (see [`KvCache::save_state`]).
    saved: Option<usize>,
}

/// A copy between state slots that a [`KvCache`] made, which the other
/// ranks of a parallel run make in theirs too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateCopy {
    pub from: usize,
    pub to: usize,
}

/// A [`KvCache`]'s state slots: the sequence's, and the saved one.
pub const STATE_SLOTS: usize = 2;
const SAVED_SLOT: usize = 1;

/// The one block of a [`KvCache`].
pub(crate) const SINGLE_TABLE: [u32; 1] = [0];

impl KvCache {
    pub fn new(shape: KvShape, capacity: usize) -> Result<Self, ModelError> {
        Self::with_states(shape, StateShape::default(), capacity)
    }

    /// [`Self::new`] for a model that keeps a state per sequence: the
    /// sequence's in slot 0, a saved one in slot 1 ([`STATE_SLOTS`]).
    pub fn with_states(
        shape: KvShape,
        states: StateShape,
        capacity: usize,
    ) -> Result<Self, ModelError> {
        let capacity = capacity.max(1);
        Ok(KvCache {
            pool: KvPool::with_states(shape, states, STATE_SLOTS, capacity, 1)?,
            len: 0,
            saved: None,
        })
    }

    /// Adds DeepSeek-V4's compressed entries (see [`KvPool::with_entries`]).
    ///
    /// # Errors
    /// As [`KvPool::with_entries`].
    pub fn with_entries(mut self, shape: EntryShape) -> Result<Self, ModelError> {
        self.pool = self.pool.with_entries(shape)?;
        Ok(self)
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

    pub(crate) fn pool(&self) -> &KvPool {
        &self.pool
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
    /// A state goes back [`StateShape::rewind`] tokens at most (none for
    /// a linear-attention one): further back, such a cache goes back to
    /// the state [`Self::save_state`] saved if that is at most `len`
    /// tokens in, else to the start; [`Self::len`] says where it is.
    /// Returns the copy it made to go back, if it made one.
    pub fn truncate(&mut self, len: usize) -> Option<StateCopy> {
        let len = self.len.min(len);
        let rewind = self.pool.state_shape().rewind;
        if self.pool.states.is_none() || self.len - len <= rewind {
            self.len = len;
            return None;
        }
        let restore = StateCopy {
            from: SAVED_SLOT,
            to: 0,
        };
        match self.saved {
            Some(at) if at <= len && self.pool.copy_state(SAVED_SLOT, 0).is_ok() => {
                self.len = at;
                Some(restore)
            }
            _ => {
                self.len = 0;
                None
            }
        }
    }

    /// Whether the cache keeps a state per sequence (linear-attention
    /// layers, DeepSeek-V4's rings and tails) beside its rows.
    pub fn has_state(&self) -> bool {
        self.pool.states.is_some()
    }

    /// Saves the linear-attention state at the current length, so that a
    /// later [`Self::truncate`] to this length or beyond comes back to it
    /// (a benchmark's depth, a chat's previous prompt). Nothing to save
    /// without such layers. Returns the copy it made, if it made one.
    pub fn save_state(&mut self) -> Option<StateCopy> {
        self.pool.copy_state(0, SAVED_SLOT).ok()?;
        self.saved = Some(self.len);
        Some(StateCopy {
            from: 0,
            to: SAVED_SLOT,
        })
    }
}
