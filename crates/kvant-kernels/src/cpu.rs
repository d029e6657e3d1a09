//! CPU feature detection and the SIMD tier chosen once at start-up.
//!
//! One binary serves every x86-64 CPU: kernels are compiled for each tier
//! with `#[target_feature]` and the tier is picked at run time, the way
//! ggml's `cpu-feats.cpp` scores backend variants. `KVANT_SIMD` lets a user
//! (or a benchmark) force a lower tier; it can never raise the tier above
//! what the CPU supports, so forcing is always safe.
//!
//! The `Avx512` tier runs the int8 products on AVX-512 VNNI where the CPU
//! has it (`vpdpbusd` on 256-bit registers with VL's 32 of them,
//! `int8::avx2::group_tile_vnni`), one- and two-token f16/bf16 products on
//! 512-bit registers, bf16 weights with `vdpbf16ps` where the CPU has
//! AVX-512 BF16 (`halfpack`), the training kernels on 512-bit registers,
//! and the AVX2 kernels everywhere else (attention, norms, activations: not
//! written for 512-bit registers yet; Zen 4 runs 512-bit operations as two
//! 256-bit halves, so there they would save instructions, not throughput).
//! AMX is never used: VMs here list it and fault on its tile instructions.

use std::sync::OnceLock;

/// Instruction-set tiers, ordered from least to most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdTier {
    /// Portable Rust; the compiler may still auto-vectorise with the baseline ISA.
    Scalar,
    /// AVX2 + FMA + F16C (Haswell and later, Zen and later).
    Avx2,
    /// AVX-512 F/BW/VL on top of the AVX2 tier.
    Avx512,
}

impl SimdTier {
    pub fn name(self) -> &'static str {
        match self {
            SimdTier::Scalar => "scalar",
            SimdTier::Avx2 => "avx2",
            SimdTier::Avx512 => "avx512",
        }
    }

    /// Parses a `KVANT_SIMD` value; `None` for anything unrecognised.
    pub fn parse(value: &str) -> Option<SimdTier> {
        match value.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(SimdTier::Scalar),
            "avx2" => Some(SimdTier::Avx2),
            "avx512" => Some(SimdTier::Avx512),
            _ => None,
        }
    }
}

impl std::fmt::Display for SimdTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the CPU supports, detected once.
#[derive(Clone, Copy, Debug)]
struct Detected {
    tier: SimdTier,
    avx512_vnni: bool,
    avx512_bf16: bool,
}

fn detected() -> Detected {
    static DETECTED: OnceLock<Detected> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Detected {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl");
    let tier = if avx512 {
        SimdTier::Avx512
    } else if avx2 {
        SimdTier::Avx2
    } else {
        SimdTier::Scalar
    };
    Detected {
        tier,
        avx512_vnni: avx512 && is_x86_feature_detected!("avx512vnni"),
        avx512_bf16: avx512 && is_x86_feature_detected!("avx512bf16"),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Detected {
    Detected {
        tier: SimdTier::Scalar,
        avx512_vnni: false,
        avx512_bf16: false,
    }
}

/// The best tier this CPU supports, ignoring `KVANT_SIMD`.
pub fn detected_tier() -> SimdTier {
    detected().tier
}

/// Whether AVX-512 VNNI (int8 dot products) is present, for int8 kernels and reports.
pub fn has_avx512_vnni() -> bool {
    detected().avx512_vnni
}

/// Whether AVX-512 BF16 (`vdpbf16ps`, bf16 pair dot products) is present,
/// for the bf16 GEMM of the training kernels (`kvant_train::gemm`).
pub fn has_avx512_bf16() -> bool {
    detected().avx512_bf16
}

/// The tier every dispatching kernel uses: the detected one, lowered by
/// `KVANT_SIMD=scalar|avx2|avx512` if set. A request above the detected tier,
/// or an unrecognised value, leaves the detected tier in place.
pub fn tier() -> SimdTier {
    static TIER: OnceLock<SimdTier> = OnceLock::new();
    *TIER.get_or_init(|| {
        let requested = std::env::var("KVANT_SIMD")
            .ok()
            .and_then(|v| SimdTier::parse(&v));
        effective(requested, detected_tier())
    })
}

fn effective(requested: Option<SimdTier>, detected: SimdTier) -> SimdTier {
    requested.map_or(detected, |r| r.min(detected))
}

/// Every tier this CPU can run, lowest first, so tests can compare each
/// fast path with the reference regardless of `KVANT_SIMD`.
pub fn available_tiers() -> Vec<SimdTier> {
    [SimdTier::Scalar, SimdTier::Avx2, SimdTier::Avx512]
        .into_iter()
        .filter(|&t| t <= detected_tier())
        .collect()
}

/// Lowers a caller-chosen tier to one the CPU supports. Every `*_with(tier, ..)`
/// kernel entry point goes through this, which is what makes the `unsafe`
/// calls into `#[target_feature]` code sound.
pub fn clamp(tier: SimdTier) -> SimdTier {
    tier.min(detected_tier())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_only_lower_the_tier() {
        assert_eq!(effective(None, SimdTier::Avx2), SimdTier::Avx2);
        assert_eq!(
            effective(Some(SimdTier::Scalar), SimdTier::Avx2),
            SimdTier::Scalar
        );
        assert_eq!(
            effective(Some(SimdTier::Avx512), SimdTier::Avx2),
            SimdTier::Avx2
        );
        assert_eq!(
            effective(Some(SimdTier::Avx2), SimdTier::Scalar),
            SimdTier::Scalar
        );
    }

    #[test]
    fn parses_env_values() {
        assert_eq!(SimdTier::parse(" AVX2 "), Some(SimdTier::Avx2));
        assert_eq!(SimdTier::parse("scalar"), Some(SimdTier::Scalar));
        assert_eq!(SimdTier::parse("avx512"), Some(SimdTier::Avx512));
        assert_eq!(SimdTier::parse("sse"), None);
        for t in available_tiers() {
            assert_eq!(SimdTier::parse(t.name()), Some(t));
        }
    }

    #[test]
    fn available_tiers_are_sorted_and_contain_the_chosen_one() {
        let tiers = available_tiers();
        assert_eq!(tiers.first(), Some(&SimdTier::Scalar));
        assert!(tiers.windows(2).all(|w| w[0] < w[1]));
        assert!(tiers.contains(&tier()));
        assert_eq!(tiers.last(), Some(&detected_tier()));
        assert!(!has_avx512_vnni() || detected_tier() == SimdTier::Avx512);
        assert!(!has_avx512_bf16() || detected_tier() == SimdTier::Avx512);
        assert_eq!(clamp(SimdTier::Avx512), detected_tier());
    }
}
