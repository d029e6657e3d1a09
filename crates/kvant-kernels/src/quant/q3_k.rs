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
