//! `y = x · Wᵀ` for a weight of any stored type: the linear layer.
//!
//! `W` is `[out, in]` (PyTorch and GGUF order), `x` is `[n_tokens, in]` and
//! `y` is `[n_tokens, out]`. Work is split by output rows into a few chunks
//! per pool thread (not one task per row, whose scheduling would cost more
//! than a short row's dot product), and not split at all when the whole
//! call is too small to repay handing it to the pool.
//!
//! Four rows at a time are dequantized once into a per-thread scratch
//! buffer (a few KiB: it stays in L1) and dotted with every token in tiles
//! of three, each row element and token element loaded once per tile.
//!
//! **Batch invariance.** Every (row, token) product goes through the same
//! per-pair arithmetic of the 4-row dot tile (one accumulator per pair),
//! whatever the token count and the row's place: a last group of fewer
//! than four rows repeats its last row, a last tile of fewer than three
//! tokens uses a narrower tile. So a token's output does not depend on
//! the other tokens of the call (one decoding sequence alone or batched
//! with others gives the same bits), which is why one token takes this
//! path too rather than a row-at-a-time dot.

use crate::cpu::{self, SimdTier};
use crate::dot::dot_tile_f32_with;
use crate::error::{check_len, checked_mul, KernelError};
use crate::pool;
use crate::quant::{dequantize_row_ref, RowKernel};
use kvant_core::Tensor;
use std::cell::Cell;

/// Rows dequantized together (the row count of the dot tiles).
const ROW_GROUP: usize = 4;

/// Tokens dotted together with a row group: 4 × 3 accumulators plus the
/// loaded values fill the 16 AVX2 registers.
const TOKEN_TILE: usize = 3;

/// The least work worth a task of its own, in multiply-adds: a few times
/// what one core gets through (~30 G multiply-adds/s in the dot tiles) in
/// the ~1 µs the spinning pool takes to hand out a job.
const MIN_TASK_MACS: usize = 128 << 10;

/// Chunks of rows per pool thread, so a slow thread does not hold up the call.
const TASKS_PER_THREAD: usize = 4;

thread_local! {
    /// Dequantized rows of the current group; reused across calls, so a
    /// steady-state forward pass does not allocate here.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Rows per task for `rows` rows of `work_per_row` each, a multiple of
/// [`ROW_GROUP`]; `None` when the call should not fork.
fn rows_per_task(rows: usize, work_per_row: usize) -> Option<usize> {
    let threads = pool::global().threads();
    let groups = rows.div_ceil(ROW_GROUP);
    let by_work = rows.saturating_mul(work_per_row) / MIN_TASK_MACS;
    let tasks = (threads * TASKS_PER_THREAD).min(groups).min(by_work);
    // A whole number of tasks per thread, or two threads would wait on a third task.
    let tasks = if tasks >= threads {
        tasks / threads * threads
    } else {
        tasks
    };
    (threads > 1 && tasks > 1).then(|| groups.div_ceil(tasks) * ROW_GROUP)
}

/// `y[t*out + o] = Σ_i W[o, i] · x[t*in + i]` on the start-up SIMD tier,
/// accumulated in f32.
///
/// # Errors
/// [`KernelError::NotAMatrix`] unless `w` is 2-D, and
/// [`KernelError::LengthMismatch`] unless `x` holds `n_tokens * in` values and
/// `y` `n_tokens * out`; `y` is untouched then.
pub fn matmul(w: &Tensor, x: &[f32], n_tokens: usize, y: &mut [f32]) -> Result<(), KernelError> {
    matmul_with(cpu::tier(), w, x, n_tokens, y)
}

/// The shape of one call, checked against the slices.
struct Dims {
    out: usize,
    inp: usize,
    row_bytes: usize,
}

/// Checks one call's shapes against the slices: `None` for an empty
/// product, after zeroing `y` (each of its values, if any, a sum of no
/// terms).
fn check(
    op: &'static str,
    w: &Tensor,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<Option<Dims>, KernelError> {
    let &[out, inp] = w.shape() else {
        return Err(KernelError::NotAMatrix {
            op,
            shape: w.shape().to_vec(),
        });
    };
    check_len(
        "matmul input [n_tokens, in]",
        checked_mul(op, n_tokens, inp)?,
        x.len(),
    )?;
    check_len(
        "matmul output [n_tokens, out]",
        checked_mul(op, n_tokens, out)?,
        y.len(),
    )?;
    let row_bytes = w.dtype().bytes_for(inp)?;
    check_len(
        "matmul weight bytes",
        checked_mul(op, out, row_bytes)?,
        w.bytes().len(),
    )?;
    if out == 0 || inp == 0 || n_tokens == 0 {
        y.fill(0.0);
        return Ok(None);
    }
    Ok(Some(Dims {
        out,
        inp,
        row_bytes,
    }))
}

/// [`matmul`] on a given tier (lowered to one the CPU supports).
pub fn matmul_with(
    tier: SimdTier,
    w: &Tensor,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let Some(Dims {
        out,
        inp,
        row_bytes,
    }) = check("matmul", w, x, n_tokens, y)?
    else {
        return Ok(());
    };
    let kernel = RowKernel::new(w.dtype(), tier);
    let bytes = w.bytes();
    let job = Job {
        kernel,
        x,
        n_tokens,
        out,
        inp,
        y: OutPtr(y.as_mut_ptr()),
    };
    match rows_per_task(out, inp.saturating_mul(n_tokens)) {
        None => job.rows(0, bytes, row_bytes),
        Some(rows) => pool::global().run(out.div_ceil(rows), &|task| {
            let r = task * rows..((task + 1) * rows).min(out);
            job.rows(
                r.start,
                &bytes[r.start * row_bytes..r.end * row_bytes],
                row_bytes,
            );
        }),
    }
    Ok(())
}

/// The output pointer, shared by the tasks of one call.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: the tasks of one call write disjoint elements of `y` (their own
// output rows), and `matmul_with` holds the `&mut` borrow of `y` until all
// tasks have finished.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no task reads `y`.
unsafe impl Sync for OutPtr {}

/// One checked call: everything a task needs.
struct Job<'a> {
    kernel: RowKernel,
    x: &'a [f32],
    n_tokens: usize,
    out: usize,
    inp: usize,
    y: OutPtr,
}

impl Job<'_> {
    /// Writes `y[t*out + o]` for rows `o` in `first..first + rows.len()/row_bytes`.
    fn rows(&self, first: usize, rows: &[u8], row_bytes: usize) {
        let mut scratch = SCRATCH.take();
        scratch.resize(ROW_GROUP * self.inp, 0.0);
        for (g, group) in (first..)
            .step_by(ROW_GROUP)
            .zip(rows.chunks(ROW_GROUP * row_bytes))
        {
            let n_rows = group.len() / row_bytes;
            let w = &mut scratch[..n_rows * self.inp];
            for (row, buf) in group
                .chunks_exact(row_bytes)
                .zip(w.chunks_exact_mut(self.inp))
            {
                self.kernel.dequantize(row, buf);
            }
            self.dot_group(g, w);
        }
        SCRATCH.set(scratch);
    }

    /// Dots the dequantized rows `first..` held in `w` (1 to 4 of them)
    /// with every token, through the 4-row tile only (see the module doc).
    fn dot_group(&self, first: usize, w: &[f32]) {
        let tier = self.kernel.tier();
        let n_rows = w.len() / self.inp;
        let row = |r: usize| &w[r.min(n_rows - 1) * self.inp..][..self.inp];
        let rows = [row(0), row(1), row(2), row(3)];
        let tile = self.inp * TOKEN_TILE;
        let mut tiles = self.x.chunks_exact(tile);
        for (i, xs) in (&mut tiles).enumerate() {
            let xs: [&[f32]; TOKEN_TILE] =
                std::array::from_fn(|t| &xs[t * self.inp..(t + 1) * self.inp]);
            let d = dot_tile_f32_with(tier, rows, xs);
            self.write_tile(i * TOKEN_TILE, first, n_rows, &d);
        }
        let t0 = self.n_tokens - tiles.remainder().len() / self.inp;
        match tiles.remainder().len() / self.inp {
            2 => {
                let (x0, x1) = tiles.remainder().split_at(self.inp);
                let d = dot_tile_f32_with(tier, rows, [x0, x1]);
                self.write_tile(t0, first, n_rows, &d);
            }
            1 => {
                let d = dot_tile_f32_with(tier, rows, [tiles.remainder()]);
                self.write_tile(t0, first, n_rows, &d);
            }
            _ => {}
        }
    }

    /// Writes `d[r][t]` to row `first + r` of token `t0 + t`, for the
    /// first `n_rows` rows (the rest are repeats).
    fn write_tile<const T: usize>(
        &self,
        t0: usize,
        first: usize,
        n_rows: usize,
        d: &[[f32; T]; ROW_GROUP],
    ) {
        for (r, d) in d.iter().enumerate().take(n_rows) {
            for (t, &v) in d.iter().enumerate() {
                self.write(t0 + t, first + r, v);
            }
        }
    }

    fn write(&self, t: usize, o: usize, v: f32) {
        debug_assert!(t < self.n_tokens && o < self.out);
        // SAFETY: `t < n_tokens` and `o < out` (rows come from chunks of the
        // checked weight bytes, tokens from chunks of the checked `x`), so the
        // index is inside `y` (length `n_tokens * out`, checked); each `(t, o)`
        // belongs to exactly one task (see `OutPtr`).
        unsafe { *self.y.0.add(t * self.out + o) = v }
    }
}

/// Reference: dequantizes each row with `dequantize_ref` and accumulates in f64.
pub fn matmul_ref(
    w: &Tensor,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let Some(d) = check("matmul_ref", w, x, n_tokens, y)? else {
        return Ok(());
    };
    let mut row = vec![0f32; d.inp];
    for (o, bytes) in w.bytes().chunks_exact(d.row_bytes).enumerate() {
        dequantize_row_ref(w.dtype(), bytes, &mut row)?;
        for (t, xt) in x.chunks_exact(d.inp).enumerate() {
            let sum: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
            y[t * d.out + o] = sum as f32;
        }
    }
    Ok(())
}
