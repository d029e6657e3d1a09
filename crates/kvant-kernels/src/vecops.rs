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
use crate::lanes::{with_rows, Lanes, RowPtrs, RowSet};

/// `a·b + c`, fused where the tier has FMA: a generic body takes it as a
/// type parameter, [`Plain`] in its scalar copy and [`Fused`] in its
/// AVX2/AVX-512 ones.
pub trait Fma {
    /// `a·b + c`.
    fn fma(a: f32, b: f32, c: f32) -> f32;
}

/// A multiply and an add, rounded twice (the scalar tier).
pub struct Plain;
impl Fma for Plain {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// One fused multiply-add, rounded once (every tier from AVX2 up).
#[cfg(target_arch = "x86_64")]
pub struct Fused;
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
pub fn exp<F: Fma>(x: f32) -> f32 {
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

/// `acc[k·n + i] += Σ_j p[k·p_stride + j] · rows[j][i]` for `j <
/// rows.len()`: several rows of probabilities weighting the same value
/// rows, each value widened exactly. Each element is one chain of FMAs
/// over `j` in order, so a row's bits do not depend on the rows beside it
/// or on the values' stored type.
#[inline(always)]
fn weighted_rows_group_body<E: Lanes, F: Fma>(
    (p, p_stride): (&[f32], usize),
    rows: RowSet<'_, '_, E>,
    acc: &mut [f32],
    n: usize,
) {
    for (k, acc) in acc.chunks_exact_mut(n.max(1)).enumerate() {
        let p = &p[k * p_stride..][..rows.len()];
        for (j, &w) in p.iter().enumerate() {
            for (a, x) in acc.iter_mut().zip(rows.row(j)) {
                *a = F::fma(w, x.to_f32(), *a);
            }
        }
    }
}

/// Rows of [`weighted_f32_body`] that share each load of a value row,
/// and the columns each keeps in registers: 3 × 32 lanes is 12 of the 16
/// AVX2 registers; a row alone keeps 64 (8 FMA chains cover the latency).
/// Gemma 3's 32-key value tile (32 KiB) lives in L2: the loads, not the
/// FMAs, set the pace.
const GROUP_ROWS: usize = 3;
const GROUP_COLS: usize = 32;
const SINGLE_COLS: usize = 64;

/// With AVX-512 VL's 32 vector registers: 6 × 32 lanes is 24 of them, so
/// up to six rows (a token's heads that share a key-value head, Gemma 3's
/// four among them) share each value-row load in one pass.
const WIDE_GROUP_ROWS: usize = 6;

/// Most rows `tier`'s attention kernels run in one pass (the score tile of
/// `dot_keys` as the weighted-rows kernel here): [`WIDE_GROUP_ROWS`] where
/// AVX-512 VL's 32 registers hold them, else [`GROUP_ROWS`].
pub(crate) fn rows_per_tile(tier: SimdTier) -> usize {
    match cpu::clamp(tier) {
        SimdTier::Avx512 => WIDE_GROUP_ROWS,
        _ => GROUP_ROWS,
    }
}

/// Rows the next pass of a weighted-rows kernel takes, of `left`, at most
/// `most`: two near-equal passes rather than a full one and a short one
/// (a lone row loads a value vector per FMA, and each pass loads, or
/// converts, the value rows again).
#[inline(always)]
pub(crate) fn rows_per_pass(left: usize, most: usize) -> usize {
    match left {
        _ if left <= most => left,
        _ if left < 2 * most => left.div_ceil(2),
        _ => most,
    }
}

/// [`weighted_rows_group_body`] over f32 value rows as plain loops the
/// compiler vectorizes (the prompt path, over tiles widened once per
/// sweep): the same blocking written with intrinsics spilled and ran the
/// prompt's attention 4–7% slower (one thread, 128 tokens after 2048).
#[inline(always)]
fn weighted_f32_body<'a, E: Lanes + 'a, F: Fma, P: RowPtrs<'a, E>, const ROWS: usize>(
    (p, p_stride): (&[f32], usize),
    (rows, len): (P, usize),
    acc: &mut [f32],
    n: usize,
) {
    let n_rows = acc.len() / n.max(1);
    let mut r = 0;
    while r < n_rows {
        let g = rows_per_pass(n_rows - r, ROWS);
        let p = &p[r * p_stride..];
        let acc = &mut acc[r * n..(r + g) * n];
        let rows = (rows, len);
        match g {
            6 => weighted_f32_group::<E, F, P, 6, GROUP_COLS>((p, p_stride), rows, acc),
            5 => weighted_f32_group::<E, F, P, 5, GROUP_COLS>((p, p_stride), rows, acc),
            4 => weighted_f32_group::<E, F, P, 4, GROUP_COLS>((p, p_stride), rows, acc),
            3 => weighted_f32_group::<E, F, P, 3, GROUP_COLS>((p, p_stride), rows, acc),
            2 => weighted_f32_group::<E, F, P, 2, GROUP_COLS>((p, p_stride), rows, acc),
            _ => weighted_f32_group::<E, F, P, 1, SINGLE_COLS>((p, p_stride), rows, acc),
        }
        r += g;
    }
}

/// `R` rows of [`weighted_f32_body`], `C` columns at a time.
#[inline(always)]
fn weighted_f32_group<
    'a,
    E: Lanes + 'a,
    F: Fma,
    P: RowPtrs<'a, E>,
    const R: usize,
    const C: usize,
>(
    (p, p_stride): (&[f32], usize),
    (rows, len): (P, usize),
    acc: &mut [f32],
) {
    let n = acc.len() / R;
    // Plain loops, not `array::from_fn`: its closure was not inlined into
    // the `avx2` function, a call per key and 19% of prefill attention.
    let mut ps: [&[f32]; R] = [&[]; R];
    for (k, pk) in ps.iter_mut().enumerate() {
        *pk = &p[k * p_stride..][..len];
    }
    let mut c0 = 0;
    while c0 + C <= n {
        let mut r = [[0f32; C]; R];
        for (k, rk) in r.iter_mut().enumerate() {
            rk.copy_from_slice(&acc[k * n + c0..][..C]);
        }
        for j in 0..len {
            let row = &rows.row(j)[c0..][..C];
            let mut w = [0f32; R];
            for (w, pk) in w.iter_mut().zip(&ps) {
                *w = pk[j];
            }
            // Column-outer: one loaded vector of the value row serves every
            // row before the next is loaded (12 accumulators, 3 weights and
            // 1 value vector fill the 16 registers; row-outer spilled two).
            for (i, x) in row.iter().enumerate() {
                for k in 0..R {
                    r[k][i] = F::fma(w[k], x.to_f32(), r[k][i]);
                }
            }
        }
        for (k, rk) in r.iter().enumerate() {
            acc[k * n + c0..][..C].copy_from_slice(rk);
        }
        c0 += C;
    }
    if c0 < n {
        for (k, pk) in ps.iter().enumerate() {
            let a = &mut acc[k * n + c0..(k + 1) * n];
            for (j, &w) in pk.iter().enumerate() {
                let row = &rows.row(j)[c0..][..a.len()];
                for (a, x) in a.iter_mut().zip(row) {
                    *a = F::fma(w, x.to_f32(), *a);
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

/// Lanes of [`argmax_finite`]'s two passes: two vectors of 8 on AVX2.
const ARGMAX_LANES: usize = 16;

#[inline(always)]
fn max_finite_body(x: &[f32]) -> f32 {
    // Running maxima per lane, as in `scale_max_body`; a value that is not
    // finite (NaN, ±inf) counts as -inf, so `m` is finite exactly when some
    // value is.
    let finite = |v: f32| {
        if v.abs() < f32::INFINITY {
            v
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut lanes = [f32::NEG_INFINITY; ARGMAX_LANES];
    let mut chunks = x.chunks_exact(ARGMAX_LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            let v = finite(v);
            *l = if v > *l { v } else { *l };
        }
    }
    let m = lanes.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    chunks.remainder().iter().fold(m, |m, &v| m.max(finite(v)))
}

#[inline(always)]
fn first_equal_body(x: &[f32], m: f32) -> Option<usize> {
    // A whole chunk compared at once (no exit inside it, so it stays one
    // vector compare per 8 lanes), then the hit located within the chunk.
    let mut chunks = x.chunks_exact(ARGMAX_LANES);
    for (i, c) in (&mut chunks).enumerate() {
        if c.iter().fold(false, |hit, &v| hit | (v == m)) {
            return c.iter().position(|&v| v == m).map(|j| i * ARGMAX_LANES + j);
        }
    }
    let at = x.len() - chunks.remainder().len();
    chunks
        .remainder()
        .iter()
        .position(|&v| v == m)
        .map(|j| at + j)
}

#[inline(always)]
fn argmax_finite_body(x: &[f32]) -> Option<usize> {
    let m = max_finite_body(x);
    // `x[i] == m` only for finite `x[i]` when `m` is finite; -0.0 == 0.0,
    // as the one-pass comparison `x[i] > best` treats them.
    match m > f32::NEG_INFINITY {
        true => first_equal_body(x, m),
        false => None,
    }
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
    use crate::lanes::RowPtrs;

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn exp_shifted(s: &mut [f32], m: f32) -> f32 {
        exp_shifted_body::<Fused>(s, m)
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; the slices are as
    /// [`super::weighted_rows_group`] checks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weighted_rows_group<'a, E: Lanes + 'a, P: RowPtrs<'a, E>>(
        (p, p_stride): (&[f32], usize),
        (rows, len, ahead): (P, usize, &[&[E]]),
        acc: &mut [f32],
        n: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe { weighted_rows_body::<E, P, GROUP_ROWS>((p, p_stride), (rows, len, ahead), acc, n) }
    }

    /// [`weighted_rows_group`] with AVX-512 VL's 32 vector registers: up
    /// to six rows per pass ([`WIDE_GROUP_ROWS`]), the same FMA chains.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F/BW/VL, AVX2, FMA and F16C; the slices
    /// are as [`super::weighted_rows_group`] checks.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn weighted_rows_group_wide<'a, E: Lanes + 'a, P: RowPtrs<'a, E>>(
        (p, p_stride): (&[f32], usize),
        (rows, len, ahead): (P, usize, &[&[E]]),
        acc: &mut [f32],
        n: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            weighted_rows_body::<E, P, WIDE_GROUP_ROWS>((p, p_stride), (rows, len, ahead), acc, n)
        }
    }

    /// The body of both, `ROWS` rows sharing each value load at most
    /// (three on AVX2: 12 accumulators, 3 weights and 1 value vector fill
    /// the 16 registers; a fourth row would spill).
    ///
    /// # Safety
    /// As for [`weighted_rows_group`], called only from it and the wide one.
    #[inline(always)]
    unsafe fn weighted_rows_body<'a, E: Lanes + 'a, P: RowPtrs<'a, E>, const ROWS: usize>(
        (p, p_stride): (&[f32], usize),
        (rows, len, ahead): (P, usize, &[&[E]]),
        acc: &mut [f32],
        n: usize,
    ) {
        if E::F32 {
            return weighted_f32_body::<E, Fused, P, ROWS>((p, p_stride), (rows, len), acc, n);
        }
        let n_rows = acc.len() / n;
        let mut r = 0;
        while r < n_rows {
            let g = rows_per_pass(n_rows - r, ROWS);
            let (p, acc) = (&p[r * p_stride..], &mut acc[r * n..(r + g) * n]);
            // The first group's pass prefetches; later ones find the lines requested.
            let ahead = if r == 0 { ahead } else { &[] };
            let rows = (rows, len, ahead);
            // SAFETY: `acc` holds `g` rows of `n`; the caller's contract.
            unsafe {
                match g {
                    6 => weighted_group::<E, P, 6, 4>((p, p_stride), rows, acc, n),
                    5 => weighted_group::<E, P, 5, 4>((p, p_stride), rows, acc, n),
                    4 => weighted_group::<E, P, 4, 4>((p, p_stride), rows, acc, n),
                    3 => weighted_group::<E, P, 3, 4>((p, p_stride), rows, acc, n),
                    2 => weighted_group::<E, P, 2, 4>((p, p_stride), rows, acc, n),
                    _ => weighted_group::<E, P, 1, 8>((p, p_stride), rows, acc, n),
                }
            }
            r += g;
        }
    }

    /// `R` rows of [`weighted_rows_group`], `C` vectors of columns in
    /// registers at a time (then one vector, then single columns).
    ///
    /// Inlined into both entry points, so that the AVX-512 one allocates
    /// AVX-512 VL's 32 registers: compiled once for AVX2 and called from
    /// there, it held three rows' twelve accumulators, three weights and
    /// two value vectors in 16 registers by spilling an accumulator, whose
    /// store and reload chained every key of a decode step's value tile
    /// (`perf annotate`: a fifth of the kernel's samples on that chain).
    /// SmolLM2 Q8_0 decoding after 512 positions, Zen 4, 7 alternated
    /// runs: 156.2 -> 159.0 tok/s on one thread, 194.7 -> 203.2 on two,
    /// inside the runs' spread. The AVX2 tier keeps its spill: three rows
    /// in two passes of two column vectors measured no faster there.
    ///
    /// # Safety
    /// As [`weighted_rows_group`], and `acc` holds `R` rows of `n`; called
    /// only from functions compiled with AVX2, FMA and F16C.
    #[inline(always)]
    unsafe fn weighted_group<
        'a,
        E: Lanes + 'a,
        P: RowPtrs<'a, E>,
        const R: usize,
        const C: usize,
    >(
        (p, p_stride): (&[f32], usize),
        (rows, len, ahead): (P, usize, &[&[E]]),
        acc: &mut [f32],
        n: usize,
    ) {
        use std::arch::x86_64::*;
        let mut ps = [p.as_ptr(); R];
        for (k, pk) in ps.iter_mut().enumerate() {
            *pk = p[k * p_stride..][..len].as_ptr();
        }
        let pa = acc.as_mut_ptr();
        let mut c0 = 0;
        // SAFETY (every access below): column `c0 + 8·c + 8 <= n` within
        // each accumulator row (`R` rows of `n`) and value row (checked to
        // hold `n` values); weight `j < len` within each weight row.
        macro_rules! columns {
            ($c:expr) => {
                while c0 + 8 * $c <= n {
                    let mut a = [[_mm256_setzero_ps(); $c]; R];
                    for (k, ak) in a.iter_mut().enumerate() {
                        for (c, v) in ak.iter_mut().enumerate() {
                            *v = unsafe { _mm256_loadu_ps(pa.add(k * n + c0 + 8 * c)) };
                        }
                    }
                    for j in 0..len {
                        let row = rows.row(j);
                        let mut w = [_mm256_setzero_ps(); R];
                        for (w, pk) in w.iter_mut().zip(ps) {
                            *w = _mm256_set1_ps(unsafe { *pk.add(j) });
                        }
                        let vp = row.as_ptr();
                        if let Some(next) = ahead.get(j) {
                            let at = (next.as_ptr() as *const i8)
                                .wrapping_add(c0 * std::mem::size_of::<E>());
                            for off in (0..8 * $c * std::mem::size_of::<E>()).step_by(64) {
                                // A hint: never faults, whatever the address.
                                _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(off));
                            }
                        }
                        for c in 0..$c {
                            let x = unsafe { E::load8(vp.add(c0 + 8 * c)) };
                            for (ak, w) in a.iter_mut().zip(w) {
                                ak[c] = _mm256_fmadd_ps(w, x, ak[c]);
                            }
                        }
                    }
                    for (k, ak) in a.iter().enumerate() {
                        for (c, v) in ak.iter().enumerate() {
                            unsafe { _mm256_storeu_ps(pa.add(k * n + c0 + 8 * c), *v) };
                        }
                    }
                    c0 += 8 * $c;
                }
            };
        }
        columns!(C);
        columns!(1);
        for i in c0..n {
            for (k, pk) in ps.iter().enumerate() {
                let mut a = unsafe { *pa.add(k * n + i) };
                for j in 0..len {
                    a = unsafe { *pk.add(j) }.mul_add(rows.row(j)[i].to_f32(), a);
                }
                unsafe { *pa.add(k * n + i) = a };
            }
        }
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

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn argmax_finite(x: &[f32]) -> Option<usize> {
        argmax_finite_body(x)
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

/// The probability-weighted sums of value rows for the `acc.len() / n`
/// rows of `acc` (`n` each) over the value rows `rows` (the first `n`
/// values of each, of any [`Lanes`] type: f16 and bf16 are read as
/// stored), row `k` weighting them by `p[k·p_stride..][..rows.len()]`:
/// `acc[k·n + i] += Σ_j p[k·p_stride + j] · rows[j][i]`, each element one
/// chain of multiply-adds (fused where the tier has FMA) over `j` in
/// order. So every row's result is bit-identical to that row alone, and
/// to the values widened to f32 first; rows share each value-vector load
/// (up to three at a time).
///
/// `ahead` are rows the caller reads next (the next tile's values, or
/// none), prefetched while the rows at the same index are read (as in
/// [`crate::dot::dot_keys_with`]).
///
/// # Panics
/// If a value row is shorter than `n` or `p` too short for its rows (a
/// bug in the calling kernel).
pub fn weighted_rows_group<E: Lanes>(
    tier: SimdTier,
    (p, p_stride): (&[f32], usize),
    (rows, ahead): (RowSet<'_, '_, E>, &[&[E]]),
    acc: &mut [f32],
    n: usize,
) {
    if n == 0 || rows.is_empty() {
        return;
    }
    let n_rows = acc.len() / n;
    assert_eq!(acc.len(), n_rows * n, "weighted_rows_group: ragged rows");
    let rows = rows.narrow(n);
    if n_rows > 0 {
        assert!(
            (n_rows - 1) * p_stride + rows.len() <= p.len(),
            "weighted_rows_group: weights past the end"
        );
    }
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the clamped tier has AVX2, FMA and F16C; the lengths are
        // checked above.
        SimdTier::Avx2 => with_rows!(rows, r => unsafe {
            avx2::weighted_rows_group((p, p_stride), (r, rows.len(), ahead), acc, n)
        }),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the clamped tier has AVX-512 F/BW/VL besides AVX2, FMA and
        // F16C; the lengths are checked above.
        SimdTier::Avx512 => with_rows!(rows, r => unsafe {
            avx2::weighted_rows_group_wide((p, p_stride), (r, rows.len(), ahead), acc, n)
        }),
        _ => weighted_rows_group_body::<E, Plain>((p, p_stride), rows, acc, n),
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

/// Index of the largest finite value, the first of equal ones (`-0.0`
/// equals `0.0`), or `None` if no value is finite: `torch.argmax` over the
/// finite values, as greedy sampling takes it. Two passes (the maximum,
/// then its first index), each vectorized: the one-pass loop with its
/// running index stayed scalar, 2.2% of a Gemma 3 decode step (a
/// 262,144-logit row) in `perf`.
pub fn argmax_finite(tier: SimdTier, x: &[f32]) -> Option<usize> {
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `exp_shifted`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { avx2::argmax_finite(x) },
        _ => argmax_finite_body(x),
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

    /// The plain one-pass argmax greedy sampling ran before: the first
    /// finite value greater than every earlier finite one.
    fn argmax_finite_ref(x: &[f32]) -> Option<usize> {
        let mut best: Option<(usize, f32)> = None;
        for (i, &v) in x.iter().enumerate() {
            if v.is_finite() && best.is_none_or(|(_, b)| v > b) {
                best = Some((i, v));
            }
        }
        best.map(|(i, _)| i)
    }

    #[test]
    fn argmax_finite_matches_the_one_pass_loop() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MAX,
            f32::MIN,
        ];
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN],
            vec![f32::NAN, f32::NEG_INFINITY, f32::INFINITY],
            vec![-0.0, 0.0],
            vec![1.0, 3.0, 3.0, f32::NAN],
            vec![f32::INFINITY; 40],
        ];
        for n in [1usize, 5, 15, 16, 17, 31, 33, 100, 1023, 49_152] {
            // Few distinct values, so ties (and ±0) are common; a value
            // drawn from `specials` one time in eight.
            let mut x: Vec<f32> = (0..n)
                .map(|_| match rng.random_range(0..8) {
                    0 => specials[rng.random_range(0..specials.len())],
                    _ => rng.random_range(-4i32..4) as f32 * 0.5,
                })
                .collect();
            cases.push(x.clone());
            // A unique maximum at the end (in the remainder after the
            // whole chunks, for lengths not a multiple of the lanes).
            x.push(1e30);
            cases.push(x);
            let mut all_bad = vec![f32::NAN; n];
            all_bad[n / 2] = f32::INFINITY;
            cases.push(all_bad.clone());
            all_bad[n - 1] = -7.0;
            cases.push(all_bad);
        }
        for tier in cpu::available_tiers() {
            for x in &cases {
                assert_eq!(
                    argmax_finite(tier, x),
                    argmax_finite_ref(x),
                    "{tier}, {} values",
                    x.len()
                );
            }
        }
    }

    #[test]
    fn weighted_rows_group_and_scale_match_f64() {
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
            let v_rows: Vec<&[f32]> = (0..rows).map(|j| &v[2 + j * stride..][..n]).collect();
            for tier in cpu::available_tiers() {
                let mut acc = init.clone();
                weighted_rows_group(
                    tier,
                    (&p, 0),
                    (RowSet::gathered(&v_rows, n), &v_rows),
                    &mut acc,
                    n,
                );
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

    /// Each row of `weighted_rows_group` bit-identical to one chain of
    /// multiply-adds per element over the value rows in order (fused on
    /// the SIMD tiers), and so to the row alone, on every tier (row counts
    /// around the 3-row group, widths around the 32- and 64-column
    /// blocks); f16 and bf16 value rows read as stored bit-identical to
    /// the same rows widened to f32.
    #[test]
    fn weighted_rows_group_equals_each_row_alone() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for &(rows, len, n, stride) in &[
            (1usize, 1usize, 1usize, 1usize),
            (2, 5, 33, 40),
            (3, 32, 64, 64),
            (4, 9, 71, 72),
            (5, 3, 130, 130),
            (7, 17, 95, 101),
            (24, 32, 256, 256),
        ] {
            let ps = len + 3;
            let p: Vec<f32> = (0..rows * ps).map(|_| rng.random_range(0.0..1.0)).collect();
            // Values f16 holds exactly, so that all three types store the same.
            let v: Vec<f32> = (0..(len - 1) * stride + n)
                .map(|_| half::f16::from_f32(rng.random_range(-1.0..1.0)).to_f32())
                .collect();
            let v_rows: Vec<&[f32]> = (0..len).map(|j| &v[j * stride..][..n]).collect();
            let f16: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            let f16_rows: Vec<&[half::f16]> = (0..len).map(|j| &f16[j * stride..][..n]).collect();
            let bf16: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let bf16_rows: Vec<&[half::bf16]> =
                (0..len).map(|j| &bf16[j * stride..][..n]).collect();
            let init: Vec<f32> = (0..rows * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for tier in cpu::available_tiers() {
                let mut acc = init.clone();
                weighted_rows_group(
                    tier,
                    (&p, ps),
                    (RowSet::gathered(&v_rows, n), &v_rows[..1]),
                    &mut acc,
                    n,
                );
                for r in 0..rows {
                    let mut want = init[r * n..(r + 1) * n].to_vec();
                    for (i, a) in want.iter_mut().enumerate() {
                        for (j, &w) in p[r * ps..][..len].iter().enumerate() {
                            let x = v[j * stride + i];
                            *a = match tier {
                                SimdTier::Scalar => w * x + *a,
                                _ => w.mul_add(x, *a),
                            };
                        }
                    }
                    let mut alone = init[r * n..(r + 1) * n].to_vec();
                    weighted_rows_group(
                        tier,
                        (&p[r * ps..], ps),
                        (RowSet::gathered(&v_rows, n), &[]),
                        &mut alone,
                        n,
                    );
                    assert_eq!(bits(&alone), bits(&want), "{tier}: alone, n {n}");
                    assert_eq!(
                        bits(&acc[r * n..(r + 1) * n]),
                        bits(&want),
                        "{tier}: rows {rows}, len {len}, n {n}: row {r}"
                    );
                }
                let mut got = init.clone();
                weighted_rows_group(
                    tier,
                    (&p, ps),
                    (RowSet::gathered(&f16_rows, n), &[]),
                    &mut got,
                    n,
                );
                assert_eq!(bits(&got), bits(&acc), "{tier} f16: rows {rows}, n {n}");
                let mut got = init.clone();
                weighted_rows_group(
                    tier,
                    (&p, ps),
                    (RowSet::strided(&bf16, stride, len, n), &bf16_rows),
                    &mut got,
                    n,
                );
                // bf16 rounds f16's values: compare with its own widening.
                let widened: Vec<f32> = bf16.iter().map(|h| h.to_f32()).collect();
                let w_rows: Vec<&[f32]> = (0..len).map(|j| &widened[j * stride..][..n]).collect();
                let mut want = init.clone();
                weighted_rows_group(
                    tier,
                    (&p, ps),
                    (RowSet::gathered(&w_rows, n), &[]),
                    &mut want,
                    n,
                );
                assert_eq!(bits(&got), bits(&want), "{tier} bf16: rows {rows}, n {n}");
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
