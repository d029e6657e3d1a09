//! Distillation losses over log-probabilities: Liger's generalised JSD
//! (`LigerJSD`) and torch's `kl_div`.
//!
//! JSD, with student `X = log Q`, teacher `Y = log P` (rows of `V`):
//! `M = βP + (1−β)Q`,
//! `JSD_β = β·KL(P‖M) + (1−β)·KL(Q‖M) = Σ_j βP_jY_j + (1−β)Q_jX_j − M_j log M_j`,
//! `∂/∂X_j = (1−β)Q_j(X_j − log M_j)`. As in Liger, `β = 0` is the forward
//! KL `Σ P(Y − X)` (gradient `−P`) and `β = 1` the reverse KL `Σ Q(X − Y)`
//! (gradient `Q(X − Y) + Q`): the general formula would give 0 there.
//! The loss is the sum over counted rows divided by the number of counted
//! rows (labels equal to `ignore_index` do not count; without labels every
//! row counts), and the gradient is written in the forward, scaled the
//! same way; with no counted row the loss is 0 (Liger's rows are all 0).
//!
//! KL (`torch.nn.functional.kl_div(input, target, reduction, log_target)`),
//! with `input = log q`: elementwise `t·(log t − input)` (0 where `t = 0`)
//! or, with `log_target`, `e^t·(t − input)`; reduced by sum, mean over all
//! elements or batchmean (over rows). `∂/∂input = −t` (or `−e^t`).
//!
//! Rows run in parallel; each row's sum is an f32 sum in element order and
//! the rows' sums are added in row order (f64), so the result does not
//! depend on the thread count.

use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::error::check_len;
use kvant_kernels::pool::{self, DisjointSlice, ThreadPool};
#[cfg(target_arch = "x86_64")]
use kvant_kernels::vecops::Fused;
use kvant_kernels::vecops::{exp, Fma, Plain};
use kvant_kernels::KernelError;
use std::ops::Range;

use super::Elem;

/// torch's `kl_div` reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KlReduction {
    None,
    Sum,
    /// Divided by the number of elements.
    Mean,
    /// Divided by the number of rows (torch's mathematically correct mean).
    BatchMean,
}

/// One JSD problem besides its log-probabilities: the labels (`[rows]`;
/// rows whose label is `ignore_index` do not count), the vocabulary and
/// `beta`. [`jsd_fwd`], the fused linear JSD and [`jsd_ref`] check it alike.
#[derive(Clone, Copy, Debug)]
pub struct JsdArgs<'a> {
    pub labels: Option<&'a [i64]>,
    pub vocab: usize,
    /// In `0..=1`.
    pub beta: f32,
    pub ignore_index: i64,
}

impl JsdArgs<'_> {
    /// `log_q` and `log_p` (as many values, whole rows), then
    /// [`JsdArgs::prepare`]: the rows and the row loop's arguments.
    fn check(&self, log_q: usize, log_p: usize) -> Result<(usize, JsdRows<'_>), KernelError> {
        let rows = rows_of("jsd", log_q, self.vocab)?;
        check_len("jsd log_p", log_q, log_p)?;
        Ok((rows, self.prepare(("jsd", "jsd labels"), rows)?))
    }

    /// `beta` and the labels of `rows` rows: the row loop's arguments,
    /// with the counted rows and the mean's scale. `op` names the
    /// operation and its labels in errors.
    pub(crate) fn prepare(
        &self,
        (op, labels_what): (&'static str, &'static str),
        rows: usize,
    ) -> Result<JsdRows<'_>, KernelError> {
        if !(0.0..=1.0).contains(&self.beta) {
            return Err(KernelError::InvalidShape {
                op,
                why: format!("beta {} is not in 0..=1", self.beta),
            });
        }
        let kind = if self.beta == 0.0 {
            Jsd::Forward
        } else if self.beta == 1.0 {
            Jsd::Reverse
        } else {
            Jsd::General(self.beta)
        };
        let counted = match self.labels {
            Some(l) => {
                check_len(labels_what, rows, l.len())?;
                l.iter().filter(|&&v| v != self.ignore_index).count()
            }
            None => rows,
        };
        let scale = if counted > 0 {
            1.0 / counted as f32
        } else {
            0.0
        };
        Ok(JsdRows {
            labels: self.labels,
            vocab: self.vocab,
            kind,
            ignore_index: self.ignore_index,
            scale,
            counted,
        })
    }
}

/// Which JSD formula a `beta` selects.
#[derive(Clone, Copy)]
enum Jsd {
    Forward,
    Reverse,
    General(f32),
}

/// The checked arguments of the JSD row loop, for a run of rows.
#[derive(Clone, Copy)]
pub(crate) struct JsdRows<'a> {
    labels: Option<&'a [i64]>,
    vocab: usize,
    kind: Jsd,
    ignore_index: i64,
    /// The gradient's scale, and the loss's: 1/counted (0 with none).
    pub(crate) scale: f32,
    /// Rows whose label is not `ignore_index` (every row without labels).
    pub(crate) counted: usize,
}

impl JsdRows<'_> {
    /// Rows `r` of these.
    pub(crate) fn rows(&self, r: Range<usize>) -> JsdRows<'_> {
        JsdRows {
            labels: self.labels.map(|l| &l[r]),
            ..*self
        }
    }
}

/// The tensors of a run of JSD rows: the student's (`x = log q`) and the
/// teacher's (`y = log p`) log-probabilities in; the gradient w.r.t. `x`
/// and the per-row sums out.
pub(crate) struct JsdIo<'a, E> {
    pub(crate) x: &'a [E],
    pub(crate) y: &'a [E],
    pub(crate) dx: &'a mut [E],
    pub(crate) sums: &'a mut [f32],
}

#[inline(always)]
fn jsd_row<E: Elem, F: Fma>(x: &[E], y: &[E], kind: Jsd, scale: f32, dx: &mut [E]) -> f32 {
    let mut sum = 0f32;
    for ((xv, yv), d) in x.iter().zip(y).zip(dx.iter_mut()) {
        let (xv, yv) = (xv.to_f32(), yv.to_f32());
        let (l, g) = match kind {
            Jsd::Forward => {
                let p = exp::<F>(yv);
                (p * (yv - xv), -p)
            }
            Jsd::Reverse => {
                let q = exp::<F>(xv);
                let l = q * (xv - yv);
                (l, l + q)
            }
            Jsd::General(b) => {
                let bp = b * exp::<F>(yv);
                let q1 = (1.0 - b) * exp::<F>(xv);
                let m = bp + q1;
                let lm = m.ln();
                (bp * yv + q1 * xv - m * lm, q1 * (xv - lm))
            }
        };
        sum += l;
        *d = E::from_f32(g * scale);
    }
    sum
}

#[inline(always)]
fn jsd_rows<E: Elem, F: Fma>(job: &JsdRows<'_>, io: JsdIo<'_, E>) {
    let JsdIo { x, y, dx, sums } = io;
    let JsdRows {
        labels,
        vocab,
        kind,
        ignore_index,
        scale,
        ..
    } = *job;
    for (i, ((xr, yr), dr)) in x
        .chunks_exact(vocab)
        .zip(y.chunks_exact(vocab))
        .zip(dx.chunks_exact_mut(vocab))
        .enumerate()
    {
        if labels.is_some_and(|l| l[i] == ignore_index) {
            dr.fill(E::from_f32(0.0));
            sums[i] = 0.0;
        } else {
            sums[i] = jsd_row::<E, F>(xr, yr, kind, scale, dr);
        }
    }
}

kvant_kernels::per_tier! {
    /// [`jsd_rows`] on `tier`.
    fn jsd_rows_on<E: Elem>(
        tier: SimdTier,
        job: &JsdRows<'_>,
        io: JsdIo<'_, E>,
    ) [F = Plain, Fused] {
        jsd_rows::<E, F>(job, io)
    }
}

fn tasks_for(rows: usize, pool: &ThreadPool) -> usize {
    rows.min(pool.threads() * 4).max(1)
}

/// Rows of a `[rows, vocab]` tensor of `len` values, or an error.
fn rows_of(op: &'static str, len: usize, vocab: usize) -> Result<usize, KernelError> {
    if vocab == 0 {
        return match len {
            0 => Ok(0),
            _ => Err(KernelError::InvalidShape {
                op,
                why: "vocab is 0".into(),
            }),
        };
    }
    if !len.is_multiple_of(vocab) {
        return Err(KernelError::InvalidShape {
            op,
            why: format!("{len} values are not whole rows of {vocab}"),
        });
    }
    Ok(len / vocab)
}

/// `f(rows, elements)` for each task's rows of a `[rows, vocab]` tensor,
/// in parallel: the split every row loop here shares (rows independent,
/// so it changes no result).
fn par_rows(
    pool: &ThreadPool,
    rows: usize,
    vocab: usize,
    f: &(dyn Fn(Range<usize>, Range<usize>) + Sync),
) {
    let tasks = tasks_for(rows, pool);
    pool.run(tasks, &|t| {
        let r = pool::chunk(rows, tasks, 1, t);
        let e = r.start * vocab..r.end * vocab;
        f(r, e)
    });
}

/// The checked, parallel JSD shared with the fused linear JSD: per-row
/// sums (unscaled) into `io.sums`, gradients (times `job.scale`) into `io.dx`.
pub(crate) fn jsd_rows_in<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    job: &JsdRows<'_>,
    io: JsdIo<'_, E>,
) {
    let JsdIo { x, y, dx, sums } = io;
    let rows = sums.len();
    let d = DisjointSlice::new(dx);
    let s = DisjointSlice::new(sums);
    par_rows(pool, rows, job.vocab, &|r, e| {
        // SAFETY: each task alone owns its rows `r` (disjoint ranges).
        let (dx, sums) = unsafe { (d.range(e.clone()), s.range(r.clone())) };
        let (x, y) = (&x[e.clone()], &y[e]);
        jsd_rows_on(tier, &job.rows(r), JsdIo { x, y, dx, sums })
    });
}

/// Liger's `LigerJSD` on `pool` and `tier`: generalised JSD of student
/// `log_q` and teacher `log_p` (`[rows, vocab]` log-probabilities) with
/// `a.beta`; rows whose label is `ignore_index` are ignored; loss = sum
/// over counted rows / counted. The gradient w.r.t. `log_q` is written into
/// `dlog_q` (scaled for the mean; 0 on ignored rows). Returns `(loss, counted)`.
pub fn jsd_fwd<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    a: &JsdArgs<'_>,
    log_q: &[E],
    log_p: &[E],
    dlog_q: &mut [E],
) -> Result<(f32, usize), KernelError> {
    let (rows, job) = a.check(log_q.len(), log_p.len())?;
    check_len("jsd dlog_q", log_q.len(), dlog_q.len())?;
    let mut sums = vec![0f32; rows];
    let io = JsdIo {
        x: log_q,
        y: log_p,
        dx: dlog_q,
        sums: &mut sums,
    };
    jsd_rows_in(pool, tier, &job, io);
    let total: f64 = sums.iter().map(|&v| v as f64).sum();
    Ok(((total * job.scale as f64) as f32, job.counted))
}

/// f64 reference of [`jsd_fwd`], arguments checked as there:
/// `(loss, counted, dlog_q)`.
pub fn jsd_ref(
    a: &JsdArgs<'_>,
    log_q: &[f64],
    log_p: &[f64],
) -> Result<(f64, usize, Vec<f64>), KernelError> {
    let (rows, job) = a.check(log_q.len(), log_p.len())?;
    let JsdRows {
        labels,
        vocab,
        ignore_index,
        counted,
        ..
    } = job;
    let beta = a.beta as f64;
    let scale = if counted > 0 {
        1.0 / counted as f64
    } else {
        0.0
    };
    let mut grad = vec![0.0; log_q.len()];
    let mut loss = 0.0;
    for i in 0..rows {
        if labels.is_some_and(|l| l[i] == ignore_index) {
            continue;
        }
        for j in i * vocab..(i + 1) * vocab {
            let (x, y) = (log_q[j], log_p[j]);
            let (q, p) = (x.exp(), y.exp());
            let (l, g) = if beta == 0.0 {
                (p * (y - x), -p)
            } else if beta == 1.0 {
                (q * (x - y), q * (x - y) + q)
            } else {
                let m = beta * p + (1.0 - beta) * q;
                (
                    beta * p * (y - m.ln()) + (1.0 - beta) * q * (x - m.ln()),
                    (1.0 - beta) * q * (x - m.ln()),
                )
            };
            loss += l;
            grad[j] = g * scale;
        }
    }
    Ok((loss * scale, counted, grad))
}

/// One `kl_div` problem besides its tensors: the row length and torch's
/// options. The forward, the backward and [`kl_div_ref`] check it alike.
#[derive(Clone, Copy, Debug)]
pub struct KlArgs {
    pub vocab: usize,
    /// The target holds log-probabilities (else probabilities).
    pub log_target: bool,
    pub reduction: KlReduction,
}

impl KlArgs {
    /// The rows of a tensor of `len` values (whole rows of `vocab`), with
    /// `other` (named `what`) as long.
    fn check(
        &self,
        len: usize,
        (what, other): (&'static str, usize),
    ) -> Result<usize, KernelError> {
        let rows = rows_of("kl_div", len, self.vocab)?;
        check_len(what, len, other)?;
        Ok(rows)
    }
}

#[inline(always)]
fn kl_elem<F: Fma>(x: f32, t: f32, log_target: bool) -> f32 {
    if log_target {
        exp::<F>(t) * (t - x)
    } else if t == 0.0 {
        // torch's xlogy: 0·log 0 = 0 (and 0·x = 0 for finite x).
        -t * x
    } else {
        t * (t.ln() - x)
    }
}

#[inline(always)]
fn kl_rows<E: Elem, F: Fma>(a: &KlArgs, x: &[E], t: &[E], el: Option<&mut [E]>, sums: &mut [f32]) {
    let KlArgs {
        vocab, log_target, ..
    } = *a;
    match el {
        Some(el) => {
            for (((xr, tr), er), s) in x
                .chunks_exact(vocab)
                .zip(t.chunks_exact(vocab))
                .zip(el.chunks_exact_mut(vocab))
                .zip(sums.iter_mut())
            {
                let mut acc = 0f32;
                for ((a, b), e) in xr.iter().zip(tr).zip(er.iter_mut()) {
                    let v = kl_elem::<F>(a.to_f32(), b.to_f32(), log_target);
                    acc += v;
                    *e = E::from_f32(v);
                }
                *s = acc;
            }
        }
        None => {
            for ((xr, tr), s) in x
                .chunks_exact(vocab)
                .zip(t.chunks_exact(vocab))
                .zip(sums.iter_mut())
            {
                let mut acc = 0f32;
                for (a, b) in xr.iter().zip(tr) {
                    acc += kl_elem::<F>(a.to_f32(), b.to_f32(), log_target);
                }
                *s = acc;
            }
        }
    }
}

kvant_kernels::per_tier! {
    /// [`kl_rows`] on `tier`.
    fn kl_rows_on<E: Elem>(
        tier: SimdTier,
        a: &KlArgs,
        x: &[E],
        t: &[E],
        el: Option<&mut [E]>,
        sums: &mut [f32],
    ) [F = Plain, Fused] {
        kl_rows::<E, F>(a, x, t, el, sums)
    }
}

/// `torch.nn.functional.kl_div(input, target, reduction, log_target)` on
/// `[rows, vocab]` tensors, `input = log q`, on `pool` and `tier`. Returns
/// the reduced loss (for `None` the sum, and the elementwise losses are
/// written to `elementwise`, `rows·vocab` long; otherwise `elementwise` is
/// not touched and may be empty).
pub fn kl_div_fwd<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    a: &KlArgs,
    input: &[E],
    target: &[E],
    elementwise: &mut [E],
) -> Result<f32, KernelError> {
    let rows = a.check(input.len(), ("kl_div target", target.len()))?;
    let write = a.reduction == KlReduction::None;
    if write {
        check_len("kl_div elementwise", input.len(), elementwise.len())?;
    }
    let mut sums = vec![0f32; rows];
    let el = DisjointSlice::new(elementwise);
    let s = DisjointSlice::new(&mut sums);
    par_rows(pool, rows, a.vocab, &|r, e| {
        // SAFETY: each task alone owns its rows `r` (disjoint ranges);
        // `elementwise` is only ranged when its length was checked.
        let (er, sr) = unsafe { (write.then(|| el.range(e.clone())), s.range(r)) };
        let (xr, tr) = (&input[e.clone()], &target[e]);
        kl_rows_on(tier, a, xr, tr, er, sr)
    });
    let total: f64 = sums.iter().map(|&v| v as f64).sum();
    Ok((total * kl_scale(a.reduction, rows, input.len())) as f32)
}

fn kl_scale(reduction: KlReduction, rows: usize, numel: usize) -> f64 {
    match reduction {
        KlReduction::None | KlReduction::Sum => 1.0,
        KlReduction::Mean => 1.0 / numel.max(1) as f64,
        KlReduction::BatchMean => 1.0 / rows.max(1) as f64,
    }
}

/// Backward of [`kl_div_fwd`]: `dinput = −(target or e^target) · scale ·
/// grad_out`, times `grad_elementwise[k]` (reduction None) if given; the
/// scale is 1, `1/numel` (Mean) or `1/rows` (BatchMean).
pub fn kl_div_bwd<E: Elem>(
    a: &KlArgs,
    target: &[E],
    grad_out: f32,
    grad_elementwise: Option<&[E]>,
    dinput: &mut [E],
) -> Result<(), KernelError> {
    let rows = a.check(target.len(), ("kl_div dinput", dinput.len()))?;
    if let Some(g) = grad_elementwise {
        check_len("kl_div grad_elementwise", target.len(), g.len())?;
    }
    let scale = (kl_scale(a.reduction, rows, target.len()) * grad_out as f64) as f32;
    let tier = cpu::clamp(cpu::tier());
    let d = DisjointSlice::new(dinput);
    par_rows(pool::global(), rows, a.vocab, &|_, e| {
        // SAFETY: each task alone owns its rows' elements `e` (disjoint ranges).
        let dr = unsafe { d.range(e.clone()) };
        let g = grad_elementwise.map(|g| &g[e.clone()]);
        kl_bwd_on(tier, &target[e], a.log_target, scale, g, dr)
    });
    Ok(())
}

#[inline(always)]
fn kl_bwd_body<E: Elem, F: Fma>(
    t: &[E],
    log_target: bool,
    scale: f32,
    g: Option<&[E]>,
    d: &mut [E],
) {
    for (k, (tv, dv)) in t.iter().zip(d.iter_mut()).enumerate() {
        let tv = tv.to_f32();
        let p = if log_target { exp::<F>(tv) } else { tv };
        let ge = g.map_or(1.0, |g| g[k].to_f32());
        *dv = E::from_f32(-p * scale * ge);
    }
}

kvant_kernels::per_tier! {
    /// [`kl_bwd_body`] on `tier`.
    fn kl_bwd_on<E: Elem>(
        tier: SimdTier,
        t: &[E],
        log_target: bool,
        scale: f32,
        g: Option<&[E]>,
        d: &mut [E],
    ) [F = Plain, Fused] {
        kl_bwd_body::<E, F>(t, log_target, scale, g, d)
    }
}

/// f64 reference of `kl_div`, arguments checked as in [`kl_div_fwd`]:
/// `(elementwise, reduced)`.
pub fn kl_div_ref(
    a: &KlArgs,
    input: &[f64],
    target: &[f64],
) -> Result<(Vec<f64>, f64), KernelError> {
    let rows = a.check(input.len(), ("kl_div target", target.len()))?;
    let el: Vec<f64> = input
        .iter()
        .zip(target)
        .map(|(&x, &t)| {
            if a.log_target {
                t.exp() * (t - x)
            } else if t == 0.0 {
                0.0
            } else {
                t * (t.ln() - x)
            }
        })
        .collect();
    let sum: f64 = el.iter().sum();
    Ok((el, sum * kl_scale(a.reduction, rows, input.len())))
}

#[cfg(test)]
mod tests {
    use super::super::cross_entropy::tests::same_on_1_and_3_threads;
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Random log-softmax rows (f64), logits in -4..4.
    fn log_probs(rng: &mut ChaCha8Rng, rows: usize, vocab: usize) -> Vec<f64> {
        let mut v = Vec::with_capacity(rows * vocab);
        for _ in 0..rows {
            let x: Vec<f64> = (0..vocab).map(|_| rng.random_range(-4.0..4.0)).collect();
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + x.iter().map(|&a| (a - m).exp()).sum::<f64>().ln();
            v.extend(x.iter().map(|&a| a - lse));
        }
        v
    }

    /// JSD arguments with ignore_index -100.
    fn jsd(labels: Option<&[i64]>, vocab: usize, beta: f32) -> JsdArgs<'_> {
        JsdArgs {
            labels,
            vocab,
            beta,
            ignore_index: -100,
        }
    }

    /// [`jsd_fwd`] on the global pool and the CPU's tier.
    fn jsd_global(
        a: JsdArgs<'_>,
        q: &[f32],
        p: &[f32],
        d: &mut [f32],
    ) -> Result<(f32, usize), KernelError> {
        jsd_fwd(pool::global(), cpu::tier(), &a, q, p, d)
    }

    fn round<E: Elem>(v: &[f64]) -> (Vec<E>, Vec<f64>) {
        let e: Vec<E> = v.iter().map(|&x| E::from_f32(x as f32)).collect();
        let back = e.iter().map(|x| x.to_f32() as f64).collect();
        (e, back)
    }

    /// f32 exp (~2e-7 relative) and libm log, f32 row sums: loss within
    /// 1e-5 relative (+1e-6 absolute, JSD near 0), gradients within 1e-6 ·
    /// scale absolute; bf16 gradients rounded once more (2^-8 relative).
    fn check_jsd<E: Elem>(rows: usize, vocab: usize, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (q, q64) = round::<E>(&log_probs(&mut rng, rows, vocab));
        let (p, p64) = round::<E>(&log_probs(&mut rng, rows, vocab));
        let labels: Vec<i64> = (0..rows)
            .map(|_| if rng.random_bool(0.4) { -100 } else { 1 })
            .collect();
        let rel = if E::F32 { 0.0 } else { 1.0 / 256.0 };
        for beta in [0.0f32, 1.0, 0.5, 0.1] {
            for lab in [None, Some(&labels[..])] {
                let a = jsd(lab, vocab, beta);
                let (wl, wc, wg) = jsd_ref(&a, &q64, &p64).unwrap();
                for tier in cpu::available_tiers() {
                    let mut d = vec![E::from_f32(f32::NAN); q.len()];
                    let (l, c) = jsd_fwd(pool::global(), tier, &a, &q, &p, &mut d).unwrap();
                    assert_eq!(c, wc);
                    assert!(
                        (l as f64 - wl).abs() <= 1e-6 + 1e-5 * wl.abs(),
                        "{tier} beta {beta}: {l} vs {wl}"
                    );
                    let s = 1.0 / wc.max(1) as f64;
                    for (k, (g, w)) in d.iter().zip(&wg).enumerate() {
                        let g = g.to_f32() as f64;
                        assert!(
                            (g - w).abs() <= 1e-6 * s + rel * w.abs(),
                            "{tier} beta {beta} {k}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn jsd_matches_the_reference() {
        for (i, &(r, v)) in [(1, 1), (3, 7), (7, 31), (5, 123), (4, 4096)]
            .iter()
            .enumerate()
        {
            check_jsd::<f32>(r, v, i as u64);
            check_jsd::<bf16>(r, v, 50 + i as u64);
        }
    }

    /// Central differences (f64, h = 1e-6) of the JSD reference agree with
    /// its gradient to 1e-7.
    #[test]
    fn jsd_reference_gradient_matches_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let q = log_probs(&mut rng, 2, 5);
        let p = log_probs(&mut rng, 2, 5);
        for beta in [0.0, 1.0, 0.3] {
            let a = jsd(Some(&[0, 3]), 5, beta);
            let (_, _, g) = jsd_ref(&a, &q, &p).unwrap();
            for k in 0..q.len() {
                let (mut qa, mut qb) = (q.clone(), q.clone());
                qa[k] += 1e-6;
                qb[k] -= 1e-6;
                let fd = (jsd_ref(&a, &qa, &p).unwrap().0 - jsd_ref(&a, &qb, &p).unwrap().0) / 2e-6;
                assert!(
                    (fd - g[k]).abs() < 1e-7,
                    "beta {beta} {k}: {fd} vs {}",
                    g[k]
                );
            }
        }
    }

    /// Known values: JSD_β of identical distributions is 0, and β = 0 is
    /// KL(P‖Q) (here two-point distributions).
    #[test]
    fn jsd_known_values() {
        let q = [0.25f32.ln(), 0.75f32.ln()];
        let p = [0.5f32.ln(), 0.5f32.ln()];
        let mut d = [0f32; 2];
        let (l, _) = jsd_global(jsd(None, 2, 0.5), &q, &q, &mut d).unwrap();
        assert!(l.abs() < 1e-7);
        let (l, _) = jsd_global(jsd(None, 2, 0.0), &q, &p, &mut d).unwrap();
        let want = 0.5 * (0.5f32 / 0.25).ln() + 0.5 * (0.5f32 / 0.75).ln();
        assert!((l - want).abs() < 1e-6);
        let (l, c) = jsd_global(jsd(Some(&[-100]), 2, 0.5), &q, &p, &mut d).unwrap();
        assert_eq!((l, c), (0.0, 0));
        assert_eq!(d, [0.0, 0.0]);
    }

    /// KL forward and backward on every tier and reduction against f64;
    /// same tolerances as the JSD.
    fn check_kl<E: Elem>(rows: usize, vocab: usize, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (x, x64) = round::<E>(&log_probs(&mut rng, rows, vocab));
        let lp = log_probs(&mut rng, rows, vocab);
        let rel = if E::F32 { 0.0 } else { 1.0 / 256.0 };
        for log_target in [false, true] {
            let mut tv: Vec<f64> = if log_target {
                lp.clone()
            } else {
                lp.iter().map(|v| v.exp()).collect()
            };
            if !log_target && !tv.is_empty() {
                tv[0] = 0.0; // the xlogy case
            }
            let (t, t64) = round::<E>(&tv);
            for red in [
                KlReduction::None,
                KlReduction::Sum,
                KlReduction::Mean,
                KlReduction::BatchMean,
            ] {
                let a = KlArgs {
                    vocab,
                    log_target,
                    reduction: red,
                };
                let (wel, wl) = kl_div_ref(&a, &x64, &t64).unwrap();
                for tier in cpu::available_tiers() {
                    let mut el = vec![E::from_f32(f32::NAN); x.len()];
                    let l = kl_div_fwd(pool::global(), tier, &a, &x, &t, &mut el).unwrap();
                    assert!(
                        (l as f64 - wl).abs() <= 1e-6 + 1e-5 * wl.abs(),
                        "{tier} {red:?} {log_target}: {l} vs {wl}"
                    );
                    if red == KlReduction::None {
                        for (a, w) in el.iter().zip(&wel) {
                            let a = a.to_f32() as f64;
                            assert!((a - w).abs() <= 1e-6 + (rel + 1e-6) * w.abs());
                        }
                    } else {
                        assert!(el.iter().all(|v| v.to_f32().is_nan()));
                    }
                }
                let ge: Vec<E> = (0..x.len())
                    .map(|_| E::from_f32(rng.random_range(-1.0..1.0)))
                    .collect();
                let g = (red == KlReduction::None).then_some(&ge[..]);
                let mut d = vec![E::from_f32(f32::NAN); x.len()];
                kl_div_bwd(&a, &t, 0.7, g, &mut d).unwrap();
                let s = 0.7 * kl_scale(red, rows, x.len());
                for (k, (dv, tv)) in d.iter().zip(&t64).enumerate() {
                    let p = if log_target { tv.exp() } else { *tv };
                    let w = -p * s * g.map_or(1.0, |g| g[k].to_f32() as f64);
                    let dv = dv.to_f32() as f64;
                    assert!(
                        (dv - w).abs() <= 1e-7 + (rel + 1e-6) * w.abs(),
                        "{dv} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn kl_div_matches_the_reference() {
        for (i, &(r, v)) in [(1, 1), (3, 7), (7, 31), (5, 123), (2, 4096)]
            .iter()
            .enumerate()
        {
            check_kl::<f32>(r, v, 200 + i as u64);
            check_kl::<bf16>(r, v, 300 + i as u64);
        }
    }

    #[test]
    fn thread_count_does_not_change_the_result() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let (rows, vocab) = (29, 517);
        let q: Vec<f32> = log_probs(&mut rng, rows, vocab)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let p: Vec<f32> = log_probs(&mut rng, rows, vocab)
            .iter()
            .map(|&v| v as f32)
            .collect();
        same_on_1_and_3_threads(|pool| {
            let mut d = vec![0f32; q.len()];
            let a = jsd(None, vocab, 0.3);
            let (l, _) = jsd_fwd(pool, cpu::tier(), &a, &q, &p, &mut d).unwrap();
            let mut el = vec![0f32; q.len()];
            let a = KlArgs {
                vocab,
                log_target: true,
                reduction: KlReduction::None,
            };
            let k = kl_div_fwd(pool, cpu::tier(), &a, &q, &p, &mut el).unwrap();
            (l.to_bits(), d, k.to_bits(), el)
        });
    }

    #[test]
    fn bad_arguments_are_errors() {
        let x = [0f32; 6];
        let mut d = [0f32; 6];
        assert!(jsd_global(jsd(None, 4, 0.5), &x, &x, &mut d).is_err());
        assert!(jsd_global(jsd(None, 0, 0.5), &x, &x, &mut d).is_err());
        assert!(jsd_global(jsd(None, 3, 0.5), &x, &x[..3], &mut d).is_err());
        assert!(jsd_global(jsd(None, 3, 1.5), &x, &x, &mut d).is_err());
        assert!(jsd_global(jsd(Some(&[0]), 3, 0.5), &x, &x, &mut d).is_err());
        let kl = |vocab, reduction| KlArgs {
            vocab,
            log_target: false,
            reduction,
        };
        let (pool, tier) = (pool::global(), cpu::tier());
        let none = kl(3, KlReduction::None);
        assert!(kl_div_fwd(pool, tier, &none, &x, &x, &mut d[..5]).is_err());
        let sum = kl(3, KlReduction::Sum);
        assert!(kl_div_fwd(pool, tier, &sum, &x, &x, &mut []).is_ok());
        assert!(kl_div_bwd(&sum, &x, 1.0, Some(&x[..2]), &mut d).is_err());
        assert!(kl_div_bwd(&kl(4, KlReduction::Sum), &x, 1.0, None, &mut d).is_err());
    }
}
