//! NVFP4: 64 e2m1 weights in four sub-blocks of 16, each with an unsigned
//! e4m3 scale.
//!
//! Block (36 bytes): `d: [u8; 4]` (one scale per sub-block), `qs: [u8; 32]`.
//! Sub-block `s` has bytes `qs[8s..8s + 8]`: byte `j` holds its weight `j`
//! in the low nibble and weight `j + 8` in the high one;
//! `w = kvalues[q] · ue4m3(d_s) / 2` ([`E2M1_DOUBLED`]), as ggml computes it.

use super::fields::{blocks, E2M1_DOUBLED};
use kvant_core::dtype::QK_NVFP4;

/// Weights per scale.
const SUB: usize = 16;
pub(crate) const BLOCK_BYTES: usize = QK_NVFP4 / SUB + QK_NVFP4 / 2;

/// ggml's `ggml_ue4m3_to_fp32`: half the value of an unsigned e4m3 scale
/// (0 and 0x7F, its NaN, read as 0; otherwise bit 7 ignored, so 0xFF is
/// 0x7F's bits read as a number, 480). The value is exact in f32, and so
/// is its half.
pub(crate) fn ue4m3_half(x: u8) -> f32 {
    if x == 0 || x == 0x7F {
        return 0.0;
    }
    match x & 0x7F {
        // e4m3fn's NaN pattern, which ggml reads as 1.875 · 2^8.
        0x7F => 240.0,
        m => super::fp8::e4m3_to_f32(m) * 0.5,
    }
}

/// ggml's `dequantize_row_nvfp4`.
pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK_NVFP4>(src, dst) {
        for s in 0..QK_NVFP4 / SUB {
            let d = ue4m3_half(b[s]);
            let qs = &b[4 + 8 * s..4 + 8 * s + 8];
            let yb = &mut y[SUB * s..SUB * (s + 1)];
            for j in 0..SUB / 2 {
                yb[j] = E2M1_DOUBLED[(qs[j] & 0x0F) as usize] as f32 * d;
                yb[j + SUB / 2] = E2M1_DOUBLED[(qs[j] >> 4) as usize] as f32 * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every scale byte against ggml's formula spelled out.
    #[test]
    fn scales_are_ggmls() {
        for x in 0..=255u8 {
            let want = if x == 0 || x == 0x7F {
                0.0
            } else {
                let (exp, man) = ((x >> 3 & 0x0F) as i32, (x & 7) as f32);
                let raw = match exp {
                    0 => man * 2f32.powi(-9),
                    e => (1.0 + man / 8.0) * 2f32.powi(e - 7),
                };
                raw * 0.5
            };
            assert_eq!(super::ue4m3_half(x), want, "{x:#x}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::mxfp4::avx2::e2m1_table;
    use super::{ue4m3_half, BLOCK_BYTES, QK_NVFP4, SUB};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference: the same `kvalue as f32 * d` per lane.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mask = _mm_set1_epi8(0x0F);
        let table = e2m1_table();
        for (b, y) in blocks::<BLOCK_BYTES, QK_NVFP4>(src, dst) {
            let y = y.as_mut_ptr();
            for s in 0..QK_NVFP4 / SUB {
                let d = _mm256_set1_ps(ue4m3_half(b[s]));
                // SAFETY: `b` is one whole block: sub-block `s` has 8 quant
                // bytes at offset 4 + 8s.
                let q = _mm_loadl_epi64(b.as_ptr().add(4 + 8 * s) as *const __m128i);
                let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, mask));
                let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), mask));
                for (k, half) in [lo, hi].into_iter().enumerate() {
                    let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half));
                    // SAFETY: `y` points at 64 floats; this store covers
                    // 16s + 8k..16s + 8k + 8.
                    _mm256_storeu_ps(y.add(SUB * s + 8 * k), _mm256_mul_ps(v, d));
                }
            }
        }
    }
}
