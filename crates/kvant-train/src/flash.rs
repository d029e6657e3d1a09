//! FlashAttention-2 style attention for training: forward and backward,
//! causal or not, grouped-query (GQA), sliding window, f32 and bf16.
//!
//! Math, per (batch, q head h, query row i), with kv head `g = h / (q_heads / kv_heads)`
//! and the keys `j` row `i` sees (see [`FlashShape`]):
//!
//! - forward: `s_j = scale·q_i·k_j`, `lse_i = ln Σ_j e^{s_j}`,
//!   `o_i = Σ_j e^{s_j - lse_i} v_j`; computed tile by tile ([`BQ`] queries ×
//!   [`BK`] keys) with the online softmax (running max `m`, running sum `l`,
//!   the output rescaled by `e^{m_old - m_new}`), so no score matrix is
//!   kept; only `lse` is saved.
//! - backward: `P_ij = e^{s_ij - lse_i}` recomputed per tile,
//!   `D_i = Σ_c dout_ic·out_ic`, `dP_ij = dout_i·v_j`,
//!   `dS_ij = P_ij (dP_ij - D_i)`, `dv_j = Σ_i P_ij dout_i`,
//!   `dk_j = scale Σ_i dS_ij q_i`, `dq_i = scale Σ_j dS_ij k_j` (sums over
//!   the q heads of a group for dk, dv).
//!
//! The backward is one pass over (key group, batch, kv head): a task walks
//! the key tiles of its group in order, and for each, every q head of the
//! kv group and every query tile that sees it: `Sᵀ`, `Pᵀ`, `dV += Pᵀ·dO`,
//! `dPᵀ`, `dSᵀ`, `dK += dSᵀ·Q`, and `dQ_grp += dS·K` into a partial dQ of
//! its own (five tile products, where a second pass for dQ would recompute
//! `S` and `dP`: seven). The partials of the [`dq_groups`] groups are then
//! added in group order. Each output element is written by exactly one
//! task, summed in an order fixed by the shape alone (never atomics), so
//! the results are bitwise independent of the thread count. Tiles that a
//! causal mask or a window hides completely are skipped.
//!
//! Tile products run on the training GEMM's packed microkernels on the
//! calling thread ([`gemm_serial`]: AVX-512 12×32, AVX2 6×16, and
//! `vdpbf16ps` when both operands are bf16), reading `Q`, `K`, `V`, `dO`
//! in place through strided views (packing widens and transposes), so a
//! tile costs no copies of its own. With bf16 inputs `P` and `dS` are
//! rounded to bf16 before their products, as FlashAttention-2 and torch's
//! CPU SDPA do, so all five run on `vdpbf16ps`. The elementwise work (exponentials,
//! masks, `dS`) is compiled once per tier and vectorizes to its width;
//! tiles that a mask does not cut skip the per-row bounds.

use crate::{zero_first, Elem};
use half::bf16;
use kvant_kernels::cpu::SimdTier;
use kvant_kernels::error::{check_len, checked_mul};
use kvant_kernels::pool::{self, DisjointSlice, ThreadPool};
use kvant_kernels::vecops::{exp, Fma, Plain};
use kvant_kernels::KernelError;
use std::cell::RefCell;
use std::sync::Mutex;

use super::gemm::{gemm_serial, GemmArgs, MatRef};

/// Query rows per tile: a multiple of both microkernels' rows (12 and 6)
/// and columns (32 and 16), so no product has an edge tile. Measured on
/// the Zen 4 VM (2 threads, f32, [1, 16/4, 2048, 64] causal, medians of
/// 5–7): forward / backward 100 / 263–295 ms at 64, 83 / 214 at 96,
/// 86 / 232 at 128, 85 / 229 at 192.
const BQ: usize = 96;
/// Key rows per tile (as [`BQ`]).
const BK: usize = 96;

/// The shape and options of one attention call.
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
    /// Query i sees key j only if j <= i + (kv_len - q_len) (bottom-right aligned, as flash-attn >= 2.1; equals torch's is_causal when q_len == kv_len).
    pub causal: bool,
    /// Sliding window (Hugging Face / Mistral semantics): with d = i + (kv_len - q_len) - j, key j is seen only if d < window (and, if causal, d >= 0).
    pub window: Option<usize>,
}

/// Element counts of the tensors, checked once.
#[derive(Clone, Copy)]
struct Sizes {
    q: usize,
    k: usize,
    v: usize,
    o: usize,
    lse: usize,
}

fn sizes(op: &'static str, s: &FlashShape) -> Result<Sizes, KernelError> {
    // `is_multiple_of(0)` holds only for 0: no kv heads need no q heads.
    if !s.q_heads.is_multiple_of(s.kv_heads) {
        return Err(KernelError::InvalidShape {
            op,
            why: format!(
                "{} q heads are not a multiple of {} kv heads",
                s.q_heads, s.kv_heads
            ),
        });
    }
    let bq = checked_mul(op, s.batch, s.q_heads)?;
    let bk = checked_mul(op, s.batch, s.kv_heads)?;
    let q_rows = checked_mul(op, bq, s.q_len)?;
    let k_rows = checked_mul(op, bk, s.kv_len)?;
    Ok(Sizes {
        q: checked_mul(op, q_rows, s.head_dim)?,
        k: checked_mul(op, k_rows, s.head_dim)?,
        v: checked_mul(op, k_rows, s.v_dim)?,
        o: checked_mul(op, q_rows, s.v_dim)?,
        lse: q_rows,
    })
}

impl Sizes {
    /// The lengths of the tensors a forward and a backward share.
    fn check_fwd<E>(
        &self,
        q: &[E],
        k: &[E],
        v: &[E],
        out: &[E],
        lse: &[f32],
    ) -> Result<(), KernelError> {
        check_len("flash_attn q", self.q, q.len())?;
        check_len("flash_attn k", self.k, k.len())?;
        check_len("flash_attn v", self.v, v.len())?;
        check_len("flash_attn out", self.o, out.len())?;
        check_len("flash_attn lse", self.lse, lse.len())
    }
}

/// One forward: `q` `[batch, q_heads, q_len, head_dim]`, `k` `[batch,
/// kv_heads, kv_len, head_dim]`, `v` `[batch, kv_heads, kv_len, v_dim]`
/// (contiguous) in; `out` `[batch, q_heads, q_len, v_dim]` and `lse`
/// `[batch, q_heads, q_len]` (natural log of Σ exp(scale·q·k) over seen
/// keys; -inf and out = 0 for a row that sees no key) out. The kernel and
/// its reference take the same and check it the same way.
pub struct FlashFwd<'a, E> {
    pub shape: FlashShape,
    pub q: &'a [E],
    pub k: &'a [E],
    pub v: &'a [E],
    pub out: &'a mut [E],
    pub lse: &'a mut [f32],
}

/// One backward: the forward's tensors (`out` and `lse` as it wrote them),
/// `dout` (as `out`) in; the gradients `dq`, `dk`, `dv` (as `q`, `k`, `v`)
/// out.
pub struct FlashBwd<'a, E> {
    pub shape: FlashShape,
    pub q: &'a [E],
    pub k: &'a [E],
    pub v: &'a [E],
    pub out: &'a [E],
    pub dout: &'a [E],
    pub lse: &'a [f32],
    pub dq: &'a mut [E],
    pub dk: &'a mut [E],
    pub dv: &'a mut [E],
}

impl<E> FlashFwd<'_, E> {
    /// Checks the shape and every length, for the kernel and the
    /// reference alike; the element counts.
    fn check(&self, op: &'static str) -> Result<Sizes, KernelError> {
        let n = sizes(op, &self.shape)?;
        n.check_fwd(self.q, self.k, self.v, self.out, self.lse)?;
        Ok(n)
    }
}

impl<E> FlashBwd<'_, E> {
    /// As [`FlashFwd::check`], with `dout` and the gradients.
    fn check(&self, op: &'static str) -> Result<Sizes, KernelError> {
        let n = sizes(op, &self.shape)?;
        n.check_fwd(self.q, self.k, self.v, self.out, self.lse)?;
        check_len("flash_attn dout", n.o, self.dout.len())?;
        check_len("flash_attn dq", n.q, self.dq.len())?;
        check_len("flash_attn dk", n.k, self.dk.len())?;
        check_len("flash_attn dv", n.v, self.dv.len())?;
        Ok(n)
    }
}

/// Which keys each query row sees: one interval per row.
#[derive(Clone, Copy)]
struct Mask {
    /// `kv_len - q_len`: where row i's diagonal is.
    off: i64,
    causal: bool,
    window: Option<i64>,
    kv_len: i64,
}

impl Mask {
    fn new(s: &FlashShape) -> Mask {
        // Lengths are element counts of slices (checked), so they fit i64.
        Mask {
            off: s.kv_len as i64 - s.q_len as i64,
            causal: s.causal,
            window: s.window.map(|w| w.min(i64::MAX as usize / 4) as i64),
            kv_len: s.kv_len as i64,
        }
    }

    /// Keys `lo..hi` row `i` sees (`lo == hi` when none).
    #[inline(always)]
    fn range(&self, i: usize) -> (usize, usize) {
        let p = i as i64 + self.off;
        let hi = if self.causal {
            (p + 1).clamp(0, self.kv_len)
        } else {
            self.kv_len
        };
        let lo = match self.window {
            Some(w) => (p - w + 1).clamp(0, self.kv_len),
            None => 0,
        };
        (lo as usize, hi.max(lo) as usize)
    }

    /// Whether query rows `i0..i1` may see any of keys `j0..j1` (rows'
    /// intervals move right as `i` grows, so the first row's start and the
    /// last row's end bound them all).
    #[inline(always)]
    fn overlaps(&self, i0: usize, i1: usize, j0: usize, j1: usize) -> bool {
        i0 < i1 && self.range(i0).0 < j1 && self.range(i1 - 1).1 > j0
    }

    /// Whether every row of `i0..i1` sees every key of `j0..j1`: no mask
    /// inside the tile (the first row ends last-seen keys earliest, the
    /// last row starts latest).
    #[inline(always)]
    fn full(&self, i0: usize, i1: usize, j0: usize, j1: usize) -> bool {
        i0 < i1 && self.range(i0).1 >= j1 && self.range(i1 - 1).0 <= j0
    }

    /// Keys rows `i0..i1` may see, as a superset interval.
    fn keys(&self, i0: usize, i1: usize) -> (usize, usize) {
        (self.range(i0).0, self.range(i1 - 1).1)
    }
}

// ---------------------------------------------------------------------------
// Tile kernels.

/// `C ← β·C + A·B` on the calling thread with the training GEMM's packed
/// microkernels (`A`, `B` strided views of the inputs or of f32 tiles, `C`
/// a row-major f32 tile of width `n`).
#[inline(always)]
fn mm<A: Elem, B: Elem>(
    tier: SimdTier,
    a: MatRef<'_, A>,
    b: MatRef<'_, B>,
    c: &mut [f32],
    beta: f32,
) -> Result<(), KernelError> {
    let n = b.cols();
    gemm_serial(tier, GemmArgs::new(a, b, c, n).beta(beta))
}

/// Rows `r0..r0+n` of a `[rows, w]` row-major tensor as a matrix.
#[inline(always)]
fn rows<E>(x: &[E], r0: usize, n: usize, w: usize) -> Result<MatRef<'_, E>, KernelError> {
    MatRef::row_major(&x[r0 * w..(r0 + n) * w], n, w)
}

/// `P` or `dS` (`rows × cols`, row-major) as the left operand of a tile
/// product: f32 as computed, or, with bf16 inputs, rounded to bf16 once,
/// as FlashAttention-2 and torch's CPU SDPA do, so the product runs on the
/// bf16 kernel (`vdpbf16ps`, twice the f32 rate) instead of widening the
/// other operand.
enum Left<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl<'a> Left<'a> {
    #[inline(always)]
    fn of<E: Elem>(x: &'a [f32], half: &'a mut Vec<bf16>) -> Left<'a> {
        if E::F32 {
            return Left::F32(x);
        }
        half.clear();
        half.extend(x.iter().map(|&v| <bf16 as Elem>::from_f32(v)));
        Left::Bf16(half)
    }

    /// `C ← β·C + X·B` (`Xᵀ·B` when `transposed`).
    #[inline(always)]
    fn mm<E: Elem>(
        &self,
        tier: SimdTier,
        (rows, cols, transposed): (usize, usize, bool),
        b: MatRef<'_, E>,
        c: &mut [f32],
        beta: f32,
    ) -> Result<(), KernelError> {
        fn tr<T>(m: MatRef<'_, T>, t: bool) -> MatRef<'_, T> {
            if t {
                m.t()
            } else {
                m
            }
        }
        match *self {
            Left::F32(x) => mm(
                tier,
                tr(MatRef::row_major(x, rows, cols)?, transposed),
                b,
                c,
                beta,
            ),
            Left::Bf16(x) => mm(
                tier,
                tr(MatRef::row_major(x, rows, cols)?, transposed),
                b,
                c,
                beta,
            ),
        }
    }
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Per-thread tile buffers, reused across calls.
#[derive(Default)]
struct Scratch {
    s: Vec<f32>,
    dp: Vec<f32>,
    acc: Vec<f32>,
    acc2: Vec<f32>,
    rows: Vec<f32>,
    /// Per query row of a tile: the keys it sees, `(lo, hi)`.
    ranges: Vec<(usize, usize)>,
    /// `P` or `dS` rounded to bf16 (bf16 inputs).
    half: Vec<bf16>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut sc) => f(&mut sc),
        // Only reachable if a task re-entered on this thread: use a fresh one.
        Err(_) => f(&mut Scratch::default()),
    })
}

/// The inputs of one call, shared by its tasks.
struct Args<'a, E> {
    s: FlashShape,
    m: Mask,
    tier: SimdTier,
    q: &'a [E],
    k: &'a [E],
    v: &'a [E],
}

impl<'a, E> Args<'a, E> {
    fn new(s: &FlashShape, tier: SimdTier, q: &'a [E], k: &'a [E], v: &'a [E]) -> Self {
        Args {
            s: *s,
            m: Mask::new(s),
            tier,
            q,
            k,
            v,
        }
    }
    fn group(&self) -> usize {
        self.s.q_heads / self.s.kv_heads
    }
    /// First element of q-head row `(b, h, i)` in units of rows.
    fn qrow(&self, b: usize, h: usize, i: usize) -> usize {
        (b * self.s.q_heads + h) * self.s.q_len + i
    }
    fn krow(&self, b: usize, g: usize, j: usize) -> usize {
        (b * self.s.kv_heads + g) * self.s.kv_len + j
    }
}

/// What one forward task writes: query rows `i0..i1` of `(b, h)`, their
/// `out` and `lse` rows.
struct RowsOut<'a, E> {
    b: usize,
    h: usize,
    i0: usize,
    i1: usize,
    out: &'a mut [E],
    lse: &'a mut [f32],
}

/// The forward of `o`'s query rows.
#[inline(always)]
fn fwd_tile<E: Elem, F: Fma>(
    a: &Args<'_, E>,
    o: RowsOut<'_, E>,
    sc: &mut Scratch,
) -> Result<(), KernelError> {
    let RowsOut {
        b,
        h,
        i0,
        i1,
        out,
        lse,
    } = o;
    let (d, dv, scale) = (a.s.head_dim, a.s.v_dim, a.s.scale);
    let nq = i1 - i0;
    let g = h / a.group();
    let r0 = a.qrow(b, h, i0);
    let q = rows(a.q, r0, nq, d)?;
    let acc = sized(&mut sc.acc, nq * dv);
    acc.fill(0.0);
    // Running max and sum per row.
    let (mx, sum) = sized(&mut sc.rows, 2 * nq).split_at_mut(nq);
    mx.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    let (klo, khi) = a.m.keys(i0, i1);
    let mut j0 = klo / BK * BK;
    while j0 < khi {
        let j1 = (j0 + BK).min(khi);
        let nk = j1 - j0;
        let kr = a.krow(b, g, j0);
        let st = sized(&mut sc.s, nq * nk);
        mm(a.tier, q, rows(a.k, kr, nk, d)?.t(), st, 0.0)?;
        let full = a.m.full(i0, i1, j0, j1);
        for r in 0..nq {
            let row = &mut st[r * nk..][..nk];
            let (lo, hi) = if full {
                (0, nk)
            } else {
                let (lo, hi) = a.m.range(i0 + r);
                (lo.clamp(j0, j1) - j0, hi.clamp(j0, j1) - j0)
            };
            let mut m_new = mx[r];
            for x in &mut row[lo..hi.max(lo)] {
                *x *= scale;
                m_new = m_new.max(*x);
            }
            if m_new == f32::NEG_INFINITY || lo >= hi {
                row.fill(0.0);
                continue;
            }
            row[..lo].fill(0.0);
            row[hi..].fill(0.0);
            let alpha = exp::<F>(mx[r] - m_new);
            let mut t = [0f32; 8];
            let mut it = row[lo..hi].chunks_exact_mut(8);
            for c in &mut it {
                for (x, l) in c.iter_mut().zip(t.iter_mut()) {
                    *x = exp::<F>(*x - m_new);
                    *l += *x;
                }
            }
            for x in it.into_remainder() {
                *x = exp::<F>(*x - m_new);
                t[0] += *x;
            }
            sum[r] = sum[r] * alpha + t.iter().sum::<f32>();
            mx[r] = m_new;
            if alpha != 1.0 {
                for o in &mut acc[r * dv..][..dv] {
                    *o *= alpha;
                }
            }
        }
        let vt = rows(a.v, kr, nk, dv)?;
        Left::of::<E>(st, &mut sc.half).mm(a.tier, (nq, nk, false), vt, acc, 1.0)?;
        j0 = j1;
    }
    for r in 0..nq {
        let o = &mut out[r * dv..][..dv];
        if sum[r] > 0.0 {
            let inv = 1.0 / sum[r];
            for (o, &x) in o.iter_mut().zip(&acc[r * dv..][..dv]) {
                *o = E::from_f32(x * inv);
            }
            lse[r] = mx[r] + sum[r].ln();
        } else {
            o.fill(E::from_f32(0.0));
            lse[r] = f32::NEG_INFINITY;
        }
    }
    Ok(())
}

/// `Pᵀ` from transposed scores in place (key `c`, query `r` of the tile at
/// `c·nq + r`): `e^{scale·s - lse_r}` where row `r` sees key `c`, else 0.
#[inline(always)]
fn probs<F: Fma>(
    m: &Mask,
    s: &mut [f32],
    (i0, nq): (usize, usize),
    (j0, nk): (usize, usize),
    scale: f32,
    lse: &[f32],
    ranges: &mut Vec<(usize, usize)>,
) {
    // The keys each query row sees, in tile coordinates, once per tile
    // (nothing hidden when the whole tile is visible).
    let full = m.full(i0, i0 + nq, j0, j0 + nk) && lse.iter().all(|&l| l != f32::NEG_INFINITY);
    if full {
        for row in s.chunks_exact_mut(nq).take(nk) {
            for (x, &l) in row.iter_mut().zip(lse) {
                *x = exp::<F>(F::fma(*x, scale, -l));
            }
        }
        return;
    }
    ranges.clear();
    ranges.extend((0..nq).map(|r| {
        if lse[r] == f32::NEG_INFINITY {
            (0, 0)
        } else {
            let (lo, hi) = m.range(i0 + r);
            (lo.clamp(j0, j0 + nk) - j0, hi.clamp(j0, j0 + nk) - j0)
        }
    }));
    for (c, row) in s.chunks_exact_mut(nq).take(nk).enumerate() {
        for ((x, &l), &(lo, hi)) in row.iter_mut().zip(lse).zip(ranges.iter()) {
            let p = exp::<F>(F::fma(*x, scale, -l));
            *x = if c >= lo && c < hi { p } else { 0.0 };
        }
    }
}

/// What one backward task writes: for key tiles `kt` of `(b, g)`, their
/// dK and dV rows, and the group's partial dQ of every q head of `g` (all
/// query rows, f32, unscaled).
struct GroupOut<'a, E> {
    b: usize,
    g: usize,
    kt: std::ops::Range<usize>,
    dk: &'a mut [E],
    dv: &'a mut [E],
    dqp: &'a mut [f32],
}

/// The backward of key tiles `o.kt` of `(o.b, o.g)`, in order: per key
/// tile, every q head of the group and every query tile that sees it.
#[inline(always)]
fn bwd_group<E: Elem, F: Fma>(
    a: &Args<'_, E>,
    (dout, lse, dsum): (&[E], &[f32], &[f32]),
    o: GroupOut<'_, E>,
    sc: &mut Scratch,
) -> Result<(), KernelError> {
    let (d, dv, scale) = (a.s.head_dim, a.s.v_dim, a.s.scale);
    let (b, g, grp) = (o.b, o.g, a.group());
    let k_first = o.kt.start * BK;
    for jt in o.kt.clone() {
        let j0 = jt * BK;
        let j1 = (j0 + BK).min(a.s.kv_len);
        let nk = j1 - j0;
        let kr = a.krow(b, g, j0);
        let (kt, vt) = (rows(a.k, kr, nk, d)?, rows(a.v, kr, nk, dv)?);
        let acc = sized(&mut sc.acc, nk * d);
        acc.fill(0.0);
        let acc2 = sized(&mut sc.acc2, nk * dv);
        acc2.fill(0.0);
        for h in g * grp..(g + 1) * grp {
            let mut i0 = 0;
            while i0 < a.s.q_len {
                let i1 = (i0 + BQ).min(a.s.q_len);
                let nq = i1 - i0;
                if !a.m.overlaps(i0, i1, j0, j1) {
                    i0 = i1;
                    continue;
                }
                let r0 = a.qrow(b, h, i0);
                let (qt, dot) = (rows(a.q, r0, nq, d)?, rows(dout, r0, nq, dv)?);
                // Sᵀ = K·Qᵀ, then Pᵀ.
                let st = sized(&mut sc.s, nk * nq);
                mm(a.tier, kt, qt.t(), st, 0.0)?;
                let l = &lse[r0..r0 + nq];
                probs::<F>(&a.m, st, (i0, nq), (j0, nk), scale, l, &mut sc.ranges);
                // dV += Pᵀ·dO.
                Left::of::<E>(st, &mut sc.half).mm(a.tier, (nk, nq, false), dot, acc2, 1.0)?;
                // dPᵀ = V·dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ - D).
                let dp = sized(&mut sc.dp, nk * nq);
                mm(a.tier, vt, dot.t(), dp, 0.0)?;
                let dd = &dsum[r0..r0 + nq];
                for (dpr, pr) in dp.chunks_exact_mut(nq).zip(st.chunks_exact(nq)) {
                    for ((x, &p), &di) in dpr.iter_mut().zip(pr).zip(dd) {
                        *x = p * (*x - di);
                    }
                }
                // dK += dSᵀ·Q; this group's dQ += dS·K.
                let ds = Left::of::<E>(dp, &mut sc.half);
                ds.mm(a.tier, (nk, nq, false), qt, acc, 1.0)?;
                let q0 = ((h - g * grp) * a.s.q_len + i0) * d;
                let dq = &mut o.dqp[q0..q0 + nq * d];
                ds.mm(a.tier, (nk, nq, true), kt, dq, 1.0)?;
                i0 = i1;
            }
        }
        let (kd, vd) = ((j0 - k_first) * d, (j0 - k_first) * dv);
        for (o, &x) in o.dk[kd..kd + nk * d].iter_mut().zip(acc.iter()) {
            *o = E::from_f32(x * scale);
        }
        for (o, &x) in o.dv[vd..vd + nk * dv].iter_mut().zip(acc2.iter()) {
            *o = E::from_f32(x);
        }
    }
    Ok(())
}

// One copy of each tile body per tier: the elementwise work (exponentials,
// masks, dS) vectorizes to the tier's width; the products dispatch on
// `Args::tier` inside `gemm_serial`.
kvant_kernels::per_tier! {
    /// [`fwd_tile`] on `tier`.
    fn fwd_on<E: Elem>(
        tier: SimdTier,
        a: &Args<'_, E>,
        o: RowsOut<'_, E>,
        sc: &mut Scratch,
    ) -> Result<(), KernelError> [F = Plain, kvant_kernels::vecops::Fused] {
        fwd_tile::<E, F>(a, o, sc)
    }

    /// [`bwd_group`] on `tier`.
    fn bwd_on<E: Elem>(
        tier: SimdTier,
        a: &Args<'_, E>,
        ins: (&[E], &[f32], &[f32]),
        o: GroupOut<'_, E>,
        sc: &mut Scratch,
    ) -> Result<(), KernelError> [F = Plain, kvant_kernels::vecops::Fused] {
        bwd_group::<E, F>(a, ins, o, sc)
    }
}

/// Key groups of the backward (each a partial dQ, added in group order):
/// 4 (the groups are tasks with the kv heads, so batch 1 with 4 kv heads
/// still has 16 for 2–8 threads), fewer while the partials would pass
/// 2^28 f32 values (1 GiB), and never more than the key tiles. A
/// function of the shape alone: it fixes the summation order.
fn dq_groups(s: &FlashShape, q_elems: usize) -> usize {
    let tiles = s.kv_len.div_ceil(BK).max(1);
    let mut g = tiles.min(4);
    while g > 1 && g.saturating_mul(q_elems) > 1 << 28 {
        g -= 1;
    }
    g
}

/// The first error any task of a pool run returned.
#[derive(Default)]
struct FirstError(Mutex<Option<KernelError>>);

impl FirstError {
    fn record(&self, r: Result<(), KernelError>) {
        if let Err(e) = r {
            let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
            g.get_or_insert(e);
        }
    }
    fn result(self) -> Result<(), KernelError> {
        match self.0.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------
// Entry points.

/// The forward on the global pool, on `tier` (lowered to one the CPU
/// supports).
///
/// # Errors
/// When the q heads are not a multiple of the kv heads, a size overflows,
/// or a tensor's length is not the shape's.
pub fn flash_attn_fwd<E: Elem>(tier: SimdTier, a: FlashFwd<'_, E>) -> Result<(), KernelError> {
    fwd_in(pool::global(), tier, a)
}

fn fwd_in<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    fa: FlashFwd<'_, E>,
) -> Result<(), KernelError> {
    let n = fa.check("flash_attn_fwd")?;
    let (s, q, k, v) = (&fa.shape, fa.q, fa.k, fa.v);
    let (out, lse) = (fa.out, fa.lse);
    if n.lse == 0 {
        return Ok(());
    }
    let a = Args::new(s, tier, q, k, v);
    let tiles = s.q_len.div_ceil(BQ);
    let bh = s.batch * s.q_heads;
    let dv = s.v_dim;
    let err = FirstError::default();
    let outs = DisjointSlice::new(out);
    let lses = DisjointSlice::new(lse);
    pool.run(bh * tiles, &|t| {
        let (bhi, qt) = (t / tiles, t % tiles);
        let (b, h) = (bhi / s.q_heads, bhi % s.q_heads);
        let i0 = qt * BQ;
        let i1 = (i0 + BQ).min(s.q_len);
        let r0 = a.qrow(b, h, i0);
        let r1 = r0 + (i1 - i0);
        // SAFETY: task `t` owns query rows r0..r1 of (b, h), disjoint from
        // every other task's.
        let (out, lse) = unsafe { (outs.range(r0 * dv..r1 * dv), lses.range(r0..r1)) };
        let o = RowsOut {
            b,
            h,
            i0,
            i1,
            out,
            lse,
        };
        err.record(with_scratch(|sc| fwd_on(a.tier, &a, o, sc)));
    });
    err.result()
}

/// The backward on the global pool, on `tier` (lowered to one the CPU
/// supports).
///
/// # Errors
/// When the q heads are not a multiple of the kv heads, a size overflows,
/// or a tensor's length is not the shape's.
pub fn flash_attn_bwd<E: Elem>(tier: SimdTier, a: FlashBwd<'_, E>) -> Result<(), KernelError> {
    bwd_in(pool::global(), tier, a)
}

fn bwd_in<E: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    ba: FlashBwd<'_, E>,
) -> Result<(), KernelError> {
    const OP: &str = "flash_attn_bwd";
    let n = ba.check(OP)?;
    let (s, q, k, v) = (&ba.shape, ba.q, ba.k, ba.v);
    let (out, dout, lse) = (ba.out, ba.dout, ba.lse);
    let (dq, dk, dv) = (ba.dq, ba.dk, ba.dv);
    // Keys no query row sees (or every key, without queries) get 0.
    dk.fill(E::from_f32(0.0));
    dv.fill(E::from_f32(0.0));
    if n.lse == 0 {
        return Ok(());
    }
    let vd = s.v_dim;
    // D_i = Σ dout·out, rows in fixed chunks.
    let mut dsum = vec![0f32; n.lse];
    {
        let ds = DisjointSlice::new(&mut dsum);
        const ROWS: usize = 256;
        pool.run(n.lse.div_ceil(ROWS), &|t| {
            let r0 = t * ROWS;
            let r1 = (r0 + ROWS).min(n.lse);
            // SAFETY: task `t` owns rows r0..r1.
            let d = unsafe { ds.range(r0..r1) };
            for (r, x) in (r0..r1).zip(d) {
                let o = &out[r * vd..][..vd];
                let g = &dout[r * vd..][..vd];
                *x = o.iter().zip(g).map(|(a, b)| a.to_f32() * b.to_f32()).sum();
            }
        });
    }
    let a = Args::new(s, tier, q, k, v);
    let d = s.head_dim;
    let err = FirstError::default();
    // Partial dQ per key group: [groups][batch][q_heads][q_len][d], f32.
    let groups = dq_groups(s, n.q);
    let mut dqp = vec![0f32; checked_mul(OP, groups, n.q)?];
    if s.kv_len > 0 {
        let tiles = s.kv_len.div_ceil(BK);
        let per = tiles.div_ceil(groups);
        let bg = s.batch * s.kv_heads;
        let head_rows = a.group() * s.q_len * d;
        let (dks, dvs, dqs) = (
            DisjointSlice::new(dk),
            DisjointSlice::new(dv),
            DisjointSlice::new(&mut dqp),
        );
        let dsum = &dsum;
        // Group-major: the first groups (with causal masks, the keys most
        // queries see) are handed out first.
        pool.run(groups * bg, &|t| {
            let (grp, bgi) = (t / bg, t % bg);
            let (b, g) = (bgi / s.kv_heads, bgi % s.kv_heads);
            let kt = grp * per..((grp + 1) * per).min(tiles);
            if kt.is_empty() {
                return;
            }
            let (j0, j1) = (kt.start * BK, (kt.end * BK).min(s.kv_len));
            let (r0, r1) = (a.krow(b, g, j0), a.krow(b, g, j1));
            let p0 = grp * n.q + bgi * head_rows;
            // SAFETY: task `t` alone owns key rows r0..r1 of (b, g) and
            // the partial dQ of group `grp` for the q heads of (b, g).
            let o = unsafe {
                GroupOut {
                    b,
                    g,
                    kt,
                    dk: dks.range(r0 * d..r1 * d),
                    dv: dvs.range(r0 * vd..r1 * vd),
                    dqp: dqs.range(p0..p0 + head_rows),
                }
            };
            // Zeros written before the products accumulate: see `zero_first`.
            zero_first(o.dqp);
            err.record(with_scratch(|sc| {
                bwd_on(a.tier, &a, (dout, lse, dsum), o, sc)
            }));
        });
    }
    // dQ = scale · Σ_groups partial, in group order.
    let dqo = DisjointSlice::new(dq);
    const CHUNK: usize = 1 << 14;
    let scale = s.scale;
    let dqp = &dqp;
    pool.run(n.q.div_ceil(CHUNK), &|t| {
        let r = t * CHUNK..((t + 1) * CHUNK).min(n.q);
        // SAFETY: task `t` owns elements `r`.
        let out = unsafe { dqo.range(r.clone()) };
        for (i, o) in r.zip(out) {
            let mut sum = 0f32;
            for grp in 0..groups {
                sum += dqp[grp * n.q + i];
            }
            *o = E::from_f32(sum * scale);
        }
    });
    err.result()
}

// ---------------------------------------------------------------------------
// Reference: plain O(n²) softmax attention in f64.

fn to64<E: Elem>(x: &[E]) -> Vec<f64> {
    x.iter().map(|v| v.to_f32() as f64).collect()
}

/// Every query row of the reference, in order: `(r, k0, lo, hi)`, its row
/// `r`, the row of its kv head's first key, and the keys `lo..hi` it sees.
fn ref_rows(s: &FlashShape) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
    let m = Mask::new(s);
    let grp = s.q_heads / s.kv_heads.max(1);
    (0..s.batch * s.q_heads).flat_map(move |bh| {
        let (b, h) = (bh / s.q_heads, bh % s.q_heads);
        let k0 = (b * s.kv_heads + h / grp) * s.kv_len;
        (0..s.q_len).map(move |i| {
            let (lo, hi) = m.range(i);
            (bh * s.q_len + i, k0, lo, hi)
        })
    })
}

/// f64 forward: (out, lse).
fn ref_fwd64(s: &FlashShape, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (d, dv) = (s.head_dim, s.v_dim);
    let rows = s.batch * s.q_heads * s.q_len;
    let mut out = vec![0f64; rows * dv];
    let mut lse = vec![f64::NEG_INFINITY; rows];
    for (r, k0, lo, hi) in ref_rows(s) {
        if lo >= hi {
            continue;
        }
        let qi = &q[r * d..][..d];
        let sc: Vec<f64> = (lo..hi)
            .map(|j| {
                let kj = &k[(k0 + j) * d..][..d];
                s.scale as f64 * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
            })
            .collect();
        let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = mx + sc.iter().map(|x| (x - mx).exp()).sum::<f64>().ln();
        lse[r] = l;
        for (j, x) in (lo..hi).zip(&sc) {
            let p = (x - l).exp();
            let vj = &v[(k0 + j) * dv..][..dv];
            for (o, y) in out[r * dv..][..dv].iter_mut().zip(vj) {
                *o += p * y;
            }
        }
    }
    (out, lse)
}

/// f64 backward: (dq, dk, dv), recomputing everything from q, k, v.
fn ref_bwd64(
    s: &FlashShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dout: &[f64],
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (d, dv) = (s.head_dim, s.v_dim);
    let (_, lse) = ref_fwd64(s, q, k, v);
    let mut dq = vec![0f64; q.len()];
    let mut dk = vec![0f64; k.len()];
    let mut dvv = vec![0f64; v.len()];
    let sc = s.scale as f64;
    for (r, k0, lo, hi) in ref_rows(s) {
        let qi = &q[r * d..][..d];
        let doi = &dout[r * dv..][..dv];
        let kr = |j: usize| k0 + j;
        let p: Vec<f64> = (lo..hi)
            .map(|j| {
                let kj = &k[kr(j) * d..][..d];
                (sc * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() - lse[r]).exp()
            })
            .collect();
        let dp: Vec<f64> = (lo..hi)
            .map(|j| {
                let vj = &v[kr(j) * dv..][..dv];
                doi.iter().zip(vj).map(|(a, b)| a * b).sum::<f64>()
            })
            .collect();
        let dd: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for (t, j) in (lo..hi).enumerate() {
            let ds = p[t] * (dp[t] - dd);
            for c in 0..d {
                dq[r * d + c] += sc * ds * k[kr(j) * d + c];
                dk[kr(j) * d + c] += sc * ds * qi[c];
            }
            for c in 0..dv {
                dvv[kr(j) * dv + c] += p[t] * doi[c];
            }
        }
    }
    (dq, dk, dvv)
}

/// The reference forward: plain softmax attention in f64, rounded once to `E`.
///
/// # Errors
/// When the q heads are not a multiple of the kv heads, a size overflows,
/// or a tensor's length is not the shape's.
pub fn flash_attn_ref<E: Elem>(a: FlashFwd<'_, E>) -> Result<(), KernelError> {
    a.check("flash_attn_ref")?;
    let s = &a.shape;
    let (o, l) = ref_fwd64(s, &to64(a.q), &to64(a.k), &to64(a.v));
    for (d, x) in a.out.iter_mut().zip(o) {
        *d = E::from_f32(x as f32);
    }
    for (d, x) in a.lse.iter_mut().zip(l) {
        *d = x as f32;
    }
    Ok(())
}

/// The reference backward in f64, rounded once to `E`. It recomputes the
/// softmax from `q`, `k`, `v`: `out` and `lse` are only length-checked.
///
/// # Errors
/// When the q heads are not a multiple of the kv heads, a size overflows,
/// or a tensor's length is not the shape's.
pub fn flash_attn_bwd_ref<E: Elem>(a: FlashBwd<'_, E>) -> Result<(), KernelError> {
    a.check("flash_attn_bwd_ref")?;
    let (gq, gk, gv) = ref_bwd64(&a.shape, &to64(a.q), &to64(a.k), &to64(a.v), &to64(a.dout));
    for (dst, src) in [(a.dq, gq), (a.dk, gk), (a.dv, gv)] {
        for (d, x) in dst.iter_mut().zip(src) {
            *d = E::from_f32(x as f32);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use kvant_kernels::cpu;
    use rand::{Rng, SeedableRng};

    #[allow(clippy::too_many_arguments)]
    fn shape(
        b: usize,
        qh: usize,
        kvh: usize,
        ql: usize,
        kl: usize,
        d: usize,
        dv: usize,
        causal: bool,
        window: Option<usize>,
    ) -> FlashShape {
        FlashShape {
            batch: b,
            q_heads: qh,
            kv_heads: kvh,
            q_len: ql,
            kv_len: kl,
            head_dim: d,
            v_dim: dv,
            scale: 1.0 / (d.max(1) as f32).sqrt(),
            causal,
            window,
        }
    }

    fn rand_vec<E: Elem>(rng: &mut rand_chacha::ChaCha8Rng, n: usize, amp: f32) -> Vec<E> {
        (0..n)
            .map(|_| E::from_f32(rng.random_range(-amp..amp)))
            .collect()
    }

    fn nan<E: Elem>(n: usize) -> Vec<E> {
        vec![E::from_f32(f32::NAN); n]
    }

    /// Random `q`, `k` (amplitude `amp`), `v`, `dout` (amplitude 1) for `s`.
    struct Inputs<E> {
        n: Sizes,
        q: Vec<E>,
        k: Vec<E>,
        v: Vec<E>,
        dout: Vec<E>,
    }

    impl<E: Elem> Inputs<E> {
        fn new(s: &FlashShape, seed: u64, amp: f32) -> Self {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let n = sizes("t", s).unwrap();
            let q = rand_vec(&mut rng, n.q, amp);
            let k = rand_vec(&mut rng, n.k, amp);
            let v = rand_vec(&mut rng, n.v, 1.0);
            let dout = rand_vec(&mut rng, n.o, 1.0);
            Inputs { n, q, k, v, dout }
        }

        /// The forward of these inputs into `out`, `lse`.
        fn fwd<'a>(
            &'a self,
            s: &FlashShape,
            out: &'a mut [E],
            lse: &'a mut [f32],
        ) -> FlashFwd<'a, E> {
            let (q, k, v) = (&self.q[..], &self.k[..], &self.v[..]);
            FlashFwd {
                shape: *s,
                q,
                k,
                v,
                out,
                lse,
            }
        }

        /// The backward of these inputs and the forward's `out`, `lse`
        /// into `d` (dq, dk, dv).
        fn bwd<'a>(
            &'a self,
            s: &FlashShape,
            (out, lse): (&'a [E], &'a [f32]),
            d: &'a mut (Vec<E>, Vec<E>, Vec<E>),
        ) -> FlashBwd<'a, E> {
            let (q, k, v, dout) = (&self.q[..], &self.k[..], &self.v[..], &self.dout[..]);
            let (dq, dk, dv) = (&mut d.0[..], &mut d.1[..], &mut d.2[..]);
            FlashBwd {
                shape: *s,
                q,
                k,
                v,
                out,
                dout,
                lse,
                dq,
                dk,
                dv,
            }
        }

        /// NaN-filled gradients.
        fn grads(&self) -> (Vec<E>, Vec<E>, Vec<E>) {
            (nan(self.n.q), nan(self.n.k), nan(self.n.v))
        }
    }

    /// Largest |got - want| over max(1, max |want|) (inputs are O(1)): an error relative
    /// to the tensor's scale, as a mean-free attention output has entries
    /// near 0 whose relative error says nothing, and a row seeing one key
    /// has exactly-zero dq and dk that f32 gives as a cancellation of
    /// O(1) terms (dP - D).
    fn rel_err<E: Elem>(got: &[E], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(1f64, |m, x| m.max(x.abs()));
        got.iter()
            .zip(want)
            .map(|(g, w)| {
                let g = g.to_f32() as f64;
                assert!(g.is_finite(), "non-finite {g} (want {w})");
                (g - w).abs()
            })
            .fold(0.0, f64::max)
            / scale
    }

    /// The shapes the tests run: odd lengths, kv_len ≠ q_len both ways,
    /// GQA 4:2 and 6:1, windows 1, 5, 100, causal on and off, rows that
    /// see nothing (kv_len < q_len causal; window with kv_len < q_len).
    fn shapes() -> Vec<FlashShape> {
        let mut v = Vec::new();
        for &(ql, kl) in &[
            (1, 1),
            (1, 9),
            (7, 7),
            (65, 65),
            (130, 130),
            (65, 130),
            (130, 65),
            (7, 3),
        ] {
            for &(qh, kvh) in &[(4, 2), (6, 1)] {
                for &d in &[31, 64] {
                    for &causal in &[true, false] {
                        for &w in &[None, Some(1), Some(5), Some(100)] {
                            // Keep the run short: every combination of the
                            // small ones, a sample of the large ones.
                            if ql >= 65 && (qh, d) == (6, 31) && w == Some(1) {
                                continue;
                            }
                            v.push(shape(
                                1,
                                qh,
                                kvh,
                                ql,
                                kl,
                                d,
                                if d == 31 { 17 } else { d },
                                causal,
                                w,
                            ));
                        }
                    }
                }
            }
        }
        v.push(shape(2, 2, 2, 7, 7, 8, 8, true, None));
        v
    }

    /// Tolerances, as [`rel_err`]. f32: the polynomial exp (~2e-7
    /// relative) and f32 sums of ≤ 130 terms in a different order than the
    /// f64 reference stay far below 2e-5 of the tensor's scale (measured
    /// ≤ 2e-6). bf16: inputs are the same bf16 values in both, so the error
    /// is the one rounding of each output (2^-9 relative) plus the rounding
    /// of `P` and `dS` to bf16 before their products (2^-9 of each term,
    /// mostly averaging out over a row: the output stays within 4e-3) and,
    /// in the backward, `D_i` computed from the bf16-rounded `out` (an error
    /// of ~2^-8·|out·dout| in every dS of the row): 1e-2 of the scale.
    fn tol<E: Elem>(grad: bool) -> f64 {
        if E::F32 {
            2e-5
        } else if grad {
            1e-2
        } else {
            4e-3
        }
    }

    fn check_shape<E: Elem>(s: &FlashShape, tier: SimdTier, seed: u64) {
        let x = Inputs::<E>::new(s, seed, 2.0);
        let (n, q, k, v, dout) = (&x.n, &x.q, &x.k, &x.v, &x.dout);
        let (o64, l64) = ref_fwd64(s, &to64(q), &to64(k), &to64(v));
        let mut out = nan::<E>(n.o);
        let mut lse = vec![f32::NAN; n.lse];
        flash_attn_fwd(tier, x.fwd(s, &mut out, &mut lse)).unwrap();
        let e = rel_err(&out, &o64);
        assert!(e <= tol::<E>(false), "{s:?} {tier} out err {e}");
        for (r, (&g, &w)) in lse.iter().zip(&l64).enumerate() {
            if w == f64::NEG_INFINITY {
                assert_eq!(g, f32::NEG_INFINITY, "{s:?} row {r}");
            } else {
                assert!(
                    (g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "{s:?} {tier} lse {g} vs {w}"
                );
            }
        }
        let (gq, gk, gv) = ref_bwd64(s, &to64(q), &to64(k), &to64(v), &to64(dout));
        let mut d = x.grads();
        flash_attn_bwd(tier, x.bwd(s, (&out, &lse), &mut d)).unwrap();
        let (dq, dk, dv) = &d;
        for (name, got, want) in [("dq", dq, &gq), ("dk", dk, &gk), ("dv", dv, &gv)] {
            let e = rel_err(got, want);
            assert!(e <= tol::<E>(true), "{s:?} {tier} {name} err {e}");
        }
    }

    #[test]
    fn every_tier_matches_the_f64_reference_f32() {
        for tier in cpu::available_tiers() {
            for (i, s) in shapes().iter().enumerate() {
                check_shape::<f32>(s, tier, i as u64);
            }
        }
    }

    #[test]
    fn every_tier_matches_the_f64_reference_bf16() {
        for tier in cpu::available_tiers() {
            for (i, s) in shapes().iter().enumerate() {
                check_shape::<bf16>(s, tier, 100 + i as u64);
            }
        }
    }

    /// One realistic shape: 8 q heads over 2 kv heads, 300 tokens, 128-dim heads.
    #[test]
    fn realistic_shape() {
        let s = shape(1, 8, 2, 300, 300, 128, 128, true, None);
        check_shape::<f32>(&s, cpu::tier(), 7);
        check_shape::<bf16>(&s, cpu::tier(), 8);
        let s = shape(1, 4, 4, 200, 200, 64, 64, true, Some(50));
        check_shape::<f32>(&s, cpu::tier(), 9);
    }

    /// Rows that see no key: lse -inf, out 0, dq 0; keys no row sees: dk = dv = 0.
    #[test]
    fn fully_masked_rows() {
        // kv_len 3 < q_len 7 causal: rows 0..4 see nothing.
        let s = shape(1, 2, 1, 7, 3, 8, 8, true, None);
        // Causal with window 0: nothing at all (d >= 0 and d < 0).
        let s0 = FlashShape {
            window: Some(0),
            ..shape(1, 2, 1, 5, 5, 8, 8, true, None)
        };
        for s in [s, s0] {
            let x = Inputs::<f32>::new(&s, 3, 1.0);
            let n = &x.n;
            for tier in cpu::available_tiers() {
                let (mut out, mut lse) = (nan::<f32>(n.o), vec![f32::NAN; n.lse]);
                flash_attn_fwd(tier, x.fwd(&s, &mut out, &mut lse)).unwrap();
                let mut rl = vec![0f32; n.lse];
                let mut ro = vec![0f32; n.o];
                flash_attn_ref(x.fwd(&s, &mut ro, &mut rl)).unwrap();
                for h in 0..2 {
                    for i in 0..s.q_len {
                        let r = h * s.q_len + i;
                        let (lo, hi) = Mask::new(&s).range(i);
                        if lo >= hi {
                            assert_eq!(lse[r], f32::NEG_INFINITY);
                            assert_eq!(rl[r], f32::NEG_INFINITY);
                            assert!(out[r * 8..][..8].iter().all(|&x| x == 0.0));
                        }
                    }
                }
                let mut d = x.grads();
                flash_attn_bwd(tier, x.bwd(&s, (&out, &lse), &mut d)).unwrap();
                let (dq, dk, dv) = &d;
                assert!(dq.iter().chain(dk).chain(dv).all(|x| x.is_finite()));
                if s.window == Some(0) {
                    assert!(dq.iter().chain(dk).chain(dv).all(|&x| x == 0.0));
                    assert!(out.iter().all(|&x| x == 0.0));
                }
            }
        }
    }

    /// Central differences of L = Σ dout·out through the f64 reference
    /// forward match the reference backward (f64: step 1e-6, truncation
    /// error ~1e-12, rounding ~1e-10; tolerance 1e-7 relative to max(1, |g|)).
    #[test]
    fn reference_gradient_matches_finite_differences() {
        for s in [
            shape(1, 4, 2, 3, 5, 3, 2, true, Some(3)),
            shape(1, 2, 1, 4, 4, 2, 3, false, None),
            shape(1, 2, 2, 4, 3, 2, 2, true, None),
        ] {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
            let n = sizes("t", &s).unwrap();
            let mut r =
                |n: usize| -> Vec<f64> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
            let (q, k, v, dout) = (r(n.q), r(n.k), r(n.v), r(n.o));
            let (gq, gk, gv) = ref_bwd64(&s, &q, &k, &v, &dout);
            let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                let (o, _) = ref_fwd64(&s, q, k, v);
                o.iter().zip(&dout).map(|(a, b)| a * b).sum()
            };
            let h = 1e-6;
            for which in 0..3 {
                let (base, grad) = match which {
                    0 => (&q, &gq),
                    1 => (&k, &gk),
                    _ => (&v, &gv),
                };
                for idx in 0..base.len() {
                    let mut p = base.clone();
                    let mut m = base.clone();
                    p[idx] += h;
                    m[idx] -= h;
                    let (lp, lm) = match which {
                        0 => (loss(&p, &k, &v), loss(&m, &k, &v)),
                        1 => (loss(&q, &p, &v), loss(&q, &m, &v)),
                        _ => (loss(&q, &k, &p), loss(&q, &k, &m)),
                    };
                    let fd = (lp - lm) / (2.0 * h);
                    assert!(
                        (fd - grad[idx]).abs() <= 1e-7 * grad[idx].abs().max(1.0),
                        "{s:?} tensor {which} [{idx}]: fd {fd} vs {}",
                        grad[idx]
                    );
                }
            }
        }
    }

    /// Every output is written by one task in an order fixed by the shape:
    /// 1 and 3 threads give the same bits.
    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let one = ThreadPool::new(1).unwrap();
        let three = ThreadPool::new(3).unwrap();
        let s = shape(2, 4, 2, 150, 150, 32, 32, true, Some(70));
        let x = Inputs::<bf16>::new(&s, 5, 2.0);
        let n = &x.n;
        let run = |pool: &ThreadPool| {
            let (mut out, mut lse) = (nan::<bf16>(n.o), vec![f32::NAN; n.lse]);
            fwd_in(pool, cpu::tier(), x.fwd(&s, &mut out, &mut lse)).unwrap();
            let mut d = x.grads();
            bwd_in(pool, cpu::tier(), x.bwd(&s, (&out, &lse), &mut d)).unwrap();
            let (dq, dk, dv) = &d;
            let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            (
                bits(&out),
                lse.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                bits(dq),
                bits(dk),
                bits(dv),
            )
        };
        assert_eq!(run(&one), run(&three));
    }

    #[test]
    fn bad_arguments_are_errors() {
        fn fwd(
            shape: FlashShape,
            (q, k, v): (&[f32], &[f32], &[f32]),
            out: &mut [f32],
            lse: &mut [f32],
        ) -> Result<(), KernelError> {
            flash_attn_fwd(
                cpu::tier(),
                FlashFwd {
                    shape,
                    q,
                    k,
                    v,
                    out,
                    lse,
                },
            )
        }
        let s = shape(1, 3, 2, 4, 4, 8, 8, true, None);
        let z = vec![0f32; 1000];
        let mut o = vec![0f32; 1000];
        let mut l = vec![0f32; 1000];
        assert!(matches!(
            fwd(
                s,
                (&z[..96], &z[..64], &z[..64]),
                &mut o[..96],
                &mut l[..12]
            ),
            Err(KernelError::InvalidShape { .. })
        ));
        let s = shape(1, 4, 2, 4, 4, 8, 8, true, None);
        assert!(matches!(
            fwd(
                s,
                (&z[..127], &z[..64], &z[..64]),
                &mut o[..128],
                &mut l[..16]
            ),
            Err(KernelError::LengthMismatch { .. })
        ));
        let (mut a, mut b, mut c) = (vec![0f32; 128], vec![0f32; 64], vec![0f32; 64]);
        let bwd = FlashBwd {
            shape: s,
            q: &z[..128],
            k: &z[..64],
            v: &z[..64],
            out: &z[..128],
            dout: &z[..128],
            lse: &l[..15],
            dq: &mut a,
            dk: &mut b,
            dv: &mut c,
        };
        assert!(matches!(
            flash_attn_bwd(cpu::tier(), bwd),
            Err(KernelError::LengthMismatch { .. })
        ));
        let s0 = FlashShape { kv_heads: 0, ..s };
        assert!(fwd(s0, (&z[..128], &[], &[]), &mut o[..128], &mut l[..16]).is_err());
        let big = FlashShape {
            batch: usize::MAX / 2,
            ..s
        };
        assert!(matches!(
            fwd(big, (&z, &z, &z), &mut o, &mut l),
            Err(KernelError::SizeOverflow { .. })
        ));
        // Empty shapes are fine.
        let e = FlashShape { q_len: 0, ..s };
        fwd(e, (&[], &z[..64], &z[..64]), &mut [], &mut []).unwrap();
    }
}
