//! Opening a checkpoint as a runnable model: configuration, weights,
//! tokenizer and chat template from one path.

use crate::arch::decoder::{DecoderModel, LoadOptions};
use crate::arch::parallel::Parallel;
use crate::chat::ChatTemplate;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::gguf::GgufFile;
use crate::hf::HfDir;
use crate::tokenizer::{GgufTokenizerSpec, Tokenizer};
use crate::ModelError;
use kvant_core::DType;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub struct LoadedModel {
    pub model: DecoderModel,
    pub tokenizer: Tokenizer,
    /// `None` when the checkpoint carries no template.
    pub chat_template: Option<ChatTemplate>,
    pub info: ModelInfo,
}

/// What `kvant info` prints.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelInfo {
    pub format: &'static str,
    pub architecture: &'static str,
    pub parameters: u64,
    /// Tensor count per stored dtype.
    pub tensor_dtypes: BTreeMap<String, usize>,
    /// The context the model runs with ([`LoadOptions::context_length`] or
    /// the checkpoint's).
    pub context_length: usize,
    /// The context the checkpoint declares (what it was trained for).
    pub trained_context_length: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub tokenizer: String,
    pub vocab_size: usize,
    pub chat_template: bool,
    /// Bytes of weights one decoded token reads (a mixture of experts reads
    /// only its routed and shared experts).
    pub weight_bytes: usize,
    /// Bytes of all prepared weights.
    pub total_weight_bytes: usize,
    /// Routed experts per MoE layer, experts per token, and MoE layers.
    pub experts: Option<(usize, usize, usize)>,
    /// Latent attention: `kv_lora_rank + qk_rope_head_dim` values cached
    /// per token and layer.
    pub mla_latent_dim: Option<usize>,
    /// Sparse attention (DeepSeek-V3.2): indexer heads, key size, and the
    /// positions each token attends to.
    pub indexer: Option<(usize, usize, usize)>,
    /// Linear attention: its layers, the bytes of state one sequence
    /// keeps over them whatever its length, and the kind of layer.
    pub linear: Option<(usize, usize, &'static str)>,
    /// KV cache bytes per token (f16 cache), and what caching each head's
    /// expanded keys and values would take.
    pub kv_bytes_per_token: usize,
    pub kv_bytes_per_token_expanded: usize,
    /// Multi-token-prediction layers in the checkpoint.
    pub mtp_layers: usize,
    /// DeepSeek-V4: the attention kind of each layer (`sliding`, `csa`,
    /// `hca`), the bytes of state one sequence keeps whatever its length
    /// (window rings and compressor tails), and the cache one sequence
    /// holds at 4k, 32k and 128k tokens (its entries plus that state).
    pub compressed: Option<CompressedInfo>,
}

/// DeepSeek-V4's cache, for `kvant info`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CompressedInfo {
    pub layers: Vec<&'static str>,
    pub state_bytes: usize,
    /// `(tokens, bytes)` of one sequence's cache.
    pub at: Vec<(usize, usize)>,
}

/// [`load_with`] the default options (int8 activations where they apply).
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    load_with(path, LoadOptions::default())
}

pub fn load_with(path: &Path, opts: LoadOptions) -> Result<LoadedModel, ModelError> {
    load_parallel(path, opts, None)
}

/// [`load_with`], or with `par` this rank's share of the model (see
/// [`DecoderModel::load`]).
pub fn load_parallel(
    path: &Path,
    opts: LoadOptions,
    par: Option<Arc<Parallel>>,
) -> Result<LoadedModel, ModelError> {
    load_files(path, None, opts, par)
}

/// [`load_parallel`], with the multi-token-prediction module read from
/// the file `drafter` when given (llama.cpp's `convert_hf_to_gguf.py
/// --mtp` output; see [`DecoderModel::load_with_drafter`]).
pub fn load_files(
    path: &Path,
    drafter: Option<&Path>,
    opts: LoadOptions,
    par: Option<Arc<Parallel>>,
) -> Result<LoadedModel, ModelError> {
    let ckpt = Checkpoint::open(path)?;
    let drafter = drafter.map(Checkpoint::open).transpose()?;
    let (cfg, tokenizer, template, dtypes) = match &ckpt {
        Checkpoint::Gguf(g) => {
            let cfg = ModelConfig::from_gguf(g)?;
            let spec = tokenizer_spec(g)?;
            let tokenizer = Tokenizer::from_gguf_spec(&spec)?;
            let template = match g.get_str("tokenizer.chat_template")? {
                Some(src) => Some(template_with_tokens(src, &tokenizer)?),
                None => None,
            };
            let dtypes = g.tensor_infos().iter().map(|t| (t.dtype, t.elements()));
            (cfg, tokenizer, template, count(dtypes))
        }
        Checkpoint::Hf(h) => {
            let cfg = ModelConfig::from_hf_json(h.config())?;
            let (tokenizer, template) = hf_tokenizer(h)?;
            let dtypes = h
                .tensor_names()
                .filter_map(|n| h.tensor(n).ok())
                .map(|t| (t.dtype(), t.elements() as u64));
            (cfg, tokenizer, template, count(dtypes))
        }
    };
    let trained_context_length = cfg.max_context;
    let model = DecoderModel::load_with_drafter(&ckpt, drafter.as_ref(), cfg, opts, par)?;
    let c = model.config();
    let info = ModelInfo {
        format: match ckpt {
            Checkpoint::Gguf(_) => "gguf",
            Checkpoint::Hf(_) => "safetensors",
        },
        architecture: c.arch.name(),
        parameters: dtypes.1,
        tensor_dtypes: dtypes.0,
        context_length: c.max_context,
        trained_context_length,
        hidden_size: c.hidden,
        layers: c.n_layers,
        heads: c.n_heads,
        kv_heads: c.n_kv_heads,
        tokenizer: tokenizer.kind().to_string(),
        vocab_size: tokenizer.vocab_size(),
        chat_template: template.is_some(),
        weight_bytes: model.weight_bytes(),
        total_weight_bytes: model.total_weight_bytes(),
        experts: c.experts.as_ref().map(|e| {
            let layers = e.layers.iter().filter(|&&m| m).count();
            (e.router.n_experts, e.router.top_k, layers)
        }),
        mla_latent_dim: c.mla.map(|m| m.latent_dim()),
        indexer: c.indexer.map(|i| (i.n_heads, i.head_dim, i.topk)),
        linear: c.linear.as_ref().map(|l| {
            let st = model.state_shape();
            let kind = match l.layout {
                crate::config::LinearLayout::Kda => "Kimi Delta Attention",
                _ => "Gated DeltaNet",
            };
            (st.layers, st.bytes_per_slot(), kind)
        }),
        kv_bytes_per_token: model.kv_bytes_per_token(),
        kv_bytes_per_token_expanded: model.expanded_kv_bytes_per_token(),
        mtp_layers: c.mtp_layers,
        compressed: c.v4.as_ref().map(|v4| {
            let state = model.state_shape().bytes_per_slot();
            CompressedInfo {
                layers: v4
                    .layers
                    .iter()
                    .map(|l| match l {
                        crate::config::V4Attention::Sliding => "sliding",
                        crate::config::V4Attention::Csa => "csa",
                        crate::config::V4Attention::Hca => "hca",
                    })
                    .collect(),
                state_bytes: state,
                at: [4096, 32768, 131072]
                    .into_iter()
                    .map(|n| (n, n * model.kv_bytes_per_token() + state))
                    .collect(),
            }
        }),
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template: template,
        info,
    })
}

fn count(items: impl Iterator<Item = (DType, u64)>) -> (BTreeMap<String, usize>, u64) {
    let mut map = BTreeMap::new();
    let mut params = 0u64;
    for (d, n) in items {
        *map.entry(d.name().to_string()).or_default() += 1;
        params = params.saturating_add(n);
    }
    (map, params)
}

/// The template renders `bos_token`/`eos_token` as the tokenizer spells them.
fn template_with_tokens(src: &str, tok: &Tokenizer) -> Result<ChatTemplate, ModelError> {
    let piece = |id: Option<u32>| id.and_then(|i| tok.token_to_piece(i).ok());
    Ok(ChatTemplate::new(
        src,
        piece(tok.bos_id()),
        piece(tok.eos_ids().first().copied()),
    )?)
}

/// Collects the `tokenizer.ggml.*` keys llama.cpp's converter writes.
pub fn tokenizer_spec(g: &GgufFile) -> Result<GgufTokenizerSpec, ModelError> {
    let id = |k: &str| -> Result<Option<u32>, ModelError> {
        Ok(g.get_u32(&format!("tokenizer.ggml.{k}"))?)
    };
    let flag = |k: &str| -> Result<Option<bool>, ModelError> {
        Ok(g.get_bool(&format!("tokenizer.ggml.{k}"))?)
    };
    Ok(GgufTokenizerSpec {
        model: g
            .get_str("tokenizer.ggml.model")?
            .ok_or_else(|| ModelError::MissingTokenizer("GGUF key tokenizer.ggml.model".into()))?
            .to_string(),
        pre: g.get_str("tokenizer.ggml.pre")?.map(str::to_string),
        tokens: g
            .get_str_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| ModelError::MissingTokenizer("GGUF key tokenizer.ggml.tokens".into()))?
            .to_vec(),
        scores: g
            .get_f32_array("tokenizer.ggml.scores")?
            .map(|c| c.into_owned()),
        token_types: g
            .get_i32_array("tokenizer.ggml.token_type")?
            .map(|c| c.into_owned()),
        merges: g
            .get_str_array("tokenizer.ggml.merges")?
            .map(<[String]>::to_vec),
        bos_id: id("bos_token_id")?,
        eos_id: id("eos_token_id")?,
        eot_id: id("eot_token_id")?,
        eom_id: id("eom_token_id")?,
        unk_id: id("unknown_token_id")?,
        pad_id: id("padding_token_id")?,
        add_bos: flag("add_bos_token")?,
        add_eos: flag("add_eos_token")?,
        add_space_prefix: flag("add_space_prefix")?,
    })
}

fn hf_tokenizer(h: &HfDir) -> Result<(Tokenizer, Option<ChatTemplate>), ModelError> {
    let json = h
        .tokenizer_json_path()
        .ok_or_else(|| ModelError::MissingTokenizer("tokenizer.json".into()))?;
    let tokenizer = Tokenizer::from_hf_files(json, h.tokenizer_config(), h.generation_config())?;
    let src = match h.chat_template_file() {
        Some(t) => Some(t.to_string()),
        None => h.tokenizer_config().and_then(template_from_config),
    };
    let template = match src {
        Some(s) => Some(template_with_tokens(&s, &tokenizer)?),
        None => None,
    };
    Ok((tokenizer, template))
}

/// `chat_template` is a string, or a list of `{name, template}` whose
/// "default" entry applies.
fn template_from_config(cfg: &serde_json::Value) -> Option<String> {
    match cfg.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|e| e.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}
