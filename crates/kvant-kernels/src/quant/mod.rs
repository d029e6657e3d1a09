//! Block-quantized formats: dequantizers and row dot products for every GGUF
//! weight type kvant reads.
//!
//! Each format lives in its own file with a scalar `dequantize_ref` that
//! follows ggml's `dequantize_row_*` (ggml-quants.c) operation for operation,
//! so it matches the gguf Python package bit for bit. Every format also has
//! an AVX2 dequantizer that is bit-identical to the reference (f32 needs
//! none). [`RowKernel`] is the per-type table (in the spirit of ggml's type
//! traits) that the row dot product and the matmul look kernels up in, once
//! per call: both dequantize into a buffer that stays in L1 and dot the
//! floats with the tier's f32 kernels (`crate::dot`), so a format's only
//! fast kernel is its dequantizer.

mod fields;
mod float;
pub mod fp8;
pub(crate) mod mxfp4;
mod nvfp4;
mod q2_k;
mod q3_k;
pub(crate) mod q4_0;
mod q4_1;
pub(crate) mod q4_k;
pub(crate) mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
pub(crate) mod q8_0;
mod requantize;
#[cfg(target_arch = "x86_64")]
mod simd;

pub(crate) use fields::{e8m0_half, E2M1_DOUBLED};
pub use requantize::{quantize_tensor, quantized_type};

use crate::cpu::{self, SimdTier};
use crate::dot::dot_f32_with;
use crate::error::{check_len, KernelError};
use kvant_core::dtype::QK_K;
use kvant_core::DType;

/// Dequantizes whole blocks from `src` into `dst`. `unsafe` because the fast
/// variants need the CPU features of the tier they were chosen for; every
/// variant stays within both slices even if their lengths disagree.
type DequantFn = unsafe fn(&[u8], &mut [f32]);

/// Elements dequantized at a time by [`dot_row`]: one k-quant super-block, or
/// eight legacy blocks; the buffer stays in L1 next to the slice of `x`.
const CHUNK: usize = QK_K;

/// The scalar reference dequantizer of each type.
fn ref_dequantizer(dtype: DType) -> fn(&[u8], &mut [f32]) {
    match dtype {
        DType::F32 => float::dequantize_f32,
        DType::F16 => float::dequantize_f16_ref,
        DType::BF16 => float::dequantize_bf16_ref,
        DType::Q4_0 => q4_0::dequantize_ref,
        DType::Q4_1 => q4_1::dequantize_ref,
        DType::Q5_0 => q5_0::dequantize_ref,
        DType::Q5_1 => q5_1::dequantize_ref,
        DType::Q8_0 => q8_0::dequantize_ref,
        DType::Q2_K => q2_k::dequantize_ref,
        DType::Q3_K => q3_k::dequantize_ref,
        DType::Q4_K => q4_k::dequantize_ref,
        DType::Q5_K => q5_k::dequantize_ref,
        DType::Q6_K => q6_k::dequantize_ref,
        DType::MXFP4 => mxfp4::dequantize_ref,
        DType::NVFP4 => nvfp4::dequantize_ref,
        DType::F8_B128 => fp8::dequantize_ref,
        DType::I32 => float::dequantize_i32,
    }
}

/// The AVX2 dequantizer of a type (f32 rows are only copied: the reference does).
#[cfg(target_arch = "x86_64")]
fn avx2_dequantizer(dtype: DType) -> Option<DequantFn> {
    Some(match dtype {
        DType::F16 => float::avx2::dequantize_f16,
        DType::BF16 => float::avx2::dequantize_bf16,
        DType::Q4_0 => q4_0::avx2::dequantize,
        DType::Q4_1 => q4_1::avx2::dequantize,
        DType::Q5_0 => q5_0::avx2::dequantize,
        DType::Q5_1 => q5_1::avx2::dequantize,
        DType::Q8_0 => q8_0::avx2::dequantize,
        DType::Q2_K => q2_k::avx2::dequantize,
        DType::Q3_K => q3_k::avx2::dequantize,
        DType::Q4_K => q4_k::avx2::dequantize,
        DType::Q5_K => q5_k::avx2::dequantize,
        DType::Q6_K => q6_k::avx2::dequantize,
        DType::MXFP4 => mxfp4::avx2::dequantize,
        DType::NVFP4 => nvfp4::avx2::dequantize,
        DType::F8_B128 => fp8::avx2::dequantize,
        DType::F32 | DType::I32 => return None,
    })
}

/// Row kernels for one type on one tier, looked up once per call.
#[derive(Clone, Copy)]
pub(crate) struct RowKernel {
    tier: SimdTier,
    block: usize,
    block_bytes: usize,
    dequantize: DequantFn,
}

impl RowKernel {
    /// The fastest kernels for `dtype` on `tier`, lowered to what the CPU runs.
    pub(crate) fn new(dtype: DType, tier: SimdTier) -> RowKernel {
        let tier = cpu::clamp(tier);
        let reference: DequantFn = ref_dequantizer(dtype);
        #[cfg(target_arch = "x86_64")]
        let dequantize = match tier {
            SimdTier::Scalar => reference,
            SimdTier::Avx2 | SimdTier::Avx512 => avx2_dequantizer(dtype).unwrap_or(reference),
        };
        #[cfg(not(target_arch = "x86_64"))]
        let dequantize = reference;
        RowKernel {
            tier,
            block: dtype.block_size(),
            block_bytes: dtype.block_bytes(),
            dequantize,
        }
    }

    /// The reference kernels for `dtype`.
    pub(crate) fn reference(dtype: DType) -> RowKernel {
        RowKernel {
            dequantize: ref_dequantizer(dtype),
            ..RowKernel::new(dtype, SimdTier::Scalar)
        }
    }

    pub(crate) fn tier(&self) -> SimdTier {
        self.tier
    }

    /// Bytes of `elements` values; the caller has checked `elements` is whole blocks.
    fn bytes_for(&self, elements: usize) -> usize {
        elements / self.block * self.block_bytes
    }

    /// Dequantizes whole blocks. Callers check lengths once per call; a
    /// mismatch here gives wrong numbers (caught by debug assertions), never
    /// an out-of-bounds access.
    pub(crate) fn dequantize(&self, src: &[u8], dst: &mut [f32]) {
        debug_assert_eq!(dst.len() % self.block, 0);
        debug_assert_eq!(src.len(), self.bytes_for(dst.len()));
        // SAFETY: `self.dequantize` was chosen in `new` for a tier that
        // `cpu::clamp` lowered to one this CPU supports; every variant bounds
        // its accesses by both slice lengths.
        unsafe { (self.dequantize)(src, dst) }
    }

    /// `Σ w[i]·x[i]` for one row, dequantizing a chunk at a time into a
    /// stack buffer and dotting it with the tier's f32 dot. Lengths are
    /// checked by the caller, as for [`Self::dequantize`].
    pub(crate) fn dot(&self, row: &[u8], x: &[f32]) -> f32 {
        let mut buf = [0f32; CHUNK];
        let chunk_bytes = self.bytes_for(CHUNK);
        let mut acc = 0f32;
        for (src, xs) in row.chunks(chunk_bytes).zip(x.chunks(CHUNK)) {
            let w = &mut buf[..xs.len()];
            self.dequantize(src, w);
            acc += dot_f32_with(self.tier, w, xs);
        }
        acc
    }
}

/// Checks that `src` holds exactly the blocks of `elements` values of `dtype`.
fn check_row(dtype: DType, src: &[u8], elements: usize) -> Result<(), KernelError> {
    check_len("quantized row bytes", dtype.bytes_for(elements)?, src.len())
}

/// Dequantizes one row (or any run of whole blocks) with the start-up tier's
/// fastest kernel. `src.len()` must equal `dtype.bytes_for(dst.len())`.
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    dequantize_row_with(cpu::tier(), dtype, src, dst)
}

/// [`dequantize_row`] on a given tier (lowered to one the CPU supports).
pub fn dequantize_row_with(
    tier: SimdTier,
    dtype: DType,
    src: &[u8],
    dst: &mut [f32],
) -> Result<(), KernelError> {
    check_row(dtype, src, dst.len())?;
    RowKernel::new(dtype, tier).dequantize(src, dst);
    Ok(())
}

/// Quantizes `src` (whole 32-value blocks) to Q8_0 blocks in `dst`, as
/// ggml's reference quantizer does.
///
/// # Errors
/// [`KernelError`] unless `dst` holds exactly the blocks of `src`.
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_row(DType::Q8_0, dst, src.len())?;
    q8_0::quantize_ref(src, dst);
    Ok(())
}

/// Quantizes `src` (whole 32-value blocks) to Q4_0 blocks in `dst`, as
/// ggml's reference quantizer does.
///
/// # Errors
/// [`KernelError`] unless `dst` holds exactly the blocks of `src`.
pub fn quantize_row_q4_0(src: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    check_row(DType::Q4_0, dst, src.len())?;
    q4_0::quantize_ref(src, dst);
    Ok(())
}

/// Quantizes `src` (whole blocks of `dtype`) to `dtype` in `dst` as ggml's
/// reference quantizer does (without an importance matrix): Q8_0, Q4_0,
/// Q5_0, Q4_K and MXFP4, the bytes `llama-quantize` writes.
///
/// # Errors
/// [`KernelError::UnsupportedDType`] for another type; [`KernelError`]
/// unless `dst` holds exactly the blocks of `src`.
pub fn quantize_row(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    quantize_row_with(cpu::tier(), dtype, src, dst)
}

/// [`quantize_row`] on a given tier (lowered to one the CPU supports):
/// every tier writes the same bytes.
pub fn quantize_row_with(
    tier: SimdTier,
    dtype: DType,
    src: &[f32],
    dst: &mut [u8],
) -> Result<(), KernelError> {
    let quantize: fn(&[f32], &mut [u8]) = match dtype {
        DType::Q8_0 => q8_0::quantize_ref,
        DType::Q4_0 => q4_0::quantize_ref,
        DType::Q5_0 => q5_0::quantize_ref,
        DType::Q4_K => q4_k::quantize_ref,
        DType::MXFP4 => mxfp4::quantize_ref,
        dtype => {
            return Err(KernelError::UnsupportedDType {
                op: "quantize_row",
                dtype,
            })
        }
    };
    check_row(dtype, dst, src.len())?;
    #[cfg(target_arch = "x86_64")]
    if dtype == DType::Q4_K && cpu::clamp(tier) >= SimdTier::Avx2 {
        // SAFETY: `clamp` lowered the tier to one the CPU supports.
        unsafe { q4_k::quantize_avx2(src, dst) };
        return Ok(());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = tier;
    quantize(src, dst);
    Ok(())
}

/// The scalar reference dequantizer, matching ggml's `dequantize_row_*`.
pub fn dequantize_row_ref(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    check_row(dtype, src, dst.len())?;
    RowKernel::reference(dtype).dequantize(src, dst);
    Ok(())
}

/// `Σ W[i]·x[i]` for one stored row of `dtype`, accumulated in f32.
pub fn dot_row(dtype: DType, row: &[u8], x: &[f32]) -> Result<f32, KernelError> {
    dot_row_with(cpu::tier(), dtype, row, x)
}

/// [`dot_row`] on a given tier (lowered to one the CPU supports).
pub fn dot_row_with(
    tier: SimdTier,
    dtype: DType,
    row: &[u8],
    x: &[f32],
) -> Result<f32, KernelError> {
    check_row(dtype, row, x.len())?;
    Ok(RowKernel::new(dtype, tier).dot(row, x))
}
