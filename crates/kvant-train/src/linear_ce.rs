//! Fused linear cross-entropy and fused linear JSD (Liger's
//! `LigerFusedLinearCrossEntropy` / `LigerFusedLinearJSD`): the LM head's
//! product and the loss in row chunks, so the `[n, v]` logits never exist.
//!
//! Per chunk of rows `c`: `L_c = x_c·Wᵀ (+ b)` (f32, accumulated in f32
//! whatever the input type) → the cross-entropy row loop of
//! [`super::cross_entropy`] overwrites `L_c` with `G_c = ∂loss/∂L_c`
//! (times `row_scale`) → `dx_c = G_c·W`, `dW += G_cᵀ·x_c` (f32),
//! `db += Σ_rows G_c`. All gradients are made in the forward; for
//! reduction None, Python calls this again in backward with `row_scale` =
//! grad_output. The JSD variant does the same with two heads: student and
//! teacher logits divided by the temperature `T`, log-softmax, JSD with
//! `beta` (gradient `g` w.r.t. the student's log-probabilities), then back
//! through the log-softmax, `dz = (g − softmax·Σg)/T`, into the student's
//! `dx` and `dW` only.
//!
//! Chunks have fixed boundaries (from the shapes, see [`chunk_rows`]) and
//! `dW`/`db` are summed chunk by chunk in order, each GEMM element one
//! chain over `k` in order, so nothing depends on the thread count.
//!
//! The three products per chunk run on [`super::gemm`] (packed, register
//! tiled, bitwise independent of the thread count).

use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::error::{check_len, checked_mul};
use kvant_kernels::lanes::Lanes;
use kvant_kernels::pool::{self, DisjointSlice, ThreadPool};
#[cfg(target_arch = "x86_64")]
use kvant_kernels::vecops::Fused;
use kvant_kernels::vecops::{exp, Fma, Plain};
use kvant_kernels::KernelError;

use super::cross_entropy::{ce_rows, grad_scale, totals, CeArgs, CeRows, CeTotals, RowsIo};
use super::distill::{jsd_rows_in, JsdArgs, JsdIo};
use super::gemm::{gemm_in, GemmArgs, MatRef};
use super::Elem;

/// What [`linear_cross_entropy`] reads: the LM head, the cross-entropy's
/// targets and options, and the chunking.
#[derive(Clone, Copy, Debug)]
pub struct LinearCeArgs<'a, E> {
    /// `[n, hidden]`.
    pub x: &'a [E],
    /// `[vocab, hidden]`.
    pub w: &'a [E],
    /// `[vocab]`.
    pub bias: Option<&'a [E]>,
    pub hidden: usize,
    /// `n` targets, the vocabulary and the loss's options.
    pub ce: CeArgs<'a>,
    /// `[n]`: row i's gradient times `row_scale[i]`.
    pub row_scale: Option<&'a [f32]>,
    /// Rows per chunk; None: [`chunk_rows`].
    pub chunk: Option<usize>,
}

/// Gradients [`linear_cross_entropy`] writes.
pub struct LinearCeGrads<'a, E> {
    /// `[n, h]`.
    pub dx: &'a mut [E],
    /// `[v, h]`, overwritten.
    pub dw: &'a mut [f32],
    /// `[v]`, overwritten.
    pub dbias: Option<&'a mut [f32]>,
}

/// Most f32 values a chunk's logits hold: 64 MiB.
const CHUNK_CAP: usize = 16 << 20;
/// Fewest rows a chunk has (unless `n` is smaller). Measured at (n, h, v) =
/// (1024, 512, 32000), f32, forward and backward on one thread: 1.85 CPU-s
/// at 64-row chunks, 1.48 at 128, 1.29–1.32 at 256 to 1024 (torch eager
/// linear + cross-entropy: 1.50); below 256 rows packing `W` and reading and
/// writing `dW` once per chunk is what the GEMMs cannot hide. 256 rows of
/// f32 logits at v = 128256 are 131 MB.
const MIN_CHUNK_ROWS: usize = 256;

/// Rows per chunk: the chunk's f32 logits hold about `n·h` values (no more
/// than `x` itself, Liger's budget) or [`CHUNK_CAP`], whichever is smaller;
/// at (n, h, v) = (8192, 4096, 128256) that would be 130 rows (the floor
/// below makes it 256: 131 MB instead of 4.2 GB of logits). At least [`MIN_CHUNK_ROWS`] rows: every chunk streams
/// all of `W` three times (logits, `dx`, `dW`: `3·v·h` values for `6·c·v·h`
/// flops), so a chunk of `c` rows does `2c` flops per value of `W` read,
/// where Liger's budget alone gives 16 rows at (1024, 512, 32000), bound by
/// reading `W`.
pub fn chunk_rows(n: usize, h: usize, v: usize) -> usize {
    let budget = n.saturating_mul(h).min(CHUNK_CAP);
    (budget / v.max(1)).max(MIN_CHUNK_ROWS).min(n).max(1)
}

/// Fused linear cross-entropy: `x` `[n, h]` times `w` `[v, h]`ᵀ (+ `bias`
/// `[v]`) → cross-entropy per row as [`super::cross_entropy::cross_entropy_fwd`],
/// in row chunks ([`chunk_rows`]) so the `[n, v]` logits never exist.
/// With `grads`, `dx_c = G_c·W`, `dW = Σ G_cᵀ·x_c` (f32), `dbias = Σ G_c`
/// in the same pass; `row_scale` (`[n]`) multiplies row i's gradient.
pub fn linear_cross_entropy<E: Elem>(
    a: &LinearCeArgs<'_, E>,
    losses: &mut [f32],
    mut grads: Option<LinearCeGrads<'_, E>>,
) -> Result<CeTotals, KernelError> {
    const OP: &str = "linear_cross_entropy";
    let LinearCeArgs {
        x,
        w,
        bias,
        hidden: h,
        ce,
        row_scale,
        chunk,
    } = *a;
    let (n, v, o) = (ce.targets.len(), ce.vocab, ce.options);
    let chunk = chunk.unwrap_or_else(|| chunk_rows(n, h, v));
    if v == 0 || chunk == 0 {
        return Err(KernelError::InvalidShape {
            op: OP,
            why: format!("vocab {v} and chunk rows {chunk} must be positive"),
        });
    }
    check_len("linear-ce x", checked_mul(OP, n, h)?, x.len())?;
    check_len("linear-ce w", checked_mul(OP, v, h)?, w.len())?;
    checked_mul(OP, chunk.min(n.max(1)), v)?;
    if let Some(b) = bias {
        check_len("linear-ce bias", v, b.len())?;
    }
    check_len("linear-ce losses", n, losses.len())?;
    if let Some(r) = row_scale {
        check_len("linear-ce row_scale", n, r.len())?;
    }
    if let Some(g) = &grads {
        check_len("linear-ce dx", n * h, g.dx.len())?;
        check_len("linear-ce dw", v * h, g.dw.len())?;
        if let Some(db) = &g.dbias {
            check_len("linear-ce dbias", v, db.len())?;
        }
    }
    let (p, counted) = ce.prepare()?;
    let job = CeRows {
        targets: ce.targets,
        vocab: v,
        p,
        grad: grads.is_some().then(|| grad_scale(o.reduction, counted)),
        row_scale,
    };
    let (pool, tier) = (pool::global(), cpu::tier());
    let chunk = chunk.min(n.max(1));
    let mut logits = vec![0f32; chunk * v];
    let mut dxc = vec![0f32; if grads.is_some() { chunk * h } else { 0 }];
    // bf16 inputs: the chunk's gradient rounded to bf16 once (what torch's
    // bf16 linear backward multiplies), so dX and dW run on the bf16
    // kernel (`vdpbf16ps`, twice the f32 rate) instead of widening W.
    let mut gbuf = vec![
        E::from_f32(0.0);
        if grads.is_some() && !E::F32 {
            chunk * v
        } else {
            0
        }
    ];
    let mut zs = vec![0f32; n];
    if let Some(g) = grads.as_mut() {
        g.dw.fill(0.0);
        if let Some(db) = g.dbias.as_deref_mut() {
            db.fill(0.0);
        }
    }
    let wm = MatRef::row_major(w, v, h)?;
    for c0 in (0..n).step_by(chunk) {
        let c1 = (c0 + chunk).min(n);
        let cr = c1 - c0;
        let lg = &mut logits[..cr * v];
        let xc = MatRef::row_major(&x[c0 * h..c1 * h], cr, h)?;
        let beta = match bias {
            Some(b) => {
                fill_rows(pool, lg, v, b);
                1.0
            }
            None => 0.0,
        };
        gemm_in(pool, tier, GemmArgs::new(xc, wm.t(), lg, v).beta(beta))?;
        let (lc, zc) = (&mut losses[c0..c1], &mut zs[c0..c1]);
        ce_rows(pool, tier, RowsIo::InPlace(lg), &job.rows(c0..c1), lc, zc);
        if let Some(g) = grads.as_mut() {
            let dx = &mut dxc[..cr * h];
            if E::F32 {
                let gm = MatRef::row_major(&*lg, cr, v)?;
                grad_products(pool, tier, gm, (wm, xc), dx, g.dw)?;
            } else {
                let gb = &mut gbuf[..cr * v];
                round_into(pool, lg, gb);
                let gm = MatRef::row_major(&*gb, cr, v)?;
                grad_products(pool, tier, gm, (wm, xc), dx, g.dw)?;
            }
            for (d, s) in g.dx[c0 * h..c1 * h].iter_mut().zip(dx.iter()) {
                *d = E::from_f32(*s);
            }
            if let Some(db) = g.dbias.as_deref_mut() {
                for row in lg.chunks_exact(v) {
                    for (d, s) in db.iter_mut().zip(row) {
                        *d += s;
                    }
                }
            }
        }
    }
    Ok(totals(losses, &zs, counted, o.reduction))
}

/// A chunk's `dX = G·W` (overwritten) and `dW += Gᵀ·X`.
fn grad_products<G: Elem, E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    gm: MatRef<'_, G>,
    (wm, xc): (MatRef<'_, E>, MatRef<'_, E>),
    dx: &mut [f32],
    dw: &mut [f32],
) -> Result<(), KernelError> {
    let h = wm.cols();
    gemm_in(pool, tier, GemmArgs::new(gm, wm, dx, h))?;
    gemm_in(pool, tier, GemmArgs::new(gm.t(), xc, dw, h).beta(1.0))
}

/// `dst[i] = E::from_f32(src[i])`, in parallel.
fn round_into<E: Elem>(pool: &ThreadPool, src: &[f32], dst: &mut [E]) {
    const CHUNK: usize = 1 << 16;
    let d = DisjointSlice::new(dst);
    pool.run(src.len().div_ceil(CHUNK), &|t| {
        let r = t * CHUNK..((t + 1) * CHUNK).min(src.len());
        // SAFETY: task `t` alone owns elements `r`.
        let out = unsafe { d.range(r.clone()) };
        for (o, &v) in out.iter_mut().zip(&src[r]) {
            *o = E::from_f32(v);
        }
    });
}

/// Every row of `rows` (`width` each) set to `src` widened, in parallel.
fn fill_rows<E: Lanes>(pool: &ThreadPool, rows: &mut [f32], width: usize, src: &[E]) {
    let n = rows.len() / width;
    let tasks = n.min(pool.threads() * 4).max(1);
    let d = DisjointSlice::new(rows);
    pool.run(tasks, &|t| {
        let r = pool::chunk(n, tasks, 1, t);
        // SAFETY: task `t` alone owns rows `r` (`chunk` ranges are disjoint).
        let out = unsafe { d.range(r.start * width..r.end * width) };
        for row in out.chunks_exact_mut(width) {
            for (o, s) in row.iter_mut().zip(src) {
                *o = s.to_f32();
            }
        }
    });
}

#[inline(always)]
fn log_softmax_body<F: Fma>(rows: &mut [f32], v: usize, inv_t: f32) {
    for row in rows.chunks_exact_mut(v) {
        let mut m = f32::NEG_INFINITY;
        for z in row.iter_mut() {
            *z *= inv_t;
            m = if *z > m { *z } else { m };
        }
        let mut l = [0f32; 8];
        let mut it = row.chunks_exact(8);
        for c in &mut it {
            for (a, &z) in l.iter_mut().zip(c) {
                *a += exp::<F>(z - m);
            }
        }
        let mut s: f32 = l.iter().sum();
        for &z in it.remainder() {
            s += exp::<F>(z - m);
        }
        let lse = m + s.ln();
        row.iter_mut().for_each(|z| *z -= lse);
    }
}

/// `dz = (g − e^{log q}·Σg)/T` in place of `g`, row by row.
#[inline(always)]
fn softmax_back_body<F: Fma>(g: &mut [f32], logq: &[f32], v: usize, inv_t: f32) {
    for (gr, lr) in g.chunks_exact_mut(v).zip(logq.chunks_exact(v)) {
        let s: f32 = gr.iter().sum();
        for (gv, &l) in gr.iter_mut().zip(lr) {
            *gv = (*gv - exp::<F>(l) * s) * inv_t;
        }
    }
}

kvant_kernels::per_tier! {
    /// [`log_softmax_body`] on `tier`.
    fn log_softmax_on(
        tier: SimdTier,
        rows: &mut [f32],
        v: usize,
        inv_t: f32,
    ) [F = Plain, Fused] {
        log_softmax_body::<F>(rows, v, inv_t)
    }
}

kvant_kernels::per_tier! {
    /// [`softmax_back_body`] on `tier`.
    fn softmax_back_on(
        tier: SimdTier,
        g: &mut [f32],
        logq: &[f32],
        v: usize,
        inv_t: f32,
    ) [F = Plain, Fused] {
        softmax_back_body::<F>(g, logq, v, inv_t)
    }
}

/// Rows of `a` (and of `b`, the same shape) in parallel.
fn par_rows(
    pool: &ThreadPool,
    a: &mut [f32],
    b: &[f32],
    v: usize,
    f: &(dyn Fn(&mut [f32], &[f32]) + Sync),
) {
    let n = a.len() / v;
    let tasks = n.min(pool.threads() * 4).max(1);
    let d = DisjointSlice::new(a);
    pool.run(tasks, &|t| {
        let r = pool::chunk(n, tasks, 1, t);
        let e = r.start * v..r.end * v;
        // SAFETY: task `t` alone owns rows `r` (`chunk` ranges are disjoint).
        let out = unsafe { d.range(e.clone()) };
        f(out, if b.is_empty() { b } else { &b[e] });
    });
}

/// What [`linear_jsd`] reads: the student's and the teacher's LM heads,
/// the JSD's labels, vocabulary and `beta`, the temperature and the
/// chunking.
#[derive(Clone, Copy, Debug)]
pub struct LinearJsdArgs<'a, E> {
    /// Student `[n, hs]` and its head `[vocab, hs]`.
    pub x_s: &'a [E],
    pub w_s: &'a [E],
    /// Teacher `[n, ht]` and its head `[vocab, ht]`.
    pub x_t: &'a [E],
    pub w_t: &'a [E],
    pub hs: usize,
    pub ht: usize,
    pub jsd: JsdArgs<'a>,
    /// Both heads' logits are divided by it; positive.
    pub temperature: f32,
    /// Rows per chunk; None: [`chunk_rows`].
    pub chunk: Option<usize>,
}

/// Fused linear JSD for distillation (Liger's `LigerFusedLinearJSD`):
/// student `x_s` `[n, hs]`·`w_s` `[v, hs]`ᵀ and teacher `x_t` `[n, ht]`·
/// `w_t` `[v, ht]`ᵀ, both divided by `temperature`, log-softmax, JSD with
/// `beta` as [`super::distill::jsd_fwd`] (labels/ignore_index), chunked as
/// [`linear_cross_entropy`]; gradients for the student only (`dx_s`
/// `[n, hs]`, `dw_s` `[v, hs]` f32, overwritten). Returns `(loss, counted)`.
pub fn linear_jsd<E: Elem>(
    a: &LinearJsdArgs<'_, E>,
    mut dx_s: Option<&mut [E]>,
    mut dw_s: Option<&mut [f32]>,
) -> Result<(f32, usize), KernelError> {
    const OP: &str = "linear_jsd";
    let LinearJsdArgs {
        x_s,
        w_s,
        x_t,
        w_t,
        hs,
        ht,
        jsd,
        temperature,
        chunk,
    } = *a;
    let v = jsd.vocab;
    let chunk = chunk.unwrap_or_else(|| chunk_rows(x_s.len() / hs.max(1), hs.max(ht), v));
    let bad = |why: String| KernelError::InvalidShape { op: OP, why };
    if v == 0 || hs == 0 || ht == 0 || chunk == 0 {
        return Err(bad(format!(
            "vocab {v}, hidden sizes {hs}/{ht} and chunk rows {chunk} must be positive"
        )));
    }
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(bad(format!("temperature {temperature} is not positive")));
    }
    if !x_s.len().is_multiple_of(hs) {
        return Err(bad(format!("{} values are not rows of {hs}", x_s.len())));
    }
    let n = x_s.len() / hs;
    check_len("linear-jsd x_t", checked_mul(OP, n, ht)?, x_t.len())?;
    check_len("linear-jsd w_s", checked_mul(OP, v, hs)?, w_s.len())?;
    check_len("linear-jsd w_t", checked_mul(OP, v, ht)?, w_t.len())?;
    checked_mul(OP, chunk.min(n.max(1)), v)?;
    if let Some(d) = &dx_s {
        check_len("linear-jsd dx_s", n * hs, d.len())?;
    }
    if let Some(d) = &dw_s {
        check_len("linear-jsd dw_s", v * hs, d.len())?;
    }
    let job = jsd.prepare((OP, "linear-jsd labels"), n)?;
    let want = dx_s.is_some() || dw_s.is_some();
    let (pool, tier) = (pool::global(), cpu::tier());
    let tier = cpu::clamp(tier);
    let chunk = chunk.min(n.max(1));
    let inv_t = 1.0 / temperature;
    let mut s_buf = vec![0f32; chunk * v];
    let mut t_buf = vec![0f32; chunk * v];
    let mut g_buf = vec![0f32; chunk * v];
    let mut dxc = vec![0f32; if dx_s.is_some() { chunk * hs } else { 0 }];
    let mut sums = vec![0f32; n];
    if let Some(d) = dw_s.as_deref_mut() {
        d.fill(0.0);
    }
    let lsm = |r: &mut [f32], _: &[f32]| log_softmax_on(tier, r, v, inv_t);
    let back = |g: &mut [f32], l: &[f32]| softmax_back_on(tier, g, l, v, inv_t);
    let ws = MatRef::row_major(w_s, v, hs)?;
    let wt = MatRef::row_major(w_t, v, ht)?;
    for c0 in (0..n).step_by(chunk) {
        let c1 = (c0 + chunk).min(n);
        let cr = c1 - c0;
        let (sb, tb, gb) = (
            &mut s_buf[..cr * v],
            &mut t_buf[..cr * v],
            &mut g_buf[..cr * v],
        );
        let xs = MatRef::row_major(&x_s[c0 * hs..c1 * hs], cr, hs)?;
        let xt = MatRef::row_major(&x_t[c0 * ht..c1 * ht], cr, ht)?;
        gemm_in(pool, tier, GemmArgs::new(xs, ws.t(), sb, v))?;
        gemm_in(pool, tier, GemmArgs::new(xt, wt.t(), tb, v))?;
        par_rows(pool, sb, &[], v, &lsm);
        par_rows(pool, tb, &[], v, &lsm);
        let io = JsdIo {
            x: sb,
            y: tb,
            dx: gb,
            sums: &mut sums[c0..c1],
        };
        jsd_rows_in(pool, tier, &job.rows(c0..c1), io);
        if want {
            par_rows(pool, gb, sb, v, &back);
            let gm = MatRef::row_major(&*gb, cr, v)?;
            if let Some(d) = dx_s.as_deref_mut() {
                let dx = &mut dxc[..cr * hs];
                gemm_in(pool, tier, GemmArgs::new(gm, ws, dx, hs))?;
                for (o, s) in d[c0 * hs..c1 * hs].iter_mut().zip(dx.iter()) {
                    *o = E::from_f32(*s);
                }
            }
            if let Some(d) = dw_s.as_deref_mut() {
                gemm_in(pool, tier, GemmArgs::new(gm.t(), xs, d, hs).beta(1.0))?;
            }
        }
    }
    let total: f64 = sums.iter().map(|&s| s as f64).sum();
    Ok(((total * job.scale as f64) as f32, job.counted))
}

#[cfg(test)]
mod tests {
    use super::super::cross_entropy::tests::same_on_1_and_3_threads;
    use super::super::cross_entropy::{cross_entropy_ref, CeOptions};
    use super::super::distill::jsd_ref;
    use super::super::Reduction;
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_vec<E: Elem>(rng: &mut ChaCha8Rng, len: usize, s: f32) -> (Vec<E>, Vec<f64>) {
        let e: Vec<E> = (0..len)
            .map(|_| E::from_f32(rng.random_range(-s..s)))
            .collect();
        let d = e.iter().map(|v| v.to_f32() as f64).collect();
        (e, d)
    }

    /// `a` `[m, k]` · `b` `[n, k]`ᵀ in f64.
    fn mm_bt(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|q| a[i * k + q] * b[j * k + q]).sum();
            }
        }
        c
    }

    /// `dx = G·W`, `dW = Gᵀ·x` in f64.
    fn back(g: &[f64], w: &[f64], x: &[f64], n: usize, h: usize, v: usize) -> (Vec<f64>, Vec<f64>) {
        let mut dx = vec![0.0; n * h];
        let mut dw = vec![0.0; v * h];
        for i in 0..n {
            for j in 0..v {
                let gv = g[i * v + j];
                for q in 0..h {
                    dx[i * h + q] += gv * w[j * h + q];
                    dw[j * h + q] += gv * x[i * h + q];
                }
            }
        }
        (dx, dw)
    }

    /// dx and dW against f64, within the tolerances [`check`] explains.
    fn close_grads<E: Elem>(what: &str, (dx, dw): (&[E], &[f32]), (wdx, wdw): (&[f64], &[f64])) {
        let dx_tol = if E::F32 { 1e-4 } else { 1e-2 };
        let dw_tol = if E::F32 { 1e-4 } else { 1.0 / 256.0 };
        close(
            what,
            dx.iter().map(|v| v.to_f32() as f64),
            wdx,
            dx_tol,
            1e-7,
        );
        close(what, dw.iter().map(|&v| v as f64), wdw, dw_tol, 1e-7);
    }

    /// `|got − want| ≤ atol + rtol·max|want|` elementwise.
    fn close(what: &str, got: impl Iterator<Item = f64>, want: &[f64], rtol: f64, atol: f64) {
        let m = want.iter().fold(0f64, |a, &b| a.max(b.abs()));
        for (k, (g, &w)) in got.zip(want).enumerate() {
            assert!(
                (g - w).abs() <= atol + rtol * m,
                "{what} [{k}]: {g} vs {w} (max {m})"
            );
        }
    }

    /// Against `cross_entropy_ref` on f64 logits of the same (rounded)
    /// inputs. The f32 GEMMs (sums over h ≤ 64 of products ≤ 1) and the
    /// f32 loss give losses within 1e-4 relative; gradients within 1e-4 of
    /// their largest magnitude (f32: GEMM rounding over v ≤ 1000 terms);
    /// bf16 dx is rounded once more (2^-8 of its magnitude), and with bf16
    /// inputs the gradient of the logits is rounded to bf16 before both
    /// products (as torch's bf16 backward multiplies it), so dW sits within
    /// 2^-8 of its largest magnitude.
    fn check<E: Elem>(n: usize, h: usize, v: usize, chunk: usize, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (x, x64) = rand_vec::<E>(&mut rng, n * h, 1.0);
        let (w, w64) = rand_vec::<E>(&mut rng, v * h, 0.5);
        let (b, b64) = rand_vec::<E>(&mut rng, v, 1.0);
        let t: Vec<i64> = (0..n)
            .map(|_| {
                if rng.random_bool(0.5) {
                    -100
                } else {
                    rng.random_range(0..v as i64)
                }
            })
            .collect();
        let rs: Vec<f32> = (0..n).map(|_| rng.random_range(0.5..2.0)).collect();
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            for (with_bias, opts) in [(false, 0), (true, 1)] {
                let o = if opts == 0 {
                    CeOptions {
                        reduction,
                        ..Default::default()
                    }
                } else {
                    CeOptions {
                        ignore_index: -100,
                        label_smoothing: 0.1,
                        z_loss: 1e-4,
                        softcap: Some(30.0),
                        reduction,
                    }
                };
                let use_rs = reduction == Reduction::None;
                let mut logits = mm_bt(&x64, &w64, n, h, v);
                if with_bias {
                    for r in logits.chunks_exact_mut(v) {
                        r.iter_mut().zip(&b64).for_each(|(l, b)| *l += b);
                    }
                }
                let ce = CeArgs {
                    targets: &t,
                    vocab: v,
                    options: o,
                };
                let want = cross_entropy_ref(&ce, &logits).unwrap();
                let mut g = want.grad.clone();
                if use_rs {
                    for (i, r) in g.chunks_exact_mut(v).enumerate() {
                        r.iter_mut().for_each(|e| *e *= rs[i] as f64);
                    }
                }
                let (wdx, wdw) = back(&g, &w64, &x64, n, h, v);
                let wdb: Vec<f64> = (0..v).map(|j| (0..n).map(|i| g[i * v + j]).sum()).collect();
                let mut losses = vec![f32::NAN; n];
                let mut dx = vec![E::from_f32(f32::NAN); n * h];
                let mut dw = vec![f32::NAN; v * h];
                let mut db = vec![f32::NAN; v];
                let a = LinearCeArgs {
                    x: &x,
                    w: &w,
                    bias: with_bias.then_some(&b[..]),
                    hidden: h,
                    ce,
                    row_scale: use_rs.then_some(&rs[..]),
                    chunk: Some(chunk),
                };
                let grads = LinearCeGrads {
                    dx: &mut dx,
                    dw: &mut dw,
                    dbias: Some(&mut db),
                };
                let tot = linear_cross_entropy(&a, &mut losses, Some(grads)).unwrap();
                let what = format!("n {n} h {h} v {v} chunk {chunk} {o:?} bias {with_bias}");
                assert_eq!(tot.counted, want.counted);
                close(
                    &what,
                    losses.iter().map(|&l| l as f64),
                    &want.losses,
                    1e-4,
                    1e-5,
                );
                if want.counted > 0 {
                    assert!((tot.loss as f64 - want.loss).abs() <= 1e-4 * want.loss.abs().max(1.0));
                }
                close_grads(&what, (&dx, &dw), (&wdx, &wdw));
                close(&what, db.iter().map(|&v| v as f64), &wdb, 1e-4, 1e-7);
                // Loss only: the same losses, nothing else touched.
                let mut l2 = vec![f32::NAN; n];
                let a = LinearCeArgs {
                    row_scale: None,
                    ..a
                };
                let tot2 = linear_cross_entropy(&a, &mut l2, None).unwrap();
                assert_eq!(l2, losses);
                assert_eq!(tot2.loss.to_bits(), tot.loss.to_bits());
            }
        }
    }

    #[test]
    fn matches_cross_entropy_of_explicit_logits() {
        for (i, &(n, h, v, chunk)) in [
            (1, 1, 1, 1),
            (7, 31, 123, 3),
            (47, 31, 123, 16),
            (130, 64, 1000, 48),
        ]
        .iter()
        .enumerate()
        {
            check::<f32>(n, h, v, chunk, i as u64);
            check::<bf16>(n, h, v, chunk, 10 + i as u64);
        }
        // The default chunking too.
        check::<f32>(47, 31, 123, chunk_rows(47, 31, 123), 99);
    }

    #[test]
    fn chunk_rows_follow_the_budget() {
        assert_eq!(chunk_rows(8192, 4096, 128_256), 256);
        assert_eq!(chunk_rows(1024, 512, 32000), 256);
        assert_eq!(chunk_rows(4096, 4096, 32000), 524);
        assert_eq!(chunk_rows(7, 31, 123), 7);
        assert_eq!(chunk_rows(0, 31, 123), 1);
    }

    /// f64 reference of the fused linear JSD: `(loss, dx_s, dw_s)`.
    fn jsd_linear_ref(a: &LinearJsdArgs<'_, f64>) -> (f64, Vec<f64>, Vec<f64>) {
        let LinearJsdArgs {
            x_s: xs,
            w_s: ws,
            x_t: xt,
            w_t: wt,
            hs,
            ht,
            jsd,
            ..
        } = *a;
        let (n, v, temp) = (xs.len() / hs, jsd.vocab, a.temperature as f64);
        let lsm = |z: Vec<f64>| -> Vec<f64> {
            let mut out = Vec::with_capacity(z.len());
            for r in z.chunks_exact(v) {
                let r: Vec<f64> = r.iter().map(|a| a / temp).collect();
                let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + r.iter().map(|a| (a - m).exp()).sum::<f64>().ln();
                out.extend(r.iter().map(|a| a - lse));
            }
            out
        };
        let lq = lsm(mm_bt(xs, ws, n, hs, v));
        let lp = lsm(mm_bt(xt, wt, n, ht, v));
        let (loss, _, g) = jsd_ref(&jsd, &lq, &lp).unwrap();
        let mut dz = g.clone();
        for (r, l) in dz.chunks_exact_mut(v).zip(lq.chunks_exact(v)) {
            let s: f64 = r.iter().sum();
            for (a, &lv) in r.iter_mut().zip(l) {
                *a = (*a - lv.exp() * s) / temp;
            }
        }
        let (dx, dw) = back(&dz, ws, xs, n, hs, v);
        (loss, dx, dw)
    }

    fn check_jsd<E: Elem>(n: usize, hs: usize, ht: usize, v: usize, chunk: usize, seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (xs, xs64) = rand_vec::<E>(&mut rng, n * hs, 1.0);
        let (ws, ws64) = rand_vec::<E>(&mut rng, v * hs, 0.5);
        let (xt, xt64) = rand_vec::<E>(&mut rng, n * ht, 1.0);
        let (wt, wt64) = rand_vec::<E>(&mut rng, v * ht, 0.5);
        let labels: Vec<i64> = (0..n)
            .map(|_| if rng.random_bool(0.5) { -100 } else { 0 })
            .collect();
        for beta in [0.0f32, 0.5, 1.0] {
            for lab in [None, Some(&labels[..])] {
                let jsd = JsdArgs {
                    labels: lab,
                    vocab: v,
                    beta,
                    ignore_index: -100,
                };
                let (temperature, chunk) = (2.0f32, Some(chunk));
                let (wl, wdx, wdw) = jsd_linear_ref(&LinearJsdArgs {
                    x_s: &xs64,
                    w_s: &ws64,
                    x_t: &xt64,
                    w_t: &wt64,
                    hs,
                    ht,
                    jsd,
                    temperature,
                    chunk,
                });
                let a = LinearJsdArgs {
                    x_s: &xs,
                    w_s: &ws,
                    x_t: &xt,
                    w_t: &wt,
                    hs,
                    ht,
                    jsd,
                    temperature,
                    chunk,
                };
                let mut dx = vec![E::from_f32(f32::NAN); n * hs];
                let mut dw = vec![f32::NAN; v * hs];
                let (l, _) = linear_jsd(&a, Some(&mut dx), Some(&mut dw)).unwrap();
                let what = format!("jsd n {n} v {v} beta {beta}");
                assert!(
                    (l as f64 - wl).abs() <= 1e-6 + 1e-4 * wl.abs(),
                    "{what}: {l} vs {wl}"
                );
                close_grads(&what, (&dx, &dw), (&wdx, &wdw));
            }
        }
    }

    #[test]
    fn linear_jsd_matches_the_reference() {
        for (i, &(n, hs, ht, v, chunk)) in
            [(1, 1, 1, 2, 1), (7, 31, 17, 123, 3), (47, 31, 40, 123, 16)]
                .iter()
                .enumerate()
        {
            check_jsd::<f32>(n, hs, ht, v, chunk, 40 + i as u64);
            check_jsd::<bf16>(n, hs, ht, v, chunk, 50 + i as u64);
        }
    }

    #[test]
    fn thread_count_does_not_change_the_gemm() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (a, _) = rand_vec::<f32>(&mut rng, 37 * 29, 1.0);
        let (b, _) = rand_vec::<f32>(&mut rng, 41 * 29, 1.0);
        same_on_1_and_3_threads(|pool| {
            let mut c = vec![0f32; 37 * 41];
            let am = MatRef::row_major(&a[..], 37, 29).unwrap();
            let bm = MatRef::row_major(&b[..], 41, 29).unwrap();
            gemm_in(pool, cpu::tier(), GemmArgs::new(am, bm.t(), &mut c, 41)).unwrap();
            let mut d = vec![0f32; 29 * 29];
            gemm_in(pool, cpu::tier(), GemmArgs::new(am.t(), am, &mut d, 29)).unwrap();
            (c, d)
        });
    }

    #[test]
    fn bad_arguments_are_errors() {
        let x = [0f32; 6];
        let w = [0f32; 9];
        let mut l = [0f32; 2];
        let call = |targets: &[i64], hidden, vocab, l: &mut [f32]| {
            let ce = CeArgs {
                targets,
                vocab,
                options: CeOptions::default(),
            };
            let a = LinearCeArgs {
                x: &x,
                w: &w,
                bias: None,
                hidden,
                ce,
                row_scale: None,
                chunk: None,
            };
            linear_cross_entropy(&a, l, None)
        };
        assert!(call(&[0, 1], 3, 3, &mut l).is_ok());
        assert!(call(&[0, 3], 3, 3, &mut l).is_err());
        assert!(call(&[0, 1], 2, 3, &mut l).is_err());
        assert!(call(&[0, 1], 3, 0, &mut l).is_err());
        assert!(call(&[0], 3, 3, &mut l[..1]).is_err());
        assert!(call(&[0, 1], 3, 3, &mut l[..1]).is_err());
        let mut dx = [0f32; 5];
        let mut dw = [0f32; 9];
        let g = LinearCeGrads {
            dx: &mut dx,
            dw: &mut dw,
            dbias: None,
        };
        let a = LinearCeArgs {
            x: &x,
            w: &w,
            bias: None,
            hidden: 3,
            ce: CeArgs {
                targets: &[0, 1],
                vocab: 3,
                options: CeOptions::default(),
            },
            row_scale: None,
            chunk: None,
        };
        assert!(linear_cross_entropy(&a, &mut l, Some(g)).is_err());
        let mut d = [0f32; 6];
        let jsd = JsdArgs {
            labels: None,
            vocab: 3,
            beta: 0.5,
            ignore_index: -100,
        };
        let ok = LinearJsdArgs {
            x_s: &x,
            w_s: &w,
            x_t: &x,
            w_t: &w,
            hs: 3,
            ht: 3,
            jsd,
            temperature: 1.0,
            chunk: None,
        };
        let cold = LinearJsdArgs {
            temperature: 0.0,
            ..ok
        };
        assert!(linear_jsd(&cold, Some(&mut d), None).is_err());
        let beta = LinearJsdArgs {
            jsd: JsdArgs { beta: 1.5, ..jsd },
            ..ok
        };
        assert!(linear_jsd(&beta, None, None).is_err());
        let short = LinearJsdArgs { w_t: &w[..6], ..ok };
        assert!(linear_jsd(&short, None, None).is_err());
        let labels = LinearJsdArgs {
            jsd: JsdArgs {
                labels: Some(&[0]),
                ..jsd
            },
            ..ok
        };
        assert!(linear_jsd(&labels, None, None).is_err());
        assert!(linear_jsd(&ok, Some(&mut d), None).is_ok());
    }
}
