//! Q3_K: 256 weights in 16 groups of 16, 3-bit values, 6-bit signed scales.
//!
//! Block (110 bytes): `hmask: [u8; 32]`, `qs: [u8; 64]`, `scales: [u8; 12]`,
//! `d: f16`. The low two bits come from `qs` as in Q2_K; bit `4h + j` of
//! `hmask[l]` is the high bit of weight `32j + l` of half `h`, and a *clear*
//! high bit subtracts 4. The 16 scales are 6 bits each: low nibbles in
//! bytes 0..8 (groups 0..8 in the low nibble, 8..16 in the high nibble), high
//! two-bit pairs in bytes 8..12 (group `g` at byte `8 + g % 4`, shift
//! `2·(g / 4)`), stored with an offset of 32. `w = d·(scale - 32) · q`.

use super::fields::{blocks, f16_at};
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;

/// The 16 signed group scales of a block.
fn scales(packed: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (g, s) in out.iter_mut().enumerate() {
        let low = if g < 8 {
            packed[g] & 0x0F
        } else {
            packed[g - 8] >> 4
        };
        let high = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
        *s = (low | (high << 4)) as i32 - 32;
    }
    out
}

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
        let hmask = &b[..32];
        let qs = &b[32..96];
        let scales = scales(&b[96..108]);
        let d = f16_at(b, 108);
        for (half, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(128)).enumerate() {
            for j in 0..4 {
                let shift = 2 * j;
                let bit = 1u8 << (4 * half + j);
                for l in 0..32 {
                    let dl = d * scales[8 * half + 2 * j + l / 16] as f32;
                    let low = ((q[l] >> shift) & 3) as i32;
                    let q3 = if hmask[l] & bit != 0 { low } else { low - 4 };
                    y[32 * j + l] = dl * q3 as f32;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::{f16_load, store_scaled_i8x32};
    use super::{scales, BLOCK_BYTES, QK_K};
    use std::arch::x86_64::*;

    /// The signed 3-bit values of weights `32j..32j+32` of half `half`: the
    /// low two bits from the half's 32 `qs` bytes, minus 4 where the
    /// `hmask` bit `4·half + j` is clear.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn values(hmask: __m256i, qs: __m256i, half: usize, j: usize) -> __m256i {
        // 16-bit shifts leak the neighbour byte only into bits the mask clears.
        let shifted = _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * j as i32));
        let low = _mm256_and_si256(shifted, _mm256_set1_epi8(3));
        let bit = _mm256_set1_epi8(1 << (4 * half + j));
        let clear = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), _mm256_setzero_si256());
        _mm256_sub_epi8(low, _mm256_and_si256(clear, _mm256_set1_epi8(4)))
    }

    /// Bit-identical to the reference: the same scalar `d·scale`, then one
    /// multiply per lane.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
            let p = b.as_ptr();
            // SAFETY (loads): `b` is one whole block: `hmask` at 0..32, `qs`
            // at 32..96, `d` at 108.
            let d = f16_load(p.add(108));
            let s = scales(&b[96..108]);
            let hmask = _mm256_loadu_si256(p as *const __m256i);
            for (half, y) in y.chunks_exact_mut(128).enumerate() {
                let qs = _mm256_loadu_si256(p.add(32 + 32 * half) as *const __m256i);
                for j in 0..4 {
                    let g = 8 * half + 2 * j;
                    let (s0, s1) = (d * s[g] as f32, d * s[g + 1] as f32);
                    let q = values(hmask, qs, half, j);
                    // SAFETY: `y` holds 128 floats; this writes 32j..32j+32.
                    let out = y.as_mut_ptr().add(32 * j);
                    store_scaled_i8x32(q, _mm256_set1_ps(s0), _mm256_set1_ps(s1), out);
                }
            }
        }
    }
}
