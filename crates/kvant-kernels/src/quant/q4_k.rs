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

/// The eight 6-bit scales, then the eight mins, of a Q4_K/Q5_K block's 12
/// packed bytes (as `scale_min` reads them), one per byte of four
/// little-endian words: word-wide masks and shifts (ggml's `utmp` trick)
/// instead of sixteen byte lookups, and no byte stores for a vector load to
/// wait on.
#[cfg(any(target_arch = "x86_64", test))]
pub(crate) fn unpack_scales(packed: &[u8; 12]) -> [u32; 4] {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word =
        |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    [
        a & LOW6,
        (c & LOW4) | (((a >> 6) & LOW2) << 4),
        b & LOW6,
        ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4),
    ]
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
    use super::super::fused::{dot32, lane, load32, FusedBlock, Super};
    use super::super::simd::{f16_pair_splat, nibbles, store_affine_u8x32};
    use super::{unpack_scales, BLOCK_BYTES, QK_K};
    use kvant_core::DType;
    use std::arch::x86_64::*;

    /// Bit-identical to the reference (multiply, then subtract; no FMA; the
    /// group scales are the reference's `d·scale` and `dmin·min` products).
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
            // SAFETY: `b` is one whole block.
            let (sc, mn) = scales_mins(b.as_ptr());
            for (c, (q, y)) in b[16..]
                .chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
            {
                let (d1, m1) = (lane(sc, 2 * c), lane(mn, 2 * c));
                let (d2, m2) = (lane(sc, 2 * c + 1), lane(mn, 2 * c + 1));
                // SAFETY: `q` is 32 bytes and `y` 64 floats.
                let q = _mm256_loadu_si256(q.as_ptr() as *const __m256i);
                let lo = _mm256_and_si256(q, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                let y = y.as_mut_ptr();
                store_affine_u8x32(lo, [d1, d1], [m1, m1], y);
                store_affine_u8x32(hi, [d2, d2], [m2, m2], y.add(32));
            }
        }
    }

    /// `(d·scale, dmin·min)` of the eight groups of a Q4_K/Q5_K block, as
    /// two vectors (lane `g`: group `g`).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `w` is valid for 16 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn scales_mins(w: *const u8) -> (__m256, __m256) {
        let [a, b, c, d] = unpack_scales(&*(w.add(4) as *const [u8; 12])).map(|u| u as i32);
        let v = _mm_setr_epi32(a, b, c, d);
        let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        let (d, dmin) = f16_pair_splat(w);
        (_mm256_mul_ps(sc, d), _mm256_mul_ps(mn, dmin))
    }

    /// The fused Q4_K row kernel: per group `g` of 32,
    /// `d·scale_g·Σ q·x - dmin·min_g·Σ x`, the second term one FMA over the
    /// eight precomputed group sums.
    pub(crate) struct Fused;

    // SAFETY: `dot` reads the 144 bytes of one block; `Super` covers 256
    // floats and 8 sums.
    unsafe impl FusedBlock for Fused {
        const DTYPE: DType = DType::Q4_K;
        const ELEMS: usize = QK_K;
        const BYTES: usize = BLOCK_BYTES;
        const SUM_GROUP: usize = 32;
        type X = Super;

        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn prepare(x: *const f32, sums: *const f32) -> Super {
            Super::new(x, sums, 8)
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn dot(w: *const u8, x: &Super, acc: __m256) -> __m256 {
            let (sc, mn) = scales_mins(w);
            let mut acc = _mm256_fnmadd_ps(mn, x.sums[0], acc);
            let z = _mm256_setzero_ps();
            for c in 0..4 {
                let q = w.add(16 + 32 * c);
                let [a0, a1, a2, a3] = nibbles(q);
                let [b0, b1, b2, b3] = nibbles(q.add(16));
                let xs = x.x.add(64 * c);
                let lo = dot32([a0, a1, b0, b1], &load32(xs), z);
                let hi = dot32([a2, a3, b2, b3], &load32(xs.add(32)), z);
                acc = _mm256_fmadd_ps(lane(sc, 2 * c), lo, acc);
                acc = _mm256_fmadd_ps(lane(sc, 2 * c + 1), hi, acc);
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
    fn unpacked_scales_match_scale_min() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for _ in 0..2000 {
            let packed: [u8; 12] = rng.random();
            let words = unpack_scales(&packed);
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            for j in 0..8 {
                assert_eq!(
                    (bytes[j], bytes[8 + j]),
                    scale_min(j, &packed),
                    "{packed:?} group {j}"
                );
            }
        }
    }
}
