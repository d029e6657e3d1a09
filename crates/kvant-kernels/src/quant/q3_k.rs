//! Q3_K: 256 weights in 16 groups of 16, 3-bit values, 6-bit signed scales.
//!
//! Block (110 bytes): `hmask: [u8; 32]`, `qs: [u8; 64]`, `scales: [u8; 12]`,
//! `d: f16`. The low two bits come from `qs` as in Q2_K; bit `4h + j` of
//! `hmask[l]` is the high bit of weight `32j + l` of half `h`, and a *clear*
//! high bit subtracts 4. The 16 scales are 6 bits each: low nibbles in
//! bytes 0..8 (groups 0..8 in the low nibble, 8..16 in the high nibble), high
//! two-bit pairs in bytes 8..12 (group `g` at byte `8 + g % 4`, shift
//! `2·(g / 4)`), stored with an offset of 32. `w = d·(scale - 32) · q`.

use super::f16_at;
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;

/// The 16 scales (offset by 32) of a block's 12 packed bytes, one per byte
/// of four little-endian words: `scales` with word-wide masks and shifts
/// (ggml's trick), for the vector kernel.
#[cfg(any(target_arch = "x86_64", test))]
pub(crate) fn unpack_scales(packed: &[u8; 12]) -> [u32; 4] {
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word =
        |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    [
        (a & LOW4) | ((c & LOW2) << 4),
        (b & LOW4) | (((c >> 2) & LOW2) << 4),
        ((a >> 4) & LOW4) | (((c >> 4) & LOW2) << 4),
        ((b >> 4) & LOW4) | (((c >> 6) & LOW2) << 4),
    ]
}

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
    debug_assert_eq!(src.len() / BLOCK_BYTES * QK_K, dst.len());
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
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
    use super::super::fused::{dot16x2, lane, load32, FusedBlock};
    use super::super::simd::{f16_load, quarters, store_scaled_i8x32};
    use super::{scales, unpack_scales, BLOCK_BYTES, QK_K};
    use kvant_core::DType;
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
        for (b, y) in src
            .chunks_exact(BLOCK_BYTES)
            .zip(dst.chunks_exact_mut(QK_K))
        {
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

    /// The fused Q3_K row kernel: per group `g` of 16, `(d·scale_g)·Σ q·x`
    /// with `q = low - 4` where the high bit is clear, built bytewise.
    pub(crate) struct Fused;

    // SAFETY: `dot` reads the 110 bytes of one block; `prepare` keeps the
    // pointer to 256 floats.
    unsafe impl FusedBlock for Fused {
        const DTYPE: DType = DType::Q3_K;
        const ELEMS: usize = QK_K;
        const BYTES: usize = BLOCK_BYTES;
        const SUM_GROUP: usize = 0;
        type X = *const f32;

        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn prepare(x: *const f32, _: *const f32) -> *const f32 {
            x
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn dot(w: *const u8, x: &*const f32, mut acc: __m256) -> __m256 {
            let d = _mm256_set1_ps(f16_load(w.add(108)));
            let [s0, s1, s2, s3] =
                unpack_scales(&*(w.add(96) as *const [u8; 12])).map(|u| u as i32);
            let s = _mm_sub_epi8(_mm_setr_epi32(s0, s1, s2, s3), _mm_set1_epi8(32));
            // Lane g of `sc[h]`: group 8h + g.
            let sc = [s, _mm_srli_si128(s, 8)]
                .map(|v| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d));
            let hmask = _mm256_loadu_si256(w as *const __m256i);
            for (half, sc) in sc.into_iter().enumerate() {
                let qs = _mm256_loadu_si256(w.add(32 + 32 * half) as *const __m256i);
                for j in 0..4 {
                    let q = quarters::<true>(values(hmask, qs, half, j));
                    let s = [lane(sc, 2 * j), lane(sc, 2 * j + 1)];
                    acc = dot16x2(q, &load32(x.add(128 * half + 32 * j)), s, acc);
                }
            }
            acc
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn unpacked_scales_match_scales() {
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        for _ in 0..2000 {
            let packed: [u8; 12] = rng.random();
            let words = unpack_scales(&packed);
            let bytes: Vec<i32> = words
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .map(|b| b as i32 - 32)
                .collect();
            assert_eq!(bytes, scales(&packed), "{packed:?}");
        }
    }
}
