//! One decoder layer: pre-norm attention and feed-forward blocks with
//! residual adds (and Gemma's post-norms), whatever kind each block is.

use super::ctx::{LayerCtx, Place, StateCtx, Step};
use super::ffn::{DenseFfn, FfnScratch};
use super::gdn::{GatedDeltaNet, GdnScratch};
use super::loader::Loader;
use super::mha::{MhaAttention, MhaScratch};
use super::mla::{MlaAttention, MlaScratch};
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
    /// layers with cached rows (attention) or with states (linear).
    pub cache: usize,
}

/// Every layer's activations, reused across layers and passes.
#[derive(Default)]
pub(crate) struct LayerScratch {
    xn: Vec<f32>,
    proj: Vec<f32>,
    mha: MhaScratch,
    mla: MlaScratch,
    gdn: GdnScratch,
    ffn: FfnScratch,
    moe: MoeLayerScratch,
    pub q8: Q8Activations,
}

impl Layer {
    /// Bytes of every weight, and of what one decoded token reads (a MoE
    /// layer reads only its router, `top_k` experts and shared experts).
    pub fn bytes(&self) -> (usize, usize) {
        let attn: usize = match &self.attn {
            Attention::Mha(a) => a.weights().iter().map(|w| w.byte_len()).sum(),
            Attention::Mla(a) => a.byte_len(),
            Attention::Linear(a) => a.byte_len(),
        };
        let (all, read) = match &self.ffn {
            Ffn::Dense(f) => (f.byte_len(), f.byte_len()),
            Ffn::Moe(m) => m.bytes(),
        };
        (attn + all, attn + read)
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
                m.forward(c.activation, step, net).await?
            }
        }
        add_rms_norm(x, proj, h, self.post_ffn_norm.as_deref(), None, c.rms_eps);
        Ok(())
    }
}
