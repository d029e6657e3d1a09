//! The Llama-family decoder: weights as stored in the checkpoint and the
//! forward pass over a ragged batch (several sequences, each contributing
//! a prefill chunk or one decode token) against a paged KV pool.
//!
//! Switches: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3),
//! tied embeddings, GQA/MQA, sliding windows (Mistral, Gemma 3 local layers),
//! Gemma's embedding scale, sandwich norms and GELU.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::kv::{KvCache, KvDType, KvPool, KvShape, SINGLE_TABLE};
use crate::ModelError;
use kvant_core::Tensor;
use kvant_kernels::activation::gated;
use kvant_kernels::attention::{AttnParams, SeqAttn};
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};
use kvant_kernels::norm::{rms_norm, rms_norm_inplace};
use kvant_kernels::quant::dequantize_row;
use kvant_kernels::rope::rope_inplace;
use std::sync::Mutex;

/// A projection: a weight `[out, in]` prepared for its kernel and an optional bias.
struct Linear {
    weight: LinearWeight,
    bias: Option<Vec<f32>>,
}

impl Linear {
    fn forward(&self, x: &LinearInput<'_>, y: &mut [f32]) -> Result<(), ModelError> {
        self.weight.forward(x, y)?;
        self.add_bias(y);
        Ok(())
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(v, bv)| *v += bv);
            }
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// Gemma's norm on the attention output before the residual add.
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    post_ffn_norm: Option<Vec<f32>>,
    gate: LinearWeight,
    up: LinearWeight,
    down: LinearWeight,
    inv_freq: Vec<f32>,
    window: Option<usize>,
}

impl Layer {
    fn weights(&self) -> [&LinearWeight; 7] {
        [
            &self.q.weight,
            &self.k.weight,
            &self.v.weight,
            &self.o.weight,
            &self.gate,
            &self.up,
            &self.down,
        ]
    }
}

/// Which positions' logits a forward pass returns for a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that does not end its prompt).
    None,
    /// Only the last token's (generation).
    Last,
    /// Every token's, `[n_tokens, vocab]` (perplexity, reference checks).
    All,
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
}

impl LoadOptions {
    /// Every activation and cached key/value in f32: results closest to an
    /// f32 reference (the correctness tests' mode), at a cost in speed.
    pub const F32: LoadOptions = LoadOptions {
        int8_activations: false,
        kv_dtype: KvDType::F32,
    };
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            int8_activations: true,
            kv_dtype: KvDType::F16,
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
}

pub struct LlamaModel {
    cfg: ModelConfig,
    embed: Tensor,
    /// `lm_head`, or the embedding again when tied.
    output: LinearWeight,
    final_norm: Vec<f32>,
    layers: Vec<Layer>,
    /// Activation buffers, reused by every forward pass so that steady-state
    /// decoding does not allocate; forward passes of one model are serial.
    scratch: Mutex<Scratch>,
    kv_dtype: KvDType,
}

/// The per-pass activations; each buffer grows to the largest batch seen.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    q8: Q8Activations,
}

/// `buf` resized to `len` (contents unspecified: every user overwrites it).
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..len]
}

impl LlamaModel {
    pub fn load(
        ckpt: &Checkpoint,
        cfg: ModelConfig,
        opts: LoadOptions,
    ) -> Result<Self, ModelError> {
        let g = ckpt.global_names();
        // Hugging Face Gemma stores norm weights as offsets from 1; GGUF files
        // have the 1 added by the converter.
        let norm_offset = if cfg.gemma && matches!(ckpt, Checkpoint::Hf(_)) {
            1.0
        } else {
            0.0
        };
        let vector = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let t = ckpt.tensor(name)?;
            to_f32_vec(&t, name, len, norm_offset)
        };
        let opt_vector = |name: &str, len: usize| -> Result<Option<Vec<f32>>, ModelError> {
            if ckpt.has_tensor(name) {
                vector(name, len).map(Some)
            } else {
                Ok(None)
            }
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<Tensor, ModelError> {
            let t = ckpt.tensor(name)?;
            check_shape(&t, name, &[rows, cols])?;
            Ok(t)
        };
        let weight = |name: &str, rows: usize, cols: usize| -> Result<LinearWeight, ModelError> {
            let t = matrix(name, rows, cols)?;
            Ok(LinearWeight::prepare(t, opts.int8_activations)?)
        };
        let linear = |stem: &str, rows: usize, cols: usize| -> Result<Linear, ModelError> {
            // Biases load when present; a config that promises them must have them.
            let bias = match opt_vector(&format!("{stem}.bias"), rows)? {
                None if cfg.qkv_bias => {
                    return Err(ModelError::MissingTensor(format!("{stem}.bias")))
                }
                b => b,
            };
            Ok(Linear {
                weight: weight(&format!("{stem}.weight"), rows, cols)?,
                bias,
            })
        };
        let (h, qd, kvd, ff) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate);
        let embed = matrix(g.embed, cfg.vocab, h)?;
        let output = if ckpt.has_tensor(g.output) {
            weight(g.output, cfg.vocab, h)?
        } else if cfg.tied_embeddings || matches!(ckpt, Checkpoint::Gguf(_)) {
            LinearWeight::prepare(embed.clone(), opts.int8_activations)?
        } else {
            return Err(ModelError::MissingTensor(g.output.into()));
        };
        let freq_factors = match g.rope_freqs {
            Some(name) if ckpt.has_tensor(name) => Some(vector(name, cfg.rope.dim / 2)?),
            _ => None,
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = ckpt.layer_names(i, cfg.gemma);
            let req_norm = |name: &str, len: usize| -> Result<Option<Vec<f32>>, ModelError> {
                match opt_vector(name, len)? {
                    None if cfg.gemma || (cfg.qk_norm && len == cfg.head_dim) => {
                        Err(ModelError::MissingTensor(name.into()))
                    }
                    v => Ok(v),
                }
            };
            let (qk_norm_q, qk_norm_k) = if cfg.qk_norm {
                (
                    req_norm(&n.q_norm, cfg.head_dim)?,
                    req_norm(&n.k_norm, cfg.head_dim)?,
                )
            } else {
                (None, None)
            };
            let (post_attn_norm, post_ffn_norm) = if cfg.gemma {
                (
                    req_norm(&n.post_attn_norm, h)?,
                    req_norm(&n.post_ffn_norm, h)?,
                )
            } else {
                (None, None)
            };
            layers.push(Layer {
                attn_norm: vector(&n.attn_norm, h)?,
                q: linear(&n.q, qd, h)?,
                k: linear(&n.k, kvd, h)?,
                v: linear(&n.v, kvd, h)?,
                o: Linear {
                    weight: weight(&format!("{}.weight", n.o), h, qd)?,
                    bias: None,
                },
                q_norm: qk_norm_q,
                k_norm: qk_norm_k,
                post_attn_norm,
                ffn_norm: vector(&n.ffn_norm, h)?,
                post_ffn_norm,
                gate: weight(&n.gate, ff, h)?,
                up: weight(&n.up, ff, h)?,
                down: weight(&n.down, h, ff)?,
                inv_freq: cfg.inv_freq(i, freq_factors.as_deref()),
                window: if cfg.is_sliding(i) {
                    cfg.sliding_window
                } else {
                    None
                },
            });
        }
        Ok(LlamaModel {
            final_norm: vector(g.final_norm, h)?,
            embed,
            output,
            layers,
            cfg,
            scratch: Mutex::new(Scratch::default()),
            kv_dtype: opts.kv_dtype,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The shape of this model's KV caches.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            n_layers: self.cfg.n_layers,
            n_kv_heads: self.cfg.n_kv_heads,
            head_dim: self.cfg.head_dim,
            dtype: self.kv_dtype,
        }
    }

    /// KV bytes one token occupies across all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_shape().bytes_per_token()
    }

    /// A one-sequence cache able to hold `capacity` tokens (at most the
    /// context length).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache, ModelError> {
        KvCache::new(self.kv_shape(), capacity.min(self.cfg.max_context))
    }

    /// A paged pool of `n_blocks` blocks of `block_size` tokens.
    pub fn new_pool(&self, block_size: usize, n_blocks: usize) -> Result<KvPool, ModelError> {
        KvPool::new(self.kv_shape(), block_size, n_blocks)
    }

    /// Bytes of weights read per decoded token: every layer's matrices and
    /// the output matrix (the embedding contributes one row).
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| l.weights().iter().map(|w| w.byte_len()).sum::<usize>())
            .sum();
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
        let step = SeqStep {
            tokens,
            pos0: cache.len(),
            table: &SINGLE_TABLE,
            logits: want,
        };
        let logits = self.forward_batch(cache.pool_mut(), &[step])?;
        cache.advance(tokens.len());
        Ok(logits)
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
        let c = &self.cfg;
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if n == 0 || seqs.iter().any(|s| s.tokens.is_empty()) {
            return Err(ModelError::EmptyInput);
        }
        if pool.shape() != self.kv_shape() {
            return Err(ModelError::KvShape);
        }
        let mut attn_seqs = Vec::with_capacity(seqs.len());
        let mut row = 0;
        for s in seqs {
            pool.check_table(s.table, s.pos0 + s.tokens.len())?;
            if let Some(&id) = s.tokens.iter().find(|&&t| t as usize >= c.vocab) {
                return Err(ModelError::TokenOutOfRange { id, vocab: c.vocab });
            }
            attn_seqs.push(SeqAttn {
                rows: row..row + s.tokens.len(),
                pos0: s.pos0,
                table: s.table,
            });
            row += s.tokens.len();
        }
        let (h, qd, kvd, ff) = (c.hidden, c.q_dim(), c.kv_dim(), c.intermediate);
        let mut guard = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let Scratch {
            x,
            xn,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            q8,
        } = &mut *guard;
        let x = sized(x, n * h);
        let tokens = seqs.iter().flat_map(|s| s.tokens.iter());
        for (row, &t) in x.chunks_exact_mut(h).zip(tokens) {
            dequantize_row(self.embed.dtype(), self.embed.row_bytes(t as usize), row)?;
            if c.gemma {
                let s = (h as f32).sqrt();
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        let xn = sized(xn, n * h);
        let q = sized(q, n * qd);
        let k = sized(k, n * kvd);
        let v = sized(v, n * kvd);
        let attn = sized(attn, n * qd);
        let proj = sized(proj, n * h);
        let gate = sized(gate, n * ff);
        let up = sized(up, n * ff);
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(x, &l.attn_norm, c.rms_eps, xn);
            let input = LinearInput::new(xn, n, q8, &[&l.q.weight, &l.k.weight, &l.v.weight])?;
            forward_batch(
                &input,
                &mut [
                    (&l.q.weight, &mut *q),
                    (&l.k.weight, &mut *k),
                    (&l.v.weight, &mut *v),
                ],
            )?;
            l.q.add_bias(q);
            l.k.add_bias(k);
            l.v.add_bias(v);
            if let Some(w) = &l.q_norm {
                rms_norm_inplace(q, w, c.rms_eps);
            }
            if let Some(w) = &l.k_norm {
                rms_norm_inplace(k, w, c.rms_eps);
            }
            for s in &attn_seqs {
                for (i, t) in s.rows.clone().enumerate() {
                    let pos = s.pos0 + i;
                    let (qt, kt) = (&mut q[t * qd..(t + 1) * qd], &mut k[t * kvd..(t + 1) * kvd]);
                    rope_inplace(qt, c.head_dim, pos, &l.inv_freq, c.rope.style);
                    rope_inplace(kt, c.head_dim, pos, &l.inv_freq, c.rope.style);
                }
            }
            let params = AttnParams {
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: c.head_dim,
                scale: c.attn_scale,
                window: l.window,
            };
            pool.store_and_attend(li, &attn_seqs, (k, v), &params, q, attn);
            l.o.forward(&LinearInput::new(attn, n, q8, &[&l.o.weight])?, proj)?;
            if let Some(w) = &l.post_attn_norm {
                rms_norm_inplace(proj, w, c.rms_eps);
            }
            add_assign(x, proj);
            rms_norm(x, &l.ffn_norm, c.rms_eps, xn);
            let input = LinearInput::new(xn, n, q8, &[&l.gate, &l.up])?;
            forward_batch(&input, &mut [(&l.gate, &mut *gate), (&l.up, &mut *up)])?;
            gated(c.activation, gate, up);
            l.down
                .forward(&LinearInput::new(gate, n, q8, &[&l.down])?, proj)?;
            if let Some(w) = &l.post_ffn_norm {
                rms_norm_inplace(proj, w, c.rms_eps);
            }
            add_assign(x, proj);
        }
        // Gather the rows whose logits are wanted, then norm and project them.
        let mut m = 0;
        for (s, a) in seqs.iter().zip(&attn_seqs) {
            let rows = match s.logits {
                Logits::None => continue,
                Logits::Last => a.rows.end - 1..a.rows.end,
                Logits::All => a.rows.clone(),
            };
            proj[m * h..(m + rows.len()) * h].copy_from_slice(&x[rows.start * h..rows.end * h]);
            m += rows.len();
        }
        if m == 0 {
            return Ok(Vec::new());
        }
        let xn = &mut xn[..m * h];
        rms_norm(&proj[..m * h], &self.final_norm, c.rms_eps, xn);
        let mut logits = vec![0f32; m * c.vocab];
        let input = LinearInput::new(xn, m, q8, &[&self.output])?;
        self.output.forward(&input, &mut logits)?;
        Ok(logits)
    }
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

fn check_shape(t: &Tensor, name: &str, expected: &[usize]) -> Result<(), ModelError> {
    if t.shape() != expected {
        return Err(ModelError::TensorShape {
            name: name.into(),
            expected: expected.to_vec(),
            actual: t.shape().to_vec(),
        });
    }
    Ok(())
}

/// A small 1-D tensor (norm, bias) as f32, plus `offset` (Gemma's `1 + w`).
fn to_f32_vec(t: &Tensor, name: &str, len: usize, offset: f32) -> Result<Vec<f32>, ModelError> {
    check_shape(t, name, &[len])?;
    let mut out = vec![0f32; len];
    dequantize_row(t.dtype(), t.bytes(), &mut out)?;
    out.iter_mut().for_each(|v| *v += offset);
    Ok(out)
}
