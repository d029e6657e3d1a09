//! `y = x · Wᵀ` for a weight of any stored type: the linear layer.
//!
//! `W` is `[out, in]` (PyTorch and GGUF order), `x` is `[n_tokens, in]` and
//! `y` is `[n_tokens, out]`. Work is split by output rows into a few chunks
//! per pool thread (not one task per row, whose scheduling would cost more
//! than a short row's dot product). A weight row is read from memory once per
//! call: four rows at a time are dequantized into a per-thread scratch buffer
//! (a few KiB to a few hundred KiB: it stays in L1/L2) and dotted with every
//! token, loading each element of a token once for the four rows.

use crate::cpu::{self, SimdTier};
use crate::dot::{dot4_f32_with, dot_f32_with};
use crate::error::{check_len, checked_mul, KernelError};
use crate::quant::{dequantize_row_ref, RowKernel};
use kvant_core::Tensor;
use rayon::prelude::*;
use std::cell::Cell;

/// Rows dequantized together (the width of `dot4`).
const ROW_GROUP: usize = 4;

/// Below this many multiply-adds a fork-join costs more than it saves.
const MIN_PARALLEL_MACS: usize = 1 << 16;

/// Chunks of rows per pool thread, so a slow thread does not hold up the call.
const TASKS_PER_THREAD: usize = 4;

thread_local! {
    /// Dequantized rows of the current group; reused across calls, so a
    /// steady-state forward pass does not allocate here.
    static SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
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

fn check(
    op: &'static str,
    w: &Tensor,
    x: &[f32],
    n_tokens: usize,
    y: &[f32],
) -> Result<Dims, KernelError> {
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
    Ok(Dims {
        out,
        inp,
        row_bytes,
    })
}

/// [`matmul`] on a given tier (lowered to one the CPU supports).
pub fn matmul_with(
    tier: SimdTier,
    w: &Tensor,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let Dims {
        out,
        inp,
        row_bytes,
    } = check("matmul", w, x, n_tokens, y)?;
    if inp == 0 {
        y.fill(0.0);
        return Ok(());
    }
    if out == 0 || n_tokens == 0 {
        return Ok(());
    }
    let job = Job {
        kernel: RowKernel::new(w.dtype(), tier),
        x,
        n_tokens,
        out,
        inp,
        y: OutPtr(y.as_mut_ptr()),
    };
    let bytes = w.bytes();
    let threads = rayon::current_num_threads();
    let macs = out.saturating_mul(inp).saturating_mul(n_tokens);
    if threads == 1 || macs < MIN_PARALLEL_MACS {
        job.rows(0, bytes, row_bytes);
        return Ok(());
    }
    let groups = out.div_ceil(ROW_GROUP);
    let tasks = (threads * TASKS_PER_THREAD).min(groups);
    let rows_per_task = groups.div_ceil(tasks) * ROW_GROUP;
    bytes
        .par_chunks(rows_per_task * row_bytes)
        .enumerate()
        .for_each(|(task, chunk)| job.rows(task * rows_per_task, chunk, row_bytes));
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

    /// Dots the dequantized rows `first..` held in `w` with every token.
    fn dot_group(&self, first: usize, w: &[f32]) {
        let tier = self.kernel.tier();
        for (t, xt) in self.x.chunks_exact(self.inp).enumerate() {
            let mut rows = w.chunks_exact(self.inp);
            if let (Some(r0), Some(r1), Some(r2), Some(r3)) =
                (rows.next(), rows.next(), rows.next(), rows.next())
            {
                let d = dot4_f32_with(tier, [r0, r1, r2, r3], xt);
                for (r, v) in d.into_iter().enumerate() {
                    self.write(t, first + r, v);
                }
            } else {
                for (r, row) in w.chunks_exact(self.inp).enumerate() {
                    self.write(t, first + r, dot_f32_with(tier, row, xt));
                }
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
    let Dims {
        out,
        inp,
        row_bytes,
    } = check("matmul_ref", w, x, n_tokens, y)?;
    if row_bytes == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let mut row = vec![0f32; inp];
    for (o, bytes) in w.bytes().chunks_exact(row_bytes).enumerate() {
        dequantize_row_ref(w.dtype(), bytes, &mut row)?;
        for (t, xt) in x.chunks_exact(inp).enumerate() {
            let sum: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
            y[t * out + o] = sum as f32;
        }
    }
    Ok(())
}
