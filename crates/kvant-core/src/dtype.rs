//! Element types, including GGML's block-quantized formats.
//!
//! A quantized type stores `block_size` weights in `block_bytes` bytes; a row of
//! a weight matrix is always a whole number of blocks. The numeric ids are the
//! `ggml_type` values written in GGUF tensor infos.

use crate::{CoreError, Result};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    /// OCP microscaling FP4: 32 e2m1 values and one power-of-two (e8m0)
    /// scale per block (gpt-oss's experts; GGUF type 39).
    MXFP4,
    /// NVIDIA's FP4: 64 e2m1 values in sub-blocks of 16, each with an
    /// unsigned e4m3 scale (GGUF type 40).
    NVFP4,
    /// FP8 e4m3 weights with one f32 scale per 128 values of a row: the
    /// 128×128-block-scaled layout DeepSeek and Qwen publish
    /// (`weight` + `weight_scale_inv`), each row carrying its column
    /// blocks' scales (a scale per 128 bytes, 3% more). kvant's own: no
    /// GGUF type, so never written to a GGUF file.
    F8_B128,
    /// 32-bit integers: index tables stored beside the weights (DeepSeek-V4's
    /// token → experts map), never multiplied.
    I32,
}

/// Super-block size of the k-quants.
pub const QK_K: usize = 256;
/// Block size of the legacy quants.
pub const QK: usize = 32;
/// Block size of [`DType::NVFP4`].
pub const QK_NVFP4: usize = 64;
/// Block size of [`DType::F8_B128`] (the width of DeepSeek's scale blocks).
pub const QK_F8: usize = 128;

impl DType {
    /// Every weight type (the element types kvant computes with); I32,
    /// which only index tables use, is not one.
    pub const ALL: [DType; 16] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::MXFP4,
        DType::NVFP4,
        DType::F8_B128,
    ];

    /// The `ggml_type` id used in GGUF files; `None` for kvant's own
    /// [`DType::F8_B128`], which GGUF has no type for.
    pub fn ggml_id(self) -> Option<u32> {
        Some(match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q8_0 => 8,
            DType::Q2_K => 10,
            DType::Q3_K => 11,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::I32 => 26,
            DType::BF16 => 30,
            DType::MXFP4 => 39,
            DType::NVFP4 => 40,
            DType::F8_B128 => return None,
        })
    }

    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL
            .into_iter()
            .chain([DType::I32])
            .find(|d| d.ggml_id() == Some(id))
    }

    /// Number of elements one block holds (1 for plain floats).
    pub fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::MXFP4 => {
                QK
            }
            DType::NVFP4 => QK_NVFP4,
            DType::F8_B128 => QK_F8,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => QK_K,
        }
    }

    /// Bytes one block occupies (see ggml-common.h for each layout).
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 2 + QK / 2,
            DType::Q4_1 => 2 + 2 + QK / 2,
            DType::Q5_0 => 2 + 4 + QK / 2,
            DType::Q5_1 => 2 + 2 + 4 + QK / 2,
            DType::Q8_0 => 2 + QK,
            DType::Q2_K => QK_K / 16 + QK_K / 4 + 2 + 2,
            DType::Q3_K => QK_K / 8 + QK_K / 4 + 12 + 2,
            DType::Q4_K => 2 + 2 + 12 + QK_K / 2,
            DType::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            DType::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            DType::MXFP4 => 1 + QK / 2,
            DType::NVFP4 => QK_NVFP4 / 16 + QK_NVFP4 / 2,
            DType::F8_B128 => 4 + QK_F8,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::MXFP4 => "MXFP4",
            DType::NVFP4 => "NVFP4",
            DType::F8_B128 => "F8_E4M3_B128",
            DType::I32 => "I32",
        }
    }

    /// Bytes needed for `elements` values, or an error when `elements` does not
    /// fill whole blocks or the size overflows (hostile headers ask for both).
    pub fn bytes_for(self, elements: usize) -> Result<usize> {
        let block = self.block_size();
        if !elements.is_multiple_of(block) {
            return Err(CoreError::PartialBlock {
                dtype: self,
                elements,
                block,
            });
        }
        (elements / block)
            .checked_mul(self.block_bytes())
            // Lazily: this runs for every matrix product, and the error's
            // `Vec` was half the allocations of a decode step.
            .ok_or_else(|| CoreError::ShapeOverflow {
                shape: vec![elements],
            })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_bytes_match_ggml() {
        // Sizes from ggml-common.h static_asserts.
        let expect = [
            (DType::Q4_0, 18),
            (DType::Q4_1, 20),
            (DType::Q5_0, 22),
            (DType::Q5_1, 24),
            (DType::Q8_0, 34),
            (DType::Q2_K, 84),
            (DType::Q3_K, 110),
            (DType::Q4_K, 144),
            (DType::Q5_K, 176),
            (DType::Q6_K, 210),
            (DType::MXFP4, 17),
            (DType::NVFP4, 36),
        ];
        for (d, n) in expect {
            assert_eq!(d.block_bytes(), n, "{d}");
        }
    }

    #[test]
    fn ids_round_trip() {
        for d in DType::ALL.into_iter().chain([DType::I32]) {
            match d.ggml_id() {
                Some(id) => assert_eq!(DType::from_ggml_id(id), Some(d)),
                None => assert_eq!(d, DType::F8_B128),
            }
        }
        assert_eq!(DType::from_ggml_id(4), None);
        assert_eq!(DType::from_ggml_id(u32::MAX), None);
    }

    #[test]
    fn bytes_for_rejects_partial_blocks_and_overflow() {
        assert!(DType::Q4_0.bytes_for(33).is_err());
        assert_eq!(DType::Q4_0.bytes_for(64).unwrap(), 36);
        assert!(DType::F32.bytes_for(usize::MAX).is_err());
    }
}
