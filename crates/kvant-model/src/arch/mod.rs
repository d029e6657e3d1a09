//! Architectures: one decoder ([`decoder::DecoderModel`]) whose layers
//! compose an attention (multi-head with GQA, or DeepSeek's multi-head
//! latent attention, [`mla`]) and a feed-forward (dense, or a mixture of
//! experts, [`moe`]), with switches from [`crate::config::ModelConfig`]:
//! Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma 3, Mixtral, Qwen2/3-MoE and
//! DeepSeek-V2/V3 (GigaChat3) are configurations of it, not copies;
//! DeepSeek-V3.2 adds an [`indexer`] to latent attention, which makes it
//! sparse. DeepSeek-V4 composes its own attention ([`csa`]: a sliding
//! window beside compressed entries) with hyper-connected residual streams
//! ([`mhc`]).

mod compressor;
mod csa;
mod ctx;
pub mod decoder;
mod ffn;
mod gdn;
mod heads;
mod indexer;
mod layer;
mod lightning;
mod loader;
mod mha;
mod mhc;
mod mla;
mod mla_expand;
mod moe;
mod mtp;
pub mod parallel;
mod shard;

/// The first `len` values of `buf`, grown to hold them (contents
/// unspecified: every user overwrites them). It never shrinks: a scratch
/// that layers of different sizes share (DeepSeek-V4's widened entries,
/// a CSA layer's thousands after an HCA layer's few) would otherwise be
/// zero-filled again at every larger layer. V4 bench model decoding at
/// 16k tokens: `memset` was 4.6% of the samples.
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}
