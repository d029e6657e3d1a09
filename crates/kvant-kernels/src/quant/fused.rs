//! Fused AVX2 row·vector products: `Σ W[r, i]·x[i]` straight from the packed
//! weights, without writing a dequantized row anywhere.
//!
//! Decoding a token streams every weight once, so the matmul is bound by how
//! fast each block turns into f32 lanes. Each format implements
//! [`FusedBlock`]: load one block, widen its integers to f32 *in registers*,
//! multiply-add them with `x`, and apply the block's scales once per block
//! rather than once per weight, using `Σ (d·q + m)·x = d·Σ q·x + m·Σ x` (the
//! per-block `Σ x` is shared by every row). [`gemv`] runs four rows per
//! pass, so each activation vector is loaded once for the four.
//!
//! Numerics: activations stay f32 and every sum accumulates in f32, as with
//! dequantize-then-dot; only the rounding order differs (the scale multiplies
//! a block's sum instead of each weight), which tests bound against the f64
//! dot of the reference weights.

use super::ref_dequantizer;
use crate::dot::avx2::{hsum, hsum4};
use kvant_core::DType;
use std::arch::x86_64::*;

/// One weight format's block, as the fused kernels see it.
///
/// # Safety
/// Implementations read exactly `BYTES` bytes at the block pointer and
/// `ELEMS` floats (plus `ELEMS / SUM_GROUP` sums) at the activation pointers.
pub(crate) unsafe trait FusedBlock {
    /// The stored type, for row sizes and the scalar tail of float rows.
    const DTYPE: DType;
    /// Weights per block.
    const ELEMS: usize;
    /// Bytes per block.
    const BYTES: usize;
    /// Elements per precomputed activation sum (see [`x_sums`]), or 0 if
    /// the format needs none.
    const SUM_GROUP: usize;
    /// One block of activations, prepared once and reused by every row.
    type X;

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `x` is valid for `ELEMS` floats
    /// and `sums` for `ELEMS / SUM_GROUP` floats (none if `SUM_GROUP` is 0).
    unsafe fn prepare(x: *const f32, sums: *const f32) -> Self::X;

    /// `acc` plus a vector whose lanes sum to the block's `Σ w·x`.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `w` is valid for `BYTES` bytes
    /// and `x` came from [`Self::prepare`] with valid pointers.
    unsafe fn dot(w: *const u8, x: &Self::X, acc: __m256) -> __m256;
}

/// The fused kernel of a type: `y[r] = Σ_i W[r, i]·x[i]` for the `y.len()`
/// rows stored back to back in `w`, with `sums` from [`x_sums`].
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C. (Lengths are asserted.)
pub(crate) type GemvFn = unsafe fn(w: &[u8], x: &[f32], sums: &[f32], y: &mut [f32]);

/// Rows dotted per pass: with four, the activation loads are amortised and
/// four independent accumulator chains hide the FMA latency.
const ROWS: usize = 4;

/// How far ahead of each row's reads to prefetch: one row group (the same
/// position four rows on, since a group's rows are contiguous), at most
/// this many bytes. Weights stream from DRAM once per token; without
/// software prefetch the block arithmetic and the memory reads barely
/// overlap, and a one-token matmul of a 42 MB weight ran at half the speed
/// (benches/matmul.rs, `dram`). Prefetching cached data costs little.
const MAX_PREFETCH: usize = 4096;

/// Cache line size, the granularity of a prefetch.
const LINE: usize = 64;

/// [`GemvFn`] for format `B`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C.
///
/// # Panics
/// If `w` does not hold `y.len()` rows of `x.len()` elements, or `sums` is
/// shorter than [`x_sums`] makes it: a bug in the calling kernel.
pub(crate) unsafe fn gemv<B: FusedBlock>(w: &[u8], x: &[f32], sums: &[f32], y: &mut [f32]) {
    let n = x.len();
    let row_bytes = match B::DTYPE.bytes_for(n) {
        Ok(b) if b.checked_mul(y.len()) == Some(w.len()) => b,
        _ => panic!(
            "fused gemv: {} bytes for {} rows of {n} {}",
            w.len(),
            y.len(),
            B::DTYPE
        ),
    };
    if row_bytes == 0 {
        y.fill(0.0);
        return;
    }
    let blocks = n / B::ELEMS;
    assert!(
        sums.len() >= blocks * sums_per_block::<B>(),
        "fused gemv: {} activation sums",
        sums.len()
    );
    let body = blocks * B::BYTES;
    let (xp, sp) = (x.as_ptr(), sums.as_ptr());
    let mut rows = w.chunks_exact(ROWS * row_bytes);
    let mut ys = y.chunks_exact_mut(ROWS);
    for (w4, y4) in (&mut rows).zip(&mut ys) {
        // SAFETY: `w4` holds four rows of `row_bytes ≥ blocks·BYTES` bytes,
        // `x` has `blocks·ELEMS` floats and `sums` enough (asserted above).
        let dots = dot_rows::<B, ROWS>(w4.as_ptr(), row_bytes, xp, sp, blocks);
        for (r, (yr, d)) in y4.iter_mut().zip(dots).enumerate() {
            *yr = d + tail::<B>(
                &w4[r * row_bytes + body..(r + 1) * row_bytes],
                &x[blocks * B::ELEMS..],
            );
        }
    }
    let rest = rows.remainder();
    for (r, yr) in ys.into_remainder().iter_mut().enumerate() {
        let row = &rest[r * row_bytes..(r + 1) * row_bytes];
        // SAFETY: as above, for one row.
        let [d] = dot_rows::<B, 1>(row.as_ptr(), row_bytes, xp, sp, blocks);
        *yr = d + tail::<B>(&row[body..], &x[blocks * B::ELEMS..]);
    }
}

/// The dot of `R` rows (`row_bytes` apart from `w`) with `x`, over `blocks` blocks.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; every row is valid for
/// `blocks·BYTES` bytes, `x` for `blocks·ELEMS` floats and `sums` for
/// `blocks·ELEMS/SUM_GROUP` floats.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows<B: FusedBlock, const R: usize>(
    w: *const u8,
    row_bytes: usize,
    x: *const f32,
    sums: *const f32,
    blocks: usize,
) -> [f32; R] {
    let sums_per_block = sums_per_block::<B>();
    let ahead = (ROWS * row_bytes).min(MAX_PREFETCH);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let xb = B::prepare(x.add(b * B::ELEMS), sums.add(b * sums_per_block));
        for (r, acc) in acc.iter_mut().enumerate() {
            let block = w.add(r * row_bytes + b * B::BYTES);
            // A prefetch is only a hint: it never faults, so it may point
            // past the end of the weights (hence `wrapping_add`).
            for line in (0..B::BYTES).step_by(LINE) {
                _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(ahead + line) as *const i8);
            }
            *acc = B::dot(block, &xb, *acc);
        }
    }
    let mut out = [0f32; R];
    if let Ok(four) = <[__m256; 4]>::try_from(&acc[..]) {
        out.copy_from_slice(&hsum4(four));
    } else {
        for (o, a) in out.iter_mut().zip(acc) {
            *o = hsum(a);
        }
    }
    out
}

/// Activation sums per block of `B` (0 if it takes none).
fn sums_per_block<B: FusedBlock>() -> usize {
    B::ELEMS.checked_div(B::SUM_GROUP).unwrap_or(0)
}

/// The elements after the last whole block: only float rows (block size 1)
/// have them, fewer than `ELEMS`, done by the reference dequantizer.
fn tail<B: FusedBlock>(w: &[u8], x: &[f32]) -> f32 {
    if x.is_empty() {
        return 0.0;
    }
    let mut buf = [0f32; 32];
    let elem_bytes = B::BYTES / B::ELEMS;
    let mut acc = 0f32;
    for (x, w) in x.chunks(buf.len()).zip(w.chunks(buf.len() * elem_bytes)) {
        let v = &mut buf[..x.len()];
        ref_dequantizer(B::DTYPE)(w, v);
        acc += v.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
    }
    acc
}

/// Sums of `x` over consecutive groups of `group` elements, one per element
/// of `out`, for formats whose blocks subtract a minimum: their kernels fold
/// `m·Σx` in once per group instead of adding `m` to every weight.
pub(crate) fn x_sums(x: &[f32], group: usize, out: &mut [f32]) {
    for (s, c) in out.iter_mut().zip(x.chunks(group.max(1))) {
        *s = c.iter().sum();
    }
}

/// The 32 activations of a legacy (32-weight) block in four registers, and
/// their sum times a per-format factor (see [`Legacy32::load`]).
pub(crate) struct Legacy32 {
    pub(crate) x: [__m256; 4],
    pub(crate) bias: __m256,
}

impl Legacy32 {
    /// Loads 32 floats; `bias` holds `factor·Σx` spread over its lanes: the
    /// offset of Q4_0/Q5_0 (`w = d·(q - 8)`: factor -8) or the sum that the
    /// minimum of Q4_1/Q5_1 multiplies (factor 1).
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA; `x` is valid for 32 floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn load(x: *const f32, factor: f32) -> Legacy32 {
        let x = load32(x);
        let sum = _mm256_add_ps(_mm256_add_ps(x[0], x[1]), _mm256_add_ps(x[2], x[3]));
        Legacy32 {
            x,
            bias: _mm256_mul_ps(sum, _mm256_set1_ps(factor)),
        }
    }
}

/// `init + Σ_k q[k]·x[k]` as one vector, in two chains so the four FMAs do
/// not wait on each other.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn dot32(q: [__m256; 4], x: &[__m256; 4], init: __m256) -> __m256 {
    let a = _mm256_fmadd_ps(q[0], x[0], init);
    let b = _mm256_mul_ps(q[2], x[2]);
    let a = _mm256_fmadd_ps(q[1], x[1], a);
    let b = _mm256_fmadd_ps(q[3], x[3], b);
    _mm256_add_ps(a, b)
}

/// `acc + s[0]·Σ_{k<2} q[k]·x[k] + s[1]·Σ_{k≥2} q[k]·x[k]`: 32 weights in
/// two groups of 16 with their own scales (Q2_K, Q3_K, Q6_K).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn dot16x2(q: [__m256; 4], x: &[__m256; 4], s: [__m256; 2], acc: __m256) -> __m256 {
    let a = _mm256_fmadd_ps(q[1], x[1], _mm256_mul_ps(q[0], x[0]));
    let b = _mm256_fmadd_ps(q[3], x[3], _mm256_mul_ps(q[2], x[2]));
    _mm256_fmadd_ps(s[1], b, _mm256_fmadd_ps(s[0], a, acc))
}

/// The eight activations at `x + 8k` for `k` in 0..4 (one 32-weight group).
///
/// # Safety
/// The CPU supports AVX2; `x` is valid for 32 floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn load32(x: *const f32) -> [__m256; 4] {
    [0, 8, 16, 24].map(|k| _mm256_loadu_ps(x.add(k)))
}

/// Broadcasts lane `i` of `v` (a per-group scale) to all eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn lane(v: __m256, i: usize) -> __m256 {
    _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i as i32))
}

/// `Σ x[k]` over the lanes whose mask has its sign bit set: the weights
/// whose fifth bit is set, in Q5 formats (`Σ (q + 16·h)·x = Σ q·x + 16·Σ_h x`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn masked_sum(sign: [__m256i; 4], x: &[__m256; 4]) -> __m256 {
    let z = _mm256_setzero_ps();
    let m = |k: usize| _mm256_blendv_ps(z, x[k], _mm256_castsi256_ps(sign[k]));
    _mm256_add_ps(_mm256_add_ps(m(0), m(1)), _mm256_add_ps(m(2), m(3)))
}

/// The 8 bytes at `p` widened to f32 lanes, unsigned or signed.
///
/// # Safety
/// The CPU supports AVX2; `p` is valid for 8 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn bytes8<const SIGNED: bool>(p: *const u8) -> __m256 {
    let v = _mm_loadl_epi64(p as *const __m128i);
    _mm256_cvtepi32_ps(if SIGNED {
        _mm256_cvtepi8_epi32(v)
    } else {
        _mm256_cvtepu8_epi32(v)
    })
}

/// Activations of a k-quant super-block: where its 256 values start, and
/// the precomputed sums (see [`x_sums`]) of its groups, when the format has
/// minimums: eight sums of 32 or sixteen of 16.
pub(crate) struct Super {
    pub(crate) x: *const f32,
    pub(crate) sums: [__m256; 2],
}

impl Super {
    /// # Safety
    /// The CPU supports AVX2; `sums` is valid for `n_sums` (0, 8 or 16) floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn new(x: *const f32, sums: *const f32, n_sums: usize) -> Super {
        let z = _mm256_setzero_ps();
        let load = |k: usize| {
            if n_sums >= 8 * (k + 1) {
                _mm256_loadu_ps(sums.add(8 * k))
            } else {
                z
            }
        };
        Super {
            x,
            sums: [load(0), load(1)],
        }
    }
}

/// The 32 bits of the little-endian `u32` at `p`, one per lane in weight
/// order (lanes of vector `k` hold bits `8k..8k+8`), moved to the sign bit
/// for [`masked_sum`]: the fifth bits of a Q5_0/Q5_1 block.
///
/// # Safety
/// The CPU supports AVX2; `p` is valid for 4 bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn high_bits(p: *const u8) -> [__m256i; 4] {
    let qh = _mm256_set1_epi32((p as *const i32).read_unaligned());
    // Bit j (lane j % 8 of vector j / 8) shifts left by 31 - j.
    let shift = |k: i32| {
        let b = 31 - 8 * k;
        _mm256_setr_epi32(b, b - 1, b - 2, b - 3, b - 4, b - 5, b - 6, b - 7)
    };
    [0, 1, 2, 3].map(|k| _mm256_sllv_epi32(qh, shift(k)))
}
