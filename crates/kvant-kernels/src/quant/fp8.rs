//! FP8 e4m3 weights with an f32 scale per 128 values of a row
//! ([`DType::F8_B128`](kvant_core::DType::F8_B128)).
//!
//! Block (132 bytes): `d: f32` (little-endian), `q: [u8; 128]` e4m3
//! (`e4m3fn`: sign, 4 exponent bits with bias 7, 3 mantissa bits; no
//! infinities, `S.1111.111` is NaN); `w = e4m3(q) · d`, the product
//! DeepSeek's and transformers' dequantizers take with `weight_scale_inv`
//! (`d`). The loader (`kvant-model`'s safetensors reader) builds the rows
//! from a `weight` and its 128×128 scale grid and refuses NaN codes, so the
//! kernels never meet one.

use super::fields::blocks;
use kvant_core::dtype::QK_F8;

pub(crate) const BLOCK_BYTES: usize = 4 + QK_F8;

/// The value of an e4m3fn code (NaN for `0x7F` and `0xFF`).
pub fn e4m3_to_f32(q: u8) -> f32 {
    if q & 0x7F == 0x7F {
        return f32::NAN;
    }
    let exp = (q >> 3 & 0x0F) as i32;
    let man = (q & 7) as f32;
    // 4-bit significands times powers of two: exact in f32.
    let mag = if exp == 0 {
        man * (2f32).powi(-9)
    } else {
        (1.0 + man / 8.0) * (2f32).powi(exp - 7)
    };
    if q & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK_F8>(src, dst) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (y, &q) in y.iter_mut().zip(&b[4..]) {
            *y = e4m3_to_f32(q) * d;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::{BLOCK_BYTES, QK_F8};
    use std::arch::x86_64::*;

    /// e4m3 codes to f32 through F16C: the code's 7 magnitude bits placed
    /// at the top of an f16's exponent and mantissa (`q << 7`), the sign at
    /// bit 15, give exactly `e4m3(q) / 256` (f16's exponent bias is 8 more
    /// than e4m3's; e4m3 subnormals land on f16 subnormals of the same
    /// significand), so one exact multiply by 256 restores the value.
    /// NaN codes come out finite (480): the loader refuses them.
    ///
    /// Bit-identical to the reference for every other code: the value is
    /// exact, then multiplied by the scale once, as there.
    ///
    /// # Safety
    /// The CPU supports AVX2 and F16C (lengths only need to match for a
    /// meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let sign = _mm256_set1_epi16(0x80);
        let magnitude = _mm256_set1_epi16(0x7F);
        let k256 = _mm256_set1_ps(256.0);
        for (b, y) in blocks::<BLOCK_BYTES, QK_F8>(src, dst) {
            let d = _mm256_set1_ps(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let y = y.as_mut_ptr();
            for c in 0..QK_F8 / 16 {
                // SAFETY: `b` is one whole block: 128 codes at offset 4.
                let q = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                    b.as_ptr().add(4 + 16 * c) as *const __m128i
                ));
                let h = _mm256_or_si256(
                    _mm256_slli_epi16(_mm256_and_si256(q, sign), 8),
                    _mm256_slli_epi16(_mm256_and_si256(q, magnitude), 7),
                );
                let lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k256);
                let hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k256);
                // SAFETY: `y` points at 128 floats; these cover 16c..16c+16.
                _mm256_storeu_ps(y.add(16 * c), _mm256_mul_ps(lo, d));
                _mm256_storeu_ps(y.add(16 * c + 8), _mm256_mul_ps(hi, d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_against_its_definition() {
        // The e4m3fn values spelled out: 0, the subnormals m/8 · 2^-6,
        // the normals (1 + m/8) · 2^(e-7), the largest 448, NaN.
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x3C), 1.5);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        // Monotone over the positive codes.
        for q in 1..0x7Fu8 {
            assert!(e4m3_to_f32(q) > e4m3_to_f32(q - 1), "{q:#x}");
        }
    }
}
