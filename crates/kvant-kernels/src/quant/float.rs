//! Plain float rows: f32, f16 and bf16, stored little-endian.
//!
//! They go through the same row interface as the block formats so a matmul
//! or an embedding lookup does not care how a checkpoint stored its weights.

/// f32 row: a copy of the little-endian values.
pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len() * 4);
    for (b, y) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// 32-bit integers as floats (exact up to 2^24; index tables, whose
/// values are far below).
pub(crate) fn dequantize_i32(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len() * 4);
    for (b, y) in src.chunks_exact(4).zip(dst.iter_mut()) {
        *y = i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32;
    }
}

/// IEEE half: exact widening through the `half` crate.
pub(crate) fn dequantize_f16_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len() * 2);
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// bfloat16 is the top half of an f32, so widening is a 16-bit shift.
pub(crate) fn dequantize_bf16_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len() * 2);
    for (b, y) in src.chunks_exact(2).zip(dst.iter_mut()) {
        *y = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// F16C widening, 8 values per instruction; bit-identical to the reference
    /// (f16 → f32 is exact).
    ///
    /// # Safety
    /// The CPU supports AVX2 and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
        let mut s = src.chunks_exact(16);
        let mut d = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s).zip(&mut d) {
            // SAFETY: `s` holds 16 bytes and `d` 8 floats; both unaligned.
            let h = _mm_loadu_si128(s.as_ptr() as *const __m128i);
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        super::dequantize_f16_ref(s.remainder(), d.into_remainder());
    }

    /// bf16 widening by zero-extension and shift; bit-identical to the reference.
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
        let mut s = src.chunks_exact(16);
        let mut d = dst.chunks_exact_mut(8);
        for (s, d) in (&mut s).zip(&mut d) {
            // SAFETY: `s` holds 16 bytes and `d` 8 floats; both unaligned.
            let h = _mm_loadu_si128(s.as_ptr() as *const __m128i);
            let w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_castsi256_ps(w));
        }
        super::dequantize_bf16_ref(s.remainder(), d.into_remainder());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i32_values_widen_exactly() {
        let values = [0i32, 1, -1, 255, -7, 1 << 24, i32::MIN];
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut out = vec![f32::NAN; values.len()];
        dequantize_i32(&bytes, &mut out);
        for (v, o) in values.iter().zip(&out) {
            assert_eq!(*o, *v as f32);
        }
    }
}
