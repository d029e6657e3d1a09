//! Q4_K: 256 weights in 8 groups of 32, 4-bit values, 6-bit scales and mins.
//!
//! Block (144 bytes): `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]`.
//! Each 64 weights use 32 bytes of `qs`: low nibbles are group `2c`, high
//! nibbles group `2c + 1`. `w = d·scale · q - dmin·min`.

use super::fields::{blocks, f16_at};
use kvant_core::dtype::QK_K;

pub(crate) const BLOCK_BYTES: usize = 2 + 2 + 12 + QK_K / 2;

/// Scale and min of group `j` (0..8) from the 12 packed bytes shared by Q4_K
/// and Q5_K: groups 0..4 keep 6 bits in bytes `j` and `j + 4`; groups 4..8
/// take a nibble from byte `j + 4` and their top two bits from the spare
/// bits of bytes `j - 4` and `j`.
pub(crate) fn scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// Per-group `(d·scale, dmin·min)` of one Q4_K/Q5_K block.
fn group_scales(b: &[u8]) -> [(f32, f32); 8] {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let packed = &b[4..16];
    std::array::from_fn(|j| {
        let (sc, m) = scale_min(j, packed);
        (d * sc as f32, dmin * m as f32)
    })
}

/// The eight 6-bit scales, then the eight mins, of a Q4_K/Q5_K block's 12
/// packed bytes (as `scale_min` reads them), one per byte of four
/// little-endian words: word-wide masks and shifts (ggml's `utmp` trick)
/// instead of sixteen byte lookups, and no byte stores for a vector load to
/// wait on.
#[cfg(any(target_arch = "x86_64", test))]
fn unpack_scales(packed: &[u8; 12]) -> [u32; 4] {
    const LOW6: u32 = 0x3F3F_3F3F;
    const LOW4: u32 = 0x0F0F_0F0F;
    const LOW2: u32 = 0x0303_0303;
    let word =
        |i: usize| u32::from_le_bytes([packed[i], packed[i + 1], packed[i + 2], packed[i + 3]]);
    let (a, b, c) = (word(0), word(4), word(8));
    [
        a & LOW6,
        (c & LOW4) | (((a >> 6) & LOW2) << 4),
        b & LOW6,
        ((c >> 4) & LOW4) | (((b >> 6) & LOW2) << 4),
    ]
}

/// ggml's `nearest_int`: round to nearest, ties to even, by adding
/// 1.5·2²³ and reading the mantissa (exact for |v| < 2²²).
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// ggml's `make_qkx2_quants` for one group of 32 (`nmax` 15, `rmin` -1,
/// `rdelta` 0.1, 20 steps, squared error): the scale and the (negated) min
/// of `x ≈ scale·L - min` with `L` in `0..=15`, the weighted error least
/// over 21 candidate scales, each refined by weighted least squares. The
/// float operations are ggml's, in its order (ggml's base library is built
/// without FMA contraction), so the bytes are llama-quantize's.
fn group_scale_min(x: &[f32], w: &[f32], l_out: &mut [u8]) -> (f32, f32) {
    const NMAX: i32 = 15;
    let (rmin, rdelta, nstep) = (-1.0f32, 0.1f32, 20);
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let mut iscale = NMAX as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, NMAX);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + NMAX as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, NMAX);
            aux[i] = l as u8;
            let lf = l as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The first pass over one 256-value block: each group's scale and min
/// and first-pass values.
type FirstPass = fn(&[f32], &mut [u8; QK_K]) -> ([f32; 8], [f32; 8]);

/// [`FirstPass`] group by group: weights `rms(group) + |x|`, then
/// [`group_scale_min`].
fn first_pass_ref(x: &[f32], l: &mut [u8; QK_K]) -> ([f32; 8], [f32; 8]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let g = &x[32 * j..32 * (j + 1)];
        let mut sum_x2 = 0f32;
        for &v in g {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let w: [f32; 32] = std::array::from_fn(|i| av_x + g[i].abs());
        (scales[j], mins[j]) = group_scale_min(g, &w, &mut l[32 * j..32 * (j + 1)]);
    }
    (scales, mins)
}

/// ggml's `quantize_row_q4_K_ref` (no importance matrix): each group of
/// 32 gets a scale and min from [`group_scale_min`] (weights
/// `rms(group) + |x|`), the block's largest of each becomes the f16 `d`
/// and `dmin` (over 63), the groups' 6-bit multiples of them are packed
/// as [`scale_min`] reads them, and every value is rounded again against
/// the stored scale and min. A group whose stored scale is 0 keeps its
/// first-pass values, as in ggml.
pub(crate) fn quantize_ref(src: &[f32], dst: &mut [u8]) {
    quantize_blocks(src, dst, first_pass_ref);
}

/// [`quantize_ref`] with the first pass run on eight lanes, one group
/// each: the same bytes. Loading a 0.9B-parameter bf16 checkpoint with
/// `--quantize q4_k` took 30.8 s with the reference, 5.8 s with this
/// (`tools/bench/isq_load.py`, 2 threads, Zen 4).
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn quantize_avx2(src: &[f32], dst: &mut [u8]) {
    // SAFETY: the caller guarantees AVX2.
    quantize_blocks(src, dst, |x, l| unsafe { avx2::first_pass(x, l) });
}

fn quantize_blocks(src: &[f32], dst: &mut [u8], first_pass: FirstPass) {
    debug_assert_eq!(src.len() / QK_K * BLOCK_BYTES, dst.len());
    for (x, b) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BLOCK_BYTES))
    {
        let mut l = [0u8; QK_K];
        let (scales, mins) = first_pass(x, &mut l);
        let (mut max_scale, mut max_min) = (0f32, 0f32);
        for j in 0..8 {
            if scales[j] > max_scale {
                max_scale = scales[j];
            }
            if mins[j] > max_min {
                max_min = mins[j];
            }
        }
        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let packed = &mut b[4..16];
        packed.fill(0);
        for j in 0..8 {
            // C stores the int in a `uint8_t` (wrapping) before the min.
            let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                packed[j] = ls;
                packed[j + 4] = lm;
            } else {
                packed[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
                packed[j - 4] |= (ls >> 4) << 6;
                packed[j] |= (lm >> 4) << 6;
            }
        }
        let d = half::f16::from_f32(max_scale / 63.0);
        let dmin = half::f16::from_f32(max_min / 63.0);
        b[..2].copy_from_slice(&d.to_le_bytes());
        b[2..4].copy_from_slice(&dmin.to_le_bytes());
        for j in 0..8 {
            let (sc, m) = scale_min(j, &b[4..16]);
            let d = d.to_f32() * sc as f32;
            if d == 0.0 {
                continue;
            }
            let dm = dmin.to_f32() * m as f32;
            for i in 32 * j..32 * (j + 1) {
                l[i] = nearest_int((x[i] + dm) / d).clamp(0, 15) as u8;
            }
        }
        for (c, q) in b[16..].chunks_exact_mut(32).enumerate() {
            for i in 0..32 {
                q[i] = l[64 * c + i] | (l[64 * c + i + 32] << 4);
            }
        }
    }
}

/// Chunk `c` of a Q4_K/Q5_K block: `c`, its 32 bytes of `qs`, its 64
/// weights, and its two groups' `(d·scale, dmin·min)`.
pub(crate) type GroupPair<'a> = (usize, &'a [u8], &'a mut [f32], [(f32, f32); 2]);

/// The reference walk of a Q4_K/Q5_K block `b` of weights `y`: chunk
/// `c` of 64 weights (the low nibbles of its 32 bytes of `qs`, then the
/// high ones) with the `(d·scale, dmin·min)` of its two groups.
#[inline(always)]
pub(crate) fn group_pairs<'a>(
    b: &[u8],
    qs: &'a [u8],
    y: &'a mut [f32],
) -> impl Iterator<Item = GroupPair<'a>> {
    let groups = group_scales(b);
    qs.chunks_exact(32)
        .zip(y.chunks_exact_mut(64))
        .enumerate()
        .map(move |(c, (q, y))| (c, q, y, [groups[2 * c], groups[2 * c + 1]]))
}

pub(crate) fn dequantize_ref(src: &[u8], dst: &mut [f32]) {
    for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
        for (_, q, y, [(d1, m1), (d2, m2)]) in group_pairs(b, &b[16..], y) {
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::super::fields::blocks;
    use super::super::simd::{f16_pair_splat, lane, store_affine_u8x32};
    use super::{unpack_scales, BLOCK_BYTES, QK_K};
    use std::arch::x86_64::*;

    /// `super::nearest_int` on eight lanes.
    #[inline(always)]
    unsafe fn nearest_int(v: __m256) -> __m256i {
        let magic = _mm256_add_ps(v, _mm256_set1_ps(12_582_912.0));
        let bits = _mm256_and_si256(_mm256_castps_si256(magic), _mm256_set1_epi32(0x007f_ffff));
        _mm256_sub_epi32(bits, _mm256_set1_epi32(0x0040_0000))
    }

    /// `nearest_int(v)` clamped to `0..=15`, as a float.
    #[inline(always)]
    unsafe fn level(v: __m256) -> __m256 {
        let l = _mm256_min_epi32(
            _mm256_max_epi32(nearest_int(v), _mm256_setzero_si256()),
            _mm256_set1_epi32(15),
        );
        _mm256_cvtepi32_ps(l)
    }

    /// `a` where `mask`, else `b`.
    #[inline(always)]
    unsafe fn pick(mask: __m256, a: __m256, b: __m256) -> __m256 {
        _mm256_blendv_ps(b, a, mask)
    }

    /// `super::first_pass_ref` with lane `j` doing group `j`: every lane
    /// runs the reference's float operations in the reference's order
    /// (multiplies and adds apart, no FMA; IEEE division and square root;
    /// comparisons false on NaN as in C), and the branches become masks,
    /// so the results are the same bits.
    ///
    /// # Safety
    /// The CPU supports AVX2; `x` holds 256 values.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn first_pass(x: &[f32], l_out: &mut [u8; QK_K]) -> ([f32; 8], [f32; 8]) {
        debug_assert_eq!(x.len(), QK_K);
        // Lanes across groups: xs[i] holds value i of each group.
        let xs: [__m256; 32] = std::array::from_fn(|i| {
            let lane: [f32; 8] = std::array::from_fn(|j| x[32 * j + i]);
            // SAFETY: an 8-float array is 32 bytes; unaligned load.
            unsafe { _mm256_loadu_ps(lane.as_ptr()) }
        });
        let sign = _mm256_set1_ps(-0.0);
        let mut sum_x2 = _mm256_setzero_ps();
        for &v in &xs {
            sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(v, v));
        }
        let av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, _mm256_set1_ps(32.0)));
        let w: [__m256; 32] =
            std::array::from_fn(|i| _mm256_add_ps(av_x, _mm256_andnot_ps(sign, xs[i])));

        let (mut min, mut max) = (xs[0], xs[0]);
        let mut sum_w = w[0];
        let mut sum_x = _mm256_mul_ps(sum_w, xs[0]);
        for i in 1..32 {
            min = pick(_mm256_cmp_ps::<_CMP_LT_OQ>(xs[i], min), xs[i], min);
            max = pick(_mm256_cmp_ps::<_CMP_GT_OQ>(xs[i], max), xs[i], max);
            sum_w = _mm256_add_ps(sum_w, w[i]);
            sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(w[i], xs[i]));
        }
        let zero = _mm256_setzero_ps();
        min = pick(_mm256_cmp_ps::<_CMP_GT_OQ>(min, zero), zero, min);
        let flat = _mm256_cmp_ps::<_CMP_EQ_OQ>(max, min);
        let flat_min = min;
        let iscale = _mm256_div_ps(_mm256_set1_ps(15.0), _mm256_sub_ps(max, min));
        let mut scale = _mm256_div_ps(_mm256_set1_ps(1.0), iscale);
        let mut best = zero;
        let mut l: [__m256; 32] = [zero; 32];
        for i in 0..32 {
            l[i] = level(_mm256_mul_ps(iscale, _mm256_sub_ps(xs[i], min)));
            let diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, l[i]), min), xs[i]);
            best = _mm256_add_ps(best, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
        }
        let (rmin, rdelta) = (-1.0f32, 0.1f32);
        for is in 0..=20 {
            // The min a better candidate found is the next one's origin,
            // as in ggml.
            let num = rmin + rdelta * is as f32 + 15.0;
            let iscale = _mm256_div_ps(_mm256_set1_ps(num), _mm256_sub_ps(max, min));
            let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
            let mut aux: [__m256; 32] = [zero; 32];
            for i in 0..32 {
                aux[i] = level(_mm256_mul_ps(iscale, _mm256_sub_ps(xs[i], min)));
                let wl = _mm256_mul_ps(w[i], aux[i]);
                sum_l = _mm256_add_ps(sum_l, wl);
                sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wl, aux[i]));
                sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wl, xs[i]));
            }
            let det = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
            let solvable = _mm256_cmp_ps::<_CMP_GT_OQ>(det, zero);
            let mut this_scale = _mm256_div_ps(
                _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l)),
                det,
            );
            let mut this_min = _mm256_div_ps(
                _mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl)),
                det,
            );
            let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(this_min, zero);
            this_scale = pick(positive, _mm256_div_ps(sum_xl, sum_l2), this_scale);
            this_min = pick(positive, zero, this_min);
            let mut cur = zero;
            for i in 0..32 {
                let diff = _mm256_sub_ps(
                    _mm256_add_ps(_mm256_mul_ps(this_scale, aux[i]), this_min),
                    xs[i],
                );
                cur = _mm256_add_ps(cur, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
            }
            let better = _mm256_and_ps(solvable, _mm256_cmp_ps::<_CMP_LT_OQ>(cur, best));
            for i in 0..32 {
                l[i] = pick(better, aux[i], l[i]);
            }
            best = pick(better, cur, best);
            scale = pick(better, this_scale, scale);
            min = pick(better, this_min, min);
        }
        // A flat group: all values 0, scale 0, its min as first clamped.
        scale = pick(flat, zero, scale);
        min = pick(flat, flat_min, min);
        let neg_min = _mm256_xor_ps(min, sign);
        let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(scales.as_mut_ptr(), scale);
        _mm256_storeu_ps(mins.as_mut_ptr(), neg_min);
        for (i, v) in l.iter().enumerate() {
            let mut lane = [0f32; 8];
            _mm256_storeu_ps(lane.as_mut_ptr(), pick(flat, zero, *v));
            for j in 0..8 {
                l_out[32 * j + i] = lane[j] as u8;
            }
        }
        (scales, mins)
    }

    /// Bit-identical to the reference (multiply, then subtract; no FMA; the
    /// group scales are the reference's `d·scale` and `dmin·min` products).
    ///
    /// # Safety
    /// The CPU supports AVX2 (lengths only need to match for a meaningful result).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dequantize(src: &[u8], dst: &mut [f32]) {
        let mask = _mm256_set1_epi8(0x0F);
        for (b, y) in blocks::<BLOCK_BYTES, QK_K>(src, dst) {
            // SAFETY: `b` is one whole block.
            let (sc, mn) = scales_mins(b.as_ptr());
            for (c, (q, y)) in b[16..]
                .chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
            {
                let (d1, m1) = (lane(sc, 2 * c), lane(mn, 2 * c));
                let (d2, m2) = (lane(sc, 2 * c + 1), lane(mn, 2 * c + 1));
                // SAFETY: `q` is 32 bytes and `y` 64 floats.
                let q = _mm256_loadu_si256(q.as_ptr() as *const __m256i);
                let lo = _mm256_and_si256(q, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                let y = y.as_mut_ptr();
                store_affine_u8x32(lo, [d1, d1], [m1, m1], y);
                store_affine_u8x32(hi, [d2, d2], [m2, m2], y.add(32));
            }
        }
    }

    /// `(d·scale, dmin·min)` of the eight groups of a Q4_K/Q5_K block, as
    /// two vectors (lane `g`: group `g`).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `w` is valid for 16 bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn scales_mins(w: *const u8) -> (__m256, __m256) {
        let [a, b, c, d] = unpack_scales(&*(w.add(4) as *const [u8; 12])).map(|u| u as i32);
        let v = _mm_setr_epi32(a, b, c, d);
        let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        let (d, dmin) = f16_pair_splat(w);
        (_mm256_mul_ps(sc, d), _mm256_mul_ps(mn, dmin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn unpacked_scales_match_scale_min() {
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        for _ in 0..2000 {
            let packed: [u8; 12] = rng.random();
            let words = unpack_scales(&packed);
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            for j in 0..8 {
                assert_eq!(
                    (bytes[j], bytes[8 + j]),
                    scale_min(j, &packed),
                    "{packed:?} group {j}"
                );
            }
        }
    }
}
