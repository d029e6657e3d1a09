//! Q5_0: 32 weights as 5-bit values with an offset of 16, one f16 scale.
//!
//! Block (22 bytes): `d: f16`, `qh: u32` (little-endian; bit `j` is the fifth
//! bit of weight `j`), `qs: [u8; 16]` (low nibbles ordered as in Q4_0);
//! `w = (q - 16) · d`.

use super::fields::{blocks, f16_at, five_bit_values};
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 2 + 4 + QK / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
        let d = f16_at(b, 0);
        for (y, q) in y.iter_mut().zip(five_bit_values(&b[2..6], &b[6..])) {
            *y = (q as i32 - 16) as f32 * d;
        }
    }
}

/// ggml's `quantize_row_q5_0_ref`: per block the value of largest
/// magnitude (its sign kept) sets `d = max / -16`; each value becomes
/// `min(31, trunc(x / d + 16.5))`, its low nibble in `qs` and its fifth bit
/// in `qh`. `d` is stored as f16 while the values use the f32 `d`. It is
/// llama.cpp's fallback for Q4_K rows that are not whole 256-value blocks.
pub(crate) fn quantize_ref(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(src.len() / QK * BLOCK_BYTES, dst.len());
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let d = super::fields::signed_absmax(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        // C's `(int8_t)` conversion truncates toward zero, as `as i8` does
        // (the argument lies in about 0.5..32.5).
        let q = |v: f32| ((v * id + 16.5) as i8).min(31) as u8;
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let (q0, q1) = (q(x[j]), q(x[j + QK / 2]));
            b[6 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            qh |= u32::from(q0 >> 4) << j;
            qh |= u32::from(q1 >> 4) << (j + QK / 2);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::{f16_splat, five_bit_values};
    use super::{BLOCK_BYTES, QK};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference: `((q | h) - 16) as f32 * d` per lane.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let sixteen = _mm256_set1_epi32(16);
        for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
            // SAFETY: `b` is one whole block: `qh` at 2, 16 quant bytes at 6.
            let p = b.as_ptr();
            let d = f16_splat(p);
            let values = five_bit_values(p.add(2), p.add(6));
            for (k, q) in values.into_iter().enumerate() {
                let v = _mm256_sub_epi32(q, sixteen);
                // SAFETY: `y` holds 32 floats; this writes 8k..8k+8.
                _mm256_storeu_ps(
                    y.as_mut_ptr().add(8 * k),
                    _mm256_mul_ps(_mm256_cvtepi32_ps(v), d),
                );
            }
        }
    }
}
