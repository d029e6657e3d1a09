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
//!
//! DeepSeek-V4's module (DeepSeek's `MTPBlock`, vLLM's
//! `deepseek_v4_mtp.py`) is the same idea on the `hc_mult` residual
//! streams: `h` is the main model's streams before its `hc_head`
//! collapse, each stream becomes `h_proj(hnorm(h_k)) + e_proj(enorm(e))`
//! (two projections where V3 has one `eh_proj`), a V4 block (its own
//! attention kind, caches and mHC) runs over them, and the module's own
//! `hc_head` collapses them before `norm` and the main model's head.
//! Input `i` sits at position `i`, the position of its hidden state (as
//! vLLM places it): a compressing block's windows then line up with the
//! main model's. llama.cpp's converter writes the module to a GGUF of its
//! own with the two projections as one `eh_proj = [e_proj | h_proj]`
//! (the same products, the embedding's then taken once per stream), read
//! with [`crate::arch::decoder::DecoderModel::load_with_drafter`].

use super::layer::{Attention, Ffn, Layer};
use super::loader::Loader;
use super::mha::MhaAttention;
use super::mhc::{hyper_names, HyperHead};
use super::mla::MlaAttention;
use super::mla_expand::MlaPrefill;
use super::moe::ExpertLayout;
use crate::checkpoint::{Checkpoint, LayerNames};
use crate::config::{ModelConfig, V4Attention};
use crate::ModelError;
use kvant_kernels::linear::LinearWeight;

/// How the module mixes a token's embedding with the main model's state.
pub(crate) enum MtpMix {
    /// `eh_proj([enorm(e); hnorm(h)])`, `[hidden, 2 · hidden]`.
    Fused(LinearWeight),
    /// `e_proj(enorm(e)) + h_proj(hnorm(h_k))` for each stream `k`
    /// (DeepSeek-V4; the embedding's projection runs once per token).
    Split { e: LinearWeight, h: LinearWeight },
}

pub(crate) struct MtpModule {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub mix: MtpMix,
    pub layer: Layer,
    pub head_norm: Vec<f32>,
    pub head: Option<LinearWeight>,
    /// DeepSeek-V4: the module's own collapse of its streams.
    pub hyper_head: Option<HyperHead>,
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
        if cfg.v4.is_some() {
            return Self::load_v4(ld, cfg, index);
        }
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
            mix: MtpMix::Fused(ld.weight(&eh_proj, h, 2 * h)?),
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
            hyper_head: None,
        }))
    }

    /// DeepSeek-V4's module, published as `mtp.0.*` in safetensors, or
    /// as llama.cpp's converter writes it with `--mtp` (a GGUF of its own:
    /// block `index` in the main layers' names plus `nextn.{eh_proj,
    /// enorm, hnorm, shared_head_norm}`, the module's `hc_head` as the
    /// file's `output_hc_*`, and `eh_proj` = `[e_proj | h_proj]`, which
    /// the converter stores as Q8_0); `None` when it is absent. Its block's
    /// attention is the config's entry past the main layers
    /// ([`crate::config::V4Config::mtp`]).
    fn load_v4(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        index: usize,
    ) -> Result<Option<Self>, ModelError> {
        let Some(v4) = &cfg.v4 else {
            return Ok(None);
        };
        let h = cfg.hidden;
        let names = match ld.ckpt {
            Checkpoint::Hf(_) => V4Names::published(),
            Checkpoint::Gguf(_) => V4Names::gguf(ld.ckpt.layer_names(index, cfg.arch), index),
        };
        if !ld.has(&names.probe) {
            return Ok(None);
        }
        let p = &names.layer.prefix;
        // A block with a compressor where the config says sliding would
        // run without it: say so instead.
        let compressor = [
            format!("{p}attn.compressor.wkv.weight"),
            format!("{p}attn_compressor_kv.weight"),
        ];
        if let Some(c) = compressor.iter().find(|c| ld.has(c)) {
            if v4.mtp == V4Attention::Sliding {
                return Err(ModelError::BadTensor {
                    name: c.clone(),
                    why: "present, but the config gives the MTP layer a sliding window only \
                          (no compress-ratio entry past the main layers, or 0)"
                        .into(),
                });
            }
        }
        let layout = ExpertLayout::Shared(ld.shard);
        let prefill = MlaPrefill::default();
        let layer = Layer::load(ld, cfg, (index, names.layer), prefill, layout, None)?;
        let mix = match &names.mix {
            V4Mix::Split { e, h: hp } => MtpMix::Split {
                e: ld.weight(e, h, h)?,
                h: ld.weight(hp, h, h)?,
            },
            V4Mix::Fused(eh) => MtpMix::Fused(ld.weight(eh, h, 2 * h)?),
        };
        // The norm before the head: llama.cpp falls back to the main
        // model's final norm when the file has none of its own.
        let head_norm = match ld.has(&names.head_norm) {
            true => names.head_norm,
            false => names.head_norm_fallback,
        };
        Ok(Some(MtpModule {
            enorm: ld.vector(&names.enorm, h)?,
            hnorm: ld.vector(&names.hnorm, h)?,
            mix,
            layer,
            head_norm: ld.vector(&head_norm, h)?,
            // DeepSeek's module shares the main model's head.
            head: match ld.has(&names.head) {
                true => Some(ld.weight(&names.head, cfg.vocab, h)?),
                false => None,
            },
            hyper_head: Some(HyperHead::load(
                ld,
                hyper_names(ld, &names.hc_stem).each_ref(),
                v4.hc,
                h,
                cfg.rms_eps,
            )?),
        }))
    }
}

enum V4Mix {
    Split { e: String, h: String },
    Fused(String),
}

/// Where DeepSeek-V4's module keeps its tensors in each format.
struct V4Names {
    /// Present exactly when the module is.
    probe: String,
    layer: LayerNames,
    mix: V4Mix,
    enorm: String,
    hnorm: String,
    head_norm: String,
    head_norm_fallback: String,
    head: String,
    /// The module's `hc_head` collapse ([`hyper_names`]).
    hc_stem: String,
}

impl V4Names {
    /// DeepSeek's published `mtp.0.*`.
    fn published() -> Self {
        let own = |s: &str| format!("mtp.0.{s}");
        V4Names {
            probe: own("e_proj.weight"),
            layer: LayerNames::deepseek_v4("mtp.0."),
            mix: V4Mix::Split {
                e: own("e_proj.weight"),
                h: own("h_proj.weight"),
            },
            enorm: own("enorm.weight"),
            hnorm: own("hnorm.weight"),
            head_norm: own("norm.weight"),
            head_norm_fallback: own("norm.weight"),
            head: own("head.weight"),
            hc_stem: own("hc_head"),
        }
    }

    /// llama.cpp's `deepseek4` names for block `index`.
    fn gguf(layer: LayerNames, index: usize) -> Self {
        let own = |s: &str| format!("blk.{index}.nextn.{s}.weight");
        V4Names {
            probe: own("eh_proj"),
            layer,
            mix: V4Mix::Fused(own("eh_proj")),
            enorm: own("enorm"),
            hnorm: own("hnorm"),
            head_norm: own("shared_head_norm"),
            head_norm_fallback: "output_norm.weight".into(),
            head: own("shared_head_head"),
            hc_stem: "output_hc".into(),
        }
    }
}
