//! AVX2 int8 kernels: a group of 8 packed rows against a tile of `T` tokens.
//!
//! Per block the group's quants are loaded (and for 4-bit formats split
//! into low and high nibbles) once, then reused by every token of the tile:
//! `vpmaddubsw` multiplies unsigned weight bytes by signed activation bytes
//! (4 activations broadcast to the 8 row lanes) and adds adjacent pairs;
//! `vpmaddwd` with ones widens to one i32 per row. 4-bit products are small
//! enough (|pair| ≤ 2·15·127) to sum all 8 chunks in i16 before widening;
//! 8-bit weights go through `vpsignb` (|w| as the unsigned operand, the
//! sign moved onto the activation, as in ggml) and widen per chunk.

use super::pack::{PackedFormat, GROUP, SUBS};
use kvant_core::dtype::QK;
use std::arch::x86_64::*;

/// Activation pointers of one token: quants, block scales, scaled sums.
#[derive(Clone, Copy)]
pub(crate) struct TokenPtrs {
    pub q: *const i8,
    pub d: *const f32,
    pub s: *const f32,
}

/// How far ahead of the block being read a one-token call prefetches the
/// packed weights. Decoding streams every weight once from DRAM, and this
/// machine's hardware prefetchers alone kept a one-token product of a
/// 30 MB Q8_0 weight at 13 GiB/s on 2 threads (45% of the measured read
/// bandwidth); 4 KiB ahead reads it at 23 GiB/s (`benches/matmul.rs`,
/// `dram`; 2 KiB and 8 KiB did worse on one of Q8_0 and Q4_1). Tiles of
/// several tokens reuse each block enough to hide the reads without it.
const PREFETCH_BYTES: usize = 4096;

/// Prefetches the cache lines of `len` bytes at `p` (any address: a
/// prefetch is a hint and never faults).
#[inline(always)]
unsafe fn prefetch(p: *const u8, len: usize) {
    for off in (0..len).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8);
    }
}

/// Block `b` (of `bb` bytes) at `w`, its first 8 f16 (the rows' scales)
/// widened, after prefetching ahead for a one-token call.
///
/// # Safety
/// As for [`group_tile`]: block `b` lies inside the packed weights.
#[inline(always)]
unsafe fn open_block<const T: usize>(w: *const u8, b: usize, bb: usize) -> (*const u8, __m256) {
    let blk = w.add(b * bb);
    if T == 1 {
        prefetch(blk.wrapping_add(PREFETCH_BYTES), bb);
    }
    (blk, _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i)))
}

/// Four activation bytes at `p` in all eight 32-bit lanes.
#[inline(always)]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// `Σ w·x` per row lane for `T` tokens over `blocks` packed blocks at `w`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `w` is valid for `blocks` packed
/// blocks of `format`; each token's pointers for `blocks * 32` quants and
/// `blocks` scales and sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn group_tile<const T: usize>(
    format: PackedFormat,
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    match format {
        PackedFormat::Q4Sym => q4_tile::<T, false>(w, blocks, x),
        PackedFormat::Q4Asym => q4_tile::<T, true>(w, blocks, x),
        PackedFormat::Q8 => q8_tile::<T>(w, blocks, x),
        PackedFormat::Q4K => q4k_tile::<T>(w, blocks, x),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_tile<const T: usize, const ASYM: bool>(
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    let fmt = if ASYM {
        PackedFormat::Q4Asym
    } else {
        PackedFormat::Q4Sym
    };
    let (bb, hdr) = (fmt.block_bytes(), fmt.header());
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..blocks {
        // SAFETY (whole loop): block `b` of `blocks` packed blocks at `w`;
        // activation block `b` of each token (the caller's contract).
        let (blk, d) = open_block::<T>(w, b, bb);
        let m = if ASYM {
            _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * GROUP) as *const __m128i))
        } else {
            _mm256_mul_ps(d, _mm256_set1_ps(-8.0))
        };
        let q = blk.add(hdr);
        // Chunk by chunk, every token: only the chunk's two nibble registers
        // and one i16 sum per token stay live, so tiles of several tokens
        // fit the 16 registers without spills.
        let mut p = [_mm256_setzero_si256(); T];
        for c in 0..4 {
            let raw = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let lo = _mm256_and_si256(raw, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            for (t, p) in p.iter_mut().enumerate() {
                let xq = x[t].q.add(b * QK);
                let a = _mm256_maddubs_epi16(lo, bcast4(xq.add(4 * c)));
                let h = _mm256_maddubs_epi16(hi, bcast4(xq.add(16 + 4 * c)));
                *p = _mm256_add_epi16(*p, _mm256_add_epi16(a, h));
            }
        }
        for t in 0..T {
            let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(p[t], ones));
            let dd = _mm256_mul_ps(d, _mm256_set1_ps(*x[t].d.add(b)));
            acc[t] = _mm256_fmadd_ps(isum, dd, acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(*x[t].s.add(b)), acc[t]);
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_tile<const T: usize>(w: *const u8, blocks: usize, x: &[TokenPtrs; T]) -> [__m256; T] {
    let fmt = PackedFormat::Q8;
    let (bb, hdr) = (fmt.block_bytes(), fmt.header());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..blocks {
        // SAFETY (whole loop): as in `q4_tile`.
        let (blk, d) = open_block::<T>(w, b, bb);
        let q = blk.add(hdr);
        // Chunk-outer as in `q4_tile`.
        let mut s = [_mm256_setzero_si256(); T];
        for c in 0..8 {
            let raw = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let abs = _mm256_abs_epi8(raw);
            for (t, s) in s.iter_mut().enumerate() {
                let xs = _mm256_sign_epi8(bcast4(x[t].q.add(b * QK + 4 * c)), raw);
                let p = _mm256_maddubs_epi16(abs, xs);
                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, ones));
            }
        }
        for t in 0..T {
            let dd = _mm256_mul_ps(d, _mm256_set1_ps(*x[t].d.add(b)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), dd, acc[t]);
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_tile<const T: usize>(w: *const u8, blocks: usize, x: &[TokenPtrs; T]) -> [__m256; T] {
    let fmt = PackedFormat::Q4K;
    let (bb, hdr) = (fmt.block_bytes(), fmt.header());
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for sb in 0..blocks {
        // SAFETY (whole loop): super-block `sb` of `blocks` at `w`;
        // activation blocks `8 sb .. 8 sb + 8` of each token.
        let (blk, d) = open_block::<T>(w, sb, bb);
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * GROUP) as *const __m128i));
        let lanes = |off: usize| {
            let v = _mm_loadl_epi64(blk.add(off) as *const __m128i);
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
        };
        for pair in 0..SUBS / 2 {
            // p[0]: sub-block 2·pair (low nibbles), p[1]: 2·pair + 1.
            let mut p = [[_mm256_setzero_si256(); T]; 2];
            for c in 0..8 {
                let raw = _mm256_loadu_si256(blk.add(hdr + 32 * (8 * pair + c)) as *const __m256i);
                let lo = _mm256_and_si256(raw, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                let [p_lo, p_hi] = &mut p;
                for (t, (pl, ph)) in p_lo.iter_mut().zip(p_hi.iter_mut()).enumerate() {
                    let xq = x[t].q.add(sb * 256 + 64 * pair + 4 * c);
                    *pl = _mm256_add_epi16(*pl, _mm256_maddubs_epi16(lo, bcast4(xq)));
                    *ph = _mm256_add_epi16(*ph, _mm256_maddubs_epi16(hi, bcast4(xq.add(32))));
                }
            }
            for (h, ph) in p.iter().enumerate() {
                let j = 2 * pair + h;
                let dsc = _mm256_mul_ps(d, lanes(4 * GROUP + GROUP * j));
                let dm = _mm256_mul_ps(dmin, lanes(4 * GROUP + GROUP * (SUBS + j)));
                let xb = sb * SUBS + j;
                for t in 0..T {
                    let isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(ph[t], ones));
                    let dd = _mm256_mul_ps(dsc, _mm256_set1_ps(*x[t].d.add(xb)));
                    acc[t] = _mm256_fmadd_ps(isum, dd, acc[t]);
                    acc[t] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(*x[t].s.add(xb)), acc[t]);
                }
            }
        }
    }
    acc
}
