//! The scalar int8 kernel: one group of 8 packed rows against one token.
//!
//! Integer sums are exact; the float work per block and lane is the same
//! sequence of roundings as the AVX2 kernel's (`acc = fma(Σq·x, d_w·d_x,
//! acc)`, then `acc = fma(m_w, s_x, acc)`), so the two agree bit for bit.

use super::pack::{PackedFormat, GROUP, SUBS};
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
    if format == PackedFormat::Q4K {
        return q4k_group_dot(w, xq, xd, xs);
    }
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
                    // (Q4K returned above.)
                    PackedFormat::Q4Sym | PackedFormat::Q4Asym | PackedFormat::Q4K => {
                        let byte = blk[hdr + 32 * (i % 16 / 4) + 4 * r + i % 4];
                        (if i < 16 { byte & 0x0F } else { byte >> 4 }) as i32
                    }
                };
                isum += q * x[i] as i32;
            }
            *acc = (isum as f32).mul_add(d * xd[b], *acc);
            let m = match format {
                PackedFormat::Q8 | PackedFormat::Q4K => continue,
                PackedFormat::Q4Sym => -8.0 * d,
                PackedFormat::Q4Asym => f16(&blk[2 * GROUP..], r),
            };
            *acc = m.mul_add(xs[b], *acc);
        }
    }
    acc
}

/// [`group_dot`] for `Q4K`: per sub-block `j`, `acc = fma(Σq·x, (d·sc_j)·d_x,
/// acc)`, then `acc = fma(-(dmin·m_j), s_x, acc)`.
fn q4k_group_dot(w: &[u8], xq: &[i8], xd: &[f32], xs: &[f32]) -> [f32; GROUP] {
    let format = PackedFormat::Q4K;
    let (bb, hdr) = (format.block_bytes(), format.header());
    let mut acc = [0f32; GROUP];
    for (sb, blk) in w.chunks_exact(bb).enumerate() {
        for (r, acc) in acc.iter_mut().enumerate() {
            let d = f16(blk, r);
            let dmin = f16(&blk[2 * GROUP..], r);
            for j in 0..SUBS {
                let sc = blk[4 * GROUP + GROUP * j + r] as f32;
                let m = blk[4 * GROUP + GROUP * (SUBS + j) + r] as f32;
                let xb = sb * SUBS + j;
                let x = &xq[xb * QK..(xb + 1) * QK];
                let (pair, high) = (j / 2, j % 2 == 1);
                let mut isum = 0i32;
                for (i, &xv) in x.iter().enumerate() {
                    let byte = blk[hdr + 32 * (8 * pair + i / 4) + 4 * r + i % 4];
                    let q = if high { byte >> 4 } else { byte & 0x0F };
                    isum += q as i32 * xv as i32;
                }
                *acc = (isum as f32).mul_add(d * sc * xd[xb], *acc);
                *acc = (-(dmin * m)).mul_add(xs[xb], *acc);
            }
        }
    }
    acc
}
