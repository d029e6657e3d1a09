//! Q5_1: 32 weights as 5-bit values with an f16 scale and an f16 minimum.
//!
//! Block (24 bytes): `d: f16`, `m: f16`, `qh: u32`, `qs: [u8; 16]`, bits
//! ordered as in Q5_0; `w = q · d + m`.

use super::f16_at;
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 2 + 2 + 4 + QK / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() / BLOCK_BYTES * QK, dst.len());
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..];
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + QK / 2)) & 1) << 4;
            y[j] = ((qs[j] & 0x0F) as u32 | h0) as f32 * d + m;
            y[j + QK / 2] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fused::{dot32, high_bits, masked_sum, FusedBlock, Legacy32};
    use super::super::simd::{f16_pair_splat, nibbles};
    use super::{BLOCK_BYTES, QK};
    use kvant_core::DType;
    use std::arch::x86_64::*;

    /// The fused Q5_1 row kernel: with `h` the fifth bits,
    /// `d·(Σ q·x + 16·Σ_h x) + m·Σ x` per block.
    pub(crate) struct Fused;

    // SAFETY: `dot` reads the 24 bytes of one block, `prepare` 32 floats.
    unsafe impl FusedBlock for Fused {
        const DTYPE: DType = DType::Q5_1;
        const ELEMS: usize = QK;
        const BYTES: usize = BLOCK_BYTES;
        const SUM_GROUP: usize = 0;
        type X = Legacy32;

        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn prepare(x: *const f32, _: *const f32) -> Legacy32 {
            Legacy32::load(x, 1.0)
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn dot(w: *const u8, x: &Legacy32, acc: __m256) -> __m256 {
            let h = masked_sum(high_bits(w.add(4)), &x.x);
            let s = dot32(
                nibbles(w.add(8)),
                &x.x,
                _mm256_mul_ps(h, _mm256_set1_ps(16.0)),
            );
            let (d, m) = f16_pair_splat(w);
            _mm256_fmadd_ps(m, x.bias, _mm256_fmadd_ps(d, s, acc))
        }
    }
}
