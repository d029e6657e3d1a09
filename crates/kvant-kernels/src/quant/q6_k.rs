//! Q6_K: 256 weights in 16 groups of 16, 6-bit values, 8-bit signed scales.
//!
//! Block (210 bytes): `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`,
//! `d: f16`. Each half of 128 weights uses 64 bytes of `ql` and 32 of `qh`:
//! for `l < 32`, weights `l`, `l+32`, `l+64`, `l+96` take the low nibble of
//! `ql[l]`, of `ql[l+32]`, the high nibble of `ql[l]`, of `ql[l+32]`, and the
//! bit pairs 0, 2, 4, 6 of `qh[l]` as their top two bits, offset by 32.
//! `w = d·scale · q`, with the scale of group `(index within half) / 16`.

use super::fields::{blocks, f16_at};
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
        let d = f16_at(b, 208);
        for (half, y) in y.chunks_exact_mut(128).enumerate() {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let sc = &b[192 + 8 * half..192 + 8 * half + 8];
            for l in 0..32 {
                let g = l / 16;
                let q = [
                    (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, q) in q.into_iter().enumerate() {
                    let scale = d * sc[g + 2 * k] as i8 as f32;
                    y[l + 32 * k] = scale * (q as i32 - 32) as f32;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::{f16_at, store_scaled_i8x32};
    use super::{BLOCK_BYTES, QK_K};
    use std::arch::x86_64::*;

    /// The signed 6-bit values (`q - 32`) of half `half` of a block at `p`:
    /// vector `k` holds weights `32k..32k+32` of the half.
    ///
    /// # Safety
    /// The CPU supports AVX2; `p` is valid for the block's 210 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn values(p: *const u8, half: usize) -> [__m256i; 4] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let ql0 = _mm256_loadu_si256(p.add(64 * half) as *const __m256i);
        let ql1 = _mm256_loadu_si256(p.add(64 * half + 32) as *const __m256i);
        let qh = _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i);
        // 16-bit shifts spill bits across the byte pair, but only into bits
        // the 0x0F / 0x30 masks then clear.
        [
            _mm256_or_si256(
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(qh, m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
            ),
        ]
        .map(|q| _mm256_sub_epi8(q, _mm256_set1_epi8(32)))
    }

    /// Bit-identical to the reference: `(d·scale) · q` per lane.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
            let d = f16_at(b, 208);
            for (half, y) in y.chunks_exact_mut(128).enumerate() {
                // SAFETY: `b` is one whole block.
                let q = values(b.as_ptr(), half);
                let sc = &b[192 + 8 * half..192 + 8 * half + 8];
                let y = y.as_mut_ptr();
                for (k, q) in q.into_iter().enumerate() {
                    let s0 = _mm256_set1_ps(d * sc[2 * k] as i8 as f32);
                    let s1 = _mm256_set1_ps(d * sc[2 * k + 1] as i8 as f32);
                    // SAFETY: `y` points at 128 floats; this writes 32k..32k+32.
                    store_scaled_i8x32(q, s0, s1, y.add(32 * k));
                }
            }
        }
    }
}
