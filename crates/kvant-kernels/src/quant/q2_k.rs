//! Q2_K: 256 weights in 16 groups of 16, 2-bit values, 4-bit scales and mins.
//!
//! Block (84 bytes): `scales: [u8; 16]` (low nibble: scale, high nibble: min of
//! group `g`), `qs: [u8; 64]`, `d: f16`, `dmin: f16`. Each half of 128 weights
//! uses 32 bytes of `qs`; shift `2j` of byte `l` (l < 32) gives weight
//! `32j + l` of that half. `w = d·scale · q - dmin·min`.

use super::f16_at;
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = QK_K / 16 + QK_K / 4 + 2 + 2;

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(src.len() / BLOCK_BYTES * QK_K, dst.len());
    for (b, y) in src
        .chunks_exact(BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
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
