//! A linear layer's weight, prepared once for its fastest kernel, and the
//! input it is applied to.
//!
//! Block-quantized weights the int8 kernels know are repacked at load time
//! and multiplied with 8-bit activations; everything else (and every weight
//! when the caller asks for f32 activations) goes through [`crate::matmul`].
//! A [`LinearInput`] quantizes its activations at most once, however many
//! weights read it (q, k and v; gate and up).

use crate::cpu;
use crate::error::KernelError;
use crate::halfpack::{self, HalfMatrix};
use crate::int8::{self, PackedMatrix, Q8Activations};
use crate::matmul::matmul;
use kvant_core::Tensor;

/// A `[out, in]` weight in the form its kernel wants.
#[derive(Clone, Debug)]
pub enum LinearWeight {
    /// Repacked for the int8 kernels.
    Int8(PackedMatrix),
    /// f16 or bf16, repacked 8 rows interleaved (exact weights; f32
    /// activations, or bf16 ones on `vdpbf16ps`).
    Half(HalfMatrix),
    /// As stored, for the f32-activation kernels.
    Float(Tensor),
}

impl LinearWeight {
    /// Repacks `w` for the int8 kernels when `int8` is set and its type has
    /// them, f16 and bf16 weights always (their packing is exact; with
    /// `int8` set, bf16 ones for `vdpbf16ps` where the CPU has it, which
    /// rounds the activations to bf16: see [`HalfMatrix::pack_with`]);
    /// keeps it as stored otherwise. `int8` is the caller's consent to
    /// reduced-precision activations (`--f32-activations` withholds it).
    ///
    /// # Errors
    /// [`KernelError::NotAMatrix`] unless `w` is 2-D.
    pub fn prepare(w: Tensor, int8: bool) -> Result<Self, KernelError> {
        if w.shape().len() != 2 {
            return Err(KernelError::NotAMatrix {
                op: "linear",
                shape: w.shape().to_vec(),
            });
        }
        let packed = if int8 {
            PackedMatrix::pack(&w)?.map(LinearWeight::Int8)
        } else {
            None
        };
        let packed = match packed {
            Some(p) => Some(p),
            None => HalfMatrix::pack_with(&w, int8)?.map(LinearWeight::Half),
        };
        match packed {
            Some(p) => {
                // The packed copy replaces the stored bytes: let the OS drop
                // their pages now, not after every weight has been copied.
                #[cfg(unix)]
                w.release_resident_pages();
                Ok(p)
            }
            None => Ok(LinearWeight::Float(w)),
        }
    }

    /// [`Self::prepare`] for each matrix of a stack `[n, rows, cols]`
    /// (GGUF's experts, llama.cpp's per-head attention matrices).
    ///
    /// # Errors
    /// [`kvant_core::CoreError::NotStacked`] unless `stack` is 3-D.
    pub fn prepare_stack(stack: &Tensor, int8: bool) -> Result<Vec<Self>, KernelError> {
        let &[n, _, _] = stack.shape() else {
            let shape = stack.shape().to_vec();
            return Err(kvant_core::CoreError::NotStacked { shape }.into());
        };
        (0..n)
            .map(|i| Self::prepare(stack.matrix(i)?, int8))
            .collect()
    }

    /// Output features (rows).
    pub fn rows(&self) -> usize {
        match self {
            LinearWeight::Int8(p) => p.rows(),
            LinearWeight::Half(p) => p.rows(),
            LinearWeight::Float(t) => t.shape()[0],
        }
    }

    /// Input features (columns).
    pub fn cols(&self) -> usize {
        match self {
            LinearWeight::Int8(p) => p.cols(),
            LinearWeight::Half(p) => p.cols(),
            LinearWeight::Float(t) => t.shape()[1],
        }
    }

    /// Bytes read by one pass over the weight.
    pub fn byte_len(&self) -> usize {
        match self {
            LinearWeight::Int8(p) => p.byte_len(),
            LinearWeight::Half(p) => p.byte_len(),
            LinearWeight::Float(t) => t.byte_len(),
        }
    }

    fn wants_q8(&self) -> bool {
        matches!(self, LinearWeight::Int8(_))
    }

    /// `y = x · Wᵀ` (`y` is `[n_tokens, rows]`).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] if the shapes disagree, or if `x`
    /// was made without quantized activations for an int8 weight.
    pub fn forward(&self, x: &LinearInput<'_>, y: &mut [f32]) -> Result<(), KernelError> {
        match self {
            LinearWeight::Int8(p) => match x.q8 {
                Some(q) => int8::gemm(p, q, y),
                None => Err(KernelError::LengthMismatch {
                    what: "quantized activations for an int8 weight",
                    expected: x.x.len(),
                    actual: 0,
                }),
            },
            LinearWeight::Half(p) => halfpack::gemm(p, x.x, x.n_tokens, y),
            LinearWeight::Float(t) => matmul(t, x.x, x.n_tokens, y),
        }
    }
}

/// `y_i = x · W_iᵀ` for weights that read the same input (q, k and v;
/// gate and up): the int8 ones run as one pool job (see
/// [`int8::gemm_batch`]), the others one by one.
///
/// # Errors
/// As [`LinearWeight::forward`]; more than [`int8::MAX_BATCH`] pairs is a
/// [`KernelError::LengthMismatch`].
pub fn forward_batch(
    x: &LinearInput<'_>,
    pairs: &mut [(&LinearWeight, &mut [f32])],
) -> Result<(), KernelError> {
    let mut packed: [Option<&PackedMatrix>; int8::MAX_BATCH] = [None; int8::MAX_BATCH];
    let mut outs: [&mut [f32]; int8::MAX_BATCH] = Default::default();
    let mut n = 0;
    for (w, y) in pairs.iter_mut() {
        match (w, x.q8) {
            (LinearWeight::Int8(p), Some(_)) if n < int8::MAX_BATCH => {
                packed[n] = Some(p);
                outs[n] = &mut **y;
                n += 1;
            }
            (w, _) => w.forward(x, y)?,
        }
    }
    let (Some(q8), true) = (x.q8, n > 0) else {
        return Ok(());
    };
    let ws: [&PackedMatrix; int8::MAX_BATCH] =
        std::array::from_fn(|i| packed[i].or(packed[0]).expect("n > 0"));
    int8::gemm_batch(&ws[..n], q8, &mut outs[..n])
}

/// Activations `[n_tokens, k]` ready for a set of weights: the f32 values
/// and, if any of the weights is int8, their 8-bit quantization.
pub struct LinearInput<'a> {
    x: &'a [f32],
    n_tokens: usize,
    q8: Option<&'a Q8Activations>,
}

impl<'a> LinearInput<'a> {
    /// Prepares `x` for `weights`, quantizing into `buf` when one wants it.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] if `x` is not `n_tokens` rows of a
    /// whole number of quantization blocks when quantizing.
    pub fn new(
        x: &'a [f32],
        n_tokens: usize,
        buf: &'a mut Q8Activations,
        weights: &[&LinearWeight],
    ) -> Result<Self, KernelError> {
        let q8 = match weights.iter().find(|w| w.wants_q8()) {
            Some(w) => {
                buf.quantize(cpu::tier(), x, n_tokens, w.cols())?;
                Some(&*buf)
            }
            None => None,
        };
        Ok(LinearInput { x, n_tokens, q8 })
    }
}
