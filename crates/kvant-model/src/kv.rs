//! The KV cache the forward pass writes and attention reads.
//!
//! One sequence, contiguous per layer, sized up front for the request
//! (prompt + output budget) so decoding never reallocates. The paged,
//! block-table cache of the serving engine replaces this type behind the same
//! methods.

/// Keys and values of one sequence, `[capacity, kv_dim]` per layer, f32.
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    kv_dim: usize,
    capacity: usize,
    len: usize,
}

impl KvCache {
    pub fn new(n_layers: usize, kv_dim: usize, capacity: usize) -> Self {
        KvCache {
            keys: (0..n_layers)
                .map(|_| vec![0.0; capacity * kv_dim])
                .collect(),
            values: (0..n_layers)
                .map(|_| vec![0.0; capacity * kv_dim])
                .collect(),
            kv_dim,
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

    /// Bytes held, for memory reports.
    pub fn bytes(&self) -> usize {
        2 * self.keys.len() * self.capacity * self.kv_dim * std::mem::size_of::<f32>()
    }

    /// Stores `n` new tokens' keys and values of one layer after the current
    /// length and returns the layer's whole history including them.
    /// The caller has checked `len + n <= capacity`.
    pub(crate) fn append_layer(&mut self, layer: usize, k: &[f32], v: &[f32]) -> (&[f32], &[f32]) {
        let start = self.len * self.kv_dim;
        let end = start + k.len();
        self.keys[layer][start..end].copy_from_slice(k);
        self.values[layer][start..end].copy_from_slice(v);
        (&self.keys[layer][..end], &self.values[layer][..end])
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
