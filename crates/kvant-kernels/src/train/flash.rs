//! FlashAttention-2 forward and backward for training: causal, grouped-query
//! heads, sliding windows; the forward saves only the log-sum-exp of each
//! query row and the backward recomputes the score tiles.
//!
//! Forward, per (batch, head, tile of [`BQ`] query rows), over tiles of
//! [`BK`] keys: `S = scale·Q·Kᵀ`, masked; the online softmax keeps a running
//! max `m` and sum `l` per row and rescales the output accumulator when `m`
//! grows; at the end `O = acc / l` and `lse = m + ln l`. Only the key tiles
//! a query tile can see are visited (causal and window bounds), so a
//! sliding window costs `q_len · window`, not `q_len · kv_len`.
//!
//! Backward, with `D_i = Σ dO_i·O_i` and `P = exp(S − lse)` recomputed:
//! `dV = Pᵀ·dO`, `dP = dO·Vᵀ`, `dS = P ∘ (dP − D)`, `dK = scale·dSᵀ·Q`,
//! `dQ = scale·dS·K`. The GPU kernel accumulates `dQ` with atomics across
//! key tiles; here two passes keep every gradient element the sum of one
//! task in a fixed order (bitwise the same for any thread count, run after
//! run): one pass over (batch, kv head, key tile) for `dK` and `dV` (all
//! query heads of the group, all query tiles, in order), one over (batch,
//! query head, query tile) for `dQ`. The score tiles are computed twice,
//! which costs 2 of the backward's 9 multiply-adds per (query, key, dim).
//!
//! Products run as rows of axpys over transposed tiles (`s_row += q_d ·
//! Kᵀ[d]`), which LLVM vectorizes 8 (AVX2) or 16 (AVX-512) wide without
//! reassociating a float reduction; bf16 tiles are widened once per tile
//! into f32 scratch. Layouts are torch's SDPA ones: `[batch, heads, seq,
//! dim]`, contiguous.

use crate::cpu::{self, SimdTier};
use crate::error::{check_len, checked_mul, KernelError};
use crate::pool::{self, DisjointSlice};
use crate::train::Elem;
#[cfg(target_arch = "x86_64")]
use crate::vecops::Fused;
use crate::vecops::{exp, Fma, Plain};

/// Query rows per tile: a tile's rows share each widened key tile.
const BQ: usize = 32;
/// Keys per tile: a score row of 64 f32 is 8 AVX2 or 4 AVX-512 registers.
const BK: usize = 64;

#[derive(Clone, Copy, Debug)]
pub struct FlashShape {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
    pub v_dim: usize,
    pub scale: f32,
    /// Query i sees key j only if j <= i + (kv_len - q_len) (bottom-right
    /// aligned, as flash-attn >= 2.1; torch's `is_causal` when the lengths
    /// are equal).
    pub causal: bool,
    /// Sliding window: with d = i + (kv_len - q_len) - j, key j is seen
    /// only if d < window (Hugging Face / Mistral); without `causal` also
    /// -d < window (a symmetric band, flash-attn's `(w-1, w-1)`).
    pub window: Option<usize>,
}

/// Element counts of the tensors of one call.
struct Lens {
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    lse: usize,
}

impl FlashShape {
    fn check(&self, op: &'static str) -> Result<Lens, KernelError> {
        let bad = |why: String| KernelError::InvalidShape { op, why };
        if self.kv_heads == 0 || !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.q_heads, self.kv_heads
            )));
        }
        if self.window == Some(0) {
            return Err(bad("a sliding window must hold at least one key".into()));
        }
        if !self.scale.is_finite() {
            return Err(bad(format!("scale {} is not finite", self.scale)));
        }
        let rows = |heads: usize, len: usize, dim: usize| {
            checked_mul(op, self.batch, heads)
                .and_then(|n| checked_mul(op, n, len))
                .and_then(|n| checked_mul(op, n, dim))
        };
        Ok(Lens {
            q: rows(self.q_heads, self.q_len, self.head_dim)?,
            k: rows(self.kv_heads, self.kv_len, self.head_dim)?,
            v: rows(self.kv_heads, self.kv_len, self.v_dim)?,
            o: rows(self.q_heads, self.q_len, self.v_dim)?,
            lse: rows(self.q_heads, self.q_len, 1)?,
        })
    }

    /// The keys query row `i` sees: `lo..hi` (empty when none).
    fn keys(&self, i: usize) -> (usize, usize) {
        let p = i as i64 + self.kv_len as i64 - self.q_len as i64;
        let (mut lo, mut hi) = (0i64, self.kv_len as i64);
        if self.causal {
            hi = hi.min(p + 1);
        }
        if let Some(w) = self.window {
            let w = w as i64;
            lo = lo.max(p - w + 1);
            if !self.causal {
                hi = hi.min(p + w);
            }
        }
        let lo = lo.clamp(0, self.kv_len as i64) as usize;
        let hi = hi.clamp(0, self.kv_len as i64) as usize;
        (lo, hi.max(lo))
    }

    /// The keys any row of `i0..i1` sees (row bounds grow with `i`).
    fn tile_keys(&self, i0: usize, i1: usize) -> (usize, usize) {
        let (lo, _) = self.keys(i0);
        let (_, hi) = self.keys(i1 - 1);
        (lo, hi.max(lo))
    }

    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    fn q_tiles(&self) -> usize {
        self.q_len.div_ceil(BQ)
    }
}

/// Widens rows `r0..r0+n` of a `[rows, dim]` block at `base` into `dst`
/// (`n × dim`, row-major), optionally times `scale`.
#[inline(always)]
fn widen<E: Elem>(src: &[E], base: usize, dim: usize, n: usize, scale: f32, dst: &mut [f32]) {
    for (d, s) in dst[..n * dim].iter_mut().zip(&src[base..base + n * dim]) {
        *d = s.to_f32() * scale;
    }
}

/// Widens `n` rows of `dim` values at `base` transposed: `dst[c·BK + r]`.
#[inline(always)]
fn widen_t<E: Elem>(src: &[E], base: usize, dim: usize, n: usize, dst: &mut [f32]) {
    for r in 0..n {
        let row = &src[base + r * dim..base + (r + 1) * dim];
        for (c, v) in row.iter().enumerate() {
            dst[c * BK + r] = v.to_f32();
        }
    }
}

/// `s[..n] = Σ_c a[c] · t[c·BK..][..n]`: a row of `A·B` with `B` transposed.
#[inline(always)]
fn row_times_t<F: Fma>(a: &[f32], t: &[f32], n: usize, s: &mut [f32]) {
    let s = &mut s[..n];
    s.fill(0.0);
    for (c, &ac) in a.iter().enumerate() {
        let tc = &t[c * BK..c * BK + n];
        for (x, &y) in s.iter_mut().zip(tc) {
            *x = F::fma(ac, y, *x);
        }
    }
}

/// `y += a · x`.
#[inline(always)]
fn axpy<F: Fma>(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = F::fma(a, x, *y);
    }
}

/// The max of `s`, eight lanes at a time (a serial fold would stay scalar).
#[inline(always)]
fn max8(s: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    let mut m = lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for &v in chunks.remainder() {
        m = m.max(v);
    }
    m
}

/// `s[j] = exp(s[j] − m)` (0 where `s[j]` is -inf) and their sum.
#[inline(always)]
fn exp_sum<F: Fma>(s: &mut [f32], m: f32) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        for (v, l) in c.iter_mut().zip(lanes.iter_mut()) {
            *v = exp::<F>(*v - m);
            *l += *v;
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for v in chunks.into_remainder() {
        *v = exp::<F>(*v - m);
        sum += *v;
    }
    sum
}

/// Sets the scores of keys outside `lo..hi` (absolute) to -inf; the tile
/// starts at key `j0` and holds `n`.
#[inline(always)]
fn mask(s: &mut [f32], j0: usize, n: usize, lo: usize, hi: usize) {
    for (jj, v) in s[..n].iter_mut().enumerate() {
        let j = j0 + jj;
        if j < lo || j >= hi {
            *v = f32::NEG_INFINITY;
        }
    }
}

struct Fwd<'a, E> {
    s: FlashShape,
    q: &'a [E],
    k: &'a [E],
    v: &'a [E],
    out: DisjointSlice<'a, E>,
    lse: DisjointSlice<'a, f32>,
}

/// One (batch, head, query tile) of the forward.
#[inline(always)]
fn fwd_task<E: Elem, F: Fma>(c: &Fwd<'_, E>, task: usize) {
    let s = &c.s;
    let (d, dv) = (s.head_dim, s.v_dim);
    let qt = task % s.q_tiles();
    let bh = task / s.q_tiles();
    let (b, h) = (bh / s.q_heads, bh % s.q_heads);
    let hk = h / s.group();
    let i0 = qt * BQ;
    let i1 = (i0 + BQ).min(s.q_len);
    let rows = i1 - i0;
    let q_base = (bh * s.q_len + i0) * d;
    let kv_row0 = (b * s.kv_heads + hk) * s.kv_len;

    let mut qf = vec![0f32; rows * d];
    let mut kt = vec![0f32; d * BK];
    let mut vf = vec![0f32; BK * dv];
    let mut st = vec![0f32; BK];
    let mut acc = vec![0f32; rows * dv];
    let mut m = vec![f32::NEG_INFINITY; rows];
    let mut l = vec![0f32; rows];
    widen(c.q, q_base, d, rows, s.scale, &mut qf);

    let (klo, khi) = s.tile_keys(i0, i1);
    let mut j0 = klo;
    while j0 < khi {
        let n = (khi - j0).min(BK);
        widen_t(c.k, (kv_row0 + j0) * d, d, n, &mut kt);
        widen(c.v, (kv_row0 + j0) * dv, dv, n, 1.0, &mut vf);
        for r in 0..rows {
            let (lo, hi) = s.keys(i0 + r);
            if hi <= j0 || lo >= j0 + n {
                continue;
            }
            row_times_t::<F>(&qf[r * d..(r + 1) * d], &kt, n, &mut st);
            mask(&mut st, j0, n, lo, hi);
            let m_new = m[r].max(max8(&st[..n]));
            let corr = exp::<F>(m[r] - m_new);
            let sum = exp_sum::<F>(&mut st[..n], m_new);
            l[r] = l[r] * corr + sum;
            let a = &mut acc[r * dv..(r + 1) * dv];
            if corr != 1.0 {
                a.iter_mut().for_each(|x| *x *= corr);
            }
            for (jj, &p) in st[..n].iter().enumerate() {
                if p != 0.0 {
                    axpy::<F>(p, &vf[jj * dv..(jj + 1) * dv], a);
                }
            }
            m[r] = m_new;
        }
        j0 += n;
    }
    // SAFETY: this task's rows `i0..i1` of head (b, h) are written by this
    // task alone (tasks are distinct (batch, head, query tile) triples).
    let out = unsafe {
        c.out
            .range((bh * s.q_len + i0) * dv..(bh * s.q_len + i1) * dv)
    };
    // SAFETY: as above.
    let lse = unsafe { c.lse.range(bh * s.q_len + i0..bh * s.q_len + i1) };
    for r in 0..rows {
        let o = &mut out[r * dv..(r + 1) * dv];
        if l[r] > 0.0 {
            let inv = 1.0 / l[r];
            for (o, &a) in o.iter_mut().zip(&acc[r * dv..(r + 1) * dv]) {
                *o = E::from_f32(a * inv);
            }
            lse[r] = m[r] + l[r].ln();
        } else {
            o.fill(E::from_f32(0.0));
            lse[r] = f32::NEG_INFINITY;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fwd_task_avx2<E: Elem>(c: &Fwd<'_, E>, task: usize) {
    fwd_task::<E, Fused>(c, task)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn fwd_task_avx512<E: Elem>(c: &Fwd<'_, E>, task: usize) {
    fwd_task::<E, Fused>(c, task)
}

/// Attention forward; see the module doc. q `[batch, q_heads, q_len,
/// head_dim]`, k `[batch, kv_heads, kv_len, head_dim]`, v `[batch,
/// kv_heads, kv_len, v_dim]`; out `[batch, q_heads, q_len, v_dim]`, lse
/// `[batch, q_heads, q_len]` (-inf, and a zero output row, where a query
/// sees no key).
pub fn flash_attn_fwd<E: Elem>(
    s: &FlashShape,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [E],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    flash_attn_fwd_with(cpu::tier(), s, q, k, v, out, lse)
}

/// [`flash_attn_fwd`] on a given tier (lowered to one the CPU supports).
pub fn flash_attn_fwd_with<E: Elem>(
    tier: SimdTier,
    s: &FlashShape,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [E],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    let n = s.check("flash_attn_fwd")?;
    check_len("flash_attn q", n.q, q.len())?;
    check_len("flash_attn k", n.k, k.len())?;
    check_len("flash_attn v", n.v, v.len())?;
    check_len("flash_attn out", n.o, out.len())?;
    check_len("flash_attn lse", n.lse, lse.len())?;
    let tasks = s.batch * s.q_heads * s.q_tiles();
    let c = Fwd {
        s: *s,
        q,
        k,
        v,
        out: DisjointSlice::new(out),
        lse: DisjointSlice::new(lse),
    };
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the clamped tier is one the CPU supports (AVX-512 F/BW/VL
        // with AVX2 and FMA).
        SimdTier::Avx512 => pool::global().run(tasks, &|t| unsafe { fwd_task_avx512(&c, t) }),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the clamped tier is one the CPU supports, with AVX2 and FMA.
        SimdTier::Avx2 => pool::global().run(tasks, &|t| unsafe { fwd_task_avx2(&c, t) }),
        _ => pool::global().run(tasks, &|t| fwd_task::<E, Plain>(&c, t)),
    }
    Ok(())
}

struct Bwd<'a, E> {
    s: FlashShape,
    q: &'a [E],
    k: &'a [E],
    v: &'a [E],
    dout: &'a [E],
    lse: &'a [f32],
    /// `D_i = Σ dO_i · O_i` per query row.
    delta: &'a [f32],
    dq: DisjointSlice<'a, E>,
    dk: DisjointSlice<'a, E>,
    dv: DisjointSlice<'a, E>,
}

/// The recomputed `P` and `dS` rows of query row `r` (absolute `i`) against
/// the key tile at `j0` (`n` keys): `p` and `ds` hold `n` values.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn probs_and_ds<F: Fma>(
    s: &FlashShape,
    i: usize,
    q_row: &[f32],
    do_row: &[f32],
    kt: &[f32],
    vt: &[f32],
    j0: usize,
    n: usize,
    lse: f32,
    delta: f32,
    p: &mut [f32],
    ds: &mut [f32],
) {
    let (lo, hi) = s.keys(i);
    row_times_t::<F>(q_row, kt, n, p);
    for x in &mut p[..n] {
        *x *= s.scale;
    }
    mask(p, j0, n, lo, hi);
    for x in &mut p[..n] {
        // exp(-inf - lse) is 0: masked keys and rows that see nothing.
        *x = exp::<F>(*x - lse);
    }
    if lse == f32::NEG_INFINITY {
        p[..n].fill(0.0);
    }
    row_times_t::<F>(do_row, vt, n, ds);
    for (d, &pv) in ds[..n].iter_mut().zip(&p[..n]) {
        *d = pv * (*d - delta);
    }
}

/// One (batch, kv head, key tile) of the backward: its rows of dK and dV.
#[inline(always)]
fn dkv_task<E: Elem, F: Fma>(c: &Bwd<'_, E>, task: usize) {
    let s = &c.s;
    let (d, dv) = (s.head_dim, s.v_dim);
    let k_tiles = s.kv_len.div_ceil(BK);
    let kt_i = task % k_tiles;
    let bhk = task / k_tiles;
    let (b, hk) = (bhk / s.kv_heads, bhk % s.kv_heads);
    let j0 = kt_i * BK;
    let n = (s.kv_len - j0).min(BK);
    let kv_base = bhk * s.kv_len + j0;

    let mut kt = vec![0f32; d * BK];
    let mut vt = vec![0f32; dv * BK];
    widen_t(c.k, kv_base * d, d, n, &mut kt);
    widen_t(c.v, kv_base * dv, dv, n, &mut vt);
    let mut dk = vec![0f32; n * d];
    let mut dva = vec![0f32; n * dv];
    let mut qf = vec![0f32; BQ * d];
    let mut dof = vec![0f32; BQ * dv];
    let mut p = vec![0f32; BK];
    let mut ds = vec![0f32; BK];

    for h in hk * s.group()..(hk + 1) * s.group() {
        let bh = b * s.q_heads + h;
        for qt in 0..s.q_tiles() {
            let i0 = qt * BQ;
            let i1 = (i0 + BQ).min(s.q_len);
            let (lo, hi) = s.tile_keys(i0, i1);
            if hi <= j0 || lo >= j0 + n {
                continue;
            }
            let rows = i1 - i0;
            widen(c.q, (bh * s.q_len + i0) * d, d, rows, 1.0, &mut qf);
            widen(c.dout, (bh * s.q_len + i0) * dv, dv, rows, 1.0, &mut dof);
            for r in 0..rows {
                let i = i0 + r;
                let (lo, hi) = s.keys(i);
                if hi <= j0 || lo >= j0 + n {
                    continue;
                }
                let row = bh * s.q_len + i;
                let q_row = &qf[r * d..(r + 1) * d];
                let do_row = &dof[r * dv..(r + 1) * dv];
                probs_and_ds::<F>(
                    s,
                    i,
                    q_row,
                    do_row,
                    &kt,
                    &vt,
                    j0,
                    n,
                    c.lse[row],
                    c.delta[row],
                    &mut p,
                    &mut ds,
                );
                for jj in 0..n {
                    if p[jj] != 0.0 {
                        axpy::<F>(p[jj], do_row, &mut dva[jj * dv..(jj + 1) * dv]);
                    }
                    if ds[jj] != 0.0 {
                        axpy::<F>(ds[jj] * s.scale, q_row, &mut dk[jj * d..(jj + 1) * d]);
                    }
                }
            }
        }
    }
    // SAFETY: rows j0..j0+n of kv head (b, hk) belong to this task alone.
    let dk_out = unsafe { c.dk.range(kv_base * d..(kv_base + n) * d) };
    // SAFETY: as above.
    let dv_out = unsafe { c.dv.range(kv_base * dv..(kv_base + n) * dv) };
    for (o, &x) in dk_out.iter_mut().zip(&dk) {
        *o = E::from_f32(x);
    }
    for (o, &x) in dv_out.iter_mut().zip(&dva) {
        *o = E::from_f32(x);
    }
}

/// One (batch, query head, query tile) of the backward: its rows of dQ.
#[inline(always)]
fn dq_task<E: Elem, F: Fma>(c: &Bwd<'_, E>, task: usize) {
    let s = &c.s;
    let (d, dv) = (s.head_dim, s.v_dim);
    let qt = task % s.q_tiles();
    let bh = task / s.q_tiles();
    let (b, h) = (bh / s.q_heads, bh % s.q_heads);
    let hk = h / s.group();
    let i0 = qt * BQ;
    let i1 = (i0 + BQ).min(s.q_len);
    let rows = i1 - i0;
    let kv_row0 = (b * s.kv_heads + hk) * s.kv_len;

    let mut qf = vec![0f32; rows * d];
    let mut dof = vec![0f32; rows * dv];
    widen(c.q, (bh * s.q_len + i0) * d, d, rows, 1.0, &mut qf);
    widen(c.dout, (bh * s.q_len + i0) * dv, dv, rows, 1.0, &mut dof);
    let mut kt = vec![0f32; d * BK];
    let mut kf = vec![0f32; BK * d];
    let mut vt = vec![0f32; dv * BK];
    let mut dq = vec![0f32; rows * d];
    let mut p = vec![0f32; BK];
    let mut ds = vec![0f32; BK];

    let (klo, khi) = s.tile_keys(i0, i1);
    let mut j0 = klo;
    while j0 < khi {
        let n = (khi - j0).min(BK);
        widen_t(c.k, (kv_row0 + j0) * d, d, n, &mut kt);
        widen(c.k, (kv_row0 + j0) * d, d, n, 1.0, &mut kf);
        widen_t(c.v, (kv_row0 + j0) * dv, dv, n, &mut vt);
        for r in 0..rows {
            let i = i0 + r;
            let (lo, hi) = s.keys(i);
            if hi <= j0 || lo >= j0 + n {
                continue;
            }
            let row = bh * s.q_len + i;
            probs_and_ds::<F>(
                s,
                i,
                &qf[r * d..(r + 1) * d],
                &dof[r * dv..(r + 1) * dv],
                &kt,
                &vt,
                j0,
                n,
                c.lse[row],
                c.delta[row],
                &mut p,
                &mut ds,
            );
            let acc = &mut dq[r * d..(r + 1) * d];
            for (jj, &g) in ds[..n].iter().enumerate() {
                if g != 0.0 {
                    axpy::<F>(g * s.scale, &kf[jj * d..(jj + 1) * d], acc);
                }
            }
        }
        j0 += n;
    }
    // SAFETY: rows i0..i1 of query head (b, h) belong to this task alone.
    let out = unsafe { c.dq.range((bh * s.q_len + i0) * d..(bh * s.q_len + i1) * d) };
    for (o, &x) in out.iter_mut().zip(&dq) {
        *o = E::from_f32(x);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn bwd_task_avx2<E: Elem>(c: &Bwd<'_, E>, dkv: bool, task: usize) {
    match dkv {
        true => dkv_task::<E, Fused>(c, task),
        false => dq_task::<E, Fused>(c, task),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn bwd_task_avx512<E: Elem>(c: &Bwd<'_, E>, dkv: bool, task: usize) {
    match dkv {
        true => dkv_task::<E, Fused>(c, task),
        false => dq_task::<E, Fused>(c, task),
    }
}

fn bwd_task_plain<E: Elem>(c: &Bwd<'_, E>, dkv: bool, task: usize) {
    match dkv {
        true => dkv_task::<E, Plain>(c, task),
        false => dq_task::<E, Plain>(c, task),
    }
}

/// Attention backward: dq, dk, dv (the shapes of q, k, v) from the
/// forward's inputs, its output and log-sum-exp, and the output's gradient.
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_bwd<E: Elem>(
    s: &FlashShape,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &[E],
    dout: &[E],
    lse: &[f32],
    dq: &mut [E],
    dk: &mut [E],
    dv: &mut [E],
) -> Result<(), KernelError> {
    flash_attn_bwd_with(cpu::tier(), s, q, k, v, out, dout, lse, dq, dk, dv)
}

/// [`flash_attn_bwd`] on a given tier (lowered to one the CPU supports).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_bwd_with<E: Elem>(
    tier: SimdTier,
    s: &FlashShape,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &[E],
    dout: &[E],
    lse: &[f32],
    dq: &mut [E],
    dk: &mut [E],
    dv: &mut [E],
) -> Result<(), KernelError> {
    let n = s.check("flash_attn_bwd")?;
    check_len("flash_attn q", n.q, q.len())?;
    check_len("flash_attn k", n.k, k.len())?;
    check_len("flash_attn v", n.v, v.len())?;
    check_len("flash_attn out", n.o, out.len())?;
    check_len("flash_attn grad_out", n.o, dout.len())?;
    check_len("flash_attn lse", n.lse, lse.len())?;
    check_len("flash_attn grad_q", n.q, dq.len())?;
    check_len("flash_attn grad_k", n.k, dk.len())?;
    check_len("flash_attn grad_v", n.v, dv.len())?;
    let dvd = s.v_dim;
    let delta: Vec<f32> = (0..n.lse)
        .map(|r| {
            let o = &out[r * dvd..(r + 1) * dvd];
            let g = &dout[r * dvd..(r + 1) * dvd];
            o.iter().zip(g).map(|(a, b)| a.to_f32() * b.to_f32()).sum()
        })
        .collect();
    let c = Bwd {
        s: *s,
        q,
        k,
        v,
        dout,
        lse,
        delta: &delta,
        dq: DisjointSlice::new(dq),
        dk: DisjointSlice::new(dk),
        dv: DisjointSlice::new(dv),
    };
    let dkv_tasks = s.batch * s.kv_heads * s.kv_len.div_ceil(BK);
    let dq_tasks = s.batch * s.q_heads * s.q_tiles();
    let tier = cpu::clamp(tier);
    for (dkv, tasks) in [(true, dkv_tasks), (false, dq_tasks)] {
        match tier {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the clamped tier is one the CPU supports.
            SimdTier::Avx512 => {
                pool::global().run(tasks, &|t| unsafe { bwd_task_avx512(&c, dkv, t) })
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the clamped tier is one the CPU supports, with AVX2 and FMA.
            SimdTier::Avx2 => pool::global().run(tasks, &|t| unsafe { bwd_task_avx2(&c, dkv, t) }),
            _ => pool::global().run(tasks, &|t| bwd_task_plain(&c, dkv, t)),
        }
    }
    Ok(())
}

/// f64 reference of [`flash_attn_fwd`]: plain softmax attention.
pub fn flash_attn_ref<E: Elem>(
    s: &FlashShape,
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [E],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    let n = s.check("flash_attn_ref")?;
    check_len("flash_attn q", n.q, q.len())?;
    check_len("flash_attn k", n.k, k.len())?;
    check_len("flash_attn v", n.v, v.len())?;
    check_len("flash_attn out", n.o, out.len())?;
    check_len("flash_attn lse", n.lse, lse.len())?;
    let (d, dv) = (s.head_dim, s.v_dim);
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let bh = b * s.q_heads + h;
            let kv = (b * s.kv_heads + h / s.group()) * s.kv_len;
            for i in 0..s.q_len {
                let row = bh * s.q_len + i;
                let (lo, hi) = s.keys(i);
                let sc: Vec<f64> = (lo..hi)
                    .map(|j| {
                        (0..d)
                            .map(|c| {
                                q[row * d + c].to_f32() as f64 * k[(kv + j) * d + c].to_f32() as f64
                            })
                            .sum::<f64>()
                            * s.scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for e in 0..dv {
                    let o: f64 = sc
                        .iter()
                        .zip(lo..hi)
                        .map(|(x, j)| (x - m).exp() / l * v[(kv + j) * dv + e].to_f32() as f64)
                        .sum();
                    out[row * dv + e] = E::from_f32(if hi > lo { o as f32 } else { 0.0 });
                }
                lse[row] = if hi > lo {
                    (m + l.ln()) as f32
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
    Ok(())
}

/// f64 reference of [`flash_attn_bwd`] (recomputes the softmax itself; the
/// forward's `out` and `lse` are not read).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_bwd_ref<E: Elem>(
    s: &FlashShape,
    q: &[E],
    k: &[E],
    v: &[E],
    dout: &[E],
    dq: &mut [E],
    dk: &mut [E],
    dv: &mut [E],
) -> Result<(), KernelError> {
    let n = s.check("flash_attn_bwd_ref")?;
    check_len("flash_attn q", n.q, q.len())?;
    check_len("flash_attn k", n.k, k.len())?;
    check_len("flash_attn v", n.v, v.len())?;
    check_len("flash_attn grad_out", n.o, dout.len())?;
    check_len("flash_attn grad_q", n.q, dq.len())?;
    check_len("flash_attn grad_k", n.k, dk.len())?;
    check_len("flash_attn grad_v", n.v, dv.len())?;
    let (d, dvd) = (s.head_dim, s.v_dim);
    let f = |x: &E| x.to_f32() as f64;
    let mut gq = vec![0f64; n.q];
    let mut gk = vec![0f64; n.k];
    let mut gv = vec![0f64; n.v];
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let bh = b * s.q_heads + h;
            let kv = (b * s.kv_heads + h / s.group()) * s.kv_len;
            for i in 0..s.q_len {
                let row = bh * s.q_len + i;
                let (lo, hi) = s.keys(i);
                if hi <= lo {
                    continue;
                }
                let sc: Vec<f64> = (lo..hi)
                    .map(|j| {
                        (0..d)
                            .map(|c| f(&q[row * d + c]) * f(&k[(kv + j) * d + c]))
                            .sum::<f64>()
                            * s.scale as f64
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = sc.iter().map(|x| (x - m).exp() / l).collect();
                let dp: Vec<f64> = (lo..hi)
                    .map(|j| {
                        (0..dvd)
                            .map(|e| f(&dout[row * dvd + e]) * f(&v[(kv + j) * dvd + e]))
                            .sum()
                    })
                    .collect();
                let delta: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for (t, j) in (lo..hi).enumerate() {
                    let g = p[t] * (dp[t] - delta) * s.scale as f64;
                    for e in 0..dvd {
                        gv[(kv + j) * dvd + e] += p[t] * f(&dout[row * dvd + e]);
                    }
                    for c in 0..d {
                        gq[row * d + c] += g * f(&k[(kv + j) * d + c]);
                        gk[(kv + j) * d + c] += g * f(&q[row * d + c]);
                    }
                }
            }
        }
    }
    for (o, x) in dq.iter_mut().zip(gq) {
        *o = E::from_f32(x as f32);
    }
    for (o, x) in dk.iter_mut().zip(gk) {
        *o = E::from_f32(x as f32);
    }
    for (o, x) in dv.iter_mut().zip(gv) {
        *o = E::from_f32(x as f32);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.5f32..1.5)).collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn shape(
        b: usize,
        hq: usize,
        hk: usize,
        sq: usize,
        sk: usize,
        d: usize,
        causal: bool,
        window: Option<usize>,
    ) -> FlashShape {
        FlashShape {
            batch: b,
            q_heads: hq,
            kv_heads: hk,
            q_len: sq,
            kv_len: sk,
            head_dim: d,
            v_dim: d + 3,
            scale: 1.0 / (d as f32).sqrt(),
            causal,
            window,
        }
    }

    /// (batch, q heads, kv heads, q len, kv len, head dim, causal, window).
    type Case = (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        bool,
        Option<usize>,
    );

    const CASES: &[Case] = &[
        (1, 2, 2, 7, 7, 31, true, None),
        (2, 4, 2, 65, 65, 16, true, None),
        (1, 6, 1, 33, 33, 8, true, Some(5)),
        (1, 2, 1, 130, 130, 16, true, Some(100)),
        (1, 2, 2, 9, 20, 12, true, None),
        (1, 2, 2, 20, 9, 12, true, None),
        (2, 2, 1, 17, 17, 9, false, None),
        (1, 2, 1, 40, 40, 9, false, Some(3)),
        (1, 1, 1, 1, 1, 8, true, Some(1)),
    ];

    /// Max |a − b| relative to max(1, max |b|).
    fn rel_err(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    fn run_case<E: Elem>(tier: SimdTier, c: &Case, tol: f32) {
        let s = shape(c.0, c.1, c.2, c.3, c.4, c.5, c.6, c.7);
        let n = s.check("test").unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let cv = |v: Vec<f32>| v.into_iter().map(E::from_f32).collect::<Vec<E>>();
        let (q, k, v, g) = (
            cv(rand_vec(&mut rng, n.q)),
            cv(rand_vec(&mut rng, n.k)),
            cv(rand_vec(&mut rng, n.v)),
            cv(rand_vec(&mut rng, n.o)),
        );
        let nan = E::from_f32(f32::NAN);
        let (mut o, mut lse) = (vec![nan; n.o], vec![f32::NAN; n.lse]);
        flash_attn_fwd_with(tier, &s, &q, &k, &v, &mut o, &mut lse).unwrap();
        let (mut o_ref, mut lse_ref) = (vec![nan; n.o], vec![f32::NAN; n.lse]);
        flash_attn_ref(&s, &q, &k, &v, &mut o_ref, &mut lse_ref).unwrap();
        let w = |x: &[E]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        assert!(rel_err(&w(&o), &w(&o_ref)) <= tol, "{tier} {c:?} out");
        for (a, b) in lse.iter().zip(&lse_ref) {
            assert!(
                (a == b) || (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{tier} {c:?} lse {a} {b}"
            );
        }
        let (mut dq, mut dk, mut dv) = (vec![nan; n.q], vec![nan; n.k], vec![nan; n.v]);
        flash_attn_bwd_with(
            tier, &s, &q, &k, &v, &o, &g, &lse, &mut dq, &mut dk, &mut dv,
        )
        .unwrap();
        let (mut rq, mut rk, mut rv) = (vec![nan; n.q], vec![nan; n.k], vec![nan; n.v]);
        flash_attn_bwd_ref(&s, &q, &k, &v, &g, &mut rq, &mut rk, &mut rv).unwrap();
        assert!(rel_err(&w(&dq), &w(&rq)) <= tol, "{tier} {c:?} dq");
        assert!(rel_err(&w(&dk), &w(&rk)) <= tol, "{tier} {c:?} dk");
        assert!(rel_err(&w(&dv), &w(&rv)) <= tol, "{tier} {c:?} dv");
    }

    /// f32: a softmax over at most 130 keys with a ~2e-7 exp and f32
    /// accumulation of ≤ 130·6 products lands within 2e-5 of f64 relative
    /// to the largest gradient. bf16: the output's own rounding (2^-8)
    /// plus the bf16 `out` that the backward's `D` reads.
    #[test]
    fn every_tier_matches_the_f64_reference() {
        for tier in cpu::available_tiers() {
            for c in CASES {
                run_case::<f32>(tier, c, 2e-5);
                run_case::<bf16>(tier, c, 1.6e-2);
            }
        }
    }

    #[test]
    fn rows_that_see_no_key_are_zero_with_lse_minus_inf() {
        let s = shape(1, 1, 1, 5, 3, 8, true, None);
        let q = vec![1f32; 40];
        let k = vec![1f32; 24];
        let v = vec![1f32; 33];
        let (mut o, mut lse) = (vec![f32::NAN; 55], vec![f32::NAN; 5]);
        flash_attn_fwd(&s, &q, &k, &v, &mut o, &mut lse).unwrap();
        assert!(o[..22].iter().all(|&x| x == 0.0));
        assert_eq!(lse[0], f32::NEG_INFINITY);
        assert_eq!(lse[1], f32::NEG_INFINITY);
        assert!(lse[2].is_finite());
        let g = vec![1f32; 55];
        let (mut dq, mut dk, mut dv) = (vec![f32::NAN; 40], vec![f32::NAN; 24], vec![f32::NAN; 33]);
        flash_attn_bwd(&s, &q, &k, &v, &o, &g, &lse, &mut dq, &mut dk, &mut dv).unwrap();
        assert!(dq[..16].iter().all(|&x| x == 0.0));
        assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()));
    }

    #[test]
    fn repeated_runs_give_the_same_bits() {
        let s = shape(1, 4, 2, 150, 150, 32, true, None);
        let n = s.check("t").unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (q, k, v, g) = (
            rand_vec(&mut rng, n.q),
            rand_vec(&mut rng, n.k),
            rand_vec(&mut rng, n.v),
            rand_vec(&mut rng, n.o),
        );
        let run = || {
            let (mut o, mut lse) = (vec![0f32; n.o], vec![0f32; n.lse]);
            flash_attn_fwd(&s, &q, &k, &v, &mut o, &mut lse).unwrap();
            let (mut dq, mut dk, mut dv) = (vec![0f32; n.q], vec![0f32; n.k], vec![0f32; n.v]);
            flash_attn_bwd(&s, &q, &k, &v, &o, &g, &lse, &mut dq, &mut dk, &mut dv).unwrap();
            (o, dq, dk, dv)
        };
        let a = run();
        for _ in 0..3 {
            assert!(a == run());
        }
    }

    #[test]
    fn the_reference_backward_matches_finite_differences() {
        // f64 finite differences of sum(out · g) through the f64 reference,
        // on f32 inputs (the reference computes in f64).
        let s = shape(1, 2, 1, 4, 4, 3, true, Some(3));
        let n = s.check("t").unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (q, k, v, g) = (
            rand_vec(&mut rng, n.q),
            rand_vec(&mut rng, n.k),
            rand_vec(&mut rng, n.v),
            rand_vec(&mut rng, n.o),
        );
        let loss = |q: &[f32], k: &[f32], v: &[f32]| -> f64 {
            let (mut o, mut l) = (vec![0f32; n.o], vec![0f32; n.lse]);
            flash_attn_ref(&s, q, k, v, &mut o, &mut l).unwrap();
            o.iter().zip(&g).map(|(a, b)| *a as f64 * *b as f64).sum()
        };
        let (mut dq, mut dk, mut dv) = (vec![0f32; n.q], vec![0f32; n.k], vec![0f32; n.v]);
        flash_attn_bwd_ref(&s, &q, &k, &v, &g, &mut dq, &mut dk, &mut dv).unwrap();
        let h = 1e-2f32;
        for (which, grad) in [(0, &dq), (1, &dk), (2, &dv)] {
            for idx in 0..grad.len() {
                let mut x = [q.clone(), k.clone(), v.clone()];
                x[which][idx] += h;
                let up = loss(&x[0], &x[1], &x[2]);
                x[which][idx] -= 2.0 * h;
                let down = loss(&x[0], &x[1], &x[2]);
                let fd = (up - down) / (2.0 * h as f64);
                // Central differences in f32 inputs: O(h²) truncation
                // plus the f32 rounding of the outputs (~1e-7 / h).
                assert!(
                    (fd - grad[idx] as f64).abs() < 2e-3,
                    "{which}[{idx}]: fd {fd} vs {}",
                    grad[idx]
                );
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let s = shape(1, 3, 2, 4, 4, 8, true, None);
        let (q, k, v) = (vec![0f32; 96], vec![0f32; 64], vec![0f32; 88]);
        let (mut o, mut l) = (vec![0f32; 132], vec![0f32; 12]);
        assert!(flash_attn_fwd(&s, &q, &k, &v, &mut o, &mut l).is_err());
        let s = FlashShape { q_heads: 2, ..s };
        assert!(flash_attn_fwd(&s, &q[..64], &k, &v, &mut o[..88], &mut l[..8]).is_ok());
        assert!(flash_attn_fwd(&s, &q[..63], &k, &v, &mut o[..88], &mut l[..8]).is_err());
        let w0 = FlashShape {
            window: Some(0),
            ..s
        };
        assert!(flash_attn_fwd(&w0, &q[..64], &k, &v, &mut o[..88], &mut l[..8]).is_err());
        let huge = FlashShape {
            batch: usize::MAX,
            ..s
        };
        assert!(flash_attn_fwd(&huge, &q, &k, &v, &mut o, &mut l).is_err());
    }
}
