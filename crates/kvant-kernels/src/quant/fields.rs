//! Fields every ggml block format reads or sets the same way: the
//! little-endian f16 scales, the signed maximum that sets a symmetric
//! quantizer's scale, and the walk over whole blocks and their values.

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

/// Each whole block of `src` (`BYTES` bytes) with its `N` values in `dst`,
/// in order: the walk of every reference decoder.
#[inline(always)]
pub(super) fn blocks<'a, const BYTES: usize, const N: usize>(
    src: &'a [u8],
    dst: &'a mut [f32],
) -> impl Iterator<Item = (&'a [u8], &'a mut [f32])> {
    debug_assert_eq!(src.len() / BYTES * N, dst.len());
    src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(N))
}

/// The 32 five-bit values of a Q5_0/Q5_1 block in weight order: weight
/// `j` is nibble `j % 16` of `qs` (low nibbles first) with bit `j` of the
/// little-endian `qh` as its fifth bit.
#[inline(always)]
pub(super) fn five_bit_values(qh: &[u8], qs: &[u8]) -> [u32; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut out = [0u32; 32];
    for j in 0..16 {
        out[j] = (qs[j] & 0x0F) as u32 | (((qh >> j) & 1) << 4);
        out[j + 16] = (qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
    }
    out
}

/// The e2m1 (FP4) values doubled, so that they are the integers −12…12:
/// ggml's `kvalues_fp4`, shared by MXFP4 and NVFP4. Index is the 4-bit
/// code: bit 3 the sign, then 2 exponent bits and 1 mantissa bit.
pub(crate) const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the value of an e8m0 scale byte, `2^(e − 128)`, as ggml's
/// `ggml_e8m0_to_fp32_half` builds it (denormal bit patterns for `e < 2`):
/// the scale that multiplies [`E2M1_DOUBLED`].
#[inline(always)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}
