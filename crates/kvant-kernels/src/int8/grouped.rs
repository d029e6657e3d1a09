//! Grouped products: many packed matrices, each over its own run of rows
//! of one shared batch of quantized activations, as one pool job.
//!
//! A mixture-of-experts layer sorts its (token, expert) assignments by
//! expert, so each expert's tokens are one contiguous run of a gathered
//! batch. One [`super::gemm`] per expert and projection would cost a
//! fork-join each (~1 µs; at decode 6–8 active experts × 3 projections a
//! layer, as much as the products themselves); here every (segment, row
//! group) pair of a call is one unit of one job, dealt out to the tasks by
//! its work (tokens × rows × columns), so one expert with many tokens and
//! many experts with one token balance alike.
//!
//! Each unit runs the same per-group kernel as [`super::gemm`] over its
//! tokens, so every (row, token) value is the bits `gemm` gives that token
//! alone: the grouping changes who computes what, never how.

use super::{group_rows, PackedMatrix, Q8Activations, BLOCK, GROUP};
use super::{MIN_TASK_MACS, TASKS_PER_THREAD};
use crate::cpu::{self, SimdTier};
use crate::error::{check_len, checked_mul, KernelError};
use crate::pool::{self, DisjointSlice};
use std::ops::Range;

/// Most sets (and outputs) one call takes: gate and up of a layer's experts.
pub const MAX_SETS: usize = 4;

/// Tokens `tokens` (rows of the activations) times matrix `matrix` of set
/// `set`, written to the same token rows of output `set`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub set: usize,
    pub matrix: usize,
    pub tokens: Range<usize>,
}

/// `ys[s.set][t, r] = Σ_i W[r, i] · x[t, i]` for every segment `s`, token
/// `t` in `s.tokens` and row `r` of `W = sets[s.set][s.matrix]`, on the
/// start-up tier. Output rows of tokens no segment of a set covers are
/// left as they were.
///
/// # Errors
/// [`KernelError::IndexOutOfRange`] for a set or matrix that does not
/// exist; [`KernelError::LengthMismatch`] unless each matrix has `x.k()`
/// columns and its output `x.n_tokens() × rows` values, or when there are
/// more than [`MAX_SETS`] sets or not one output per set;
/// [`KernelError::SegmentRange`] unless each set's segments are in
/// ascending token order without overlap, inside `0..x.n_tokens()`.
pub fn gemm_grouped(
    sets: &[&[PackedMatrix]],
    segments: &[Segment],
    x: &Q8Activations,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    gemm_grouped_with(cpu::tier(), sets, segments, x, ys)
}

/// [`gemm_grouped`] on a given tier (lowered to one the CPU supports).
pub fn gemm_grouped_with(
    tier: SimdTier,
    sets: &[&[PackedMatrix]],
    segments: &[Segment],
    x: &Q8Activations,
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    check_len("grouped gemm outputs (one per set)", sets.len(), ys.len())?;
    check_len(
        "grouped gemm sets (at most 4)",
        sets.len().min(MAX_SETS),
        sets.len(),
    )?;
    let n = x.n_tokens();
    // Where each set's next segment may start: its segments' writes are
    // disjoint because they ascend.
    let mut next = [0usize; MAX_SETS];
    let mut total = 0usize;
    for s in segments {
        let w = matrix(sets, s)?;
        check_len("grouped gemm activation columns", w.cols(), x.k())?;
        check_len(
            "grouped gemm output [n_tokens, rows]",
            checked_mul("grouped gemm", n, w.rows())?,
            ys[s.set].len(),
        )?;
        let (start, end) = (s.tokens.start, s.tokens.end);
        if start < next[s.set] || end < start || end > n {
            return Err(KernelError::SegmentRange {
                start,
                end,
                min: next[s.set],
                max: n,
            });
        }
        next[s.set] = end;
        let work = checked_mul("grouped gemm", unit_work(w, s), w.groups())?;
        total = total.checked_add(work).ok_or(KernelError::SizeOverflow {
            op: "grouped gemm",
            a: total,
            b: work,
        })?;
    }
    if total == 0 {
        return Ok(());
    }
    let units: usize = segments
        .iter()
        .filter(|s| !s.tokens.is_empty())
        .map(|s| sets[s.set][s.matrix].groups())
        .sum();
    let p = pool::global();
    let tasks = pool::balanced_tasks(
        (p.threads() * TASKS_PER_THREAD)
            .min(units)
            .min((total / MIN_TASK_MACS).max(1)),
        p.threads(),
    );
    let mut outs: [Option<DisjointSlice<'_, f32>>; MAX_SETS] = Default::default();
    for (o, y) in outs.iter_mut().zip(ys.iter_mut()) {
        *o = Some(DisjointSlice::new(y));
    }
    let tier = cpu::clamp(tier);
    p.run(tasks, &|task| {
        // This task's share of the work, [lo, hi): the units whose work
        // starts in it (shares tile 0..total, so each unit is run once).
        let share = |i: usize| (total as u128 * i as u128 / tasks as u128) as usize;
        let (lo, hi) = (share(task), share(task + 1));
        let mut start = 0usize;
        for s in segments.iter().filter(|s| !s.tokens.is_empty()) {
            if start >= hi {
                break;
            }
            let w = &sets[s.set][s.matrix];
            let u = unit_work(w, s);
            let end = start + u * w.groups();
            if end > lo {
                // Units g with start + g·u in [lo, hi).
                let first = lo.saturating_sub(start).div_ceil(u);
                let last = (hi - start).div_ceil(u).min(w.groups());
                if let Some(y) = &outs[s.set] {
                    for g in first..last {
                        group_rows(tier, w, g, x, s.tokens.clone(), y);
                    }
                }
            }
            start = end;
        }
    });
    Ok(())
}

/// The matrix a segment names.
fn matrix<'a>(sets: &[&'a [PackedMatrix]], s: &Segment) -> Result<&'a PackedMatrix, KernelError> {
    let set = sets.get(s.set).ok_or(KernelError::IndexOutOfRange {
        what: "grouped gemm set",
        index: s.set,
        len: sets.len(),
    })?;
    set.get(s.matrix).ok_or(KernelError::IndexOutOfRange {
        what: "grouped gemm matrix",
        index: s.matrix,
        len: set.len(),
    })
}

/// Multiply-adds of one row group of `w` over the segment's tokens (at
/// least 1 for a non-empty segment, so its units are never skipped).
/// `cols · tokens` is at most the activations' length, far from overflow.
fn unit_work(w: &PackedMatrix, s: &Segment) -> usize {
    (w.cols() * GROUP * s.tokens.len()).max(usize::from(!s.tokens.is_empty()))
}

impl Q8Activations {
    /// Makes this buffer rows `rows` of `src`, in that order (reusing its
    /// memory): the gathered batch of a grouped product. Quantization is per
    /// row, so this is bit for bit the quantization of the gathered f32 rows,
    /// at the cost of copying bytes instead of quantizing `rows.len()` rows.
    ///
    /// # Errors
    /// [`KernelError::IndexOutOfRange`] for a row `src` does not have; the
    /// buffer is then left empty.
    pub fn gather(&mut self, src: &Q8Activations, rows: &[usize]) -> Result<(), KernelError> {
        let (k, nb) = (src.k, src.k / BLOCK);
        self.qs.clear();
        self.d.clear();
        self.s.clear();
        self.sums.clear();
        self.offsets.clear();
        self.n_tokens = 0;
        self.k = k;
        if let Some(&bad) = rows.iter().find(|&&r| r >= src.n_tokens) {
            return Err(KernelError::IndexOutOfRange {
                what: "gathered activation row",
                index: bad,
                len: src.n_tokens,
            });
        }
        for &r in rows {
            self.qs.extend_from_slice(&src.qs[r * k..(r + 1) * k]);
            self.d.extend_from_slice(&src.d[r * nb..(r + 1) * nb]);
            self.s.extend_from_slice(&src.s[r * nb..(r + 1) * nb]);
            self.sums.extend_from_slice(&src.sums[r * nb..(r + 1) * nb]);
            self.offsets
                .extend_from_slice(&src.offsets[r * nb..(r + 1) * nb]);
        }
        self.n_tokens = rows.len();
        Ok(())
    }
}
