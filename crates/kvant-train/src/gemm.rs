//! General matrix product for the training kernels:
//! `C = β·C + α·A·B`, `A` `[m×k]` and `B` `[k×n]` strided views of f32 or
//! bf16 (mixed allowed), `C` row-major f32.
//!
//! GotoBLAS/BLIS structure: `C` is cut into tiles, one task each; a task
//! walks `k` in blocks of `KC`, packs its `A` rows into `MR`-row panels
//! and its `B` columns into `NR`-column panels (widening bf16 to f32
//! exactly, zero-padding the edges), and runs one register-tiled
//! microkernel over every `MR×NR` block. Packing turns every
//! transpose/stride case and both element types into the same kernel.
//!
//! Every element of `C` is written by exactly one task, as
//! `c ← β·c + α·s₀`, then `c ← c + α·s_b` for each later `k` block `b`,
//! where `s_b` is one FMA chain over the block's `k` in order. The blocks
//! depend only on `KC` (fixed per tier), never on the tiling of `C` or the
//! thread count, so results are bitwise the same on any pool.
//!
//! bf16 × bf16 on a CPU with AVX-512 BF16 packs pairs of `k` into 32-bit
//! words for `vdpbf16ps` (two exact products per lane and step, f32 sums
//! with denormals flushed), twice the f32 FMA rate; every other type mix
//! widens to f32 while packing.
//!
//! Measured 2026-12-04 on the 2-core Zen 4 VM (AVX-512 double-pumped),
//! shared with other jobs, so in GFLOP per CPU-second of one thread
//! (1-thread pool), best of 4, against torch 2.15 (MKL f32, oneDNN bf16,
//! `torch.set_num_threads(1)`, thread CPU time), shapes of the LM head at
//! `(n, h, v) = (256, 512, 32000)`:
//!
//! | shape (m×n×k)          | f32  | torch f32 | bf16 | torch bf16 |
//! |------------------------|------|-----------|------|------------|
//! | NT 256×32000×512 (X·Wᵀ) | 91–95 | 66–76    | 162  | 192–199    |
//! | NN 256×512×32000 (G·W)  | 85–89 | 93–96    | 155  | 180–196    |
//! | TN 32000×512×256 (Gᵀ·X) | 86–100 | 70–72   | 170  | 197–210    |
//!
//! The AVX-512 12×32 f32 kernel beat AVX2 6×16 by 0–15% (AVX2: 78–91 /
//! 73–87 / 81–100), so the Avx512 tier uses it. What it cost to get here:
//! packing inside a `thread_local!` closure ran without the tier's target
//! features (the closure does not inherit them: 28–40% of the time in
//! packing), and reading `B` panel by panel instead of row by row defeated
//! the prefetchers (NN 79 → 87).

use std::cell::Cell;

use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::error::checked_mul;
use kvant_kernels::lanes::Lanes;
use kvant_kernels::pool::{self, ThreadPool};
use kvant_kernels::KernelError;

use super::Elem;

/// A strided view of a matrix: element `(i, j)` at
/// `data[i·row_stride + j·col_stride]`, every such index checked once,
/// in [`MatRef::new`].
#[derive(Clone, Copy)]
pub struct MatRef<'a, E> {
    data: &'a [E],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a, E> MatRef<'a, E> {
    /// A `rows × cols` view of `data` with the given strides.
    ///
    /// # Errors
    /// When the last element lies past `data` or its index overflows.
    pub fn new(
        data: &'a [E],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, KernelError> {
        if rows > 0 && cols > 0 {
            let last = checked_mul("gemm matrix", rows - 1, row_stride)?
                .checked_add(checked_mul("gemm matrix", cols - 1, col_stride)?)
                .ok_or(KernelError::SizeOverflow {
                    op: "gemm matrix",
                    a: rows,
                    b: cols,
                })?;
            if last >= data.len() {
                return Err(KernelError::IndexOutOfRange {
                    what: "gemm matrix element",
                    index: last,
                    len: data.len(),
                });
            }
        }
        Ok(MatRef {
            data,
            rows,
            cols,
            rs: row_stride,
            cs: col_stride,
        })
    }

    /// A row-major `rows × cols` view of `data` (row stride `cols`).
    ///
    /// # Errors
    /// When `data` holds fewer than `rows·cols` values.
    pub fn row_major(data: &'a [E], rows: usize, cols: usize) -> Result<Self, KernelError> {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose (a view of the same data; no copy).
    pub fn t(self) -> Self {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Element `(i, j)` without a bounds check.
    ///
    /// # Safety
    /// `i < rows` and `j < cols` (then the index is in bounds, see `new`).
    #[inline(always)]
    unsafe fn at(&self, i: usize, j: usize) -> E
    where
        E: Copy,
    {
        // SAFETY: the caller's contract and the check in `new`.
        unsafe { *self.data.get_unchecked(i * self.rs + j * self.cs) }
    }
}

/// One product `C = beta·C + alpha·A·B`: `A` `[m×k]`, `B` `[k×n]`, `C`
/// row-major f32 with leading dimension `ldc`. With `beta == 0`, `C` is
/// not read (NaNs there do not propagate). The kernel and its reference
/// take the same arguments and check them with [`GemmArgs::check`].
pub struct GemmArgs<'a, A, B> {
    pub a: MatRef<'a, A>,
    pub b: MatRef<'a, B>,
    pub c: &'a mut [f32],
    pub ldc: usize,
    pub alpha: f32,
    pub beta: f32,
}

impl<'a, A, B> GemmArgs<'a, A, B> {
    /// `C = A·B` (`alpha` 1, `beta` 0).
    pub fn new(a: MatRef<'a, A>, b: MatRef<'a, B>, c: &'a mut [f32], ldc: usize) -> Self {
        GemmArgs {
            a,
            b,
            c,
            ldc,
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// With `alpha`.
    pub fn alpha(self, alpha: f32) -> Self {
        GemmArgs { alpha, ..self }
    }

    /// With `beta`.
    pub fn beta(self, beta: f32) -> Self {
        GemmArgs { beta, ..self }
    }

    /// Checks the shapes; `(m, n, k)`.
    ///
    /// # Errors
    /// When `A`'s columns differ from `B`'s rows, `ldc < n`, or `C` is too short.
    pub fn check(&self) -> Result<(usize, usize, usize), KernelError> {
        let (m, n, k) = (self.a.rows, self.b.cols, self.a.cols);
        let ldc = self.ldc;
        if self.b.rows != k {
            return Err(KernelError::InvalidShape {
                op: "gemm",
                why: format!("A is {m}x{k} but B is {}x{n}", self.b.rows),
            });
        }
        if m > 0 && n > 0 {
            if ldc < n {
                return Err(KernelError::InvalidShape {
                    op: "gemm",
                    why: format!("ldc {ldc} < n {n}"),
                });
            }
            let need = checked_mul("gemm C", m - 1, ldc)?.checked_add(n).ok_or(
                KernelError::SizeOverflow {
                    op: "gemm C",
                    a: m,
                    b: ldc,
                },
            )?;
            if need > self.c.len() {
                return Err(KernelError::IndexOutOfRange {
                    what: "gemm C element",
                    index: need - 1,
                    len: self.c.len(),
                });
            }
        }
        Ok((m, n, k))
    }
}

/// [`GemmArgs`] on the global pool and tier.
///
/// # Errors
/// As [`GemmArgs::check`].
pub fn gemm<A: Elem, B: Elem>(g: GemmArgs<'_, A, B>) -> Result<(), KernelError> {
    gemm_in(pool::global(), cpu::tier(), g)
}

/// [`gemm`]'s reference: each element one f64 sum over `k` in order,
/// `beta·c + alpha·sum` in f64, rounded once.
///
/// # Errors
/// As [`gemm`].
pub fn gemm_ref<A: Elem, B: Elem>(g: GemmArgs<'_, A, B>) -> Result<(), KernelError> {
    let (m, n, k) = g.check()?;
    let (a, b, ldc) = (g.a, g.b, g.ldc);
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            for q in 0..k {
                // SAFETY: i < m, q < k, j < n: inside both views.
                let (x, y) = unsafe { (a.at(i, q), b.at(q, j)) };
                s += x.to_f32() as f64 * y.to_f32() as f64;
            }
            let cv = &mut g.c[i * ldc + j];
            let old = if g.beta == 0.0 {
                0.0
            } else {
                g.beta as f64 * *cv as f64
            };
            *cv = (old + g.alpha as f64 * s) as f32;
        }
    }
    Ok(())
}

/// How the microkernel combines its sums `s` with `C`: `c ← α·s` when
/// `!load`, else `c ← fma(c, β, α·s)` (β = 1 after the first `k` block,
/// which is an exact-product add).
#[derive(Clone, Copy)]
struct Epi {
    alpha: f32,
    beta: f32,
    load: bool,
}

/// One tier's register tile and blocking.
trait Micro {
    /// Rows of the register tile (values broadcast from the `A` panel).
    const MR: usize;
    /// Columns of the register tile (vector lanes from the `B` panel).
    const NR: usize;
    /// `k` per block: a `KC×NR` `B` panel stays in L1 while the `A`
    /// panels stream from L2.
    const KC: usize;
    /// Most rows of `C` per task: the packed `MC×KC` `A` block in L2.
    const MC: usize;
    /// Most columns of `C` per task: the packed `KC×NC` `B` block.
    const NC: usize;
    /// Whether the AVX2 packing paths may run (the tier has AVX2).
    const SIMD: bool;
    /// Whether panels hold bf16 pairs (`k` even in the low half, odd in
    /// the high half of each 32-bit word) for `vdpbf16ps`.
    const PAIRS: bool = false;

    /// `C[0..MR, 0..NR] (row stride ldc) ← epi(A_panel · B_panel)` over
    /// `kc` steps; panels packed as `a[q·MR + i]`, `b[q·NR + j]`.
    ///
    /// # Safety
    /// The CPU has the tier's features; `a`, `b` read `kc` steps and `c`
    /// addresses a full `MR×NR` tile.
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, e: Epi);
}

/// Largest `MR·NR` of any tier (the edge tile's scratch).
const MAX_TILE: usize = 16 * 32;

/// Portable kernel: separate multiply and add, no FMA (the scalar tier).
struct ScalarK;

impl Micro for ScalarK {
    const MR: usize = 4;
    const NR: usize = 8;
    const KC: usize = 256;
    const MC: usize = 128;
    const NC: usize = 512;
    const SIMD: bool = false;

    #[inline(always)]
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, e: Epi) {
        let mut acc = [[0f32; 8]; 4];
        for q in 0..kc {
            // SAFETY: the caller's contract: `kc` steps of each panel.
            let (ap, bp) = unsafe { (a.add(q * 4), b.add(q * 8)) };
            for (i, row) in acc.iter_mut().enumerate() {
                // SAFETY: as above.
                let av = unsafe { *ap.add(i) };
                for (j, s) in row.iter_mut().enumerate() {
                    // SAFETY: as above.
                    *s += av * unsafe { *bp.add(j) };
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, s) in row.iter().enumerate() {
                // SAFETY: `c` addresses a full tile.
                let cv = unsafe { &mut *c.add(i * ldc + j) };
                *cv = if e.load {
                    *cv * e.beta + e.alpha * s
                } else {
                    e.alpha * s
                };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Epi, Micro};
    use std::arch::x86_64::*;

    /// A tier's [`tile`], compiled with its features.
    type TileFn = unsafe fn(usize, *const f32, *const f32, *mut f32, usize, Epi);

    /// A vector register of f32 sums: the accumulators of a SIMD tile.
    pub(super) trait Sums: Copy {
        const LANES: usize;
        unsafe fn zero() -> Self;
        unsafe fn splat(x: f32) -> Self;
        unsafe fn mul(self, b: Self) -> Self;
        /// `self·b + c`, rounded once.
        unsafe fn fmadd(self, b: Self, c: Self) -> Self;
        unsafe fn load(p: *const f32) -> Self;
        unsafe fn store(self, p: *mut f32);
    }

    /// `impl Sums` for one vector type, from its intrinsics.
    macro_rules! sums {
        ($v:ty, $lanes:literal, $zero:ident, $splat:ident, $mul:ident, $fmadd:ident, $load:ident, $store:ident) => {
            // SAFETY (every method): the vector's features (AVX2+FMA for
            // `__m256`, AVX-512F for `__m512`) are enabled in the caller, as
            // every `Micro::tile` caller's contract says, and `p` addresses
            // `LANES` floats.
            impl Sums for $v {
                const LANES: usize = $lanes;
                #[inline(always)]
                unsafe fn zero() -> Self {
                    // SAFETY: see the impl.
                    unsafe { $zero() }
                }
                #[inline(always)]
                unsafe fn splat(x: f32) -> Self {
                    // SAFETY: see the impl.
                    unsafe { $splat(x) }
                }
                #[inline(always)]
                unsafe fn mul(self, b: Self) -> Self {
                    // SAFETY: see the impl.
                    unsafe { $mul(self, b) }
                }
                #[inline(always)]
                unsafe fn fmadd(self, b: Self, c: Self) -> Self {
                    // SAFETY: see the impl.
                    unsafe { $fmadd(self, b, c) }
                }
                #[inline(always)]
                unsafe fn load(p: *const f32) -> Self {
                    // SAFETY: see the impl.
                    unsafe { $load(p) }
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut f32) {
                    // SAFETY: see the impl.
                    unsafe { $store(p, self) }
                }
            }
        };
    }

    sums!(
        __m256,
        8,
        _mm256_setzero_ps,
        _mm256_set1_ps,
        _mm256_mul_ps,
        _mm256_fmadd_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps
    );
    sums!(
        __m512,
        16,
        _mm512_setzero_ps,
        _mm512_set1_ps,
        _mm512_mul_ps,
        _mm512_fmadd_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps
    );

    /// A SIMD tier's register tile, [`tile`]: `MR` rows of two [`Sums`]
    /// vectors; per step two `B` loads, `MR` broadcasts of `A` values and
    /// `2·MR` multiply-adds.
    pub(super) trait Wide {
        type Sums: Sums;
        /// One operand vector: f32 lanes, or bf16 pairs for `vdpbf16ps`.
        type In: Copy;
        const MR: usize;
        const PAIRS: bool;
        const TILE: TileFn;
        /// `B` values at `p` (a panel's step).
        unsafe fn load_b(p: *const f32) -> Self::In;
        /// The `A` value at `p` in every lane.
        unsafe fn splat_a(p: *const f32) -> Self::In;
        /// `acc + a·b`, lane by lane.
        unsafe fn madd(acc: Self::Sums, a: Self::In, b: Self::In) -> Self::Sums;
    }

    /// Every SIMD tier blocks alike; only the register tile differs.
    impl<W: Wide> Micro for W {
        const MR: usize = <W as Wide>::MR;
        const NR: usize = 2 * W::Sums::LANES;
        const KC: usize = 256;
        const MC: usize = 264;
        const NC: usize = 512;
        const SIMD: bool = true;
        const PAIRS: bool = <W as Wide>::PAIRS;

        #[inline(always)]
        unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, e: Epi) {
            // SAFETY: the caller's contract (the tier's features; panel and
            // tile extents), which is `TILE`'s.
            unsafe { (W::TILE)(kc, a, b, c, ldc, e) }
        }
    }

    /// [`Micro::tile`] of every SIMD tier: `C[0..MR, 0..NR]` (row stride
    /// `ldc`) `← epi(A_panel · B_panel)` over `kc` steps, `NR = 2·LANES`.
    ///
    /// # Safety
    /// `W`'s features are enabled; `a`, `b` read `kc` steps of `MR` and
    /// `NR` values, and `c` addresses a full `MR×NR` tile.
    #[inline(always)]
    unsafe fn tile<W: Wide, const MR: usize>(
        kc: usize,
        mut a: *const f32,
        mut b: *const f32,
        c: *mut f32,
        ldc: usize,
        e: Epi,
    ) {
        let n = W::Sums::LANES;
        // SAFETY: the caller's contract.
        unsafe {
            let mut acc = [[W::Sums::zero(); 2]; MR];
            for _ in 0..kc {
                let b0 = W::load_b(b);
                let b1 = W::load_b(b.add(n));
                for (i, r) in acc.iter_mut().enumerate() {
                    let av = W::splat_a(a.add(i));
                    r[0] = W::madd(r[0], av, b0);
                    r[1] = W::madd(r[1], av, b1);
                }
                a = a.add(MR);
                b = b.add(2 * n);
            }
            let al = W::Sums::splat(e.alpha);
            let be = W::Sums::splat(e.beta);
            for (i, r) in acc.iter().enumerate() {
                for (h, &s) in r.iter().enumerate() {
                    let p = c.add(i * ldc + h * n);
                    let mut v = s.mul(al);
                    if e.load {
                        v = W::Sums::load(p).fmadd(be, v);
                    }
                    v.store(p);
                }
            }
        }
    }

    /// AVX2 6×16: 12 ymm accumulators.
    pub(super) struct Avx2K;

    impl Wide for Avx2K {
        type Sums = __m256;
        type In = __m256;
        const MR: usize = 6;
        const PAIRS: bool = false;
        const TILE: TileFn = tile_avx2;
        #[inline(always)]
        unsafe fn load_b(p: *const f32) -> __m256 {
            // SAFETY: AVX2 (the tile's contract); `p` reads 8 floats.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn splat_a(p: *const f32) -> __m256 {
            // SAFETY: as `load_b`, one float.
            unsafe { _mm256_broadcast_ss(&*p) }
        }
        #[inline(always)]
        unsafe fn madd(acc: __m256, a: __m256, b: __m256) -> __m256 {
            // SAFETY: FMA (the tile's contract).
            unsafe { _mm256_fmadd_ps(a, b, acc) }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_avx2(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, e: Epi) {
        // SAFETY: the caller's contract, with AVX2+FMA enabled here.
        unsafe { tile::<Avx2K, 6>(kc, a, b, c, ldc, e) }
    }

    /// `dst[q·ld + c] = src[c·stride + q]` for `c < w` (8 or 4), `q < kc`
    /// (a multiple of 8), widened: 8×8 or 4×8 blocks transposed in
    /// registers.
    ///
    /// # Safety
    /// AVX2; the reads and writes lie inside their buffers.
    #[inline(always)]
    pub(super) unsafe fn transpose_panel<E: kvant_kernels::lanes::Lanes>(
        w: usize,
        src: *const E,
        stride: usize,
        kc: usize,
        dst: *mut f32,
        ld: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            for q in (0..kc).step_by(8) {
                let r = |c: usize| E::load8(src.add(c * stride + q));
                let d = dst.add(q * ld);
                let s = quad(r(0), r(1), r(2), r(3));
                if w == 8 {
                    let u = quad(r(4), r(5), r(6), r(7));
                    for h in 0..4 {
                        let v = _mm256_permute2f128_ps::<0x20>(s[h], u[h]);
                        _mm256_storeu_ps(d.add(h * ld), v);
                    }
                    for h in 0..4 {
                        let v = _mm256_permute2f128_ps::<0x31>(s[h], u[h]);
                        _mm256_storeu_ps(d.add((h + 4) * ld), v);
                    }
                } else {
                    for (h, &v) in s.iter().enumerate() {
                        _mm_storeu_ps(d.add(h * ld), _mm256_castps256_ps128(v));
                        _mm_storeu_ps(d.add((h + 4) * ld), _mm256_extractf128_ps::<1>(v));
                    }
                }
            }
        }
    }

    /// Four rows of 8 transposed within 128-bit halves: `s[h]` holds
    /// column `h` of the rows in its low half and column `h + 4` in its
    /// high half.
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn quad(r0: __m256, r1: __m256, r2: __m256, r3: __m256) -> [__m256; 4] {
        // SAFETY: the caller's contract.
        unsafe {
            let t0 = _mm256_unpacklo_ps(r0, r1);
            let t1 = _mm256_unpackhi_ps(r0, r1);
            let t2 = _mm256_unpacklo_ps(r2, r3);
            let t3 = _mm256_unpackhi_ps(r2, r3);
            [
                _mm256_shuffle_ps::<0x44>(t0, t2),
                _mm256_shuffle_ps::<0xEE>(t0, t2),
                _mm256_shuffle_ps::<0x44>(t1, t3),
                _mm256_shuffle_ps::<0xEE>(t1, t3),
            ]
        }
    }

    /// AVX-512 BF16 12×32 on bf16 pairs: `vdpbf16ps` adds two exact
    /// products per lane and step, twice the f32 FMA's rate.
    pub(super) struct Bf16K;

    impl Wide for Bf16K {
        type Sums = __m512;
        type In = __m512bh;
        const MR: usize = 12;
        const PAIRS: bool = true;
        const TILE: TileFn = tile_bf16;
        #[inline(always)]
        unsafe fn load_b(p: *const f32) -> __m512bh {
            // SAFETY: AVX-512F (the tile's contract); `p` reads 16 words of
            // bf16 pairs, which any bits are.
            unsafe { std::mem::transmute(_mm512_loadu_si512(p as *const _)) }
        }
        #[inline(always)]
        unsafe fn splat_a(p: *const f32) -> __m512bh {
            // SAFETY: as `load_b`, one word.
            unsafe { std::mem::transmute(_mm512_set1_epi32(*(p as *const i32))) }
        }
        #[inline(always)]
        unsafe fn madd(acc: __m512, a: __m512bh, b: __m512bh) -> __m512 {
            // SAFETY: AVX-512 BF16 (the tile's contract).
            unsafe { _mm512_dpbf16_ps(acc, a, b) }
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
    unsafe fn tile_bf16(ks: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, e: Epi) {
        // SAFETY: the caller's contract (`ks` steps of 12 and 32 words), with
        // AVX-512 BF16 enabled here.
        unsafe { tile::<Bf16K, 12>(ks, a, b, c, ldc, e) }
    }

    /// AVX-512 12×32: 24 zmm accumulators.
    pub(super) struct Avx512K;

    impl Wide for Avx512K {
        type Sums = __m512;
        type In = __m512;
        const MR: usize = 12;
        const PAIRS: bool = false;
        const TILE: TileFn = tile_avx512;
        #[inline(always)]
        unsafe fn load_b(p: *const f32) -> __m512 {
            // SAFETY: AVX-512F (the tile's contract); `p` reads 16 floats.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn splat_a(p: *const f32) -> __m512 {
            // SAFETY: as `load_b`, one float.
            unsafe { _mm512_set1_ps(*p) }
        }
        #[inline(always)]
        unsafe fn madd(acc: __m512, a: __m512, b: __m512) -> __m512 {
            // SAFETY: AVX-512F (the tile's contract).
            unsafe { _mm512_fmadd_ps(a, b, acc) }
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn tile_avx512(
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        e: Epi,
    ) {
        // SAFETY: the caller's contract, with AVX-512F enabled here.
        unsafe { tile::<Avx512K, 12>(kc, a, b, c, ldc, e) }
    }
}

/// `C`'s base pointer, shared by tasks that write disjoint tiles.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: tasks write disjoint tiles of `C` (see `gemm_in`), so sharing
// the pointer is sharing disjoint `&mut` regions of an f32 slice.
unsafe impl Send for CPtr {}
// SAFETY: as above.
unsafe impl Sync for CPtr {}

/// Everything a task needs.
struct Job<'a, A, B> {
    a: MatRef<'a, A>,
    b: MatRef<'a, B>,
    c: CPtr,
    ldc: usize,
    alpha: f32,
    beta: f32,
    /// Tile sizes of `C` (multiples of MR and NR) and tiles across `n`.
    mc: usize,
    nc: usize,
    ntiles: usize,
}

thread_local! {
    /// Per-thread packing buffers (`A` block, `B` block), reused across calls.
    static PACK: Cell<(Vec<f32>, Vec<f32>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// A 64-byte-aligned pointer to at least `len` floats of `v`.
fn aligned(v: &mut Vec<f32>, len: usize) -> *mut f32 {
    if v.len() < len + 16 {
        v.resize(len + 16, 0.0);
    }
    let p = v.as_mut_ptr();
    // SAFETY: the offset is < 16 floats, inside the 16 spare ones.
    unsafe { p.add(p.align_offset(64).min(15)) }
}

/// The part of a matrix one packing moves: rows `i0..i0+rows`, `k`
/// `k0..k0+kc`, in panels of `mr` rows (`MR` for `A`; `B` is packed as its
/// transpose, in panels of `NR`).
#[derive(Clone, Copy)]
struct Block {
    i0: usize,
    rows: usize,
    k0: usize,
    kc: usize,
    mr: usize,
}

/// Packs `blk` of `a` for `K`: [`pack_pairs`] or [`pack_f32`].
///
/// # Safety
/// As those.
#[inline(always)]
unsafe fn pack<E: Lanes, K: Micro>(a: &MatRef<'_, E>, blk: Block, dst: *mut f32) {
    // SAFETY: the caller's contract.
    unsafe {
        if K::PAIRS {
            pack_pairs::<E, K>(a, blk, dst)
        } else {
            pack_f32::<E, K>(a, blk, dst)
        }
    }
}

/// Packs `blk` of `a` into `mr`-row panels of f32:
/// panel `p` at `dst + p·mr·kc`, step `q`'s values at `+ q·mr`; rows past
/// the end are zeros. Contiguous runs are read in memory order (row by
/// row, or column by column across every panel) so the prefetchers
/// stream them; rows of a row-major `A` (columns of a column-major `B`)
/// go through 8×8 and 4×8 register transposes. Every path moves the
/// same bits.
///
/// # Safety
/// The ranges lie inside `a`; `dst` holds `ceil(rows/mr)·mr·kc` floats.
#[inline(always)]
unsafe fn pack_f32<E: Lanes, K: Micro>(a: &MatRef<'_, E>, blk: Block, dst: *mut f32) {
    let (i0, rows, k0, kc, mr) = (blk.i0, blk.rows, blk.k0, blk.kc, blk.mr);
    let panels = rows.div_ceil(mr);
    // SAFETY: inside `dst` by the caller's contract.
    let d = unsafe { std::slice::from_raw_parts_mut(dst, panels * mr * kc) };
    if a.rs == 1 && a.cs != 1 {
        for q in 0..kc {
            let base = (k0 + q) * a.cs + i0;
            // SAFETY: column `k0+q`, rows `i0..i0+rows` lie inside `a`.
            let src = unsafe { a.data.get_unchecked(base..base + rows) };
            for (p, sp) in src.chunks(mr).enumerate() {
                let o = p * mr * kc + q * mr;
                for (dv, v) in d[o..o + sp.len()].iter_mut().zip(sp) {
                    *dv = v.to_f32();
                }
            }
        }
    } else {
        for (p, r0) in (0..rows).step_by(mr).enumerate() {
            let re = mr.min(rows - r0);
            let dp = &mut d[p * mr * kc..(p + 1) * mr * kc];
            let mut r = 0;
            #[cfg(target_arch = "x86_64")]
            if K::SIMD && a.cs == 1 {
                let q8 = kc / 8 * 8;
                while r < re && re - r >= 4 {
                    let base = (i0 + r0 + r) * a.rs + k0;
                    let w = if re - r >= 8 { 8 } else { 4 };
                    // SAFETY: the tier has AVX2 (`K::SIMD`); rows
                    // `i0+r0+r..+w`, columns `k0..k0+q8` lie inside `a`;
                    // the stores stay inside the panel.
                    unsafe {
                        let src = a.data.as_ptr().add(base);
                        let dp = dp.as_mut_ptr().add(r);
                        x86::transpose_panel(w, src, a.rs, q8, dp, mr);
                    }
                    for rr in r..r + w {
                        for q in q8..kc {
                            // SAFETY: inside `a` by the caller's contract.
                            dp[q * mr + rr] = unsafe { a.at(i0 + r0 + rr, k0 + q) }.to_f32();
                        }
                    }
                    r += w;
                }
            }
            if a.cs == 1 {
                for rr in r..re {
                    let base = (i0 + r0 + rr) * a.rs + k0;
                    // SAFETY: row `i0+r0+rr`, columns `k0..k0+kc` lie inside `a`.
                    let src = unsafe { a.data.get_unchecked(base..base + kc) };
                    for (q, v) in src.iter().enumerate() {
                        dp[q * mr + rr] = v.to_f32();
                    }
                }
            } else {
                for q in 0..kc {
                    for rr in r..re {
                        // SAFETY: inside `a` by the caller's contract.
                        dp[q * mr + rr] = unsafe { a.at(i0 + r0 + rr, k0 + q) }.to_f32();
                    }
                }
            }
        }
    }
    let re = rows - (panels - 1) * mr;
    if re < mr {
        let dp = &mut d[(panels - 1) * mr * kc..];
        for q in 0..kc {
            dp[q * mr + re..q * mr + mr].fill(0.0);
        }
    }
}

/// The bf16 bits of `v` (exact for values widened from bf16).
#[inline(always)]
fn bf16_bits<E: Lanes>(v: E) -> u32 {
    v.to_f32().to_bits() >> 16
}

/// `out[c] = bits(lo[c]) | bits(hi[c]) << 16` (`hi` absent: 0).
#[inline(always)]
fn interleave<E: Lanes>(lo: &[E], hi: Option<&[E]>, out: &mut [u32]) {
    match hi {
        Some(hi) => {
            for ((o, l), h) in out.iter_mut().zip(lo).zip(hi) {
                *o = bf16_bits(*l) | bf16_bits(*h) << 16;
            }
        }
        None => {
            for (o, l) in out.iter_mut().zip(lo) {
                *o = bf16_bits(*l);
            }
        }
    }
}

/// Whether runs of `E` along a stride-1 dimension can be read as 32-bit
/// words (bf16 pairs) with `stride` (in elements) of the other dimension:
/// a 2-byte type and an even stride.
#[inline(always)]
fn word_runs<E, K: Micro>(stride: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && K::SIMD
        && std::mem::size_of::<E>() == 2
        && stride.is_multiple_of(2)
}

/// Packs `blk` of `a` for [`Micro::PAIRS`], in panels of `mr` rows: word
/// `(q2, r)` of panel `p` at `dst + p·mr·ks + q2·mr + r` (`ks =
/// ceil(kc/2)`) holds `k = 2·q2` low and `2·q2 + 1` high (0 past `kc`). A
/// row-major `A`'s pairs are adjacent words, moved by the 8×8/4×8
/// transposes; a column-major one interleaves two columns. Every path
/// moves the same bits.
///
/// # Safety
/// As [`pack_f32`], with `dst` holding `ceil(rows/mr)·mr·ks` words.
#[inline(always)]
unsafe fn pack_pairs<E: Lanes, K: Micro>(a: &MatRef<'_, E>, blk: Block, dst: *mut f32) {
    let (i0, rows, k0, kc, mr) = (blk.i0, blk.rows, blk.k0, blk.kc, blk.mr);
    let ks = kc.div_ceil(2);
    let panels = rows.div_ceil(mr);
    // SAFETY: inside `dst` by the caller's contract; f32 and u32 share
    // size and alignment.
    let d = unsafe { std::slice::from_raw_parts_mut(dst as *mut u32, panels * mr * ks) };
    d.fill(0);
    let word = |r: usize, q2: usize| {
        let q = k0 + 2 * q2;
        // SAFETY: row `i0+r` and columns `q`, `q+1` (when < k0+kc) lie
        // inside `a` by the caller's contract.
        unsafe {
            let lo = bf16_bits(a.at(i0 + r, q));
            let hi = if 2 * q2 + 1 < kc {
                bf16_bits(a.at(i0 + r, q + 1))
            } else {
                0
            };
            lo | hi << 16
        }
    };
    if a.rs == 1 && a.cs != 1 {
        for q2 in 0..ks {
            let q = k0 + 2 * q2;
            // SAFETY: columns `q`, `q+1` (when < k0+kc), rows
            // `i0..i0+rows` lie inside `a`.
            let (lo, hi) = unsafe {
                let lo = a.data.get_unchecked(q * a.cs + i0..q * a.cs + i0 + rows);
                let hi = (2 * q2 + 1 < kc).then(|| {
                    a.data
                        .get_unchecked((q + 1) * a.cs + i0..(q + 1) * a.cs + i0 + rows)
                });
                (lo, hi)
            };
            for p in 0..panels {
                let (r0, re) = (p * mr, mr.min(rows - p * mr));
                let o = p * mr * ks + q2 * mr;
                interleave(
                    &lo[r0..r0 + re],
                    hi.map(|h| &h[r0..r0 + re]),
                    &mut d[o..o + re],
                );
            }
        }
        return;
    }
    let w8 = if a.cs == 1 && word_runs::<E, K>(a.rs) {
        kc / 16 * 8
    } else {
        0
    };
    for p in 0..panels {
        let (r0, re) = (p * mr, mr.min(rows - p * mr));
        let dp = &mut d[p * mr * ks..(p + 1) * mr * ks];
        let mut r = 0;
        #[cfg(target_arch = "x86_64")]
        while w8 > 0 && re - r >= 4 {
            let w = if re - r >= 8 { 8 } else { 4 };
            // SAFETY: the tier has AVX2 (`K::SIMD`), `E` is 2 bytes and
            // the row stride even, so rows `i0+r0+r..+w`, columns
            // `k0..k0+2·w8` are `w8` words each, `a.rs/2` words apart,
            // inside `a`; the stores stay inside the panel. The moves
            // keep every bit.
            unsafe {
                let src = a.data.as_ptr().add((i0 + r0 + r) * a.rs + k0) as *const f32;
                let dp = dp.as_mut_ptr().add(r) as *mut f32;
                x86::transpose_panel(w, src, a.rs / 2, w8, dp, mr);
            }
            for rr in r..r + w {
                for q2 in w8..ks {
                    dp[q2 * mr + rr] = word(r0 + rr, q2);
                }
            }
            r += w;
        }
        for rr in r..re {
            for q2 in 0..ks {
                dp[q2 * mr + rr] = word(r0 + rr, q2);
            }
        }
    }
}

/// Task `t`: `C` tile `t / ntiles`, `t % ntiles`, every `k` block.
///
/// # Safety
/// The CPU has `K`'s features; `job` was checked (`check`) and its tiles
/// are disjoint across tasks.
#[inline(always)]
unsafe fn task<A: Lanes, B: Lanes, K: Micro>(job: &Job<'_, A, B>, t: usize) {
    let (m, n, k) = (job.a.rows, job.b.cols, job.a.cols);
    let (i0, j0) = ((t / job.ntiles) * job.mc, (t % job.ntiles) * job.nc);
    let (rows, cols) = (job.mc.min(m - i0), job.nc.min(n - j0));
    let (mp, np) = (rows.div_ceil(K::MR), cols.div_ceil(K::NR));
    // The buffers leave the thread-local for the call: a closure passed
    // to `with` would not inherit this function's target features.
    let (mut va, mut vb) = PACK.take();
    let pa = aligned(&mut va, mp * K::MR * K::KC);
    let pb = aligned(&mut vb, np * K::NR * K::KC);
    for k0 in (0..k).step_by(K::KC) {
        let kc = K::KC.min(k - k0);
        let ab = Block {
            i0,
            rows,
            k0,
            kc,
            mr: K::MR,
        };
        let bb = Block {
            i0: j0,
            rows: cols,
            mr: K::NR,
            ..ab
        };
        // SAFETY: the tile and the `k` block lie inside `a` and `b`
        // (checked shapes); the buffers hold whole panels of `KC`.
        unsafe {
            pack::<B, K>(&job.b.t(), bb, pb);
            pack::<A, K>(&job.a, ab, pa);
        }
        // Steps per panel: pairs of `k`, or `k`.
        let ks = if K::PAIRS { kc.div_ceil(2) } else { kc };
        let e = if k0 == 0 {
            Epi {
                alpha: job.alpha,
                beta: job.beta,
                load: job.beta != 0.0,
            }
        } else {
            Epi {
                alpha: job.alpha,
                beta: 1.0,
                load: true,
            }
        };
        for jp in 0..np {
            let ce = K::NR.min(cols - jp * K::NR);
            for ip in 0..mp {
                let re = K::MR.min(rows - ip * K::MR);
                // SAFETY: panels `ip`, `jp` were packed above with `kc`
                // steps; the tile's origin is inside `C`'s tile, which
                // this task alone writes; a partial tile goes through
                // scratch and only its `re×ce` part touches `C`.
                unsafe {
                    let ap = pa.add(ip * K::MR * ks);
                    let bp = pb.add(jp * K::NR * ks);
                    let cp = job.c.0.add((i0 + ip * K::MR) * job.ldc + j0 + jp * K::NR);
                    if re == K::MR && ce == K::NR {
                        K::tile(ks, ap, bp, cp, job.ldc, e);
                    } else {
                        let mut s = [0f32; MAX_TILE];
                        if e.load {
                            for r in 0..re {
                                for q in 0..ce {
                                    s[r * K::NR + q] = *cp.add(r * job.ldc + q);
                                }
                            }
                        }
                        K::tile(ks, ap, bp, s.as_mut_ptr(), K::NR, e);
                        for r in 0..re {
                            for q in 0..ce {
                                *cp.add(r * job.ldc + q) = s[r * K::NR + q];
                            }
                        }
                    }
                }
            }
        }
    }
    PACK.set((va, vb));
}

/// Tile sizes for `m × n` on `threads`: `(mc, nc, mtiles, ntiles)`, tiles
/// of at most `MC × NC`, split evenly, and split further (down to a few
/// register tiles) until there are as many as threads. No more: every
/// split packs the other operand again, which for a long `k` (dX = G·W)
/// costs more than the balance gains (2 threads, f32 256×512×32000: 70
/// GFLOP per CPU-second with two tiles per thread, 87 with one).
fn tiling<K: Micro>(m: usize, n: usize, threads: usize) -> (usize, usize, usize, usize) {
    let mut mt = m.div_ceil(K::MC);
    let mut nt = n.div_ceil(K::NC);
    let even = |len: usize, parts: usize, r: usize| len.div_ceil(parts).div_ceil(r) * r;
    loop {
        let (mc, nc) = (even(m, mt, K::MR), even(n, nt, K::NR));
        if mt * nt >= threads || (mc <= 4 * K::MR && nc <= 4 * K::NR) {
            return (mc, nc, m.div_ceil(mc), n.div_ceil(nc));
        }
        if mc * K::NR >= nc * K::MR && mc > 4 * K::MR || nc <= 4 * K::NR {
            mt += 1;
        } else {
            nt += 1;
        }
    }
}

/// `pool`: the tiles as its tasks; `None`: every tile on the calling
/// thread, in order (small products inside another kernel's task).
fn run_tier<A: Lanes, B: Lanes, K: Micro>(
    pool: Option<&ThreadPool>,
    job: &mut Job<'_, A, B>,
    m: usize,
    n: usize,
    entry: unsafe fn(&Job<'_, A, B>, usize),
) {
    let (mc, nc, mt, nt) = tiling::<K>(m, n, pool.map_or(1, |p| p.threads()));
    job.mc = mc;
    job.nc = nc;
    job.ntiles = nt;
    let job = &*job;
    // SAFETY: `entry` is the tier's task, whose features the caller
    // checked; tiles `t` are disjoint, so each task writes its own part of C.
    match pool {
        Some(pool) => pool.run(mt * nt, &|t| unsafe { entry(job, t) }),
        None => (0..mt * nt).for_each(|t| unsafe { entry(job, t) }),
    }
}

fn task_scalar<A: Lanes, B: Lanes>(job: &Job<'_, A, B>, t: usize) {
    // SAFETY: the scalar kernel needs no features; `job` was checked.
    unsafe { task::<A, B, ScalarK>(job, t) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn task_avx2<A: Lanes, B: Lanes>(job: &Job<'_, A, B>, t: usize) {
    // SAFETY: AVX2+FMA enabled here; `job` was checked.
    unsafe { task::<A, B, x86::Avx2K>(job, t) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl,avx2,fma")]
unsafe fn task_bf16<A: Lanes, B: Lanes>(job: &Job<'_, A, B>, t: usize) {
    // SAFETY: AVX-512 BF16 enabled here; `job` was checked and holds bf16.
    unsafe { task::<A, B, x86::Bf16K>(job, t) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn task_avx512<A: Lanes, B: Lanes>(job: &Job<'_, A, B>, t: usize) {
    // SAFETY: AVX-512F enabled here; `job` was checked.
    unsafe { task::<A, B, x86::Avx512K>(job, t) }
}

/// [`gemm`] on `pool` with `tier` (lowered to what the CPU has).
///
/// # Errors
/// As [`gemm`].
pub fn gemm_in<A: Elem, B: Elem>(
    pool: &ThreadPool,
    tier: SimdTier,
    g: GemmArgs<'_, A, B>,
) -> Result<(), KernelError> {
    gemm_on(Some(pool), tier, g)
}

/// [`gemm_in`] on the calling thread alone: for the tile products of a
/// kernel that is itself one task of a pool (FlashAttention). The same
/// blocking, so the same bits as on any pool.
///
/// # Errors
/// As [`gemm`].
pub fn gemm_serial<A: Elem, B: Elem>(
    tier: SimdTier,
    g: GemmArgs<'_, A, B>,
) -> Result<(), KernelError> {
    gemm_on(None, tier, g)
}

fn gemm_on<A: Elem, B: Elem>(
    pool: Option<&ThreadPool>,
    tier: SimdTier,
    g: GemmArgs<'_, A, B>,
) -> Result<(), KernelError> {
    let (m, n, k) = g.check()?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (ldc, beta) = (g.ldc, g.beta);
    if k == 0 {
        for i in 0..m {
            for v in &mut g.c[i * ldc..i * ldc + n] {
                *v = if beta == 0.0 { 0.0 } else { *v * beta };
            }
        }
        return Ok(());
    }
    let mut job = Job {
        a: g.a,
        b: g.b,
        c: CPtr(g.c.as_mut_ptr()),
        ldc,
        alpha: g.alpha,
        beta,
        mc: 0,
        nc: 0,
        ntiles: 0,
    };
    use std::any::TypeId;
    let bf16s = TypeId::of::<A>() == TypeId::of::<half::bf16>()
        && TypeId::of::<B>() == TypeId::of::<half::bf16>();
    match cpu::clamp(tier) {
        #[cfg(target_arch = "x86_64")]
        SimdTier::Avx512 if bf16s && cpu::has_avx512_bf16() => {
            run_tier::<A, B, x86::Bf16K>(pool, &mut job, m, n, task_bf16::<A, B>)
        }
        #[cfg(target_arch = "x86_64")]
        SimdTier::Avx512 => {
            run_tier::<A, B, x86::Avx512K>(pool, &mut job, m, n, task_avx512::<A, B>)
        }
        #[cfg(target_arch = "x86_64")]
        SimdTier::Avx2 => run_tier::<A, B, x86::Avx2K>(pool, &mut job, m, n, task_avx2::<A, B>),
        _ => run_tier::<A, B, ScalarK>(pool, &mut job, m, n, task_scalar::<A, B>),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rand_vec<E: Elem>(rng: &mut ChaCha8Rng, len: usize) -> Vec<E> {
        (0..len)
            .map(|_| E::from_f32(rng.random_range(-1.0f32..1.0)))
            .collect()
    }

    /// A `rows × cols` view into fresh random data laid out as `layout`:
    /// 0 row-major, 1 column-major (a transposed row-major matrix),
    /// 2 row-major with padded rows and every other column, 3 row-major
    /// and 4 column-major with an even padded stride.
    fn view<E: Elem>(
        rng: &mut ChaCha8Rng,
        rows: usize,
        cols: usize,
        layout: usize,
    ) -> (Vec<E>, [usize; 2]) {
        let (rs, cs, len) = match layout {
            0 => (cols, 1, rows * cols),
            1 => (1, rows, rows * cols),
            // Even strides (bf16 pairs read as words) with any extent.
            3 => ((cols + 2) & !1, 1, rows * ((cols + 2) & !1)),
            4 => (1, (rows + 2) & !1, cols * ((rows + 2) & !1)),
            _ => (2 * cols + 3, 2, rows * (2 * cols + 3)),
        };
        (rand_vec(rng, len.max(1)), [rs, cs])
    }

    /// Rounding-error bound of an f32 FMA chain (Higham, γ_{k+2}):
    /// `|err| ≤ (k+2)·u·(|α|·Σ|a||b| + |β·c|)`, u = 2⁻²⁴, plus the
    /// final rounding; an indexing mistake gives errors of order 1.
    /// `want` holds the reference's `C`; `c0` is `C` before the product.
    fn check_close<A: Elem, B: Elem>(
        want: &GemmArgs<'_, A, B>,
        got: &[f32],
        c0: &[f32],
        what: &str,
    ) {
        let GemmArgs {
            a,
            b,
            ldc,
            alpha,
            beta,
            ..
        } = *want;
        let (m, n, k) = (a.rows, b.cols, a.cols);
        let u = f32::EPSILON as f64 / 2.0;
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    // SAFETY: inside both views.
                    .map(|q| unsafe { (a.at(i, q).to_f32() * b.at(q, j).to_f32()).abs() as f64 })
                    .sum();
                let cb = if beta == 0.0 {
                    0.0
                } else {
                    (beta * c0[i * ldc + j]).abs() as f64
                };
                let tol = (k as f64 + 3.0) * u * (alpha.abs() as f64 * s + cb) + 1e-30;
                let (g, w) = (got[i * ldc + j], want.c[i * ldc + j]);
                assert!(
                    (g as f64 - w as f64).abs() <= tol,
                    "{what}: ({i},{j}) got {g} want {w} tol {tol}"
                );
            }
        }
    }

    fn check_case<A: Elem, B: Elem>(rng: &mut ChaCha8Rng, m: usize, n: usize, k: usize) {
        for (la, lb) in [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
            (2, 1),
            (1, 2),
            (2, 2),
            (3, 4),
            (4, 3),
            (3, 3),
        ] {
            let (ad, [ars, acs]) = view::<A>(rng, m, k, la);
            let (bd, [brs, bcs]) = view::<B>(rng, k, n, lb);
            let am = MatRef::new(&ad, m, k, ars, acs).unwrap();
            let bm = MatRef::new(&bd, k, n, brs, bcs).unwrap();
            let ldc = n + 5;
            let c0: Vec<f32> = (0..m * ldc).map(|_| rng.random_range(-1.0..1.0)).collect();
            for (alpha, beta) in [(1.0, 0.0), (0.5, -1.5), (-2.0, 1.0)] {
                let mut want = c0.clone();
                gemm_ref(
                    GemmArgs::new(am, bm, &mut want, ldc)
                        .alpha(alpha)
                        .beta(beta),
                )
                .unwrap();
                let want = GemmArgs::new(am, bm, &mut want, ldc)
                    .alpha(alpha)
                    .beta(beta);
                for tier in cpu::available_tiers() {
                    let mut got = c0.clone();
                    if beta == 0.0 {
                        for i in 0..m {
                            got[i * ldc..i * ldc + n].fill(f32::NAN);
                        }
                    }
                    let pool = ThreadPool::new(2).unwrap();
                    gemm_in(
                        &pool,
                        tier,
                        GemmArgs {
                            c: &mut got,
                            ..want
                        },
                    )
                    .unwrap();
                    let what = format!(
                        "{tier} {}x{}x{} layouts {la}/{lb} a={alpha} b={beta} {}/{}",
                        m,
                        n,
                        k,
                        std::any::type_name::<A>(),
                        std::any::type_name::<B>()
                    );
                    check_close(&want, &got, &c0, &what);
                    // The padding between rows is never written.
                    for i in 0..m {
                        assert_eq!(
                            &got[i * ldc + n..(i + 1) * ldc],
                            &c0[i * ldc + n..(i + 1) * ldc]
                        );
                    }
                }
            }
        }
    }

    const SHAPES: [(usize, usize, usize); 12] = [
        (37, 45, 64),
        (29, 70, 300),
        (1, 1, 1),
        (3, 17, 31),
        (17, 3, 65),
        (31, 65, 17),
        (65, 31, 123),
        (123, 257, 3),
        (257, 123, 65),
        (1, 257, 257),
        (257, 1, 123),
        (150, 300, 517),
    ];

    #[test]
    fn f32_matches_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for &(m, n, k) in &SHAPES {
            check_case::<f32, f32>(&mut rng, m, n, k);
        }
    }

    #[test]
    fn bf16_and_mixed_match_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for &(m, n, k) in &SHAPES {
            check_case::<bf16, bf16>(&mut rng, m, n, k);
            check_case::<f32, bf16>(&mut rng, m, n, k);
            check_case::<bf16, f32>(&mut rng, m, n, k);
        }
    }

    #[test]
    fn thread_count_does_not_change_the_result() {
        // `None`: every tile on the calling thread (`gemm_serial`).
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (m, n, k) = (301, 700, 600);
        let a = rand_vec::<f32>(&mut rng, m * k);
        let b = rand_vec::<bf16>(&mut rng, n * k);
        let c0: Vec<f32> = rand_vec(&mut rng, m * n);
        for tier in cpu::available_tiers() {
            let run = |pool: Option<&ThreadPool>| {
                let am = MatRef::row_major(&a, m, k).unwrap();
                let bm = MatRef::row_major(&b, n, k).unwrap();
                let mut c = c0.clone();
                gemm_on(pool, tier, GemmArgs::new(am, bm.t(), &mut c, n).beta(0.5)).unwrap();
                let mut d = vec![0f32; k * k];
                gemm_on(pool, tier, GemmArgs::new(am.t(), am, &mut d, k)).unwrap();
                (c, d)
            };
            let one = run(Some(&ThreadPool::new(1).unwrap()));
            let three = run(Some(&ThreadPool::new(3).unwrap()));
            assert!(one == three && one == run(None), "{tier}");
        }
        let bb = rand_vec::<bf16>(&mut rng, 333 * 601);
        for tier in cpu::available_tiers() {
            let run = |pool: Option<&ThreadPool>| {
                let am = MatRef::row_major(&bb, 333, 601).unwrap();
                let mut c = vec![f32::NAN; 333 * 333];
                gemm_on(pool, tier, GemmArgs::new(am, am.t(), &mut c, 333)).unwrap();
                c
            };
            let one = run(Some(&ThreadPool::new(1).unwrap()));
            let three = run(Some(&ThreadPool::new(3).unwrap()));
            assert!(one == three && one == run(None), "bf16 {tier}");
        }
    }

    #[test]
    fn k_zero_scales_c() {
        let (a, b) = ([0f32; 0], [0f32; 0]);
        let am = MatRef::row_major(&a, 2, 0).unwrap();
        let bm = MatRef::row_major(&b, 0, 3).unwrap();
        let mut c = [1f32; 6];
        gemm(GemmArgs::new(am, bm, &mut c, 3).beta(2.0)).unwrap();
        assert_eq!(c, [2.0; 6]);
        c.fill(f32::NAN);
        gemm(GemmArgs::new(am, bm, &mut c, 3)).unwrap();
        assert_eq!(c, [0.0; 6]);
    }

    #[test]
    fn bad_arguments_are_errors() {
        let d = [0f32; 12];
        assert!(MatRef::row_major(&d, 3, 5).is_err());
        assert!(MatRef::new(&d, 2, 2, 7, 5).is_err());
        assert!(MatRef::new(&d, 2, 2, usize::MAX, 1).is_err());
        assert!(MatRef::new(&d, 3, 3, usize::MAX / 2, usize::MAX / 2).is_err());
        assert!(MatRef::new(&d, 0, 5, 100, 100).is_ok());
        let a = MatRef::row_major(&d, 3, 4).unwrap();
        let b = MatRef::row_major(&d, 4, 3).unwrap();
        let mut c = [0f32; 9];
        assert!(gemm(GemmArgs::new(a, b, &mut c, 3)).is_ok());
        assert!(gemm(GemmArgs::new(a, a, &mut c, 3)).is_err(), "inner dims");
        assert!(
            gemm(GemmArgs::new(a, b, &mut c[..8], 3)).is_err(),
            "C short"
        );
        assert!(gemm(GemmArgs::new(a, b, &mut c, 2)).is_err(), "ldc < n");
        assert!(
            gemm(GemmArgs::new(a, b, &mut c, usize::MAX)).is_err(),
            "overflow"
        );
        assert!(gemm_ref(GemmArgs::new(a, a, &mut c, 3)).is_err());
    }
}
