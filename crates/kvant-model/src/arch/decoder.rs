//! The decoder: embeddings, a stack of layers each composing an attention
//! (multi-head, [`super::mha`], or latent, [`super::mla`]) and a
//! feed-forward (dense, [`super::ffn`], or a mixture of experts,
//! [`super::moe`]), and the output head; the forward pass runs a ragged
//! batch (several sequences, each contributing a prefill chunk or one
//! decode token) against a paged KV pool.
//!
//! Switches: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3),
//! tied embeddings, GQA/MQA, sliding windows (Mistral, Gemma 3 local layers),
//! Gemma's embedding scale, sandwich norms and GELU, experts (Mixtral,
//! Qwen-MoE, DeepSeek), latent attention (DeepSeek-V2/V3, GigaChat3).

use super::ctx::Place;
use super::gdn::GatedDeltaNet;
use super::layer::{Attention, Layer, LayerScratch};
use super::loader::{Loader, Part};
use super::mhc::{hyper_names, HyperHead};
pub use super::mla_expand::MlaPrefill;
use super::moe::ExpertLayout;
use super::mtp::{MtpMix, MtpModule};
use super::parallel::{drive, Net, Order, Parallel, Task};
use super::shard::Shard;
use super::sized;
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::kv::{EntryShape, KvCache, KvDType, KvPool, KvShape, StateShape, SINGLE_TABLE};
use crate::ModelError;
use kvant_core::DType;
use kvant_core::Tensor;
use kvant_dist::layout::{ModelShape, Placement};
use kvant_kernels::attention::SeqAttn;
use kvant_kernels::linear::{LinearInput, LinearWeight};
use kvant_kernels::norm::rms_norm;
use kvant_kernels::quant::dequantize_row;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Which positions' logits a forward pass returns for a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that does not end its prompt).
    None,
    /// Only the last token's (generation).
    Last,
    /// Every token's, `[n_tokens, vocab]` (perplexity, reference checks).
    All,
    /// The last token's, with every token's hidden state (the prefill of
    /// a sequence that an MTP module drafts for).
    LastAndHidden,
    /// No logits, every token's hidden state (a prompt chunk that does not
    /// end its prompt, of a sequence an MTP module drafts for).
    Hidden,
}

impl Logits {
    /// Logits rows returned for a sequence of `tokens` tokens.
    pub fn rows(self, tokens: usize) -> usize {
        match self {
            Logits::None | Logits::Hidden => 0,
            Logits::Last | Logits::LastAndHidden => 1,
            Logits::All => tokens,
        }
    }

    /// Whether it asks for hidden states beyond those of its logits rows.
    pub fn wants_hidden(self) -> bool {
        matches!(self, Logits::LastAndHidden | Logits::Hidden)
    }

    /// Hidden-state rows a pass returns for a sequence of `tokens` tokens:
    /// those its logits rows come from, every token's for the hidden
    /// variants.
    pub fn hidden_rows(self, tokens: usize) -> usize {
        match self {
            Logits::None => 0,
            Logits::Last => 1,
            Logits::All | Logits::LastAndHidden | Logits::Hidden => tokens,
        }
    }
}

/// How a model is prepared at load time.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Multiply Q4_0/Q4_1/Q5_0/Q8_0 weights with activations quantized to 8 bits
    /// (integer kernels, as llama.cpp does): several times faster, at the
    /// cost of the activations' rounding (at most `max|x|/254` per value of
    /// each 32-value block). Off keeps every activation in f32, for results
    /// closest to an f32 reference.
    pub int8_activations: bool,
    /// Element type of the KV caches the model makes: f16 (the default)
    /// halves what attention streams per token, f32 keeps keys and values
    /// exactly as computed.
    pub kv_dtype: KvDType,
    /// Load the multi-token-prediction module when the checkpoint has one
    /// (for self-speculative decoding): one more layer of weights and of
    /// KV cache.
    pub mtp: bool,
    /// How latent-attention models run prompt chunks (no effect on
    /// others): in the cheaper form, or always absorbed for bitwise batch
    /// invariance.
    pub mla_prefill: MlaPrefill,
    /// Context length in tokens instead of the checkpoint's (llama.cpp's
    /// `--ctx-size`): shorter bounds every cache; longer runs positions the
    /// model was not trained on (benchmarks at depth do; outputs there are
    /// whatever the positions give).
    pub context_length: Option<usize>,
    /// Quantize float weight matrices (F32, F16, BF16: projections,
    /// experts, the embedding and the output head) to this type while
    /// loading: Q8_0, Q4_0 or Q4_K (Q5_0 for rows that are not whole
    /// 256-value blocks), rounded as ggml's reference quantizer rounds
    /// them, then run on the integer kernels. Norms and routers stay as
    /// stored.
    pub quantize: Option<DType>,
    /// Called with `(layers loaded, layers)` after each layer (a progress
    /// bar: quantizing a large checkpoint takes a while).
    pub progress: Option<LoadProgress>,
}

/// See [`LoadOptions::progress`].
pub type LoadProgress = fn(done: usize, total: usize);

impl LoadOptions {
    /// Every activation and cached key/value in f32: results closest to an
    /// f32 reference (the correctness tests' mode), at a cost in speed.
    pub const F32: LoadOptions = LoadOptions {
        int8_activations: false,
        kv_dtype: KvDType::F32,
        mtp: false,
        mla_prefill: MlaPrefill::Auto,
        context_length: None,
        quantize: None,
        progress: None,
    };
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            int8_activations: true,
            kv_dtype: KvDType::F16,
            mtp: false,
            mla_prefill: MlaPrefill::Auto,
            context_length: None,
            quantize: None,
            progress: None,
        }
    }
}

/// One sequence's part of a batched forward pass.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    /// The sequence's next tokens (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Positions already in the cache: the first token's position.
    pub pos0: usize,
    /// The sequence's blocks in the pool, covering `pos0 + tokens.len()`
    /// positions; the first `pos0` hold its keys and values.
    pub table: &'a [u32],
    pub logits: Logits,
    /// The sequence's state slot in the pool, for models with
    /// linear-attention layers (each sequence of a batch its own; any
    /// value for other models).
    pub state: usize,
}

/// The rows a model's KV cache holds per token and layer: (rows, values
/// per row, latent). Multi-head attention caches a key and a value row
/// per KV head (`kv_heads` of them on this rank); latent attention one
/// latent row.
fn kv_rows(cfg: &ModelConfig, kv_heads: usize) -> (usize, usize, bool) {
    match (&cfg.mla, &cfg.v4) {
        (Some(m), _) => (1, m.latent_dim(), true),
        // DeepSeek-V4's rows are its compressed entries, one K = V head.
        (None, Some(_)) => (1, cfg.head_dim, true),
        (None, None) => (kv_heads, cfg.head_dim, false),
    }
}

pub struct DecoderModel {
    cfg: ModelConfig,
    /// This rank's rows of the embedding (all of them in one process).
    embed: Tensor,
    /// `lm_head`, or the embedding again when tied: this rank's rows.
    output: LinearWeight,
    /// The vocabulary rows of `embed` and `output`.
    vocab: Range<usize>,
    /// KV heads this rank caches per layer.
    kv_heads: usize,
    /// This rank's place in a parallel run (`None`: one process).
    par: Option<Arc<Parallel>>,
    final_norm: Vec<f32>,
    layers: Vec<Layer>,
    /// DeepSeek-V3's multi-token-prediction module, when loaded; its KV
    /// lives in the pool's layer after the main ones.
    mtp: Option<MtpModule>,
    /// DeepSeek-V4's collapse of the residual streams before the final
    /// norm.
    hyper_head: Option<HyperHead>,
    /// DeepSeek-V4's compressed entries per layer (empty for others).
    entries: EntryShape,
    /// Activation buffers, reused by every forward pass so that steady-state
    /// decoding does not allocate; forward passes of one model are serial.
    scratch: Mutex<Scratch>,
    kv_dtype: KvDType,
}

/// The per-pass activations; each buffer grows to the largest batch seen.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    /// The normed rows of the output head.
    rows_n: Vec<f32>,
    /// The MTP module's input `[enorm(e); hnorm(h)]`.
    eh: Vec<f32>,
    layer: LayerScratch,
    /// The second micro-batch's, with two-batch overlap.
    second: LayerScratch,
    /// The batch's tokens, state slots, sequences (as attention rows; kept
    /// empty between passes, see [`recycle`]) and the hidden rows whose
    /// logits or states a pass returns.
    tokens: Vec<u32>,
    slots: Vec<usize>,
    seqs: Vec<SeqAttn<'static>>,
    rows: Vec<f32>,
}

/// An empty `Vec` on `v`'s allocation, for sequences of another lifetime:
/// the scratch keeps the batch's sequence list between passes, each pass's
/// borrowing that pass's block tables. (Collecting an empty `into_iter`
/// into a `Vec` of the same layout reuses its allocation; the
/// step-allocation test counts on it.)
#[allow(clippy::unnecessary_filter_map)] // it changes the items' lifetime
fn recycle<'b>(mut v: Vec<SeqAttn<'_>>) -> Vec<SeqAttn<'b>> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

/// What fails before any weight is read: multi-token prediction on a
/// model whose state cannot step back over a rejected draft, a context
/// length out of bounds (applied to `cfg` when given), a cache type that
/// cannot hold the rows (rather than at the first pool).
fn check_before_weights(cfg: &mut ModelConfig, opts: &LoadOptions) -> Result<(), ModelError> {
    if opts.mtp && cfg.mtp_layers > 0 && cfg.linear.is_some() {
        // Verifying a draft needs the state to step back over it.
        return Err(ModelError::MtpUnsupported(
            "linear-attention layers (their state cannot step back over a rejected draft)",
        ));
    }
    if let Some(n) = opts.context_length {
        // The same bounds as a checkpoint's own context.
        if n == 0 || n > 1 << 24 {
            return Err(crate::config::ConfigError::Invalid {
                key: "context_length".into(),
                why: format!("{n} tokens (1 to {} allowed)", 1 << 24),
            }
            .into());
        }
        cfg.max_context = n;
    }
    let (_, head_dim, latent) = kv_rows(cfg, 1);
    KvShape {
        n_layers: cfg.n_layers,
        n_kv_heads: 1,
        head_dim,
        latent,
        index_dim: cfg.indexer.map_or(0, |i| i.head_dim),
        dtype: opts.kv_dtype,
    }
    .check()?;
    Ok(())
}

/// Takes the MTP module's place in the model from `file`'s config (a
/// file with the module's block: llama.cpp's `--mtp` GGUF), once it is
/// the same model's: the architecture, sizes and main layers agree, and
/// for DeepSeek-V4 every attention setting but the module's own kind.
fn fit_drafter(cfg: &mut ModelConfig, file: &ModelConfig) -> Result<(), ModelError> {
    if file.mtp_layers == 0 {
        return Err(ModelError::MtpFile(
            "it declares no multi-token-prediction layers (nextn_predict_layers)".into(),
        ));
    }
    let experts = |c: &ModelConfig| {
        c.experts
            .as_ref()
            .map(|e| (e.router.n_experts, e.router.top_k, e.ff))
    };
    let differ = [
        ("architecture", cfg.arch != file.arch),
        ("hidden size", cfg.hidden != file.hidden),
        ("main layer count", cfg.n_layers != file.n_layers),
        ("head count", cfg.n_heads != file.n_heads),
        ("head size", cfg.head_dim != file.head_dim),
        ("vocabulary", cfg.vocab != file.vocab),
        ("norm epsilon", cfg.rms_eps != file.rms_eps),
        ("experts", experts(cfg) != experts(file)),
        ("latent attention", cfg.mla != file.mla),
        (
            "DeepSeek-V4 settings",
            match (&cfg.v4, &file.v4) {
                (Some(a), Some(b)) => {
                    *a != crate::config::V4Config {
                        mtp: a.mtp,
                        ..b.clone()
                    }
                }
                (a, b) => a.is_some() != b.is_some(),
            },
        ),
    ];
    if let Some((what, _)) = differ.iter().find(|(_, d)| *d) {
        return Err(ModelError::MtpFile(format!(
            "its {what} differs from the model's ({} with {} layers, file {} with {})",
            cfg.arch.name(),
            cfg.n_layers,
            file.arch.name(),
            file.n_layers
        )));
    }
    cfg.mtp_layers = file.mtp_layers;
    if let (Some(v4), Some(f)) = (&mut cfg.v4, &file.v4) {
        v4.mtp = f.mtp;
    }
    Ok(())
}

/// This rank's share of the model under `par` (the whole of it in one
/// process), once the layout is checked to fit the model.
fn rank_shard(
    cfg: &ModelConfig,
    opts: &LoadOptions,
    par: Option<&Parallel>,
) -> Result<Shard, ModelError> {
    Ok(match par {
        Some(p) => {
            p.layout
                .check_model(&ModelShape {
                    heads: cfg.n_heads,
                    kv_heads: cfg.mla.is_none().then_some(cfg.n_kv_heads),
                    experts: cfg.experts.as_ref().map(|e| e.router.n_experts),
                })
                .map_err(kvant_dist::DistError::from)?;
            if opts.mtp && cfg.mtp_layers > 0 {
                return Err(ModelError::NotParallel("multi-token prediction (--mtp)"));
            }
            // A sequence's state runs whole on every rank of its group,
            // kept in step by rank 0's copies (expert and data
            // parallelism); its heads are not split.
            if p.layout.tp > 1 {
                if cfg.linear.is_some() {
                    return Err(ModelError::NotTensorParallel(
                        "linear attention (Gated DeltaNet)",
                    ));
                }
                if cfg.v4.is_some() {
                    return Err(ModelError::NotTensorParallel(
                        "DeepSeek-V4 attention (one K = V head, its compressors and indexer)",
                    ));
                }
            }
            Shard {
                tp: p.layout.tp,
                t: p.coords.tp,
            }
        }
        None => Shard::FULL,
    })
}

/// Expert parallelism: experts over every rank, as evenly as they go
/// (`None` without it).
fn expert_placement(
    cfg: &ModelConfig,
    par: Option<&Parallel>,
) -> Result<Option<Placement>, ModelError> {
    Ok(match (par, &cfg.experts) {
        (Some(p), Some(e)) if p.layout.expert_parallel() => Some(
            Placement::contiguous(e.router.n_experts, p.layout.world)
                .map_err(kvant_dist::DistError::from)?,
        ),
        _ => None,
    })
}

/// The final hidden states (after the final norm: what the output head
/// reads) of the rows whose logits a pass returned, `[rows, hidden]`:
/// what the MTP module continues from, as in transformers and vLLM. For
/// DeepSeek-V4, the `hc_mult` residual streams before the `hc_head`
/// collapse, `[rows, hc_mult · hidden]` (what its MTP module reads; see
/// [`DecoderModel::hidden_width`]).
pub type Hidden = Vec<f32>;

/// One sequence's part of an MTP pass: its tokens `t_{q}` for `q` from
/// `slot0 + 1`, the main model's hidden states `h_{q-1}` (one row per
/// token), and its blocks (the module's input `i` goes to slot `i`).
#[derive(Clone, Copy, Debug)]
pub struct MtpStep<'a> {
    pub tokens: &'a [u32],
    pub hidden: &'a [f32],
    pub slot0: usize,
    pub table: &'a [u32],
    /// The sequence's state slot (models that keep a state per sequence,
    /// as [`SeqStep::state`]).
    pub state: usize,
}

impl DecoderModel {
    /// Loads the model, or with `par` this rank's share of it (see
    /// [`Parallel`]): its heads, columns and vocabulary rows under tensor
    /// parallelism, its experts under expert parallelism.
    ///
    /// # Errors
    /// A [`ModelError`] for a bad checkpoint, and
    /// [`kvant_dist::DistError::Layout`] when the layout does not fit the
    /// model (more tensor-parallel ranks than heads, expert parallelism
    /// without experts).
    pub fn load(
        ckpt: &Checkpoint,
        cfg: ModelConfig,
        opts: LoadOptions,
        par: Option<Arc<Parallel>>,
    ) -> Result<Self, ModelError> {
        Self::load_with_drafter(ckpt, None, cfg, opts, par)
    }

    /// [`Self::load`], with the multi-token-prediction module read from
    /// `drafter` when given (llama.cpp's converter writes DeepSeek's
    /// module to a GGUF of its own with `--mtp`: the main model's
    /// metadata, its embedding and head, and the module's block); the
    /// module is then loaded whatever [`LoadOptions::mtp`] says.
    ///
    /// # Errors
    /// Those of [`Self::load`], and [`ModelError::MtpFile`] when `drafter`
    /// holds no module or one for another model (architecture, sizes,
    /// layer count or DeepSeek-V4 attention settings that differ).
    pub fn load_with_drafter(
        ckpt: &Checkpoint,
        drafter: Option<&Checkpoint>,
        mut cfg: ModelConfig,
        mut opts: LoadOptions,
        par: Option<Arc<Parallel>>,
    ) -> Result<Self, ModelError> {
        // llama.cpp's `--mtp` output: the module and no main layers (how
        // llama.cpp tells it too).
        if cfg.mtp_layers > 0 && !ckpt.has_tensor(&ckpt.layer_names(0, cfg.arch).attn_norm) {
            return Err(ModelError::OnlyMtp);
        }
        if let Some(d) = drafter {
            fit_drafter(&mut cfg, &d.config()?)?;
            opts.mtp = true;
        }
        check_before_weights(&mut cfg, &opts)?;
        let shard = rank_shard(&cfg, &opts, par.as_deref())?;
        let g = ckpt.global_names(cfg.arch);
        let loader = |ckpt| Loader {
            ckpt,
            int8: opts.int8_activations,
            quantize: opts.quantize,
            // Hugging Face Gemma and Qwen3-Next store norm weights as offsets
            // from 1; GGUF files have the 1 added by the converter.
            norm_offset: if cfg.zero_centered_norms && matches!(ckpt, Checkpoint::Hf(_)) {
                1.0
            } else {
                0.0
            },
            shard,
        };
        let ld = loader(ckpt);
        let h = cfg.hidden;
        let vocab = shard.vocab(cfg.vocab);
        let embed = ld.quantized(ld.matrix(g.embed, cfg.vocab, h)?.row_range(vocab.clone())?)?;
        let output = if ld.has(g.output) {
            ld.weight_part(g.output, [cfg.vocab, h], Part::Rows(vocab.clone()))?
        } else if cfg.tied_embeddings || matches!(ckpt, Checkpoint::Gguf(_)) {
            ld.prepare(embed.clone())?
        } else {
            return Err(ModelError::MissingTensor(g.output.into()));
        };
        let placement = expert_placement(&cfg, par.as_deref())?;
        let expert_layout = match (&placement, &par) {
            (Some(placement), Some(p)) => ExpertLayout::Spread {
                placement,
                rank: p.rank(),
            },
            _ => ExpertLayout::Shared(shard),
        };
        let freq_factors = match g.rope_freqs {
            Some(name) if ld.has(name) => Some(ld.raw_vector(name, cfg.rope.dim / 2)?),
            _ => None,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let freq = freq_factors.as_deref();
            layers.push(Layer::load(
                &ld,
                &cfg,
                (i, ckpt.layer_names(i, cfg.arch)),
                opts.mla_prefill,
                expert_layout,
                freq,
            )?);
            if let Some(progress) = opts.progress {
                progress(i + 1, cfg.n_layers);
            }
        }
        let mtp = match (drafter, opts.mtp && cfg.mtp_layers > 0) {
            (Some(d), _) => {
                let module = MtpModule::load(&loader(d), &cfg, cfg.n_layers, opts.mla_prefill)?;
                Some(module.ok_or_else(|| {
                    ModelError::MtpFile(format!(
                        "no multi-token-prediction module in it (blk.{}.nextn.eh_proj.weight)",
                        cfg.n_layers
                    ))
                })?)
            }
            (None, true) => MtpModule::load(&ld, &cfg, cfg.n_layers, opts.mla_prefill)?,
            (None, false) => None,
        };
        let hyper_head = match &cfg.v4 {
            Some(v4) => {
                // transformers saves `model.hc_head.hc_fn`, DeepSeek
                // publishes `hc_head_fn`, llama.cpp writes `output_hc_fn`.
                let names = match (ckpt, ckpt.v4_root()) {
                    (Checkpoint::Gguf(_), _) => hyper_names(&ld, "output_hc"),
                    (_, "model.") => {
                        ["fn", "base", "scale"].map(|p| format!("model.hc_head.hc_{p}"))
                    }
                    _ => hyper_names(&ld, "hc_head"),
                };
                Some(HyperHead::load(
                    &ld,
                    names.each_ref(),
                    v4.hc,
                    h,
                    cfg.rms_eps,
                )?)
            }
            None => None,
        };
        let entries = match &cfg.v4 {
            Some(v4) => {
                let layers = cfg.n_layers + usize::from(mtp.is_some());
                EntryShape::deepseek_v4(v4, cfg.head_dim, layers)
            }
            None => EntryShape::default(),
        };
        let first_mha = layers.iter().find_map(|l| match &l.attn {
            Attention::Mha(a) => Some(a.kv_heads()),
            _ => None,
        });
        let kv_heads = match (&cfg.mla, first_mha) {
            (None, Some(k)) => k,
            (None, None) => cfg.n_kv_heads,
            (Some(_), _) => 1,
        };
        let final_norm = ld.vector(g.final_norm, h)?;
        // What the model still reads from the file (an embedding kept as
        // stored, float weights) faults back in as it is read; the rest
        // (the header, everything copied out) stops counting as resident.
        #[cfg(unix)]
        for c in std::iter::once(ckpt).chain(drafter) {
            c.release_resident_pages();
        }
        Ok(DecoderModel {
            final_norm,
            embed,
            output,
            vocab,
            kv_heads,
            par,
            layers,
            mtp,
            hyper_head,
            entries,
            cfg,
            scratch: Mutex::new(Scratch::default()),
            kv_dtype: opts.kv_dtype,
        })
    }

    /// The vocabulary rows whose logits this rank computes (all of them in
    /// one process): a forward pass returns `[rows, vocab_range().len()]`.
    pub fn vocab_range(&self) -> Range<usize> {
        self.vocab.clone()
    }

    /// Re-places every MoE layer's experts from the loads every rank
    /// routed since the last re-placement (summed over the ranks), with
    /// `redundant` extra replicas of the hottest experts per layer
    /// (EPLB). Collective under expert parallelism (every rank calls it
    /// at the same point); outputs do not change. Without expert
    /// parallelism there is nothing to place and it does nothing.
    ///
    /// # Errors
    /// A communication error, or a placement the ranks cannot hold.
    pub fn rebalance_experts(&self, redundant: usize) -> Result<(), ModelError> {
        let Some(par) = self.par.as_deref().filter(|p| p.layout.expert_parallel()) else {
            return Ok(());
        };
        for l in &self.layers {
            let Some(ep) = l.ffn.expert_parallel() else {
                continue;
            };
            // f32 sums are exact up to 2^24 assignments per expert and
            // proportional beyond: all a balance needs. Every rank gets
            // the same sums, so every rank computes the same placement.
            let mut loads: Vec<f32> = ep.take_loads().into_iter().map(|x| x as f32).collect();
            kvant_dist::CommExt::all_reduce_sum(&*par.world, &mut loads)?;
            let loads: Vec<u64> = loads.iter().map(|&x| x as u64).collect();
            let placement = Placement::balanced(&loads, par.layout.world, redundant)
                .map_err(kvant_dist::DistError::from)?;
            ep.replace(placement)?;
        }
        Ok(())
    }

    /// Each MoE layer's expert placement under expert parallelism (empty
    /// otherwise).
    pub fn expert_placements(&self) -> Vec<Placement> {
        self.layers
            .iter()
            .filter_map(|l| l.ffn.expert_parallel())
            .map(|ep| ep.placement())
            .collect()
    }

    /// This rank's place in a parallel run, if it is part of one.
    pub fn parallel(&self) -> Option<&Arc<Parallel>> {
        self.par.as_ref()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The shape of this model's KV caches.
    pub fn kv_shape(&self) -> KvShape {
        let (n_kv_heads, head_dim, latent) = kv_rows(&self.cfg, self.kv_heads);
        if self.cfg.v4.is_some() {
            return KvShape::deepseek_v4(head_dim, self.kv_dtype);
        }
        KvShape {
            n_layers: self.cfg.attention_layers() + usize::from(self.mtp.is_some()),
            n_kv_heads,
            head_dim,
            latent,
            index_dim: self.cfg.indexer.map_or(0, |i| i.head_dim),
            dtype: self.kv_dtype,
        }
    }

    /// KV bytes one token would occupy if latent attention cached each
    /// head's expanded keys and values (what the latent cache saves);
    /// equal to [`Self::kv_bytes_per_token`] for other attention.
    pub fn expanded_kv_bytes_per_token(&self) -> usize {
        match &self.cfg.mla {
            Some(m) => {
                let dt = self.kv_dtype;
                let per_head = dt.bytes_rounded_up(m.qk_dim()) + dt.bytes_rounded_up(m.v_dim);
                self.cfg.n_layers * self.cfg.n_heads * per_head
            }
            None => self.kv_bytes_per_token(),
        }
    }

    /// DeepSeek-V4's compressed entries per layer (none for others).
    pub fn entry_shape(&self) -> EntryShape {
        self.entries.clone()
    }

    /// KV bytes one block of `block_size` tokens occupies across all
    /// layers (DeepSeek-V4: the entries its windows close, at least a row
    /// per layer).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        self.kv_shape().bytes_per_token() * block_size
            + self.entries.bytes_per_block(block_size, self.kv_dtype)
    }

    /// KV bytes one token occupies across all layers (DeepSeek-V4: its
    /// share of the compressed entries).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_shape().bytes_per_token() + self.entries.bytes_per_token(self.kv_dtype)
    }

    /// KV bytes the attention of one token at position `pos` reads over
    /// all main layers: each layer's keys and values at the positions it
    /// sees (`0..=pos`, or the last `window` of them in a sliding-window
    /// layer). Under sparse attention (DeepSeek-V3.2) the indexer reads
    /// every position's key and attention only the top-k latent rows; under
    /// DeepSeek-V4's, each layer its window's rows (f32, in the state) and
    /// the compressed entries it sees (CSA: every indexer key, the top-k
    /// entries). The MTP module, which a plain decode step does not run,
    /// is left out.
    pub fn kv_bytes_read(&self, pos: usize) -> usize {
        if let Some(v4) = &self.cfg.v4 {
            return self
                .entries
                .bytes_read(v4, (pos, self.cfg.head_dim), self.kv_dtype);
        }
        let shape = self.kv_shape();
        let index_row = shape.index_bytes();
        let kv_row = shape.bytes_per_token() / shape.n_layers.max(1) - index_row;
        let attended = match self.cfg.indexer {
            Some(i) => i.topk.min(pos + 1),
            None => pos + 1,
        };
        // A linear layer reads (and writes back) its fixed-size state.
        let st = self.state_shape();
        let state_read = 4 * (st.conv + st.delta);
        self.layers
            .iter()
            .map(|l| {
                if let Attention::Linear(_) = l.attn {
                    return state_read;
                }
                let seen = match l.window {
                    Some(w) => w.min(attended),
                    None => attended,
                };
                kv_row * seen + index_row * (pos + 1)
            })
            .sum()
    }

    /// What one sequence keeps per linear-attention layer (no layers for
    /// a model without them).
    pub fn state_shape(&self) -> StateShape {
        if let Some(v4) = &self.cfg.v4 {
            let layers = self.cfg.n_layers + usize::from(self.mtp.is_some());
            return StateShape::deepseek_v4(v4, self.cfg.head_dim, layers);
        }
        let Some(lc) = &self.cfg.linear else {
            return StateShape::default();
        };
        StateShape {
            layers: lc.layers.iter().filter(|&&l| l).count(),
            conv: (lc.conv_kernel - 1) * lc.conv_dim(),
            delta: GatedDeltaNet::params(lc).state_len(),
            rewind: 0,
        }
    }

    /// Layer `layer`'s recurrent state in `cache` (a linear-attention
    /// layer): the convolution's last inputs `[K − 1, channels]` and the
    /// delta rule's state `S` `[value heads, dk, dv]` after the cache's
    /// tokens (transformers' `conv_states` and `recurrent_states`).
    ///
    /// # Errors
    /// [`ModelError::KvShape`] if the layer is not a linear one or the
    /// cache is not this model's.
    pub fn linear_state(
        &self,
        cache: &KvCache,
        layer: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let (Some(l), Some(lc)) = (self.layers.get(layer), &self.cfg.linear) else {
            return Err(ModelError::KvShape);
        };
        if !matches!(l.attn, Attention::Linear(_)) {
            return Err(ModelError::KvShape);
        }
        let st = self.state_shape();
        let (conv, delta) = cache.pool().states(l.cache).ok_or(ModelError::KvShape)?;
        let p = GatedDeltaNet::params(lc);
        let mut s = vec![0f32; p.n_v_heads * p.dk * p.dv];
        kvant_kernels::delta::materialize(&p, &delta[..st.delta], cache.len(), &mut s)?;
        Ok((conv[..st.conv].to_vec(), s))
    }

    /// A one-sequence cache able to hold `capacity` tokens (at most the
    /// context length).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache, ModelError> {
        let capacity = capacity.min(self.cfg.max_context);
        let cache = KvCache::with_states(self.kv_shape(), self.state_shape(), capacity)?;
        match self.cfg.v4 {
            Some(_) => cache.with_entries(self.entry_shape()),
            None => Ok(cache),
        }
    }

    /// A paged pool of `n_blocks` blocks of `block_size` tokens, with
    /// `slots` sequence states for a model with linear-attention layers.
    pub fn new_pool(
        &self,
        block_size: usize,
        n_blocks: usize,
        slots: usize,
    ) -> Result<KvPool, ModelError> {
        let pool = KvPool::with_states(
            self.kv_shape(),
            self.state_shape(),
            slots,
            block_size,
            n_blocks,
        )?;
        match self.cfg.v4 {
            Some(_) => pool.with_entries(self.entry_shape()),
            None => Ok(pool),
        }
    }

    /// Bytes of weights read per decoded token: every layer's matrices
    /// (for a mixture of experts, the router, `top_k` experts of average
    /// size and the shared experts) and the output matrix (the embedding
    /// contributes one row).
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self.layers.iter().map(|l| l.bytes().1).sum();
        l + self.output.byte_len()
    }

    /// Bytes of all prepared weights (every expert included).
    pub fn total_weight_bytes(&self) -> usize {
        let l: usize = self.layers.iter().map(|l| l.bytes().0).sum();
        l + self.output.byte_len()
    }

    /// Runs `tokens` (the next tokens of the sequence in `cache`) through the
    /// model, appending their keys and values to the cache.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        want: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        Ok(self.forward_hidden(tokens, cache, want)?.0)
    }

    /// [`Self::forward`], also returning hidden states as
    /// [`Self::forward_batch_hidden`] does.
    pub fn forward_hidden(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        want: Logits,
    ) -> Result<(Vec<f32>, Hidden), ModelError> {
        let step = SeqStep {
            tokens,
            pos0: cache.len(),
            table: &SINGLE_TABLE,
            logits: want,
            state: 0,
        };
        let out = self.forward_batch_hidden(cache.pool_mut(), &[step])?;
        cache.advance(tokens.len());
        Ok(out)
    }

    /// One forward pass over a ragged batch: every sequence's tokens run
    /// through the model together (one matrix product per weight for the
    /// whole batch), their keys and values are stored at their positions in
    /// `pool`, and each attends over its own history. Returns the requested
    /// logits, `[rows, vocab]`, sequences in order. A sequence's results do
    /// not depend on the rest of the batch (see the attention kernel's
    /// batch invariance), so batching never changes an output.
    pub fn forward_batch(
        &self,
        pool: &mut KvPool,
        seqs: &[SeqStep<'_>],
    ) -> Result<Vec<f32>, ModelError> {
        Ok(self.forward_batch_hidden(pool, seqs)?.0)
    }

    /// [`Self::forward_batch`], also returning hidden states after the
    /// final norm, `[rows, hidden]` (see [`Hidden`] for DeepSeek-V4):
    /// each sequence's [`Logits::hidden_rows`], in order.
    pub fn forward_batch_hidden(
        &self,
        pool: &mut KvPool,
        seqs: &[SeqStep<'_>],
    ) -> Result<(Vec<f32>, Hidden), ModelError> {
        self.forward_step(pool, seqs, None)
    }

    /// [`Self::forward_batch_hidden`] for a step of a parallel run, with or
    /// without two-batch overlap as the step's plan says (every rank must
    /// agree: each micro-batch posts its own collectives). `None` follows
    /// the run's setting.
    pub fn forward_step(
        &self,
        pool: &mut KvPool,
        seqs: &[SeqStep<'_>],
        overlap: Option<bool>,
    ) -> Result<(Vec<f32>, Hidden), ModelError> {
        let c = &self.cfg;
        let mut guard = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let s = &mut *guard;
        // Every list of the pass lives in the scratch (no allocation once
        // the buffers have grown to the batch).
        let parts = seqs.iter().map(|s| (s.tokens, s.pos0, s.table));
        let attn_seqs = self.check_batch(pool, parts, std::mem::take(&mut s.seqs))?;
        s.slots.clear();
        s.slots.extend(seqs.iter().map(|s| s.state));
        self.check_slots(pool, &s.slots)?;
        let h = c.hidden;
        let n = attn_seqs.last().map_or(0, |a| a.rows.end);
        let x = sized(&mut s.x, n * h * self.streams());
        s.tokens.clear();
        s.tokens
            .extend(seqs.iter().flat_map(|s| s.tokens.iter().copied()));
        let overlap =
            overlap.unwrap_or_else(|| self.par.as_ref().is_some_and(|p| p.two_batch_overlap));
        self.run_layers(
            pool,
            (&attn_seqs, &s.slots),
            &s.tokens,
            x,
            [&mut s.layer, &mut s.second],
            overlap,
        )?;
        let hidden_rows = seqs
            .iter()
            .zip(&attn_seqs)
            .map(|(s, a)| a.rows.end - s.logits.hidden_rows(a.rows.len())..a.rows.end);
        let mut rows = std::mem::take(&mut s.rows);
        gather(x, h * self.streams(), hidden_rows, &mut rows);
        // DeepSeek-V4: the streams are the hidden state; the rows that
        // leave the model collapse into one (`hc_head`) before the norm.
        let mut streams = None;
        if let Some(head) = &self.hyper_head {
            let k = rows.len() / (h * self.streams());
            streams = Some(rows.clone());
            let (q8, hs) = s.layer.hyper_parts();
            head.collapse(&mut rows, k, q8, hs)?;
            rows.truncate(k * h);
        }
        let out = if !seqs.iter().any(|s| s.logits.wants_hidden()) {
            self.head(&rows, &self.final_norm, &self.output, s)
                .map(|logits| {
                    (
                        logits,
                        streams.unwrap_or_else(|| s.rows_n[..rows.len()].to_vec()),
                    )
                })
        } else {
            let hidden = self.norm_rows(&rows, &self.final_norm, s).to_vec();
            // Within the gathered rows, the ones whose logits are wanted.
            let mut at = 0;
            let logit_rows = seqs.iter().zip(&attn_seqs).map(|(sq, a)| {
                let len = sq.logits.hidden_rows(a.rows.len());
                at += len;
                at - sq.logits.rows(a.rows.len())..at
            });
            gather(&hidden, h, logit_rows, &mut rows);
            self.project(&rows, &self.output, s)
                .map(|logits| (logits, streams.unwrap_or(hidden)))
        };
        s.rows = rows;
        s.seqs = recycle(attn_seqs);
        out
    }

    /// [`Self::mtp_forward`] for the sequence in `cache`: `tokens` are its
    /// tokens from position `slot0 + 1`, `hidden` the main model's hidden
    /// states one position earlier. Returns the last row's logits.
    pub fn mtp_draft(
        &self,
        tokens: &[u32],
        hidden: &[f32],
        slot0: usize,
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, ModelError> {
        let step = MtpStep {
            tokens,
            hidden,
            slot0,
            table: &SINGLE_TABLE,
            state: 0,
        };
        self.mtp_forward(cache.pool_mut(), &[step])
    }

    /// Values per row of [`Hidden`]: `hidden`, times `hc_mult` for
    /// DeepSeek-V4.
    pub fn hidden_width(&self) -> usize {
        self.cfg.hidden * self.streams()
    }

    /// Whether the multi-token-prediction module is loaded.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Runs the MTP module over each step's tokens (see [`MtpStep`]),
    /// storing its keys in the pool's last layer, and returns each step's
    /// last-row logits: the predicted token after the step's last token.
    pub fn mtp_forward(
        &self,
        pool: &mut KvPool,
        steps: &[MtpStep<'_>],
    ) -> Result<Vec<f32>, ModelError> {
        let Some(mtp) = &self.mtp else {
            return Err(ModelError::NoMtp);
        };
        let c = &self.cfg;
        let (h, m) = (c.hidden, self.streams());
        let mut guard = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let s = &mut *guard;
        let parts = steps.iter().map(|s| (s.tokens, s.slot0, s.table));
        let attn_seqs = self.check_batch(pool, parts, std::mem::take(&mut s.seqs))?;
        s.slots.clear();
        s.slots.extend(steps.iter().map(|s| s.state));
        self.check_slots(pool, &s.slots)?;
        let n = attn_seqs.last().map_or(0, |a| a.rows.end);
        if let Some(s) = steps
            .iter()
            .find(|s| s.hidden.len() != s.tokens.len() * h * m)
        {
            return Err(ModelError::MtpHidden {
                tokens: s.tokens.len(),
                hidden: h * m,
                values: s.hidden.len(),
            });
        }
        let x = sized(&mut s.x, n * h * m);
        self.embed_rows(steps.iter().flat_map(|s| s.tokens.iter()), x)?;
        let hidden = steps.iter().flat_map(|s| s.hidden.chunks_exact(h));
        let q8 = &mut s.layer.q8;
        match &mtp.mix {
            // Row `t·m + k`: `[enorm(e_t); hnorm(h_{t,k})]`.
            MtpMix::Fused(eh_proj) => {
                let eh = sized(&mut s.eh, n * m * 2 * h);
                for (i, (dst, hs)) in eh.chunks_exact_mut(2 * h).zip(hidden).enumerate() {
                    let (de, dh) = dst.split_at_mut(h);
                    rms_norm(&x[i / m * h..(i / m + 1) * h], &mtp.enorm, c.rms_eps, de);
                    rms_norm(hs, &mtp.hnorm, c.rms_eps, dh);
                }
                eh_proj.forward(&LinearInput::new(eh, n * m, q8, &[eh_proj])?, x)?;
            }
            MtpMix::Split { e, h: h_proj } => {
                let (en, hn) = sized(&mut s.eh, n * h * (1 + m)).split_at_mut(n * h);
                rms_norm(&x[..n * h], &mtp.enorm, c.rms_eps, en);
                for (dst, hs) in hn.chunks_exact_mut(h).zip(hidden) {
                    rms_norm(hs, &mtp.hnorm, c.rms_eps, dst);
                }
                let ep = sized(&mut s.rows_n, n * h);
                e.forward(&LinearInput::new(en, n, q8, &[e])?, ep)?;
                h_proj.forward(&LinearInput::new(hn, n * m, q8, &[h_proj])?, x)?;
                for (row, ep) in x.chunks_exact_mut(h * m).zip(ep.chunks_exact(h)) {
                    for stream in row.chunks_exact_mut(h) {
                        stream.iter_mut().zip(ep).for_each(|(v, &a)| *v += a);
                    }
                }
            }
        }
        let pool = RefCell::new(pool);
        s.tokens.clear();
        s.tokens
            .extend(steps.iter().flat_map(|s| s.tokens.iter().copied()));
        let at = Place {
            pool: &pool,
            tokens: &s.tokens,
            index: c.n_layers,
            cache: c.attention_layers(),
            seqs: &attn_seqs,
            slots: &s.slots,
            // V3's input `i` at its token's position, V4's at its hidden
            // state's (see the module docs of `mtp`).
            rope_offset: usize::from(c.v4.is_none()),
        };
        {
            let layer = std::pin::pin!(mtp.layer.forward(c, at, x, n, &mut s.layer, &Net::LOCAL));
            drive(&mut [layer], None)?;
        }
        let last = attn_seqs.iter().map(|a| a.rows.end - 1..a.rows.end);
        let mut rows = std::mem::take(&mut s.rows);
        gather(x, h * m, last, &mut rows);
        if let Some(head) = &mtp.hyper_head {
            let (q8, hs) = s.layer.hyper_parts();
            head.collapse(&mut rows, steps.len(), q8, hs)?;
            rows.truncate(steps.len() * h);
        }
        let head = mtp.head.as_ref().unwrap_or(&self.output);
        let logits = self.head(&rows, &mtp.head_norm, head, s);
        s.rows = rows;
        s.seqs = recycle(attn_seqs);
        logits
    }

    /// Checks a batch (non-empty token lists in the vocabulary, block
    /// tables covering them) and lays its sequences out as attention rows.
    /// The list is built on `spare`'s allocation (the scratch's; give it
    /// back with [`recycle`]).
    fn check_batch<'a, 't>(
        &self,
        pool: &KvPool,
        parts: impl Iterator<Item = (&'a [u32], usize, &'t [u32])> + Clone,
        spare: Vec<SeqAttn<'_>>,
    ) -> Result<Vec<SeqAttn<'t>>, ModelError> {
        let vocab = self.cfg.vocab;
        // A rank of a parallel run may have nothing to compute (a
        // data-parallel group without requests): it still joins the
        // collectives of every layer.
        let none = parts.clone().next().is_none();
        if (none && self.par.is_none()) || parts.clone().any(|p| p.0.is_empty()) {
            return Err(ModelError::EmptyInput);
        }
        if pool.shape() != self.kv_shape() || !pool.has_entries(&self.entries) {
            return Err(ModelError::KvShape);
        }
        let mut out = recycle(spare);
        let mut row = 0;
        for (tokens, pos0, table) in parts {
            pool.check_table(table, pos0 + tokens.len())?;
            if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(ModelError::TokenOutOfRange { id, vocab });
            }
            out.push(SeqAttn {
                rows: row..row + tokens.len(),
                pos0,
                table,
            });
            row += tokens.len();
        }
        Ok(out)
    }

    /// Checks each sequence's state slot (models with linear layers only):
    /// in the pool, and no slot twice in a batch.
    fn check_slots(&self, pool: &KvPool, slots: &[usize]) -> Result<(), ModelError> {
        if pool.state_shape() != self.state_shape() {
            return Err(ModelError::KvShape);
        }
        if self.cfg.linear.is_none() && self.cfg.v4.is_none() {
            return Ok(());
        }
        // Pairwise: a batch holds at most a few hundred sequences, and a
        // set would allocate every pass.
        let taken = |i: usize| slots[..i].contains(&slots[i]);
        match (0..slots.len()).find(|&i| slots[i] >= pool.state_slots() || taken(i)) {
            Some(i) => Err(ModelError::StateSlot { slot: slots[i] }),
            None => Ok(()),
        }
    }

    /// The embeddings of `tokens` (checked in range), one row each: under
    /// tensor parallelism, the rows of this rank's vocabulary (others zero;
    /// the group's sum is the embedding).
    fn embed_rows<'t>(
        &self,
        tokens: impl Iterator<Item = &'t u32>,
        x: &mut [f32],
    ) -> Result<(), ModelError> {
        let h = self.cfg.hidden;
        for (row, &t) in x.chunks_exact_mut(h).zip(tokens) {
            let t = t as usize;
            if !self.vocab.contains(&t) {
                row.fill(0.0);
                continue;
            }
            let bytes = self.embed.row_bytes(t - self.vocab.start);
            dequantize_row(self.embed.dtype(), bytes, row)?;
            if self.cfg.gemma {
                let s = (h as f32).sqrt();
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        Ok(())
    }

    /// Embeds `tokens` into the rows of `x` and runs every layer over them:
    /// one micro-batch, or with two-batch overlap the first and second
    /// halves of the rows as two, each communicating while the other
    /// computes (a sequence cut in two attends with its first part's keys,
    /// which the first micro-batch always stores first).
    fn run_layers(
        &self,
        pool: &mut KvPool,
        (seqs, slots): (&[SeqAttn<'_>], &[usize]),
        tokens: &[u32],
        x: &mut [f32],
        [first, second]: [&mut LayerScratch; 2],
        overlap: bool,
    ) -> Result<(), ModelError> {
        let h = self.cfg.hidden;
        let par = self.par.as_deref();
        let overlap = overlap && par.is_some();
        let cut = match overlap {
            true => tokens.len().div_ceil(2),
            false => tokens.len(),
        };
        // Without overlap the batch is one micro-batch, as it is.
        let split = overlap.then(|| split_seqs(seqs, slots, cut));
        let ((seqs_a, slots_a), (seqs_b, slots_b)) = match &split {
            Some(((sa, la), (sb, lb))) => ((&sa[..], &la[..]), (&sb[..], &lb[..])),
            None => ((seqs, slots), (&[][..], &[][..])),
        };
        let (xa, xb) = x.split_at_mut(cut * h * self.streams());
        let pool = RefCell::new(pool);
        let order = Order::default();
        let net = |i: usize| Net {
            par: par.map(|p| (p, p.streams(i))),
            order: overlap.then_some((i, &order)),
        };
        let (net_a, net_b) = (net(0), net(1));
        let exposed = par.map(Parallel::exposed_counter);
        let a = (seqs_a, slots_a);
        let a = std::pin::pin!(self.micro_batch(&pool, a, &tokens[..cut], xa, first, &net_a));
        if !overlap {
            let mut tasks: [Task<'_, '_>; 1] = [a];
            return drive(&mut tasks, exposed);
        }
        let b = (seqs_b, slots_b);
        let b = std::pin::pin!(self.micro_batch(&pool, b, &tokens[cut..], xb, second, &net_b));
        let mut tasks: [Task<'_, '_>; 2] = [a, b];
        drive(&mut tasks, exposed)
    }

    /// One micro-batch's pass through the embedding and the layers.
    async fn micro_batch(
        &self,
        pool: &RefCell<&mut KvPool>,
        (seqs, slots): (&[SeqAttn<'_>], &[usize]),
        tokens: &[u32],
        x: &mut [f32],
        s: &mut LayerScratch,
        net: &Net<'_>,
    ) -> Result<(), ModelError> {
        let n = tokens.len();
        self.embed_rows(tokens.iter(), &mut x[..n * self.cfg.hidden])?;
        if self.vocab.len() < self.cfg.vocab {
            net.tp_sum(x).await?;
        }
        self.spread_streams(x, n);
        for (index, l) in self.layers.iter().enumerate() {
            let at = Place {
                pool,
                tokens,
                index,
                cache: l.cache,
                seqs,
                slots,
                rope_offset: 0,
            };
            l.forward(&self.cfg, at, x, tokens.len(), s, net).await?;
        }
        Ok(())
    }

    /// Residual streams per token: DeepSeek-V4's `hc_mult`, else 1.
    fn streams(&self) -> usize {
        self.cfg.v4.as_ref().map_or(1, |v| v.hc.mult)
    }

    /// Copies each of the first `n` rows of `x` (`[n, hidden]`, the
    /// embeddings) into every stream of its token (`[n, streams·hidden]`),
    /// last row first so that no row is overwritten before it is read.
    fn spread_streams(&self, x: &mut [f32], n: usize) {
        let (h, m) = (self.cfg.hidden, self.streams());
        if m == 1 {
            return;
        }
        for t in (0..n).rev() {
            for k in (0..m).rev() {
                x.copy_within(t * h..(t + 1) * h, (t * m + k) * h);
            }
        }
    }

    /// `head(norm(rows))`: logits `[rows, vocab]` of hidden rows (the
    /// normed rows stay in `s.rows_n`).
    fn head(
        &self,
        rows: &[f32],
        norm: &[f32],
        head: &LinearWeight,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        self.norm_rows(rows, norm, s);
        let normed = std::mem::take(&mut s.rows_n);
        let logits = self.project(&normed[..rows.len()], head, s);
        s.rows_n = normed;
        logits
    }

    /// `norm(rows)`, in `s.rows_n`.
    fn norm_rows<'s>(&self, rows: &[f32], norm: &[f32], s: &'s mut Scratch) -> &'s [f32] {
        let xn = sized(&mut s.rows_n, rows.len());
        rms_norm(rows, norm, self.cfg.rms_eps, xn);
        xn
    }

    /// `head(rows)`: logits `[rows, vocab]` of normed rows.
    fn project(
        &self,
        rows: &[f32],
        head: &LinearWeight,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let m = rows.len() / self.cfg.hidden;
        if m == 0 {
            return Ok(Vec::new());
        }
        // This rank's vocabulary rows (all of them in one process).
        let mut logits = vec![0f32; m * head.rows()];
        let input = LinearInput::new(rows, m, &mut s.layer.q8, &[head])?;
        head.forward(&input, &mut logits)?;
        Ok(logits)
    }
}

/// `seqs` (rows of one batch) cut at row `cut` into two batches whose rows
/// each start at 0; a sequence that spans the cut continues in the second
/// at the position after its first part.
/// Their state slots go with them.
#[allow(clippy::type_complexity)] // two (sequences, slots) halves
fn split_seqs<'t>(
    seqs: &[SeqAttn<'t>],
    slots: &[usize],
    cut: usize,
) -> (
    (Vec<SeqAttn<'t>>, Vec<usize>),
    (Vec<SeqAttn<'t>>, Vec<usize>),
) {
    let (mut a, mut b) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
    for (sq, &slot) in seqs.iter().zip(slots) {
        if sq.rows.start < cut {
            a.0.push(SeqAttn {
                rows: sq.rows.start..sq.rows.end.min(cut),
                ..sq.clone()
            });
            a.1.push(slot);
        }
        if sq.rows.end > cut {
            let start = sq.rows.start.max(cut);
            b.0.push(SeqAttn {
                rows: start - cut..sq.rows.end - cut,
                pos0: sq.pos0 + (start - sq.rows.start),
                table: sq.table,
            });
            b.1.push(slot);
        }
    }
    (a, b)
}

/// The rows `ranges` of `x` (`[_, h]`), concatenated into `out`.
fn gather(
    x: &[f32],
    h: usize,
    ranges: impl Iterator<Item = std::ops::Range<usize>>,
    out: &mut Vec<f32>,
) {
    out.clear();
    for r in ranges {
        out.extend_from_slice(&x[r.start * h..r.end * h]);
    }
}
