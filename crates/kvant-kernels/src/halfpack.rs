//! 16-bit float weights (f16 and bf16) repacked 8 rows interleaved,
//! multiplied with f32 activations.
//!
//! The row-major kernels dot each row with each token and reduce every
//! product horizontally; here a group of 8 rows is stored `k`-major (the 8
//! rows' weight `i` are 16 consecutive bytes), so one load and one widening
//! (F16C's `vcvtph2ps` for f16; a zero-extension and a 16-bit shift for
//! bf16, the top half of an f32) give weight `i` of 8 rows, which one FMA
//! per token multiplies by that token's broadcast `x[i]`: 8 rows' sums
//! build up in the lanes of one register per token, with no horizontal
//! sums, and a tile of tokens reuses each widened register (the
//! register-blocked GEMM micro-kernel BLIS and llamafile's tinyBLAS use).
//! Both widenings are exact: the weights are used exactly.
//!
//! Groups are stored in bands (see [`band`]): a band holds weight `i` of
//! its groups side by side (256 bytes: 16 groups, or 8 with `pairs`), then
//! weight `i + 1`, so the one-token tile, which reads a band's groups at
//! once, reads one contiguous stream instead of one per group. The same
//! bytes in sixteen streams 9 KiB apart read at 23–24 GB/s on one Zen 4
//! thread, as one stream at 32–35 (`tools/bench/streams.c`: three
//! alternated rounds, huge pages); SmolLM2's F16 copy decodes at 113.5
//! tok/s on one thread instead of 83.5, 129.1 on two instead of 118.1 (5
//! alternated runs, one-token prompt).
//!
//! Every (row, token) sum is one chain of FMAs over `i` in order, whatever
//! the tile: the latency is covered by running several groups (and several
//! tokens) at once, never by splitting a sum into partial chains. So a
//! token's output does not depend on how many tokens share the call (batch
//! invariance: a decoding sequence gives the same bits alone or batched).

use crate::cpu::{self, SimdTier};
use crate::error::{check_len, checked_mul, KernelError};
use crate::pool::{self, DisjointSlice};
use kvant_core::{DType, Tensor};

/// Rows per interleaved group (8 f32 lanes).
pub const GROUP: usize = 8;

/// Bytes of a band's row (see the module doc): the widest one-token
/// tile's read per weight index. Bands of 8 groups (128 bytes) decoded
/// the F16 copy at 110.3 tok/s on one thread against 113.5 for 16.
const BAND_BYTES: usize = 256;

/// Groups per band: a tile never crosses one, so its groups share one
/// stride.
#[inline(always)]
fn band(pairs: bool) -> usize {
    BAND_BYTES / (2 * unit(pairs))
}

/// Tokens per tile. Tiles run two groups (16 rows) at once: per weight
/// index, two converted weight registers and six broadcast activations feed
/// twelve FMAs into twelve accumulators (BLIS's 6×16 micro-kernel), one
/// load per two FMAs instead of one per FMA.
const TOKEN_TILE: usize = 6;

/// Tokens up to which a tile runs four groups (32 rows) at once instead of
/// two: with one or two tokens, two groups keep only two or four FMA
/// chains in flight, and each chain waits out the FMA latency at every
/// weight index. Four groups double the chains; the per-lane sums are the
/// same chains, so the bits do not change.
const QUAD_TOKENS: usize = 2;

/// The least multiply-adds worth a pool task (about a microsecond of work).
const MIN_TASK_MACS: usize = 32 << 10;

/// A `[rows, cols]` f16 or bf16 weight, 8-row interleaved.
#[derive(Clone, Debug)]
pub struct HalfMatrix {
    rows: usize,
    cols: usize,
    /// bf16 values (else f16).
    bf16: bool,
    /// bf16 stored for `vdpbf16ps` (see [`pairs`]): pair `p` of a group,
    /// weights `2p` and `2p + 1` of its 8 rows, in its unit `p` (16
    /// values), row `r`'s two at `2r` and `2r + 1`; an odd last column
    /// pairs with 0.
    pairs: bool,
    /// Bands of [`band`] groups (the last may hold fewer), each
    /// `stride() × 8` values per group: a group's unit `u` (weight `i` of
    /// its 8 rows, or pair `i` with `pairs`: [`unit`] values) lies at
    /// `u × nb + k` units into its band, for the band's `k`-th of `nb`
    /// groups (see [`at`]).
    data: kvant_core::HugeSlice<u16>,
}

impl HalfMatrix {
    /// Repacks a 2-D f16 or bf16 weight for exact f32 activations; `None`
    /// for other types.
    ///
    /// # Errors
    /// [`KernelError::NotAMatrix`] unless `w` is 2-D.
    pub fn pack(w: &Tensor) -> Result<Option<HalfMatrix>, KernelError> {
        Self::pack_with(w, false)
    }

    /// [`Self::pack`]; with `bf16_activations`, a bf16 weight on a CPU
    /// with AVX-512 BF16 (and that tier chosen) is stored for `vdpbf16ps`,
    /// which rounds the activations to bf16 (see [`pairs`]).
    ///
    /// # Errors
    /// As [`Self::pack`].
    pub fn pack_with(
        w: &Tensor,
        bf16_activations: bool,
    ) -> Result<Option<HalfMatrix>, KernelError> {
        let bf16 = match w.dtype() {
            DType::F16 => false,
            DType::BF16 => true,
            _ => return Ok(None),
        };
        let &[rows, cols] = w.shape() else {
            return Err(KernelError::NotAMatrix {
                op: "pack f16/bf16",
                shape: w.shape().to_vec(),
            });
        };
        check_len(
            "f16/bf16 weight bytes",
            checked_mul("pack f16", checked_mul("pack f16", rows, cols)?, 2)?,
            w.bytes().len(),
        )?;
        let pairs = bf16 && bf16_activations && pairs::available(cpu::tier());
        let stride = if pairs { 2 * cols.div_ceil(2) } else { cols };
        let groups = rows.div_ceil(GROUP);
        let mut data = vec![0u16; checked_mul("pack f16", groups * GROUP, stride)?];
        for (r, row) in w.bytes().chunks_exact((2 * cols).max(1)).enumerate() {
            let (g, lane) = (r / GROUP, r % GROUP);
            let (first, skip) = locate(groups, stride, pairs, g);
            for (i, b) in row.chunks_exact(2).enumerate() {
                data[first + at(pairs, skip, i, lane)] = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        Ok(Some(HalfMatrix {
            rows,
            cols,
            bf16,
            pairs,
            // On huge pages: decode streams every weight once per token.
            data: kvant_core::HugeSlice::from_vec(data),
        }))
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether the values are bf16 (else f16).
    pub fn is_bf16(&self) -> bool {
        self.bf16
    }

    /// Whether products round the activations to bf16 (`vdpbf16ps`; see
    /// [`Self::pack_with`]) on the start-up tier.
    pub fn bf16_activations(&self) -> bool {
        self.pairs
    }

    pub fn byte_len(&self) -> usize {
        2 * self.data.len()
    }

    /// Values per row of a group.
    fn stride(&self) -> usize {
        match self.pairs {
            true => 2 * self.cols.div_ceil(2),
            false => self.cols,
        }
    }

    /// Group `g`'s values from its first unit to its band's end, and the
    /// band's group count (the units between two of the group's own).
    /// Groups `g + 1 ..` of the band follow its units at once: a tile of
    /// groups within one band reads them from here, `k·unit` values on.
    ///
    /// # Panics
    /// If group `g` does not exist.
    fn group(&self, g: usize) -> (&[u16], usize) {
        let groups = self.rows.div_ceil(GROUP);
        assert!(g < groups, "group {g} of {groups}");
        let (first, skip) = locate(groups, self.stride(), self.pairs, g);
        let end = self.band_end(g).min(groups) * GROUP * self.stride();
        (&self.data[first..end], skip)
    }

    /// The group after the last of `g`'s band (past the last group for
    /// the last band): a tile from `g` stops before it.
    #[inline(always)]
    fn band_end(&self, g: usize) -> usize {
        let band = band(self.pairs);
        (g / band + 1) * band
    }
}

/// Values per unit of a group: weight `i` of its 8 rows, or with `pairs`
/// weights `2p` and `2p + 1` of them.
#[inline(always)]
fn unit(pairs: bool) -> usize {
    match pairs {
        true => 2 * GROUP,
        false => GROUP,
    }
}

/// Where group `g`'s first unit lies in the data of `groups` groups of
/// `stride` values per row, and how many groups share its band.
fn locate(groups: usize, stride: usize, pairs: bool, g: usize) -> (usize, usize) {
    let size = band(pairs);
    let band = g / size * size;
    let skip = (groups - band).min(size);
    (band * GROUP * stride + (g - band) * unit(pairs), skip)
}

/// Where weight `i` of row `r` of a group lies from its first unit, in a
/// band of `skip` groups (see [`HalfMatrix`]'s `data` and `pairs`).
#[inline(always)]
fn at(pairs: bool, skip: usize, i: usize, r: usize) -> usize {
    match pairs {
        true => 2 * GROUP * skip * (i / 2) + 2 * r + i % 2,
        false => GROUP * skip * i + r,
    }
}

/// Values a tile of `groups` groups from one band of `skip` reads from
/// its first group's first unit, over `units` units each.
#[inline(always)]
fn span(units: usize, skip: usize, groups: usize, unit: usize) -> usize {
    match units {
        0 => 0,
        _ => ((units - 1) * skip + groups) * unit,
    }
}

/// The value of stored bits `v` (bf16 when `BF`, else f16), exactly.
#[inline(always)]
fn widen<const BF: bool>(v: u16) -> f32 {
    match BF {
        true => f32::from_bits((v as u32) << 16),
        false => half::f16::from_bits(v).to_f32(),
    }
}

/// `y[t, r] = Σ_i W[r, i] · x[t, i]` (`x` is `[n_tokens, cols]`, `y`
/// `[n_tokens, rows]`) on the start-up tier.
///
/// # Errors
/// [`KernelError::LengthMismatch`] if the slices disagree with the shapes.
pub fn gemm(w: &HalfMatrix, x: &[f32], n_tokens: usize, y: &mut [f32]) -> Result<(), KernelError> {
    gemm_with(cpu::tier(), w, x, n_tokens, y)
}

/// [`gemm`] on a given tier (lowered to one the CPU supports).
pub fn gemm_with(
    tier: SimdTier,
    w: &HalfMatrix,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    check_len(
        "f16/bf16 gemm input",
        checked_mul("f16 gemm", n_tokens, w.cols)?,
        x.len(),
    )?;
    check_len(
        "f16/bf16 gemm output",
        checked_mul("f16 gemm", n_tokens, w.rows)?,
        y.len(),
    )?;
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    let tier = cpu::clamp(tier);
    let groups = w.rows.div_ceil(GROUP);
    let macs = (w.cols * GROUP * n_tokens).saturating_mul(groups);
    let p = pool::global();
    let tasks = pool::balanced_tasks(
        (p.threads() * 3)
            .min(groups)
            .min((macs / MIN_TASK_MACS).max(1)),
        p.threads(),
    );
    if w.pairs {
        pairs::gemm(tier, w, x, n_tokens, y, tasks);
        return Ok(());
    }
    let out = DisjointSlice::new(y);
    let align = task_align(w, n_tokens);
    p.run(pool::chunks(groups, tasks, align), &|i| {
        let mine = pool::chunk(groups, tasks, align, i);
        match w.bf16 {
            true => task::<true>(tier, w, x, n_tokens, mine, &out),
            false => task::<false>(tier, w, x, n_tokens, mine, &out),
        }
    });
    Ok(())
}

/// Groups a task's range is a multiple of: whole bands for a one- or
/// two-token call, whose tiles then each read one band as one stream
/// (ranges of two groups left SmolLM2's F16 copy decoding 26% slower on two
/// threads than the old layout: tiles reading parts of a band's rows);
/// pairs of groups for a prompt, whose tiles are bound by arithmetic, so
/// that the threads get equal shares (72 groups in whole bands of 16 are
/// five ranges for two threads).
fn task_align(w: &HalfMatrix, n_tokens: usize) -> usize {
    match n_tokens {
        0..=2 => band(w.pairs),
        _ => 2,
    }
}

/// Writes the `n` tokens' rows of group `g` (`v[t]`, token `t0 + t`).
fn store(w: &HalfMatrix, out: &DisjointSlice<'_, f32>, g: usize, t0: usize, v: &[[f32; GROUP]]) {
    for (dt, v) in v.iter().enumerate() {
        store_row(w, out, g, t0 + dt, v);
    }
}

/// Writes token `t`'s rows of group `g` (those that exist) from `v`.
#[inline(always)]
fn store_row(w: &HalfMatrix, out: &DisjointSlice<'_, f32>, g: usize, t: usize, v: &[f32; GROUP]) {
    let live = (w.rows - g * GROUP).min(GROUP);
    // SAFETY: rows `8g..8g+live` of every token belong to the task that
    // owns group `g` only.
    unsafe { out.write(t * w.rows + g * GROUP, v, live) }
}

/// Writes groups `g..g + live` of the `n` tokens from 512-bit tile results
/// `v`: token `t`'s rows of groups `g + 2k` and `g + 2k + 1` are lanes
/// 0..8 and 8..16 of `v[t·z + k]`.
#[cfg(target_arch = "x86_64")]
fn store_wide(
    w: &HalfMatrix,
    out: &DisjointSlice<'_, f32>,
    (g, live): (usize, usize),
    (t0, n): (usize, usize),
    v: &[[f32; 2 * GROUP]],
    z: usize,
) {
    for (dt, regs) in v.chunks_exact(z).take(n).enumerate() {
        for k in 0..live {
            let (halves, _) = regs[k / 2].as_chunks::<GROUP>();
            store_row(w, out, g + k, t0 + dt, &halves[k % 2]);
        }
    }
}

/// Groups `mine` against every token (bf16 values when `BF`).
fn task<const BF: bool>(
    tier: SimdTier,
    w: &HalfMatrix,
    x: &[f32],
    n_tokens: usize,
    mine: std::ops::Range<usize>,
    out: &DisjointSlice<'_, f32>,
) {
    let mut t = 0;
    while t < n_tokens {
        let n = (n_tokens - t).min(TOKEN_TILE);
        let xt = &x[t * w.cols..(t + n) * w.cols];
        #[cfg(target_arch = "x86_64")]
        if tier == SimdTier::Avx512 && n <= avx512::TOKENS {
            // SAFETY: the tier was clamped to the CPU, so it has AVX-512
            // F/BW/VL besides AVX2/FMA/F16C.
            unsafe { avx512::groups::<BF>(w, xt, n, t, mine.clone(), out) };
            t += n;
            continue;
        }
        let mut g = mine.start;
        while g < mine.end {
            // A tile's groups share a band (and so one stride).
            let end = mine.end.min(w.band_end(g));
            if n <= QUAD_TOKENS && g + 3 < end {
                let mut v = [[[0f32; GROUP]; QUAD_TOKENS]; 4];
                tile_quad::<BF>(tier, w, g, xt, n, &mut v);
                for (dg, v) in v.iter().enumerate() {
                    store(w, out, g + dg, t, &v[..n]);
                }
                g += 4;
                continue;
            }
            let pair = g + 1 < end;
            let mut v = [[[0f32; GROUP]; TOKEN_TILE]; 2];
            let [v0, v1] = &mut v;
            if pair {
                tile_pair::<BF>(tier, w, g, xt, &mut v0[..n], &mut v1[..n]);
            } else {
                tile::<BF>(tier, w, g, xt, &mut v0[..n]);
            }
            for (dg, v) in v.iter().enumerate().take(1 + pair as usize) {
                store(w, out, g + dg, t, &v[..n]);
            }
            g += 1 + pair as usize;
        }
        t += n;
    }
}

/// Groups `g..g + 4` (of one band) against the `n` (1 or 2) tokens in `x`.
fn tile_quad<const BF: bool>(
    tier: SimdTier,
    w: &HalfMatrix,
    g: usize,
    x: &[f32],
    n: usize,
    out: &mut [[[f32; GROUP]; QUAD_TOKENS]; 4],
) {
    match tier {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `tile`, for all four groups.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe {
            let wg = w.group(g);
            match n {
                1 => avx2::tile_quad::<BF, 1>(wg, w.cols, x, out),
                _ => avx2::tile_quad::<BF, QUAD_TOKENS>(wg, w.cols, x, out),
            }
        },
        _ => {
            for (k, o) in out.iter_mut().enumerate() {
                tile::<BF>(tier, w, g + k, x, &mut o[..n]);
            }
        }
    }
}

/// Groups `g` and `g + 1` (of one band) against the 1..=6 tokens in `x`.
fn tile_pair<const BF: bool>(
    tier: SimdTier,
    w: &HalfMatrix,
    g: usize,
    x: &[f32],
    out0: &mut [[f32; GROUP]],
    out1: &mut [[f32; GROUP]],
) {
    match tier {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `tile`, for both groups.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe {
            let wg = w.group(g);
            match out0.len() {
                1 => avx2::tile_pair::<BF, 1>(wg, w.cols, x, out0, out1),
                2 => avx2::tile_pair::<BF, 2>(wg, w.cols, x, out0, out1),
                3 => avx2::tile_pair::<BF, 3>(wg, w.cols, x, out0, out1),
                4 => avx2::tile_pair::<BF, 4>(wg, w.cols, x, out0, out1),
                5 => avx2::tile_pair::<BF, 5>(wg, w.cols, x, out0, out1),
                _ => avx2::tile_pair::<BF, TOKEN_TILE>(wg, w.cols, x, out0, out1),
            }
        },
        _ => {
            tile::<BF>(tier, w, g, x, out0);
            tile::<BF>(tier, w, g + 1, x, out1);
        }
    }
}

/// The 8 rows of group `g` against the `out.len()` tokens in `x`.
fn tile<const BF: bool>(
    tier: SimdTier,
    w: &HalfMatrix,
    g: usize,
    x: &[f32],
    out: &mut [[f32; GROUP]],
) {
    let wg = w.group(g);
    match tier {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the tier has AVX2/FMA/F16C (clamped to the CPU); `wg`
        // holds the group's `cols` units and `x` `out.len() × cols`.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe {
            match out.len() {
                1 => avx2::tile::<BF, 1>(wg, w.cols, x, out),
                2 => avx2::tile::<BF, 2>(wg, w.cols, x, out),
                3 => avx2::tile::<BF, 3>(wg, w.cols, x, out),
                4 => avx2::tile::<BF, 4>(wg, w.cols, x, out),
                5 => avx2::tile::<BF, 5>(wg, w.cols, x, out),
                _ => avx2::tile::<BF, TOKEN_TILE>(wg, w.cols, x, out),
            }
        },
        _ => {
            for (o, xt) in out.iter_mut().zip(x.chunks_exact(w.cols.max(1))) {
                *o = group_dot_ref::<BF>(wg, false, xt);
            }
        }
    }
}

/// The scalar kernel (on either layout, with exact activations): per
/// lane, one chain of FMAs over `i` in order, as the f32-activation SIMD
/// kernels compute it. `(wg, skip)` as [`HalfMatrix::group`] gives them.
fn group_dot_ref<const BF: bool>(
    (wg, skip): (&[u16], usize),
    pairs: bool,
    x: &[f32],
) -> [f32; GROUP] {
    let mut acc = [0f32; GROUP];
    for (i, &xv) in x.iter().enumerate() {
        for (r, a) in acc.iter_mut().enumerate() {
            *a = widen::<BF>(wg[at(pairs, skip, i, r)]).mul_add(xv, *a);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{span, GROUP};
    use std::arch::x86_64::*;

    /// Weight `i` of 8 rows, `v` holding their bits, as f32 (bf16 when `BF`).
    #[inline(always)]
    pub(super) unsafe fn widen8<const BF: bool>(v: __m128i) -> __m256 {
        match BF {
            true => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v))),
            false => _mm256_cvtph_ps(v),
        }
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `wg` holds a group's `cols`
    /// units `skip` apart (as `HalfMatrix::group` gives), `x` `T × cols`
    /// and `out` `T` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<const BF: bool, const T: usize>(
        (wg, skip): (&[u16], usize),
        cols: usize,
        x: &[f32],
        out: &mut [[f32; GROUP]],
    ) {
        assert!(wg.len() >= span(cols, skip, 1, GROUP));
        assert!(x.len() >= T * cols && out.len() >= T);
        let (wp, xp) = (wg.as_ptr() as *const __m128i, x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); T];
        for i in 0..cols {
            // SAFETY: `i < cols`, in range of both (asserted).
            let w = widen8::<BF>(unsafe { _mm_loadu_si128(wp.add(i * skip)) });
            for (t, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_set1_ps(unsafe { *xp.add(t * cols + i) });
                *a = _mm256_fmadd_ps(w, xv, *a);
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            _mm256_storeu_ps(o.as_mut_ptr(), a);
        }
    }

    /// Four groups at once for one or two tokens: per weight index four
    /// converted registers and `T` broadcasts feed `4T` independent FMA
    /// chains, each the chain [`tile`] computes.
    ///
    /// # Safety
    /// As for [`tile`], for the four groups from `wg`'s (of one band);
    /// `T <= 2`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_quad<const BF: bool, const T: usize>(
        (wg, skip): (&[u16], usize),
        cols: usize,
        x: &[f32],
        out: &mut [[[f32; GROUP]; super::QUAD_TOKENS]; 4],
    ) {
        assert!(wg.len() >= span(cols, skip, 4, GROUP));
        assert!(T <= super::QUAD_TOKENS && x.len() >= T * cols);
        let wp = wg.as_ptr() as *const __m128i;
        let xp = x.as_ptr();
        // acc[t][k]: token t, group k.
        let mut acc = [[_mm256_setzero_ps(); 4]; T];
        for i in 0..cols {
            // SAFETY: `i < cols`, in range of every group (asserted). No
            // closure: it would not inherit this function's features.
            let v = unsafe {
                let p = wp.add(i * skip);
                [
                    widen8::<BF>(_mm_loadu_si128(p)),
                    widen8::<BF>(_mm_loadu_si128(p.add(1))),
                    widen8::<BF>(_mm_loadu_si128(p.add(2))),
                    widen8::<BF>(_mm_loadu_si128(p.add(3))),
                ]
            };
            for (t, at) in acc.iter_mut().enumerate() {
                // SAFETY: `t < T`, `i < cols`: inside `x` (asserted).
                let xv = _mm256_set1_ps(unsafe { *xp.add(t * cols + i) });
                for (a, w) in at.iter_mut().zip(v) {
                    *a = _mm256_fmadd_ps(w, xv, *a);
                }
            }
        }
        for (t, at) in acc.iter().enumerate() {
            for (o, a) in out.iter_mut().zip(at) {
                _mm256_storeu_ps(o[t].as_mut_ptr(), *a);
            }
        }
    }

    /// Two groups at once, one chain per (group, token): per weight index
    /// two converted registers and `T` broadcasts feed `2T` FMAs.
    ///
    /// # Safety
    /// As for [`tile`], for the two groups from `wg`'s (of one band).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_pair<const BF: bool, const T: usize>(
        (wg, skip): (&[u16], usize),
        cols: usize,
        x: &[f32],
        oa: &mut [[f32; GROUP]],
        ob: &mut [[f32; GROUP]],
    ) {
        assert!(wg.len() >= span(cols, skip, 2, GROUP));
        assert!(x.len() >= T * cols && oa.len() >= T && ob.len() >= T);
        let (wp, xp) = (wg.as_ptr() as *const __m128i, x.as_ptr());
        let mut aa = [_mm256_setzero_ps(); T];
        let mut ab = [_mm256_setzero_ps(); T];
        for i in 0..cols {
            // SAFETY: `i < cols`, in range of both (asserted).
            let (va, vb) = unsafe {
                let p = wp.add(i * skip);
                (
                    widen8::<BF>(_mm_loadu_si128(p)),
                    widen8::<BF>(_mm_loadu_si128(p.add(1))),
                )
            };
            for t in 0..T {
                let xv = _mm256_set1_ps(unsafe { *xp.add(t * cols + i) });
                aa[t] = _mm256_fmadd_ps(va, xv, aa[t]);
                ab[t] = _mm256_fmadd_ps(vb, xv, ab[t]);
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(oa[t].as_mut_ptr(), aa[t]);
            _mm256_storeu_ps(ob[t].as_mut_ptr(), ab[t]);
        }
    }
}

/// The AVX-512 tiles, for one or two tokens (decode): one 512-bit register
/// holds the 16 rows of two 8-row groups (one 16-lane widening converts
/// weight `i` of both), and each lane still runs the one FMA chain over `i`
/// of [`tile`], so every tier, tile and batch gives the same bits.
///
/// Eight registers per token keep eight chains in flight, with half the
/// conversions and FMAs per weight of the AVX2 quad tile, and read a whole
/// band (sixteen groups, 256 bytes per weight index) as one stream: with
/// the groups one after another, eight registers read sixteen streams and
/// decoded SmolLM2's F16 copy at 83.5 tok/s on one Zen 4 thread, the band
/// at 113.5 (see the module doc). Two groups' units sit side by side in
/// the band, so one 32-byte load fills a register's two halves.
///
/// Prefill stays on the AVX2 tiles: it is bound by FMA throughput, which
/// 512-bit FMAs do not raise on Zen 4 (57 G lane-FMAs/s either way, timed
/// on twelve independent FMA chains). A six-token tile of four registers
/// per token on the band layout ran pp512 as fast as the AVX2 tiles on
/// one thread (434.5 against 432.6 tok/s before the bands) but at 652
/// against 792 on two, for reasons not found. The AVX2 tiles read 32 of a
/// band row's 256 bytes per weight index and pay for the layout: pp512
/// 374.7 against 408.8 tok/s on one thread (7 alternated runs), the price
/// of the decode speed above.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{HalfMatrix, GROUP};
    use crate::cpu::SimdTier;
    use crate::pool::DisjointSlice;
    use std::arch::x86_64::*;

    /// Most tokens these tiles take.
    pub(super) const TOKENS: usize = 2;

    /// Registers per token (two groups each) in the widest tile.
    const WIDTH: usize = 8;

    /// Groups `mine` against the `n <= TOKENS` tokens in `x`, which are
    /// tokens `t0..t0 + n` of the call.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F/BW/VL, AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn groups<const BF: bool>(
        w: &HalfMatrix,
        x: &[f32],
        n: usize,
        t0: usize,
        mine: std::ops::Range<usize>,
        out: &DisjointSlice<'_, f32>,
    ) {
        let mut g = mine.start;
        while g < mine.end {
            // A tile's groups share a band: its 16-byte units side by side.
            let z = match (mine.end.min(w.band_end(g)) - g) / 2 {
                0 => {
                    // One group left: the AVX2 tile.
                    let mut v = [[0f32; GROUP]; TOKENS];
                    super::tile::<BF>(SimdTier::Avx2, w, g, x, &mut v[..n]);
                    super::store(w, out, g, t0, &v[..n]);
                    g += 1;
                    continue;
                }
                1 => 1,
                2 | 3 => 2,
                4..8 => 4,
                _ => WIDTH,
            };
            let mut v = [[0f32; 2 * GROUP]; WIDTH * TOKENS];
            // SAFETY: groups `g..g + 2z` exist and share a band (`2z` at
            // most what is left of it), `x` holds `n` tokens and `v`
            // `WIDTH·TOKENS >= z·n` results.
            unsafe {
                match (z, n) {
                    (1, 1) => tile::<BF, 1, 1>(w, g, x, &mut v),
                    (1, _) => tile::<BF, 1, TOKENS>(w, g, x, &mut v),
                    (2, 1) => tile::<BF, 2, 1>(w, g, x, &mut v),
                    (2, _) => tile::<BF, 2, TOKENS>(w, g, x, &mut v),
                    (4, 1) => tile::<BF, 4, 1>(w, g, x, &mut v),
                    (4, _) => tile::<BF, 4, TOKENS>(w, g, x, &mut v),
                    (_, 1) => tile::<BF, WIDTH, 1>(w, g, x, &mut v),
                    (_, _) => tile::<BF, WIDTH, TOKENS>(w, g, x, &mut v),
                }
            }
            super::store_wide(w, out, (g, 2 * z), (t0, n), &v, z);
            g += 2 * z;
        }
    }

    /// Groups `g..g + 2Z` (of one band) against the `T` tokens in `x`: per
    /// weight index `Z` converted registers (each two groups' adjacent
    /// units, one 32-byte load) and `T` broadcasts feed `Z·T` FMAs;
    /// `out[t·Z + k]` gets token `t`'s rows of groups `g + 2k` (lanes 0..8)
    /// and `g + 2k + 1` (lanes 8..16).
    ///
    /// # Safety
    /// The CPU supports AVX-512 F/VL, AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn tile<const BF: bool, const Z: usize, const T: usize>(
        w: &HalfMatrix,
        g: usize,
        x: &[f32],
        out: &mut [[f32; 2 * GROUP]],
    ) {
        let cols = w.cols;
        assert!(x.len() >= T * cols && out.len() >= Z * T);
        // `group` panics unless group `g` exists; the span, that the band
        // holds the tile's other groups.
        let (wg, skip) = w.group(g);
        assert!(wg.len() >= super::span(cols, skip, 2 * Z, GROUP));
        let wp = wg.as_ptr() as *const __m128i;
        let xp = x.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); Z]; T];
        for i in 0..cols {
            let mut v = [_mm512_setzero_ps(); Z];
            for (k, v) in v.iter_mut().enumerate() {
                // SAFETY: units `i·skip + 2k` and the next are inside the
                // span asserted above (`i < cols`, `2k + 1 < 2Z`).
                let both =
                    unsafe { _mm256_loadu_si256(wp.add(i * skip + 2 * k) as *const __m256i) };
                *v = match BF {
                    true => {
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(both)))
                    }
                    false => _mm512_cvtph_ps(both),
                };
            }
            for (t, at) in acc.iter_mut().enumerate() {
                // SAFETY: `t < T`, `i < cols`: inside `x` (asserted).
                let xv = _mm512_set1_ps(unsafe { *xp.add(t * cols + i) });
                for (a, v) in at.iter_mut().zip(v) {
                    *a = _mm512_fmadd_ps(v, xv, *a);
                }
            }
        }
        for (t, at) in acc.iter().enumerate() {
            for (k, a) in at.iter().enumerate() {
                // SAFETY: `t·Z + k < Z·T <= out.len()`, 16 floats each.
                unsafe { _mm512_storeu_ps(out[t * Z + k].as_mut_ptr(), *a) };
            }
        }
    }
}

/// bf16 weights times activations rounded to bf16, with AVX-512 BF16's
/// `vdpbf16ps`: each 32-bit lane holds a row's weights `2p` and `2p + 1`,
/// each call adds both exact products of the pair into the lane's f32 sum
/// (denormals flushed), twice the multiply-adds of an f32 FMA per
/// instruction. llama.cpp's bf16 path does the same (its `vec_dot_type`
/// for bf16 is bf16), and in exchange for the activations' rounding
/// (half an ulp of bf16, 2^-9 relative, as `--f32-activations` avoids)
/// prefill runs at twice the FMA-bound rate of the exact kernels.
///
/// Every (row, token) sum is one chain over the pairs in order, whatever
/// the tile, so a token's bits do not depend on the batch. Tiers without
/// AVX-512 BF16 (only reached by asking for one explicitly: the layout is
/// chosen at packing from the start-up tier) run the scalar kernel with
/// exact activations.
mod pairs {
    use super::{HalfMatrix, GROUP};
    use crate::cpu::{self, SimdTier};
    use crate::pool::{self, DisjointSlice};
    use std::cell::RefCell;

    /// Whether `tier` runs the `vdpbf16ps` kernels on this CPU.
    pub(super) fn available(tier: SimdTier) -> bool {
        cfg!(target_arch = "x86_64") && tier == SimdTier::Avx512 && cpu::has_avx512_bf16()
    }

    thread_local! {
        /// The activations of a call as bf16 pairs, reused between calls.
        static PAIRS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }

    /// [`super::gemm_with`] for a matrix stored in pairs (shapes checked).
    pub(super) fn gemm(
        tier: SimdTier,
        w: &HalfMatrix,
        x: &[f32],
        n: usize,
        y: &mut [f32],
        tasks: usize,
    ) {
        let groups = w.rows.div_ceil(GROUP);
        let out = DisjointSlice::new(y);
        let p = pool::global();
        if !available(tier) {
            p.run(pool::chunks(groups, tasks, 2), &|i| {
                for g in pool::chunk(groups, tasks, 2, i) {
                    for (t, xt) in x.chunks_exact(w.cols.max(1)).enumerate() {
                        let v = super::group_dot_ref::<true>(w.group(g), true, xt);
                        super::store(w, &out, g, t, &[v]);
                    }
                }
            });
            return;
        }
        let mut xb = PAIRS.with(|b| b.take());
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available` checked AVX-512 BF16.
        unsafe {
            avx512::round_pairs(x, n, w.cols, &mut xb)
        };
        #[cfg(target_arch = "x86_64")]
        {
            let align = super::task_align(w, n);
            p.run(pool::chunks(groups, tasks, align), &|i| {
                let mine = pool::chunk(groups, tasks, align, i);
                // SAFETY: `available` checked AVX-512 BF16 (and the tier's
                // F/BW/VL); `xb` holds `n` tokens' pairs.
                unsafe { avx512::task(w, &xb, n, mine, &out) };
            });
        }
        PAIRS.with(|b| b.replace(xb));
    }

    #[cfg(target_arch = "x86_64")]
    mod avx512 {
        use super::super::{span, store_wide, HalfMatrix, GROUP};
        use crate::pool::DisjointSlice;
        use std::arch::x86_64::*;

        /// Tokens per tile of more than [`DECODE`] tokens: two registers
        /// (four groups) per token, 24 sums, two weight registers and a
        /// broadcast in the 32 registers.
        const TOKENS: usize = 12;

        /// Tokens up to which a tile runs four registers (eight groups) per
        /// token, to keep four chains in flight.
        const DECODE: usize = 2;

        /// `x` (`[n, cols]`) as bf16 pairs, `[n, cols.div_ceil(2)]`, rounded
        /// to nearest even (`vcvtneps2bf16`, 16 at a time; the tail by
        /// `half`, which rounds alike but for denormals, which
        /// `vdpbf16ps` reads as zero either way); an odd last column
        /// pairs with 0.
        ///
        /// # Safety
        /// The CPU supports AVX-512 F/BF16.
        #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
        pub(in super::super) unsafe fn round_pairs(
            x: &[f32],
            n: usize,
            cols: usize,
            out: &mut Vec<u32>,
        ) {
            let half = cols.div_ceil(2);
            out.clear();
            out.resize(n * half, 0);
            for (xt, ot) in x
                .chunks_exact(cols.max(1))
                .zip(out.chunks_exact_mut(half.max(1)))
            {
                let (whole, tail) = xt.split_at(cols / 16 * 16);
                for (c, o) in whole.chunks_exact(16).zip(ot.chunks_exact_mut(8)) {
                    // SAFETY: 16 floats in, 8 pairs (32 bytes) out.
                    unsafe {
                        let b = _mm512_cvtneps_pbh(_mm512_loadu_ps(c.as_ptr()));
                        let b: __m256i = std::mem::transmute(b);
                        _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, b);
                    }
                }
                for (o, p) in ot[whole.len() / 2..].iter_mut().zip(tail.chunks(2)) {
                    let lo = half::bf16::from_f32(p[0]).to_bits() as u32;
                    let hi = p
                        .get(1)
                        .map_or(0, |&v| half::bf16::from_f32(v).to_bits() as u32);
                    *o = lo | hi << 16;
                }
            }
        }

        /// Groups `mine` against the `n` tokens whose pairs are `xb`.
        ///
        /// # Safety
        /// The CPU supports AVX-512 F/BW/VL/BF16; `xb` holds `n` tokens of
        /// `w.cols.div_ceil(2)` pairs.
        #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
        pub(in super::super) unsafe fn task(
            w: &HalfMatrix,
            xb: &[u32],
            n: usize,
            mine: std::ops::Range<usize>,
            out: &DisjointSlice<'_, f32>,
        ) {
            let half = w.cols.div_ceil(2);
            assert!(xb.len() >= n * half);
            let mut t = 0;
            while t < n {
                let m = (n - t).min(TOKENS);
                let x = &xb[t * half..(t + m) * half];
                let widest = if m <= DECODE { 4 } else { 2 };
                let mut g = mine.start;
                while g < mine.end {
                    // A tile's groups share a band.
                    let left = mine.end.min(w.band_end(g)) - g;
                    // Registers this tile runs, and whether its one register
                    // holds a single group (twice: the upper lanes are dropped).
                    let (z, single) = match left / 2 {
                        0 => (1, true),
                        1 => (1, false),
                        2 | 3 => (2, false),
                        _ => (widest, false),
                    };
                    let mut v = [[0f32; 2 * GROUP]; 2 * TOKENS];
                    // SAFETY: groups `g..g + 2z` exist (or `g` alone when
                    // `single`), `x` holds `m` tokens, `v` `z·m` results.
                    unsafe { dispatch(z, m, w, g, single, x, &mut v) };
                    let live = if single { 1 } else { 2 * z };
                    store_wide(w, out, (g, live), (t, m), &v, z);
                    g += live;
                }
                t += m;
            }
        }

        /// [`tile`] for `z` registers and `m` tokens.
        ///
        /// # Safety
        /// As for [`tile`].
        #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
        unsafe fn dispatch(
            z: usize,
            m: usize,
            w: &HalfMatrix,
            g: usize,
            single: bool,
            x: &[u32],
            v: &mut [[f32; 2 * GROUP]],
        ) {
            macro_rules! by_tokens {
                ($z:literal; $($t:literal)*) => {
                    match m {
                        $($t => unsafe { tile::<$z, $t>(w, g, single, x, v) },)*
                        _ => unsafe { tile::<$z, TOKENS>(w, g, single, x, v) },
                    }
                };
            }
            match z {
                1 => by_tokens!(1; 1 2 3 4 5 6 7 8 9 10 11),
                2 => by_tokens!(2; 1 2 3 4 5 6 7 8 9 10 11),
                _ => match m {
                    1 => unsafe { tile::<4, 1>(w, g, false, x, v) },
                    _ => unsafe { tile::<4, DECODE>(w, g, false, x, v) },
                },
            }
        }

        /// Groups `g..g + 2Z` (group `g` twice when `single`, `Z = 1`)
        /// against the `T` tokens whose pairs are `x`: per pair `Z` weight
        /// registers and `T` broadcast pairs feed `Z·T` `vdpbf16ps`;
        /// `out[t·Z + k]` gets token `t`'s rows of groups `g + 2k` (lanes
        /// 0..8) and `g + 2k + 1` (lanes 8..16).
        ///
        /// # Safety
        /// The CPU supports AVX-512 F/BF16; `x` holds `T` tokens' pairs and
        /// `out` `Z·T` rows.
        #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
        unsafe fn tile<const Z: usize, const T: usize>(
            w: &HalfMatrix,
            g: usize,
            single: bool,
            x: &[u32],
            out: &mut [[f32; 2 * GROUP]],
        ) {
            let half = w.cols.div_ceil(2);
            assert!(x.len() >= T * half && out.len() >= Z * T);
            // `group` panics unless group `g` exists; the span, that the
            // band holds the tile's other groups.
            let (wg, skip) = w.group(g);
            let groups = if single { 1 } else { 2 * Z };
            assert!(wg.len() >= span(half, skip, groups, 2 * GROUP));
            let wp = wg.as_ptr() as *const __m256i;
            let xp = x.as_ptr() as *const i32;
            let mut acc = [[_mm512_setzero_ps(); Z]; T];
            for i in 0..half {
                let mut v = [_mm512_setzero_si512(); Z];
                for (k, v) in v.iter_mut().enumerate() {
                    // SAFETY: pair `i < half`: units `i·skip + 2k` and
                    // (unless `single`) the next are inside the span
                    // asserted above, 32 bytes each.
                    *v = unsafe {
                        let p = wp.add(i * skip + 2 * k);
                        match single {
                            true => _mm512_broadcast_i64x4(_mm256_loadu_si256(p)),
                            false => _mm512_loadu_si512(p as *const __m512i),
                        }
                    };
                }
                for (t, at) in acc.iter_mut().enumerate() {
                    // SAFETY: `t < T`, `i < half`: inside `x` (asserted).
                    let xv = _mm512_set1_epi32(unsafe { *xp.add(t * half + i) });
                    for (a, v) in at.iter_mut().zip(v) {
                        // SAFETY: reinterpretations of 512-bit registers.
                        let (wv, xv) = unsafe {
                            (
                                std::mem::transmute::<__m512i, __m512bh>(v),
                                std::mem::transmute::<__m512i, __m512bh>(xv),
                            )
                        };
                        *a = _mm512_dpbf16_ps(*a, wv, xv);
                    }
                }
            }
            for (t, at) in acc.iter().enumerate() {
                for (k, a) in at.iter().enumerate() {
                    // SAFETY: `t·Z + k < Z·T <= out.len()`, 16 floats each.
                    unsafe { _mm512_storeu_ps(out[t * Z + k].as_mut_ptr(), *a) };
                }
            }
        }
    }
}
