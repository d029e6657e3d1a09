//! DeepSeek-V3's multi-token prediction (MTP) module, stored as one more
//! layer after the main ones (`num_nextn_predict_layers`; GigaChat3 has it
//! too): from the main model's last hidden state `h` at position `p` and
//! the embedding of token `p + 1`, it predicts token `p + 2`.
//!
//! `m = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])` (`h_p` after the
//! main model's final norm, as transformers and vLLM feed it), then a full decoder
//! layer (latent attention over the module's own cache, experts), then
//! `shared_head.norm` and `shared_head.head` (the main output head when a
//! checkpoint omits it). Its input number `i` (token `i + 1` with hidden
//! state `i`) sits in slot `i` of the module's cache layer and is rotated
//! at position `i + 1`, the position of its token.

use super::layer::{Attention, Ffn, Layer};
use super::loader::Loader;
use super::mha::MhaAttention;
use super::mla::MlaAttention;
use super::mla_expand::MlaPrefill;
use super::moe::ExpertLayout;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::ModelError;
use kvant_kernels::linear::LinearWeight;

pub(crate) struct MtpModule {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// `[hidden, 2 · hidden]`, applied to `[enorm(e); hnorm(h)]`.
    pub eh_proj: LinearWeight,
    pub layer: Layer,
    pub head_norm: Vec<f32>,
    pub head: Option<LinearWeight>,
}

impl MtpModule {
    /// Loads the module stored as layer `index` (`model.layers.{index}.*`
    /// in Hugging Face files; block `index` with its `nextn.*` tensors in
    /// llama.cpp's GGUF layout); `None` when it is absent.
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        index: usize,
        prefill: MlaPrefill,
    ) -> Result<Option<Self>, ModelError> {
        let n = ld.ckpt.layer_names(index, cfg.arch);
        let p = n.prefix.clone();
        let own = |hf: &str, gguf: &str| match ld.ckpt {
            Checkpoint::Hf(_) => format!("{p}{hf}.weight"),
            Checkpoint::Gguf(_) => format!("{p}nextn.{gguf}.weight"),
        };
        let eh_proj = own("eh_proj", "eh_proj");
        let router = match ld.ckpt {
            Checkpoint::Hf(_) => format!("{p}mlp.gate.weight"),
            Checkpoint::Gguf(_) => format!("{p}ffn_gate_inp.weight"),
        };
        if !ld.has(&eh_proj) {
            return Ok(None);
        }
        let h = cfg.hidden;
        let attn = match &cfg.mla {
            Some(m) => Attention::Mla(MlaAttention::load(ld, cfg, m, &p, prefill)?),
            None => Attention::Mha(MhaAttention::load(ld, cfg, &n)?),
        };
        let moe = cfg.experts.as_ref().filter(|_| ld.has(&router));
        let ffn = Ffn::load(
            ld,
            cfg,
            &n,
            moe.map(|e| (e, ExpertLayout::Shared(ld.shard))),
        )?;
        let head = own("shared_head.head", "shared_head_head");
        Ok(Some(MtpModule {
            enorm: ld.vector(&own("enorm", "enorm"), h)?,
            hnorm: ld.vector(&own("hnorm", "hnorm"), h)?,
            eh_proj: ld.weight(&eh_proj, h, 2 * h)?,
            layer: Layer {
                attn_norm: ld.vector(&n.attn_norm, h)?,
                attn,
                post_attn_norm: None,
                ffn_norm: ld.vector(&n.ffn_norm, h)?,
                ffn,
                post_ffn_norm: None,
                inv_freq: cfg.inv_freq(index, None),
                window: None,
                // The pool's KV layer after the main model's.
                cache: cfg.attention_layers(),
                hyper: None,
            },
            head_norm: ld.vector(&own("shared_head.norm", "shared_head_norm"), h)?,
            head: match ld.has(&head) {
                true => Some(ld.weight(&head, cfg.vocab, h)?),
                false => None,
            },
        }))
    }
}
