//! AVX2 helpers shared by the fast dequantizers: widen 32 bytes to 32 floats.
//!
//! The fast dequantizers reproduce the reference arithmetic lane by lane (a
//! multiply, then an add or subtract; never a fused FMA), so their output is
//! bit-identical to `dequantize_ref` and tests can compare them exactly.

use std::arch::x86_64::*;

/// The four 8-lane quarters of 32 bytes as f32, read as `i8` if `SIGNED`
/// and as `u8` otherwise.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quarters<const SIGNED: bool>(v: __m256i) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256(v, 1);
    let parts = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
    let mut out = [_mm256_setzero_ps(); 4];
    for (o, x) in out.iter_mut().zip(parts) {
        let wide = if SIGNED {
            _mm256_cvtepi8_epi32(x)
        } else {
            _mm256_cvtepu8_epi32(x)
        };
        *o = _mm256_cvtepi32_ps(wide);
    }
    out
}

/// Writes `q[i] as f32 * d - m` for the 32 unsigned bytes of `q`.
///
/// # Safety
/// The CPU supports AVX2; `out` is valid for 32 float writes (unaligned).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn store_affine_u8x32(q: __m256i, d: __m256, m: __m256, out: *mut f32) {
    for (k, v) in quarters::<false>(q).into_iter().enumerate() {
        _mm256_storeu_ps(out.add(8 * k), _mm256_sub_ps(_mm256_mul_ps(v, d), m));
    }
}

/// Writes `q[i] as f32 * s0` for the first 16 signed bytes of `q` and
/// `q[i] as f32 * s1` for the last 16.
///
/// # Safety
/// The CPU supports AVX2; `out` is valid for 32 float writes (unaligned).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn store_scaled_i8x32(q: __m256i, s0: __m256, s1: __m256, out: *mut f32) {
    for (k, v) in quarters::<true>(q).into_iter().enumerate() {
        let s = if k < 2 { s0 } else { s1 };
        _mm256_storeu_ps(out.add(8 * k), _mm256_mul_ps(v, s));
    }
}
