//! Matrix products of packed 4-, 6- and 8-bit weights with 8-bit activations.
//!
//! The speed path for the block formats real GGUF releases use most (Q4_0,
//! Q4_1, Q5_0, Q8_0, Q4_K, and Q6_K, which `llama-quantize` gives the
//! output layer even in Q4_0 files): weights are repacked once at load
//! time (`pack`), the activations of a call are quantized once
//! (`activations`) and shared by every weight that reads them (q/k/v,
//! gate/up), and each task runs groups of 8 rows against tiles of tokens
//! with integer dot products (`avx2`), the scalar kernel (`reference`)
//! standing in on CPUs without AVX2.
//!
//! Numerics: the weights are used exactly; the activations carry the
//! rounding of 8-bit quantization (at most half a step, `max|x| / 254`,
//! per value), as in llama.cpp. [`crate::matmul`]'s f32-activation path
//! remains for checkpoints that need results close to an f32 reference.

mod activations;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod grouped;
mod pack;
mod reference;

pub use activations::{Q8Activations, BLOCK};
pub use grouped::{gemm_grouped, gemm_grouped_with, Segment, MAX_SETS};
pub use pack::{PackedFormat, PackedMatrix, GROUP};

use crate::cpu::{self, SimdTier};
use crate::error::{check_len, checked_mul, KernelError};
use crate::pool::{self, DisjointSlice};

/// Tokens per tile: each packed block is read once per tile; six
/// accumulators, six block sums and one chunk of weights fit the 16 AVX2
/// registers.
const TOKEN_TILE: usize = 6;

/// Tokens per tile for `Q5K` and `Q6K`, whose tiles hold two integer sums
/// per token besides the accumulator: six tokens' 18 registers would
/// spill, four tokens' 12 leave room for the masks and the chunk being
/// read, and the values are then rebuilt from their bit fields once per 4
/// tokens instead of 6 (64-token `Q6K` products ran about 1.25× as fast as
/// in tiles of 6, and faster than in tiles of 3: `benches/matmul.rs`,
/// `gemm`).
const K_TOKEN_TILE: usize = 4;

/// Tokens per tile on AVX-512 VNNI, whose kernels have 32 vector
/// registers (AVX-512 VL) where AVX2's have 16, so each chunk of weights
/// serves more tokens. pp512 on one Zen 4 thread, 3 alternated runs
/// against tiles of 6 and 4: SmolLM2 Q8_0 +3%, Q4_1 +3.5%, Gemma 3
/// Q4_K_M +2%; tiles of 12 and 8 lost 3–4% on Q8_0 and Gemma.
const VNNI_TOKEN_TILE: usize = 8;

/// Tokens above which `Q8` products run two groups per 512-bit register.
const PAIR_MIN_TOKENS: usize = 2;

/// [`K_TOKEN_TILE`] on AVX-512 VNNI.
const VNNI_K_TOKEN_TILE: usize = 6;

/// The least multiply-adds worth a task: a job costs about a microsecond to
/// hand out on the spinning pool, and one core does ~100 k int8
/// multiply-adds per microsecond here.
const MIN_TASK_MACS: usize = 96 << 10;

/// Tasks per pool thread, so a thread slowed by the OS does not hold up the call.
const TASKS_PER_THREAD: usize = 3;

/// Products of at most this many tokens (decode, small serving batches)
/// read each weight once and are bound by the memory stream: one task per
/// thread, each a contiguous run of row groups, streams better than
/// [`TASKS_PER_THREAD`] interleaved ones. SmolLM2 Q4_1 decode on two Zen 4
/// threads after 512 positions, alternated runs: 264.1 -> 290.7 tok/s (8
/// runs) and 275.7 -> 286.9 (6); 6 and 8 tasks per thread were slower
/// still (260 -> 237). Q8_0, Gemma 3 Q4_K_M and the DeepSeek-V3-shaped
/// MoE inside the spread. Prompts keep their tasks (one per thread
/// measured 8% slower at pp512).
const STREAM_TOKENS: usize = VNNI_TOKEN_TILE;

/// `y[t, r] = Σ_i W[r, i] · x[t, i]` for the packed `w` and quantized `x`
/// (`y` is `[n_tokens, rows]`), on the start-up tier.
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `x` has `w.cols()` columns and
/// `y` holds `n_tokens * w.rows()` values.
pub fn gemm(w: &PackedMatrix, x: &Q8Activations, y: &mut [f32]) -> Result<(), KernelError> {
    gemm_with(cpu::tier(), w, x, y)
}

/// [`gemm`] on a given tier (lowered to one the CPU supports).
pub fn gemm_with(
    tier: SimdTier,
    w: &PackedMatrix,
    x: &Q8Activations,
    y: &mut [f32],
) -> Result<(), KernelError> {
    gemm_batch_with(tier, &[w], x, &mut [y])
}

/// Most weights one [`gemm_batch`] call takes (q, k and v; gate and up).
pub const MAX_BATCH: usize = 4;

/// [`gemm`] for several weights that read the same activations, as one
/// pool job: one hand-out and one join instead of one per weight, and the
/// threads balance the row groups of all of them together.
///
/// # Errors
/// As [`gemm`] for each pair, and [`KernelError::LengthMismatch`] when `ws`
/// and `ys` differ in length or hold more than [`MAX_BATCH`].
pub fn gemm_batch(
    ws: &[&PackedMatrix],
    x: &Q8Activations,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    gemm_batch_with(cpu::tier(), ws, x, ys)
}

/// [`gemm_batch`] on a given tier.
fn gemm_batch_with(
    tier: SimdTier,
    ws: &[&PackedMatrix],
    x: &Q8Activations,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    check_len("int8 gemm batch outputs", ws.len(), ys.len())?;
    check_len(
        "int8 gemm batch size (at most 4)",
        ws.len().min(MAX_BATCH),
        ws.len(),
    )?;
    let n = x.n_tokens();
    for (w, y) in ws.iter().zip(ys.iter()) {
        check_len("int8 gemm activation columns", w.cols(), x.k())?;
        check_len(
            "int8 gemm output [n_tokens, rows]",
            checked_mul("gemm", n, w.rows())?,
            y.len(),
        )?;
    }
    if n == 0 {
        return Ok(());
    }
    // Row groups of all weights, numbered consecutively.
    let mut starts = [0usize; MAX_BATCH + 1];
    let mut outs: [Option<DisjointSlice<'_, f32>>; MAX_BATCH] = Default::default();
    for (i, (w, y)) in ws.iter().zip(ys.iter_mut()).enumerate() {
        starts[i + 1] = starts[i] + w.groups();
        outs[i] = Some(DisjointSlice::new(y));
    }
    let total = starts[ws.len()];
    let macs = (x.k().saturating_mul(GROUP).saturating_mul(n)).saturating_mul(total);
    let p = pool::global();
    let per_thread = match n <= STREAM_TOKENS {
        true => 1,
        false => TASKS_PER_THREAD,
    };
    let tasks = pool::balanced_tasks(
        (p.threads() * per_thread)
            .min(total)
            .min((macs / MIN_TASK_MACS).max(1)),
        p.threads(),
    );
    let tier = cpu::clamp(tier);
    // `Q8` (Q8_0, Q5_0) prefill on pairs of groups in 512-bit registers
    // (`group_pair_rows`): pp512 on one Zen 4 thread 625 -> 729 tok/s on
    // SmolLM2 Q8_0, 620 -> 723 on Gemma 3 Q4_K_M (its Q5_0 matrices);
    // 1101 -> 1292 on two. One- and two-token products stay on the 256-bit
    // tiles: with the pair kernel, decode measured slower (75 -> 45 tok/s,
    // but in a run that shared the machine with a build, so unsettled).
    let pairs = tier == SimdTier::Avx512 && cpu::has_avx512_vnni() && n > PAIR_MIN_TOKENS;
    p.run(pool::chunks(total, tasks, 1), &|i| {
        let mine = pool::chunk(total, tasks, 1, i);
        let mut gg = mine.start;
        while gg < mine.end {
            let m = (0..ws.len()).rfind(|&m| starts[m] <= gg).unwrap_or(0);
            let Some(y) = &outs[m] else { break };
            let pair =
                pairs && ws[m].format() == PackedFormat::Q8 && gg + 1 < mine.end.min(starts[m + 1]);
            #[cfg(target_arch = "x86_64")]
            if pair {
                // SAFETY: AVX-512 VNNI (and the tier's F/BW/VL) detected.
                unsafe { group_pair_rows(ws[m], gg - starts[m], x, n, y) };
                gg += 2;
                continue;
            }
            group_rows(tier, ws[m], gg - starts[m], x, 0..n, y);
            gg += 1;
        }
    });
    Ok(())
}

/// Writes token `t`'s `W` rows from row `first` (those of the `rows` that
/// exist) from `v` into `y` (`[n_tokens, rows]`).
#[inline(always)]
fn store_row<const W: usize>(
    y: &DisjointSlice<'_, f32>,
    rows: usize,
    first: usize,
    t: usize,
    v: &[f32; W],
) {
    // SAFETY: rows `first..first + live` of every token belong to the task
    // that owns their group(s) only.
    unsafe { y.write(t * rows + first, v, (rows - first).min(W)) }
}

/// Writes rows `8g..8g+8` (those that exist) of tokens `tokens` (rows of
/// `x` and of `y`, which is `[x.n_tokens(), w.rows()]`).
fn group_rows(
    tier: SimdTier,
    w: &PackedMatrix,
    g: usize,
    x: &Q8Activations,
    tokens: std::ops::Range<usize>,
    y: &DisjointSlice<'_, f32>,
) {
    let blk = w.group(g);
    let store = |t: usize, v: &[f32; GROUP]| store_row(y, w.rows(), g * GROUP, t, v);
    match tier {
        #[cfg(target_arch = "x86_64")]
        SimdTier::Avx2 | SimdTier::Avx512 => {
            let vnni = tier == SimdTier::Avx512 && cpu::has_avx512_vnni();
            let most = match (w.format(), vnni) {
                (PackedFormat::Q5K | PackedFormat::Q6K, false) => K_TOKEN_TILE,
                (PackedFormat::Q5K | PackedFormat::Q6K, true) => VNNI_K_TOKEN_TILE,
                (_, false) => TOKEN_TILE,
                (_, true) => VNNI_TOKEN_TILE,
            };
            let tiles = GroupTiles {
                w,
                blk,
                x,
                store: &store,
            };
            let mut t = tokens.start;
            while t < tokens.end {
                let left = (tokens.end - t).min(most);
                // SAFETY: the tier has AVX2/FMA/F16C (clamped to the CPU);
                // `blk` is this group's `blocks()` packed blocks and each
                // token's slices hold `cols` quants and `cols/32` scales.
                // One arm per tile length below the largest, whose tile
                // takes every longer rest.
                macro_rules! by_len {
                    ($tile:ident, $most:ident; $($k:literal)*) => {
                        match left {
                            $($k => $tile::<$k>(&tiles, t),)*
                            _ => $tile::<$most>(&tiles, t),
                        }
                    };
                }
                let done = unsafe {
                    match vnni {
                        false => by_len!(tile, TOKEN_TILE; 1 2 3 4 5),
                        // SAFETY (this arm): AVX-512 VNNI, F and VL were
                        // detected (`has_avx512_vnni` implies the tier).
                        true => by_len!(tile_vnni, VNNI_TOKEN_TILE; 1 2 3 4 5 6 7),
                    }
                };
                t += done;
            }
        }
        _ => {
            for t in tokens {
                let (q, d, s) = x.token(t);
                store(t, &reference::group_dot(w.format(), blk, q, d, s));
            }
        }
    }
}

/// [`group_rows`] for groups `g` and `g + 1` of a `Q8` matrix on 512-bit
/// VNNI registers ([`avx2::q8_pair_vnni`]), every token.
///
/// # Safety
/// The CPU supports AVX-512 F, BW, VL and VNNI; groups `g` and `g + 1`
/// exist.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group_pair_rows(
    w: &PackedMatrix,
    g: usize,
    x: &Q8Activations,
    n: usize,
    y: &DisjointSlice<'_, f32>,
) {
    let rows = w.rows();
    let (wa, wb) = (w.group(g).as_ptr(), w.group(g + 1).as_ptr());
    let blocks = w.blocks();
    let mut t = 0;
    while t < n {
        let left = (n - t).min(VNNI_TOKEN_TILE);
        macro_rules! run {
            ($($k:literal)*) => {
                match left {
                    $($k => pair_tile::<$k>((wa, wb), blocks, x, t, (y, rows, g * GROUP)),)*
                    _ => pair_tile::<VNNI_TOKEN_TILE>((wa, wb), blocks, x, t, (y, rows, g * GROUP)),
                }
            };
        }
        // SAFETY: the caller's contract; each token's slices hold `cols`
        // quants and `cols/32` scales and sums.
        unsafe { run!(1 2 3 4 5 6 7) };
        t += left;
    }
}

/// Tokens `t0..t0 + T` of a pair of groups, written to their 16 rows of
/// `y` (those that exist) straight from the registers: returning the tile
/// through an array cost three copies of it per tile.
///
/// # Safety
/// As for [`avx2::q8_pair_vnni`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pair_tile<const T: usize>(
    (wa, wb): (*const u8, *const u8),
    blocks: usize,
    x: &Q8Activations,
    t0: usize,
    (y, rows, first): (&DisjointSlice<'_, f32>, usize, usize),
) {
    use std::arch::x86_64::_mm512_storeu_ps;
    let ptrs = avx2::TokenPtrs::tile::<T>(x, t0);
    // SAFETY: the caller's contract.
    let acc = unsafe { avx2::q8_pair_vnni::<T>(wa, wb, blocks, &ptrs) };
    for (dt, a) in acc.into_iter().enumerate() {
        let t = t0 + dt;
        if rows - first >= 2 * GROUP {
            let o = t * rows + first;
            // SAFETY: rows `first..first + 16` of token `t` belong to this
            // task's pair of groups only; the store is unaligned.
            unsafe { _mm512_storeu_ps(y.range(o..o + 2 * GROUP).as_mut_ptr(), a) };
        } else {
            let mut v = [0f32; 2 * GROUP];
            // SAFETY: `v` holds 16 floats; the store is unaligned.
            unsafe { _mm512_storeu_ps(v.as_mut_ptr(), a) };
            store_row(y, rows, first, t, &v);
        }
    }
}

/// One group's operands for its token tiles: the matrix, the group's
/// packed blocks, the tokens, and where each token's eight rows go.
#[cfg(target_arch = "x86_64")]
struct GroupTiles<'a, S> {
    w: &'a PackedMatrix,
    blk: &'a [u8],
    x: &'a Q8Activations,
    store: &'a S,
}

/// Runs tokens `t0..t0 + T` of one group; returns `T`.
///
/// # Safety
/// As for [`avx2::group_tile`]; tokens `t0..t0 + T` are `x`'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const T: usize>(
    tiles: &GroupTiles<'_, impl Fn(usize, &[f32; GROUP])>,
    t0: usize,
) -> usize {
    // SAFETY: the caller's contract; AVX2, FMA and F16C are enabled here.
    unsafe { tile_body::<T, false>(tiles, t0) }
}

/// [`tile`] on the AVX-512 VNNI kernels.
///
/// # Safety
/// As for [`avx2::group_tile_vnni`]; tokens `t0..t0 + T` are `x`'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn tile_vnni<const T: usize>(
    tiles: &GroupTiles<'_, impl Fn(usize, &[f32; GROUP])>,
    t0: usize,
) -> usize {
    // SAFETY: the caller's contract; the VNNI features are enabled here.
    unsafe { tile_body::<T, true>(tiles, t0) }
}

/// The body of [`tile`] and [`tile_vnni`], inlined into each so that the
/// kernels inline with their entry point's features.
///
/// # Safety
/// As for [`tile`] (with `VNNI`, [`tile_vnni`]), called only from them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_body<const T: usize, const VNNI: bool>(
    tiles: &GroupTiles<'_, impl Fn(usize, &[f32; GROUP])>,
    t0: usize,
) -> usize {
    use std::arch::x86_64::_mm256_storeu_ps;
    let GroupTiles { w, blk, x, store } = tiles;
    let ptrs = avx2::TokenPtrs::tile::<T>(x, t0);
    let (f, b) = (w.format(), w.blocks());
    // SAFETY: the caller's contract (and features).
    let acc = unsafe {
        match VNNI {
            true => avx2::group_tile_vnni::<T>(f, blk.as_ptr(), b, &ptrs),
            false => avx2::group_tile::<T>(f, blk.as_ptr(), b, &ptrs),
        }
    };
    for (i, a) in acc.iter().enumerate() {
        let mut v = [0f32; GROUP];
        // SAFETY: `v` holds the eight lanes; the store is unaligned.
        unsafe { _mm256_storeu_ps(v.as_mut_ptr(), *a) };
        store(t0 + i, &v);
    }
    T
}

/// Reference for tests: `W` dequantized exactly times `x` dequantized,
/// accumulated in f64 (`y` is `[n_tokens, rows]`).
pub fn gemm_ref(w_dequantized: &[f32], rows: usize, x: &Q8Activations) -> Vec<f64> {
    let xs = x.dequantize();
    let k = x.k();
    let mut y = vec![0f64; x.n_tokens() * rows];
    for (t, xt) in xs.chunks_exact(k.max(1)).enumerate() {
        for (r, wr) in w_dequantized.chunks_exact(k.max(1)).enumerate() {
            y[t * rows + r] = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
        }
    }
    y
}
