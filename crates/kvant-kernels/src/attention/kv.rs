//! How attention sees one layer of a KV cache: fixed-size blocks of
//! head-major rows of `f32` or `f16`, addressed through each sequence's
//! block table.
//!
//! Within a block, layout `[n_kv_heads, block_size, head_dim]`: the keys one
//! work item reads (one KV head, consecutive positions) are contiguous for
//! a whole block, so a tile is one or two sequential reads the prefetchers
//! follow, not `head_dim` floats every `kv_dim` (a token-major stride).
//! `f16` halves the bytes a decode step streams; tiles are widened to f32
//! once per item and tile (F16C when the CPU has it), and all arithmetic
//! stays f32.

use half::slice::HalfFloatSliceExt;

/// An element type a KV cache can hold.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// Narrows `src` into `dst` (same length), rounding to nearest.
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl KvElem for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for half::f16 {
    fn widen(src: &[half::f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len());
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::tier() >= crate::cpu::SimdTier::Avx2 {
            // SAFETY: the start-up tier has AVX2, which implies F16C here
            // (the tier requires it); lengths are equal (asserted).
            return unsafe { widen_f16c(src, dst) };
        }
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [half::f16]) {
        dst.convert_from_f32_slice(src);
    }
}

/// f16 → f32, 8 values per instruction, inlined into the tile loop (the
/// `half` crate's slice conversion calls a function per 8 values).
///
/// # Safety
/// The CPU supports F16C and AVX; `src` and `dst` have equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_f16c(src: &[half::f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n8 = src.len() / 8 * 8;
    let (s, d) = (src.as_ptr() as *const u8, dst.as_mut_ptr());
    for i in (0..n8).step_by(8) {
        // SAFETY: `i + 8 <= len` for both slices (2 and 4 bytes per value).
        let h = unsafe { _mm_loadu_si128(s.add(2 * i) as *const __m128i) };
        unsafe { _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(h)) };
    }
    for (o, h) in dst[n8..].iter_mut().zip(&src[n8..]) {
        *o = h.to_f32();
    }
}

/// One layer's keys and values in fixed-size blocks (PagedAttention):
/// keys `[n_blocks, n_kv_heads, block_size, head_dim]`, values the same
/// with `v_dim`. Within a block the layout is head-major, so a key tile of
/// one head is contiguous for up to `block_size` positions. A contiguous
/// cache is the special case of one block of `capacity` positions.
#[derive(Clone, Copy)]
pub struct KvBlocks<'a, T> {
    pub k: &'a [T],
    /// `None` when the values are the first `v_dim` elements of each key
    /// row: multi-head latent attention caches one latent vector per
    /// token (its compressed KV followed by the rotary key part) that
    /// serves as both, so only it is stored and streamed.
    pub v: Option<&'a [T]>,
    pub block_size: usize,
}

impl<T: KvElem> KvBlocks<'_, T> {
    /// Elements per block of rows of `dim` values.
    pub(super) fn block_elems(&self, n_kv_heads: usize, dim: usize) -> usize {
        n_kv_heads * self.block_size * dim
    }

    /// Blocks held (the valid range of table entries).
    pub(super) fn n_blocks(&self, n_kv_heads: usize, head_dim: usize) -> usize {
        self.k.len() / self.block_elems(n_kv_heads, head_dim).max(1)
    }

    /// Widens positions `j0..j0 + n` of KV head `h` of the sequence whose
    /// blocks are `table` (position `j` is slot `j % block_size` of block
    /// `table[j / block_size]`) into the first `n * head_dim` values of `kt`
    /// and (stored values only) the first `n * v_dim` of `vt`, one
    /// contiguous run per block crossed.
    #[allow(clippy::too_many_arguments)] // a tile's address, unpacked
    pub(super) fn widen_tile(
        &self,
        table: &[u32],
        n_kv_heads: usize,
        (hd, vd): (usize, usize),
        h: usize,
        j0: usize,
        n: usize,
        kt: &mut [f32],
        vt: &mut [f32],
    ) {
        let bs = self.block_size;
        let (k_block, v_block) = (
            self.block_elems(n_kv_heads, hd),
            self.block_elems(n_kv_heads, vd),
        );
        let mut j = j0;
        while j < j0 + n {
            let (b, slot) = (table[j / bs] as usize, j % bs);
            let run = (bs - slot).min(j0 + n - j);
            let row = h * bs + slot;
            let (src, dst) = (b * k_block + row * hd, (j - j0) * hd);
            T::widen(&self.k[src..src + run * hd], &mut kt[dst..dst + run * hd]);
            if let Some(v) = self.v {
                let (src, dst) = (b * v_block + row * vd, (j - j0) * vd);
                T::widen(&v[src..src + run * vd], &mut vt[dst..dst + run * vd]);
            }
            j += run;
        }
    }
}

impl<T: KvElem> KvBlocks<'_, T> {
    /// Widens the rows of KV head `h` at `positions` (any order) into the
    /// first `positions.len() * head_dim` values of `kt` and (stored values
    /// only) `positions.len() * v_dim` of `vt`: the gathered tile of a
    /// sparse attention kernel.
    #[allow(clippy::too_many_arguments)] // a gathered tile's address, unpacked
    pub(super) fn widen_rows(
        &self,
        table: &[u32],
        n_kv_heads: usize,
        (hd, vd): (usize, usize),
        h: usize,
        positions: &[u32],
        kt: &mut [f32],
        vt: &mut [f32],
    ) {
        let bs = self.block_size;
        let (k_block, v_block) = (
            self.block_elems(n_kv_heads, hd),
            self.block_elems(n_kv_heads, vd),
        );
        for (i, &j) in positions.iter().enumerate() {
            let j = j as usize;
            let row = h * bs + j % bs;
            let b = table[j / bs] as usize;
            let src = b * k_block + row * hd;
            T::widen(&self.k[src..src + hd], &mut kt[i * hd..(i + 1) * hd]);
            if let Some(v) = self.v {
                let src = b * v_block + row * vd;
                T::widen(&v[src..src + vd], &mut vt[i * vd..(i + 1) * vd]);
            }
        }
    }
}

/// Writes `n` tokens' keys or values (`src`, token-major `[n, n_kv_heads *
/// head_dim]`) at positions `pos..pos + n` of a sequence whose blocks are
/// `table`, in a block store `dst` laid out as [`KvBlocks`].
///
/// # Panics
/// If a position falls outside the table or a block outside `dst`, or the
/// slices disagree (a bug in the caller: block tables are engine-made).
pub fn store_rows<T: KvElem>(
    src: &[f32],
    dst: &mut [T],
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    table: &[u32],
    pos: usize,
) {
    let at = head_rows((block_size, n_kv_heads, head_dim), table, pos, src.len());
    for (at, row) in at.zip(src.chunks_exact(head_dim)) {
        T::narrow(row, &mut dst[at..at + head_dim]);
    }
}

/// Reads back positions `pos..pos + n` of a sequence whose blocks are
/// `table` from a block store `src` laid out as [`KvBlocks`], widened into
/// `dst` (token-major `[n, n_kv_heads * head_dim]`): the inverse of
/// [`store_rows`], for paths that recompute from cached rows (latent
/// attention's expanded prefill).
///
/// # Panics
/// As [`store_rows`].
pub fn load_rows<T: KvElem>(
    src: &[T],
    dst: &mut [f32],
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    table: &[u32],
    pos: usize,
) {
    let at = head_rows((block_size, n_kv_heads, head_dim), table, pos, dst.len());
    for (at, row) in at.zip(dst.chunks_exact_mut(head_dim)) {
        T::widen(&src[at..at + head_dim], row);
    }
}

/// Where the `values` token-major values from position `pos` of a sequence
/// whose blocks are `table` live in a block store laid out as
/// [`KvBlocks`]: the offset of each token's each head's `head_dim` values,
/// in that order.
fn head_rows(
    (block_size, n_kv_heads, head_dim): (usize, usize, usize),
    table: &[u32],
    pos: usize,
    values: usize,
) -> impl Iterator<Item = usize> + '_ {
    let kv_dim = n_kv_heads * head_dim;
    assert!(kv_dim > 0 && block_size > 0);
    assert_eq!(values % kv_dim, 0);
    let per_block = kv_dim * block_size;
    (pos..pos + values / kv_dim).flat_map(move |j| {
        let b = table[j / block_size] as usize;
        let slot = j % block_size;
        (0..n_kv_heads).map(move |h| b * per_block + (h * block_size + slot) * head_dim)
    })
}
