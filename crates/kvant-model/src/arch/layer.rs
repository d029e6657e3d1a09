//! One decoder layer: pre-norm attention and feed-forward blocks with
//! residual adds (and Gemma's post-norms), whatever kind each block is.

use super::csa::{CompressedAttention, CsaScratch};
use super::ctx::{LayerCtx, Place, StateCtx, Step};
use super::ffn::{DenseFfn, FfnScratch};
use super::gdn::{GatedDeltaNet, GdnScratch};
use super::loader::Loader;
use super::mha::{MhaAttention, MhaScratch};
use super::mhc::{HyperConnection, HyperScratch};
use super::mla::{MlaAttention, MlaScratch};
use super::mla_expand::MlaPrefill;
use super::moe::{ExpertLayout, ExpertParallel, MoeFfn, MoeLayerScratch};
use super::parallel::Net;
use super::sized;
use crate::checkpoint::LayerNames;
use crate::config::{ExpertsConfig, ModelConfig};
use crate::ModelError;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::norm::{add_rms_norm, rms_norm};

pub(crate) enum Attention {
    Mha(MhaAttention),
    Mla(MlaAttention),
    /// Linear attention (Gated DeltaNet): a fixed-size state per
    /// sequence instead of cached rows per token.
    Linear(Box<GatedDeltaNet>),
    /// DeepSeek-V4's sliding-window, CSA or HCA attention.
    Compressed(Box<CompressedAttention>),
}

pub(crate) enum Ffn {
    Dense(DenseFfn),
    Moe(Box<MoeFfn>),
}

impl Ffn {
    /// The feed-forward of the layer named `n`: experts laid out by their
    /// [`ExpertLayout`] when `moe` is given, else the dense FFN of
    /// `cfg.intermediate`.
    pub fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        n: &LayerNames,
        moe: Option<(&ExpertsConfig, ExpertLayout<'_>)>,
    ) -> Result<Self, ModelError> {
        Ok(match moe {
            Some((e, layout)) => Ffn::Moe(Box::new(MoeFfn::load(ld, cfg, e, &n.prefix, layout)?)),
            None => Ffn::Dense(DenseFfn::load(
                ld,
                [&n.gate, &n.up, &n.down],
                cfg.hidden,
                cfg.intermediate,
                ld.shard,
            )?),
        })
    }

    /// The experts' placement, for a MoE layer under expert parallelism.
    pub fn expert_parallel(&self) -> Option<&ExpertParallel> {
        match self {
            Ffn::Moe(m) => m.expert_parallel(),
            Ffn::Dense(_) => None,
        }
    }
}

pub(crate) struct Layer {
    pub attn_norm: Vec<f32>,
    pub attn: Attention,
    /// Gemma's norm on the attention output before the residual add.
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    pub post_ffn_norm: Option<Vec<f32>>,
    pub inv_freq: Vec<f32>,
    pub window: Option<usize>,
    /// The layer's index in what the pool holds for its kind: among the
    /// layers with cached rows (attention) or with states (linear; every
    /// DeepSeek-V4 layer has a state).
    pub cache: usize,
    /// DeepSeek-V4's hyper-connections before the attention and before
    /// the feed-forward: the residual stream is `hc_mult` streams.
    pub hyper: Option<Box<[HyperConnection; 2]>>,
}

/// Every layer's activations, reused across layers and passes.
#[derive(Default)]
pub(crate) struct LayerScratch {
    xn: Vec<f32>,
    proj: Vec<f32>,
    mha: MhaScratch,
    mla: MlaScratch,
    gdn: GdnScratch,
    csa: CsaScratch,
    hyper: HyperScratch,
    collapsed: Vec<f32>,
    ffn: FfnScratch,
    moe: MoeLayerScratch,
    pub q8: Q8Activations,
}

impl LayerScratch {
    /// The scratch the final hyper-connection collapse reuses.
    pub fn hyper_parts(&mut self) -> (&mut Q8Activations, &mut HyperScratch) {
        (&mut self.q8, &mut self.hyper)
    }
}

impl Layer {
    /// Layer `i`, its tensors named by `n`: its attention (multi-head, latent
    /// or linear), its feed-forward (dense or experts, laid out by `experts`),
    /// its norms and its rotary frequencies (scaled by the checkpoint's
    /// `freq_factors`). DeepSeek-V4's MTP module loads its block so, as
    /// layer `n_layers`.
    pub(super) fn load(
        ld: &Loader<'_>,
        cfg: &ModelConfig,
        (i, n): (usize, LayerNames),
        mla_prefill: MlaPrefill,
        experts: ExpertLayout<'_>,
        freq_factors: Option<&[f32]>,
    ) -> Result<Self, ModelError> {
        let h = cfg.hidden;
        let gemma_norm = |name: &str| match cfg.gemma {
            true => ld.vector(name, h).map(Some),
            false => Ok(None),
        };
        let attn = match (&cfg.mla, &cfg.linear) {
            _ if cfg.v4.is_some() => {
                let v4 = cfg.v4.as_ref().ok_or(ModelError::KvShape)?;
                Attention::Compressed(Box::new(CompressedAttention::load(
                    ld,
                    cfg,
                    v4,
                    (i, &n.prefix),
                )?))
            }
            (_, Some(lc)) if lc.is_linear(i) => {
                Attention::Linear(Box::new(GatedDeltaNet::load(ld, cfg, lc, &n.prefix)?))
            }
            (Some(m), _) => Attention::Mla(MlaAttention::load(ld, cfg, m, &n.prefix, mla_prefill)?),
            (None, _) => Attention::Mha(MhaAttention::load(ld, cfg, &n)?),
        };
        // Attention layers index the pool's rows, linear layers its states.
        let cache = (0..i)
            .filter(|&j| cfg.is_linear(j) == cfg.is_linear(i))
            .count();
        // Every DeepSeek-V4 block routes to experts, the MTP module's too.
        let v4_mtp = cfg.v4.is_some() && i >= cfg.n_layers;
        let moe = cfg.experts.as_ref().filter(|e| e.is_moe(i) || v4_mtp);
        let ffn = Ffn::load(ld, cfg, &n, moe.map(|e| (e, experts)))?;
        if let Some(v4) = &cfg.v4 {
            // Hash-routed exactly where the config says so.
            let hashed = matches!(&ffn, Ffn::Moe(m) if m.routes_by_table());
            if hashed != v4.hash_layers.get(i).copied().unwrap_or(false) {
                return Err(ModelError::BadTensor {
                    name: format!("{}ffn.gate.tid2eid", n.prefix),
                    why: format!(
                        "{} in layer {i}, which mlp_layer_types says is {}",
                        if hashed { "a table" } else { "no table" },
                        if hashed {
                            "routed by score"
                        } else {
                            "hash-routed"
                        }
                    ),
                });
            }
        }
        Ok(Layer {
            attn_norm: ld.vector(&n.attn_norm, h)?,
            attn,
            post_attn_norm: gemma_norm(&n.post_attn_norm)?,
            ffn_norm: ld.vector(&n.ffn_norm, h)?,
            ffn,
            post_ffn_norm: gemma_norm(&n.post_ffn_norm)?,
            inv_freq: cfg.inv_freq(i, freq_factors),
            window: if cfg.is_sliding(i) {
                cfg.sliding_window
            } else {
                None
            },
            cache,
            hyper: match &cfg.v4 {
                Some(v4) => Some(Box::new([
                    HyperConnection::load(
                        ld,
                        &format!("{}hc_attn", n.prefix),
                        v4.hc,
                        h,
                        cfg.rms_eps,
                    )?,
                    HyperConnection::load(
                        ld,
                        &format!("{}hc_ffn", n.prefix),
                        v4.hc,
                        h,
                        cfg.rms_eps,
                    )?,
                ])),
                None => None,
            },
        })
    }

    /// Bytes of every weight, and of what one decoded token reads (a MoE
    /// layer reads only its router, `top_k` experts and shared experts).
    pub fn bytes(&self) -> (usize, usize) {
        let attn: usize = match &self.attn {
            Attention::Mha(a) => a.weights().iter().map(|w| w.byte_len()).sum(),
            Attention::Mla(a) => a.byte_len(),
            Attention::Linear(a) => a.byte_len(),
            Attention::Compressed(a) => a.byte_len(),
        };
        let hyper: usize = self
            .hyper
            .iter()
            .flat_map(|h| h.iter())
            .map(HyperConnection::byte_len)
            .sum();
        let (all, read) = match &self.ffn {
            Ffn::Dense(f) => (f.byte_len(), f.byte_len()),
            Ffn::Moe(m) => m.bytes(),
        };
        (attn + hyper + all, attn + hyper + read)
    }

    /// Runs the layer on the residual stream `x` (`[n, hidden]`) in place.
    /// Under tensor parallelism the attention's and the feed-forward's
    /// outputs are this rank's shares, summed over the group before the
    /// residual add (and Gemma's post-norms, which need the whole sum).
    pub async fn forward(
        &self,
        c: &ModelConfig,
        at: Place<'_, '_, '_>,
        x: &mut [f32],
        n: usize,
        s: &mut LayerScratch,
        net: &Net<'_>,
    ) -> Result<(), ModelError> {
        if let Some(hyper) = &self.hyper {
            return self.forward_hyper(c, at, (x, n), s, hyper, net).await;
        }
        let h = c.hidden;
        let LayerScratch {
            xn,
            proj,
            mha,
            mla,
            gdn,
            ffn,
            moe,
            q8,
            ..
        } = s;
        let xn = sized(xn, n * h);
        let proj = sized(proj, n * h);
        rms_norm(x, &self.attn_norm, c.rms_eps, xn);
        net.before_attention(at.index).await;
        if n > 0 {
            let mut pool = at.pool.borrow_mut();
            let ctx = LayerCtx {
                pool: &mut pool,
                index: at.cache,
                seqs: at.seqs,
                rope_offset: at.rope_offset,
            };
            match &self.attn {
                Attention::Mha(a) => {
                    let rope = (self.inv_freq.as_slice(), self.window);
                    let step = Step {
                        xn,
                        n,
                        q8,
                        s: mha,
                        out: proj,
                    };
                    a.forward(c, rope, ctx, step)?
                }
                Attention::Mla(a) => {
                    let m = c.mla.as_ref().ok_or(ModelError::KvShape)?;
                    let step = Step {
                        xn,
                        n,
                        q8,
                        s: mla,
                        out: proj,
                    };
                    a.forward(c, m, &self.inv_freq, ctx, step)?
                }
                Attention::Linear(a) => {
                    let ctx = StateCtx {
                        pool: ctx.pool,
                        index: at.cache,
                        seqs: at.seqs,
                        slots: at.slots,
                    };
                    let step = Step {
                        xn,
                        n,
                        q8,
                        s: gdn,
                        out: proj,
                    };
                    a.forward(c, ctx, step)?
                }
                // Loaded only with hyper-connections (forward_hyper).
                Attention::Compressed(_) => return Err(ModelError::KvShape),
            }
        }
        net.after_attention(at.index);
        net.tp_sum(proj).await?;
        let (post, next) = (self.post_attn_norm.as_deref(), &self.ffn_norm[..]);
        add_rms_norm(x, proj, h, post, Some((next, &mut *xn)), c.rms_eps);
        match &self.ffn {
            Ffn::Dense(f) => {
                if n > 0 {
                    let step = Step {
                        xn,
                        n,
                        q8,
                        s: ffn,
                        out: proj,
                    };
                    f.forward(c.activation, step)?;
                }
                net.tp_sum(proj).await?;
            }
            Ffn::Moe(m) => {
                let step = Step {
                    xn,
                    n,
                    q8,
                    s: moe,
                    out: proj,
                };
                m.forward(c.activation, at.tokens, step, net).await?
            }
        }
        add_rms_norm(x, proj, h, self.post_ffn_norm.as_deref(), None, c.rms_eps);
        Ok(())
    }

    /// The layer under hyper-connections (DeepSeek-V4): `x` holds
    /// `hc_mult` streams per row (`[n, hc_mult·hidden]`); each block reads
    /// their collapse and its output is mixed back in (see `mhc`).
    async fn forward_hyper(
        &self,
        c: &ModelConfig,
        at: Place<'_, '_, '_>,
        (x, n): (&mut [f32], usize),
        s: &mut LayerScratch,
        [before_attn, before_ffn]: &[HyperConnection; 2],
        net: &Net<'_>,
    ) -> Result<(), ModelError> {
        let h = c.hidden;
        let LayerScratch {
            xn,
            proj,
            csa,
            hyper,
            collapsed,
            moe,
            q8,
            ..
        } = s;
        let (xn, proj) = (sized(xn, n * h), sized(proj, n * h));
        let collapsed = sized(collapsed, n * h);
        let Attention::Compressed(a) = &self.attn else {
            return Err(ModelError::KvShape);
        };
        // With two-batch overlap, a sequence cut in two: its second part
        // reads the window rows and compressor tails the first part wrote.
        net.before_attention(at.index).await;
        if n > 0 {
            before_attn.pre(x, n, q8, hyper, collapsed)?;
            rms_norm(collapsed, &self.attn_norm, c.rms_eps, xn);
            let mut pool = at.pool.borrow_mut();
            let ctx = StateCtx {
                pool: &mut pool,
                index: at.cache,
                seqs: at.seqs,
                slots: at.slots,
            };
            let step = Step {
                xn,
                n,
                q8,
                s: csa,
                out: proj,
            };
            a.forward(ctx, step)?;
            before_attn.post(x, proj, n, hyper);
        }
        net.after_attention(at.index);
        if n > 0 {
            before_ffn.pre(x, n, q8, hyper, collapsed)?;
            rms_norm(collapsed, &self.ffn_norm, c.rms_eps, xn);
        }
        let Ffn::Moe(m) = &self.ffn else {
            return Err(ModelError::KvShape);
        };
        let step = Step {
            xn,
            n,
            q8,
            s: moe,
            out: proj,
        };
        m.forward(c.activation, at.tokens, step, net).await?;
        if n > 0 {
            before_ffn.post(x, proj, n, hyper);
        }
        Ok(())
    }
}
