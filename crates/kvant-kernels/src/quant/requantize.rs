//! A float weight matrix quantized whole, row by row on the pool (in-situ
//! quantization of a Hugging Face checkpoint at load time).

use super::{dequantize_row, quantize_row};
use crate::error::KernelError;
use crate::pool;
use kvant_core::{DType, Storage, Tensor};
use std::sync::Mutex;

/// Rows one pool task quantizes: large enough that hand-outs cost nothing,
/// small enough that the two halves of a 576-row projection split evenly.
const ROWS_PER_TASK: usize = 64;
const OP: &str = "quantize_tensor";

/// The type a float tensor `t` takes when its checkpoint is quantized to
/// `to`, as `llama-quantize` chooses it: `to` when its rows are whole
/// blocks of it; for Q4_K, whose blocks hold 256 values, Q5_0 otherwise
/// (llama.cpp's fallback); `None` for a tensor that is not float or whose
/// rows fit no block (kept as stored).
pub fn quantized_type(t: &Tensor, to: DType) -> Option<DType> {
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return None;
    }
    let fits = |d: DType| t.row_len().is_multiple_of(d.block_size());
    let fallback = match to {
        DType::Q4_K => Some(DType::Q5_0),
        _ => None,
    };
    std::iter::once(to).chain(fallback).find(|&d| fits(d))
}

/// `t` (F32, F16 or BF16, rows a whole number of `to`'s blocks) as a `to`
/// tensor (Q8_0, Q4_0, Q5_0 or Q4_K), each row rounded as ggml's reference
/// quantizer rounds it, so a weight quantized here is the bytes
/// `llama-quantize` writes for it.
///
/// # Errors
/// [`KernelError::UnsupportedDType`] for another source or target type, a
/// core error for rows that are not whole blocks.
pub fn quantize_tensor(t: &Tensor, to: DType) -> Result<Tensor, KernelError> {
    if !matches!(to, DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::Q4_K) {
        return Err(KernelError::UnsupportedDType { op: OP, dtype: to });
    }
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(KernelError::UnsupportedDType {
            op: OP,
            dtype: t.dtype(),
        });
    }
    let (rows, cols) = (t.rows(), t.row_len());
    let row_bytes = to.bytes_for(cols)?;
    let tasks = rows.div_ceil(ROWS_PER_TASK);
    let parts: Vec<Mutex<Result<Vec<u8>, KernelError>>> =
        (0..tasks).map(|_| Mutex::new(Ok(Vec::new()))).collect();
    pool::global().run(tasks, &|task| {
        let range = task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(rows);
        let mut out = vec![0u8; range.len() * row_bytes];
        let mut f = vec![0f32; cols];
        let done = range
            .zip(out.chunks_exact_mut(row_bytes))
            .try_for_each(|(r, dst)| {
                dequantize_row(t.dtype(), t.row_bytes(r), &mut f)?;
                quantize_row(to, &f, dst)
            });
        if let Ok(mut slot) = parts[task].lock() {
            *slot = done.map(|()| out);
        }
    });
    let mut bytes = Vec::with_capacity(rows * row_bytes);
    for part in parts {
        let part = part.into_inner().map_err(|_| KernelError::InvalidShape {
            op: OP,
            why: "a task panicked".into(),
        })??;
        bytes.extend_from_slice(&part);
    }
    Ok(Tensor::new(
        to,
        t.shape().to_vec(),
        Storage::Owned(bytes.into()),
        0,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Every row equals the row quantizer's output, for odd row counts and
    /// each source type; other types are refused.
    #[test]
    fn tensors_quantize_as_their_rows_do() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let (rows, cols) = (131, 96);
        let vals: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let f32_t = Tensor::from_f32(vec![rows, cols], &vals).expect("tensor");
        for to in [DType::Q8_0, DType::Q4_0, DType::Q5_0] {
            let q = quantize_tensor(&f32_t, to).expect("quantizes");
            assert_eq!((q.dtype(), q.shape()), (to, &[rows, cols][..]));
            let rb = to.bytes_for(cols).expect("row bytes");
            for r in [0, 64, 130] {
                let mut want = vec![0u8; rb];
                let row = &vals[r * cols..(r + 1) * cols];
                quantize_row(to, row, &mut want).expect("row");
                assert_eq!(q.row_bytes(r), &want[..], "{to:?} row {r}");
            }
        }
        // 96-value rows are not whole Q4_K blocks.
        assert!(quantize_tensor(&f32_t, DType::Q4_K).is_err());
        assert_eq!(quantized_type(&f32_t, DType::Q4_K), Some(DType::Q5_0));
        assert!(quantize_tensor(&f32_t, DType::Q6_K).is_err());
        let odd = Tensor::from_f32(vec![2, 33], &vec![0.5; 66]).expect("tensor");
        assert!(quantize_tensor(&odd, DType::Q8_0).is_err());
        assert_eq!(quantized_type(&odd, DType::Q4_K), None);
        let wide = Tensor::from_f32(vec![3, 512], &vals[..1536]).expect("tensor");
        assert_eq!(quantized_type(&wide, DType::Q4_K), Some(DType::Q4_K));
        let q = quantize_tensor(&wide, DType::Q4_K).expect("quantizes");
        let mut want = vec![0u8; DType::Q4_K.bytes_for(512).expect("row bytes")];
        quantize_row(DType::Q4_K, &vals[512..1024], &mut want).expect("row");
        assert_eq!(q.row_bytes(1), &want[..]);
    }
}
