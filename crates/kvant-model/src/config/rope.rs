//! Rotary position embedding settings: base, rotated dimensions, pair
//! order and the frequency scalings checkpoints use (linear, Llama 3,
//! YaRN), read from `config.json` (`rope_theta`/`rope_scaling` or
//! transformers 5's `rope_parameters`) or GGUF metadata, and folded into
//! the inverse frequencies as transformers computes them.

use super::arch::Arch;
use super::error::{invalid, ConfigError, Result};
use super::json::{f32_at, flag};
use crate::gguf::GgufFile;
use kvant_kernels::rope::RopeStyle;
use serde_json::Value;

#[derive(Clone, Debug)]
pub struct RopeConfig {
    pub theta: f32,
    /// Rotated dimensions per head (≤ head_dim).
    pub dim: usize,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
    /// Base for sliding-window layers when it differs (Gemma 3's local rope).
    pub local_theta: Option<f32>,
    /// No positions at all (Kimi Linear's latent attention): every
    /// frequency is zero, so the rotation is the identity (cos 0 = 1 and
    /// sin 0 = 0 exactly) and the rope path runs unchanged.
    pub nope: bool,
}

/// What a checkpoint states about its rotary embedding, in one vocabulary
/// for both formats; `build` supplies what the architecture implies.
pub(super) struct RopeSettings {
    pub theta: Option<f32>,
    /// Gemma 3's base for sliding layers.
    pub local_theta: Option<f32>,
    pub scaling: RopeScaling,
    /// Rotated dimensions per head, where the checkpoint counts them.
    pub dim: Option<usize>,
    /// Or the rotated fraction of the head (transformers' `partial_rotary_factor`).
    pub partial: Option<f32>,
    /// Pair order, where the checkpoint says it.
    pub interleaved: Option<bool>,
}

impl RopeSettings {
    /// `{arch}.rope.*` as llama.cpp's converter writes it.
    pub(super) fn from_gguf(g: &GgufFile, arch_name: &str) -> Result<Self> {
        let key = |k: &str| format!("{arch_name}.rope.{k}");
        Ok(RopeSettings {
            scaling: parse_gguf_scaling(g, arch_name)?,
            theta: g.get_f32(&key("freq_base"))?,
            // llama.cpp fixes Gemma 3's local base.
            local_theta: None,
            dim: g.get_usize(&key("dimension_count"))?,
            partial: None,
            // llama.cpp's converter permutes Llama's and Mistral's queries
            // and keys into interleaved pairs.
            interleaved: matches!(arch_name, "llama" | "mistral").then_some(true),
        })
    }

    /// transformers 5 nests rope settings in `rope_parameters` (per layer
    /// type for Gemma 3); older files keep them top-level.
    pub(super) fn from_hf(cfg: &Value, arch: Arch) -> Result<Self> {
        let params = cfg.get("rope_parameters").filter(|v| v.is_object());
        let (theta, scaling, local_theta) = match params {
            Some(rp) if rp.get("full_attention").is_some() => {
                let full = &rp["full_attention"];
                let local_theta = match rp.get("sliding_attention") {
                    Some(l) => f32_at(l, "rope_theta")?,
                    None => None,
                };
                (f32_at(full, "rope_theta")?, Some(full), local_theta)
            }
            Some(rp) => (f32_at(rp, "rope_theta")?, Some(rp), None),
            None => (
                f32_at(cfg, "rope_theta")?,
                cfg.get("rope_scaling"),
                f32_at(cfg, "rope_local_base_freq")?,
            ),
        };
        let scaling = parse_hf_scaling(scaling)?;
        let partial = match (f32_at(cfg, "partial_rotary_factor")?, params) {
            (Some(p), _) => p,
            (None, Some(rp)) => f32_at(rp, "partial_rotary_factor")?.unwrap_or(1.0),
            (None, None) => 1.0,
        };
        Ok(RopeSettings {
            theta,
            local_theta,
            scaling,
            dim: None,
            partial: Some(partial),
            // Only DeepSeek-V3 has the switch.
            interleaved: match arch {
                Arch::DeepseekV3 => flag(cfg, "rope_interleave"),
                _ => None,
            },
        })
    }

    /// The rotation of heads of `head_dim`; latent attention rotates its
    /// own `latent_rope_dim`.
    pub(super) fn build(
        self,
        arch: Arch,
        head_dim: usize,
        latent_rope_dim: Option<usize>,
    ) -> RopeConfig {
        let dim = match (latent_rope_dim, self.dim, self.partial) {
            (Some(d), _, _) | (None, Some(d), _) => d,
            (None, None, Some(p)) => ((head_dim as f32 * p) as usize) & !1,
            (None, None, None) => head_dim,
        };
        RopeConfig {
            theta: self.theta.unwrap_or(10_000.0),
            dim,
            style: match self.interleaved.unwrap_or(arch.interleaved_rope()) {
                true => RopeStyle::Interleaved,
                false => RopeStyle::Neox,
            },
            scaling: self.scaling,
            local_theta: arch.gemma().then(|| self.local_theta.unwrap_or(10_000.0)),
            nope: arch.nope(),
        }
    }
}

/// Frequency scaling applied to the rotary embedding.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (inverse frequencies divided by it).
    Linear {
        factor: f32,
    },
    /// Llama 3.x piecewise scaling of the inverse frequencies.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// YaRN (DeepSeek-V2/V3, Qwen long-context): high frequencies kept,
    /// low ones interpolated by `factor`, a linear ramp between the
    /// dimensions that turn `beta_fast` and `beta_slow` times over the
    /// original context.
    Yarn {
        factor: f32,
        original_max_position_embeddings: f32,
        beta_fast: f32,
        beta_slow: f32,
        /// `get_mscale(factor, mscale_all_dim)` when the checkpoint sets
        /// `mscale_all_dim` (DeepSeek): the softmax scale is multiplied by
        /// its square. 1 otherwise.
        softmax_mscale: f32,
        /// Multiplies the rotated values (transformers scales cos and sin by it).
        attention_factor: f32,
    },
}

impl RopeScaling {
    /// What the rotated query and key parts are multiplied by.
    pub fn attention_factor(&self) -> f32 {
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// What multiplies the softmax scale `1/sqrt(d)` (DeepSeek's mscale²).
    pub fn softmax_factor(&self) -> f32 {
        match self {
            RopeScaling::Yarn { softmax_mscale, .. } => softmax_mscale * softmax_mscale,
            _ => 1.0,
        }
    }
}

/// YaRN's magnitude correction: `0.1 · m · ln(s) + 1` for a scale `s > 1`.
fn yarn_mscale(scale: f32, m: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// Reads a transformers rope-scaling object (`rope_scaling`, or
/// transformers 5's `rope_parameters`).
pub(super) fn parse_hf_scaling(obj: Option<&Value>) -> Result<RopeScaling> {
    let Some(obj) = obj.filter(|v| v.is_object()) else {
        return Ok(RopeScaling::None);
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let opt = |k: &str| obj.get(k).and_then(Value::as_f64).map(|v| v as f32);
    let num = |k: &str| -> Result<f32> {
        opt(k).ok_or_else(|| ConfigError::Missing(format!("rope_scaling.{k}")))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        "yarn" => {
            let factor = num("factor")?;
            let (mscale, all_dim) = (opt("mscale"), opt("mscale_all_dim"));
            let attention_factor = match (opt("attention_factor"), mscale, all_dim) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                    yarn_mscale(factor, m) / yarn_mscale(factor, a)
                }
                _ => yarn_mscale(factor, 1.0),
            };
            Ok(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
                beta_fast: opt("beta_fast").filter(|&b| b != 0.0).unwrap_or(32.0),
                beta_slow: opt("beta_slow").filter(|&b| b != 0.0).unwrap_or(1.0),
                softmax_mscale: match all_dim {
                    Some(a) if a != 0.0 => yarn_mscale(factor, a),
                    _ => 1.0,
                },
                attention_factor,
            })
        }
        other => Err(invalid(
            "rope_scaling.rope_type",
            format!("`{other}` is not supported"),
        )),
    }
}

/// Reads `{arch}.rope.scaling.*` as llama.cpp's converter writes it.
/// DeepSeek's converter stores `0.1 · mscale_all_dim` as the YaRN log
/// multiplier, so the softmax correction is `1 + mul · ln(factor)`.
pub(super) fn parse_gguf_scaling(g: &GgufFile, arch: &str) -> Result<RopeScaling> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let factor = || -> Result<f32> { Ok(g.get_f32(&key("factor"))?.unwrap_or(1.0)) };
    match g.get_str(&key("type"))? {
        None | Some("none") => Ok(RopeScaling::None),
        Some("linear") => Ok(RopeScaling::Linear { factor: factor()? }),
        Some("yarn") => {
            let factor = factor()?;
            let orig = g
                .get_usize(&key("original_context_length"))?
                .ok_or_else(|| ConfigError::Missing(key("original_context_length")))?
                as f32;
            let log_mul = g.get_f32(&key("yarn_log_multiplier"))?;
            Ok(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast: g.get_f32(&key("yarn_beta_fast"))?.unwrap_or(32.0),
                beta_slow: g.get_f32(&key("yarn_beta_slow"))?.unwrap_or(1.0),
                softmax_mscale: match log_mul {
                    Some(m) if m != 0.0 && factor > 1.0 => 1.0 + m * factor.ln(),
                    _ => 1.0,
                },
                attention_factor: match (g.get_f32(&key("yarn_attn_factor"))?, log_mul) {
                    (Some(a), _) => a,
                    // DeepSeek writes its mscale as the log multiplier and
                    // leaves the rotated values unscaled (mscale = mscale_all_dim).
                    (None, Some(_)) => 1.0,
                    (None, None) => yarn_mscale(factor, 1.0),
                },
            })
        }
        Some(other) => Err(invalid(key("type"), format!("`{other}` is not supported"))),
    }
}

/// Folds rope scaling into inverse frequencies `inv` (of a rotation over
/// `dim` dimensions with base `theta`), as transformers'
/// `_compute_{linear_scaling,llama3,yarn}_parameters` do.
pub(super) fn apply_scaling(inv: &mut [f32], scaling: &RopeScaling, dim: usize, theta: f32) {
    match *scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => inv.iter_mut().for_each(|f| *f /= factor),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old_ctx,
        } => {
            let low_wavelen = old_ctx / low_freq_factor;
            let high_wavelen = old_ctx / high_freq_factor;
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (old_ctx / wavelen - low_freq_factor)
                        / (high_freq_factor - low_freq_factor);
                    *f = (1.0 - smooth) * *f / factor + smooth * *f;
                }
            }
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings: old_ctx,
            beta_fast,
            beta_slow,
            ..
        } => {
            // The dimension whose frequency turns `rot` times over the
            // original context; the ramp runs between those of beta_fast
            // and beta_slow (floored and ceiled, as transformers truncates).
            let d = dim as f64;
            let corr = |rot: f32| {
                d * (old_ctx as f64 / (rot as f64 * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * (theta as f64).ln())
            };
            let low = corr(beta_fast).floor().max(0.0);
            let mut high = corr(beta_slow).ceil().min(d - 1.0);
            if low == high {
                high += 0.001;
            }
            // The ramp in f32, as transformers computes it.
            let (low, high) = (low as f32, high as f32);
            for (i, f) in inv.iter_mut().enumerate() {
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation = 1.0 - ramp;
                *f = *f / factor * (1.0 - extrapolation) + *f * extrapolation;
            }
        }
    }
}
