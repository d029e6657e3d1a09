//! How attention sees one layer of a KV cache: head-major rows of `f32` or
//! `f16`.
//!
//! Layout `[n_kv_heads, capacity, head_dim]`: the keys one work item reads
//! (one KV head, consecutive positions) are contiguous, so a tile is one
//! sequential read the prefetchers follow, not `head_dim` floats every
//! `kv_dim` (the token-major layout's stride). `f16` halves the bytes a
//! decode step streams; tiles are widened to f32 once per item and tile
//! (F16C when the CPU has it), and all arithmetic stays f32.

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

/// One layer's keys and values, `[n_kv_heads, capacity, head_dim]` each,
/// of which positions `0..len` are valid.
#[derive(Clone, Copy)]
pub struct KvLayer<'a, T> {
    pub k: &'a [T],
    pub v: &'a [T],
    pub capacity: usize,
    pub len: usize,
}

impl<T: KvElem> KvLayer<'_, T> {
    /// Widens rows `j0..j0 + n` of KV head `h`'s keys and values into the
    /// first `n * head_dim` values of `kt` and `vt`.
    pub(super) fn widen_tile(
        &self,
        hd: usize,
        h: usize,
        j0: usize,
        n: usize,
        kt: &mut [f32],
        vt: &mut [f32],
    ) {
        let r = (h * self.capacity + j0) * hd..(h * self.capacity + j0 + n) * hd;
        T::widen(&self.k[r.clone()], &mut kt[..n * hd]);
        T::widen(&self.v[r], &mut vt[..n * hd]);
    }
}

/// Writes `n` tokens' keys or values (`src`, token-major `[n, n_kv_heads *
/// head_dim]`) at positions `pos..pos + n` of a head-major layer `dst`.
///
/// # Panics
/// If the positions exceed `capacity` or the slices disagree (a bug in the caller).
pub fn store_rows<T: KvElem>(
    src: &[f32],
    dst: &mut [T],
    capacity: usize,
    head_dim: usize,
    pos: usize,
) {
    let kv_dim = dst.len() / capacity.max(1);
    let n_kv = kv_dim / head_dim.max(1);
    assert_eq!(src.len() % kv_dim.max(1), 0);
    let n = src.len() / kv_dim.max(1);
    assert!(pos + n <= capacity, "KV rows past the capacity");
    for (t, row) in src.chunks_exact(kv_dim.max(1)).enumerate() {
        for h in 0..n_kv {
            let at = (h * capacity + pos + t) * head_dim;
            T::narrow(
                &row[h * head_dim..(h + 1) * head_dim],
                &mut dst[at..at + head_dim],
            );
        }
    }
}
