//! The scalar int8 kernel: one group of 8 packed rows against one token.
//!
//! Integer sums are exact; the float work per block and lane is the same
//! sequence of roundings as the AVX2 kernel's (`acc = fma(Σq·x, d_w·d_x,
//! acc)`, then `acc = fma(m_w, s_x, acc)`), so the two agree bit for bit.

use super::pack::{PackedFormat, GROUP};
use kvant_core::dtype::QK;

fn f16(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32()
}

/// `Σ_i w[r, i] · x[i]` for the 8 rows of a group (`w` holds its packed
/// blocks), with `x` given as quants, block scales and scaled block sums.
pub(crate) fn group_dot(
    format: PackedFormat,
    w: &[u8],
    xq: &[i8],
    xd: &[f32],
    xs: &[f32],
) -> [f32; GROUP] {
    let bb = format.block_bytes();
    let hdr = format.header();
    let mut acc = [0f32; GROUP];
    for (b, blk) in w.chunks_exact(bb).enumerate() {
        let x = &xq[b * QK..(b + 1) * QK];
        for (r, acc) in acc.iter_mut().enumerate() {
            let d = f16(blk, r);
            let mut isum = 0i32;
            for i in 0..QK {
                let q = match format {
                    PackedFormat::Q8 => blk[hdr + 32 * (i / 4) + 4 * r + i % 4] as i8 as i32,
                    PackedFormat::Q4Sym | PackedFormat::Q4Asym => {
                        let byte = blk[hdr + 32 * (i % 16 / 4) + 4 * r + i % 4];
                        (if i < 16 { byte & 0x0F } else { byte >> 4 }) as i32
                    }
                };
                isum += q * x[i] as i32;
            }
            *acc = (isum as f32).mul_add(d * xd[b], *acc);
            let m = match format {
                PackedFormat::Q8 => continue,
                PackedFormat::Q4Sym => -8.0 * d,
                PackedFormat::Q4Asym => f16(&blk[2 * GROUP..], r),
            };
            *acc = m.mul_add(xs[b], *acc);
        }
    }
    acc
}
