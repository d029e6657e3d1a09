//! Fields every ggml block format reads or sets the same way: the
//! little-endian f16 scales, and the signed maximum that sets a symmetric
//! quantizer's scale.

/// Little-endian f16 at byte `off` of a block, widened exactly to f32.
pub(super) fn f16_at(block: &[u8], off: usize) -> f32 {
    half::f16::from_le_bytes([block[off], block[off + 1]]).to_f32()
}

/// The value of largest magnitude in `x`, its sign kept (the first of
/// equal magnitudes; 0 for none): what sets the scale of ggml's symmetric
/// legacy quantizers (Q4_0, Q5_0).
pub(super) fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}
