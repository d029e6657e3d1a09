//! f32 dot products: the inner loop of every matmul and of attention scores.
//!
//! `dot_f32` dispatches on the SIMD tier chosen at start-up. The AVX2 path
//! keeps four independent 8-wide FMA accumulators so the FMA latency (4-5
//! cycles) is hidden behind two loads per cycle. `dot4_f32` dots four rows
//! with one vector, loading each element of the vector once: in a prefill
//! matmul that cuts loads per FMA from 2 to 1.25. `dot_tile_f32` dots four
//! rows with `T` vectors (register blocking over tokens): each row element
//! and each token element is loaded once per tile, `(4 + T) / 4T` loads per
//! FMA (0.58 for `T = 3`), and the `4·T` accumulators hide the FMA latency.

use crate::cpu::{self, SimdTier};
use crate::lanes::{with_rows, Lanes, RowSet};

/// `Σ a[i]·b[i]` in f32 on the start-up tier.
///
/// # Panics
/// If the lengths differ: that is a bug in the calling kernel, never a
/// property of user input.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_with(cpu::tier(), a, b)
}

/// [`dot_f32`] on a given tier (lowered to one the CPU supports); for tests
/// and benchmarks.
pub fn dot_f32_with(tier: SimdTier, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
    match cpu::clamp(tier) {
        SimdTier::Scalar => dot_f32_scalar(a, b),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `clamp` only returns an AVX tier when avx2+fma+f16c were
        // detected; the lengths are equal (asserted above).
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::dot(a, b) },
        #[cfg(not(target_arch = "x86_64"))]
        SimdTier::Avx2 | SimdTier::Avx512 => dot_f32_scalar(a, b),
    }
}

/// Dots `rows[0..4]` with `x`, each row of `x.len()` elements.
///
/// # Panics
/// If any row's length differs from `x.len()` (a bug in the calling kernel).
pub fn dot4_f32_with(tier: SimdTier, rows: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    for r in rows {
        assert_eq!(r.len(), x.len(), "dot4_f32: length mismatch");
    }
    match cpu::clamp(tier) {
        SimdTier::Scalar => rows.map(|r| dot_f32_scalar(r, x)),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_f32_with`; every row has `x.len()` elements.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::dot4(rows, x) },
        #[cfg(not(target_arch = "x86_64"))]
        SimdTier::Avx2 | SimdTier::Avx512 => rows.map(|r| dot_f32_scalar(r, x)),
    }
}

/// `out[r][t] = Σ_i rows[r][i]·xs[t][i]`: four rows against `T` vectors.
///
/// # Panics
/// If any row or vector has a length other than `rows[0].len()` (a bug in
/// the calling kernel).
pub fn dot_tile_f32_with<const T: usize>(
    tier: SimdTier,
    rows: [&[f32]; 4],
    xs: [&[f32]; T],
) -> [[f32; T]; 4] {
    let n = rows[0].len();
    for v in rows.iter().chain(&xs) {
        assert_eq!(v.len(), n, "dot_tile_f32: length mismatch");
    }
    match cpu::clamp(tier) {
        SimdTier::Scalar => rows.map(|r| xs.map(|x| dot_f32_scalar(r, x))),
        #[cfg(target_arch = "x86_64")]
        SimdTier::Avx2 | SimdTier::Avx512 => avx2_tile(rows, xs),
        #[cfg(not(target_arch = "x86_64"))]
        SimdTier::Avx2 | SimdTier::Avx512 => rows.map(|r| xs.map(|x| dot_f32_scalar(r, x))),
    }
}

/// [`dot_tile_f32_with`] on AVX2's 16 registers: at most three vectors a
/// pass (12 accumulators), four as two and two. Four in one pass kept 16
/// accumulators and spilled them (a store and a reload per FMA chain
/// step: DeepSeek-V4's lightning indexer, prefill at depth 4096, spent
/// 42% of that tile's samples on the spill). Each pair's sum is the same
/// chain whatever the pass holds, so the split changes no bit.
#[cfg(target_arch = "x86_64")]
fn avx2_tile<const T: usize>(rows: [&[f32]; 4], xs: [&[f32]; T]) -> [[f32; T]; 4] {
    let mut out = [[0f32; T]; 4];
    let mut t = 0;
    while t < T {
        let g = crate::vecops::rows_per_pass(T - t, 3);
        let mut put = |part: [[f32; 3]; 4], g: usize| {
            for (o, p) in out.iter_mut().zip(part) {
                o[t..t + g].copy_from_slice(&p[..g]);
            }
        };
        // SAFETY: the caller checked every row and vector to have the
        // rows' length; the CPU has AVX2 and FMA (the tier's clamp).
        unsafe {
            match g {
                1 => put(avx2::dot_tile(rows, [xs[t]]).map(|r| [r[0], 0.0, 0.0]), 1),
                2 => put(
                    avx2::dot_tile(rows, [xs[t], xs[t + 1]]).map(|r| [r[0], r[1], 0.0]),
                    2,
                ),
                _ => put(avx2::dot_tile(rows, [xs[t], xs[t + 1], xs[t + 2]]), 3),
            }
        }
        t += g;
    }
    out
}

/// `out[t * stride + j] = xs[t] · keys[j]` for the key rows `keys` (the
/// first `n` values of each, of any [`Lanes`] type, f16 and bf16 read as
/// stored)
/// against `T` vectors of `n`: the scores of an attention tile, written in
/// place. The keys go through [`dot_tile_f32_with`]'s tile in groups of
/// four (a short last group repeats its last key), so every pair is the
/// same dot product as there on the key widened to f32, whatever the key
/// count, `T` or the pair's neighbours.
///
/// `ahead` are rows the caller reads next (the next tile's keys, or
/// none): while key `j` is read, the lines of `ahead[j]` are prefetched,
/// so that a tile streamed from DRAM overlaps the previous tile's
/// arithmetic (the hardware prefetchers lose short rows read side by side).
///
/// # Panics
/// If a vector's length is not `n`, the keys are narrower, or `out` is too
/// short for row `T - 1` (bugs in the calling kernel).
pub fn dot_keys_with<E: Lanes, const T: usize>(
    tier: SimdTier,
    (keys, ahead): (RowSet<'_, '_, E>, &[&[E]]),
    xs: [&[f32]; T],
    out: &mut [f32],
    stride: usize,
) {
    let n = xs.first().map_or(0, |x| x.len());
    for x in &xs {
        assert_eq!(x.len(), n, "dot_keys: length mismatch");
    }
    let keys = keys.narrow(n);
    let tk = keys.len();
    if tk == 0 || T == 0 {
        return;
    }
    assert!(
        out.len() >= (T - 1) * stride + tk && stride >= tk,
        "dot_keys: output too short"
    );
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `dot_f32_with`; the lengths are checked above.
        SimdTier::Avx2 => with_rows!(keys, k => unsafe {
            avx2::dot_keys((k, tk, ahead), xs, out, stride)
        }),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, and the clamped tier has AVX-512 F/BW/VL.
        SimdTier::Avx512 => with_rows!(keys, k => unsafe {
            avx2::dot_keys_wide((k, tk, ahead), xs, out, stride)
        }),
        _ => {
            for (t, x) in xs.iter().enumerate() {
                for (j, o) in out[t * stride..t * stride + tk].iter_mut().enumerate() {
                    *o = dot_scalar(keys.row(j), x);
                }
            }
        }
    }
}

/// The f64-accumulated reference.
pub fn dot_f32_ref(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Portable f32 path: eight partial sums, which the compiler vectorises with
/// the baseline ISA (SSE2 on x86-64) and which keep the rounding error of a
/// long sum closer to that of the SIMD paths.
fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    dot_scalar(a, b)
}

/// [`dot_f32_scalar`] with `a` of any [`Lanes`] type, widened exactly.
fn dot_scalar<E: Lanes>(a: &[E], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, at) = a.split_at(a.len() - a.len() % 8);
    let (b8, bt) = b.split_at(a8.len());
    for (ca, cb) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += ca[k].to_f32() * cb[k];
        }
    }
    let tail: f32 = at.iter().zip(bt).map(|(x, y)| x.to_f32() * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use crate::lanes::{Lanes, RowPtrs};
    use std::arch::x86_64::*;

    /// Horizontal sum of 8 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The horizontal sums of four vectors at once (three `hadd`s and one
    /// add, instead of four separate reductions).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(crate) fn hsum4(v: [__m256; 4]) -> [f32; 4] {
        let s = hsum4_m128(v);
        let mut out = [0f32; 4];
        // SAFETY: `out` holds four floats; the store is unaligned.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
        out
    }

    /// [`hsum4`] left in a register.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn hsum4_m128(v: [__m256; 4]) -> __m128 {
        let ab = _mm256_hadd_ps(v[0], v[1]);
        let cd = _mm256_hadd_ps(v[2], v[3]);
        let abcd = _mm256_hadd_ps(ab, cd);
        _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1))
    }

    /// # Safety
    /// The CPU supports AVX2 and FMA, and `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let pa = a.as_ptr();
        let pb = b.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        // SAFETY (all loads below): `i + 32 <= n`, `i + 8 <= n` or `i < n`
        // bound every read within both slices of length `n`; loads are unaligned.
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let j = i + 8 * k;
                *acc =
                    _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(j)), _mm256_loadu_ps(pb.add(j)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = hsum(sum);
        while i < n {
            total += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        total
    }

    /// # Safety
    /// The CPU supports AVX2 and FMA, and every row has `x.len()` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot4(rows: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
        let n = x.len();
        let px = x.as_ptr();
        let pr = rows.map(<[f32]>::as_ptr);
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        // SAFETY (all loads below): `i + 16 <= n`, `i + 8 <= n` or `i < n`
        // bound every read within `x` and each row, all of length `n`.
        while i + 16 <= n {
            let x0 = _mm256_loadu_ps(px.add(i));
            let x1 = _mm256_loadu_ps(px.add(i + 8));
            for r in 0..4 {
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(pr[r].add(i)), x0, acc[r]);
                acc[r + 4] = _mm256_fmadd_ps(_mm256_loadu_ps(pr[r].add(i + 8)), x1, acc[r + 4]);
            }
            i += 16;
        }
        while i + 8 <= n {
            let x0 = _mm256_loadu_ps(px.add(i));
            for r in 0..4 {
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(pr[r].add(i)), x0, acc[r]);
            }
            i += 8;
        }
        let mut out = hsum4([0, 1, 2, 3].map(|r| _mm256_add_ps(acc[r], acc[r + 4])));
        while i < n {
            let xi = *px.add(i);
            for r in 0..4 {
                out[r] += *pr[r].add(i) * xi;
            }
            i += 1;
        }
        out
    }

    /// Four rows against `T` vectors of `n` elements: per vector, the
    /// rows' sums over the first `n / 8 * 8` elements (the tail is the
    /// caller's), one register each.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C, and every pointer reads `n` values.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile_sums<E: Lanes, const T: usize, const PF: bool>(
        pr: [*const E; 4],
        px: [*const f32; T],
        n: usize,
        ahead: [*const E; 4],
    ) -> [__m128; T] {
        let mut acc = [[_mm256_setzero_ps(); T]; 4];
        let mut i = 0;
        // SAFETY (all loads below): `i + 8 <= n` bounds every read within
        // the rows and vectors, all of length `n`.
        while i + 8 <= n {
            if PF {
                let off = i * std::mem::size_of::<E>();
                if off % 64 < 8 * std::mem::size_of::<E>() {
                    for p in ahead {
                        // A hint: never faults, whatever the address.
                        _mm_prefetch::<_MM_HINT_T1>((p as *const i8).wrapping_add(off));
                    }
                }
            }
            let x = px.map(|p| unsafe { _mm256_loadu_ps(p.add(i)) });
            for (acc, p) in acc.iter_mut().zip(pr) {
                let w = unsafe { E::load8(p.add(i)) };
                for (acc, x) in acc.iter_mut().zip(x) {
                    *acc = _mm256_fmadd_ps(w, x, *acc);
                }
            }
            i += 8;
        }
        std::array::from_fn(|t| hsum4_m128([acc[0][t], acc[1][t], acc[2][t], acc[3][t]]))
    }

    /// # Safety
    /// The CPU supports AVX2 and FMA, and every row and vector has
    /// `rows[0].len()` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_tile<const T: usize>(
        rows: [&[f32]; 4],
        xs: [&[f32]; T],
    ) -> [[f32; T]; 4] {
        let n = rows[0].len();
        let pr = rows.map(<[f32]>::as_ptr);
        let px = xs.map(<[f32]>::as_ptr);
        // SAFETY: every row and vector has `n` elements.
        let sums = unsafe { tile_sums::<f32, T, false>(pr, px, n, pr) };
        let mut out = [[0f32; T]; 4];
        for (t, s) in sums.into_iter().enumerate() {
            let mut v = [0f32; 4];
            // SAFETY: `v` holds four floats; the store is unaligned.
            unsafe { _mm_storeu_ps(v.as_mut_ptr(), s) };
            for r in 0..4 {
                out[r][t] = v[r];
            }
        }
        let i = n / 8 * 8;
        for (out, p) in out.iter_mut().zip(pr) {
            for (out, x) in out.iter_mut().zip(px) {
                for j in i..n {
                    // SAFETY: `j < n`.
                    *out += unsafe { *p.add(j) * *x.add(j) };
                }
            }
        }
        out
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `keys` holds at least one row,
    /// each of `n` values (every vector's length), and `out` holds row
    /// `T - 1` of `stride ≥ keys.len()` (see [`super::dot_keys_with`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_keys<'a, E: Lanes + 'a, P: RowPtrs<'a, E>, const T: usize>(
        (keys, tk, ahead): (P, usize, &[&[E]]),
        xs: [&[f32]; T],
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe { dot_keys_body((keys, tk, ahead), xs, out, stride) }
    }

    /// [`dot_keys`] with AVX-512 VL's 32 vector registers, for tiles of
    /// up to six vectors (24 accumulators): the same FMA chains.
    ///
    /// # Safety
    /// As for [`dot_keys`], and the CPU supports AVX-512 F/BW/VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn dot_keys_wide<'a, E: Lanes + 'a, P: RowPtrs<'a, E>, const T: usize>(
        (keys, tk, ahead): (P, usize, &[&[E]]),
        xs: [&[f32]; T],
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe { dot_keys_body((keys, tk, ahead), xs, out, stride) }
    }

    /// The body of [`dot_keys`] and [`dot_keys_wide`].
    ///
    /// # Safety
    /// As for [`dot_keys`], called only from the two.
    #[inline(always)]
    unsafe fn dot_keys_body<'a, E: Lanes + 'a, P: RowPtrs<'a, E>, const T: usize>(
        (keys, tk, ahead): (P, usize, &[&[E]]),
        xs: [&[f32]; T],
        out: &mut [f32],
        stride: usize,
    ) {
        let n = xs[0].len();
        let px = xs.map(<[f32]>::as_ptr);
        let po = out.as_mut_ptr();
        let tail = n / 8 * 8;
        let mut jj = 0;
        while jj < tk {
            let kn = (tk - jj).min(4);
            // Rows below `tk`, the set's length: each reads `n` values.
            // Written out: `[0, 1, 2, 3].map(..)` was not inlined (a call
            // per four keys, 2-3% of a decode step's attention).
            let last = jj + kn - 1;
            let pr = [
                keys.ptr(jj),
                keys.ptr((jj + 1).min(last)),
                keys.ptr((jj + 2).min(last)),
                keys.ptr((jj + 3).min(last)),
            ];
            // SAFETY: every pointer of `pr` reads `n` values (the rows'
            // width); the rows ahead are only prefetched.
            let sums = unsafe {
                match jj < ahead.len() {
                    true => {
                        let end = ahead.len() - 1;
                        let pf = [
                            ahead[jj.min(end)].as_ptr(),
                            ahead[(jj + 1).min(end)].as_ptr(),
                            ahead[(jj + 2).min(end)].as_ptr(),
                            ahead[(jj + 3).min(end)].as_ptr(),
                        ];
                        tile_sums::<E, T, true>(pr, px, n, pf)
                    }
                    false => tile_sums::<E, T, false>(pr, px, n, pr),
                }
            };
            for (t, s) in sums.into_iter().enumerate() {
                // SAFETY: `t * stride + jj + kn <= (T - 1) * stride + tk`,
                // within `out`.
                let dst = unsafe { po.add(t * stride + jj) };
                if kn == 4 && tail == n {
                    unsafe { _mm_storeu_ps(dst, s) };
                    continue;
                }
                let mut v = [0f32; 4];
                // SAFETY: `v` holds four floats.
                unsafe { _mm_storeu_ps(v.as_mut_ptr(), s) };
                for (r, v) in v.iter_mut().enumerate().take(kn) {
                    for j in tail..n {
                        // SAFETY: `j < n`, within the key row and the vector.
                        *v += unsafe { (*pr[r].add(j)).to_f32() * *px[t].add(j) };
                    }
                    // SAFETY: `r < kn`: within the row's `tk` outputs.
                    unsafe { *dst.add(r) = *v };
                }
            }
            jj += kn;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// f32 sums of up to ~1000 products: the error stays far below 1e-5 of
    /// Σ|a·b| for random signs, while one wrong or missing term is ~1e-3 of it.
    const REL_TOL: f64 = 1e-5;

    fn random(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn assert_close(got: f32, a: &[f32], b: &[f32], what: &str) {
        let want = dot_f32_ref(a, b);
        let scale: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 * y as f64).abs())
            .sum();
        let err = (got as f64 - want).abs();
        assert!(
            err <= REL_TOL * scale + 1e-30,
            "{what} n={}: got {got}, want {want}, err {err}",
            a.len()
        );
    }

    #[test]
    fn every_tier_matches_f64_on_odd_lengths() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for tier in cpu::available_tiers() {
            for n in [0usize, 1, 3, 7, 8, 9, 15, 17, 31, 33, 63, 100, 257, 1023] {
                let a = random(&mut rng, n);
                let b = random(&mut rng, n);
                assert_close(dot_f32_with(tier, &a, &b), &a, &b, tier.name());
            }
        }
    }

    #[test]
    fn dot4_matches_single_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        for tier in cpu::available_tiers() {
            for n in [1usize, 5, 8, 13, 16, 23, 40, 131] {
                let x = random(&mut rng, n);
                let rows: Vec<Vec<f32>> = (0..4).map(|_| random(&mut rng, n)).collect();
                let got = dot4_f32_with(tier, [&rows[0], &rows[1], &rows[2], &rows[3]], &x);
                for (r, g) in rows.iter().zip(got) {
                    assert_close(g, r, &x, tier.name());
                }
            }
        }
    }

    #[test]
    fn dot_tile_matches_single_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for tier in cpu::available_tiers() {
            for n in [1usize, 5, 8, 13, 16, 23, 40, 131] {
                let rows: Vec<Vec<f32>> = (0..4).map(|_| random(&mut rng, n)).collect();
                let xs: Vec<Vec<f32>> = (0..6).map(|_| random(&mut rng, n)).collect();
                let rows = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
                let got3 = dot_tile_f32_with(tier, rows, [&xs[0][..], &xs[1], &xs[2]]);
                let got2 = dot_tile_f32_with(tier, rows, [&xs[0][..], &xs[1]]);
                let x = |t: usize| &xs[t][..];
                let got4 = dot_tile_f32_with(tier, rows, [x(0), x(1), x(2), x(3)]);
                let got6 = dot_tile_f32_with(tier, rows, [x(0), x(1), x(2), x(3), x(4), x(5)]);
                for (r, row) in rows.iter().enumerate() {
                    for (t, x) in xs.iter().enumerate() {
                        assert_close(got6[r][t], row, x, tier.name());
                        // Each pair's bits whatever else the tile holds
                        // (AVX2 runs four as two passes, six as two).
                        let alone = dot_tile_f32_with(tier, rows, [&x[..]])[r][0];
                        assert_eq!(got6[r][t].to_bits(), alone.to_bits(), "{tier} n {n}");
                        if t < 4 {
                            assert_eq!(got4[r][t].to_bits(), alone.to_bits(), "{tier} n {n}");
                        }
                        if t < 3 {
                            assert_close(got3[r][t], row, x, tier.name());
                        }
                        if t < 2 {
                            assert_close(got2[r][t], row, x, tier.name());
                        }
                    }
                }
            }
        }
    }

    /// The in-place key tile gives the bits of the four-row tile for every
    /// pair, for any key count (short last groups) and vector count, and
    /// f16 and bf16 key rows read as stored give the bits of the same rows
    /// widened to f32.
    #[test]
    fn dot_keys_equals_the_tile_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        for tier in cpu::available_tiers() {
            for n in [1usize, 7, 8, 16, 21, 64, 131] {
                for tk in [1usize, 3, 4, 5, 11, 32] {
                    // Keys that f16 and bf16 hold exactly.
                    let keys: Vec<f32> = random(&mut rng, tk * n)
                        .iter()
                        .map(|&x| half::bf16::from_f32(x).to_f32())
                        .collect();
                    let rows: Vec<&[f32]> = keys.chunks_exact(n).collect();
                    let xs: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, n)).collect();
                    let stride = tk + 3;
                    let mut out = vec![f32::NAN; 2 * stride + tk];
                    dot_keys_with(
                        tier,
                        (RowSet::strided(&keys, n, tk, n), &rows),
                        [&xs[0][..], &xs[1], &xs[2]],
                        &mut out,
                        stride,
                    );
                    let mut one = vec![f32::NAN; tk];
                    dot_keys_with(
                        tier,
                        (RowSet::gathered(&rows, n), &[]),
                        [&xs[1][..]],
                        &mut one,
                        tk,
                    );
                    for j in 0..tk {
                        let key = rows[j];
                        let want = dot_tile_f32_with(tier, [key; 4], [&xs[0][..], &xs[1], &xs[2]]);
                        for t in 0..3 {
                            let got = out[t * stride + j];
                            assert_eq!(
                                got.to_bits(),
                                want[0][t].to_bits(),
                                "{tier} n {n} tk {tk} key {j} vector {t}"
                            );
                            assert_close(got, key, &xs[t], tier.name());
                        }
                        assert_eq!(one[j].to_bits(), want[0][1].to_bits());
                    }
                    // Six vectors at once (AVX-512's widest tile): each as in three.
                    let xs6 = [&xs[0][..], &xs[1], &xs[2], &xs[0], &xs[1], &xs[2]];
                    let mut six = vec![f32::NAN; 5 * stride + tk];
                    let k = (RowSet::strided(&keys, n, tk, n), &rows[..]);
                    dot_keys_with(tier, k, xs6, &mut six, stride);
                    for t in 0..6 {
                        let (a, b) = (&six[t * stride..][..tk], &out[t % 3 * stride..][..tk]);
                        assert_eq!(bits(a), bits(b), "{tier} n {n} tk {tk} six, vector {t}");
                    }
                    // Between rows, past `tk`: untouched.
                    assert!(out[tk..stride].iter().all(|v| v.is_nan()));
                    let f16: Vec<half::f16> =
                        keys.iter().map(|&x| half::f16::from_f32(x)).collect();
                    let bf16: Vec<half::bf16> =
                        keys.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    let xs3 = [&xs[0][..], &xs[1], &xs[2]];
                    let mut got = vec![f32::NAN; 2 * stride + tk];
                    let f16_rows: Vec<&[half::f16]> = f16.chunks_exact(n).collect();
                    dot_keys_with(
                        tier,
                        (RowSet::gathered(&f16_rows, n), &f16_rows),
                        xs3,
                        &mut got,
                        stride,
                    );
                    // f16 rounds some bf16 values (fewer exponent bits): compare
                    // with its own widening.
                    let widened: Vec<f32> = f16.iter().map(|h| h.to_f32()).collect();
                    let wrows: Vec<&[f32]> = widened.chunks_exact(n).collect();
                    let mut want = vec![f32::NAN; 2 * stride + tk];
                    dot_keys_with(
                        tier,
                        (RowSet::gathered(&wrows, n), &wrows[..1]),
                        xs3,
                        &mut want,
                        stride,
                    );
                    assert_eq!(bits(&got), bits(&want), "{tier} f16 n {n} tk {tk}");
                    let bf16_rows: Vec<&[half::bf16]> = bf16.chunks_exact(n).collect();
                    dot_keys_with(
                        tier,
                        (RowSet::gathered(&bf16_rows, n), &bf16_rows),
                        xs3,
                        &mut got,
                        stride,
                    );
                    assert_eq!(bits(&got), bits(&out), "{tier} bf16 n {n} tk {tk}");
                }
            }
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    #[should_panic(expected = "length mismatch")]
    fn mismatched_lengths_panic() {
        dot_f32(&[1.0, 2.0], &[1.0]);
    }
}
