//! Q5_K: 256 weights in 8 groups of 32, 5-bit values, 6-bit scales and mins.
//!
//! Block (176 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]` (packed as in
//! Q4_K), `qh: [u8; 32]`, `qs: [u8; 128]`. Low nibbles are laid out as in
//! Q4_K; bit `g` of `qh[l]` is the fifth bit of weight `l` of group `g`.
//! `w = d·scale · q - dmin·min`.

use super::fields::blocks;
use super::q4_k::group_pairs;
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = 2 + 2 + 12 + QK_K / 8 + QK_K / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
        let qh = &b[16..48];
        for (c, ql, y, [(d1, m1), (d2, m2)]) in group_pairs(b, &b[48..], y) {
            for l in 0..32 {
                let h1 = ((qh[l] >> (2 * c)) & 1) << 4;
                let h2 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
                y[l] = d1 * ((ql[l] & 0x0F) | h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) | h2) as f32 - m2;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::q4_k::avx2::scales_mins;
    use super::super::simd::{lane, store_affine_u8x32};
    use super::{BLOCK_BYTES, QK_K};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference (multiply, then subtract; no FMA).
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let (m4, bit4) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
        for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
            let p = b.as_ptr();
            // SAFETY (loads): `b` is one whole block: scales at 4, `qh` at
            // 16..48, the 128 low-nibble bytes at 48.
            let (sc, mn) = scales_mins(p);
            let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
            // Bit `g` of each `qh` byte moved to bit 4 (16-bit shifts leak
            // across the byte pair only into bits the mask clears).
            let fifth = |g: i32| {
                let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(g));
                _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4)
            };
            for (c, y) in y.chunks_exact_mut(64).enumerate() {
                let q = _mm256_loadu_si256(p.add(48 + 32 * c) as *const __m256i);
                let lo = _mm256_or_si256(_mm256_and_si256(q, m4), fifth(2 * c as i32));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                    fifth(2 * c as i32 + 1),
                );
                let (d1, m1) = (lane(sc, 2 * c), lane(mn, 2 * c));
                let (d2, m2) = (lane(sc, 2 * c + 1), lane(mn, 2 * c + 1));
                // SAFETY: `y` holds 64 floats.
                let y = y.as_mut_ptr();
                store_affine_u8x32(lo, [d1, d1], [m1, m1], y);
                store_affine_u8x32(hi, [d2, d2], [m2, m2], y.add(32));
            }
        }
    }
}
