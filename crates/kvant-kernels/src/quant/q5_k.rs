//! Q5_K: 256 weights in 8 groups of 32, 5-bit values, 6-bit scales and mins.
//!
//! Block (176 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]` (packed as in
//! Q4_K), `qh: [u8; 32]`, `qs: [u8; 128]`. Low nibbles are laid out as in
//! Q4_K; bit `g` of `qh[l]` is the fifth bit of weight `l` of group `g`.
//! `w = d·scale · q - dmin·min`.

use super::q4_k::group_scales;
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = 2 + 2 + 12 + QK_K / 8 + QK_K / 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() / BLOCK_BYTES * QK_K, dst.len());
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let groups = group_scales(b);
        let qh = &b[16..48];
        for (c, (ql, y)) in b[48..]
            .chunks_exact(32)
            .zip(y.chunks_exact_mut(64))
            .enumerate()
        {
            let (d1, m1) = groups[2 * c];
            let (d2, m2) = groups[2 * c + 1];
            for l in 0..32 {
                let h1 = ((qh[l] >> (2 * c)) & 1) << 4;
                let h2 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
                y[l] = d1 * ((ql[l] & 0x0F) | h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) | h2) as f32 - m2;
            }
        }
    }
}
