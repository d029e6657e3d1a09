//! Cross-entropy over logits, with its gradient written into the logits
//! in the same call (Liger's trick: nothing the size of the logits is
//! allocated or saved).
//!
//! For a row `x` (length `V`) with target `y`, softcap `c`, smoothing `ε`
//! and z-loss scale `s`:
//! - `z_j = c·tanh(x_j/c)` (or `z = x` without a softcap);
//! - `lse = log Σ_j e^{z_j}`, `p_j = e^{z_j − lse}`;
//! - `loss = (1−ε)(lse − z_y) + ε(lse − Σ_j z_j / V) + s·lse²` (torch's
//!   label smoothing: `(1−ε)·nll + ε·mean_j(−log p_j)`; Liger's z-loss);
//! - `∂loss/∂z_j = p_j(1 + 2s·lse) − ε/V − (1−ε)[j = y]`, times
//!   `∂z_j/∂x_j = 1 − (z_j/c)²` with a softcap.
//!
//! Each row is read from memory once: pass 1 widens (and caps) a block of
//! 256 values into an f32 scratch row, takes the block maximum, rescales
//! the running sum once per block when the maximum grows, and leaves
//! `e^{z_j − m_k}` (`m_k` the running maximum after the block) in the
//! scratch; pass 2 writes the gradient from the scratch alone, one factor
//! `e^{m_k − m}/Σ` per block. One exponential per value (the first version
//! took two: 90–96 ms at 4096×32000 f32 on 2 threads, exp-bound), and the
//! scratch row stays in L2 (128 KiB at vocabulary 32000). The gradient
//! goes over the logits (in place, Liger's trick) or into a separate
//! buffer ([`cross_entropy_fwd_into`], what an autograd op needs: no copy
//! of the logits). Rows are independent and the totals are summed over
//! rows in row order (f64), so no result depends on the thread count or on
//! how rows are split into tasks.

use kvant_kernels::cpu::SimdTier;
use kvant_kernels::error::{check_len, checked_mul};
use kvant_kernels::pool::{self, DisjointSlice, ThreadPool};
#[cfg(target_arch = "x86_64")]
use kvant_kernels::vecops::Fused;
use kvant_kernels::vecops::{exp, Fma, Plain};
use kvant_kernels::KernelError;

use std::ops::Range;

use super::{Elem, Reduction};

/// Options of [`cross_entropy_fwd`], torch's and Liger's.
#[derive(Clone, Copy, Debug)]
pub struct CeOptions {
    /// Rows whose target equals this count for nothing (loss and gradient 0).
    pub ignore_index: i64,
    /// torch semantics: `(1−ε)·nll + ε·mean_j(−log p_j)`; in `0..=1`.
    pub label_smoothing: f32,
    /// `lse_square_scale`: adds `z_loss·lse²` per counted row (Liger).
    pub z_loss: f32,
    /// `logits ← cap·tanh(logits/cap)` first (Gemma 2); `cap > 0`.
    pub softcap: Option<f32>,
    pub reduction: Reduction,
}

impl Default for CeOptions {
    fn default() -> Self {
        CeOptions {
            ignore_index: -100,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            reduction: Reduction::Mean,
        }
    }
}

/// One cross-entropy problem besides its logits: the targets (one per row
/// of `vocab` logits) and the options. The fast paths and the f64
/// reference check it alike ([`CeArgs::check`]).
#[derive(Clone, Copy, Debug)]
pub struct CeArgs<'a> {
    /// `[rows]`, each in `0..vocab` or `options.ignore_index`.
    pub targets: &'a [i64],
    pub vocab: usize,
    pub options: CeOptions,
}

impl CeArgs<'_> {
    /// The options and the targets: the options the row loop needs and
    /// the number of rows that count.
    pub(crate) fn prepare(&self) -> Result<(Prepared, usize), KernelError> {
        let p = Prepared::new(&self.options)?;
        let counted = count_targets(self.targets, self.vocab, self.options.ignore_index)?;
        Ok((p, counted))
    }

    /// [`CeArgs::prepare`] after the shape: a positive vocabulary (unless
    /// there is no row) and `logits` values, `[rows, vocab]`.
    pub(crate) fn check(&self, logits: usize) -> Result<(Prepared, usize), KernelError> {
        let rows = self.targets.len();
        if self.vocab == 0 && rows > 0 {
            return Err(KernelError::InvalidShape {
                op: "cross_entropy",
                why: "vocab is 0".into(),
            });
        }
        check_len(
            "cross-entropy logits",
            checked_mul("cross_entropy", rows, self.vocab)?,
            logits,
        )?;
        self.prepare()
    }
}

/// What [`cross_entropy_fwd`] returns besides the per-row losses.
#[derive(Clone, Copy, Debug, Default)]
pub struct CeTotals {
    /// The reduced loss including the z-loss (Mean: divided by `counted`,
    /// NaN when no row counts, as torch; Sum and None: the sum).
    pub loss: f32,
    /// The z-loss part, reduced the same way.
    pub z_loss: f32,
    /// Rows whose target is not `ignore_index`.
    pub counted: usize,
}

/// Values of one block: widened (and exponentiated) in place in the row's
/// f32 scratch, with the running maximum rescaled once per block.
const BLOCK: usize = 256;

/// f32 lanes of the block reductions: one 512-bit register, two 256-bit ones.
const LANES: usize = 16;

/// Options turned into what the row loop needs.
#[derive(Clone, Copy)]
pub(crate) struct Prepared {
    eps: f32,
    z_loss: f32,
    cap: Option<f32>,
    ignore_index: i64,
}

impl Prepared {
    fn new(o: &CeOptions) -> Result<Prepared, KernelError> {
        let bad = |why: String| KernelError::InvalidShape {
            op: "cross_entropy",
            why,
        };
        if !(0.0..=1.0).contains(&o.label_smoothing) {
            return Err(bad(format!(
                "label_smoothing {} is not in 0..=1",
                o.label_smoothing
            )));
        }
        if !o.z_loss.is_finite() {
            return Err(bad(format!("z_loss {} is not finite", o.z_loss)));
        }
        if let Some(c) = o.softcap {
            if !(c > 0.0 && c.is_finite()) {
                return Err(bad(format!("softcap {c} is not a positive number")));
            }
        }
        Ok(Prepared {
            eps: o.label_smoothing,
            z_loss: o.z_loss,
            cap: o.softcap,
            ignore_index: o.ignore_index,
        })
    }
}

/// Checks the targets (each in `0..vocab` or `ignore_index`) and counts
/// the rows that count.
fn count_targets(targets: &[i64], vocab: usize, ignore_index: i64) -> Result<usize, KernelError> {
    let mut counted = 0;
    for &t in targets {
        if t == ignore_index {
            continue;
        }
        if t < 0 {
            return Err(KernelError::InvalidShape {
                op: "cross_entropy",
                why: format!("target {t} is neither in 0..{vocab} nor ignore_index {ignore_index}"),
            });
        }
        if t as u64 >= vocab as u64 {
            return Err(KernelError::IndexOutOfRange {
                what: "cross-entropy target",
                index: t as usize,
                len: vocab,
            });
        }
        counted += 1;
    }
    Ok(counted)
}

/// `c·tanh(x/c)` through the vectorizable exponential (`tanh u = 1 − 2/(e^{2u}+1)`).
#[inline(always)]
fn capped<F: Fma>(x: f32, cap: Option<f32>) -> f32 {
    match cap {
        None => x,
        Some(c) => c * (1.0 - 2.0 / (exp::<F>(2.0 * x / c) + 1.0)),
    }
}

/// What the row pass leaves for the gradient pass.
#[derive(Clone, Copy)]
struct RowStats {
    /// Running maximum after the last block.
    m: f32,
    /// `Σ_j e^{z_j − m}`.
    s: f32,
    sum_z: f32,
}

/// One row's f32 working set, reused across the rows of a task: in L2
/// (128 KiB at vocabulary 32000, 512 KiB at 128256), so the logits are
/// read from memory once and each exponential is computed once.
pub(crate) struct Scratch {
    /// `e^{z_j − m_k}`, `m_k` the running maximum after `j`'s block.
    e: Vec<f32>,
    /// The soft-capped logits `z` (softcap only; the gradient needs them).
    z: Vec<f32>,
    /// `m_k` per block.
    bm: Vec<f32>,
}

impl Scratch {
    pub(crate) fn new(vocab: usize, p: Prepared) -> Scratch {
        Scratch {
            e: vec![0.0; vocab],
            z: if p.cap.is_some() {
                vec![0.0; vocab]
            } else {
                Vec::new()
            },
            bm: vec![0.0; vocab.div_ceil(BLOCK)],
        }
    }
}

/// Pass 1, the only read of the row: per block of [`BLOCK`] values, widen
/// (and cap) into the scratch, take the block maximum and `Σz`, rescale the
/// running sum when the maximum grows, and replace each value by its
/// exponential against the running maximum.
#[inline(always)]
fn row_stats<E: Elem, F: Fma>(row: &[E], p: Prepared, sc: &mut Scratch) -> RowStats {
    let (mut m, mut s, mut sum_z) = (f32::NEG_INFINITY, 0f32, 0f32);
    let zs = sc.z.chunks_mut(BLOCK);
    for (((chunk, b), bm), zb) in row
        .chunks(BLOCK)
        .zip(sc.e.chunks_mut(BLOCK))
        .zip(sc.bm.iter_mut())
        .zip(zs.map(Some).chain(std::iter::repeat_with(|| None)))
    {
        for (d, x) in b.iter_mut().zip(chunk.iter()) {
            *d = capped::<F>(x.to_f32(), p.cap);
        }
        if let Some(zb) = zb {
            zb.copy_from_slice(b);
        }
        let mut mx = [f32::NEG_INFINITY; LANES];
        let mut sz = [0f32; LANES];
        let mut it = b.chunks_exact(LANES);
        for c in &mut it {
            for ((l, z), &v) in mx.iter_mut().zip(sz.iter_mut()).zip(c) {
                *l = if v > *l { v } else { *l };
                *z += v;
            }
        }
        for (i, &v) in it.remainder().iter().enumerate() {
            mx[i] = if v > mx[i] { v } else { mx[i] };
            sz[i] += v;
        }
        let blk = mx.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        sum_z += sz.iter().sum::<f32>();
        if blk > m {
            s *= exp::<F>(m - blk);
            m = blk;
        }
        if m == f32::NEG_INFINITY {
            // Every value so far is -inf (a masked vocabulary): each one's
            // share is 0, where `exp(z - m)` would be exp(NaN).
            b.fill(0.0);
            *bm = m;
            continue;
        }
        let mut se = [0f32; LANES];
        let mut it = b.chunks_exact_mut(LANES);
        for c in &mut it {
            for (l, v) in se.iter_mut().zip(c) {
                *v = exp::<F>(*v - m);
                *l += *v;
            }
        }
        for v in it.into_remainder() {
            *v = exp::<F>(*v - m);
            se[0] += *v;
        }
        s += se.iter().sum::<f32>();
        *bm = m;
    }
    RowStats { m, s, sum_z }
}

/// The row's log-sum-exp, loss and z-loss term. A term whose weight is 0
/// is left out rather than multiplied by 0: a -inf logit makes `Σz` -inf
/// (and a -inf target `z_y`), and `0 · inf` is NaN where torch's loss is
/// finite.
#[inline(always)]
fn row_loss(st: RowStats, zy: f32, vocab: usize, p: Prepared) -> (f32, f32, f32) {
    let lse = st.m + st.s.ln();
    let zl = p.z_loss * lse * lse;
    let mut loss = lse + zl;
    if p.eps < 1.0 {
        loss -= (1.0 - p.eps) * zy;
    }
    if p.eps > 0.0 {
        loss -= p.eps * st.sum_z / vocab as f32;
    }
    (lse, loss, zl)
}

/// Pass 2, from the scratch only: `out ← scale · ∂loss/∂x`, each block's
/// exponentials rescaled by one factor `e^{m_k − m}/s`.
#[inline(always)]
fn row_grad<E: Elem, F: Fma>(
    out: &mut [E],
    sc: &Scratch,
    st: RowStats,
    (target, zy, lse): (usize, f32, f32),
    p: Prepared,
    scale: f32,
) {
    let vocab = out.len();
    let a = scale * (1.0 + 2.0 * p.z_loss * lse);
    let b = scale * p.eps / vocab as f32;
    let inv = a / st.s;
    for (k, (o, e)) in out.chunks_mut(BLOCK).zip(sc.e.chunks(BLOCK)).enumerate() {
        let f = inv * exp::<F>(sc.bm[k] - st.m);
        match p.cap {
            None => {
                for (o, &e) in o.iter_mut().zip(e) {
                    *o = E::from_f32(F::fma(f, e, -b));
                }
            }
            Some(c) => {
                let ic = 1.0 / c;
                let z = &sc.z[k * BLOCK..k * BLOCK + o.len()];
                for ((o, &e), &z) in o.iter_mut().zip(e).zip(z) {
                    let t = z * ic;
                    *o = E::from_f32(F::fma(f, e, -b) * (1.0 - t * t));
                }
            }
        }
    }
    // The target's gradient once more in f32 (no bf16 cancellation).
    let py = exp::<F>(zy - lse);
    let mut g = a * py - b - scale * (1.0 - p.eps);
    if let Some(c) = p.cap {
        let t = zy / c;
        g *= 1.0 - t * t;
    }
    out[target] = E::from_f32(g);
}

/// Where a task's rows come from and where their gradients go.
pub(crate) enum RowsIo<'a, E> {
    /// The logits, overwritten by their gradient when one is asked for.
    InPlace(&'a mut [E]),
    /// The logits read only; the gradient (if any) written to the second.
    Into(&'a [E], Option<&'a mut [E]>),
}

/// The checked arguments of the row loop, for a run of rows.
#[derive(Clone, Copy)]
pub(crate) struct CeRows<'a> {
    pub(crate) targets: &'a [i64],
    pub(crate) vocab: usize,
    pub(crate) p: Prepared,
    /// The scale of every counted row's gradient (None: no gradient).
    pub(crate) grad: Option<f32>,
    /// Row i's gradient times `row_scale[i]` besides.
    pub(crate) row_scale: Option<&'a [f32]>,
}

impl CeRows<'_> {
    /// Rows `r` of these.
    pub(crate) fn rows(&self, r: Range<usize>) -> CeRows<'_> {
        CeRows {
            targets: &self.targets[r.clone()],
            row_scale: self.row_scale.map(|s| &s[r]),
            ..*self
        }
    }
}

/// Rows of one task: losses (and z-loss terms) per row; ignored rows 0.
#[inline(always)]
fn rows_body<E: Elem, F: Fma>(
    mut io: RowsIo<'_, E>,
    job: &CeRows<'_>,
    losses: &mut [f32],
    zs: &mut [f32],
) {
    let CeRows {
        targets,
        vocab,
        p,
        grad,
        row_scale,
    } = *job;
    let mut sc = Scratch::new(vocab, p);
    for (i, &t) in targets.iter().enumerate() {
        let r = i * vocab..(i + 1) * vocab;
        // The row read, and where its gradient goes (in place: the row).
        let (x, out): (Option<&[E]>, Option<&mut [E]>) = match &mut io {
            RowsIo::InPlace(l) if grad.is_some() => (None, Some(&mut l[r])),
            RowsIo::InPlace(l) => (Some(&l[r]), None),
            RowsIo::Into(x, g) => (Some(&x[r.clone()]), g.as_deref_mut().map(|g| &mut g[r])),
        };
        if t == p.ignore_index {
            if let Some(o) = out {
                o.fill(E::from_f32(0.0));
            }
            losses[i] = 0.0;
            zs[i] = 0.0;
            continue;
        }
        let t = t as usize;
        let (st, zy) = match (x, &out) {
            (Some(x), _) => (row_stats::<E, F>(x, p, &mut sc), x[t].to_f32()),
            (None, Some(o)) => (row_stats::<E, F>(o, p, &mut sc), o[t].to_f32()),
            (None, None) => continue,
        };
        let zy = capped::<F>(zy, p.cap);
        let (lse, l, z) = row_loss(st, zy, vocab, p);
        if let (Some(o), Some(s)) = (out, grad) {
            let g = row_scale.map_or(s, |rs| s * rs[i]);
            row_grad::<E, F>(o, &sc, st, (t, zy, lse), p, g);
        }
        losses[i] = l;
        zs[i] = z;
    }
}

kvant_kernels::per_tier! {
    /// The row loop on a tier; arguments already checked.
    fn rows_with<E: Elem>(
        tier: SimdTier,
        io: RowsIo<'_, E>,
        job: &CeRows<'_>,
        losses: &mut [f32],
        zs: &mut [f32],
    ) [F = Plain, Fused] {
        rows_body::<E, F>(io, job, losses, zs)
    }
}

/// Rows per task: enough tasks to balance 2–64 threads, rows independent,
/// so the split changes no result.
fn tasks_for(rows: usize, pool: &ThreadPool) -> usize {
    rows.min(pool.threads() * 4).max(1)
}

/// The checked, parallel row loop shared with the fused linear
/// cross-entropy: per-row losses into `losses`, z-loss terms into `zs`.
pub(crate) fn ce_rows<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    io: RowsIo<'_, E>,
    job: &CeRows<'_>,
    losses: &mut [f32],
    zs: &mut [f32],
) {
    let (rows, vocab) = (job.targets.len(), job.vocab);
    let tasks = tasks_for(rows, pool);
    let (src, out): (Option<&[E]>, Option<DisjointSlice<'_, E>>) = match io {
        RowsIo::InPlace(l) => (None, Some(DisjointSlice::new(l))),
        RowsIo::Into(x, g) => (Some(x), g.map(DisjointSlice::new)),
    };
    let ls = DisjointSlice::new(losses);
    let zz = DisjointSlice::new(zs);
    pool.run(tasks, &|t| {
        let r = pool::chunk(rows, tasks, 1, t);
        let e = r.start * vocab..r.end * vocab;
        // SAFETY: task `t` alone owns rows `r` of each slice (`chunk`
        // ranges are disjoint), and the lengths were checked by the caller.
        let (o, lo, z) = unsafe {
            (
                out.as_ref().map(|o| o.range(e.clone())),
                ls.range(r.clone()),
                zz.range(r.clone()),
            )
        };
        let io = match (src, o) {
            (Some(x), o) => RowsIo::Into(&x[e], o),
            (None, Some(o)) => RowsIo::InPlace(o),
            (None, None) => return,
        };
        rows_with(tier, io, &job.rows(r), lo, z);
    });
}

/// The gradient scale a reduction gives every counted row.
pub(crate) fn grad_scale(reduction: Reduction, counted: usize) -> f32 {
    match reduction {
        Reduction::Mean if counted > 0 => 1.0 / counted as f32,
        Reduction::Mean => 0.0,
        Reduction::Sum | Reduction::None => 1.0,
    }
}

/// Totals from per-row losses and z-loss terms, summed in row order (f64).
pub(crate) fn totals(losses: &[f32], zs: &[f32], counted: usize, reduction: Reduction) -> CeTotals {
    let l: f64 = losses.iter().map(|&v| v as f64).sum();
    let z: f64 = zs.iter().map(|&v| v as f64).sum();
    let d = match reduction {
        Reduction::Mean => counted as f64,
        _ => 1.0,
    };
    CeTotals {
        loss: (l / d) as f32,
        z_loss: (z / d) as f32,
        counted,
    }
}

/// Cross-entropy of `logits` `[rows, vocab]` against `a.targets`
/// `[rows]`, on `pool` and `tier` (lowered to one the CPU supports).
///
/// Writes per-row losses (0 for ignored rows; with z-loss included) into
/// `losses` and, if `want_grad`, overwrites `logits` with the gradient of
/// the reduced loss (Mean: divided by `counted`; Sum: unscaled; None:
/// `d(row loss)/d(logits)`, which backward multiplies per row by
/// grad_output): one read and one write of the logits. A target outside
/// `0..vocab` that is not `ignore_index` is an error before anything is
/// written.
pub fn cross_entropy_fwd<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    a: &CeArgs<'_>,
    logits: &mut [E],
    losses: &mut [f32],
    want_grad: bool,
) -> Result<CeTotals, KernelError> {
    let io = if want_grad {
        RowsIo::InPlace(logits)
    } else {
        RowsIo::Into(logits, None)
    };
    run(pool, tier, a, io, losses)
}

/// [`cross_entropy_fwd`] leaving the logits as they are: the gradient (if
/// `grad` is given, `[rows, vocab]`) is written there instead. What an
/// autograd op needs, whose input may not change: no copy of the logits.
pub fn cross_entropy_fwd_into<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    a: &CeArgs<'_>,
    logits: &[E],
    losses: &mut [f32],
    grad: Option<&mut [E]>,
) -> Result<CeTotals, KernelError> {
    if let Some(g) = &grad {
        check_len("cross-entropy gradient", logits.len(), g.len())?;
    }
    run(pool, tier, a, RowsIo::Into(logits, grad), losses)
}

/// Checks the arguments, then the parallel row loop and the totals.
fn run<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    a: &CeArgs<'_>,
    io: RowsIo<'_, E>,
    losses: &mut [f32],
) -> Result<CeTotals, KernelError> {
    let len = match &io {
        RowsIo::InPlace(l) => l.len(),
        RowsIo::Into(l, _) => l.len(),
    };
    let (p, counted) = a.check(len)?;
    let rows = a.targets.len();
    check_len("cross-entropy losses", rows, losses.len())?;
    let want_grad = match &io {
        RowsIo::InPlace(_) => true,
        RowsIo::Into(_, g) => g.is_some(),
    };
    let reduction = a.options.reduction;
    let job = CeRows {
        targets: a.targets,
        vocab: a.vocab,
        p,
        grad: want_grad.then(|| grad_scale(reduction, counted)),
        row_scale: None,
    };
    let mut zs = vec![0f32; rows];
    ce_rows(pool, tier, io, &job, losses, &mut zs);
    Ok(totals(losses, &zs, counted, reduction))
}

/// The f64 reference's results.
#[derive(Clone, Debug)]
pub struct CeRef {
    pub losses: Vec<f64>,
    pub z_losses: Vec<f64>,
    /// Reduced as [`CeTotals::loss`] / [`CeTotals::z_loss`].
    pub loss: f64,
    pub z_loss: f64,
    pub counted: usize,
    /// Gradient of the reduced loss (None: of each row's loss).
    pub grad: Vec<f64>,
}

/// Scalar f64 reference of [`cross_entropy_fwd`], straight from the
/// formulas; the arguments are checked as there.
pub fn cross_entropy_ref(a: &CeArgs<'_>, logits: &[f64]) -> Result<CeRef, KernelError> {
    let (_, counted) = a.check(logits.len())?;
    let CeArgs {
        targets,
        vocab,
        options: ref o,
    } = *a;
    let rows = targets.len();
    let eps = o.label_smoothing as f64;
    let s = o.z_loss as f64;
    let v = vocab as f64;
    let mut r = CeRef {
        losses: vec![0.0; rows],
        z_losses: vec![0.0; rows],
        loss: 0.0,
        z_loss: 0.0,
        counted,
        grad: vec![0.0; rows * vocab],
    };
    let scale = match o.reduction {
        Reduction::Mean => 1.0 / counted.max(1) as f64,
        _ => 1.0,
    };
    for (i, &t) in targets.iter().enumerate() {
        if t == o.ignore_index {
            continue;
        }
        let x = &logits[i * vocab..(i + 1) * vocab];
        let z: Vec<f64> = x
            .iter()
            .map(|&x| match o.softcap {
                Some(c) => c as f64 * (x / c as f64).tanh(),
                None => x,
            })
            .collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|&z| (z - m).exp()).sum::<f64>().ln();
        let y = t as usize;
        let nll = lse - z[y];
        let smooth = z.iter().map(|&z| lse - z).sum::<f64>() / v;
        let zl = s * lse * lse;
        // Terms of weight 0 left out: `0 · inf` (a -inf logit) is NaN.
        let weighted = |w: f64, x: f64| if w == 0.0 { 0.0 } else { w * x };
        r.losses[i] = weighted(1.0 - eps, nll) + weighted(eps, smooth) + zl;
        r.z_losses[i] = zl;
        for (j, &zj) in z.iter().enumerate() {
            let p = (zj - lse).exp();
            let mut g = p * (1.0 + 2.0 * s * lse) - eps / v;
            if j == y {
                g -= 1.0 - eps;
            }
            if let Some(c) = o.softcap {
                g *= 1.0 - (zj / c as f64).powi(2);
            }
            r.grad[i * vocab + j] = g * scale;
        }
    }
    let d = match o.reduction {
        Reduction::Mean => counted as f64,
        _ => 1.0,
    };
    r.loss = r.losses.iter().sum::<f64>() / d;
    r.z_loss = r.z_losses.iter().sum::<f64>() / d;
    Ok(r)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use half::bf16;
    use kvant_kernels::cpu;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// `run` on 1 and on 3 threads gives the same result.
    pub(crate) fn same_on_1_and_3_threads<T: PartialEq + std::fmt::Debug>(
        run: impl Fn(&ThreadPool) -> T,
    ) {
        let one = ThreadPool::new(1).unwrap();
        let three = ThreadPool::new(3).unwrap();
        assert_eq!(run(&one), run(&three));
    }

    fn options() -> Vec<CeOptions> {
        let mut v = Vec::new();
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            v.push(CeOptions {
                reduction,
                ..Default::default()
            });
            v.push(CeOptions {
                ignore_index: -100,
                label_smoothing: 0.1,
                z_loss: 1e-4,
                softcap: Some(30.0),
                reduction,
            });
        }
        v.push(CeOptions {
            label_smoothing: 0.1,
            ..Default::default()
        });
        v.push(CeOptions {
            softcap: Some(5.0),
            z_loss: 1e-2,
            ..Default::default()
        });
        v
    }

    fn data(rng: &mut ChaCha8Rng, rows: usize, vocab: usize, scale: f32) -> (Vec<f32>, Vec<i64>) {
        let x = (0..rows * vocab)
            .map(|_| rng.random_range(-scale..scale))
            .collect();
        let t = (0..rows)
            .map(|_| {
                if rng.random_bool(0.3) {
                    -100
                } else {
                    rng.random_range(0..vocab as i64)
                }
            })
            .collect();
        (x, t)
    }

    /// Every tier, f32 and bf16, against the f64 reference on the same
    /// (already rounded) inputs. f32: the polynomial exp (~2e-7) and f32
    /// sums over ≤ 32000 values keep losses within 2e-5 relative and
    /// gradients within 1e-6 · scale absolute (probabilities ≤ 1). bf16:
    /// losses are f32 internally (same bound); the stored gradient is
    /// rounded once, 2^-8 relative, plus the same absolute slack.
    ///
    /// `masked`: a fifth of the logits that are not targets are -inf, and
    /// so are the first 300 of row 0 (more than a block: the running
    /// maximum is still -inf when its first blocks end), as a masked
    /// vocabulary or a -inf bias makes them; with label smoothing the
    /// loss is then +inf, as torch's.
    fn check<E: Elem>(rows: usize, vocab: usize, seed: u64, masked: bool) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (mut x, mut t) = data(&mut rng, rows, vocab, 8.0);
        if masked && vocab > 1 {
            t[0] = vocab as i64 - 1;
            for (i, row) in x.chunks_exact_mut(vocab).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    if j as i64 != t[i] && ((i == 0 && j < 300) || rng.random_bool(0.2)) {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
        }
        // Equal infinities, or finite and within `tol`.
        let close = |a: f64, b: f64, tol: f64| match b.is_finite() {
            true => (a - b).abs() <= tol,
            false => a == b,
        };
        let xe: Vec<E> = x.iter().map(|&v| E::from_f32(v)).collect();
        let x64: Vec<f64> = xe.iter().map(|v| v.to_f32() as f64).collect();
        let rel = if E::F32 { 0.0 } else { 1.0 / 256.0 };
        for o in options() {
            let a = CeArgs {
                targets: &t,
                vocab,
                options: o,
            };
            let want = cross_entropy_ref(&a, &x64).unwrap();
            let gs = match o.reduction {
                Reduction::Mean => 1.0 / want.counted.max(1) as f64,
                _ => 1.0,
            };
            for tier in cpu::available_tiers() {
                let mut g = xe.clone();
                let mut losses = vec![f32::NAN; rows];
                let tot =
                    cross_entropy_fwd(pool::global(), tier, &a, &mut g, &mut losses, true).unwrap();
                assert_eq!(tot.counted, want.counted);
                for (i, (&l, &w)) in losses.iter().zip(&want.losses).enumerate() {
                    assert!(
                        close(l as f64, w, 2e-5 * w.abs().max(1.0)),
                        "{tier} {o:?} row {i}: {l} vs {w}"
                    );
                }
                if want.counted > 0 || o.reduction != Reduction::Mean {
                    assert!(
                        close(tot.loss as f64, want.loss, 2e-5 * want.loss.abs().max(1.0)),
                        "{tier} {o:?}: {} vs {}",
                        tot.loss,
                        want.loss
                    );
                    assert!((tot.z_loss as f64 - want.z_loss).abs() <= 1e-6 + 1e-5 * want.z_loss);
                }
                for (k, (&gv, &w)) in g.iter().zip(&want.grad).enumerate() {
                    let gv = gv.to_f32() as f64;
                    assert!(
                        (gv - w).abs() <= 1e-6 * gs + rel * w.abs(),
                        "{tier} {o:?} elem {k}: {gv} vs {w}"
                    );
                }
                // Out of place: the same bits, the logits untouched.
                let mut into = vec![E::from_f32(f32::NAN); xe.len()];
                let mut l3 = vec![f32::NAN; rows];
                let tot3 =
                    cross_entropy_fwd_into(pool::global(), tier, &a, &xe, &mut l3, Some(&mut into))
                        .unwrap();
                assert!(into
                    .iter()
                    .zip(&g)
                    .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()));
                assert_eq!(l3, losses);
                assert_eq!(tot3.loss.to_bits(), tot.loss.to_bits());
                // Without the gradient the logits stay as they were.
                let mut same = xe.clone();
                let mut l2 = vec![f32::NAN; rows];
                cross_entropy_fwd(pool::global(), tier, &a, &mut same, &mut l2, false).unwrap();
                assert!(same
                    .iter()
                    .zip(&xe)
                    .all(|(a, b)| a.to_f32().to_bits() == b.to_f32().to_bits()));
                assert_eq!(l2, losses);
            }
        }
    }

    #[test]
    fn matches_the_reference_on_odd_shapes() {
        for (i, &(rows, vocab)) in [(1, 1), (1, 7), (7, 31), (5, 123), (3, 257), (9, 41)]
            .iter()
            .enumerate()
        {
            check::<f32>(rows, vocab, i as u64, false);
            check::<bf16>(rows, vocab, 100 + i as u64, false);
        }
    }

    #[test]
    fn matches_the_reference_at_a_realistic_vocab() {
        check::<f32>(6, 32000, 7, false);
        check::<bf16>(3, 32000, 8, false);
    }

    /// -inf logits (a masked vocabulary): finite losses without label
    /// smoothing, +inf with it, and the reference's gradients. The loss
    /// used to be NaN (`0 · Σz` with `Σz = -inf`; `exp(-inf - -inf)` in a
    /// leading all-masked block).
    #[test]
    fn masked_logits_match_the_reference() {
        for (i, &(rows, vocab)) in [(3, 7), (5, 301), (4, 1001), (2, 1500)].iter().enumerate() {
            check::<f32>(rows, vocab, 200 + i as u64, true);
            check::<bf16>(rows, vocab, 300 + i as u64, true);
        }
    }

    /// Central differences of the reference's losses (f64, h = 1e-6) agree
    /// with its analytic gradient to 1e-6 (the truncation error is h²·f‴).
    #[test]
    fn reference_gradient_matches_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (rows, vocab) = (3, 5);
        let x: Vec<f64> = (0..rows * vocab)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let t = vec![2, -100, 4];
        for o in options() {
            let a = CeArgs {
                targets: &t,
                vocab,
                options: o,
            };
            let r = cross_entropy_ref(&a, &x).unwrap();
            for k in 0..x.len() {
                let h = 1e-6;
                let (mut xa, mut xb) = (x.clone(), x.clone());
                xa[k] += h;
                xb[k] -= h;
                let fa = cross_entropy_ref(&a, &xa).unwrap();
                let fb = cross_entropy_ref(&a, &xb).unwrap();
                let fd = match o.reduction {
                    Reduction::None => (fa.losses[k / vocab] - fb.losses[k / vocab]) / (2.0 * h),
                    _ => (fa.loss - fb.loss) / (2.0 * h),
                };
                assert!(
                    (fd - r.grad[k]).abs() < 1e-6,
                    "{o:?} {k}: {fd} vs {}",
                    r.grad[k]
                );
            }
        }
    }

    /// Rows are independent and totals summed in row order: 1 and 3
    /// threads give the same bits.
    #[test]
    fn thread_count_does_not_change_the_result() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let (rows, vocab) = (37, 1001);
        let (x, t) = data(&mut rng, rows, vocab, 5.0);
        let a = CeArgs {
            targets: &t,
            vocab,
            options: options()[1],
        };
        same_on_1_and_3_threads(|pool| {
            let mut g = x.clone();
            let mut l = vec![0f32; rows];
            let tot = cross_entropy_fwd(pool, cpu::tier(), &a, &mut g, &mut l, true).unwrap();
            (g, l, tot.loss.to_bits())
        });
    }

    /// [`cross_entropy_fwd`] in place on the global pool and the CPU's tier.
    fn fwd(
        targets: &[i64],
        vocab: usize,
        options: CeOptions,
        x: &mut [f32],
        l: &mut [f32],
    ) -> Result<CeTotals, KernelError> {
        let a = CeArgs {
            targets,
            vocab,
            options,
        };
        cross_entropy_fwd(pool::global(), cpu::tier(), &a, x, l, true)
    }

    #[test]
    fn mean_with_every_row_ignored_is_nan_with_zero_gradient() {
        let mut x = vec![1f32; 6];
        let mut l = vec![f32::NAN; 2];
        let o = CeOptions::default();
        let t = fwd(&[-100, -100], 3, o, &mut x, &mut l).unwrap();
        assert!(t.loss.is_nan());
        assert_eq!(t.counted, 0);
        assert_eq!(x, vec![0.0; 6]);
        assert_eq!(l, vec![0.0; 2]);
    }

    #[test]
    fn bad_arguments_are_errors_before_anything_is_written() {
        let o = CeOptions::default();
        let mut x = vec![1f32; 6];
        let mut l = vec![f32::NAN; 2];
        for t in [[0i64, 3], [-1, 0], [0, i64::MAX]] {
            assert!(fwd(&t, 3, o, &mut x, &mut l).is_err());
            assert_eq!(x, vec![1.0; 6]);
            assert!(l.iter().all(|v| v.is_nan()));
        }
        assert!(fwd(&[0, 1], 4, o, &mut x, &mut l).is_err());
        assert!(fwd(&[0], 3, o, &mut x, &mut l).is_err());
        assert!(fwd(&[0, 1], 0, o, &mut x, &mut l).is_err());
        assert!(fwd(&[0, 1], usize::MAX, o, &mut x, &mut l).is_err());
        let mut short = vec![f32::NAN; 5];
        let a = CeArgs {
            targets: &[0, 1],
            vocab: 3,
            options: o,
        };
        let (pool, tier) = (pool::global(), cpu::tier());
        assert!(cross_entropy_fwd_into(pool, tier, &a, &x, &mut l, Some(&mut short)).is_err());
        assert!(short.iter().all(|v| v.is_nan()));
        for bad in [
            CeOptions {
                label_smoothing: 1.5,
                ..o
            },
            CeOptions {
                softcap: Some(0.0),
                ..o
            },
            CeOptions {
                z_loss: f32::NAN,
                ..o
            },
        ] {
            assert!(fwd(&[0, 1], 3, bad, &mut x, &mut l).is_err());
        }
        assert_eq!(x, vec![1.0; 6]);
    }
}
