//! Small vector loops of the attention kernels: shifted exponentials, a
//! weighted sum of rows, scaling.
//!
//! Each is written once as plain Rust over slices and compiled twice: as is
//! (the scalar tier) and inside an `avx2,fma` function, where LLVM
//! vectorizes the same loop 8 lanes wide. The exponential is a branch-free
//! polynomial (Cephes' `expf`: range reduction by `ln 2`, degree-6
//! polynomial, relative error ~2e-7) so that it vectorizes at all; `f32::exp`
//! is a libm call per value.

use crate::cpu::{self, SimdTier};

/// `a·b + c`, fused where the tier has FMA.
pub(crate) trait Fma {
    fn fma(a: f32, b: f32, c: f32) -> f32;
}

pub(crate) struct Plain;
impl Fma for Plain {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) struct Fused;
#[cfg(target_arch = "x86_64")]
impl Fma for Fused {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// Below this, `exp` is 0 in f32 (and the reduction below would underflow).
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 88.0;

/// `e^x` for `x ≤ 88`; exactly 0 below [`EXP_MIN`] (and for `-inf`).
#[inline(always)]
pub(crate) fn exp<F: Fma>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Adding 1.5·2^23 rounds to an integer, left in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(EXP_MIN, EXP_MAX);
    let t = F::fma(xc, LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = F::fma(n, -LN2_LO, F::fma(n, -LN2_HI, xc));
    let mut p = 1.987_569_1e-4f32;
    p = F::fma(p, r, 1.398_199_9e-3);
    p = F::fma(p, r, 8.333_452e-3);
    p = F::fma(p, r, 4.166_579_6e-2);
    p = F::fma(p, r, 1.666_666_5e-1);
    p = F::fma(p, r, 0.5);
    let e = F::fma(p, r * r, r) + 1.0;
    // 2^n from the integer in `t`'s low bits: n + 127 in the exponent field.
    let bits = t.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23;
    let v = e * f32::from_bits(bits);
    if x < EXP_MIN {
        0.0
    } else {
        v
    }
}

#[inline(always)]
fn exp_shifted_body<F: Fma>(s: &mut [f32], m: f32) -> f32 {
    // Eight partial sums: one running sum would be a serial chain of adds
    // that keeps the whole loop scalar (float adds may not be reordered).
    let mut lanes = [0f32; 8];
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        for (v, l) in c.iter_mut().zip(lanes.iter_mut()) {
            *v = exp::<F>(*v - m);
            *l += *v;
        }
    }
    let mut sum = lanes.iter().sum::<f32>();
    for v in chunks.into_remainder() {
        *v = exp::<F>(*v - m);
        sum += *v;
    }
    sum
}

/// Accumulator values kept in registers while every row adds into them:
/// 8 registers of 8 lanes, so 8 independent FMA chains cover the FMA
/// latency (one chain would run at a fifth of the FMA rate).
const BLOCK: usize = 64;

#[inline(always)]
fn weighted_rows_body<F: Fma>(p: &[f32], v: &[f32], base: usize, stride: usize, acc: &mut [f32]) {
    let n = acc.len();
    if let Some(last) = p.len().checked_sub(1) {
        // Bounds once, so the loops below index without checks.
        assert!(
            base + last * stride + n <= v.len(),
            "weighted_rows: rows past the end"
        );
    }
    let mut blocks = acc.chunks_exact_mut(BLOCK);
    let mut c0 = 0;
    for a in &mut blocks {
        let mut r: [f32; BLOCK] = std::array::from_fn(|i| a[i]);
        for (j, &w) in p.iter().enumerate() {
            let row = &v[base + j * stride + c0..][..BLOCK];
            for i in 0..BLOCK {
                r[i] = F::fma(w, row[i], r[i]);
            }
        }
        a.copy_from_slice(&r);
        c0 += BLOCK;
    }
    let tail = blocks.into_remainder();
    for (j, &w) in p.iter().enumerate() {
        let row = &v[base + j * stride + c0..][..tail.len()];
        for (a, &x) in tail.iter_mut().zip(row) {
            *a = F::fma(w, x, *a);
        }
    }
}

/// Rows of [`weighted_rows_group_body`] that share each load of a value
/// row, and the columns each keeps in registers: 3 × 32 lanes is 12 of
/// the 16 AVX2 registers. One row alone loads a value row per FMA, and
/// Gemma 3's 32-key value tile (32 KiB) lives in L2: the loads, not the
/// FMAs, set the pace.
const GROUP_ROWS: usize = 3;
const GROUP_COLS: usize = 32;

/// `acc[k·n + i] += Σ_j p[k·p_stride + j] · v[j·stride + i]` for `j < len`,
/// rows `k` of `acc` (`n` each): [`weighted_rows_body`] for several rows
/// of probabilities over the same value rows. Each element is the same
/// chain of FMAs over `j` in order as there, so a row's bits do not depend
/// on the rows beside it.
#[inline(always)]
fn weighted_rows_group_body<F: Fma>(
    (p, p_stride, len): (&[f32], usize, usize),
    v: &[f32],
    stride: usize,
    acc: &mut [f32],
    n: usize,
) {
    let rows = acc.len() / n.max(1);
    let mut r = 0;
    while r < rows {
        let g = (rows - r).min(GROUP_ROWS);
        let p = &p[r * p_stride..];
        let acc = &mut acc[r * n..(r + g) * n];
        match g {
            3 => weighted_group::<F, 3>(p, p_stride, len, v, stride, acc),
            2 => weighted_group::<F, 2>(p, p_stride, len, v, stride, acc),
            _ => weighted_rows_body::<F>(&p[..len], v, 0, stride, acc),
        }
        r += g;
    }
}

/// `R` rows of [`weighted_rows_group_body`].
#[inline(always)]
fn weighted_group<F: Fma, const R: usize>(
    p: &[f32],
    p_stride: usize,
    len: usize,
    v: &[f32],
    stride: usize,
    acc: &mut [f32],
) {
    let n = acc.len() / R;
    // Plain loops, not `array::from_fn`: its closure was not inlined into
    // the `avx2` function, a call per key and 19% of prefill attention.
    let mut ps: [&[f32]; R] = [&[]; R];
    for (k, pk) in ps.iter_mut().enumerate() {
        *pk = &p[k * p_stride..][..len];
    }
    if let Some(last) = len.checked_sub(1) {
        assert!(
            last * stride + n <= v.len(),
            "weighted_rows_group: rows past the end"
        );
    }
    let mut c0 = 0;
    while c0 + GROUP_COLS <= n {
        let mut r = [[0f32; GROUP_COLS]; R];
        for (k, rk) in r.iter_mut().enumerate() {
            rk.copy_from_slice(&acc[k * n + c0..][..GROUP_COLS]);
        }
        for j in 0..len {
            let row = &v[j * stride + c0..][..GROUP_COLS];
            let mut w = [0f32; R];
            for (w, pk) in w.iter_mut().zip(&ps) {
                *w = pk[j];
            }
            // Column-outer: one loaded vector of the value row serves every
            // row before the next is loaded (12 accumulators, 3 weights and
            // 1 value vector fill the 16 registers; row-outer spilled two).
            for (i, &x) in row.iter().enumerate() {
                for k in 0..R {
                    r[k][i] = F::fma(w[k], x, r[k][i]);
                }
            }
        }
        for (k, rk) in r.iter().enumerate() {
            acc[k * n + c0..][..GROUP_COLS].copy_from_slice(rk);
        }
        c0 += GROUP_COLS;
    }
    if c0 < n {
        for (k, pk) in ps.iter().enumerate() {
            let a = &mut acc[k * n + c0..(k + 1) * n];
            for (j, &w) in pk.iter().enumerate() {
                let row = &v[j * stride + c0..][..a.len()];
                for (a, &x) in a.iter_mut().zip(row) {
                    *a = F::fma(w, x, *a);
                }
            }
        }
    }
}

#[inline(always)]
fn axpy_body<F: Fma>(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = F::fma(a, x, *y);
    }
}

#[inline(always)]
fn sum_body(x: &[f32]) -> f32 {
    // Eight partial sums, as in `exp_shifted_body`.
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Columns per register block of [`rows_times_matrix_body`]: two vectors
/// of 8 lanes per row, four rows: 8 accumulators.
const COLS: usize = 16;

#[inline(always)]
fn rows_times_matrix_body<F: Fma>(x: &[f32], m: &[f32], k: usize, n: usize, out: &mut [f32]) {
    let rows = out.len() / n.max(1);
    assert!(
        x.len() == rows * k && m.len() == k * n && out.len() == rows * n,
        "rows_times_matrix: mismatched shapes"
    );
    let mut r = 0;
    while r + 4 <= rows {
        rows_block::<F, 4>(x, m, k, n, r, out);
        r += 4;
    }
    while r < rows {
        rows_block::<F, 1>(x, m, k, n, r, out);
        r += 1;
    }
}

/// Rows `r..r + R` of [`rows_times_matrix_body`]: each output element is
/// the same chain of FMAs over `k` in order, whatever `R` and the column
/// block it falls in.
#[inline(always)]
fn rows_block<F: Fma, const R: usize>(
    x: &[f32],
    m: &[f32],
    k: usize,
    n: usize,
    r: usize,
    out: &mut [f32],
) {
    let mut c0 = 0;
    while c0 < n {
        let w = COLS.min(n - c0);
        let mut acc = [[0f32; COLS]; R];
        if w == COLS {
            for i in 0..k {
                let row = &m[i * n + c0..][..COLS];
                for (rr, acc) in acc.iter_mut().enumerate() {
                    let a = x[(r + rr) * k + i];
                    for j in 0..COLS {
                        acc[j] = F::fma(a, row[j], acc[j]);
                    }
                }
            }
        } else {
            for i in 0..k {
                let row = &m[i * n + c0..][..w];
                for (rr, acc) in acc.iter_mut().enumerate() {
                    let a = x[(r + rr) * k + i];
                    for j in 0..w {
                        acc[j] = F::fma(a, row[j], acc[j]);
                    }
                }
            }
        }
        for (rr, acc) in acc.iter().enumerate() {
            out[(r + rr) * n + c0..][..w].copy_from_slice(&acc[..w]);
        }
        c0 += w;
    }
}

#[inline(always)]
fn scale_max_body(a: f32, y: &mut [f32]) -> f32 {
    // Eight running maxima, as the sums in `exp_shifted_body`: a single
    // running maximum would keep the loop scalar.
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = y.chunks_exact_mut(8);
    for c in &mut chunks {
        for (v, l) in c.iter_mut().zip(lanes.iter_mut()) {
            *v *= a;
            *l = if *v > *l { *v } else { *l };
        }
    }
    let mut m = lanes.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    for v in chunks.into_remainder() {
        *v *= a;
        m = m.max(*v);
    }
    m
}

#[inline(always)]
fn scale_body(a: f32, y: &mut [f32]) {
    for v in y.iter_mut() {
        *v *= a;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp_shifted(s: &mut [f32], m: f32) -> f32 {
        exp_shifted_body::<Fused>(s, m)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn weighted_rows(p: &[f32], v: &[f32], base: usize, stride: usize, acc: &mut [f32]) {
        weighted_rows_body::<Fused>(p, v, base, stride, acc)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn weighted_rows_group(
        p: (&[f32], usize, usize),
        v: &[f32],
        stride: usize,
        acc: &mut [f32],
        n: usize,
    ) {
        weighted_rows_group_body::<Fused>(p, v, stride, acc, n)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        axpy_body::<Fused>(a, x, y)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn sum(x: &[f32]) -> f32 {
        sum_body(x)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn rows_times_matrix(x: &[f32], m: &[f32], k: usize, n: usize, out: &mut [f32]) {
        rows_times_matrix_body::<Fused>(x, m, k, n, out)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn scale(a: f32, y: &mut [f32]) {
        scale_body(a, y)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn scale_max(a: f32, y: &mut [f32]) -> f32 {
        scale_max_body(a, y)
    }
}

/// `s[j] = e^(s[j] - m)` in place (0 where `s[j]` is `-inf`); returns `Σ s`.
pub fn exp_shifted(tier: SimdTier, s: &mut [f32], m: f32) -> f32 {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the clamped tier is one the CPU supports, with AVX2 and FMA.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::exp_shifted(s, m) },
        _ => exp_shifted_body::<Plain>(s, m),
    }
}

/// `acc[i] += Σ_j p[j] · v[base + j·stride + i]`: the probability-weighted
/// sum of `p.len()` rows of `v` spaced `stride` apart.
///
/// # Panics
/// If a row runs past the end of `v` (a bug in the calling kernel).
pub fn weighted_rows(
    tier: SimdTier,
    p: &[f32],
    v: &[f32],
    base: usize,
    stride: usize,
    acc: &mut [f32],
) {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe {
            avx2::weighted_rows(p, v, base, stride, acc)
        },
        _ => weighted_rows_body::<Plain>(p, v, base, stride, acc),
    }
}

/// [`weighted_rows`] for the `acc.len() / n` rows of `acc` (`n` each),
/// row `k` weighting the first `len` value rows by `p[k·p_stride..][..len]`:
/// `acc[k·n + i] += Σ_{j<len} p[k·p_stride + j] · v[j·stride + i]`. Every
/// row's result is bit-identical to [`weighted_rows`] on that row alone;
/// rows share each value-row load (three at a time).
///
/// # Panics
/// If a row runs past the end of `v` or `p` (a bug in the calling kernel).
pub fn weighted_rows_group(
    tier: SimdTier,
    (p, p_stride, len): (&[f32], usize, usize),
    v: &[f32],
    stride: usize,
    acc: &mut [f32],
    n: usize,
) {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe {
            avx2::weighted_rows_group((p, p_stride, len), v, stride, acc, n)
        },
        _ => weighted_rows_group_body::<Plain>((p, p_stride, len), v, stride, acc, n),
    }
}

/// `y[i] += a · x[i]` (fused where the tier has FMA).
pub fn axpy(tier: SimdTier, a: f32, x: &[f32], y: &mut [f32]) {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::axpy(a, x, y) },
        _ => axpy_body::<Plain>(a, x, y),
    }
}

/// `Σ x`, in eight partial sums (a fixed order for a given length).
pub fn sum(tier: SimdTier, x: &[f32]) -> f32 {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::sum(x) },
        _ => sum_body(x),
    }
}

/// `out = x · m` for `x` `[rows, k]` and `m` `[k, n]` (row-major): every
/// output element is one chain of multiply-adds over `k` in order, so a
/// row's result does not depend on the other rows (four rows share each
/// loaded row of `m`).
///
/// # Panics
/// If the shapes do not fit (a bug in the calling kernel).
pub fn rows_times_matrix(
    tier: SimdTier,
    x: &[f32],
    m: &[f32],
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::rows_times_matrix(x, m, k, n, out) },
        _ => rows_times_matrix_body::<Plain>(x, m, k, n, out),
    }
}

/// `y *= a`.
pub fn scale(tier: SimdTier, a: f32, y: &mut [f32]) {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::scale(a, y) },
        _ => scale_body(a, y),
    }
}

/// `y *= a`, returning the largest result (`-inf` for an empty slice).
pub fn scale_max(tier: SimdTier, a: f32, y: &mut [f32]) -> f32 {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::scale_max(a, y) },
        _ => scale_max_body(a, y),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Cephes' expf polynomial is accurate to ~2 ulp over the reduced range.
    const EXP_REL_TOL: f64 = 4e-7;

    #[test]
    fn exp_matches_f64_on_every_tier() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let mut xs: Vec<f32> = (0..999).map(|_| rng.random_range(-90.0..0.0)).collect();
        xs.extend([
            0.0,
            -0.0,
            -1e-30,
            f32::NEG_INFINITY,
            -86.9,
            -87.5,
            -20.0,
            10.0,
            88.0,
        ]);
        for tier in cpu::available_tiers() {
            let mut s = xs.clone();
            let sum = exp_shifted(tier, &mut s, 0.0);
            let mut want_sum = 0f64;
            for (&x, &e) in xs.iter().zip(&s) {
                let want = if x < EXP_MIN { 0.0 } else { (x as f64).exp() };
                want_sum += want;
                assert!(
                    (e as f64 - want).abs() <= EXP_REL_TOL * want,
                    "{tier}: exp({x}) = {e}, want {want}"
                );
            }
            assert!((sum as f64 - want_sum).abs() <= 1e-5 * want_sum);
        }
    }

    #[test]
    fn weighted_rows_and_scale_match_scalar_loops() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
        for &(n, rows, stride) in &[
            (1usize, 1usize, 1usize),
            (7, 3, 9),
            (64, 33, 192),
            (13, 5, 13),
        ] {
            let p: Vec<f32> = (0..rows).map(|_| rng.random_range(0.0..1.0)).collect();
            let v: Vec<f32> = (0..2 + rows * stride + n)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let init: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want: Vec<f64> = (0..n)
                .map(|i| {
                    init[i] as f64
                        + (0..rows)
                            .map(|j| p[j] as f64 * v[2 + j * stride + i] as f64)
                            .sum::<f64>()
                })
                .collect();
            for tier in cpu::available_tiers() {
                let mut acc = init.clone();
                weighted_rows(tier, &p, &v, 2, stride, &mut acc);
                for (a, w) in acc.iter().zip(&want) {
                    assert!((*a as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()), "{tier}");
                }
                scale(tier, 0.5, &mut acc);
                for (a, w) in acc.iter().zip(&want) {
                    assert!(
                        (*a as f64 - 0.5 * w).abs() <= 1e-5 * (1.0 + w.abs()),
                        "{tier}"
                    );
                }
            }
        }
    }

    /// Each row of `weighted_rows_group` bit-identical to `weighted_rows`
    /// on the row alone, on every tier (row counts around the 3-row group,
    /// widths around the 32-column block).
    #[test]
    fn weighted_rows_group_equals_each_row_alone() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for &(rows, len, n, stride) in &[
            (1usize, 1usize, 1usize, 1usize),
            (2, 5, 33, 40),
            (3, 32, 64, 64),
            (7, 17, 95, 101),
            (24, 32, 256, 256),
        ] {
            let ps = len + 3;
            let p: Vec<f32> = (0..rows * ps).map(|_| rng.random_range(0.0..1.0)).collect();
            let v: Vec<f32> = (0..(len - 1) * stride + n)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let init: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            for tier in cpu::available_tiers() {
                let mut acc = init.clone();
                weighted_rows_group(tier, (&p, ps, len), &v, stride, &mut acc, n);
                for r in 0..rows {
                    let mut want = init[r * n..(r + 1) * n].to_vec();
                    weighted_rows(tier, &p[r * ps..][..len], &v, 0, stride, &mut want);
                    let got = &acc[r * n..(r + 1) * n];
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{tier}: rows {rows}, len {len}, n {n}: row {r}"
                    );
                }
            }
        }
    }

    /// `rows_times_matrix` against f64 sums, and each row's bits the same
    /// alone as among others (odd shapes around the 4-row and 16-column
    /// blocks).
    #[test]
    fn rows_times_matrix_is_exact_per_row() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        for &(rows, k, n) in &[
            (1usize, 1usize, 1usize),
            (5, 13, 17),
            (8, 64, 64),
            (3, 7, 33),
        ] {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let m: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            for tier in cpu::available_tiers() {
                let mut out = vec![f32::NAN; rows * n];
                rows_times_matrix(tier, &x, &m, k, n, &mut out);
                for r in 0..rows {
                    let mut one = vec![f32::NAN; n];
                    rows_times_matrix(tier, &x[r * k..(r + 1) * k], &m, k, n, &mut one);
                    assert_eq!(one, out[r * n..(r + 1) * n], "{tier} row {r}");
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|i| x[r * k + i] as f64 * m[i * n + j] as f64)
                            .sum();
                        assert!(
                            (out[r * n + j] as f64 - want).abs() <= 1e-5 * k as f64,
                            "{tier}"
                        );
                    }
                }
                let mut y = x[..k].to_vec();
                axpy(tier, 0.5, &m[..k], &mut y);
                for i in 0..k {
                    assert!((y[i] - (x[i] + 0.5 * m[i])).abs() <= 1e-6);
                }
                let want: f64 = x.iter().map(|&v| v as f64).sum();
                assert!((sum(tier, &x) as f64 - want).abs() <= 1e-4);
            }
        }
    }
}
