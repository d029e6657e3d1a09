//! The expanded form of latent attention, for prompt chunks: each cached
//! latent row is expanded once per chunk into every head's key (`K_h c`,
//! then the shared rotary key) and value (`V_h c`), and the chunk's
//! queries attend as plain multi-head attention over them.
//!
//! Per head, a (query, key) pair costs `qk + v` multiply-adds expanded
//! against `(kv_lora_rank + rope) + kv_lora_rank` absorbed (DeepSeek-V3:
//! 320 against 1088), while expanding costs `(nope + v) · kv_lora_rank` per
//! context row where absorbing costs the same per query. So a fresh prompt
//! is always cheaper expanded, and a short chunk after a long cached prefix
//! never is: [`Expansion::cheaper`] weighs the two for each sequence's
//! chunk. Decode and MTP verification (one or two tokens) always stay
//! absorbed.

use super::loader::{to_f32, transpose, Loader};
use super::sized;
use crate::config::MlaConfig;
use crate::kv::KvPool;
use crate::ModelError;
use kvant_core::{DType, Tensor};
use kvant_kernels::attention::{attention, AttnParams, KvBlocks, SeqAttn};
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};
use kvant_kernels::quant::quantize_row_q8_0;

/// How latent attention runs the tokens of a prompt chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MlaPrefill {
    /// Each sequence's chunk in whichever form costs fewer multiply-adds
    /// (see [`Expansion::cheaper`]). A token's arithmetic then depends on
    /// how its prompt was chunked, so a serving batch's make-up can change
    /// results in the last bits.
    #[default]
    Auto,
    /// Always absorbed: the same arithmetic however a batch was cut
    /// (bitwise batch invariance), at up to 3× the attention work on long
    /// prompts.
    Absorbed,
}

/// Largest expanded context, in f32 values (keys and values of every
/// head): 512 MiB of workspace. Longer contexts stay absorbed rather than
/// expand in slices.
const MAX_EXPANDED: usize = 128 << 20;

/// Every head's expansion matrices, stacked.
pub(crate) struct Expansion {
    /// `[heads · nope, kv_lora_rank]`.
    k: LinearWeight,
    /// `[heads · v, kv_lora_rank]`.
    v: LinearWeight,
}

/// Buffers of the expanded form, reused across passes.
#[derive(Default)]
pub(crate) struct ExpandScratch {
    rows: Vec<f32>,
    ckv: Vec<f32>,
    k_nope: Vec<f32>,
    v_tok: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// One sequence's chunk: the layer's pool and index, the chunk, its
/// queries (`[n, heads, qk]`, rotary parts applied) and where its
/// attention output goes (`[n, heads, v]`).
pub(crate) struct Chunk<'a, 'b> {
    pub pool: &'a KvPool,
    pub layer: usize,
    pub seq: &'a SeqAttn<'b>,
    pub q: &'a [f32],
    pub out: &'a mut [f32],
}

impl Expansion {
    /// From llama.cpp's split tensors: `attn_k_b` `[all, kv_lora_rank,
    /// nope]` (transposed here; re-quantized to Q8_0 when it was
    /// quantized, so it runs on the int8 kernels) and `attn_v_b` `[all,
    /// v, kv_lora_rank]` (used as stored), heads `mine` of them.
    pub fn from_split(
        ld: &Loader<'_>,
        (k_b, v_b): (&str, &str),
        (all, mine): (usize, std::ops::Range<usize>),
        m: &MlaConfig,
    ) -> Result<Self, ModelError> {
        let (rank, nope) = (m.kv_lora_rank, m.nope_dim);
        let heads = mine.len();
        let kt = ld.tensor(k_b)?;
        super::loader::check_shape(&kt, k_b, &[all, rank, nope])?;
        let mut k = Vec::with_capacity(heads * rank * nope);
        for i in mine.clone() {
            k.extend(transpose(&to_f32(&kt.matrix(i)?)?, rank, nope));
        }
        let k = match kt.dtype().is_quantized() && ld.int8 && rank % 32 == 0 {
            true => q8_0_matrix(&k, heads * nope, rank)?,
            false => Tensor::from_f32(vec![heads * nope, rank], &k)?,
        };
        let vt = ld.tensor(v_b)?;
        super::loader::check_shape(&vt, v_b, &[all, m.v_dim, rank])?;
        let v_rows = mine.start * m.v_dim..mine.end * m.v_dim;
        Ok(Expansion {
            k: ld.prepare(k)?,
            v: ld.prepare(vt.stacked_rows()?.row_range(v_rows)?)?,
        })
    }

    /// From Hugging Face's `kv_b_proj` as f32 (`[heads · (nope + v),
    /// kv_lora_rank]`, each head's key rows then value rows; the rows of
    /// this rank's heads).
    pub fn from_kv_b(w: &[f32], heads: usize, m: &MlaConfig) -> Result<Self, ModelError> {
        let (nope, v, rank) = (m.nope_dim, m.v_dim, m.kv_lora_rank);
        let (mut k, mut vv) = (Vec::new(), Vec::new());
        for head in w.chunks_exact((nope + v) * rank) {
            let (kh, vh) = head.split_at(nope * rank);
            k.extend_from_slice(kh);
            vv.extend_from_slice(vh);
        }
        let f32_weight = |x: &[f32], rows| -> Result<LinearWeight, ModelError> {
            Ok(LinearWeight::prepare(
                Tensor::from_f32(vec![rows, rank], x)?,
                false,
            )?)
        };
        Ok(Expansion {
            k: f32_weight(&k, heads * nope)?,
            v: f32_weight(&vv, heads * v)?,
        })
    }

    pub fn byte_len(&self) -> usize {
        self.k.byte_len() + self.v.byte_len()
    }

    /// Whether a chunk of `n` tokens after `cached` ones costs fewer
    /// multiply-adds expanded (and its context fits the workspace). Steps
    /// of one or two tokens (decode, MTP verification) always stay
    /// absorbed: a verified token's row must be bit for bit what plain
    /// decoding computes, or self-speculation would change outputs.
    pub fn cheaper(m: &MlaConfig, heads: usize, n: usize, cached: usize) -> bool {
        let (rank, nope, v, qk) = (m.kv_lora_rank, m.nope_dim, m.v_dim, m.qk_dim());
        let len = cached + n;
        let pairs = n * cached + n * (n + 1) / 2;
        let absorbed = n * (nope + v) * rank + pairs * (m.latent_dim() + rank);
        let expanded = len * (nope + v) * rank + pairs * (qk + v);
        n > 2 && expanded < absorbed && len * heads * (qk + v) <= MAX_EXPANDED
    }

    /// Attention of one sequence's chunk in the expanded form. Its latent
    /// rows must already be in the pool: the whole context is read back
    /// from there, so every key is what the absorbed form would see.
    pub fn attend(
        &self,
        m: &MlaConfig,
        (heads, scale): (usize, f32),
        c: Chunk<'_, '_>,
        q8: &mut Q8Activations,
        s: &mut ExpandScratch,
    ) -> Result<(), ModelError> {
        let (rank, nope, rope, v, lat, qk) = (
            m.kv_lora_rank,
            m.nope_dim,
            m.rope_dim,
            m.v_dim,
            m.latent_dim(),
            m.qk_dim(),
        );
        let len = c.seq.pos0 + c.seq.rows.len();
        let rows = sized(&mut s.rows, len * lat);
        c.pool.load_keys(c.layer, c.seq.table, 0, rows);
        let ckv = sized(&mut s.ckv, len * rank);
        for (dst, src) in ckv.chunks_exact_mut(rank).zip(rows.chunks_exact(lat)) {
            dst.copy_from_slice(&src[..rank]);
        }
        let k_nope = sized(&mut s.k_nope, len * heads * nope);
        let v_tok = sized(&mut s.v_tok, len * heads * v);
        let input = LinearInput::new(ckv, len, q8, &[&self.k, &self.v])?;
        forward_batch(&input, &mut [(&self.k, k_nope), (&self.v, v_tok)])?;
        // Head-major, as one block of `len` positions: `[heads, len, qk]`
        // keys (the head's part, then the shared rotary key) and `[heads,
        // len, v]` values.
        let k = sized(&mut s.k, heads * len * qk);
        for (i, dst) in k.chunks_exact_mut(qk).enumerate() {
            let (h, j) = (i / len, i % len);
            dst[..nope].copy_from_slice(&k_nope[(j * heads + h) * nope..][..nope]);
            dst[nope..].copy_from_slice(&rows[j * lat + rank..][..rope]);
        }
        let vb = sized(&mut s.v, heads * len * v);
        for (i, dst) in vb.chunks_exact_mut(v).enumerate() {
            let (h, j) = (i / len, i % len);
            dst.copy_from_slice(&v_tok[(j * heads + h) * v..][..v]);
        }
        let params = AttnParams {
            n_heads: heads,
            n_kv_heads: heads,
            head_dim: qk,
            v_dim: v,
            scale,
            window: None,
        };
        let blocks = KvBlocks {
            k: &*k,
            v: Some(&*vb),
            block_size: len,
        };
        let seq = SeqAttn {
            rows: 0..c.seq.rows.len(),
            pos0: c.seq.pos0,
            table: &[0],
        };
        attention(&params, c.q, &blocks, &[seq], c.out);
        Ok(())
    }
}

/// An f32 matrix quantized to Q8_0, as a tensor.
fn q8_0_matrix(w: &[f32], rows: usize, cols: usize) -> Result<Tensor, ModelError> {
    let row_bytes = DType::Q8_0.bytes_for(cols)?;
    let mut bytes = vec![0u8; rows * row_bytes];
    for (src, dst) in w.chunks_exact(cols).zip(bytes.chunks_exact_mut(row_bytes)) {
        quantize_row_q8_0(src, dst)?;
    }
    Ok(Tensor::new(
        DType::Q8_0,
        vec![rows, cols],
        kvant_core::Storage::Owned(bytes.into()),
        0,
    )?)
}
