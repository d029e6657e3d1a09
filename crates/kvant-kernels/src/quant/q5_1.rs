//! Q5_1: 32 weights as 5-bit values with an f16 scale and an f16 minimum.
//!
//! Block (24 bytes): `d: f16`, `m: f16`, `qh: u32`, `qs: [u8; 16]`, bits
//! ordered as in Q5_0; `w = q · d + m`.

use super::fields::f16_at;
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 2 + 2 + 4 + QK / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() / BLOCK_BYTES * QK, dst.len());
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..];
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + QK / 2)) & 1) << 4;
            y[j] = ((qs[j] & 0x0F) as u32 | h0) as f32 * d + m;
            y[j + QK / 2] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::simd::{f16_pair_splat, high_bits, nibbles_i32};
    use super::{BLOCK_BYTES, QK};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference: `(q | h) as f32 * d + m` per lane
    /// (multiply, then add; no FMA).
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let sixteen = _mm256_set1_epi32(16);
        for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK)) {
            // SAFETY: `b` is one whole block: `qh` at 4, 16 quant bytes at 8.
            let p = b.as_ptr();
            let (d, m) = f16_pair_splat(p);
            let (h, q) = (high_bits(p.add(4)), nibbles_i32(p.add(8)));
            for (k, (h, q)) in h.into_iter().zip(q).enumerate() {
                let h = _mm256_and_si256(_mm256_srai_epi32(h, 31), sixteen);
                let v = _mm256_cvtepi32_ps(_mm256_or_si256(q, h));
                // SAFETY: `y` holds 32 floats; this writes 8k..8k+8.
                _mm256_storeu_ps(
                    y.as_mut_ptr().add(8 * k),
                    _mm256_add_ps(_mm256_mul_ps(v, d), m),
                );
            }
        }
    }
}
