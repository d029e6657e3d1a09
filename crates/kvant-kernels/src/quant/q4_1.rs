//! Q4_1: 32 weights as 4-bit nibbles with an f16 scale and an f16 minimum.
//!
//! Block (20 bytes): `d: f16`, `m: f16`, `qs: [u8; 16]`, nibbles ordered as in
//! Q4_0; `w = q · d + m`.

use super::fields::{blocks, f16_at};
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 4 + QK / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..];
        for j in 0..QK / 2 {
            y[j] = (qs[j] & 0x0F) as f32 * d + m;
            y[j + QK / 2] = (qs[j] >> 4) as f32 * d + m;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::f16_at;
    use super::{BLOCK_BYTES, QK};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference: a separate multiply and add (no FMA),
    /// as in the reference.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mask = _mm_set1_epi8(0x0F);
        for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
            let d = _mm256_set1_ps(f16_at(b, 0));
            let m = _mm256_set1_ps(f16_at(b, 2));
            // SAFETY: `b` is one whole block: 16 quant bytes start at offset 4.
            let q = _mm_loadu_si128(b.as_ptr().add(4) as *const __m128i);
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            let y = y.as_mut_ptr();
            for (k, half) in [lo, hi].into_iter().enumerate() {
                let a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half));
                let c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(half, 8)));
                // SAFETY: `y` points at 32 floats; stores cover 16k..16k+16.
                _mm256_storeu_ps(y.add(16 * k), _mm256_add_ps(_mm256_mul_ps(a, d), m));
                _mm256_storeu_ps(y.add(16 * k + 8), _mm256_add_ps(_mm256_mul_ps(c, d), m));
            }
        }
    }
}
