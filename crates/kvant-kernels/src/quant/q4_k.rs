//! Q4_K: 256 weights in 8 groups of 32, 4-bit values, 6-bit scales and mins.
//!
//! Block (144 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]`.
//! Each 64 weights use 32 bytes of `qs`: low nibbles are group `2c`, high
//! nibbles group `2c + 1`. `w = d·scale · q - dmin·min`.

use super::f16_at;
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = 2 + 2 + 12 + QK_K / 2;

/// Scale and min of group `j` (0..8) from the 12 packed bytes shared by Q4_K
/// and Q5_K: groups 0..4 keep 6 bits in bytes `j` and `j + 4`; groups 4..8
/// take a nibble from byte `j + 4` and their top two bits from the spare
/// bits of bytes `j - 4` and `j`.
pub(crate) fn scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// Per-group `(d·scale, dmin·min)` of one Q4_K/Q5_K block.
pub(crate) fn group_scales(b: &[u8]) -> [(f32, f32); 8] {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let packed = &b[4..16];
    std::array::from_fn(|j| {
        let (sc, m) = scale_min(j, packed);
        (d * sc as f32, dmin * m as f32)
    })
}

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() / BLOCK_BYTES * QK_K, dst.len());
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let groups = group_scales(b);
        for (c, (q, y)) in b[16..]
            .chunks_exact(32)
            .zip(y.chunks_exact_mut(64))
            .enumerate()
        {
            let (d1, m1) = groups[2 * c];
            let (d2, m2) = groups[2 * c + 1];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::simd::store_affine_u8x32;
    use super::{group_scales, BLOCK_BYTES, QK_K};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference (multiply, then subtract; no FMA).
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mask = _mm256_set1_epi8(0x0F);
        for (b, y) in src
            .chunks_exact(BLOCK_BYTES)
            .zip(dst.chunks_exact_mut(QK_K))
        {
            let groups = group_scales(b);
            for (c, (q, y)) in b[16..]
                .chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
            {
                let (d1, m1) = groups[2 * c];
                let (d2, m2) = groups[2 * c + 1];
                // SAFETY: `q` is 32 bytes and `y` 64 floats.
                let q = _mm256_loadu_si256(q.as_ptr() as *const __m256i);
                let lo = _mm256_and_si256(q, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                let y = y.as_mut_ptr();
                store_affine_u8x32(lo, _mm256_set1_ps(d1), _mm256_set1_ps(m1), y);
                store_affine_u8x32(hi, _mm256_set1_ps(d2), _mm256_set1_ps(m2), y.add(32));
            }
        }
    }
}
