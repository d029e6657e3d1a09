//! Random ggml blocks shared by the kernel tests and the matmul bench
//! (which includes this file by path): random packed bits, finite scales.

#![allow(dead_code)] // each test binary uses its own part

use kvant_core::DType;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Byte offsets of the f16 scale fields in one block (ggml-common.h); the
/// rest of a block is packed integers, where every bit pattern is valid.
/// Random bits in a scale could be NaN or huge, which would neither test
/// nor time like real weights.
fn scale_offsets(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 => &[],
        // Every e8m0 / ue4m3 scale byte is a finite scale; F8_B128's f32
        // scale is set by `random_block`.
        DType::MXFP4 | DType::NVFP4 | DType::F8_B128 => &[],
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
    }
}

/// One block of `dtype`: random bytes, then a random f16 in `±scale` in
/// each scale field.
pub fn random_block(rng: &mut ChaCha8Rng, dtype: DType, scale: f32) -> Vec<u8> {
    let mut block: Vec<u8> = (0..dtype.block_bytes()).map(|_| rng.random()).collect();
    for &off in scale_offsets(dtype) {
        let d = half::f16::from_f32(rng.random_range(-scale..scale));
        block[off..off + 2].copy_from_slice(&d.to_le_bytes());
    }
    if dtype == DType::MXFP4 {
        // Scales 2^-17..2^-1 as weights have them: a random e8m0 byte
        // reaches 2^127, whose products overflow.
        block[0] = rng.random_range(110..=126);
    }
    if dtype == DType::F8_B128 {
        // A finite f32 scale, and no NaN codes (the loader refuses them).
        let d = rng.random_range(-scale..scale) / 64.0;
        block[..4].copy_from_slice(&d.to_le_bytes());
        for q in &mut block[4..] {
            if *q & 0x7F == 0x7F {
                *q ^= 1;
            }
        }
    }
    block
}

/// A random row of `elements` values: values in ±1 for the float types;
/// random blocks with scales in ±0.05 for the block types.
pub fn random_row(rng: &mut ChaCha8Rng, dtype: DType, elements: usize) -> Vec<u8> {
    let mut bytes = Vec::new();
    match dtype {
        DType::F32 => {
            for _ in 0..elements {
                bytes.extend(rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        DType::F16 => {
            for _ in 0..elements {
                bytes.extend(half::f16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes());
            }
        }
        DType::BF16 => {
            for _ in 0..elements {
                bytes.extend(half::bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes());
            }
        }
        _ => {
            for _ in 0..elements / dtype.block_size() {
                bytes.extend(random_block(rng, dtype, 0.05));
            }
        }
    }
    assert_eq!(bytes.len(), dtype.bytes_for(elements).unwrap());
    bytes
}
