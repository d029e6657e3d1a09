//! One vocabulary for what a checkpoint states about the model, filled by
//! the GGUF and `config.json` readers, and the one place that derives the
//! configuration's switches from it.

use super::arch::Arch;
use super::error::{invalid, Result};
use super::experts::ExpertsConfig;
use super::indexer::IndexerConfig;
use super::linear::LinearConfig;
use super::mla::MlaConfig;
use super::model::ModelConfig;
use super::rope::RopeSettings;
use super::v4::V4Config;
use kvant_kernels::activation::Activation;

/// What a checkpoint states, each value as its format's reader extracted
/// it (with the format's own defaults for keys it may leave out); `None`
/// where the architecture decides. Sections are already built.
pub(super) struct ModelSettings {
    pub arch: Arch,
    /// The head count's key, for errors about it.
    pub heads_key: String,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// `None` where the checkpoint's count does not describe the cache:
    /// latent attention keeps one latent per token.
    pub n_kv_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_context: usize,
    pub rms_eps: f32,
    pub rope: RopeSettings,
    pub sliding_window: Option<usize>,
    /// Per layer: sliding (else global) attention.
    pub sliding_layers: Option<Vec<bool>>,
    /// Or every how many layers one is global (Gemma 3).
    pub sliding_pattern: Option<usize>,
    pub qkv_bias: bool,
    pub tied_embeddings: Option<bool>,
    pub activation: Option<Activation>,
    /// Gemma's softmax scale `1/sqrt(s)` in place of `1/sqrt(head_dim)`.
    pub query_pre_attn_scalar: Option<f32>,
    pub mtp_layers: usize,
    pub experts: Option<ExpertsConfig>,
    pub mla: Option<MlaConfig>,
    pub indexer: Option<IndexerConfig>,
    pub linear: Option<LinearConfig>,
    pub v4: Option<V4Config>,
}

impl ModelSettings {
    /// The configuration: every switch the architecture implies, then the
    /// checks a forward relies on.
    pub(super) fn build(self) -> Result<ModelConfig> {
        let arch = match (self.arch, &self.experts) {
            (Arch::Llama, Some(_)) => Arch::Mixtral,
            (a, _) => a,
        };
        let head_dim = match (self.mla, self.head_dim) {
            (Some(m), _) => m.qk_dim(),
            (None, Some(d)) => d,
            (None, None) => self
                .hidden
                .checked_div(self.n_heads)
                .ok_or_else(|| invalid(self.heads_key, "must be positive"))?,
        };
        let rope = self
            .rope
            .build(arch, head_dim, self.mla.map(|m| m.rope_dim));
        let gemma = arch.gemma();
        let attn_scale = match (gemma, self.query_pre_attn_scalar) {
            (true, Some(s)) => 1.0 / s.sqrt(),
            _ => rope.scaling.softmax_factor() / (head_dim as f32).sqrt(),
        };
        let sliding_layers = match (self.sliding_layers, gemma) {
            (Some(layers), _) => layers,
            (None, true) => {
                let pattern = self.sliding_pattern.unwrap_or(6).max(1);
                (0..self.n_layers).map(|i| (i + 1) % pattern != 0).collect()
            }
            (None, false) => Vec::new(),
        };
        ModelConfig {
            arch,
            hidden: self.hidden,
            n_layers: self.n_layers,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads.unwrap_or(1),
            head_dim,
            intermediate: self.intermediate,
            vocab: self.vocab,
            max_context: self.max_context,
            rms_eps: self.rms_eps,
            rope,
            sliding_window: self.sliding_window,
            sliding_layers,
            qkv_bias: self.qkv_bias,
            qk_norm: arch.qk_norm(),
            tied_embeddings: self.tied_embeddings.unwrap_or(gemma),
            activation: self.activation.unwrap_or(match gemma {
                true => Activation::GeluTanh,
                false => Activation::Silu,
            }),
            attn_scale,
            gemma,
            experts: self.experts,
            mla: self.mla,
            indexer: self.indexer,
            mtp_layers: self.mtp_layers,
            linear: self.linear,
            attn_output_gate: arch.qwen_hybrid(),
            zero_centered_norms: gemma || arch.qwen_hybrid(),
            v4: self.v4,
        }
        .validate()
    }
}

/// A checkpoint's layer count, bounded before anything is built per layer
/// (the experts' and linear layers' lists): a hostile `block_count` of
/// 2^64 - 1 made a list of that length ("capacity overflow").
pub(super) fn layer_count(key: impl Into<String>, n: usize) -> Result<usize> {
    match n > MAX_SIZE {
        true => Err(invalid(key, "is implausibly large")),
        false => Ok(n),
    }
}

/// The bound on every size and count a configuration states.
const MAX_SIZE: usize = 1 << 24;

impl ModelConfig {
    /// The sizes and numbers a forward relies on, each within range.
    fn validate(self) -> Result<Self> {
        let bad = |key: &str, why: &str| invalid(key, why);
        for (key, v) in [
            ("hidden_size", self.hidden),
            ("num_hidden_layers", self.n_layers),
            ("num_attention_heads", self.n_heads),
            ("num_key_value_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate),
            ("vocab_size", self.vocab),
            ("max_position_embeddings", self.max_context),
        ] {
            if v == 0 {
                return Err(bad(key, "must be positive"));
            }
            if v > MAX_SIZE {
                return Err(bad(key, "is implausibly large"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                "must divide the number of attention heads",
            ));
        }
        if self.rope.dim > self.head_dim || !self.rope.dim.is_multiple_of(2) {
            return Err(bad("rope dimension", "must be even and at most head_dim"));
        }
        if self.rope.dim / 2 > kvant_kernels::rope::MAX_ROPE_HALF {
            return Err(bad("rope dimension", "is larger than kvant supports (512)"));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 0.0) {
            return Err(bad("rope_theta", "must be a positive number"));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(bad("rms_norm_eps", "must be a non-negative number"));
        }
        if self.sliding_window == Some(0) {
            return Err(bad("sliding_window", "must be positive"));
        }
        if self.mtp_layers > 16 {
            return Err(bad("num_nextn_predict_layers", "is implausibly large"));
        }
        Ok(self)
    }
}
