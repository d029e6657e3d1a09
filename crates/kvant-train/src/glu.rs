//! Gated linear units of the feed-forward block, forward and backward:
//! `c = act(a)·b` elementwise.
//!
//! - SwiGLU: `act(a) = silu(a) = a·σ(a)`, `act'(a) = σ(a)·(1 + a·(1 − σ(a)))`;
//! - GeGLU (tanh): `act(a) = ½a(1 + tanh u)`, `u = √(2/π)(a + 0.044715a³)`,
//!   `act'(a) = ½(1 + tanh u) + ½a(1 − tanh²u)·√(2/π)(1 + 3·0.044715a²)`.
//!
//! Backward: `da = dc·b·act'(a)`, `db = dc·act(a)`, with the activation
//! recomputed from `a`, so the forward saves nothing but `a` and `b`, and
//! the gradients are written over them (Liger's in-place trick: no
//! buffer the size of the activations is allocated).
//!
//! The fast paths use the polynomial exponential of `vecops` (~2e-7
//! relative) and write GELU through `1 ± tanh u` from `e^{−2|u|}`, so
//! that neither `1 + tanh` nor `1 − tanh²` cancels where tanh saturates.
//! Each value is computed in f32 and rounded once (torch's bf16 SwiGLU
//! also rounds `silu(a)` to bf16 before the product; this does not).
//!
//! Measured on 4096×11008 (2 threads, shared Zen 4 VM, read probe 21–29
//! GB/s): f32 31–52 GB/s; bf16 SwiGLU 20–21 GB/s, GeGLU 10–16 GB/s,
//! bound by the exponential (~1.7 G values/s per thread).

use crate::Elem;
use kvant_kernels::cpu::SimdTier;
use kvant_kernels::error::check_len;
use kvant_kernels::pool::{self, DisjointSlice};
use kvant_kernels::vecops::{exp, Fma, Plain};
use kvant_kernels::KernelError;

/// Which activation gates `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// silu(a)·b
    Swi,
    /// gelu_tanh(a)·b
    GeTanh,
}

const K: f32 = 0.797_884_6; // √(2/π)
const C: f32 = 0.044_715;

/// Elements per task: 32 Ki (64–128 KiB of each operand), so a hand-out
/// (~1 µs) is under 2% of a task and 4096×11008 makes ~1400 tasks.
const CHUNK: usize = 32 * 1024;

/// For GELU: `(1 + tanh u, 1 − tanh u)` from `e = exp(−2|u|) ≤ 1`, each
/// without cancellation (`2/(1+e)` and `2e/(1+e)`, by the sign of `u`):
/// `1 + t` computed as `2 − q` lost every gradient below ~1e-7 of the
/// largest for a < −4.5.
#[inline(always)]
fn one_pm_tanh<F: Fma>(u: f32) -> (f32, f32) {
    let e = exp::<F>(-2.0 * u.abs());
    let d = 2.0 / (1.0 + e);
    let (big, small) = (d, e * d);
    if u >= 0.0 {
        (big, small)
    } else {
        (small, big)
    }
}

/// (act(a), act'(a)) in f32.
#[inline(always)]
fn act_grad<F: Fma>(kind: Glu, a: f32) -> (f32, f32) {
    match kind {
        Glu::Swi => {
            let s = 1.0 / (1.0 + exp::<F>(-a));
            let f = a * s;
            (f, F::fma(f, 1.0 - s, s))
        }
        Glu::GeTanh => {
            let u = K * F::fma(C * a, a * a, a);
            let (p, m) = one_pm_tanh::<F>(u);
            let half_a = 0.5 * a;
            let du = K * F::fma(3.0 * C * a, a, 1.0);
            // act = ½a(1 + t); act' = ½(1 + t) + ½a(1 − t²)·du.
            (half_a * p, F::fma(half_a * p * m, du, 0.5 * p))
        }
    }
}

#[inline(always)]
fn act<F: Fma>(kind: Glu, a: f32) -> f32 {
    match kind {
        Glu::Swi => a / (1.0 + exp::<F>(-a)),
        Glu::GeTanh => 0.5 * a * one_pm_tanh::<F>(K * F::fma(C * a, a * a, a)).0,
    }
}

#[inline(always)]
fn fwd_body<E: Elem, F: Fma>(kind: Glu, a: &[E], b: &[E], c: &mut [E]) {
    // One loop per kind, so each vectorizes without a branch inside.
    match kind {
        Glu::Swi => {
            for ((o, x), y) in c.iter_mut().zip(a).zip(b) {
                *o = E::from_f32(act::<F>(Glu::Swi, x.to_f32()) * y.to_f32());
            }
        }
        Glu::GeTanh => {
            for ((o, x), y) in c.iter_mut().zip(a).zip(b) {
                *o = E::from_f32(act::<F>(Glu::GeTanh, x.to_f32()) * y.to_f32());
            }
        }
    }
}

#[inline(always)]
fn bwd_body<E: Elem, F: Fma>(kind: Glu, dc: &[E], a: &mut [E], b: &mut [E]) {
    let step = |d: &E, x: &mut E, y: &mut E, kind: Glu| {
        let (d, xa, yb) = (d.to_f32(), x.to_f32(), y.to_f32());
        let (f, g) = act_grad::<F>(kind, xa);
        *x = E::from_f32(d * yb * g);
        *y = E::from_f32(d * f);
    };
    match kind {
        Glu::Swi => {
            for ((d, x), y) in dc.iter().zip(a.iter_mut()).zip(b.iter_mut()) {
                step(d, x, y, Glu::Swi);
            }
        }
        Glu::GeTanh => {
            for ((d, x), y) in dc.iter().zip(a.iter_mut()).zip(b.iter_mut()) {
                step(d, x, y, Glu::GeTanh);
            }
        }
    }
}

kvant_kernels::per_tier! {
    /// [`fwd_body`] on `tier` (8 or 16 lanes).
    fn fwd_on<E: Elem>(tier: SimdTier, kind: Glu, a: &[E], b: &[E], c: &mut [E])
        [F = Plain, kvant_kernels::vecops::Fused]
    {
        fwd_body::<E, F>(kind, a, b, c)
    }

    /// [`bwd_body`] on `tier`.
    fn bwd_on<E: Elem>(tier: SimdTier, kind: Glu, dc: &[E], a: &mut [E], b: &mut [E])
        [F = Plain, kvant_kernels::vecops::Fused]
    {
        bwd_body::<E, F>(kind, dc, a, b)
    }
}

/// The tensors of a GLU forward, all of one length.
pub struct GluFwd<'a, E> {
    pub a: &'a [E],
    pub b: &'a [E],
    /// `act(a)·b`.
    pub c: &'a mut [E],
}

impl<'a, E> GluFwd<'a, E> {
    /// `c = act(a)·b`.
    pub fn new(a: &'a [E], b: &'a [E], c: &'a mut [E]) -> Self {
        GluFwd { a, b, c }
    }
}

impl<E> GluFwd<'_, E> {
    /// The checks shared by [`glu_fwd`] and its reference.
    fn check(&self) -> Result<(), KernelError> {
        check_len("glu b", self.a.len(), self.b.len())?;
        check_len("glu c", self.a.len(), self.c.len())
    }
}

/// The tensors of a GLU backward, all of one length: on return `a` holds
/// da and `b` holds db (Liger's in-place trick: nothing saved but a, b).
pub struct GluBwd<'a, E> {
    pub dc: &'a [E],
    pub a: &'a mut [E],
    pub b: &'a mut [E],
}

impl<'a, E> GluBwd<'a, E> {
    /// `a` and `b` overwritten with their gradients.
    pub fn new(dc: &'a [E], a: &'a mut [E], b: &'a mut [E]) -> Self {
        GluBwd { dc, a, b }
    }
}

impl<E> GluBwd<'_, E> {
    /// The checks shared by [`glu_bwd`] and its reference.
    fn check(&self) -> Result<(), KernelError> {
        check_len("glu a", self.dc.len(), self.a.len())?;
        check_len("glu b", self.dc.len(), self.b.len())
    }
}

/// `c = act(a)·b` elementwise, on `tier` (lowered to one the CPU
/// supports; [`kvant_kernels::cpu::tier`] is the process's own).
pub fn glu_fwd<E: Elem>(tier: SimdTier, kind: Glu, t: GluFwd<'_, E>) -> Result<(), KernelError> {
    t.check()?;
    let n = t.a.len();
    let cs = DisjointSlice::new(t.c);
    pool::global().run(n.div_ceil(CHUNK), &|i| {
        let r = i * CHUNK..((i + 1) * CHUNK).min(n);
        // SAFETY: task `i` owns elements `r`.
        let c = unsafe { cs.range(r.clone()) };
        let (a, b) = (&t.a[r.clone()], &t.b[r]);
        fwd_on(tier, kind, a, b, c);
    });
    Ok(())
}

/// The backward recomputing the activation (see [`GluBwd`]), on `tier`.
pub fn glu_bwd<E: Elem>(tier: SimdTier, kind: Glu, t: GluBwd<'_, E>) -> Result<(), KernelError> {
    t.check()?;
    let n = t.dc.len();
    let (as_, bs) = (DisjointSlice::new(t.a), DisjointSlice::new(t.b));
    pool::global().run(n.div_ceil(CHUNK), &|i| {
        let r = i * CHUNK..((i + 1) * CHUNK).min(n);
        // SAFETY: task `i` owns elements `r` of both.
        let (a, b) = unsafe { (as_.range(r.clone()), bs.range(r.clone())) };
        let dc = &t.dc[r];
        bwd_on(tier, kind, dc, a, b);
    });
    Ok(())
}

/// (act(a), act'(a)) in f64 with libm's exp and tanh.
pub(crate) fn act_grad_f64(kind: Glu, a: f64) -> (f64, f64) {
    match kind {
        Glu::Swi => {
            let s = 1.0 / (1.0 + (-a).exp());
            (a * s, s * (1.0 + a * (1.0 - s)))
        }
        Glu::GeTanh => {
            let (k, c) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044_715);
            let t = (k * (a + c * a * a * a)).tanh();
            let du = k * (1.0 + 3.0 * c * a * a);
            (
                0.5 * a * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * du,
            )
        }
    }
}

/// f64 reference of [`glu_fwd`].
pub fn glu_fwd_ref<E: Elem>(kind: Glu, t: GluFwd<'_, E>) -> Result<(), KernelError> {
    t.check()?;
    for ((o, x), y) in t.c.iter_mut().zip(t.a).zip(t.b) {
        let f = act_grad_f64(kind, x.to_f32() as f64).0;
        *o = E::from_f32((f * y.to_f32() as f64) as f32);
    }
    Ok(())
}

/// f64 reference of [`glu_bwd`].
pub fn glu_bwd_ref<E: Elem>(kind: Glu, t: GluBwd<'_, E>) -> Result<(), KernelError> {
    t.check()?;
    for ((d, x), y) in t.dc.iter().zip(t.a.iter_mut()).zip(t.b.iter_mut()) {
        let (d, xa, yb) = (d.to_f32() as f64, x.to_f32() as f64, y.to_f32() as f64);
        let (f, g) = act_grad_f64(kind, xa);
        *x = E::from_f32((d * yb * g) as f32);
        *y = E::from_f32((d * f) as f32);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::norm::tests::{assert_close, f32s, nans, rand_vec};
    use half::bf16;
    use kvant_kernels::cpu;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// f32: the polynomial exponential (~2e-7 relative) and a few f32
    /// operations after it, relative to each value, plus 1e-6 of the
    /// largest for values that pass through 0 (gelu' near a = −0.75).
    /// bf16: one rounding flip (2^-8) where f32 and f64 straddle a
    /// rounding boundary, with the f32 part's slack.
    fn tol<E: Elem>() -> (f32, f32) {
        if E::F32 {
            (1e-5, 1e-6)
        } else {
            (1.0 / 128.0, 1e-6)
        }
    }

    fn inputs<E: Elem>(rng: &mut ChaCha8Rng, n: usize) -> Vec<E> {
        let mut a: Vec<E> = rand_vec(rng, n, -8.0, 8.0);
        let special = [
            0.0, -0.0, 1e-4, -1e-4, 20.0, -20.0, 90.0, -90.0, 200.0, -200.0, 0.75, -0.75,
        ];
        for (v, s) in a.iter_mut().zip(special) {
            *v = E::from_f32(s);
        }
        a
    }

    fn case<E: Elem>(rng: &mut ChaCha8Rng, n: usize) {
        let a: Vec<E> = inputs(rng, n);
        let b: Vec<E> = rand_vec(rng, n, -2.0, 2.0);
        let dc: Vec<E> = rand_vec(rng, n, -2.0, 2.0);
        for kind in [Glu::Swi, Glu::GeTanh] {
            let mut c0 = nans::<E>(n);
            glu_fwd_ref(kind, GluFwd::new(&a, &b, &mut c0)).unwrap();
            let (mut da0, mut db0) = (a.clone(), b.clone());
            glu_bwd_ref(kind, GluBwd::new(&dc, &mut da0, &mut db0)).unwrap();
            for tier in cpu::available_tiers() {
                let what = format!("{kind:?} n={n} {tier} {}", std::any::type_name::<E>());
                let mut c = nans::<E>(n);
                glu_fwd(tier, kind, GluFwd::new(&a, &b, &mut c)).unwrap();
                assert_close(&format!("c {what}"), &f32s(&c), &f32s(&c0), tol::<E>());
                let (mut da, mut db) = (a.clone(), b.clone());
                glu_bwd(tier, kind, GluBwd::new(&dc, &mut da, &mut db)).unwrap();
                assert_close(&format!("da {what}"), &f32s(&da), &f32s(&da0), tol::<E>());
                assert_close(&format!("db {what}"), &f32s(&db), &f32s(&db0), tol::<E>());
            }
        }
    }

    #[test]
    fn every_tier_matches_the_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(31);
        for n in [1usize, 7, 31, 123, 1000, 70_001] {
            case::<f32>(&mut rng, n);
            case::<bf16>(&mut rng, n);
        }
    }

    /// silu(1) = 0.7310585786, gelu_tanh(1) = 0.8411919906 (PyTorch's f32
    /// prints 0.8411920); their derivatives at 1: 0.9276705119, 1.0829640838.
    #[test]
    fn known_values() {
        let (f, g) = act_grad_f64(Glu::Swi, 1.0);
        assert!((f - 0.731_058_578_6).abs() < 1e-9 && (g - 0.927_670_511_8).abs() < 1e-9);
        let (f, g) = act_grad_f64(Glu::GeTanh, 1.0);
        assert!((f - 0.841_191_990_6).abs() < 1e-9, "{f}");
        assert!((g - 1.082_964_083_8).abs() < 1e-9, "{g}");
    }

    /// Central differences (f64, step 1e-6) of the reference activation
    /// against its derivative; the backward is `dc·b·act'` and `dc·act`.
    #[test]
    fn reference_gradient_matches_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(32);
        let h = 1e-6;
        for kind in [Glu::Swi, Glu::GeTanh] {
            for _ in 0..200 {
                let a: f64 = rng.random_range(-6.0..6.0);
                let fd = (act_grad_f64(kind, a + h).0 - act_grad_f64(kind, a - h).0) / (2.0 * h);
                let g = act_grad_f64(kind, a).1;
                assert!(
                    (fd - g).abs() < 1e-7 * (1.0 + g.abs()),
                    "{kind:?} a={a}: {fd} vs {g}"
                );
            }
            // The public reference: L = Σ dc·act(a)·b in f32 storage;
            // db = dc·act(a) is exact in b (linear), da checked with a
            // step large enough for f32 (1e-2: error ~|act''|·1e-4).
            let (a, b, dc) = (vec![0.37f32, -1.3], vec![0.8f32, -0.6], vec![1.1f32, 0.7]);
            let (mut da, mut db) = (a.clone(), b.clone());
            glu_bwd_ref(kind, GluBwd::new(&dc, &mut da, &mut db)).unwrap();
            let loss = |a: &[f32], b: &[f32]| -> f64 {
                let mut c = vec![0f32; 2];
                glu_fwd_ref(kind, GluFwd::new(a, b, &mut c)).unwrap();
                c.iter().zip(&dc).map(|(c, d)| *c as f64 * *d as f64).sum()
            };
            // The central difference of `loss` in `v[k]`.
            let hs = 1e-2f32;
            let diff = |v: &[f32], k: usize, loss: &dyn Fn(&[f32]) -> f64| {
                let (mut p, mut m) = (v.to_vec(), v.to_vec());
                p[k] += hs;
                m[k] -= hs;
                (loss(&p) - loss(&m)) / (2.0 * hs as f64)
            };
            for k in 0..2 {
                let fd = diff(&a, k, &|a| loss(a, &b));
                assert!(
                    (fd - da[k] as f64).abs() < 1e-3,
                    "{kind:?} da[{k}]: {fd} vs {}",
                    da[k]
                );
                let fd = diff(&b, k, &|b| loss(&a, b));
                assert!(
                    (fd - db[k] as f64).abs() < 1e-5,
                    "{kind:?} db[{k}]: {fd} vs {}",
                    db[k]
                );
            }
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        let tier = cpu::tier();
        let (a, b) = (vec![0f32; 5], vec![0f32; 4]);
        let mut c = vec![0f32; 5];
        assert!(glu_fwd(tier, Glu::Swi, GluFwd::new(&a, &b, &mut c)).is_err());
        assert!(glu_fwd(tier, Glu::Swi, GluFwd::new(&a, &a, &mut c[..4])).is_err());
        assert!(glu_fwd_ref(Glu::Swi, GluFwd::new(&a, &b, &mut c)).is_err());
        let (mut x, mut y) = (vec![0f32; 5], vec![0f32; 4]);
        assert!(glu_bwd(tier, Glu::GeTanh, GluBwd::new(&a, &mut x, &mut y)).is_err());
        assert!(glu_bwd(tier, Glu::GeTanh, GluBwd::new(&b, &mut x, &mut y)).is_err());
        assert!(glu_bwd_ref(Glu::GeTanh, GluBwd::new(&a, &mut x, &mut y)).is_err());
        assert!(glu_fwd::<f32>(tier, Glu::Swi, GluFwd::new(&[], &[], &mut [])).is_ok());
    }
}
