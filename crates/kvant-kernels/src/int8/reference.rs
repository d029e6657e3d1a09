//! The scalar int8 kernel: one group of 8 packed rows against one token.
//!
//! Integer sums are exact; the float work per block and lane is the same
//! sequence of roundings as the AVX2 kernel's (`acc = fma(Σq·x, d_w·d_x,
//! acc)`, then `acc = fma(m_w, s_x, acc)`), so the two agree bit for bit.

use super::pack::{PackedFormat, GROUP, Q5K_HIGH, Q6K_HIGH, Q6K_SUBS, SUBS};
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
    match format {
        PackedFormat::Q4K => return q4k_group_dot::<false>(w, xq, xd, xs),
        PackedFormat::Q5K => return q4k_group_dot::<true>(w, xq, xd, xs),
        PackedFormat::Q6K => return q6k_group_dot(w, xq, xd),
        PackedFormat::Mxfp4 => return mxfp4_group_dot(w, xq, xd),
        _ => {}
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
                    // (The k-quants returned above.)
                    PackedFormat::Q4Sym
                    | PackedFormat::Q4Asym
                    | PackedFormat::Q4K
                    | PackedFormat::Q5K
                    | PackedFormat::Q6K
                    | PackedFormat::Mxfp4 => {
                        let byte = blk[hdr + 32 * (i % 16 / 4) + 4 * r + i % 4];
                        (if i < 16 { byte & 0x0F } else { byte >> 4 }) as i32
                    }
                };
                isum += q * x[i] as i32;
            }
            *acc = (isum as f32).mul_add(d * xd[b], *acc);
            let m = match format {
                PackedFormat::Q8
                | PackedFormat::Q4K
                | PackedFormat::Q5K
                | PackedFormat::Q6K
                | PackedFormat::Mxfp4 => continue,
                PackedFormat::Q4Sym => -8.0 * d,
                PackedFormat::Q4Asym => f16(&blk[2 * GROUP..], r),
            };
            *acc = m.mul_add(xs[b], *acc);
        }
    }
    acc
}

/// [`group_dot`] for `Q4K` (and `Q5K` when `FIVE`, each `q` with its fifth
/// bit): per sub-block `j`, `acc = fma(Σq·x, (d·sc_j)·d_x, acc)`, then
/// `acc = fma(-(dmin·m_j), s_x, acc)`. `Σq·x` is exact in i32 and in f32
/// (at most `32·31·127 < 2^24`).
fn q4k_group_dot<const FIVE: bool>(w: &[u8], xq: &[i8], xd: &[f32], xs: &[f32]) -> [f32; GROUP] {
    let format = if FIVE {
        PackedFormat::Q5K
    } else {
        PackedFormat::Q4K
    };
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
                    let mut q = if high { byte >> 4 } else { byte & 0x0F };
                    if FIVE {
                        let bits = blk[Q5K_HIGH + 32 * (i / 4) + 4 * r + i % 4];
                        q |= (bits >> j & 1) << 4;
                    }
                    isum += q as i32 * xv as i32;
                }
                *acc = (isum as f32).mul_add(d * sc * xd[xb], *acc);
                *acc = (-(dmin * m)).mul_add(xs[xb], *acc);
            }
        }
    }
    acc
}

/// [`group_dot`] for `Mxfp4`: per block `acc = fma(Σk·x, d·d_x, acc)`
/// with `k` the doubled e2m1 value of each code (exact in i32: at most
/// `32·12·127`) and `d = 2^(e − 128)`. The AVX2 kernel sums `(k + 12)·x`
/// and takes `12·Σx` off, the same integer, then rounds the same two
/// operations.
fn mxfp4_group_dot(w: &[u8], xq: &[i8], xd: &[f32]) -> [f32; GROUP] {
    let format = PackedFormat::Mxfp4;
    let (bb, hdr) = (format.block_bytes(), format.header());
    let mut acc = [0f32; GROUP];
    for (b, blk) in w.chunks_exact(bb).enumerate() {
        let x = &xq[b * QK..(b + 1) * QK];
        for (r, acc) in acc.iter_mut().enumerate() {
            let d = crate::quant::e8m0_half(blk[r]);
            let isum: i32 = (0..QK)
                .map(|i| {
                    let byte = blk[hdr + 32 * (i % 16 / 4) + 4 * r + i % 4];
                    let code = if i < 16 { byte & 0x0F } else { byte >> 4 };
                    crate::quant::E2M1_DOUBLED[code as usize] as i32 * x[i] as i32
                })
                .sum();
            *acc = (isum as f32).mul_add(d * xd[b], *acc);
        }
    }
    acc
}

/// The signed value `q - 32` of weight `w` (of 256) of row `r` in a packed
/// `Q6K` block (layout in `pack`).
fn q6k_weight(blk: &[u8], r: usize, w: usize) -> i32 {
    let (u, s, h, k, i) = (w / 64, w / 32 % 2, w / 16 % 2, w / 4 % 4, w % 4);
    let hdr = PackedFormat::Q6K.header();
    let low = blk[hdr + 32 * (8 * u + 4 * h + k) + 4 * r + i] >> (4 * s) & 0x0F;
    let high = blk[Q6K_HIGH + 32 * (4 * u + k) + 4 * r + i] >> (2 * (s + 2 * h)) & 3;
    (low | high << 4) as i32 - 32
}

/// [`group_dot`] for `Q6K`: per activation block of 32, which meets two
/// weight sub-blocks of 16, `Σ = sc_1·Σ_{0..16} q·x + sc_2·Σ_{16..32} q·x`
/// in i32 (exact: at most `2·128·16·32·127 < 2^24`, so also exact as an
/// f32), then `acc = fma(Σ, d·d_x, acc)`: one rounding of the integer sum's
/// scale and one of the accumulation per block, as for `Q8`. The AVX2
/// kernel reaches the same integer by another exact route (unsigned `q`,
/// the offset subtracted per sub-block) and rounds the same two operations,
/// so the two agree bit for bit.
fn q6k_group_dot(w: &[u8], xq: &[i8], xd: &[f32]) -> [f32; GROUP] {
    let bb = PackedFormat::Q6K.block_bytes();
    let mut acc = [0f32; GROUP];
    for (sb, blk) in w.chunks_exact(bb).enumerate() {
        for (r, acc) in acc.iter_mut().enumerate() {
            let d = f16(blk, r);
            for a in 0..Q6K_SUBS / 2 {
                let xb = sb * Q6K_SUBS / 2 + a;
                let x = &xq[xb * QK..(xb + 1) * QK];
                let mut isum = 0i32;
                for (h, x) in x.chunks_exact(QK / 2).enumerate() {
                    let sc = blk[2 * GROUP + GROUP * (2 * a + h) + r] as i8 as i32;
                    let dot: i32 = x
                        .iter()
                        .enumerate()
                        .map(|(i, &xv)| q6k_weight(blk, r, QK * a + QK / 2 * h + i) * xv as i32)
                        .sum();
                    isum += sc * dot;
                }
                *acc = (isum as f32).mul_add(d * xd[xb], *acc);
            }
        }
    }
    acc
}
