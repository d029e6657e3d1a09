//! Q5_0: 32 weights as 5-bit values with an offset of 16, one f16 scale.
//!
//! Block (22 bytes): `d: f16`, `qh: u32` (little-endian; bit `j` is the fifth
//! bit of weight `j`), `qs: [u8; 16]` (low nibbles ordered as in Q4_0);
//! `w = (q - 16) · d`.

use super::f16_at;
use kvant_core::dtype::QK;

pub(crate) const BLOCK_BYTES: usize = 2 + 4 + QK / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() / BLOCK_BYTES * QK, dst.len());
    for (b, y) in src.chunks_exact(BLOCK_BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..];
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + QK / 2)) & 1) << 4;
            y[j] = (((qs[j] & 0x0F) as u32 | h0) as i32 - 16) as f32 * d;
            y[j + QK / 2] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
        }
    }
}
