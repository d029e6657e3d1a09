//! MXFP4 (OCP microscaling FP4): 32 e2m1 weights and one e8m0 scale.
//!
//! Block (17 bytes): `e: u8`, `qs: [u8; 16]`. Byte `j` holds weight `j` in
//! its low nibble and weight `j + 16` in its high nibble, as Q4_0 does;
//! `w = kvalues[q] · 2^(e − 128)` where `kvalues` are the e2m1 values
//! doubled ([`E2M1_DOUBLED`]), as ggml computes it. The doubled values are
//! the integers −12…12, so the int8 kernels multiply them exactly
//! (`crate::int8`'s `Mxfp4` format).

use super::fields::{blocks, e8m0_half, E2M1_DOUBLED};
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 1 + QK / 2;

/// ggml's `dequantize_row_mxfp4`.
pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
        let d = e8m0_half(b[0]);
        let qs = &b[1..];
        for j in 0..QK / 2 {
            y[j] = E2M1_DOUBLED[(qs[j] & 0x0F) as usize] as f32 * d;
            y[j + QK / 2] = E2M1_DOUBLED[(qs[j] >> 4) as usize] as f32 * d;
        }
    }
}

/// The code of the doubled e2m1 value nearest `x / d` (the first of equal
/// distances, in code order), as ggml's `best_index_mxfp4` searches it.
fn best_index(x: f32, d: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (E2M1_DOUBLED[0] as f32 * d - x).abs();
    for (i, &k) in E2M1_DOUBLED.iter().enumerate().skip(1) {
        let err = (k as f32 * d - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// ggml's `quantize_row_mxfp4_ref`: the scale exponent is
/// `floor(log2(max|x|)) − 2` (so the largest magnitude lands near the top
/// e2m1 value 6 = 2^2·1.5), each weight the nearest code.
pub(crate) fn quantize_ref(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(src.len() / QK * BLOCK_BYTES, dst.len());
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = x
            .iter()
            .fold(0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        // C's `(uint8_t)` of the float: truncation, in range for finite
        // weights (|x| between 2^-125 and 2^127).
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_half(e);
        b[0] = e;
        for j in 0..QK / 2 {
            b[1 + j] = best_index(x[j], d) | best_index(x[j + QK / 2], d) << 4;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::{blocks, e8m0_half, E2M1_DOUBLED};
    use super::{BLOCK_BYTES, QK};
    use std::arch::x86_64::*;

    /// The 16 doubled e2m1 values as a byte table for `vpshufb`.
    ///
    /// # Safety
    /// The CPU supports SSE2 (every x86-64 does).
    #[inline(always)]
    pub(crate) unsafe fn e2m1_table() -> __m128i {
        // SAFETY: 16 bytes read from a 16-byte array.
        _mm_loadu_si128(E2M1_DOUBLED.as_ptr() as *const __m128i)
    }

    /// Bit-identical to the reference: the same `kvalue as f32 * d` per lane.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mask = _mm_set1_epi8(0x0F);
        let table = e2m1_table();
        for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
            let d = _mm256_set1_ps(e8m0_half(b[0]));
            // SAFETY: `b` is one whole block: 16 quant bytes start at offset 1.
            let q = _mm_loadu_si128(b.as_ptr().add(1) as *const __m128i);
            let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, mask));
            let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
            let y = y.as_mut_ptr();
            for (k, half) in [lo, hi].into_iter().enumerate() {
                let a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half));
                let c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(half, 8)));
                // SAFETY: `y` points at 32 floats; stores cover 16k..16k+16.
                _mm256_storeu_ps(y.add(16 * k), _mm256_mul_ps(a, d));
                _mm256_storeu_ps(y.add(16 * k + 8), _mm256_mul_ps(c, d));
            }
        }
    }
}
