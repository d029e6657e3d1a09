//! A typed, shaped view of bytes in a [`Storage`].

use crate::{CoreError, DType, Result, Storage};

/// An immutable tensor: weights as stored in the checkpoint.
///
/// Shapes are row-major with the *last* dimension contiguous, written the
/// PyTorch way: a linear weight is `[out, in]`. (GGUF lists dimensions
/// innermost-first; the GGUF reader reverses them.)
#[derive(Clone, Debug)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
    offset: usize,
    len: usize,
}

impl Tensor {
    /// Builds a view, checking that the bytes exist and the rows are whole blocks.
    pub fn new(dtype: DType, shape: Vec<usize>, storage: Storage, offset: usize) -> Result<Self> {
        let elements = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| CoreError::ShapeOverflow {
                shape: shape.clone(),
            })?;
        let row = shape.last().copied().unwrap_or(1);
        if dtype.is_quantized() {
            // Every row must start on a block boundary.
            dtype.bytes_for(row)?;
        }
        let len = dtype.bytes_for(elements)?;
        storage.slice(offset, len)?;
        Ok(Tensor {
            dtype,
            shape,
            storage,
            offset,
            len,
        })
    }

    /// An owned f32 tensor, for small tensors made at load time.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::new(DType::F32, shape, Storage::Owned(bytes.into()), 0)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Length of the contiguous last dimension.
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows (product of all but the last dimension).
    pub fn rows(&self) -> usize {
        self.elements() / self.row_len().max(1)
    }

    pub fn bytes(&self) -> &[u8] {
        // In range: checked in `new`, and storage is immutable.
        &self.storage.as_bytes()[self.offset..self.offset + self.len]
    }

    /// Bytes of row `i` (whole blocks).
    pub fn row_bytes(&self, i: usize) -> &[u8] {
        let per_row = self.len / self.rows().max(1);
        &self.bytes()[i * per_row..(i + 1) * per_row]
    }

    /// See [`Storage::release_resident_pages`]: drops this process's
    /// resident pages of the tensor's bytes (when they are a file mapping).
    #[cfg(unix)]
    pub fn release_resident_pages(&self) {
        self.storage
            .release_resident_pages(self.offset, self.byte_len());
    }

    /// Matrix `i` of a 3-D tensor `[n, rows, cols]`, as a `[rows, cols]`
    /// view of the same storage (no copy). GGUF stores all experts of a
    /// mixture-of-experts layer as one such stack (`ffn_gate_exps` is
    /// `[n_expert, ff, hidden]`); each expert's weight is one matrix of it.
    /// Rows are whole blocks (checked in [`Tensor::new`]), so matrix `i`
    /// starts `i` matrices' bytes in.
    ///
    /// # Errors
    /// [`CoreError::NotStacked`] unless the tensor is 3-D, and
    /// [`CoreError::MatrixOutOfRange`] unless `i < n`.
    pub fn matrix(&self, i: usize) -> Result<Tensor> {
        let &[n, rows, cols] = self.shape.as_slice() else {
            return Err(CoreError::NotStacked {
                shape: self.shape.clone(),
            });
        };
        if i >= n {
            return Err(CoreError::MatrixOutOfRange { index: i, count: n });
        }
        // `len` is `n` whole matrices (checked in `new`) and `n > i >= 0`.
        let bytes = self.len / n;
        Tensor::new(
            self.dtype,
            vec![rows, cols],
            self.storage.clone(),
            self.offset + i * bytes,
        )
    }

    /// A stack of matrices `[n, rows, cols]` as one `[n · rows, cols]`
    /// matrix over the same bytes (every head's matrix in one product).
    ///
    /// # Errors
    /// [`CoreError::NotStacked`] unless the tensor is 3-D.
    pub fn stacked_rows(&self) -> Result<Tensor> {
        let &[n, rows, cols] = self.shape.as_slice() else {
            return Err(CoreError::NotStacked {
                shape: self.shape.clone(),
            });
        };
        // `n · rows · cols` elements were checked not to overflow in `new`.
        Tensor::new(
            self.dtype,
            vec![n * rows, cols],
            self.storage.clone(),
            self.offset,
        )
    }

    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// Rows `rows` of a 2-D tensor, as a view of the same storage (no
    /// copy): a rank's share of a column-parallel weight (its heads'
    /// rows of q/k/v, its slice of the vocabulary).
    ///
    /// # Errors
    /// [`CoreError::WrongShape`] unless the tensor is 2-D, and
    /// [`CoreError::OutOfBounds`] for rows past its end.
    pub fn row_range(&self, rows: std::ops::Range<usize>) -> Result<Tensor> {
        let &[n, cols] = self.shape.as_slice() else {
            return Err(CoreError::WrongShape {
                expected: vec![rows.len(), self.row_len()],
                actual: self.shape.clone(),
            });
        };
        if rows.start > rows.end || rows.end > n {
            return Err(CoreError::OutOfBounds {
                start: rows.start,
                end: rows.end,
                len: n,
            });
        }
        let per_row = self.dtype.bytes_for(cols)?;
        Tensor::new(
            self.dtype,
            vec![rows.len(), cols],
            self.storage.clone(),
            self.offset + rows.start * per_row,
        )
    }

    /// The rows of `runs` (ranges of a 2-D tensor's rows, in that order)
    /// copied into one owned tensor: a projection whose checkpoint
    /// interleaves several outputs per head (Qwen3-Next's `in_proj_qkvz`,
    /// a gated query's `[q, gate]` per head), regrouped at load.
    ///
    /// # Errors
    /// [`CoreError::WrongShape`] unless the tensor is 2-D, and
    /// [`CoreError::OutOfBounds`] for a run past its end.
    pub fn rows_of(&self, runs: &[std::ops::Range<usize>]) -> Result<Tensor> {
        let &[n, cols] = self.shape.as_slice() else {
            return Err(CoreError::WrongShape {
                expected: vec![runs.iter().map(|r| r.len()).sum(), self.row_len()],
                actual: self.shape.clone(),
            });
        };
        let per_row = self.dtype.bytes_for(cols)?;
        let mut bytes = Vec::new();
        let mut rows = 0usize;
        for r in runs {
            if r.start > r.end || r.end > n {
                return Err(CoreError::OutOfBounds {
                    start: r.start,
                    end: r.end,
                    len: n,
                });
            }
            bytes.extend_from_slice(&self.bytes()[r.start * per_row..r.end * per_row]);
            rows += r.len();
        }
        Tensor::new(
            self.dtype,
            vec![rows, cols],
            Storage::Owned(bytes.into()),
            0,
        )
    }

    /// Columns `cols` of a 2-D tensor, copied into owned storage: a rank's
    /// share of a row-parallel weight (the output projection's columns of
    /// its heads). Quantized rows are cut between blocks, never inside one.
    ///
    /// # Errors
    /// [`CoreError::WrongShape`] unless the tensor is 2-D,
    /// [`CoreError::OutOfBounds`] for columns past its end, and
    /// [`CoreError::PartialBlock`] when a bound falls inside a block.
    pub fn col_range(&self, cols: std::ops::Range<usize>) -> Result<Tensor> {
        let &[n, width] = self.shape.as_slice() else {
            return Err(CoreError::WrongShape {
                expected: vec![self.rows(), cols.len()],
                actual: self.shape.clone(),
            });
        };
        if cols.start > cols.end || cols.end > width {
            return Err(CoreError::OutOfBounds {
                start: cols.start,
                end: cols.end,
                len: width,
            });
        }
        let start = self.dtype.bytes_for(cols.start)?;
        let len = self.dtype.bytes_for(cols.len())?;
        let mut bytes = Vec::with_capacity(n.saturating_mul(len));
        for r in 0..n {
            bytes.extend_from_slice(&self.row_bytes(r)[start..start + len]);
        }
        Tensor::new(
            self.dtype,
            vec![n, cols.len()],
            Storage::Owned(bytes.into()),
            0,
        )
    }

    pub fn ensure_shape(&self, expected: &[usize]) -> Result<()> {
        if self.shape != expected {
            return Err(CoreError::WrongShape {
                expected: expected.to_vec(),
                actual: self.shape.clone(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_out_of_range_and_partial_rows() {
        let s = Storage::Owned(vec![0u8; 36].into());
        assert!(Tensor::new(DType::Q4_0, vec![2, 32], s.clone(), 0).is_ok());
        assert!(Tensor::new(DType::Q4_0, vec![2, 32], s.clone(), 1).is_err());
        assert!(Tensor::new(DType::Q4_0, vec![1, 64], s.clone(), 0).is_ok());
        assert!(Tensor::new(DType::Q4_0, vec![4, 16], s.clone(), 0).is_err());
        assert!(Tensor::new(DType::F32, vec![usize::MAX, 2], s, 0).is_err());
    }

    #[test]
    fn matrices_of_a_stack_are_views_of_their_bytes() {
        // 3 matrices of [2, 64] Q4_0: 2 rows of 2 blocks of 18 bytes each.
        let bytes: Vec<u8> = (0..3 * 2 * 36).map(|i| (i % 251) as u8).collect();
        let s = Storage::Owned(bytes.clone().into());
        // An offset into the storage, as a tensor inside a GGUF file has.
        let mut padded = vec![0xAAu8; 5];
        padded.extend(&bytes);
        let stack = Tensor::new(
            DType::Q4_0,
            vec![3, 2, 64],
            Storage::Owned(padded.into()),
            5,
        )
        .unwrap();
        for (i, want) in bytes.chunks(72).enumerate() {
            let m = stack.matrix(i).unwrap();
            assert_eq!(m.shape(), &[2, 64]);
            assert_eq!(m.dtype(), DType::Q4_0);
            assert_eq!(m.bytes(), want, "matrix {i}");
            // A view, not a copy.
            assert_eq!(m.bytes().as_ptr(), stack.bytes()[72 * i..].as_ptr());
            assert_eq!(m.row_bytes(1), &want[36..]);
        }
        let f = Tensor::new(DType::F32, vec![2, 3, 1], s.clone(), 0).unwrap();
        assert_eq!(f.matrix(1).unwrap().bytes(), &bytes[12..24]);
        assert!(matches!(
            stack.matrix(3),
            Err(CoreError::MatrixOutOfRange { index: 3, count: 3 })
        ));
        let rows = stack.stacked_rows().unwrap();
        assert_eq!(rows.shape(), &[6, 64]);
        assert_eq!(rows.bytes(), stack.bytes());
        assert_eq!(rows.row_bytes(4), &bytes[144..180]);
        let flat = Tensor::new(DType::Q4_0, vec![6, 64], s.clone(), 0).unwrap();
        assert!(matches!(flat.matrix(0), Err(CoreError::NotStacked { .. })));
        assert!(matches!(
            flat.stacked_rows(),
            Err(CoreError::NotStacked { .. })
        ));
        let empty = Tensor::new(DType::F32, vec![0, 4, 4], s, 0).unwrap();
        assert!(matches!(
            empty.matrix(0),
            Err(CoreError::MatrixOutOfRange { index: 0, count: 0 })
        ));
    }

    #[test]
    fn row_and_column_ranges() {
        // [3, 64] Q4_0: 2 blocks of 18 bytes per row.
        let bytes: Vec<u8> = (0..3 * 36).map(|i| (i % 251) as u8).collect();
        let t = Tensor::new(
            DType::Q4_0,
            vec![3, 64],
            Storage::Owned(bytes.clone().into()),
            0,
        )
        .unwrap();
        let picked = t.rows_of(&[2..3, 0..1, 1..1]).unwrap();
        assert_eq!(picked.shape(), &[2, 64]);
        assert_eq!(picked.bytes(), [&bytes[72..], &bytes[..36]].concat());
        assert!(t.rows_of(std::slice::from_ref(&(2..4))).is_err());
        let rows = t.row_range(1..3).unwrap();
        assert_eq!(rows.shape(), &[2, 64]);
        assert_eq!(rows.bytes(), &bytes[36..]);
        assert_eq!(rows.bytes().as_ptr(), t.bytes()[36..].as_ptr());
        assert_eq!(t.row_range(3..3).unwrap().shape(), &[0, 64]);
        assert!(t.row_range(2..4).is_err());
        let cols = t.col_range(32..64).unwrap();
        assert_eq!(cols.shape(), &[3, 32]);
        for r in 0..3 {
            assert_eq!(cols.row_bytes(r), &bytes[r * 36 + 18..r * 36 + 36]);
        }
        assert!(matches!(
            t.col_range(16..64),
            Err(CoreError::PartialBlock { .. })
        ));
        assert!(t.col_range(0..96).is_err());
        let f = Tensor::from_f32(vec![2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap();
        let c = f.col_range(1..3).unwrap();
        assert_eq!(
            c.bytes(),
            &[2f32, 3., 5., 6.].map(f32::to_le_bytes).concat()[..]
        );
        let stack = Tensor::new(DType::F32, vec![1, 2, 3], f.storage.clone(), 0).unwrap();
        assert!(matches!(
            stack.col_range(0..1),
            Err(CoreError::WrongShape { .. })
        ));
    }

    #[test]
    fn f32_rows() {
        let t = Tensor::from_f32(vec![2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap();
        assert_eq!(t.rows(), 2);
        assert_eq!(
            t.row_bytes(1),
            &[4f32, 5., 6.].map(f32::to_le_bytes).concat()[..]
        );
    }
}
