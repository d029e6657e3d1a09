//! Q4_0: 32 weights as 4-bit unsigned nibbles with an offset of 8, one f16 scale.
//!
//! Block (18 bytes): `d: f16`, `qs: [u8; 16]`. Byte `j` holds weight `j` in its
//! low nibble and weight `j + 16` in its high nibble; `w = (q - 8) · d`.

use super::fields::{blocks, f16_at};
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 2 + QK / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
        let d = f16_at(b, 0);
        let qs = &b[2..];
        for j in 0..QK / 2 {
            y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
            y[j + QK / 2] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// ggml's `quantize_row_q4_0_ref`: per block the value of largest
/// magnitude `max` (its sign kept) sets `d = max / -8`, so that it maps to
/// nibble 0 and the rest of the range to `1..=15`; each value becomes
/// `min(15, trunc(x / d + 8.5))`. `d` is stored as f16 (rounded to
/// nearest even) while the nibbles are computed with the f32 `d`, as ggml
/// does. kvant writes Q4_0 only for KV caches (`--kv-cache-type q4_0`).
pub(crate) fn quantize_ref(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(src.len() / QK * BLOCK_BYTES, dst.len());
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let d = super::fields::signed_absmax(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        // C's `(int8_t)` conversion truncates toward zero, as `as i8` does
        // (the argument lies in about 0.5..16.5).
        let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        for j in 0..QK / 2 {
            b[2 + j] = q(x[j]) | (q(x[j + QK / 2]) << 4);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::f16_splat;
    use super::{BLOCK_BYTES, QK};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference: the same `(q - 8) as f32 * d` per lane.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mask = _mm_set1_epi8(0x0F);
        let eight = _mm256_set1_epi32(8);
        for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
            // SAFETY: the scale is the block's first two bytes.
            let d = f16_splat(b.as_ptr());
            // SAFETY: `b` is one whole block: 16 quant bytes start at offset 2.
            let q = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
            let lo = _mm_and_si128(q, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
            let y = y.as_mut_ptr();
            for (k, half) in [lo, hi].into_iter().enumerate() {
                let a = _mm256_sub_epi32(_mm256_cvtepu8_epi32(half), eight);
                let c = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(half, 8)), eight);
                // SAFETY: `y` points at 32 floats; stores cover 16k..16k+16.
                _mm256_storeu_ps(y.add(16 * k), _mm256_mul_ps(_mm256_cvtepi32_ps(a), d));
                _mm256_storeu_ps(y.add(16 * k + 8), _mm256_mul_ps(_mm256_cvtepi32_ps(c), d));
            }
        }
    }
}
