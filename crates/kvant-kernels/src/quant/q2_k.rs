//! Q2_K: 256 weights in 16 groups of 16, 2-bit values, 4-bit scales and mins.
//!
//! Block (84 bytes): `scales: [u8; 16]` (low nibble: scale, high nibble: min of
//! group `g`), `qs: [u8; 64]`, `d: f16`, `dmin: f16`. Each half of 128 weights
//! uses 32 bytes of `qs`; shift `2j` of byte `l` (l < 32) gives weight
//! `32j + l` of that half. `w = d·scale · q - dmin·min`.

use super::fields::{blocks, f16_at};
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = QK_K / 16 + QK_K / 4 + 2 + 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
        let scales = &b[..16];
        let qs = &b[16..80];
        let d = f16_at(b, 80);
        let dmin = f16_at(b, 82);
        for (half, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(128)).enumerate() {
            for j in 0..4 {
                let shift = 2 * j;
                for (g, (q, y)) in q
                    .chunks_exact(16)
                    .zip(y[32 * j..32 * j + 32].chunks_exact_mut(16))
                    .enumerate()
                {
                    let sc = scales[8 * half + 2 * j + g];
                    let dl = d * (sc & 0x0F) as f32;
                    let ml = dmin * (sc >> 4) as f32;
                    for (y, &q) in y.iter_mut().zip(q) {
                        *y = dl * ((q >> shift) & 3) as f32 - ml;
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::{f16_load, store_affine_u8x32};
    use super::{BLOCK_BYTES, QK_K};
    use std::arch::x86_64::*;

    /// The 2-bit values of weights `32j..32j+32` of a half, from its 32 `qs`
    /// bytes (16-bit shifts leak the neighbour byte only into bits the mask
    /// clears).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn values(qs: __m256i, j: usize) -> __m256i {
        let shifted = _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * j as i32));
        _mm256_and_si256(shifted, _mm256_set1_epi8(3))
    }

    /// Bit-identical to the reference: the same scalar `d·scale` and
    /// `dmin·min`, then multiply and subtract per lane (no FMA).
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
            let p = b.as_ptr();
            // SAFETY: `b` is one whole block: `d`, `dmin` at 80 and 82.
            let (d, dmin) = (f16_load(p.add(80)), f16_load(p.add(82)));
            let scale = |g: usize| _mm256_set1_ps(d * (b[g] & 0x0F) as f32);
            let min = |g: usize| _mm256_set1_ps(dmin * (b[g] >> 4) as f32);
            for (half, y) in y.chunks_exact_mut(128).enumerate() {
                // SAFETY: `qs` bytes 16 + 32h..+32 lie in the 84-byte block.
                let qs = _mm256_loadu_si256(p.add(16 + 32 * half) as *const __m256i);
                for j in 0..4 {
                    let g = 8 * half + 2 * j;
                    // SAFETY: `y` holds 128 floats; this writes 32j..32j+32.
                    let out = y.as_mut_ptr().add(32 * j);
                    let q = values(qs, j);
                    store_affine_u8x32(q, [scale(g), scale(g + 1)], [min(g), min(g + 1)], out);
                }
            }
        }
    }
}
