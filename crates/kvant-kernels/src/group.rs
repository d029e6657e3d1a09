//! Equal-shaped weights, each applied to its own runs of rows: a layer's
//! routed experts (each over the tokens routed to it) or latent
//! attention's per-head matrices (each over its head's rows).
//!
//! Packed for the int8 kernels, every run of a call goes into one pool job
//! ([`int8::gemm_grouped`]: its units are (matrix, row group) pairs dealt
//! out by work), not one fork-join per matrix: a decode step of a 16-head
//! or 64-expert layer would otherwise pay one per matrix. Weights whose
//! kernels take f32 rows (f16, f32, bf16) run one product per run.

use crate::cpu::SimdTier;
use crate::error::KernelError;
use crate::halfpack::{self, HalfMatrix};
use crate::int8::{self, PackedMatrix, Q8Activations, Segment};
use crate::linear::LinearWeight;
use crate::matmul::matmul_with;
use kvant_core::Tensor;
use std::ops::Range;

/// `n` weights of one shape `[rows, cols]`, all packed for the int8
/// kernels or none (one stacked checkpoint tensor always prepares to one
/// of the two).
#[derive(Clone, Debug)]
pub struct MatrixGroup {
    kind: Kind,
    rows: usize,
    cols: usize,
}

#[derive(Clone, Debug)]
enum Kind {
    Int8(Vec<PackedMatrix>),
    F32(Vec<F32Weight>),
}

/// A weight whose kernel takes f32 activations.
#[derive(Clone, Debug)]
enum F32Weight {
    Half(HalfMatrix),
    Float(Tensor),
}

impl MatrixGroup {
    /// Groups `ws` (named `what` in errors), checking every shape is
    /// `shape`.
    ///
    /// # Errors
    /// [`KernelError::MatrixShape`] for a weight of another shape,
    /// [`KernelError::MatrixKind`] for one prepared for another kernel
    /// than the first.
    pub fn new(
        what: &'static str,
        ws: Vec<LinearWeight>,
        shape: [usize; 2],
    ) -> Result<Self, KernelError> {
        for (matrix, w) in ws.iter().enumerate() {
            let actual = [w.rows(), w.cols()];
            if actual != shape {
                return Err(KernelError::MatrixShape {
                    what,
                    matrix,
                    expected: shape,
                    actual,
                });
            }
        }
        let int8 = |w: &LinearWeight| matches!(w, LinearWeight::Int8(_));
        if let Some(first) = ws.first() {
            if let Some(matrix) = ws.iter().position(|w| int8(w) != int8(first)) {
                return Err(KernelError::MatrixKind { what, matrix });
            }
        }
        let (mut packed, mut plain) = (Vec::new(), Vec::new());
        for w in ws {
            match w {
                LinearWeight::Int8(p) => packed.push(p),
                LinearWeight::Half(p) => plain.push(F32Weight::Half(p)),
                LinearWeight::Float(t) => plain.push(F32Weight::Float(t)),
            }
        }
        let kind = match plain.is_empty() {
            true => Kind::Int8(packed),
            false => Kind::F32(plain),
        };
        Ok(MatrixGroup {
            kind,
            rows: shape[0],
            cols: shape[1],
        })
    }

    /// The packed matrices, for callers that batch several groups into one
    /// grouped job; `None` for f32-activation weights.
    pub fn int8(&self) -> Option<&[PackedMatrix]> {
        match &self.kind {
            Kind::Int8(v) => Some(v),
            Kind::F32(_) => None,
        }
    }

    /// Bytes of matrix `m`.
    ///
    /// # Panics
    /// If `m` is not a matrix of the group.
    pub fn matrix_bytes(&self, m: usize) -> usize {
        match &self.kind {
            Kind::Int8(v) => v[m].byte_len(),
            Kind::F32(v) => match &v[m] {
                F32Weight::Half(p) => p.byte_len(),
                F32Weight::Float(t) => t.byte_len(),
            },
        }
    }

    /// Bytes of every matrix.
    pub fn byte_len(&self) -> usize {
        (0..self.len()).map(|m| self.matrix_bytes(m)).sum()
    }

    pub fn len(&self) -> usize {
        match &self.kind {
            Kind::Int8(v) => v.len(),
            Kind::F32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `y[r] = x[r] · W_mᵀ` for every run `(m, r)` of rows: `x` is
    /// `[_, cols]`, `y` `[_, rows]`; rows no run covers keep their values.
    /// Int8 weights quantize all of `x` once (into `q8`) and run every run
    /// as one job, so the runs must ascend without overlapping.
    ///
    /// # Errors
    /// [`KernelError`] if the slices or runs disagree with the shapes.
    pub fn forward_runs(
        &self,
        tier: SimdTier,
        runs: impl Iterator<Item = (usize, Range<usize>)>,
        x: &[f32],
        q8: &mut Q8Activations,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let (rows, cols) = (self.rows, self.cols);
        match &self.kind {
            Kind::Int8(p) => {
                q8.quantize(tier, x, x.len() / cols.max(1), cols)?;
                let segments: Vec<Segment> = runs
                    .map(|(matrix, tokens)| Segment {
                        set: 0,
                        matrix,
                        tokens,
                    })
                    .collect();
                int8::gemm_grouped_with(tier, &[p], &segments, q8, &mut [y])
            }
            Kind::F32(ws) => {
                for (m, r) in runs {
                    let w = ws.get(m).ok_or(KernelError::IndexOutOfRange {
                        what: "matrix of a group",
                        index: m,
                        len: ws.len(),
                    })?;
                    let short = |what, expected, actual| KernelError::LengthMismatch {
                        what,
                        expected,
                        actual,
                    };
                    let xr = x.get(r.start * cols..r.end * cols).ok_or(short(
                        "group input rows",
                        r.end * cols,
                        x.len(),
                    ))?;
                    let yr_len = y.len();
                    let yr = y.get_mut(r.start * rows..r.end * rows).ok_or(short(
                        "group output rows",
                        r.end * rows,
                        yr_len,
                    ))?;
                    match w {
                        F32Weight::Half(p) => halfpack::gemm_with(tier, p, xr, r.len(), yr)?,
                        F32Weight::Float(t) => matmul_with(tier, t, xr, r.len(), yr)?,
                    }
                }
                Ok(())
            }
        }
    }
}
