//! The KV cache the forward pass writes and attention reads.
//!
//! One sequence, one buffer per layer, sized up front for the request
//! (prompt + output budget) so decoding never reallocates. Rows are stored
//! head-major (`[n_kv_heads, capacity, head_dim]`, see
//! `kvant_kernels::attention::KvLayer`) in f16 by default, which halves
//! what each decode step streams; f32 keeps results closest to an f32
//! reference. The paged, block-table cache of the serving engine replaces
//! this type behind the same methods.

use kvant_kernels::attention::{attention, store_rows, AttnParams, KvElem, KvLayer};

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

/// Every layer's keys and values in one element type.
struct Layers<T> {
    keys: Vec<Vec<T>>,
    values: Vec<Vec<T>>,
}

impl<T: KvElem + Default> Layers<T> {
    fn new(n_layers: usize, per_layer: usize) -> Self {
        Layers {
            keys: (0..n_layers)
                .map(|_| vec![T::default(); per_layer])
                .collect(),
            values: (0..n_layers)
                .map(|_| vec![T::default(); per_layer])
                .collect(),
        }
    }
}

enum Store {
    F16(Layers<half::f16>),
    F32(Layers<f32>),
}

/// Keys and values of one sequence.
pub struct KvCache {
    store: Store,
    n_kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
}

impl KvCache {
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: KvDType,
    ) -> Self {
        let per_layer = n_kv_heads * capacity * head_dim;
        KvCache {
            store: match dtype {
                KvDType::F16 => Store::F16(Layers::new(n_layers, per_layer)),
                KvDType::F32 => Store::F32(Layers::new(n_layers, per_layer)),
            },
            n_kv_heads,
            head_dim,
            capacity,
            len: 0,
        }
    }

    /// Tokens already stored (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn dtype(&self) -> KvDType {
        match self.store {
            Store::F16(_) => KvDType::F16,
            Store::F32(_) => KvDType::F32,
        }
    }

    /// Bytes held, for memory reports.
    pub fn bytes(&self) -> usize {
        let layers = match &self.store {
            Store::F16(l) => l.keys.len(),
            Store::F32(l) => l.keys.len(),
        };
        2 * layers * self.n_kv_heads * self.capacity * self.head_dim * self.dtype().bytes()
    }

    /// Stores `k` and `v` (`[n, kv_dim]`, the next `n` tokens) in one layer
    /// after the current length, then runs attention for queries `q` (the
    /// same tokens) over the layer's history including them.
    /// The caller has checked `len + n <= capacity`.
    pub(crate) fn append_and_attend(
        &mut self,
        layer: usize,
        k: &[f32],
        v: &[f32],
        p: &AttnParams,
        q: &[f32],
        out: &mut [f32],
    ) {
        let n = k.len() / (self.n_kv_heads * self.head_dim);
        match &mut self.store {
            Store::F16(l) => step(
                l,
                layer,
                self.capacity,
                self.head_dim,
                self.len,
                n,
                k,
                v,
                p,
                q,
                out,
            ),
            Store::F32(l) => step(
                l,
                layer,
                self.capacity,
                self.head_dim,
                self.len,
                n,
                k,
                v,
                p,
                q,
                out,
            ),
        }
    }

    /// Commits the tokens appended to every layer by one forward pass.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Forgets everything after the first `len` tokens (e.g. a new window).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

#[allow(clippy::too_many_arguments)] // one layer's step, unpacked from the cache
fn step<T: KvElem>(
    l: &mut Layers<T>,
    layer: usize,
    capacity: usize,
    head_dim: usize,
    pos: usize,
    n: usize,
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
    q: &[f32],
    out: &mut [f32],
) {
    store_rows(k, &mut l.keys[layer], capacity, head_dim, pos);
    store_rows(v, &mut l.values[layer], capacity, head_dim, pos);
    let kv = KvLayer {
        k: &l.keys[layer],
        v: &l.values[layer],
        capacity,
        len: pos + n,
    };
    attention(p, q, pos, &kv, out);
}
