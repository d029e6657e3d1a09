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

/// Which JSD formula a `beta` selects.
#[derive(Clone, Copy)]
enum Jsd {
    Forward,
    Reverse,
    General(f32),
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
#[allow(clippy::too_many_arguments)]
fn jsd_rows<E: Elem, F: Fma>(
    x: &[E],
    y: &[E],
    labels: Option<&[i64]>,
    vocab: usize,
    kind: Jsd,
    ignore_index: i64,
    scale: f32,
    dx: &mut [E],
    sums: &mut [f32],
) {
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
        x: &[E],
        y: &[E],
        labels: Option<&[i64]>,
        vocab: usize,
        kind: Jsd,
        ignore_index: i64,
        scale: f32,
        dx: &mut [E],
        sums: &mut [f32],
    ) [F = Plain, Fused] {
        jsd_rows::<E, F>(x, y, labels, vocab, kind, ignore_index, scale, dx, sums)
    }
}

fn tasks_for(rows: usize, pool: &ThreadPool) -> usize {
    rows.min(pool.threads() * 4).max(1)
}

fn check_beta(beta: f32) -> Result<Jsd, KernelError> {
    if !(0.0..=1.0).contains(&beta) {
        return Err(KernelError::InvalidShape {
            op: "jsd",
            why: format!("beta {beta} is not in 0..=1"),
        });
    }
    Ok(if beta == 0.0 {
        Jsd::Forward
    } else if beta == 1.0 {
        Jsd::Reverse
    } else {
        Jsd::General(beta)
    })
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

/// The checked, parallel JSD shared with the fused linear JSD: per-row
/// sums (unscaled) into `sums`, gradients (times `scale`) into `dx`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn jsd_rows_in<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    x: &[E],
    y: &[E],
    labels: Option<&[i64]>,
    vocab: usize,
    beta: f32,
    ignore_index: i64,
    scale: f32,
    dx: &mut [E],
    sums: &mut [f32],
) -> Result<(), KernelError> {
    let kind = check_beta(beta)?;
    let rows = sums.len();
    let tasks = tasks_for(rows, pool);
    let d = DisjointSlice::new(dx);
    let s = DisjointSlice::new(sums);
    pool.run(tasks, &|t| {
        let r = pool::chunk(rows, tasks, 1, t);
        let e = r.start * vocab..r.end * vocab;
        // SAFETY: task `t` alone owns rows `r` (`chunk` ranges are disjoint).
        let (dr, sr) = unsafe { (d.range(e.clone()), s.range(r.clone())) };
        let lr = labels.map(|l| &l[r.clone()]);
        let (xr, yr) = (&x[e.clone()], &y[e]);
        jsd_rows_on(tier, xr, yr, lr, vocab, kind, ignore_index, scale, dr, sr)
    });
    Ok(())
}

/// Liger's `LigerJSD`: generalised JSD of student `log_q` and teacher
/// `log_p` (`[rows, vocab]` log-probabilities), `beta` in `0..=1`,
/// optional `labels` with `ignore_index` (those rows ignored); loss = sum
/// over counted rows / counted. The gradient w.r.t. `log_q` is written into
/// `dlog_q` (scaled for the mean; 0 on ignored rows). Returns `(loss, counted)`.
pub fn jsd_fwd<E: Elem>(
    log_q: &[E],
    log_p: &[E],
    labels: Option<&[i64]>,
    vocab: usize,
    beta: f32,
    ignore_index: i64,
    dlog_q: &mut [E],
) -> Result<(f32, usize), KernelError> {
    jsd_fwd_in(
        pool::global(),
        cpu::tier(),
        log_q,
        log_p,
        labels,
        vocab,
        beta,
        ignore_index,
        dlog_q,
    )
}

/// [`jsd_fwd`] on a given pool and tier.
#[allow(clippy::too_many_arguments)]
pub fn jsd_fwd_in<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    log_q: &[E],
    log_p: &[E],
    labels: Option<&[i64]>,
    vocab: usize,
    beta: f32,
    ignore_index: i64,
    dlog_q: &mut [E],
) -> Result<(f32, usize), KernelError> {
    let rows = rows_of("jsd", log_q.len(), vocab)?;
    check_len("jsd log_p", log_q.len(), log_p.len())?;
    check_len("jsd dlog_q", log_q.len(), dlog_q.len())?;
    check_beta(beta)?;
    let counted = match labels {
        Some(l) => {
            check_len("jsd labels", rows, l.len())?;
            l.iter().filter(|&&v| v != ignore_index).count()
        }
        None => rows,
    };
    let scale = if counted > 0 {
        1.0 / counted as f32
    } else {
        0.0
    };
    let mut sums = vec![0f32; rows];
    jsd_rows_in(
        pool,
        tier,
        log_q,
        log_p,
        labels,
        vocab,
        beta,
        ignore_index,
        scale,
        dlog_q,
        &mut sums,
    )?;
    let total: f64 = sums.iter().map(|&v| v as f64).sum();
    Ok(((total * scale as f64) as f32, counted))
}

/// f64 reference of [`jsd_fwd`]: `(loss, counted, dlog_q)`.
pub fn jsd_ref(
    log_q: &[f64],
    log_p: &[f64],
    labels: Option<&[i64]>,
    vocab: usize,
    beta: f64,
    ignore_index: i64,
) -> (f64, usize, Vec<f64>) {
    let rows = log_q.len() / vocab.max(1);
    let counted = labels.map_or(rows, |l| l.iter().filter(|&&v| v != ignore_index).count());
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
    (loss * scale, counted, grad)
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
fn kl_rows<E: Elem, F: Fma>(
    x: &[E],
    t: &[E],
    vocab: usize,
    log_target: bool,
    el: Option<&mut [E]>,
    sums: &mut [f32],
) {
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
        x: &[E],
        t: &[E],
        vocab: usize,
        log_target: bool,
        el: Option<&mut [E]>,
        sums: &mut [f32],
    ) [F = Plain, Fused] {
        kl_rows::<E, F>(x, t, vocab, log_target, el, sums)
    }
}

/// `torch.nn.functional.kl_div(input, target, reduction, log_target)` on
/// `[rows, vocab]` tensors, `input = log q`. Returns the reduced loss (for
/// `None` the sum, and the elementwise losses are written to `elementwise`,
/// `rows·vocab` long; otherwise `elementwise` is not touched and may be empty).
pub fn kl_div_fwd<E: Elem>(
    input: &[E],
    target: &[E],
    vocab: usize,
    log_target: bool,
    reduction: KlReduction,
    elementwise: &mut [E],
) -> Result<f32, KernelError> {
    kl_div_fwd_in(
        pool::global(),
        cpu::tier(),
        input,
        target,
        vocab,
        log_target,
        reduction,
        elementwise,
    )
}

/// [`kl_div_fwd`] on a given pool and tier.
#[allow(clippy::too_many_arguments)]
pub fn kl_div_fwd_in<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    input: &[E],
    target: &[E],
    vocab: usize,
    log_target: bool,
    reduction: KlReduction,
    elementwise: &mut [E],
) -> Result<f32, KernelError> {
    let rows = rows_of("kl_div", input.len(), vocab)?;
    check_len("kl_div target", input.len(), target.len())?;
    let write = reduction == KlReduction::None;
    if write {
        check_len("kl_div elementwise", input.len(), elementwise.len())?;
    }
    let mut sums = vec![0f32; rows];
    let tasks = tasks_for(rows, pool);
    let el = DisjointSlice::new(elementwise);
    let s = DisjointSlice::new(&mut sums);
    pool.run(tasks, &|t| {
        let r = pool::chunk(rows, tasks, 1, t);
        let e = r.start * vocab..r.end * vocab;
        // SAFETY: task `t` alone owns rows `r` (`chunk` ranges are
        // disjoint); `elementwise` is only ranged when its length was checked.
        let (er, sr) = unsafe { (write.then(|| el.range(e.clone())), s.range(r.clone())) };
        let (xr, tr) = (&input[e.clone()], &target[e]);
        kl_rows_on(tier, xr, tr, vocab, log_target, er, sr)
    });
    let total: f64 = sums.iter().map(|&v| v as f64).sum();
    Ok((total * kl_scale(reduction, rows, input.len())) as f32)
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
    target: &[E],
    log_target: bool,
    reduction: KlReduction,
    vocab: usize,
    grad_out: f32,
    grad_elementwise: Option<&[E]>,
    dinput: &mut [E],
) -> Result<(), KernelError> {
    let rows = rows_of("kl_div", target.len(), vocab)?;
    check_len("kl_div dinput", target.len(), dinput.len())?;
    if let Some(g) = grad_elementwise {
        check_len("kl_div grad_elementwise", target.len(), g.len())?;
    }
    let scale = (kl_scale(reduction, rows, target.len()) * grad_out as f64) as f32;
    let tier = cpu::clamp(cpu::tier());
    let pool = pool::global();
    let tasks = tasks_for(rows, pool);
    let d = DisjointSlice::new(dinput);
    pool.run(tasks, &|t| {
        let r = pool::chunk(rows, tasks, 1, t);
        let e = r.start * vocab..r.end * vocab;
        // SAFETY: task `t` alone owns rows `r` (`chunk` ranges are disjoint).
        let dr = unsafe { d.range(e.clone()) };
        let g = grad_elementwise.map(|g| &g[e.clone()]);
        kl_bwd_on(tier, &target[e], log_target, scale, g, dr)
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

/// f64 reference of `kl_div`: `(elementwise, reduced)`.
pub fn kl_div_ref(
    input: &[f64],
    target: &[f64],
    vocab: usize,
    log_target: bool,
    reduction: KlReduction,
) -> (Vec<f64>, f64) {
    let el: Vec<f64> = input
        .iter()
        .zip(target)
        .map(|(&x, &t)| {
            if log_target {
                t.exp() * (t - x)
            } else if t == 0.0 {
                0.0
            } else {
                t * (t.ln() - x)
            }
        })
        .collect();
    let rows = input.len() / vocab.max(1);
    let sum: f64 = el.iter().sum();
    (el, sum * kl_scale(reduction, rows, input.len()))
}

#[cfg(test)]
mod tests {
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
                let (wl, wc, wg) = jsd_ref(&q64, &p64, lab, vocab, beta as f64, -100);
                for tier in cpu::available_tiers() {
                    let mut d = vec![E::from_f32(f32::NAN); q.len()];
                    let (l, c) =
                        jsd_fwd_in(pool::global(), tier, &q, &p, lab, vocab, beta, -100, &mut d)
                            .unwrap();
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
            let (_, _, g) = jsd_ref(&q, &p, Some(&[0, 3]), 5, beta, -100);
            for k in 0..q.len() {
                let (mut a, mut b) = (q.clone(), q.clone());
                a[k] += 1e-6;
                b[k] -= 1e-6;
                let fd = (jsd_ref(&a, &p, Some(&[0, 3]), 5, beta, -100).0
                    - jsd_ref(&b, &p, Some(&[0, 3]), 5, beta, -100).0)
                    / 2e-6;
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
        let (l, _) = jsd_fwd(&q, &q, None, 2, 0.5, -100, &mut d).unwrap();
        assert!(l.abs() < 1e-7);
        let (l, _) = jsd_fwd(&q, &p, None, 2, 0.0, -100, &mut d).unwrap();
        let want = 0.5 * (0.5f32 / 0.25).ln() + 0.5 * (0.5f32 / 0.75).ln();
        assert!((l - want).abs() < 1e-6);
        let (l, c) = jsd_fwd(&q, &p, Some(&[-100]), 2, 0.5, -100, &mut d).unwrap();
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
                let (wel, wl) = kl_div_ref(&x64, &t64, vocab, log_target, red);
                for tier in cpu::available_tiers() {
                    let mut el = vec![E::from_f32(f32::NAN); x.len()];
                    let l = kl_div_fwd_in(
                        pool::global(),
                        tier,
                        &x,
                        &t,
                        vocab,
                        log_target,
                        red,
                        &mut el,
                    )
                    .unwrap();
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
                kl_div_bwd(&t, log_target, red, vocab, 0.7, g, &mut d).unwrap();
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
        let run = |pool: &ThreadPool| {
            let mut d = vec![0f32; q.len()];
            let (l, _) =
                jsd_fwd_in(pool, cpu::tier(), &q, &p, None, vocab, 0.3, -100, &mut d).unwrap();
            let mut el = vec![0f32; q.len()];
            let k = kl_div_fwd_in(
                pool,
                cpu::tier(),
                &q,
                &p,
                vocab,
                true,
                KlReduction::None,
                &mut el,
            )
            .unwrap();
            (l.to_bits(), d, k.to_bits(), el)
        };
        assert_eq!(
            run(&ThreadPool::new(1).unwrap()),
            run(&ThreadPool::new(3).unwrap())
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        let x = [0f32; 6];
        let mut d = [0f32; 6];
        assert!(jsd_fwd(&x, &x, None, 4, 0.5, -100, &mut d).is_err());
        assert!(jsd_fwd(&x, &x, None, 0, 0.5, -100, &mut d).is_err());
        assert!(jsd_fwd(&x, &x[..3], None, 3, 0.5, -100, &mut d).is_err());
        assert!(jsd_fwd(&x, &x, None, 3, 1.5, -100, &mut d).is_err());
        assert!(jsd_fwd(&x, &x, Some(&[0]), 3, 0.5, -100, &mut d).is_err());
        assert!(kl_div_fwd(&x, &x, 3, false, KlReduction::None, &mut d[..5]).is_err());
        assert!(kl_div_fwd(&x, &x, 3, false, KlReduction::Sum, &mut []).is_ok());
        assert!(kl_div_bwd(&x, false, KlReduction::Sum, 3, 1.0, Some(&x[..2]), &mut d).is_err());
        assert!(kl_div_bwd(&x, false, KlReduction::Sum, 4, 1.0, None, &mut d).is_err());
    }
}
