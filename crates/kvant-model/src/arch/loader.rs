//! Reading a layer's tensors from a checkpoint into the forms the forward
//! pass wants, with the shape checks every architecture component needs.

use super::shard::Shard;
use crate::checkpoint::Checkpoint;
use crate::ModelError;
use kvant_core::DType;
use kvant_core::{CoreError, Tensor};
use kvant_kernels::linear::{LinearInput, LinearWeight};
use kvant_kernels::quant::{dequantize_row, quantize_tensor, quantized_type};
use std::ops::Range;

/// A projection: a weight `[out, in]` prepared for its kernel and an optional bias.
pub(crate) struct Linear {
    pub weight: LinearWeight,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    pub fn forward(&self, x: &LinearInput<'_>, y: &mut [f32]) -> Result<(), ModelError> {
        self.weight.forward(x, y)?;
        self.add_bias(y);
        Ok(())
    }

    pub fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(v, bv)| *v += bv);
            }
        }
    }
}

/// Whether a projection's bias must be present.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bias {
    Required,
    IfPresent,
}

/// Which part of a `[rows, cols]` matrix a rank loads: rows (a
/// column-parallel share: its heads or FFN columns) or columns (a
/// row-parallel share, whose products the ranks sum).
#[derive(Clone, Debug)]
pub(crate) enum Part {
    Rows(Range<usize>),
    Cols(Range<usize>),
}

pub(crate) struct Loader<'a> {
    pub ckpt: &'a Checkpoint,
    /// Prepare int8-capable weights for the int8 kernels.
    pub int8: bool,
    /// Quantize float projection weights to this type first.
    pub quantize: Option<DType>,
    /// Added to norm weights (Hugging Face Gemma stores `w - 1`).
    pub norm_offset: f32,
    /// This rank's tensor-parallel share.
    pub shard: Shard,
}

impl Loader<'_> {
    pub fn has(&self, name: &str) -> bool {
        self.ckpt.has_tensor(name)
    }

    pub fn tensor(&self, name: &str) -> Result<Tensor, ModelError> {
        self.ckpt.tensor(name)
    }

    /// A norm weight or bias of `len` values, as f32.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.ckpt.tensor(name)?;
        to_f32_vec(&t, name, len, self.norm_offset)
    }

    /// A 1-D tensor stored as-is (no norm offset), such as a bias.
    pub fn raw_vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.ckpt.tensor(name)?;
        to_f32_vec(&t, name, len, 0.0)
    }

    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor, ModelError> {
        let t = self.ckpt.tensor(name)?;
        check_shape(&t, name, &[rows, cols])?;
        Ok(t)
    }

    pub fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<LinearWeight, ModelError> {
        self.prepare(self.matrix(name, rows, cols)?)
    }

    /// A weight kept in f32 activations whatever the load options say
    /// (routers, latent-attention head products: small, and where the
    /// rounding of 8-bit activations would flip expert choices or move
    /// every attention score).
    pub fn exact_weight(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<LinearWeight, ModelError> {
        Ok(LinearWeight::prepare(
            self.matrix(name, rows, cols)?,
            false,
        )?)
    }

    /// A projection weight for its kernel, quantized first when the load
    /// asks for it (rows that are not whole blocks stay as stored, as
    /// llama.cpp's quantizer leaves them).
    pub fn prepare(&self, t: Tensor) -> Result<LinearWeight, ModelError> {
        Ok(LinearWeight::prepare(self.quantized(t)?, self.int8)?)
    }

    /// `t` in the type the load quantizes float matrices to, if any (also
    /// the token embedding, as gguf-py's and llama.cpp's quantizers do).
    pub fn quantized(&self, t: Tensor) -> Result<Tensor, ModelError> {
        quantized(t, self.quantize)
    }

    /// The `n` matrices `[rows, cols]` of a stacked tensor `[n, rows, cols]`
    /// (GGUF's experts, llama.cpp's per-head `attn_k_b` / `attn_v_b`), as
    /// views: a rank prepares only those it holds.
    pub fn stacked(
        &self,
        name: &str,
        n: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Tensor>, ModelError> {
        let t = self.tensor(name)?;
        check_shape(&t, name, &[n, rows, cols])?;
        Ok((0..n).map(|i| t.matrix(i)).collect::<Result<_, _>>()?)
    }

    /// Part `part` of the `[rows, cols]` matrix `name` (a rank's share of
    /// a projection), prepared.
    pub fn weight_part(
        &self,
        name: &str,
        [rows, cols]: [usize; 2],
        part: Part,
    ) -> Result<LinearWeight, ModelError> {
        let t = self.matrix(name, rows, cols)?;
        match part {
            Part::Rows(r) if r == (0..rows) => self.prepare(t),
            Part::Cols(c) if c == (0..cols) => self.prepare(t),
            Part::Rows(r) => self.prepare(t.row_range(r)?),
            Part::Cols(c) => self.prepare(cut_cols(&t, name, c)?),
        }
    }

    /// The rows of `runs` of `{stem}.weight` `[rows, cols]` and of its
    /// bias, regrouped in that order (a projection the checkpoint stores
    /// interleaved with another, see `Tensor::rows_of`).
    pub fn linear_runs(
        &self,
        stem: &str,
        [rows, cols]: [usize; 2],
        runs: &[Range<usize>],
        bias: Bias,
    ) -> Result<Linear, ModelError> {
        let b = self.bias(stem, rows, bias)?;
        let t = self.matrix(&format!("{stem}.weight"), rows, cols)?;
        Ok(Linear {
            weight: self.prepare(t.rows_of(runs)?)?,
            bias: b.map(|b| runs.iter().flat_map(|r| b[r.clone()].to_vec()).collect()),
        })
    }

    /// Part `part` of `{stem}.weight` and the bias that goes with it:
    /// the same rows of it (a column-parallel projection's share), or for
    /// a column share (row-parallel, whose outputs are summed) all of it,
    /// on the first tensor-parallel rank only.
    pub fn linear_part(
        &self,
        stem: &str,
        [rows, cols]: [usize; 2],
        part: Part,
        bias: Bias,
    ) -> Result<Linear, ModelError> {
        let b = self.bias(stem, rows, bias)?;
        let bias = match &part {
            Part::Rows(r) => b.map(|b| b[r.clone()].to_vec()),
            Part::Cols(_) => b.filter(|_| self.shard.t == 0),
        };
        let weight = self.weight_part(&format!("{stem}.weight"), [rows, cols], part)?;
        Ok(Linear { weight, bias })
    }

    /// `{stem}.bias` when present, an error when required and absent.
    fn bias(&self, stem: &str, rows: usize, bias: Bias) -> Result<Option<Vec<f32>>, ModelError> {
        match (self.has(&format!("{stem}.bias")), bias) {
            (true, _) => Ok(Some(self.raw_vector(&format!("{stem}.bias"), rows)?)),
            (false, Bias::Required) => Err(ModelError::MissingTensor(format!("{stem}.bias"))),
            (false, Bias::IfPresent) => Ok(None),
        }
    }

    /// `{stem}.weight` and `{stem}.bias`.
    pub fn linear(
        &self,
        stem: &str,
        rows: usize,
        cols: usize,
        bias: Bias,
    ) -> Result<Linear, ModelError> {
        self.linear_part(stem, [rows, cols], Part::Rows(0..rows), bias)
    }
}

/// Columns `range` of `t`, or an error naming the tensor when a bound
/// falls inside a quantization block.
pub(crate) fn cut_cols(t: &Tensor, name: &str, range: Range<usize>) -> Result<Tensor, ModelError> {
    t.col_range(range.clone()).map_err(|e| match e {
        CoreError::PartialBlock { dtype, block, .. } => ModelError::Split {
            name: name.into(),
            at: range,
            dtype: dtype.name(),
            block,
        },
        e => e.into(),
    })
}

pub(crate) fn check_shape(t: &Tensor, name: &str, expected: &[usize]) -> Result<(), ModelError> {
    if t.shape() != expected {
        return Err(ModelError::TensorShape {
            name: name.into(),
            expected: expected.to_vec(),
            actual: t.shape().to_vec(),
        });
    }
    Ok(())
}

/// A tensor's values as f32 (dequantized row by row).
pub(crate) fn to_f32(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    let cols = t.row_len();
    let mut out = vec![0f32; t.elements()];
    for (r, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
        dequantize_row(t.dtype(), t.row_bytes(r), row)?;
    }
    #[cfg(unix)]
    t.release_resident_pages();
    Ok(out)
}

/// A small 1-D tensor (norm, bias) as f32, plus `offset` (Gemma's `1 + w`).
fn to_f32_vec(t: &Tensor, name: &str, len: usize, offset: f32) -> Result<Vec<f32>, ModelError> {
    check_shape(t, name, &[len])?;
    let mut out = vec![0f32; len];
    dequantize_row(t.dtype(), t.bytes(), &mut out)?;
    // The copy replaces the file's bytes, and reading them may have mapped
    // a large folio of weights already repacked around them.
    #[cfg(unix)]
    t.release_resident_pages();
    out.iter_mut().for_each(|v| *v += offset);
    Ok(out)
}

/// A row-major `[rows, cols]` matrix transposed to `[cols, rows]`.
pub(crate) fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; rows * cols];
    for (r, row) in w.chunks_exact(cols).take(rows).enumerate() {
        for (c, &x) in row.iter().enumerate() {
            t[c * rows + r] = x;
        }
    }
    t
}

/// The type a float matrix `t` takes when the load quantizes to `to`
/// ([`quantized_type`]: Q4_K rows that are not whole 256-value blocks
/// become Q5_0, as llama-quantize makes them); `None`: kept as stored.
fn load_type(t: &Tensor, to: Option<DType>) -> Option<DType> {
    to.filter(|_| t.shape().len() == 2)
        .and_then(|q| quantized_type(t, q))
}

/// `t` as the load quantizes it (see [`load_type`]), or as stored.
pub(crate) fn quantized(t: Tensor, to: Option<DType>) -> Result<Tensor, ModelError> {
    Ok(match load_type(&t, to) {
        Some(q) => quantize_tensor(&t, q)?,
        None => t,
    })
}

/// The column block a tensor-parallel cut of `t` must respect once the load
/// quantizes it to `to`.
pub(crate) fn block_after(t: &Tensor, to: Option<DType>) -> usize {
    load_type(t, to).unwrap_or(t.dtype()).block_size()
}
