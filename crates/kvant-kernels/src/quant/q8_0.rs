//! Q8_0: 32 signed bytes with one f16 scale; `w = q · d`.
//!
//! Block (34 bytes): `d: f16`, `qs: [i8; 32]`.

use super::fields::{blocks, f16_at};
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 2 + QK;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK>(src, dst) {
        let d = f16_at(b, 0);
        for (y, &q) in y.iter_mut().zip(&b[2..]) {
            *y = q as i8 as f32 * d;
        }
    }
}

/// ggml's `quantize_row_q8_0_ref`: per block `d = max|x| / 127`, `q =
/// round(x / d)`. kvant reads Q8_0 weights from checkpoints; it writes them
/// only for weights it derives at load time (a transposed copy of a stored
/// matrix), so they run on the same int8 kernels.
pub(crate) fn quantize_ref(src: &[f32], dst: &mut [u8]) {
    debug_assert_eq!(src.len() / QK * BLOCK_BYTES, dst.len());
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = (v * id).round() as i8 as u8;
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::simd::f16_splat;
    use super::{BLOCK_BYTES, QK};
    use std::arch::x86_64::*;

    /// Bit-identical to the reference.
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK)) {
            // SAFETY: the scale is the block's first two bytes. (Splat
            // from a broadcast load: `_mm256_set1_ps(f16_at(..))` compiled
            // to a `vpinsrw` merging into the previous block's product
            // register, a dependency chain that halved the speed.)
            let d = f16_splat(b.as_ptr());
            let q = b.as_ptr().add(2);
            let y = y.as_mut_ptr();
            for k in 0..4 {
                // SAFETY: bytes 2 + 8k .. 2 + 8k + 8 lie in the 34-byte block;
                // the store covers floats 8k .. 8k + 8 of the 32.
                let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(q.add(8 * k) as *const __m128i));
                _mm256_storeu_ps(y.add(8 * k), _mm256_mul_ps(_mm256_cvtepi32_ps(v), d));
            }
        }
    }
}
