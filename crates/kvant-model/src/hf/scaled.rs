//! Weights published with block scales, assembled as stored into kvant's
//! block types (no widening: the codes keep their bits).
//!
//! - **FP8**: an `F8_E4M3` weight with one scale per 128×128 block (the
//!   layout DeepSeek-V3/V3.2/V4, GigaChat3 and Qwen's FP8 releases ship) in
//!   a companion `<name>_scale_inv` (transformers' name) or `<stem>.scale`
//!   (DeepSeek's own), `F32` or `F8_E8M0`, becomes [`DType::F8_B128`]: each
//!   row's 128-value blocks with their scale, `w = e4m3 · scale` as
//!   transformers' and DeepSeek's dequantizers compute it. Rows need not be
//!   a multiple of 128 (the scale grid rounds up); columns must be.
//! - **FP4**: two e2m1 codes per byte (low nibble first), in `I8`/`U8`
//!   with the last dimension halved (transformers' and DeepSeek-V4's
//!   experts) or in `F4`, with an e8m0 scale per 32 values of a row,
//!   becomes [`DType::MXFP4`] (`w = e2m1 · 2^(e − 127)`): the same codes
//!   and scale byte, the nibbles reordered into ggml's block layout.

use super::error::{HfError, Result};
use kvant_core::dtype::{QK, QK_F8};
use kvant_core::{DType, Storage, Tensor};

/// A tensor as stored in a safetensors file.
pub(crate) struct Raw<'a> {
    pub(crate) dtype: &'static str,
    pub(crate) shape: &'a [usize],
    pub(crate) bytes: &'a [u8],
}

/// The companion scale names of weight `name`, in the order looked up.
pub(super) fn scale_names(name: &str) -> Vec<String> {
    let mut names = vec![format!("{name}_scale_inv")];
    if let Some(stem) = name.strip_suffix(".weight") {
        names.push(format!("{stem}.scale"));
    }
    names
}

fn bad(tensor: &str, reason: String) -> HfError {
    HfError::ScaledWeight {
        tensor: tensor.to_string(),
        reason,
    }
}

/// `[matrices, rows, cols]` of a weight of at least two dimensions (the
/// leading ones, an expert stack's, flattened into `matrices`).
fn matrices(tensor: &str, shape: &[usize]) -> Result<(usize, usize, usize)> {
    match shape {
        [lead @ .., rows, cols] => Ok((lead.iter().product(), *rows, *cols)),
        _ => Err(bad(
            tensor,
            format!("a block-scaled weight must be a matrix, not {shape:?}"),
        )),
    }
}

/// The scale values of `scale` (named for errors), as f32.
fn scale_values(tensor: &str, scale: &Raw<'_>) -> Result<Vec<f32>> {
    let values: Vec<f32> = match scale.dtype {
        "F32" => scale
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        "BF16" => scale
            .bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        "F8_E8M0" => scale.bytes.iter().map(|&e| e8m0(e)).collect(),
        other => {
            return Err(bad(
                tensor,
                format!("its scale is {other}; kvant reads F32, BF16 and F8_E8M0 scales"),
            ))
        }
    };
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(bad(tensor, format!("scale {i} is not finite")));
    }
    Ok(values)
}

/// `2^(e − 127)`, exactly (NaN for 255, e8m0's NaN).
fn e8m0(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        // Subnormal f32: 2^-127 is bit 22.
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// FP8 `weight` with its 128×128-block `scale` as [`DType::F8_B128`].
pub(super) fn fp8(tensor: &str, weight: Raw<'_>, scale: Raw<'_>) -> Result<Tensor> {
    let (n, rows, cols) = matrices(tensor, weight.shape)?;
    if !cols.is_multiple_of(QK_F8) {
        return Err(bad(
            tensor,
            format!("FP8 weight of {cols} columns: kvant reads FP8 rows of whole 128-value blocks"),
        ));
    }
    let (sr, sc) = (rows.div_ceil(QK_F8), cols / QK_F8);
    let mut want = weight.shape[..weight.shape.len() - 2].to_vec();
    want.extend([sr, sc]);
    if scale.shape != want.as_slice() {
        return Err(bad(
            tensor,
            format!(
                "scale shape {:?} is not the 128×128 block grid {want:?} of {:?}",
                scale.shape, weight.shape
            ),
        ));
    }
    if let Some(i) = weight.bytes.iter().position(|&q| q & 0x7F == 0x7F) {
        return Err(bad(tensor, format!("value {i} is an FP8 NaN")));
    }
    let scales = scale_values(tensor, &scale)?;
    let block = DType::F8_B128.block_bytes();
    let mut out = Vec::with_capacity(n * rows * sc * block);
    for (m, codes) in weight.bytes.chunks_exact(rows * cols).enumerate() {
        for (r, row) in codes.chunks_exact(cols).enumerate() {
            for (c, q) in row.chunks_exact(QK_F8).enumerate() {
                out.extend(scales[(m * sr + r / QK_F8) * sc + c].to_le_bytes());
                out.extend_from_slice(q);
            }
        }
    }
    Tensor::new(
        DType::F8_B128,
        weight.shape.to_vec(),
        Storage::Owned(out.into()),
        0,
    )
    .map_err(|source| HfError::Tensor {
        tensor: tensor.to_string(),
        source,
    })
}

/// FP4 codes with an e8m0 scale per 32 values of a row as [`DType::MXFP4`].
pub(super) fn fp4(tensor: &str, weight: Raw<'_>, scale: Raw<'_>) -> Result<Tensor> {
    let (n, rows, stored) = matrices(tensor, weight.shape)?;
    // Two codes per byte: I8/U8 shapes count bytes, F4 shapes count codes.
    let cols = if weight.dtype == "F4" {
        stored
    } else {
        2 * stored
    };
    if !cols.is_multiple_of(QK) {
        return Err(bad(
            tensor,
            format!("FP4 weight of {cols} columns: the scales cover whole blocks of 32"),
        ));
    }
    let mut want = weight.shape[..weight.shape.len() - 1].to_vec();
    want.push(cols / QK);
    if scale.shape != want.as_slice() {
        return Err(bad(
            tensor,
            format!(
                "scale shape {:?} is not one scale per 32 values, {want:?}",
                scale.shape
            ),
        ));
    }
    let exponents: Vec<u8> = match scale.dtype {
        "F8_E8M0" => {
            if scale.bytes.contains(&255) {
                return Err(bad(tensor, "an e8m0 scale is NaN (255)".to_string()));
            }
            scale.bytes.to_vec()
        }
        _ => scale_values(tensor, &scale)?
            .into_iter()
            .map(|v| power_of_two_exponent(v).ok_or(v))
            .collect::<std::result::Result<_, f32>>()
            .map_err(|v| {
                bad(
                    tensor,
                    format!("scale {v} is not a power of two, which FP4 blocks (e8m0) need"),
                )
            })?,
    };
    let mut out = Vec::with_capacity(n * rows * cols / QK * DType::MXFP4.block_bytes());
    let code = |bytes: &[u8], i: usize| bytes[i / 2] >> (4 * (i % 2)) & 0x0F;
    for (block, &e) in weight.bytes.chunks_exact(QK / 2).zip(&exponents) {
        out.push(e);
        out.extend((0..QK / 2).map(|j| code(block, j) | code(block, j + QK / 2) << 4));
    }
    let mut shape = weight.shape.to_vec();
    if let Some(last) = shape.last_mut() {
        *last = cols;
    }
    Tensor::new(DType::MXFP4, shape, Storage::Owned(out.into()), 0).map_err(|source| {
        HfError::Tensor {
            tensor: tensor.to_string(),
            source,
        }
    })
}

/// The e8m0 byte of `v` if it is `2^(e − 127)` for a byte `e < 255`.
fn power_of_two_exponent(v: f32) -> Option<u8> {
    (0..255u8).find(|&e| e8m0(e) == v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<f32> {
        let mut out = vec![0f32; t.shape().iter().product()];
        kvant_kernels::quant::dequantize_row_ref(t.dtype(), t.bytes(), &mut out).unwrap();
        out
    }

    fn raw<'a>(dtype: &'static str, shape: &'a [usize], bytes: &'a [u8]) -> Raw<'a> {
        Raw {
            dtype,
            shape,
            bytes,
        }
    }

    #[test]
    fn fp8_rows_carry_their_block_scales() {
        // 130 rows (a partial row block), 256 columns (two column blocks).
        let (rows, cols) = (130usize, 256usize);
        let codes: Vec<u8> = (0..rows * cols).map(|i| (i % 120) as u8).collect();
        let scales: Vec<u8> = [0.5f32, 2.0, 0.25, 8.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t = fp8(
            "w",
            raw("F8_E4M3", &[rows, cols], &codes),
            raw("F32", &[2, 2], &scales),
        )
        .unwrap();
        assert_eq!(t.dtype(), DType::F8_B128);
        let w = values(&t);
        for (r, c) in [(0, 0), (5, 200), (127, 129), (128, 3), (129, 255)] {
            let s = [[0.5f32, 2.0], [0.25, 8.0]][r / 128][c / 128];
            let want = kvant_kernels::quant::fp8::e4m3_to_f32(codes[r * cols + c]) * s;
            assert_eq!(w[r * cols + c], want, "({r}, {c})");
        }
        // Wrong grid, NaN codes, ragged columns: errors.
        assert!(fp8(
            "w",
            raw("F8_E4M3", &[rows, cols], &codes),
            raw("F32", &[1, 4], &scales)
        )
        .is_err());
        let mut nan = codes.clone();
        nan[7] = 0xFF;
        assert!(fp8(
            "w",
            raw("F8_E4M3", &[rows, cols], &nan),
            raw("F32", &[2, 2], &scales)
        )
        .is_err());
        assert!(fp8(
            "w",
            raw("F8_E4M3", &[256, 130], &codes),
            raw("F32", &[2, 2], &scales)
        )
        .is_err());
    }

    #[test]
    fn fp4_codes_keep_their_values() {
        // 3 rows of 64 codes: two e8m0 scales per row.
        let bytes: Vec<u8> = (0..3 * 32).map(|i| (i * 37 % 256) as u8).collect();
        let exps: Vec<u8> = (0..6).map(|i| 120 + i as u8).collect();
        let t = fp4(
            "w",
            raw("I8", &[3, 32], &bytes),
            raw("F8_E8M0", &[3, 2], &exps),
        )
        .unwrap();
        assert_eq!((t.dtype(), t.shape()), (DType::MXFP4, &[3usize, 64][..]));
        let w = values(&t);
        let e2m1 = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for (i, &got) in w.iter().enumerate() {
            let byte = bytes[i / 2];
            let code = (byte >> (4 * (i % 2)) & 0x0F) as usize;
            let v = e2m1[code & 7] * if code & 8 != 0 { -1.0 } else { 1.0 };
            let want = v * 2f32.powi(exps[i / 32] as i32 - 127);
            assert_eq!(got, want, "value {i}");
        }
        // f32 scales that are powers of two give the same tensor; others are refused.
        let f32s: Vec<u8> = exps
            .iter()
            .flat_map(|&e| 2f32.powi(e as i32 - 127).to_le_bytes())
            .collect();
        let same = fp4("w", raw("U8", &[3, 32], &bytes), raw("F32", &[3, 2], &f32s)).unwrap();
        assert_eq!(same.bytes(), t.bytes());
        let third: Vec<u8> = (0..6).flat_map(|_| 0.3f32.to_le_bytes()).collect();
        assert!(fp4(
            "w",
            raw("U8", &[3, 32], &bytes),
            raw("F32", &[3, 2], &third)
        )
        .is_err());
        assert!(fp4(
            "w",
            raw("U8", &[3, 32], &bytes),
            raw("F8_E8M0", &[3, 1], &exps[..3])
        )
        .is_err());
    }
}
