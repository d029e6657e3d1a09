//! Q5_1: 32 weights as 5-bit values with an f16 scale and an f16 minimum.
//!
//! Block (24 bytes): `d: f16`, `m: f16`, `qh: u32`, `qs: [u8; 16]`, bits
//! ordered as in Q5_0; `w = q · d + m`.

use super::fields::{blocks, f16_at, five_bit_values};
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 2 + 2 + 4 + QK / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        for (y, q) in y.iter_mut().zip(five_bit_values(&b[4..8], &b[8..])) {
            *y = q as f32 * d + m;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::{f16_pair_splat, five_bit_values};
    use super::{BLOCK_BYTES, QK};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference: `(q | h) as f32 * d + m` per lane
    /// (multiply, then add; no FMA).
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
            // SAFETY: `b` is one whole block: `qh` at 4, 16 quant bytes at 8.
            let p = b.as_ptr();
            let (d, m) = f16_pair_splat(p);
            for (k, q) in five_bit_values(p.add(4), p.add(8)).into_iter().enumerate() {
                let v = _mm256_cvtepi32_ps(q);
                // SAFETY: `y` holds 32 floats; this writes 8k..8k+8.
                _mm256_storeu_ps(
                    y.as_mut_ptr().add(8 * k),
                    _mm256_add_ps(_mm256_mul_ps(v, d), m),
                );
            }
        }
    }
}
