//! AVX2 helpers shared by the fast dequantizers: f16 scales through F16C,
//! and packed integers widened to f32 lanes.
//!
//! The fast dequantizers reproduce the reference arithmetic lane by lane (a
//! multiply, then an add or subtract; never a fused FMA), so their output is
//! bit-identical to `dequantize_ref` and tests can compare them exactly.
//! F16C widening is exact, like the `half` crate's, but inline: one
//! instruction instead of a function call per scale.

use std::arch::x86_64::*;

/// The little-endian f16 at `p`, widened exactly.
///
/// # Safety
/// The CPU supports F16C; `p` is valid for a 2-byte read (unaligned).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn f16_load(p: *const u8) -> f32 {
    let h = (p as *const u16).read_unaligned();
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// [`f16_load`] at byte `off` of a block, for the dequantizers' slices.
///
/// # Panics
/// If `block` is shorter than `off + 2` (a bug in the calling kernel).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn f16_at(block: &[u8], off: usize) -> f32 {
    let bytes = &block[off..off + 2];
    // SAFETY: `bytes` holds the two bytes read; the caller's tier has F16C.
    unsafe { f16_load(bytes.as_ptr()) }
}

/// The f16 at `p` in all eight lanes (broadcast, then widen: no
/// insert-and-shuffle through a scalar).
///
/// # Safety
/// As for [`f16_load`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn f16_splat(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned()))
}

/// The two f16 at `p` and `p + 2` (a block's scale and minimum), each in
/// all eight lanes, from one 4-byte broadcast and one conversion.
///
/// # Safety
/// As for [`f16_load`], with `p` valid for 4 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn f16_pair_splat(p: *const u8) -> (__m256, __m256) {
    let v = _mm256_cvtph_ps(_mm_set1_epi32((p as *const i32).read_unaligned()));
    (_mm256_moveldup_ps(v), _mm256_movehdup_ps(v))
}

/// The four 8-lane quarters of 32 bytes as f32, read as `i8` if `SIGNED`
/// and as `u8` otherwise.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn quarters<const SIGNED: bool>(v: __m256i) -> [__m256; 4] {
    let lo = _mm256_castsi256_si128(v);
    let hi = _mm256_extracti128_si256(v, 1);
    let parts = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
    parts.map(|x| {
        let wide = if SIGNED {
            _mm256_cvtepi8_epi32(x)
        } else {
            _mm256_cvtepu8_epi32(x)
        };
        _mm256_cvtepi32_ps(wide)
    })
}

/// The 32 nibbles of 16 bytes at `p`, one per 32-bit lane, in Q4 order:
/// low nibbles of bytes 0..8 and 8..16, then high nibbles of bytes 0..8
/// and 8..16.
///
/// Widening 8 bytes straight from memory (`vpmovzxbd ymm, m64`) before
/// splitting the nibbles costs fewer instructions than splitting 16 bytes
/// and widening from a register.
///
/// # Safety
/// The CPU supports AVX2; `p` is valid for 16 bytes (unaligned).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles_i32(p: *const u8) -> [__m256i; 4] {
    let a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
    let m = _mm256_set1_epi32(0x0F);
    [
        _mm256_and_si256(a, m),
        _mm256_and_si256(b, m),
        _mm256_srli_epi32(a, 4),
        _mm256_srli_epi32(b, 4),
    ]
}

/// Writes `q[i] as f32 * d[h] - m[h]` for the 32 unsigned bytes of `q`,
/// with `h = i / 16`: one scale and minimum per group of 16 (Q2_K), or the
/// same twice for groups of 32.
///
/// # Safety
/// The CPU supports AVX2; `out` is valid for 32 float writes (unaligned).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn store_affine_u8x32(q: __m256i, d: [__m256; 2], m: [__m256; 2], out: *mut f32) {
    for (k, v) in quarters::<false>(q).into_iter().enumerate() {
        let (d, m) = (d[k / 2], m[k / 2]);
        _mm256_storeu_ps(out.add(8 * k), _mm256_sub_ps(_mm256_mul_ps(v, d), m));
    }
}

/// Writes `q[i] as f32 * s0` for the first 16 signed bytes of `q` and
/// `q[i] as f32 * s1` for the last 16.
///
/// # Safety
/// The CPU supports AVX2; `out` is valid for 32 float writes (unaligned).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn store_scaled_i8x32(q: __m256i, s0: __m256, s1: __m256, out: *mut f32) {
    for (k, v) in quarters::<true>(q).into_iter().enumerate() {
        let s = if k < 2 { s0 } else { s1 };
        _mm256_storeu_ps(out.add(8 * k), _mm256_mul_ps(v, s));
    }
}

/// Broadcasts lane `i` of `v` (a per-group scale) to all eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn lane(v: __m256, i: usize) -> __m256 {
    _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i as i32))
}

/// The 32 bits of the little-endian `u32` at `p`, one per lane in weight
/// order (lanes of vector `k` hold bits `8k..8k+8`), moved to the sign bit:
/// the fifth bits of a Q5_0/Q5_1 block, which an arithmetic shift right by
/// 31 then spreads into a mask.
///
/// # Safety
/// The CPU supports AVX2; `p` is valid for 4 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn high_bits(p: *const u8) -> [__m256i; 4] {
    let qh = _mm256_set1_epi32((p as *const i32).read_unaligned());
    // Bit j (lane j % 8 of vector j / 8) shifts left by 31 - j.
    let shift = |k: i32| {
        let b = 31 - 8 * k;
        _mm256_setr_epi32(b, b - 1, b - 2, b - 3, b - 4, b - 5, b - 6, b - 7)
    };
    [0, 1, 2, 3].map(|k| _mm256_sllv_epi32(qh, shift(k)))
}

/// The 32 five-bit values of a Q5_0/Q5_1 block as four vectors of eight
/// i32 (in weight order): the nibbles of the 16 bytes at `qs`, each with
/// 16 added where its bit of the `u32` at `qh` is set.
///
/// # Safety
/// The CPU supports AVX2; `qh` is valid for 4 bytes, `qs` for 16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn five_bit_values(qh: *const u8, qs: *const u8) -> [__m256i; 4] {
    let sixteen = _mm256_set1_epi32(16);
    let (h, q) = (high_bits(qh), nibbles_i32(qs));
    [0, 1, 2, 3].map(|k| {
        let h = _mm256_and_si256(_mm256_srai_epi32(h[k], 31), sixteen);
        _mm256_or_si256(q[k], h)
    })
}
