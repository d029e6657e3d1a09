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
