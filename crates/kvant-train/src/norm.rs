//! RMSNorm (plain and fused with the residual add) and LayerNorm, forward
//! and backward, over rows of `cols` values.
//!
//! RMSNorm, with `s = offset + w` and `r = 1/sqrt(mean(x²) + eps)`:
//! - forward `y = x·r·s`; `r` is saved per row (f32) for the backward;
//! - backward `g = dy·s`, `dx = r·g − x·r³·(Σ g·x)/N`, `dw = Σ_rows dy·x·r`.
//!
//! Casting ([`RmsCasting`]) says where bf16 rounds, as in Liger:
//! - `Llama` (Hugging Face `LlamaRMSNorm`): `h = (x·r)` rounded to the input
//!   type, `y = round(h·s)` (torch's bf16 `w * h` is the exact f32 product
//!   rounded once); the backward follows torch's autograd through that
//!   graph: `g = round(dy·s)`, `dw = Σ dy·h`, the rest in f32;
//! - `Gemma`: everything in f32, `y` rounded once; `g` and `dw` unrounded.
//!
//! Fused add: `sum = round(x + residual)`, `y = rmsnorm(sum)`; backward
//! `ds = round(dsum + dx_norm)`, the gradient of both `x` and `residual`.
//!
//! LayerNorm, `x̂ = (x − μ)·r`, `r = 1/sqrt(var + eps)` (biased variance):
//! - forward `y = x̂·w + b`, `μ` and `r` saved per row;
//! - backward `g = dy·w`, `dx = r·(g − mean(g) − x̂·mean(g·x̂))`,
//!   `dw = Σ dy·x̂`, `db = Σ dy`.
//!
//! Rows are split over the pool in chunks whose size depends on the shape
//! only ([`row_chunk`]); each chunk sums its weight gradient into its own
//! f32 partial and the partials are added in chunk order, so `dw` and
//! `db` do not depend on the thread count. Rows stay in L1 between the
//! passes over them (a 4096-wide bf16 row is 8 KiB), so each element is
//! read from memory once.
//!
//! Measured (`cargo bench --bench train_rows`, 4096×4096, 2 threads of a
//! shared Zen 4 VM whose read probe gave 21–29 GB/s around the run; bytes
//! read + written): f32 forward 29–32 GB/s, backward 22–25 (LayerNorm
//! 16); bf16 forward 23–33, backward 15–18 (LayerNorm 14). The bf16
//! backward is bound by the conversions (7 GB/s per thread of CPU time).
//! With the next row prefetched in the backwards ([`Ahead`]), a later run
//! (4 KiB pages, criterion's ranges): f32 RMSNorm backward 20.4–22.4,
//! LayerNorm 17.7–19.3; bf16 15.6–16.0 and 13.4–13.9 GB/s.

use crate::{zero_first, Elem};
use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::error::{check_len, checked_mul};
use kvant_kernels::pool::{self, DisjointSlice, ThreadPool};
use kvant_kernels::vecops::{Fma, Plain};
use kvant_kernels::KernelError;
use std::ops::Range;

/// Where RMSNorm rounds to the input type (no effect on f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsCasting {
    /// Hugging Face Llama: x·rstd computed in f32, rounded to the input type, then times the weight (product rounded).
    Llama,
    /// Gemma: everything in f32 ((offset + w) included), the result rounded once.
    Gemma,
}

/// Options of the RMSNorm kernels.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormArgs {
    /// Values per row (the weight's length).
    pub cols: usize,
    pub eps: f32,
    /// Added to the weight: 1.0 for Gemma's `(1 + w)`, else 0.
    pub offset: f32,
    pub casting: RmsCasting,
}

/// Rows per chunk of work: at most [`MAX_CHUNKS`] chunks, and at least
/// [`MIN_CHUNK_ELEMS`] values each so that a small call runs as one chunk,
/// serially. Depends on the shape only, never on the thread count, so the
/// weight gradients' partial sums are the same on any pool.
pub(crate) fn row_chunk(rows: usize, cols: usize) -> usize {
    rows.div_ceil(MAX_CHUNKS)
        .max(MIN_CHUNK_ELEMS.div_ceil(cols.max(1)))
        .max(1)
}

/// Enough chunks to balance 2–16 threads; 64 partial rows of 4096 f32
/// weight gradients are 1 MiB, 3% of a 4096×4096 bf16 backward's traffic.
const MAX_CHUNKS: usize = 64;
/// 16 Ki values (32–64 KiB) per chunk: below that a pool hand-out (~1 µs)
/// is a sizeable part of the work.
const MIN_CHUNK_ELEMS: usize = 16 * 1024;

/// The reductions of the row kernels, per tier. Plain loops over an f32
/// sum and a bf16 row vectorized 2 lanes wide with the accumulators
/// spilled (LayerNorm forward and RMSNorm backward in bf16 ran at 4–5 GB/s
/// on 2 threads), so the AVX2 tier loads 8 lanes at a time with
/// [`Lanes::load8`](kvant_kernels::lanes::Lanes::load8) into four accumulators.
/// Each sum is in a fixed order for a given length.
pub(crate) trait Kern {
    type F: Fma;
    /// `Σ a·b`.
    ///
    /// # Safety
    /// The CPU supports the tier this type stands for.
    unsafe fn dot<A: Elem, B: Elem>(a: &[A], b: &[B]) -> f32;
    /// `Σ a·(b − m)`.
    ///
    /// # Safety
    /// As [`Kern::dot`].
    unsafe fn dot_dev<A: Elem, B: Elem>(a: &[A], b: &[B], m: f32) -> f32;
    /// `Σ a`.
    ///
    /// # Safety
    /// As [`Kern::dot`].
    unsafe fn sum<E: Elem>(a: &[E]) -> f32;
    /// `Σ (a − m)²`.
    ///
    /// # Safety
    /// As [`Kern::dot`].
    unsafe fn sq_dev<E: Elem>(a: &[E], m: f32) -> f32;
    /// RMSNorm backward's first pass over `rows = (dy, w, x)`: `g = dy·(off + w)`
    /// (rounded to `E` when `ROUND`) written to `g`; returns `Σ g·x`.
    ///
    /// # Safety
    /// As [`Kern::dot`].
    unsafe fn g_dot<E: Elem, const ROUND: bool>(
        rows: (&[E], &[E], &[E]),
        off: f32,
        g: &mut [f32],
    ) -> f32;
}

/// Portable loops.
pub(crate) struct Scalar;

impl Kern for Scalar {
    type F = Plain;
    unsafe fn dot<A: Elem, B: Elem>(a: &[A], b: &[B]) -> f32 {
        let mut acc = [0f32; 8];
        let mut ia = a.chunks_exact(8);
        let mut ib = b.chunks_exact(8);
        for (ca, cb) in (&mut ia).zip(&mut ib) {
            for k in 0..8 {
                acc[k] += ca[k].to_f32() * cb[k].to_f32();
            }
        }
        let mut s = hsum8(acc);
        for (x, y) in ia.remainder().iter().zip(ib.remainder()) {
            s += x.to_f32() * y.to_f32();
        }
        s
    }

    unsafe fn dot_dev<A: Elem, B: Elem>(a: &[A], b: &[B], m: f32) -> f32 {
        let mut acc = [0f32; 8];
        let mut ia = a.chunks_exact(8);
        let mut ib = b.chunks_exact(8);
        for (ca, cb) in (&mut ia).zip(&mut ib) {
            for k in 0..8 {
                acc[k] += ca[k].to_f32() * (cb[k].to_f32() - m);
            }
        }
        let mut s = hsum8(acc);
        for (x, y) in ia.remainder().iter().zip(ib.remainder()) {
            s += x.to_f32() * (y.to_f32() - m);
        }
        s
    }

    unsafe fn sum<E: Elem>(a: &[E]) -> f32 {
        let mut acc = [0f32; 8];
        let mut it = a.chunks_exact(8);
        for c in &mut it {
            for k in 0..8 {
                acc[k] += c[k].to_f32();
            }
        }
        let mut s = hsum8(acc);
        for x in it.remainder() {
            s += x.to_f32();
        }
        s
    }

    unsafe fn sq_dev<E: Elem>(a: &[E], m: f32) -> f32 {
        let mut acc = [0f32; 8];
        let mut it = a.chunks_exact(8);
        for c in &mut it {
            for k in 0..8 {
                let d = c[k].to_f32() - m;
                acc[k] += d * d;
            }
        }
        let mut s = hsum8(acc);
        for x in it.remainder() {
            let d = x.to_f32() - m;
            s += d * d;
        }
        s
    }

    unsafe fn g_dot<E: Elem, const ROUND: bool>(
        (dy, w, x): (&[E], &[E], &[E]),
        off: f32,
        g: &mut [f32],
    ) -> f32 {
        for ((gv, d), wv) in g.iter_mut().zip(dy).zip(w) {
            let p = d.to_f32() * (off + wv.to_f32());
            *gv = if ROUND { round::<E>(p) } else { p };
        }
        // SAFETY: the scalar tier runs anywhere.
        unsafe { Self::dot(&*g, x) }
    }
}

fn hsum8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// AVX2 + FMA + F16C (also the AVX-512 tier's reductions: these loops
/// are load-bound).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx;

#[cfg(target_arch = "x86_64")]
mod avx_red {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: AVX (caller's contract); `a` holds eight floats.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        hsum8(a)
    }

    /// Each lane rounded to bf16 and widened back: [`store`] then
    /// `to_f32`, 8 lanes at a time (NaN quieted, as half does).
    #[inline(always)]
    pub(super) unsafe fn round_bf16(v: __m256) -> __m256 {
        // SAFETY: AVX2 (caller's contract); register operations only.
        unsafe {
            let x = _mm256_castps_si256(v);
            let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            let r = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
            let r = _mm256_and_si256(r, hi);
            let q = _mm256_and_si256(_mm256_or_si256(x, _mm256_set1_epi32(0x0040_0000)), hi);
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
            _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(q), nan)
        }
    }

    /// One 8-lane step of [`Kern::g_dot`]: `g = dy·(off + w)` at `j`
    /// (rounded when `ROUND`), stored, and `acc + g·x`. A plain function
    /// (inlined always): the same code in a closure was not inlined under
    /// the Llama rounding and ran its intrinsics as calls, 15× slower.
    #[inline(always)]
    pub(super) unsafe fn g_step<E: Elem, const ROUND: bool>(
        (dy, w, x, g): (*const E, *const E, *const E, *mut f32),
        offv: __m256,
        j: usize,
        acc: __m256,
    ) -> __m256 {
        // SAFETY: AVX2/FMA/F16C and 8 values at `j` in each (caller's contract).
        unsafe {
            let mut gv =
                _mm256_mul_ps(E::load8(dy.add(j)), _mm256_add_ps(offv, E::load8(w.add(j))));
            if ROUND && !E::F32 {
                gv = round_bf16(gv);
            }
            _mm256_storeu_ps(g.add(j), gv);
            _mm256_fmadd_ps(gv, E::load8(x.add(j)), acc)
        }
    }

    /// `Σ f(a_j, b_j)` with `f` one FMA step on 8 lanes, four chains.
    #[inline(always)]
    pub(super) unsafe fn reduce2<A: Elem, B: Elem>(
        a: &[A],
        b: &[B],
        step: impl Fn(__m256, __m256, __m256) -> __m256,
        tail: impl Fn(f32, f32) -> f32,
    ) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        // SAFETY: AVX2/FMA/F16C by the caller's contract; every load reads
        // 8 values at j + k·8 + 8 <= n.
        unsafe {
            let mut s = [_mm256_setzero_ps(); 4];
            let mut j = 0;
            while j + 32 <= n {
                for (k, acc) in s.iter_mut().enumerate() {
                    let o = j + 8 * k;
                    *acc = step(A::load8(pa.add(o)), B::load8(pb.add(o)), *acc);
                }
                j += 32;
            }
            while j + 8 <= n {
                s[0] = step(A::load8(pa.add(j)), B::load8(pb.add(j)), s[0]);
                j += 8;
            }
            let mut t = hsum(_mm256_add_ps(
                _mm256_add_ps(s[0], s[1]),
                _mm256_add_ps(s[2], s[3]),
            ));
            for k in j..n {
                t += tail(a[k].to_f32(), b[k].to_f32());
            }
            t
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kern for Avx {
    type F = kvant_kernels::vecops::Fused;

    #[inline(always)]
    unsafe fn dot<A: Elem, B: Elem>(a: &[A], b: &[B]) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2, FMA, F16C).
        unsafe { avx_red::reduce2(a, b, |x, y, s| _mm256_fmadd_ps(x, y, s), |x, y| x * y) }
    }

    #[inline(always)]
    unsafe fn dot_dev<A: Elem, B: Elem>(a: &[A], b: &[B], m: f32) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2, FMA, F16C).
        unsafe {
            let mv = _mm256_set1_ps(m);
            avx_red::reduce2(
                a,
                b,
                |x, y, s| _mm256_fmadd_ps(x, _mm256_sub_ps(y, mv), s),
                |x, y| x * (y - m),
            )
        }
    }

    #[inline(always)]
    unsafe fn sum<E: Elem>(a: &[E]) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; `a` is read twice as the second
        // operand and ignored.
        unsafe { avx_red::reduce2(a, a, |x, _, s| _mm256_add_ps(x, s), |x, _| x) }
    }

    #[inline(always)]
    unsafe fn sq_dev<E: Elem>(a: &[E], m: f32) -> f32 {
        use std::arch::x86_64::*;
        // SAFETY: as in `sum`.
        unsafe {
            let mv = _mm256_set1_ps(m);
            avx_red::reduce2(
                a,
                a,
                |x, _, s| {
                    let d = _mm256_sub_ps(x, mv);
                    _mm256_fmadd_ps(d, d, s)
                },
                |x, _| (x - m) * (x - m),
            )
        }
    }

    #[inline(always)]
    unsafe fn g_dot<E: Elem, const ROUND: bool>(
        (dy, w, x): (&[E], &[E], &[E]),
        off: f32,
        g: &mut [f32],
    ) -> f32 {
        use std::arch::x86_64::*;
        let n = g.len().min(dy.len()).min(w.len()).min(x.len());
        // SAFETY: AVX2/FMA/F16C by the caller's contract; every load and
        // store covers 8 values at j + 8 <= n.
        unsafe {
            let offv = _mm256_set1_ps(off);
            let (pd, pw, px, pg) = (dy.as_ptr(), w.as_ptr(), x.as_ptr(), g.as_mut_ptr());
            let step =
                |j: usize, acc: __m256| avx_red::g_step::<E, ROUND>((pd, pw, px, pg), offv, j, acc);
            // Two chains in registers (an indexed array of them lived on
            // the stack: 12% of the backward's time).
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut j = 0;
            while j + 16 <= n {
                a0 = step(j, a0);
                a1 = step(j + 8, a1);
                j += 16;
            }
            if j + 8 <= n {
                a0 = step(j, a0);
                j += 8;
            }
            let acc = [a0, a1];
            let mut a = [0f32; 8];
            _mm256_storeu_ps(a.as_mut_ptr(), _mm256_add_ps(acc[0], acc[1]));
            let mut t = hsum8(a);
            for k in j..n {
                let p = dy[k].to_f32() * (off + w[k].to_f32());
                g[k] = if ROUND { round::<E>(p) } else { p };
                t += g[k] * x[k].to_f32();
            }
            t
        }
    }
}

/// `v` rounded to `E` and back (identity for f32).
#[inline(always)]
fn round<E: Elem>(v: f32) -> f32 {
    E::from_f32(v).to_f32()
}

// ---------------------------------------------------------------- RMSNorm

/// The tensors of an RMSNorm forward over rows of [`RmsNormArgs::cols`]:
/// plain, or fused with the residual add when `residual` and `sum` are
/// given. Chunks of rows are views of the same type.
pub struct RmsFwd<'a, E> {
    pub x: &'a [E],
    /// Added to `x` before the norm (the fused add); given exactly when `sum` is.
    pub residual: Option<&'a [E]>,
    /// The weight, `cols` values.
    pub w: &'a [E],
    pub y: &'a mut [E],
    /// `x + residual` rounded to `E`: what is normalized, for the backward.
    pub sum: Option<&'a mut [E]>,
    /// `1/sqrt(mean(x²) + eps)` per row (f32), for the backward.
    pub rstd: &'a mut [f32],
}

impl<'a, E> RmsFwd<'a, E> {
    /// A plain RMSNorm forward (no residual add).
    pub fn new(x: &'a [E], w: &'a [E], y: &'a mut [E], rstd: &'a mut [f32]) -> Self {
        RmsFwd {
            x,
            residual: None,
            w,
            y,
            sum: None,
            rstd,
        }
    }
}

impl<E> RmsFwd<'_, E> {
    /// The checks shared by [`rms_norm_fwd`] and its reference; returns the row count.
    fn check(&self, op: &'static str, a: &RmsNormArgs) -> Result<usize, KernelError> {
        let n = self.x.len();
        let rows = check_rows(op, n, a.cols, a.eps)?;
        check_offset(op, a)?;
        check_len("rms_norm weight", a.cols, self.w.len())?;
        check_len("rms_norm y", n, self.y.len())?;
        check_len("rms_norm rstd", rows, self.rstd.len())?;
        match (self.residual, self.sum.as_deref()) {
            (Some(r), Some(s)) => {
                check_len("add_rms_norm residual", n, r.len())?;
                check_len("add_rms_norm sum", n, s.len())?;
            }
            (None, None) => {}
            _ => {
                return Err(KernelError::InvalidShape {
                    op,
                    why: "residual and sum are given together (the fused add) or not at all".into(),
                })
            }
        }
        Ok(rows)
    }
}

/// The tensors of an RMSNorm backward; with `dsum`, the fused add's.
pub struct RmsBwd<'a, E> {
    pub dy: &'a [E],
    /// The gradient flowing into the fused add's `sum` from elsewhere,
    /// added to `dx`, which is then the gradient of both `x` and `residual`.
    pub dsum: Option<&'a [E]>,
    /// What the forward normalized: `x`, or the fused add's `sum`.
    pub x: &'a [E],
    pub w: &'a [E],
    /// As the forward saved it.
    pub rstd: &'a [f32],
    pub dx: &'a mut [E],
    /// `cols` values (f32), overwritten with the sum over rows; in a
    /// chunk's view, the chunk's own partial sum, added to.
    pub dw: &'a mut [f32],
}

impl<'a, E> RmsBwd<'a, E> {
    /// A plain RMSNorm backward (no fused add).
    pub fn new(
        dy: &'a [E],
        x: &'a [E],
        w: &'a [E],
        rstd: &'a [f32],
        dx: &'a mut [E],
        dw: &'a mut [f32],
    ) -> Self {
        RmsBwd {
            dy,
            dsum: None,
            x,
            w,
            rstd,
            dx,
            dw,
        }
    }
}

impl<'a, E: Elem> NormBwd<'a, E, 1> for RmsBwd<'a, E> {
    type Args = RmsNormArgs;
    const OP: &'static str = "rms_norm_bwd";

    fn cols(a: &RmsNormArgs) -> usize {
        a.cols
    }

    fn check(&self, op: &'static str, a: &RmsNormArgs) -> Result<usize, KernelError> {
        let n = self.x.len();
        let rows = check_rows(op, n, a.cols, a.eps)?;
        check_offset(op, a)?;
        check_len("rms_norm dy", n, self.dy.len())?;
        check_len("rms_norm weight", a.cols, self.w.len())?;
        check_len("rms_norm rstd", rows, self.rstd.len())?;
        check_len("rms_norm dx", n, self.dx.len())?;
        check_len("rms_norm dw", a.cols, self.dw.len())?;
        if let Some(d) = self.dsum {
            check_len("add_rms_norm dsum", n, d.len())?;
        }
        Ok(rows)
    }

    fn take_outputs(&mut self) -> (&'a mut [E], [&'a mut [f32]; 1]) {
        (std::mem::take(&mut self.dx), [std::mem::take(&mut self.dw)])
    }

    fn rows_on(&self, tier: SimdTier, a: &RmsNormArgs, c: ChunkOut<'_, E, 1>, g: &mut [f32]) {
        let (rr, er, dx, [dw]) = c;
        let part = RmsBwd {
            dy: &self.dy[er.clone()],
            dsum: self.dsum.map(|d| &d[er.clone()]),
            x: &self.x[er],
            w: self.w,
            rstd: &self.rstd[rr],
            dx,
            dw,
        };
        rms_bwd_on(tier, a, part, g)
    }
}

/// Forward of a chunk of rows: `rstd.len()` rows. With a residual, `sum`
/// is written first (`x + residual` rounded) and normalized.
#[inline(always)]
fn rms_fwd_rows<E: Elem, K: Kern>(a: &RmsNormArgs, mut t: RmsFwd<'_, E>) {
    let n = a.cols;
    for (i, r_out) in t.rstd.iter_mut().enumerate() {
        let xr = &t.x[i * n..][..n];
        let yr = &mut t.y[i * n..][..n];
        let src: &[E] = match (t.residual, t.sum.as_deref_mut()) {
            (Some(res), Some(sum)) => {
                let sr = &mut sum[i * n..][..n];
                for ((s, u), v) in sr.iter_mut().zip(xr).zip(&res[i * n..][..n]) {
                    *s = E::from_f32(u.to_f32() + v.to_f32());
                }
                sr
            }
            _ => xr,
        };
        // SAFETY (every `K::` call below): bodies run with `K` only inside
        // the tier's wrapper, entered after `cpu::clamp` checked the CPU.
        let r = 1.0 / (unsafe { K::dot(src, src) } / n as f32 + a.eps).sqrt();
        *r_out = r;
        let off = a.offset;
        match a.casting {
            RmsCasting::Llama => {
                for ((o, v), wv) in yr.iter_mut().zip(src).zip(t.w) {
                    let h = round::<E>(v.to_f32() * r);
                    *o = E::from_f32(h * (off + wv.to_f32()));
                }
            }
            RmsCasting::Gemma => {
                for ((o, v), wv) in yr.iter_mut().zip(src).zip(t.w) {
                    *o = E::from_f32(v.to_f32() * r * (off + wv.to_f32()));
                }
            }
        }
    }
}

/// Backward of a chunk of rows (`t.dw` accumulates this chunk's weight
/// gradient); `g` is scratch of `cols`.
#[inline(always)]
fn rms_bwd_rows<E: Elem, K: Kern>(a: &RmsNormArgs, t: RmsBwd<'_, E>, g: &mut [f32]) {
    let n = a.cols;
    let llama = a.casting == RmsCasting::Llama;
    for (i, &r) in t.rstd.iter().enumerate() {
        let dyr = &t.dy[i * n..][..n];
        let xr = &t.x[i * n..][..n];
        let dxr = &mut t.dx[i * n..][..n];
        // g = dy·(offset + w), torch's bf16 product under Llama casting.
        // SAFETY: as in `rms_fwd_rows`.
        let sgx = unsafe {
            match llama {
                true => K::g_dot::<E, true>((dyr, t.w, xr), a.offset, g),
                false => K::g_dot::<E, false>((dyr, t.w, xr), a.offset, g),
            }
        };
        let c = r * r * r * sgx / n as f32;
        let ahead = Ahead::after([t.dy, t.x, t.dsum.unwrap_or(&[])], i, n);
        let dsr = t.dsum.map(|d| &d[i * n..][..n]);
        for b in blocks::<E>(n) {
            ahead.fetch(b.clone());
            let rows = (&dyr[b.clone()], &xr[b.clone()], &g[b.clone()]);
            let (dxr, dw) = (&mut dxr[b.clone()], &mut t.dw[b.clone()]);
            match (llama, dsr) {
                (true, Some(d)) => rms_dx_dw::<E, K, true, true>(rows, &d[b], (r, c), dxr, dw),
                (true, None) => rms_dx_dw::<E, K, true, false>(rows, rows.0, (r, c), dxr, dw),
                (false, Some(d)) => rms_dx_dw::<E, K, false, true>(rows, &d[b], (r, c), dxr, dw),
                (false, None) => rms_dx_dw::<E, K, false, false>(rows, rows.0, (r, c), dxr, dw),
            }
        }
    }
}

/// RMSNorm backward's second pass over a row, one loop: `dx = r·g − c·x
/// (+ dsum)` and `dw += dy·h`, `h = x·r` (rounded to `E` under Llama
/// casting, as torch's saved bf16 `h`). Each is a compile-time variant.
#[inline(always)]
fn rms_dx_dw<E: Elem, K: Kern, const LLAMA: bool, const DSUM: bool>(
    (dy, x, g): (&[E], &[E], &[f32]),
    dsum: &[E],
    (r, c): (f32, f32),
    dx: &mut [E],
    dw: &mut [f32],
) {
    let n = dx.len();
    let (dy, x, g, dsum, dw) = (&dy[..n], &x[..n], &g[..n], &dsum[..n], &mut dw[..n]);
    for j in 0..n {
        let v = x[j].to_f32();
        let mut d = K::F::fma(r, g[j], -c * v);
        if DSUM {
            d += dsum[j].to_f32();
        }
        dx[j] = E::from_f32(d);
        let h = if LLAMA { round::<E>(v * r) } else { v * r };
        dw[j] = K::F::fma(dy[j].to_f32(), h, dw[j]);
    }
}

// ---------------------------------------------------------------- LayerNorm

/// The tensors of a LayerNorm forward over rows of `cols`; chunks of rows
/// are views of the same type.
pub struct LnFwd<'a, E> {
    pub x: &'a [E],
    /// The weight and the bias, `cols` values each.
    pub w: &'a [E],
    pub b: &'a [E],
    pub y: &'a mut [E],
    /// Per row (f32), for the backward.
    pub mean: &'a mut [f32],
    pub rstd: &'a mut [f32],
}

impl<E> LnFwd<'_, E> {
    /// The checks shared by [`layer_norm_fwd`] and its reference; returns the row count.
    fn check(&self, op: &'static str, cols: usize, eps: f32) -> Result<usize, KernelError> {
        let rows = check_rows(op, self.x.len(), cols, eps)?;
        check_len("layer_norm weight", cols, self.w.len())?;
        check_len("layer_norm bias", cols, self.b.len())?;
        check_len("layer_norm y", self.x.len(), self.y.len())?;
        check_len("layer_norm mean", rows, self.mean.len())?;
        check_len("layer_norm rstd", rows, self.rstd.len())?;
        Ok(rows)
    }
}

/// The tensors of a LayerNorm backward.
pub struct LnBwd<'a, E> {
    pub dy: &'a [E],
    pub x: &'a [E],
    pub w: &'a [E],
    /// As the forward saved them.
    pub mean: &'a [f32],
    pub rstd: &'a [f32],
    pub dx: &'a mut [E],
    /// `cols` values each (f32), overwritten with the sums over rows; in a
    /// chunk's view, the chunk's own partial sums, added to.
    pub dw: &'a mut [f32],
    pub db: &'a mut [f32],
}

impl<'a, E: Elem> NormBwd<'a, E, 2> for LnBwd<'a, E> {
    /// The row width.
    type Args = usize;
    const OP: &'static str = "layer_norm_bwd";

    fn cols(&cols: &usize) -> usize {
        cols
    }

    fn check(&self, op: &'static str, &cols: &usize) -> Result<usize, KernelError> {
        let rows = check_rows(op, self.x.len(), cols, 0.0)?;
        check_len("layer_norm dy", self.x.len(), self.dy.len())?;
        check_len("layer_norm weight", cols, self.w.len())?;
        check_len("layer_norm mean", rows, self.mean.len())?;
        check_len("layer_norm rstd", rows, self.rstd.len())?;
        check_len("layer_norm dx", self.x.len(), self.dx.len())?;
        check_len("layer_norm dw", cols, self.dw.len())?;
        check_len("layer_norm db", cols, self.db.len())?;
        Ok(rows)
    }

    fn take_outputs(&mut self) -> (&'a mut [E], [&'a mut [f32]; 2]) {
        let grads = [std::mem::take(&mut self.dw), std::mem::take(&mut self.db)];
        (std::mem::take(&mut self.dx), grads)
    }

    fn rows_on(&self, tier: SimdTier, &n: &usize, c: ChunkOut<'_, E, 2>, g: &mut [f32]) {
        let (rr, er, dx, [dw, db]) = c;
        let part = LnBwd {
            dy: &self.dy[er.clone()],
            x: &self.x[er],
            w: self.w,
            mean: &self.mean[rr.clone()],
            rstd: &self.rstd[rr],
            dx,
            dw,
            db,
        };
        ln_bwd_on(tier, n, part, g)
    }
}

/// Forward of a chunk of rows (`t.mean.len()`) of `n`.
#[inline(always)]
fn ln_fwd_rows<E: Elem, K: Kern>(n: usize, eps: f32, t: LnFwd<'_, E>) {
    for (i, (m_out, r_out)) in t.mean.iter_mut().zip(t.rstd.iter_mut()).enumerate() {
        let xr = &t.x[i * n..][..n];
        // SAFETY: as in `rms_fwd_rows`. Two passes (mean, then squared
        // deviations from it) as torch: the row is in L1 for the second.
        let m = unsafe { K::sum(xr) } / n as f32;
        let r = 1.0 / (unsafe { K::sq_dev(xr, m) } / n as f32 + eps).sqrt();
        (*m_out, *r_out) = (m, r);
        for ((o, v), (wv, bv)) in t.y[i * n..][..n]
            .iter_mut()
            .zip(xr)
            .zip(t.w.iter().zip(t.b))
        {
            *o = E::from_f32(K::F::fma((v.to_f32() - m) * r, wv.to_f32(), bv.to_f32()));
        }
    }
}

/// Backward of a chunk of rows (`t.dw`, `t.db` accumulate this chunk's
/// weight and bias gradients); `g` is scratch of `n`.
#[inline(always)]
fn ln_bwd_rows<E: Elem, K: Kern>(n: usize, t: LnBwd<'_, E>, g: &mut [f32]) {
    for (i, (&m, &r)) in t.mean.iter().zip(t.rstd).enumerate() {
        let dyr = &t.dy[i * n..][..n];
        let xr = &t.x[i * n..][..n];
        // g = dy·w (kept), then Σ g and Σ g·x̂ = r·Σ g·(x − μ).
        for ((gv, d), wv) in g.iter_mut().zip(dyr).zip(t.w) {
            *gv = d.to_f32() * wv.to_f32();
        }
        // SAFETY: as in `rms_fwd_rows`.
        let (tg, tgx) = unsafe { (K::sum(&*g), r * K::dot_dev(&*g, xr, m)) };
        let (mg, mgx) = (tg / n as f32, tgx / n as f32);
        // dx, dw and db in one loop (two loops: LayerNorm backward ran at
        // 52% of the bandwidth in f32), the next row's dy and x prefetched.
        let (dxr, gr) = (&mut t.dx[i * n..][..n], &g[..n]);
        let ahead = Ahead::after([t.dy, t.x], i, n);
        for c in blocks::<E>(n) {
            ahead.fetch(c.clone());
            let (dyr, xr, gr) = (&dyr[c.clone()], &xr[c.clone()], &gr[c.clone()]);
            let (dxr, dw, db) = (&mut dxr[c.clone()], &mut t.dw[c.clone()], &mut t.db[c]);
            for j in 0..dxr.len() {
                let xh = (xr[j].to_f32() - m) * r;
                dxr[j] = E::from_f32(r * (gr[j] - mg - xh * mgx));
                let d = dyr[j].to_f32();
                dw[j] = K::F::fma(d, xh, dw[j]);
                db[j] += d;
            }
        }
    }
}

/// The same columns of the next row of a few row-major tensors, prefetched
/// into L2 block by block while a backward's last pass over the current
/// row runs. That pass reads the row from L1 and issues no reads to
/// memory, so with the hardware prefetchers alone memory sat idle during
/// it. 4096×4096, 2 threads, Zen 4 VM, medians of 30 calls alternated with
/// and without, four runs: LayerNorm backward 1.09–1.23× faster (f32) and
/// 1.15–1.23× (bf16), RMSNorm backward 1.06–1.13× and 1.06–1.09×. The
/// forwards measured 0.98–1.07×, within the noise, and do without.
struct Ahead<'a, E, const N: usize>([&'a [E]; N]);

impl<'a, E, const N: usize> Ahead<'a, E, N> {
    /// Row `i + 1` (width `n`) of each tensor; empty past the last row.
    #[inline(always)]
    fn after(tensors: [&'a [E]; N], i: usize, n: usize) -> Self {
        Ahead(tensors.map(|t| t.get((i + 1) * n..(i + 2) * n).unwrap_or(&[])))
    }

    /// Prefetches columns `r` of each next row (none where it is empty).
    #[inline(always)]
    fn fetch(&self, r: std::ops::Range<usize>) {
        for t in &self.0 {
            if let Some(s) = t.get(r.clone()) {
                prefetch_l2(s);
            }
        }
    }
}

/// A row's columns in blocks of 1 KiB of `E`, the unit of [`Ahead`]
/// (256 B and 4 KiB blocks measured the same).
#[inline(always)]
fn blocks<E>(n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = 1024 / std::mem::size_of::<E>();
    (0..n).step_by(step).map(move |b| b..(b + step).min(n))
}

/// Prefetches the lines of `s` into L2 (`prefetcht1`: into L1 the
/// prefetches of the attention kernels evicted the rows being read).
#[inline(always)]
fn prefetch_l2<E>(s: &[E]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let p = s.as_ptr() as *const i8;
        for off in (0..std::mem::size_of_val(s)).step_by(64) {
            // SAFETY: a prefetch never faults; the address is inside `s`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

// ------------------------------------------------------- tiers per chunk

// The row kernels, compiled once per tier: the same generic bodies, with
// the tier's features enabled so the compiler vectorizes them 8 (AVX2) or
// 16 (AVX-512) lanes wide.
kvant_kernels::per_tier! {
    /// [`rms_fwd_rows`] on `tier`.
    fn rms_fwd_on<E: Elem>(tier: SimdTier, a: &RmsNormArgs, t: RmsFwd<'_, E>) [K = Scalar, Avx] {
        rms_fwd_rows::<E, K>(a, t)
    }

    /// [`rms_bwd_rows`] on `tier`.
    fn rms_bwd_on<E: Elem>(tier: SimdTier, a: &RmsNormArgs, t: RmsBwd<'_, E>, g: &mut [f32])
        [K = Scalar, Avx]
    {
        rms_bwd_rows::<E, K>(a, t, g)
    }

    /// [`ln_fwd_rows`] on `tier`.
    fn ln_fwd_on<E: Elem>(tier: SimdTier, n: usize, eps: f32, t: LnFwd<'_, E>) [K = Scalar, Avx] {
        ln_fwd_rows::<E, K>(n, eps, t)
    }

    /// [`ln_bwd_rows`] on `tier`.
    fn ln_bwd_on<E: Elem>(tier: SimdTier, n: usize, t: LnBwd<'_, E>, g: &mut [f32])
        [K = Scalar, Avx]
    {
        ln_bwd_rows::<E, K>(n, t, g)
    }

    /// [`add_partials_body`] on `tier`.
    fn add_partials_on(
        tier: SimdTier,
        parts: &[f32],
        stride: usize,
        cols: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        add_partials_body(parts, stride, cols, out)
    }
}

/// `out[j − lo] = Σ_c parts[c·stride + j]` over `j` in `cols`, chunks in order.
#[inline(always)]
fn add_partials_body(parts: &[f32], stride: usize, cols: std::ops::Range<usize>, out: &mut [f32]) {
    out.fill(0.0);
    for p in parts.chunks_exact(stride) {
        for (o, v) in out.iter_mut().zip(&p[cols.clone()]) {
            *o += v;
        }
    }
}

/// Sums `parts` (`chunks × cols`) over the chunks, in chunk order, into
/// `out`, the columns split over the pool.
fn add_partials(pool: &ThreadPool, tier: SimdTier, parts: &[f32], cols: usize, out: &mut [f32]) {
    let col_chunk = if parts.len() <= MIN_CHUNK_ELEMS {
        cols.max(1)
    } else {
        1024
    };
    let out_s = DisjointSlice::new(out);
    pool.run(cols.div_ceil(col_chunk), &|t| {
        let r = t * col_chunk..((t + 1) * col_chunk).min(cols);
        // SAFETY: tasks own disjoint column ranges.
        let o = unsafe { out_s.range(r.clone()) };
        add_partials_on(tier, parts, cols, r, o)
    });
}

// ---------------------------------------------------------------- checks

fn check_rows(op: &'static str, x_len: usize, cols: usize, eps: f32) -> Result<usize, KernelError> {
    if cols == 0 {
        return Err(KernelError::InvalidShape {
            op,
            why: "cols must be at least 1".into(),
        });
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(KernelError::InvalidShape {
            op,
            why: format!("eps must be finite and >= 0, got {eps}"),
        });
    }
    if !x_len.is_multiple_of(cols) {
        return Err(KernelError::InvalidShape {
            op,
            why: format!("{x_len} values are not whole rows of {cols}"),
        });
    }
    Ok(x_len / cols)
}

fn check_offset(op: &'static str, a: &RmsNormArgs) -> Result<(), KernelError> {
    if a.offset.is_finite() {
        Ok(())
    } else {
        Err(KernelError::InvalidShape {
            op,
            why: format!("offset must be finite, got {}", a.offset),
        })
    }
}

// ------------------------------------------------------------- chunks

/// Runs `f(c, rows, elements)` on the pool for each chunk `c` of
/// [`row_chunk`] rows of `rows × n` values.
fn for_row_chunks(
    pool: &ThreadPool,
    rows: usize,
    n: usize,
    f: impl Fn(usize, Range<usize>, Range<usize>) + Sync,
) {
    let cr = row_chunk(rows, n);
    pool.run(rows.div_ceil(cr), &|c| {
        let rr = c * cr..((c + 1) * cr).min(rows);
        let er = rr.start * n..rr.end * n;
        f(c, rr, er)
    });
}

/// [`for_row_chunks`] for a backward whose `K` parameter gradients (`n`
/// values each) are sums over rows: `f(rows, elements, partials)` adds a
/// chunk's rows into `K` zeroed partial rows of the chunk's own, which are
/// then added in chunk order into `grads`, so the sums do not depend on
/// the thread count. No rows: `grads` are zeroed.
fn weight_grad_chunks<const K: usize>(
    (pool, tier): (&ThreadPool, SimdTier),
    op: &'static str,
    (rows, n): (usize, usize),
    mut grads: [&mut [f32]; K],
    f: impl Fn(Range<usize>, Range<usize>, [&mut [f32]; K]) + Sync,
) -> Result<(), KernelError> {
    let chunks = rows.div_ceil(row_chunk(rows, n));
    if chunks == 0 {
        grads.iter_mut().for_each(|g| g.fill(0.0));
        return Ok(());
    }
    // Partial row k of chunk c at K·c + k.
    let mut parts = vec![0f32; checked_mul(op, K * chunks, n)?];
    let p_s = DisjointSlice::new(&mut parts);
    for_row_chunks(pool, rows, n, |c, rr, er| {
        let partials = std::array::from_fn(|k| {
            let at = (K * c + k) * n;
            // SAFETY: chunk `c` owns partial rows K·c to K·c + K − 1.
            let p = unsafe { p_s.range(at..at + n) };
            zero_first(p);
            p
        });
        f(rr, er, partials)
    });
    if let [g] = &mut grads[..] {
        add_partials(pool, tier, &parts, n, g);
    } else {
        // Viewed with stride K·n, column k·n + j is gradient k's column j.
        let mut all = vec![0f32; K * n];
        add_partials(pool, tier, &parts, K * n, &mut all);
        for (g, s) in grads.iter_mut().zip(all.chunks_exact(n)) {
            g.copy_from_slice(s);
        }
    }
    Ok(())
}

// ------------------------------------------------------- backward driver

/// A chunk's share of a backward's outputs: its rows, its elements, its
/// rows of `dx` and its own partial rows of the `K` parameter gradients.
type ChunkOut<'b, E, const K: usize> =
    (Range<usize>, Range<usize>, &'b mut [E], [&'b mut [f32]; K]);

/// A backward's tensors as [`norm_bwd_in`] drives them, `K` the number of
/// parameter gradients summed over rows (RMSNorm's `dw`; LayerNorm's `dw`
/// and `db`).
pub(crate) trait NormBwd<'a, E, const K: usize>: Sync {
    /// The arguments besides the tensors.
    type Args: Sync;
    /// The kernel's name in errors.
    const OP: &'static str;
    fn cols(a: &Self::Args) -> usize;
    /// The checks shared by the kernel and its reference; returns the row count.
    fn check(&self, op: &'static str, a: &Self::Args) -> Result<usize, KernelError>;
    /// `dx` and the parameter gradients, moved out (left empty) to be split.
    fn take_outputs(&mut self) -> (&'a mut [E], [&'a mut [f32]; K]);
    /// The row kernel on `tier` over the chunk `c` of the inputs; `g` is
    /// scratch of `cols`.
    fn rows_on(&self, tier: SimdTier, a: &Self::Args, c: ChunkOut<'_, E, K>, g: &mut [f32]);
}

/// A backward on `pool` (the public kernels use the global one; the
/// thread-count test passes its own): checks, then the rows in chunks
/// (see [`weight_grad_chunks`]) on `tier`.
pub(crate) fn norm_bwd_in<'a, E: Elem, T: NormBwd<'a, E, K>, const K: usize>(
    pool: &ThreadPool,
    tier: SimdTier,
    a: &T::Args,
    mut t: T,
) -> Result<(), KernelError> {
    let rows = t.check(T::OP, a)?;
    let tier = cpu::clamp(tier);
    let n = T::cols(a);
    let (dx, grads) = t.take_outputs();
    let dx_s = DisjointSlice::new(dx);
    weight_grad_chunks((pool, tier), T::OP, (rows, n), grads, |rr, er, grads| {
        let mut g = vec![0f32; n];
        // SAFETY: chunk `c` owns rows `rr` (elements `er`) of dx.
        let dx = unsafe { dx_s.range(er.clone()) };
        t.rows_on(tier, a, (rr, er, dx, grads), &mut g)
    })
}

// ------------------------------------------------------------- public API

/// RMSNorm forward, plain or fused with the residual add (see
/// [`RmsFwd`]), on `tier` (lowered to one the CPU supports;
/// [`cpu::tier`] is the process's own).
pub fn rms_norm_fwd<E: Elem>(
    tier: SimdTier,
    a: RmsNormArgs,
    t: RmsFwd<'_, E>,
) -> Result<(), KernelError> {
    let rows = t.check("rms_norm_fwd", &a)?;
    let tier = cpu::clamp(tier);
    let (y, sum, rstd) = (
        DisjointSlice::new(t.y),
        t.sum.map(DisjointSlice::new),
        DisjointSlice::new(t.rstd),
    );
    for_row_chunks(pool::global(), rows, a.cols, |_, rr, er| {
        // SAFETY: chunk `c` owns rows `rr` (elements `er`) of every output.
        let part = unsafe {
            RmsFwd {
                x: &t.x[er.clone()],
                residual: t.residual.map(|r| &r[er.clone()]),
                w: t.w,
                y: y.range(er.clone()),
                sum: sum.as_ref().map(|s| s.range(er)),
                rstd: rstd.range(rr),
            }
        };
        rms_fwd_on(tier, &a, part)
    });
    Ok(())
}

/// RMSNorm backward, plain or of the fused add (see [`RmsBwd`]), on `tier`.
pub fn rms_norm_bwd<E: Elem>(
    tier: SimdTier,
    a: RmsNormArgs,
    t: RmsBwd<'_, E>,
) -> Result<(), KernelError> {
    norm_bwd_in(pool::global(), tier, &a, t)
}

/// LayerNorm forward with weight and bias over rows of `cols`, on `tier`.
pub fn layer_norm_fwd<E: Elem>(
    tier: SimdTier,
    cols: usize,
    eps: f32,
    t: LnFwd<'_, E>,
) -> Result<(), KernelError> {
    let rows = t.check("layer_norm_fwd", cols, eps)?;
    let tier = cpu::clamp(tier);
    let (y, mean, rstd) = (
        DisjointSlice::new(t.y),
        DisjointSlice::new(t.mean),
        DisjointSlice::new(t.rstd),
    );
    for_row_chunks(pool::global(), rows, cols, |_, rr, er| {
        // SAFETY: chunk `c` owns rows `rr` (elements `er`) of every output.
        let part = unsafe {
            LnFwd {
                x: &t.x[er.clone()],
                w: t.w,
                b: t.b,
                y: y.range(er),
                mean: mean.range(rr.clone()),
                rstd: rstd.range(rr),
            }
        };
        ln_fwd_on(tier, cols, eps, part)
    });
    Ok(())
}

/// LayerNorm backward over rows of `cols`, on `tier`.
pub fn layer_norm_bwd<E: Elem>(
    tier: SimdTier,
    cols: usize,
    t: LnBwd<'_, E>,
) -> Result<(), KernelError> {
    norm_bwd_in(pool::global(), tier, &cols, t)
}

// ------------------------------------------------------------ references

/// Rounding of an f64 to `E` (through f32) and back, for the references.
fn round_ref<E: Elem>(v: f64) -> f64 {
    E::from_f32(v as f32).to_f32() as f64
}

fn widen<E: Elem>(v: &[E]) -> Vec<f64> {
    v.iter().map(|x| x.to_f32() as f64).collect()
}

/// One RMSNorm row in f64; returns rstd. `rnd` rounds to the input type
/// where Llama casting does (the identity for the gradient check).
pub(crate) fn rms_row_f64(
    x: &[f64],
    w: &[f64],
    a: &RmsNormArgs,
    rnd: &dyn Fn(f64) -> f64,
    y: &mut [f64],
) -> f64 {
    let n = x.len() as f64;
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / n + a.eps as f64).sqrt();
    let off = a.offset as f64;
    for ((o, v), wv) in y.iter_mut().zip(x).zip(w) {
        *o = match a.casting {
            RmsCasting::Llama => rnd(v * r) * (off + wv),
            RmsCasting::Gemma => v * r * (off + wv),
        };
    }
    r
}

/// One RMSNorm row's backward in f64: writes dx, adds to dw.
pub(crate) fn rms_row_bwd_f64(
    (dy, x, w): (&[f64], &[f64], &[f64]),
    r: f64,
    a: &RmsNormArgs,
    rnd: &dyn Fn(f64) -> f64,
    dx: &mut [f64],
    dw: &mut [f64],
) {
    let n = x.len() as f64;
    let llama = a.casting == RmsCasting::Llama;
    let off = a.offset as f64;
    let g: Vec<f64> = dy
        .iter()
        .zip(w)
        .map(|(d, wv)| {
            if llama {
                rnd(d * (off + wv))
            } else {
                d * (off + wv)
            }
        })
        .collect();
    let sgx: f64 = g.iter().zip(x).map(|(g, v)| g * v).sum();
    for j in 0..x.len() {
        dx[j] = r * g[j] - x[j] * r * r * r * sgx / n;
        let h = if llama { rnd(x[j] * r) } else { x[j] * r };
        dw[j] += dy[j] * h;
    }
}

/// f64 reference of [`rms_norm_fwd`].
pub fn rms_norm_fwd_ref<E: Elem>(a: RmsNormArgs, mut t: RmsFwd<'_, E>) -> Result<(), KernelError> {
    t.check("rms_norm_fwd_ref", &a)?;
    let n = a.cols;
    let wf = widen(t.w);
    let mut yr = vec![0f64; n];
    for (i, r_out) in t.rstd.iter_mut().enumerate() {
        let e = i * n..(i + 1) * n;
        let mut xr = widen(&t.x[e.clone()]);
        if let (Some(res), Some(s)) = (t.residual, t.sum.as_deref_mut()) {
            for (j, v) in xr.iter_mut().enumerate() {
                let t = E::from_f32((*v + res[e.start + j].to_f32() as f64) as f32);
                s[e.start + j] = t;
                *v = t.to_f32() as f64;
            }
        }
        *r_out = rms_row_f64(&xr, &wf, &a, &round_ref::<E>, &mut yr) as f32;
        for (o, v) in t.y[e].iter_mut().zip(&yr) {
            *o = E::from_f32(*v as f32);
        }
    }
    Ok(())
}

/// f64 reference of [`rms_norm_bwd`] (with the saved f32 rstd).
pub fn rms_norm_bwd_ref<E: Elem>(a: RmsNormArgs, t: RmsBwd<'_, E>) -> Result<(), KernelError> {
    t.check("rms_norm_bwd_ref", &a)?;
    let n = a.cols;
    let wf = widen(t.w);
    let mut dwf = vec![0f64; n];
    let mut dxr = vec![0f64; n];
    for (i, &r) in t.rstd.iter().enumerate() {
        let e = i * n..(i + 1) * n;
        let (dyr, xr) = (widen(&t.dy[e.clone()]), widen(&t.x[e.clone()]));
        let r = r as f64;
        rms_row_bwd_f64((&dyr, &xr, &wf), r, &a, &round_ref::<E>, &mut dxr, &mut dwf);
        for (j, o) in t.dx[e.clone()].iter_mut().enumerate() {
            let extra = t.dsum.map_or(0.0, |d| d[e.start + j].to_f32() as f64);
            *o = E::from_f32((dxr[j] + extra) as f32);
        }
    }
    for (o, v) in t.dw.iter_mut().zip(&dwf) {
        *o = *v as f32;
    }
    Ok(())
}

/// One LayerNorm row in f64; returns (mean, rstd).
pub(crate) fn ln_row_f64(x: &[f64], w: &[f64], b: &[f64], eps: f64, y: &mut [f64]) -> (f64, f64) {
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n;
    let r = 1.0 / (var + eps).sqrt();
    for ((o, v), (wv, bv)) in y.iter_mut().zip(x).zip(w.iter().zip(b)) {
        *o = (v - m) * r * wv + bv;
    }
    (m, r)
}

/// One LayerNorm row's backward in f64: writes dx, adds to dw and db.
pub(crate) fn ln_row_bwd_f64(
    (dy, x, w): (&[f64], &[f64], &[f64]),
    (m, r): (f64, f64),
    dx: &mut [f64],
    dw: &mut [f64],
    db: &mut [f64],
) {
    let n = x.len() as f64;
    let xh: Vec<f64> = x.iter().map(|v| (v - m) * r).collect();
    let g: Vec<f64> = dy.iter().zip(w).map(|(d, wv)| d * wv).collect();
    let mg = g.iter().sum::<f64>() / n;
    let mgx = g.iter().zip(&xh).map(|(g, h)| g * h).sum::<f64>() / n;
    for j in 0..x.len() {
        dx[j] = r * (g[j] - mg - xh[j] * mgx);
        dw[j] += dy[j] * xh[j];
        db[j] += dy[j];
    }
}

/// f64 reference of [`layer_norm_fwd`].
pub fn layer_norm_fwd_ref<E: Elem>(
    cols: usize,
    eps: f32,
    t: LnFwd<'_, E>,
) -> Result<(), KernelError> {
    let rows = t.check("layer_norm_fwd_ref", cols, eps)?;
    let (wf, bf) = (widen(t.w), widen(t.b));
    let mut yr = vec![0f64; cols];
    for i in 0..rows {
        let e = i * cols..(i + 1) * cols;
        let (m, r) = ln_row_f64(&widen(&t.x[e.clone()]), &wf, &bf, eps as f64, &mut yr);
        (t.mean[i], t.rstd[i]) = (m as f32, r as f32);
        for (o, v) in t.y[e].iter_mut().zip(&yr) {
            *o = E::from_f32(*v as f32);
        }
    }
    Ok(())
}

/// f64 reference of [`layer_norm_bwd`] (with the saved f32 mean and rstd).
pub fn layer_norm_bwd_ref<E: Elem>(cols: usize, t: LnBwd<'_, E>) -> Result<(), KernelError> {
    let rows = t.check("layer_norm_bwd_ref", &cols)?;
    let wf = widen(t.w);
    let (mut dwf, mut dbf, mut dxr) = (vec![0f64; cols], vec![0f64; cols], vec![0f64; cols]);
    for i in 0..rows {
        let e = i * cols..(i + 1) * cols;
        let (dyr, xr) = (widen(&t.dy[e.clone()]), widen(&t.x[e.clone()]));
        let mr = (t.mean[i] as f64, t.rstd[i] as f64);
        ln_row_bwd_f64((&dyr, &xr, &wf), mr, &mut dxr, &mut dwf, &mut dbf);
        for (o, v) in t.dx[e].iter_mut().zip(&dxr) {
            *o = E::from_f32(*v as f32);
        }
    }
    for (o, v) in t.dw.iter_mut().zip(&dwf) {
        *o = *v as f32;
    }
    for (o, v) in t.db.iter_mut().zip(&dbf) {
        *o = *v as f32;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    pub(crate) fn rand_vec<E: Elem>(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<E> {
        (0..n)
            .map(|_| E::from_f32(rng.random_range(lo..hi)))
            .collect()
    }

    pub(crate) fn nans<E: Elem>(n: usize) -> Vec<E> {
        vec![E::from_f32(f32::NAN); n]
    }

    pub(crate) fn f32s<E: Elem>(v: &[E]) -> Vec<f32> {
        v.iter().map(|x| x.to_f32()).collect()
    }

    /// `|got − want| ≤ rtol·|want| + atol·max|want|` element by element
    /// (NaN fails: outputs are poisoned with NaN before each call).
    pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f32], tol: (f32, f32)) {
        assert_close_scaled(what, got, want, tol, max_abs(want))
    }

    pub(crate) fn max_abs(v: &[f32]) -> f32 {
        v.iter().fold(0f32, |m, x| m.max(x.abs()))
    }

    /// As [`assert_close`] with `atol·scale`, for outputs that cancel
    /// (dx = r·g − c·x): `scale` is the size of the terms.
    pub(crate) fn assert_close_scaled(
        what: &str,
        got: &[f32],
        want: &[f32],
        (rtol, atol): (f32, f32),
        scale: f32,
    ) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs();
            assert!(
                err <= rtol * w.abs() + atol * scale + 1e-30,
                "{what}[{i}]: {g} vs {w} (scale {scale})"
            );
        }
    }

    /// Fast path vs f64 reference. f32: sums of up to 4096 f32 terms and
    /// the cancellation in dx (r·g − c·x) carry ~1e-6 of the terms'
    /// magnitude. bf16: where the f32 and f64 values straddle a rounding
    /// boundary one rounding flips by one ulp (2^-8 relative), Llama's two
    /// roundings (and the rounded dy·w in its backward) by up to two; the
    /// absolute part covers dx's cancellation after a flipped g.
    pub(crate) fn tol<E: Elem>() -> (f32, f32) {
        if E::F32 {
            (2e-5, 2e-5)
        } else {
            (1.0 / 128.0, 1.0 / 256.0)
        }
    }

    const SHAPES: [(usize, usize); 7] = [
        (1, 1),
        (7, 31),
        (123, 7),
        (3, 123),
        (5, 1000),
        (2, 33),
        (64, 4096),
    ];

    /// `fast` on `tier`, or `reference` where there is none; either must succeed.
    fn fast_or_ref<T>(
        tier: Option<SimdTier>,
        t: T,
        fast: impl FnOnce(SimdTier, T) -> Result<(), KernelError>,
        reference: impl FnOnce(T) -> Result<(), KernelError>,
    ) {
        let done = match tier {
            Some(tier) => fast(tier, t),
            None => reference(t),
        };
        done.unwrap();
    }

    /// The reference's outputs (`run(None)`), then each tier's
    /// (`run(Some(tier))`) handed to `check` with them; returns the reference's.
    fn vs_reference<O>(run: impl Fn(Option<SimdTier>) -> O, check: impl Fn(SimdTier, O, &O)) -> O {
        let want = run(None);
        for tier in cpu::available_tiers() {
            check(tier, run(Some(tier)), &want);
        }
        want
    }

    /// The checks of a backward's `dx` (which cancels: `atol·dx_scale`)
    /// and `dw` on a tier against the reference's.
    fn assert_dx_dw<E: Elem>(
        what: &str,
        (dx, dw): (&[E], &[f32]),
        (dx0, dw0): (&[E], &[f32]),
        dx_scale: f32,
    ) {
        let t = tol::<E>();
        assert_close_scaled(&format!("dx {what}"), &f32s(dx), &f32s(dx0), t, dx_scale);
        assert_close(&format!("dw {what}"), dw, dw0, t);
    }

    /// A LayerNorm forward's tensors.
    fn ln_t<'a, E>(
        (x, w, b): (&'a [E], &'a [E], &'a [E]),
        y: &'a mut [E],
        (mean, rstd): (&'a mut [f32], &'a mut [f32]),
    ) -> LnFwd<'a, E> {
        LnFwd {
            x,
            w,
            b,
            y,
            mean,
            rstd,
        }
    }

    /// A LayerNorm backward's tensors.
    fn ln_b<'a, E>(
        (dy, x, w): (&'a [E], &'a [E], &'a [E]),
        (mean, rstd): (&'a [f32], &'a [f32]),
        dx: &'a mut [E],
        (dw, db): (&'a mut [f32], &'a mut [f32]),
    ) -> LnBwd<'a, E> {
        LnBwd {
            dy,
            x,
            w,
            mean,
            rstd,
            dx,
            dw,
            db,
        }
    }

    fn rms_case<E: Elem>(
        rng: &mut ChaCha8Rng,
        rows: usize,
        cols: usize,
        a: RmsNormArgs,
        add: bool,
    ) {
        let n = rows * cols;
        let x: Vec<E> = rand_vec(rng, n, -2.0, 2.0);
        let res: Vec<E> = rand_vec(rng, n, -2.0, 2.0);
        let w: Vec<E> = rand_vec(rng, cols, -1.5, 1.5);
        let dy: Vec<E> = rand_vec(rng, n, -1.0, 1.0);
        let dsum: Vec<E> = rand_vec(rng, n, -1.0, 1.0);
        // Forward and backward on a tier, or (None) the reference's; the
        // backwards all start from the reference's sum and rstd.
        let fwd = |tier: Option<SimdTier>| {
            let (mut y, mut s, mut r) = (nans::<E>(n), nans::<E>(n), vec![f32::NAN; rows]);
            let t = RmsFwd {
                residual: add.then_some(&res[..]),
                sum: add.then_some(&mut s[..]),
                ..RmsFwd::new(&x, &w, &mut y, &mut r)
            };
            fast_or_ref(
                tier,
                t,
                |tier, t| rms_norm_fwd(tier, a, t),
                |t| rms_norm_fwd_ref(a, t),
            );
            (y, s, r)
        };
        let t = tol::<E>();
        let what = format!(
            "{rows}x{cols} {a:?} add={add} {}",
            std::any::type_name::<E>()
        );
        let (_, s0, r0) = vs_reference(fwd, |tier, (y, s, r), (y0, s0, r0)| {
            if add {
                assert_close(&format!("sum {what} {tier}"), &f32s(&s), &f32s(s0), t);
            }
            assert_close(&format!("y {what} {tier}"), &f32s(&y), &f32s(y0), t);
            assert_close(&format!("rstd {what} {tier}"), &r, r0, (1e-5, 0.0));
        });
        let src = if add { &s0 } else { &x };
        let bwd = |tier: Option<SimdTier>| {
            let (mut dx, mut dw) = (nans::<E>(n), vec![f32::NAN; cols]);
            let t = RmsBwd {
                dsum: add.then_some(&dsum[..]),
                ..RmsBwd::new(&dy, src, &w, &r0, &mut dx, &mut dw)
            };
            fast_or_ref(
                tier,
                t,
                |tier, t| rms_norm_bwd(tier, a, t),
                |t| rms_norm_bwd_ref(a, t),
            );
            (dx, dw)
        };
        let sw: Vec<f32> = w.iter().map(|v| a.offset + v.to_f32()).collect();
        let dx_scale = max_abs(&r0) * max_abs(&f32s(&dy)) * max_abs(&sw) + max_abs(&f32s(&dsum));
        vs_reference(bwd, |tier, (dx, dw), (dx0, dw0)| {
            let what = format!("{what} {tier}");
            assert_dx_dw(&what, (&dx, &dw), (dx0, dw0), dx_scale);
        });
    }

    fn args(cols: usize, casting: RmsCasting) -> Vec<RmsNormArgs> {
        let offset = match casting {
            RmsCasting::Llama => 0.0,
            RmsCasting::Gemma => 1.0,
        };
        vec![
            RmsNormArgs {
                cols,
                eps: 1e-6,
                offset,
                casting,
            },
            // A large eps (and the other offset) moves every value.
            RmsNormArgs {
                cols,
                eps: 0.5,
                offset: 1.0 - offset,
                casting,
            },
        ]
    }

    #[test]
    fn rms_norm_every_tier_matches_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for (rows, cols) in SHAPES {
            for casting in [RmsCasting::Llama, RmsCasting::Gemma] {
                for a in args(cols, casting) {
                    for add in [false, true] {
                        rms_case::<f32>(&mut rng, rows, cols, a, add);
                        rms_case::<bf16>(&mut rng, rows, cols, a, add);
                    }
                }
            }
        }
    }

    /// torch's Llama bf16 forward, spelled out: `h = (x.float()*rstd).to(bf16); y = w * h`.
    #[test]
    fn llama_bf16_rounds_like_torch() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let cols = 77;
        let x: Vec<bf16> = rand_vec(&mut rng, 3 * cols, -3.0, 3.0);
        let w: Vec<bf16> = rand_vec(&mut rng, cols, -2.0, 2.0);
        let a = RmsNormArgs {
            cols,
            eps: 1e-5,
            offset: 0.0,
            casting: RmsCasting::Llama,
        };
        let (mut y, mut r) = (nans::<bf16>(x.len()), vec![0f32; 3]);
        rms_norm_fwd(cpu::tier(), a, RmsFwd::new(&x, &w, &mut y, &mut r)).unwrap();
        for (i, row) in x.chunks(cols).enumerate() {
            for (j, v) in row.iter().enumerate() {
                let h = bf16::from_f32(v.to_f32() * r[i]);
                let want = bf16::from_f32(w[j].to_f32() * h.to_f32());
                assert_eq!(y[i * cols + j], want, "row {i} col {j}");
            }
        }
    }

    #[test]
    fn layer_norm_every_tier_matches_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        for (rows, cols) in SHAPES {
            for eps in [1e-5f32, 0.5] {
                ln_case::<f32>(&mut rng, rows, cols, eps);
                ln_case::<bf16>(&mut rng, rows, cols, eps);
            }
        }
    }

    fn ln_case<E: Elem>(rng: &mut ChaCha8Rng, rows: usize, cols: usize, eps: f32) {
        let n = rows * cols;
        // An offset mean, so that (x − μ) matters.
        let x: Vec<E> = rand_vec(rng, n, 1.0, 4.0);
        let w: Vec<E> = rand_vec(rng, cols, -1.5, 1.5);
        let b: Vec<E> = rand_vec(rng, cols, -1.0, 1.0);
        let dy: Vec<E> = rand_vec(rng, n, -1.0, 1.0);
        // Forward and backward on a tier, or (None) the reference's; the
        // backwards all start from the reference's mean and rstd.
        let fwd = |tier: Option<SimdTier>| {
            let (mut y, mut m, mut r) = (nans::<E>(n), vec![f32::NAN; rows], vec![f32::NAN; rows]);
            let t = ln_t((&x, &w, &b), &mut y, (&mut m, &mut r));
            fast_or_ref(
                tier,
                t,
                |tier, t| layer_norm_fwd(tier, cols, eps, t),
                |t| layer_norm_fwd_ref(cols, eps, t),
            );
            (y, m, r)
        };
        let t = tol::<E>();
        let what = format!("{rows}x{cols} eps {eps} {}", std::any::type_name::<E>());
        let (_, m0, r0) = vs_reference(fwd, |tier, (y, m, r), (y0, m0, r0)| {
            assert_close(&format!("y {what} {tier}"), &f32s(&y), &f32s(y0), t);
            assert_close(&format!("mean {what} {tier}"), &m, m0, (1e-5, 0.0));
            // rstd of a constant row (cols 1) is 1/sqrt(eps): exact enough.
            assert_close(&format!("rstd {what} {tier}"), &r, r0, (1e-4, 0.0));
        });
        let bwd = |tier: Option<SimdTier>| {
            let (mut dx, mut dw, mut db) =
                (nans::<E>(n), vec![f32::NAN; cols], vec![f32::NAN; cols]);
            let t = ln_b((&dy, &x, &w), (&m0, &r0), &mut dx, (&mut dw, &mut db));
            fast_or_ref(
                tier,
                t,
                |tier, t| layer_norm_bwd(tier, cols, t),
                |t| layer_norm_bwd_ref(cols, t),
            );
            (dx, dw, db)
        };
        let dx_scale = 3.0 * max_abs(&r0) * max_abs(&f32s(&dy)) * max_abs(&f32s(&w));
        vs_reference(bwd, |tier, (dx, dw, db), (dx0, dw0, db0)| {
            let what = format!("{what} {tier}");
            assert_dx_dw(&what, (&dx, &dw), (dx0, dw0), dx_scale);
            assert_close(&format!("db {what}"), &db, db0, t);
        });
    }

    /// Central differences of `Σ gy·y` (f64, step 1e-6: truncation ~1e-12,
    /// cancellation ~1e-10 relative) against the reference gradients.
    #[test]
    fn reference_gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(14);
        let (rows, cols) = (3, 5);
        let rv = |rng: &mut ChaCha8Rng, n: usize| -> Vec<f64> {
            (0..n).map(|_| rng.random_range(-1.5..1.5)).collect()
        };
        let id = |v: f64| v;
        let h = 1e-6;
        let check = |what: &str, fd: f64, an: f64| {
            assert!(
                (fd - an).abs() <= 1e-6 * (1.0 + an.abs()),
                "{what}: fd {fd} vs {an}"
            );
        };
        // The central difference of `loss` in `v[k]`.
        let diff = |v: &[f64], k: usize, loss: &dyn Fn(&[f64]) -> f64| {
            let (mut p, mut m) = (v.to_vec(), v.to_vec());
            p[k] += h;
            m[k] -= h;
            (loss(&p) - loss(&m)) / (2.0 * h)
        };
        for (casting, offset) in [(RmsCasting::Llama, 0.0), (RmsCasting::Gemma, 1.0)] {
            let a = RmsNormArgs {
                cols,
                eps: 1e-2,
                offset,
                casting,
            };
            let (x, w, gy, gs) = (
                rv(&mut rng, rows * cols),
                rv(&mut rng, cols),
                rv(&mut rng, rows * cols),
                rv(&mut rng, rows * cols),
            );
            // Loss of the fused add with residual 0.3·x (a second path
            // into the sum): L = Σ gy·rms(s) + Σ gs·s, s = x + res.
            let res: Vec<f64> = rv(&mut rng, rows * cols);
            let loss = |x: &[f64], w: &[f64]| -> f64 {
                let mut y = vec![0.0; cols];
                let mut l = 0.0;
                for i in 0..rows {
                    let s: Vec<f64> = (0..cols)
                        .map(|j| x[i * cols + j] + res[i * cols + j])
                        .collect();
                    rms_row_f64(&s, w, &a, &id, &mut y);
                    for j in 0..cols {
                        l += gy[i * cols + j] * y[j] + gs[i * cols + j] * s[j];
                    }
                }
                l
            };
            let (mut dx, mut dw) = (vec![0.0; rows * cols], vec![0.0; cols]);
            let mut y = vec![0.0; cols];
            for i in 0..rows {
                let e = i * cols..(i + 1) * cols;
                let s: Vec<f64> = e.clone().map(|k| x[k] + res[k]).collect();
                let r = rms_row_f64(&s, &w, &a, &id, &mut y);
                rms_row_bwd_f64(
                    (&gy[e.clone()], &s, &w),
                    r,
                    &a,
                    &id,
                    &mut dx[e.clone()],
                    &mut dw,
                );
                for k in e {
                    dx[k] += gs[k];
                }
            }
            for (k, &an) in dx.iter().enumerate() {
                let fd = diff(&x, k, &|x| loss(x, &w));
                check(&format!("rms {casting:?} dx[{k}]"), fd, an);
            }
            for (j, &an) in dw.iter().enumerate() {
                let fd = diff(&w, j, &|w| loss(&x, w));
                check(&format!("rms {casting:?} dw[{j}]"), fd, an);
            }
        }
        // LayerNorm.
        let (x, w, b, gy) = (
            rv(&mut rng, rows * cols),
            rv(&mut rng, cols),
            rv(&mut rng, cols),
            rv(&mut rng, rows * cols),
        );
        let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
            let mut y = vec![0.0; cols];
            let mut l = 0.0;
            for i in 0..rows {
                ln_row_f64(&x[i * cols..(i + 1) * cols], w, b, 1e-2, &mut y);
                l += (0..cols).map(|j| gy[i * cols + j] * y[j]).sum::<f64>();
            }
            l
        };
        let (mut dx, mut dw, mut db) = (vec![0.0; rows * cols], vec![0.0; cols], vec![0.0; cols]);
        let mut y = vec![0.0; cols];
        for i in 0..rows {
            let e = i * cols..(i + 1) * cols;
            let mr = ln_row_f64(&x[e.clone()], &w, &b, 1e-2, &mut y);
            ln_row_bwd_f64(
                (&gy[e.clone()], &x[e.clone()], &w),
                mr,
                &mut dx[e],
                &mut dw,
                &mut db,
            );
        }
        for (k, &an) in dx.iter().enumerate() {
            let fd = diff(&x, k, &|x| loss(x, &w, &b));
            check(&format!("ln dx[{k}]"), fd, an);
        }
        for j in 0..cols {
            let fd = diff(&w, j, &|w| loss(&x, w, &b));
            check(&format!("ln dw[{j}]"), fd, dw[j]);
            let fd = diff(&b, j, &|b| loss(&x, &w, b));
            check(&format!("ln db[{j}]"), fd, db[j]);
        }
    }

    /// Weight gradients are bit-identical on 1, 2 and 3 threads: the row
    /// chunks (4 here) and their order do not depend on the pool.
    #[test]
    fn weight_gradients_do_not_depend_on_the_thread_count() {
        let mut rng = ChaCha8Rng::seed_from_u64(15);
        let (rows, cols) = (300usize, 200usize);
        assert!(rows.div_ceil(row_chunk(rows, cols)) > 2);
        let x: Vec<bf16> = rand_vec(&mut rng, rows * cols, -2.0, 2.0);
        let dy: Vec<bf16> = rand_vec(&mut rng, rows * cols, -2.0, 2.0);
        let w: Vec<bf16> = rand_vec(&mut rng, cols, -2.0, 2.0);
        let rstd: Vec<f32> = (0..rows).map(|_| rng.random_range(0.5..2.0)).collect();
        let mean: Vec<f32> = (0..rows).map(|_| rng.random_range(-0.5..0.5)).collect();
        let a = RmsNormArgs {
            cols,
            eps: 1e-6,
            offset: 0.0,
            casting: RmsCasting::Gemma,
        };
        let mut outs = Vec::new();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let (mut dx, mut dw) = (nans::<bf16>(rows * cols), vec![f32::NAN; cols]);
            let t = RmsBwd::new(&dy, &x, &w, &rstd, &mut dx, &mut dw);
            norm_bwd_in(&pool, cpu::tier(), &a, t).unwrap();
            let (mut dx2, mut dw2, mut db2) = (
                nans::<bf16>(rows * cols),
                vec![f32::NAN; cols],
                vec![f32::NAN; cols],
            );
            let t = ln_b(
                (&dy, &x, &w),
                (&mean, &rstd),
                &mut dx2,
                (&mut dw2, &mut db2),
            );
            norm_bwd_in(&pool, cpu::tier(), &cols, t).unwrap();
            outs.push((dx, dw, dx2, dw2, db2));
        }
        for o in &outs[1..] {
            assert!(o.0 == outs[0].0 && o.2 == outs[0].2);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&o.1), bits(&outs[0].1));
            assert_eq!(bits(&o.3), bits(&outs[0].3));
            assert_eq!(bits(&o.4), bits(&outs[0].4));
        }
    }

    /// The 8-lane bf16 rounding of the AVX2 backward rounds as half does,
    /// bit for bit, on every class (the scalar store's own test, on the
    /// same cases, is `train::tests::bf16_store_rounds_like_half`).
    #[test]
    fn store_rounds_like_half() {
        // The special patterns come first: `chunks_exact` drops a tail.
        let xs = crate::tests::bf16_cases();
        // The 8-lane rounding of the AVX2 backward, against the same.
        #[cfg(target_arch = "x86_64")]
        if cpu::detected_tier() >= SimdTier::Avx2 {
            for c in xs.chunks_exact(8) {
                let mut got = [0f32; 8];
                // SAFETY: AVX2 was detected; `c` and `got` hold 8 values.
                unsafe {
                    use std::arch::x86_64::*;
                    let v = _mm256_loadu_ps(c.as_ptr() as *const f32);
                    _mm256_storeu_ps(got.as_mut_ptr(), avx_red::round_bf16(v));
                }
                for (g, x) in got.iter().zip(c) {
                    let want = bf16::from_f32(f32::from_bits(*x)).to_f32();
                    assert_eq!(g.to_bits(), want.to_bits(), "{x:#x}");
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let tier = cpu::tier();
        let x = vec![1f32; 12];
        let w = vec![1f32; 4];
        let a = RmsNormArgs {
            cols: 4,
            eps: 1e-6,
            offset: 0.0,
            casting: RmsCasting::Llama,
        };
        let (mut y, mut r) = (vec![0f32; 12], vec![0f32; 3]);
        let fwd = |a, w: &[f32], y: &mut [f32], r: &mut [f32]| {
            rms_norm_fwd(tier, a, RmsFwd::new(&x, w, y, r)).is_err()
        };
        assert!(!fwd(a, &w, &mut y, &mut r));
        assert!(fwd(RmsNormArgs { cols: 0, ..a }, &w, &mut y, &mut r));
        assert!(fwd(RmsNormArgs { cols: 5, ..a }, &w, &mut y, &mut r));
        assert!(fwd(RmsNormArgs { eps: f32::NAN, ..a }, &w, &mut y, &mut r));
        assert!(fwd(RmsNormArgs { eps: -1.0, ..a }, &w, &mut y, &mut r));
        assert!(fwd(a, &w[..3], &mut y, &mut r));
        assert!(fwd(a, &w, &mut y[..11], &mut r));
        assert!(fwd(a, &w, &mut y, &mut r[..2]));
        assert!(rms_norm_fwd_ref(a, RmsFwd::new(&x, &w, &mut y, &mut r[..2])).is_err());
        let (mut s, mut dx, mut dw) = (vec![0f32; 12], vec![0f32; 12], vec![0f32; 4]);
        let mut add = |res: &[f32], s: &mut [f32]| {
            let t = RmsFwd {
                residual: Some(res),
                sum: Some(s),
                ..RmsFwd::new(&x, &w, &mut y, &mut r)
            };
            rms_norm_fwd(tier, a, t).is_err()
        };
        assert!(add(&x[..8], &mut s));
        assert!(add(&x, &mut s[..8]));
        // A residual without a sum to write.
        let t = RmsFwd {
            residual: Some(&x),
            ..RmsFwd::new(&x, &w, &mut y, &mut r)
        };
        assert!(rms_norm_fwd(tier, a, t).is_err());
        assert!(rms_norm_bwd(tier, a, RmsBwd::new(&x, &x, &w, &r, &mut dx, &mut dw[..3])).is_err());
        assert!(rms_norm_bwd(tier, a, RmsBwd::new(&x[..8], &x, &w, &r, &mut dx, &mut dw)).is_err());
        let t = RmsBwd {
            dsum: Some(&x[..4]),
            ..RmsBwd::new(&x, &x, &w, &r, &mut dx, &mut dw)
        };
        assert!(rms_norm_bwd(tier, a, t).is_err());
        let (mut m, mut db) = (vec![0f32; 3], vec![0f32; 4]);
        let t = ln_t((&x, &w, &w[..2]), &mut y, (&mut m, &mut r));
        assert!(layer_norm_fwd(tier, 4, 1e-5, t).is_err());
        let t = ln_t((&x, &w, &w), &mut y, (&mut m[..1], &mut r));
        assert!(layer_norm_fwd(tier, 4, 1e-5, t).is_err());
        let t = ln_b((&x, &x, &w), (&m, &r), &mut dx, (&mut dw, &mut db[..1]));
        assert!(layer_norm_bwd(tier, 4, t).is_err());
        let t = ln_b((&x, &x, &w), (&m, &r), &mut dx, (&mut dw, &mut db));
        assert!(layer_norm_bwd(tier, 0, t).is_err());
        // Zero rows is fine and zeroes the weight gradient.
        let mut dw = vec![f32::NAN; 4];
        rms_norm_bwd::<f32>(tier, a, RmsBwd::new(&[], &[], &w, &[], &mut [], &mut dw)).unwrap();
        assert_eq!(dw, vec![0.0; 4]);
    }
}
