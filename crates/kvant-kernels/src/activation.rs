//! Gated activations of the feed-forward block.
//!
//! `Activation::apply` is the scalar reference (libm `exp`/`tanh`); `gated`
//! evaluates the same functions through the vectorizable exponential of
//! `vecops` (tanh as `1 - 2/(e^{2u} + 1)`), compiled for AVX2 where the CPU
//! has it: libm's per-value calls were 15% of Gemma 3's prefill.

use crate::cpu::{self, SimdTier};
use crate::pool;
use crate::vecops::{exp, Fma, Plain};

/// Which nonlinearity gates the up projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (swish): Llama, Mistral, Qwen.
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`): Gemma.
    GeluTanh,
    /// SiLU with the gate clamped to at most the limit and the up
    /// projection to ±limit before the product (DeepSeek-V4's
    /// `swiglu_limit`, transformers' `gate.clamp(max=l)`,
    /// `up.clamp(-l, l)`).
    SiluClamped(Limit),
}

/// A clamp limit, compared by its bits so that [`Activation`] stays `Eq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit(u32);

impl Limit {
    pub fn new(limit: f32) -> Self {
        Limit(limit.to_bits())
    }

    pub fn get(self) -> f32 {
        f32::from_bits(self.0)
    }
}

impl Activation {
    /// The nonlinearity on a gate value (clamped first where the variant
    /// clamps); see [`Activation::up`] for what multiplies it.
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::SiluClamped(l) => {
                let x = x.min(l.get());
                x / (1.0 + (-x).exp())
            }
            Activation::GeluTanh => {
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
            }
        }
    }

    /// The up projection's value as the product sees it (clamped to
    /// ±limit by [`Activation::SiluClamped`], as is otherwise).
    pub fn up(self, u: f32) -> f32 {
        match self {
            Activation::SiluClamped(l) => u.clamp(-l.get(), l.get()),
            _ => u,
        }
    }

    /// The gated unit's scalar reference: `apply(g) · up(u)`.
    pub fn glu(self, g: f32, u: f32) -> f32 {
        self.apply(g) * self.up(u)
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

#[inline(always)]
fn gated_body<F: Fma>(act: Activation, gate: &mut [f32], up: &[f32]) {
    match act {
        Activation::Silu => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = *g / (1.0 + exp::<F>(-*g)) * u;
            }
        }
        Activation::SiluClamped(l) => {
            let l = l.get();
            for (g, &u) in gate.iter_mut().zip(up) {
                let x = g.min(l);
                *g = x / (1.0 + exp::<F>(-x)) * u.clamp(-l, l);
            }
        }
        Activation::GeluTanh => {
            for (g, &u) in gate.iter_mut().zip(up) {
                let x = *g;
                let t = SQRT_2_OVER_PI * F::fma(0.044_715 * x, x * x, x);
                let tanh = 1.0 - 2.0 / (exp::<F>(2.0 * t) + 1.0);
                *g = 0.5 * x * (1.0 + tanh) * u;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn gated_avx2(act: Activation, gate: &mut [f32], up: &[f32]) {
    gated_body::<crate::vecops::Fused>(act, gate, up)
}

/// `gate[i] = act(gate[i]) * up[i]`: the gated linear unit, in place, on
/// the start-up tier.
pub fn gated(act: Activation, gate: &mut [f32], up: &[f32]) {
    gated_with(cpu::tier(), act, gate, up)
}

/// [`gated`] on a given tier (lowered to one the CPU supports). Long
/// inputs (a prefill chunk's rows) are split over the pool in pieces of
/// 64 values; each value is computed on its own, so the split
/// changes no bits.
pub fn gated_with(tier: SimdTier, act: Activation, gate: &mut [f32], up: &[f32]) {
    debug_assert_eq!(gate.len(), up.len());
    let tier = cpu::clamp(tier);
    let len = gate.len().min(up.len());
    let (whole, tail) = gate[..len].split_at_mut(len / PIECE * PIECE);
    pool::for_rows_mut(whole, PIECE, &|r, g| {
        gated_on(tier, act, g, &up[r.start * PIECE..r.end * PIECE])
    });
    gated_on(tier, act, tail, &up[len / PIECE * PIECE..len]);
}

/// The unit [`gated_with`] splits its input into.
const PIECE: usize = 64;

fn gated_on(tier: SimdTier, act: Activation, gate: &mut [f32], up: &[f32]) {
    match tier {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the clamped tier is one the CPU supports, with AVX2 and FMA.
        SimdTier::Avx2 | SimdTier::Avx512 => unsafe { gated_avx2(act, gate, up) },
        _ => gated_body::<Plain>(act, gate, up),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The polynomial exponential (~2e-7 relative) and the tanh identity
    /// (cancellation near 0, absolute ~1e-7) keep every value within this
    /// of the libm reference, relative to max(1, |value|).
    const TOL: f32 = 2e-6;

    #[test]
    fn every_tier_matches_the_libm_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        // Long enough to be split over the pool (`pool::ROWS_MIN_PARALLEL`).
        let mut x: Vec<f32> = (0..20_001).map(|_| rng.random_range(-30.0..30.0)).collect();
        x.extend([0.0, -0.0, 1e-6, -1e-6, 100.0, -100.0, 5.0, -5.0]);
        let up: Vec<f32> = (0..x.len()).map(|_| rng.random_range(-2.0..2.0)).collect();
        let clamped = Activation::SiluClamped(Limit::new(7.0));
        for act in [Activation::Silu, Activation::GeluTanh, clamped] {
            for tier in cpu::available_tiers() {
                let mut g = x.clone();
                gated_with(tier, act, &mut g, &up);
                // The split over the pool changes no bits.
                let mut whole = x.clone();
                gated_on(cpu::clamp(tier), act, &mut whole, &up);
                assert_eq!(g, whole, "{act:?} {tier}");
                for ((&xi, &u), &got) in x.iter().zip(&up).zip(&g) {
                    let want = act.glu(xi, u);
                    assert!(
                        (got - want).abs() <= TOL * want.abs().max(1.0),
                        "{act:?} {tier} x={xi}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn known_values() {
        // silu(1) = 1/(1+e^-1); gelu_tanh(1) from PyTorch: 0.8411920071.
        assert!((Activation::Silu.apply(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-6);
        assert!((Activation::Silu.apply(-100.0)).abs() < 1e-30);
        assert_eq!(Activation::GeluTanh.apply(0.0), 0.0);
        let mut g = vec![1.0, -2.0, 0.5];
        gated(Activation::Silu, &mut g, &[2.0, 1.0, 0.0]);
        assert!((g[0] - 2.0 * 0.731_058_6).abs() < 1e-6);
        assert_eq!(g[2], 0.0);
    }
}
