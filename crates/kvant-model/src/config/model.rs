//! The Llama-family configuration: one struct with switches for every
//! supported variant (built by `settings` from what either format's reader
//! extracts), and what the forward asks of it.

use super::arch::Arch;
use super::experts::ExpertsConfig;
use super::indexer::IndexerConfig;
use super::linear::LinearConfig;
use super::mla::MlaConfig;
use super::rope::{apply_scaling, RopeConfig};
use super::v4::V4Config;
use kvant_kernels::activation::Activation;

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub max_context: usize,
    pub rms_eps: f32,
    pub rope: RopeConfig,
    /// Attention window of sliding layers (all layers unless `sliding_layers` says otherwise).
    pub sliding_window: Option<usize>,
    /// Per layer: does it use the sliding window? Empty means "every layer, if a window is set".
    pub sliding_layers: Vec<bool>,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied_embeddings: bool,
    pub activation: Activation,
    /// Softmax scale `1/sqrt(d)`, with `d` = head_dim or Gemma's `query_pre_attn_scalar`.
    pub attn_scale: f32,
    /// Gemma multiplies embeddings by `sqrt(hidden)` and wraps FFN/attention in extra norms.
    pub gemma: bool,
    /// Routed experts in place of the dense FFN (in the layers it says).
    pub experts: Option<ExpertsConfig>,
    /// Multi-head latent attention in place of multi-head attention; then
    /// `n_kv_heads` is 1 (one latent per token) and `head_dim` is the
    /// per-head query/key size before absorption.
    pub mla: Option<MlaConfig>,
    /// DeepSeek sparse attention: every latent-attention layer's indexer.
    pub indexer: Option<IndexerConfig>,
    /// Multi-token-prediction layers stored after the main ones
    /// (DeepSeek-V3's `num_nextn_predict_layers`).
    pub mtp_layers: usize,
    /// Linear-attention (Gated DeltaNet) layers beside the full-attention
    /// ones, which `layers` of it leaves out.
    pub linear: Option<LinearConfig>,
    /// Full attention multiplies its output by `sigmoid(gate)`, a second
    /// query-sized projection stored interleaved with the query per head
    /// (Qwen3-Next, Qwen3.5).
    pub attn_output_gate: bool,
    /// Every RMSNorm scales by `1 + w` (Gemma 3, Qwen3-Next, Qwen3.5):
    /// Hugging Face checkpoints store `w`, GGUF converters add the 1.
    pub zero_centered_norms: bool,
    /// DeepSeek-V4: per-layer sliding / compressed attention, mHC
    /// residual streams, hash-routed MoE layers.
    pub v4: Option<V4Config>,
}

impl ModelConfig {
    /// Whether layer `layer` is a linear-attention layer.
    pub fn is_linear(&self, layer: usize) -> bool {
        self.linear.as_ref().is_some_and(|l| l.is_linear(layer))
    }

    /// Layers with attention over cached rows (all but the linear ones).
    pub fn attention_layers(&self) -> usize {
        (0..self.n_layers).filter(|&i| !self.is_linear(i)).count()
    }

    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some() && self.sliding_layers.get(layer).copied().unwrap_or(true)
    }

    /// Inverse rotary frequencies for a layer, with scaling folded in.
    pub fn inv_freq(&self, layer: usize, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let theta = match (self.rope.local_theta, self.is_sliding(layer)) {
            (Some(local), true) => local,
            _ => self.rope.theta,
        };
        let d = self.rope.dim;
        if self.rope.nope {
            return vec![0.0; d / 2];
        }
        let mut inv: Vec<f32> = (0..d / 2)
            .map(|i| (1.0 / (theta as f64).powf((2 * i) as f64 / d as f64)) as f32)
            .collect();
        // Gemma 3 applies the global scaling only to full-attention layers.
        let scaled = !(self.rope.local_theta.is_some() && self.is_sliding(layer));
        if let Some(ff) = freq_factors {
            // GGUF stores Llama 3 scaling as per-frequency divisors.
            for (f, &div) in inv.iter_mut().zip(ff) {
                *f /= div;
            }
        } else if scaled {
            apply_scaling(&mut inv, &self.rope.scaling, d, theta);
        }
        inv
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
