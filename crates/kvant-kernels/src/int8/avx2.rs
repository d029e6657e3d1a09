//! AVX2 int8 kernels: a group of 8 packed rows against a tile of `T` tokens.
//!
//! Per block the group's quants are loaded (and for 4-bit formats split
//! into low and high nibbles) once, then reused by every token of the tile:
//! `vpmaddubsw` multiplies unsigned weight bytes by signed activation bytes
//! (4 activations broadcast to the 8 row lanes) and adds adjacent pairs;
//! `vpmaddwd` with ones widens to one i32 per row. 4-bit products are small
//! enough (|pair| ≤ 2·15·127) to sum all 8 chunks in i16 before widening;
//! 8-bit weights go through `vpsignb` (|w| as the unsigned operand, the
//! sign moved onto the activation, as in ggml) and widen per chunk. 5- and
//! 6-bit weights are rebuilt from their nibble and high-bit chunks; 5-bit
//! sums widen every 4 chunks (`q5k_tile`), and the 6-bit offset of 32 comes
//! off once per sub-block (`q6k_tile`).
//!
//! **AVX-512 VNNI.** The same kernels compile a second time with
//! `vpdpbusd` (`_mm256_dpbusd_epi32`: four unsigned × signed byte products
//! summed into each i32 lane) in place of each `vpmaddubsw` and its
//! widening `vpmaddwd` ([`Dot`]): one instruction per chunk and token
//! instead of two or three, the weight unpacking unchanged. Integer sums are
//! exact either way, so both give the same bits; [`group_tile_vnni`] runs
//! where the CPU has AVX-512 VNNI and VL (256-bit registers: the packed
//! layout of 8 rows × 4 bytes per lane is the same).

use super::pack::{PackedFormat, GROUP, Q5K_HIGH, Q6K_HIGH, SUBS};
use kvant_core::dtype::QK;
use std::arch::x86_64::*;

/// Activation pointers of one token: quants, block scales, scaled sums,
/// exact block sums, Q6_K offsets (two per block).
#[derive(Clone, Copy)]
pub(crate) struct TokenPtrs {
    pub q: *const i8,
    pub d: *const f32,
    pub s: *const f32,
    pub n: *const i32,
    pub o: *const i32,
}

impl TokenPtrs {
    /// Token `t`'s pointers into `x`.
    ///
    /// # Panics
    /// If `t` is not a token of `x`.
    #[inline(always)]
    pub(crate) fn of(x: &super::activations::Q8Activations, t: usize) -> Self {
        let (q, d, s) = x.token(t);
        TokenPtrs {
            q: q.as_ptr(),
            d: d.as_ptr(),
            s: s.as_ptr(),
            n: x.token_sums(t).as_ptr(),
            o: x.token_offsets(t).as_ptr() as *const i32,
        }
    }

    /// Tokens `t0..t0 + T`'s pointers into `x`. A plain loop, inlined into
    /// the tile: built through `array::from_fn`, each token's pointers came
    /// from a closure call through the stack, and reading them back as one
    /// 32-byte load stalled on store forwarding (10% of Gemma 3's pp512
    /// profile, for every row group and token).
    ///
    /// # Panics
    /// If a token is not one of `x`'s.
    #[inline(always)]
    pub(crate) fn tile<const T: usize>(
        x: &super::activations::Q8Activations,
        t0: usize,
    ) -> [Self; T] {
        let none = TokenPtrs {
            q: std::ptr::null(),
            d: std::ptr::null(),
            s: std::ptr::null(),
            n: std::ptr::null(),
            o: std::ptr::null(),
        };
        let mut p = [none; T];
        for (i, p) in p.iter_mut().enumerate() {
            *p = Self::of(x, t0 + i);
        }
        p
    }
}

/// How far ahead of the block being read a one- or two-token call prefetches the
/// packed weights. Decoding streams every weight once from DRAM, and this
/// machine's hardware prefetchers alone kept a one-token product of a
/// 30 MB Q8_0 weight at 13 GiB/s on 2 threads (45% of the measured read
/// bandwidth); 4 KiB ahead reads it at 23 GiB/s (`benches/matmul.rs`,
/// `dram`; 2 KiB and 8 KiB did worse on one of Q8_0 and Q4_1). Tiles of
/// several tokens reuse each block enough to hide the reads without it.
const PREFETCH_BYTES: usize = 4096;

/// Tiles of up to this many tokens prefetch (see [`PREFETCH_BYTES`]): a
/// two-token call (a speculative decoder's verify step) streams its weights
/// from DRAM as a one-token call does, and without the prefetches it ran
/// the 41 MB Q6_K output head of a DeepSeek-V3-shaped model at half the
/// speed (a 2-token forward pass took 21 ms against 12 with them).
const PREFETCH_TOKENS: usize = 2;

/// Tiles of up to this many tokens split each block's integer sum into two
/// chains (even and odd chunks; low and high nibbles): with one token, one
/// chain of eight dependent products per block bound the kernel by the
/// product's latency, not by the weights' reads. Integer sums are exact,
/// so the split changes no bit.
const SPLIT_TOKENS: usize = 2;

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
    if T <= PREFETCH_TOKENS {
        prefetch(blk.wrapping_add(PREFETCH_BYTES), bb);
    }
    (blk, _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i)))
}

/// Prefetches part `i` of `n` of the block of `bb` bytes [`PREFETCH_BYTES`]
/// ahead of `blk`, for a one-token call that reads the block in `n` parts.
///
/// For the k-quants' large blocks, not all their lines at once as
/// [`open_block`] does: the 19 to 27 lines of a block at once filled the
/// core's outstanding-miss slots and stalled the kernel, which read weights
/// far larger than the caches well below the read bandwidth
/// (`benches/matmul.rs`, `dram`, one thread: `Q6K` at 5.2 GiB/s against
/// 9–10 in parts, `Q4K` at 7.0 against 10.7, with 10.7 GiB/s measured). A
/// part's prefetches are 64 bytes apart and the next part starts less than
/// 64 bytes after its last, so every line is covered.
#[inline(always)]
unsafe fn prefetch_part(blk: *const u8, bb: usize, i: usize, n: usize) {
    prefetch(blk.wrapping_add(PREFETCH_BYTES + i * bb / n), bb / n);
}

/// Four activation bytes at `p` in all eight 32-bit lanes.
#[inline(always)]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// The integer dot products of a chunk: 32 weight bytes (unsigned, 4 per
/// row lane) against 4 activation bytes broadcast to every lane.
///
/// `acc` adds a chunk's products into a narrow accumulator that `widen`
/// turns into one i32 per lane (AVX2: i16 pairs, widened once per few
/// chunks; VNNI: already i32); `acc32` adds them into an i32 accumulator
/// at once. `scaled` gives `Σ (p − off) · scale` per lane for Q6_K, from a
/// narrow sum `p`, the offset `off` in the i16 positions of
/// [`super::activations::offsets_ref`], and
/// the 8 rows' i8 scales.
pub(crate) trait Dot {
    /// Whether 8-bit weights go in offset by 128 (`w ^ 0x80`, unsigned)
    /// with `128 · Σ x` taken off each block's exact sum afterwards,
    /// instead of through `vpsignb` per token: one operation per chunk
    /// and token fewer. Only where the products widen to i32 at once:
    /// `vpmaddubsw`'s i16 pairs would saturate at `2 · 255 · 127`.
    const OFFSET_Q8: bool;
    unsafe fn acc(p: __m256i, w: __m256i, x: __m256i) -> __m256i;
    unsafe fn widen(p: __m256i) -> __m256i;
    unsafe fn acc32(s: __m256i, w: __m256i, x: __m256i) -> __m256i;
    unsafe fn scaled(p: __m256i, off: __m256i, sc: __m128i) -> __m256i;
}

/// AVX2: `vpmaddubsw` (pairs into i16, never saturating for these
/// formats: see each kernel) and `vpmaddwd` to widen.
pub struct Madd;

impl Dot for Madd {
    const OFFSET_Q8: bool = false;
    #[inline(always)]
    unsafe fn acc(p: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_add_epi16(p, _mm256_maddubs_epi16(w, x))
    }
    #[inline(always)]
    unsafe fn widen(p: __m256i) -> __m256i {
        _mm256_madd_epi16(p, _mm256_set1_epi16(1))
    }
    #[inline(always)]
    unsafe fn acc32(s: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_add_epi32(s, Self::widen(_mm256_maddubs_epi16(w, x)))
    }
    #[inline(always)]
    unsafe fn scaled(p: __m256i, off: __m256i, sc: __m128i) -> __m256i {
        // Each row's scale in both i16 halves of its lane.
        let sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc, sc));
        _mm256_madd_epi16(_mm256_sub_epi16(p, off), sc)
    }
}

/// AVX-512 VNNI: `vpdpbusd` into i32 lanes.
pub struct Vnni;

impl Dot for Vnni {
    const OFFSET_Q8: bool = true;
    #[inline(always)]
    unsafe fn acc(p: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(p, w, x)
    }
    #[inline(always)]
    unsafe fn widen(p: __m256i) -> __m256i {
        p
    }
    #[inline(always)]
    unsafe fn acc32(s: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(s, w, x)
    }
    #[inline(always)]
    unsafe fn scaled(p: __m256i, off: __m256i, sc: __m128i) -> __m256i {
        // The lane's offset is the sum of its two i16 positions; the
        // exact `Σ q·x − off` times the row's scale, as `Madd` computes.
        let off = _mm256_madd_epi16(off, _mm256_set1_epi16(1));
        _mm256_mullo_epi32(_mm256_sub_epi32(p, off), _mm256_cvtepi8_epi32(sc))
    }
}

/// `Σ w·x` per row lane for `T` tokens over `blocks` packed blocks at `w`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `w` is valid for `blocks` packed
/// blocks of `format`; each token's pointers for `blocks * 32` quants and
/// `blocks` scales and sums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn group_tile<const T: usize>(
    format: PackedFormat,
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    tile_body::<Madd, T>(format, w, blocks, x)
}

/// [`group_tile`] on AVX-512 VNNI (the same bits).
///
/// # Safety
/// As for [`group_tile`], and the CPU supports AVX-512 F, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
pub(crate) unsafe fn group_tile_vnni<const T: usize>(
    format: PackedFormat,
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    tile_body::<Vnni, T>(format, w, blocks, x)
}

/// Two groups of `Q8` (16 rows) on 512-bit VNNI registers: each chunk of
/// both groups' weights in one register, one broadcast and one `vpdpbusd`
/// per token for 16 rows instead of 8, and the block's scale arithmetic
/// per token once for both groups. Lanes 0..8 are group `wa`'s rows, 8..16
/// `wb`'s; each lane's integer sum is exact and its float operations are
/// those of [`group_tile_vnni`] (the same bits).
///
/// # Safety
/// As for [`group_tile`] for both groups (format `Q8`), and the CPU
/// supports AVX-512 F, BW, VL and VNNI.
///
/// Inlined into its tile ([`super::pair_tile`]), as [`group_tile`] and
/// [`group_tile_vnni`] are into theirs: called, the token pointers went to
/// the callee through memory and the accumulators came back through it;
/// inlined, both stay in the tile's frame and registers (Gemma 3 Q4_K_M
/// pp512 on one Zen 4 thread, 5 alternated runs: 822 -> 877 tok/s for this
/// kernel, -> 894 with the other two).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(crate) unsafe fn q8_pair_vnni<const T: usize>(
    wa: *const u8,
    wb: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m512; T] {
    let fmt = PackedFormat::Q8;
    let (bb, hdr) = (fmt.block_bytes(), fmt.header());
    let flip = _mm512_set1_epi8(i8::MIN);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..blocks {
        // SAFETY (whole loop): as in `q8_tile`, for both groups.
        let (ba, bq) = (wa.add(b * bb), wb.add(b * bb));
        if T <= PREFETCH_TOKENS {
            prefetch(ba.wrapping_add(PREFETCH_BYTES), bb);
            prefetch(bq.wrapping_add(PREFETCH_BYTES), bb);
        }
        let d = _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(ba as *const __m128i)),
            _mm_loadu_si128(bq as *const __m128i),
        ));
        let (qa, qb) = (ba.add(hdr), bq.add(hdr));
        let mut s = [[_mm512_setzero_si512(); T]; 2];
        for c in 0..8 {
            let raw = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(qa.add(32 * c) as *const __m256i)),
                _mm256_loadu_si256(qb.add(32 * c) as *const __m256i),
            );
            let u = _mm512_xor_si512(raw, flip);
            let k = if T <= SPLIT_TOKENS { c % 2 } else { 0 };
            for (t, s) in s[k].iter_mut().enumerate() {
                let xq = (x[t].q.add(b * QK + 4 * c) as *const i32).read_unaligned();
                *s = _mm512_dpbusd_epi32(*s, u, _mm512_set1_epi32(xq));
            }
        }
        for t in 0..T {
            let mut st = if T <= SPLIT_TOKENS {
                _mm512_add_epi32(s[0][t], s[1][t])
            } else {
                s[0][t]
            };
            st = _mm512_sub_epi32(st, _mm512_set1_epi32(*x[t].n.add(b) << 7));
            let dd = _mm512_mul_ps(d, _mm512_set1_ps(*x[t].d.add(b)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(st), dd, acc[t]);
        }
    }
    acc
}

#[inline(always)]
unsafe fn tile_body<I: Dot, const T: usize>(
    format: PackedFormat,
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    match format {
        PackedFormat::Q4Sym => q4_tile::<I, T, false>(w, blocks, x),
        PackedFormat::Q4Asym => q4_tile::<I, T, true>(w, blocks, x),
        PackedFormat::Q8 => q8_tile::<I, T>(w, blocks, x),
        PackedFormat::Q4K => q4k_tile::<I, T>(w, blocks, x),
        PackedFormat::Q5K => q5k_tile::<I, T>(w, blocks, x),
        PackedFormat::Q6K => q6k_tile::<I, T>(w, blocks, x),
        PackedFormat::Mxfp4 => mxfp4_tile::<I, T>(w, blocks, x),
    }
}

/// `Mxfp4`: each chunk's codes become `k + 12` (0…24, unsigned for
/// `vpmaddubsw`) through one `vpshufb` per nibble half, so the products
/// need no sign trick; `12·Σx` comes off the block's exact i32 sum. A
/// chunk's low and high products (each pair at most `2·24·127`) add in i16
/// and widen per chunk: eight chunks of them could reach 48768 and wrap.
#[inline(always)]
unsafe fn mxfp4_tile<I: Dot, const T: usize>(
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    let fmt = PackedFormat::Mxfp4;
    let (bb, hdr) = (fmt.block_bytes(), fmt.header());
    let mask = _mm256_set1_epi8(0x0F);
    let mut table = [0u8; 16];
    for (t, &k) in table.iter_mut().zip(crate::quant::E2M1_DOUBLED.iter()) {
        *t = (k + 12) as u8;
    }
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i));
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..blocks {
        // SAFETY (whole loop): as in `q4_tile`.
        let blk = w.add(b * bb);
        if T <= PREFETCH_TOKENS {
            prefetch(blk.wrapping_add(PREFETCH_BYTES), bb);
        }
        let d = e8m0_half_lanes(blk);
        let q = blk.add(hdr);
        let mut s = [[_mm256_setzero_si256(); T]; 2];
        for c in 0..4 {
            let raw = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, mask));
            let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
            let k = if T <= SPLIT_TOKENS { c % 2 } else { 0 };
            for (t, s) in s[k].iter_mut().enumerate() {
                let xq = x[t].q.add(b * QK);
                let p = I::acc(_mm256_setzero_si256(), lo, bcast4(xq.add(4 * c)));
                let p = I::acc(p, hi, bcast4(xq.add(16 + 4 * c)));
                *s = _mm256_add_epi32(*s, I::widen(p));
            }
        }
        for t in 0..T {
            let mut st = if T <= SPLIT_TOKENS {
                _mm256_add_epi32(s[0][t], s[1][t])
            } else {
                s[0][t]
            };
            // Σ (k + 12) x − 12 Σ x = Σ k x, exactly.
            st = _mm256_sub_epi32(st, _mm256_set1_epi32(*x[t].n.add(b) * 12));
            let dd = _mm256_mul_ps(d, _mm256_set1_ps(*x[t].d.add(b)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(st), dd, acc[t]);
        }
    }
    acc
}

/// The 8 rows' e8m0 bytes at `p` as `2^(e − 128)` per lane, bit for bit
/// as [`crate::quant::e8m0_half`] builds them (`(e − 1) << 23`, and the
/// denormal `0x200000 << e` below 2).
///
/// # Safety
/// `p` is valid for an 8-byte read; the CPU supports AVX2.
#[inline(always)]
unsafe fn e8m0_half_lanes(p: *const u8) -> __m256 {
    let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    let normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    let denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
    let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, small))
}

#[inline(always)]
unsafe fn q4_tile<I: Dot, const T: usize, const ASYM: bool>(
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
        let mut p = [[_mm256_setzero_si256(); T]; 2];
        for c in 0..4 {
            let raw = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let lo = _mm256_and_si256(raw, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            let [p0, p1] = &mut p;
            for (t, (p0, p1)) in p0.iter_mut().zip(p1.iter_mut()).enumerate() {
                let xq = x[t].q.add(b * QK);
                *p0 = I::acc(*p0, lo, bcast4(xq.add(4 * c)));
                let ph = if T <= SPLIT_TOKENS { p1 } else { &mut *p0 };
                *ph = I::acc(*ph, hi, bcast4(xq.add(16 + 4 * c)));
            }
        }
        for t in 0..T {
            // Exact integer sums: splitting them changes no bit.
            let pt = if T <= SPLIT_TOKENS {
                _mm256_add_epi32(I::widen(p[0][t]), I::widen(p[1][t]))
            } else {
                I::widen(p[0][t])
            };
            let isum = _mm256_cvtepi32_ps(pt);
            let dd = _mm256_mul_ps(d, _mm256_set1_ps(*x[t].d.add(b)));
            acc[t] = _mm256_fmadd_ps(isum, dd, acc[t]);
            acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(*x[t].s.add(b)), acc[t]);
        }
    }
    acc
}

#[inline(always)]
unsafe fn q8_tile<I: Dot, const T: usize>(
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    let fmt = PackedFormat::Q8;
    let (bb, hdr) = (fmt.block_bytes(), fmt.header());
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..blocks {
        // SAFETY (whole loop): as in `q4_tile`.
        let (blk, d) = open_block::<T>(w, b, bb);
        let q = blk.add(hdr);
        // Chunk-outer as in `q4_tile`.
        // Even and odd chunks in two sums per token for one or two tokens,
        // whose chains are otherwise eight dependent products long.
        let mut s = [[_mm256_setzero_si256(); T]; 2];
        for c in 0..8 {
            let raw = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
            let k = if T <= SPLIT_TOKENS { c % 2 } else { 0 };
            if I::OFFSET_Q8 {
                let u = _mm256_xor_si256(raw, _mm256_set1_epi8(i8::MIN));
                for (t, s) in s[k].iter_mut().enumerate() {
                    *s = I::acc32(*s, u, bcast4(x[t].q.add(b * QK + 4 * c)));
                }
            } else {
                let abs = _mm256_abs_epi8(raw);
                for (t, s) in s[k].iter_mut().enumerate() {
                    let xs = _mm256_sign_epi8(bcast4(x[t].q.add(b * QK + 4 * c)), raw);
                    *s = I::acc32(*s, abs, xs);
                }
            }
        }
        for t in 0..T {
            let mut st = if T <= SPLIT_TOKENS {
                _mm256_add_epi32(s[0][t], s[1][t])
            } else {
                s[0][t]
            };
            if I::OFFSET_Q8 {
                // Σ (w + 128) x − 128 Σ x = Σ w x, exactly (|Σ| < 2^21).
                st = _mm256_sub_epi32(st, _mm256_set1_epi32(*x[t].n.add(b) << 7));
            }
            let dd = _mm256_mul_ps(d, _mm256_set1_ps(*x[t].d.add(b)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(st), dd, acc[t]);
        }
    }
    acc
}

#[inline(always)]
unsafe fn q4k_tile<I: Dot, const T: usize>(
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    let fmt = PackedFormat::Q4K;
    let (bb, hdr) = (fmt.block_bytes(), fmt.header());
    let mask = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); T];
    for sb in 0..blocks {
        // SAFETY (whole loop): super-block `sb` of `blocks` at `w`;
        // activation blocks `8 sb .. 8 sb + 8` of each token.
        let blk = w.add(sb * bb);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * GROUP) as *const __m128i));
        let lanes = |off: usize| {
            let v = _mm_loadl_epi64(blk.add(off) as *const __m128i);
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
        };
        for pair in 0..SUBS / 2 {
            if T <= PREFETCH_TOKENS {
                prefetch_part(blk, bb, pair, SUBS / 2);
            }
            // p[0]: sub-block 2·pair (low nibbles), p[1]: 2·pair + 1.
            let mut p = [[_mm256_setzero_si256(); T]; 2];
            for c in 0..8 {
                let raw = _mm256_loadu_si256(blk.add(hdr + 32 * (8 * pair + c)) as *const __m256i);
                let lo = _mm256_and_si256(raw, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                let [p_lo, p_hi] = &mut p;
                for (t, (pl, ph)) in p_lo.iter_mut().zip(p_hi.iter_mut()).enumerate() {
                    let xq = x[t].q.add(sb * 256 + 64 * pair + 4 * c);
                    *pl = I::acc(*pl, lo, bcast4(xq));
                    *ph = I::acc(*ph, hi, bcast4(xq.add(32)));
                }
            }
            for (h, ph) in p.iter().enumerate() {
                let j = 2 * pair + h;
                let dsc = _mm256_mul_ps(d, lanes(4 * GROUP + GROUP * j));
                let dm = _mm256_mul_ps(dmin, lanes(4 * GROUP + GROUP * (SUBS + j)));
                let xb = sb * SUBS + j;
                for t in 0..T {
                    let isum = _mm256_cvtepi32_ps(I::widen(ph[t]));
                    let dd = _mm256_mul_ps(dsc, _mm256_set1_ps(*x[t].d.add(xb)));
                    acc[t] = _mm256_fmadd_ps(isum, dd, acc[t]);
                    acc[t] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(*x[t].s.add(xb)), acc[t]);
                }
            }
        }
    }
    acc
}

/// The `Q6K` kernel; the sums and roundings of `reference::q6k_group_dot`.
///
/// The unsigned 6-bit `q` is `vpmaddubsw`'s unsigned operand as stored, and
/// the offset comes off once per sub-block: `Σ (q - 32) x = Σ q x - 32 Σ x`,
/// with `32 Σ x` per i16 position computed once per token and sub-block
/// when the activations are quantized (`Q8Activations::offsets`; computed
/// in the tile, once per row group, it was 4% of Gemma 3's pp512) instead
/// of a subtraction, `vpabsb` and `vpsignb` per
/// chunk. A `vpmaddubsw` pair is at most `2·63·127 = 16002`, so it
/// never saturates; the four chunks of a sub-block of 16 then sum in i16
/// with wrapping adds, and the sum less the offset is exact: the true
/// value, `Σ (q - 32) x` over 8 products (`|·| ≤ 8·32·127 = 32512`), is an
/// i16, and wrapping arithmetic is exact modulo 2^16. `vpmaddwd` with the
/// sub-block's scale (in both i16 of a row lane) widens and scales at once,
/// and the two sub-blocks of an activation block sum in i32 (exact, below
/// 2^24: see the reference).
#[inline(always)]
unsafe fn q6k_tile<I: Dot, const T: usize>(
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    let bb = PackedFormat::Q6K.block_bytes();
    let mut acc = [_mm256_setzero_ps(); T];
    for sb in 0..blocks {
        // SAFETY (whole loop): super-block `sb` of `blocks` at `w`;
        // activation blocks `8 sb .. 8 sb + 8` of each token.
        let blk = w.add(sb * bb);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        for u in 0..4 {
            if T <= PREFETCH_TOKENS {
                prefetch_part(blk, bb, u, 4);
            }
            q6k_block::<I, T, 0>(blk, d, sb, u, x, &mut acc);
            q6k_block::<I, T, 1>(blk, d, sb, u, x, &mut acc);
        }
    }
    acc
}

/// Activation block `2u + S` of super-block `sb` (packed at `blk`, row
/// scales `d`) into `acc`: sub-blocks `4u + 2S` and `4u + 2S + 1`.
///
/// # Safety
/// As for [`group_tile`], for super-block `sb` at `blk`.
#[inline(always)]
unsafe fn q6k_block<I: Dot, const T: usize, const S: usize>(
    blk: *const u8,
    d: __m256,
    sb: usize,
    u: usize,
    x: &[TokenPtrs; T],
    acc: &mut [__m256; T],
) {
    let (low, high) = (blk.add(PackedFormat::Q6K.header()), blk.add(Q6K_HIGH));
    let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let xb = sb * 8 + 2 * u + S;
    let mut isum = [_mm256_setzero_si256(); T];
    for h in 0..2 {
        let mut p = [_mm256_setzero_si256(); T];
        for k in 0..4 {
            let l = _mm256_loadu_si256(low.add(32 * (8 * u + 4 * h + k)) as *const __m256i);
            let hb = _mm256_loadu_si256(high.add(32 * (4 * u + k)) as *const __m256i);
            let l = if S == 0 { l } else { _mm256_srli_epi16(l, 4) };
            // Bits 2(S + 2h).. of each byte to bits 4..6; 16-bit shifts
            // spill only into bits the 0x30 mask clears.
            let hb = match S + 2 * h {
                0 => _mm256_slli_epi16(hb, 4),
                1 => _mm256_slli_epi16(hb, 2),
                2 => hb,
                _ => _mm256_srli_epi16(hb, 2),
            };
            let q = _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(hb, m30));
            for (t, p) in p.iter_mut().enumerate() {
                let xq = x[t].q.add(QK * xb + 16 * h + 4 * k);
                *p = I::acc(*p, q, bcast4(xq));
            }
        }
        // The 8 rows' scales of sub-block 4u + 2S + h.
        let sc =
            _mm_loadl_epi64(blk.add(2 * GROUP + GROUP * (4 * u + 2 * S + h)) as *const __m128i);
        for t in 0..T {
            let off = _mm256_set1_epi32(*x[t].o.add(2 * xb + h));
            isum[t] = _mm256_add_epi32(isum[t], I::scaled(p[t], off, sc));
        }
    }
    for t in 0..T {
        let dd = _mm256_mul_ps(d, _mm256_set1_ps(*x[t].d.add(xb)));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), dd, acc[t]);
    }
}

/// The `Q5K` kernel; the sums and roundings of `reference::q4k_group_dot`.
///
/// One pass over the chunks per sub-block (low or high nibbles with their
/// fifth bits) rather than `q4k_tile`'s one for both: a `vpmaddubsw` pair
/// is at most `2·31·127 = 7874`, so a sub-block's 8 chunks no longer fit
/// one i16 sum and widen every 4, and the per-token sums of both
/// sub-blocks would not fit the registers.
#[inline(always)]
unsafe fn q5k_tile<I: Dot, const T: usize>(
    w: *const u8,
    blocks: usize,
    x: &[TokenPtrs; T],
) -> [__m256; T] {
    let bb = PackedFormat::Q5K.block_bytes();
    let mut acc = [_mm256_setzero_ps(); T];
    for sb in 0..blocks {
        // SAFETY (whole loop): super-block `sb` of `blocks` at `w`;
        // activation blocks `8 sb .. 8 sb + 8` of each token.
        let blk = w.add(sb * bb);
        let p = Q5kBlock {
            blk,
            d: _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i)),
            dmin: _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * GROUP) as *const __m128i)),
            sb,
        };
        q5k_sub::<I, T, 0>(&p, x, &mut acc);
        q5k_sub::<I, T, 1>(&p, x, &mut acc);
        q5k_sub::<I, T, 2>(&p, x, &mut acc);
        q5k_sub::<I, T, 3>(&p, x, &mut acc);
        q5k_sub::<I, T, 4>(&p, x, &mut acc);
        q5k_sub::<I, T, 5>(&p, x, &mut acc);
        q5k_sub::<I, T, 6>(&p, x, &mut acc);
        q5k_sub::<I, T, 7>(&p, x, &mut acc);
    }
    acc
}

/// A packed `Q5K` super-block: its address, the rows' scales and minimum
/// scales widened, and its index.
struct Q5kBlock {
    blk: *const u8,
    d: __m256,
    dmin: __m256,
    sb: usize,
}

/// Sub-block `J` of a `Q5K` super-block into `acc`.
///
/// # Safety
/// As for [`group_tile`], for the super-block `b`.
#[inline(always)]
unsafe fn q5k_sub<I: Dot, const T: usize, const J: usize>(
    b: &Q5kBlock,
    x: &[TokenPtrs; T],
    acc: &mut [__m256; T],
) {
    let bb = PackedFormat::Q5K.block_bytes();
    if T <= PREFETCH_TOKENS {
        prefetch_part(b.blk, bb, J, SUBS);
    }
    let low = b.blk.add(PackedFormat::Q5K.header() + 32 * 8 * (J / 2));
    let (m4, m10) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    let xb = b.sb * SUBS + J;
    let mut isum = [_mm256_setzero_si256(); T];
    for half in 0..2 {
        let mut p = [_mm256_setzero_si256(); T];
        for k in 0..4 {
            let c = 4 * half + k;
            let l = _mm256_loadu_si256(low.add(32 * c) as *const __m256i);
            let l = if J.is_multiple_of(2) {
                l
            } else {
                _mm256_srli_epi16(l, 4)
            };
            let hb = _mm256_loadu_si256(b.blk.add(Q5K_HIGH + 32 * c) as *const __m256i);
            // Bit J of each byte to bit 4; 16-bit shifts spill only into
            // bits the 0x10 mask clears.
            let hb = match J {
                0 => _mm256_slli_epi16(hb, 4),
                1 => _mm256_slli_epi16(hb, 3),
                2 => _mm256_slli_epi16(hb, 2),
                3 => _mm256_slli_epi16(hb, 1),
                4 => hb,
                5 => _mm256_srli_epi16(hb, 1),
                6 => _mm256_srli_epi16(hb, 2),
                _ => _mm256_srli_epi16(hb, 3),
            };
            let q = _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(hb, m10));
            for (t, p) in p.iter_mut().enumerate() {
                let xq = x[t].q.add(QK * xb + 4 * c);
                *p = I::acc(*p, q, bcast4(xq));
            }
        }
        for (s, p) in isum.iter_mut().zip(p) {
            *s = _mm256_add_epi32(*s, I::widen(p));
        }
    }
    let lanes = |off: usize| {
        let v = _mm_loadl_epi64(b.blk.add(off) as *const __m128i);
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
    };
    let dsc = _mm256_mul_ps(b.d, lanes(4 * GROUP + GROUP * J));
    let dm = _mm256_mul_ps(b.dmin, lanes(4 * GROUP + GROUP * (SUBS + J)));
    for t in 0..T {
        let dd = _mm256_mul_ps(dsc, _mm256_set1_ps(*x[t].d.add(xb)));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), dd, acc[t]);
        acc[t] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(*x[t].s.add(xb)), acc[t]);
    }
}
