//! The int8 path (packed weights × 8-bit activations) on every SIMD tier,
//! against the scalar kernel (bit for bit), an f64 product of the same
//! dequantized operands, and the unquantized activations (within the
//! rounding bound of 8-bit quantization), on seeded random matrices of odd
//! sizes.

use kvant_core::{DType, Storage, Tensor};
use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::int8::{gemm_ref, gemm_with, PackedMatrix, Q8Activations, BLOCK};
use kvant_kernels::linear::LinearWeight;
use kvant_kernels::quant::dequantize_row_ref;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f32 accumulation of one f32 term per block (exact integer block sums):
/// a few ulps of Σ|w·x| for rows of at most 48 blocks, while a wrong,
/// missing or duplicated block moves the result by ~1e-2 of it.
const REL_TOL: f64 = 1e-5;

const TYPES: [DType; 8] = [
    DType::MXFP4,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

/// A random `[rows, cols]` weight: random quants and sub-block scales,
/// finite f16 scales (and minimums for Q4_1, Q4_K and Q5_K).
fn random_weight(rng: &mut ChaCha8Rng, dtype: DType, rows: usize, cols: usize) -> Tensor {
    let scale_fields: &[usize] = match dtype {
        DType::Q4_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q6_K => &[208],
        DType::MXFP4 => &[],
        _ => &[0],
    };
    let mut bytes = Vec::new();
    for _ in 0..rows * cols / dtype.block_size() {
        let mut block: Vec<u8> = (0..dtype.block_bytes()).map(|_| rng.random()).collect();
        if dtype == DType::MXFP4 {
            // e8m0 scales 2^-17..2^-1.
            block[0] = rng.random_range(110..=126);
        }
        for &off in scale_fields {
            let s = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
            block[off..off + 2].copy_from_slice(&s.to_le_bytes());
        }
        bytes.extend(block);
    }
    Tensor::new(dtype, vec![rows, cols], Storage::Owned(bytes.into()), 0).unwrap()
}

fn dequantized(w: &Tensor) -> Vec<f32> {
    let mut out = vec![0f32; w.elements()];
    dequantize_row_ref(w.dtype(), w.bytes(), &mut out).unwrap();
    out
}

#[test]
fn every_tier_matches_the_scalar_kernel_and_the_f64_product() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dtype in TYPES {
        let shapes: &[(usize, usize)] = if dtype.block_size() == 256 {
            &[(1, 256), (7, 512), (9, 768), (17, 1536)]
        } else {
            &[(1, 32), (7, 64), (8, 96), (9, 160), (33, 576), (20, 1536)]
        };
        for &(rows, cols) in shapes {
            let w = random_weight(&mut rng, dtype, rows, cols);
            let packed = PackedMatrix::pack(&w).unwrap().unwrap();
            let wd = dequantized(&w);
            // Every tile width, and a full tile plus one.
            for n in [1usize, 2, 3, 4, 5, 7, 9, 17] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
                let mut xq = Q8Activations::default();
                xq.quantize(SimdTier::Scalar, &x, n, cols).unwrap();
                let mut want = vec![f32::NAN; n * rows];
                gemm_with(SimdTier::Scalar, &packed, &xq, &mut want).unwrap();
                let exact = gemm_ref(&wd, rows, &xq);
                let xd = xq.dequantize();
                for (i, (&got, &e)) in want.iter().zip(&exact).enumerate() {
                    let (t, r) = (i / rows, i % rows);
                    let mag: f64 = (0..cols)
                        .map(|j| (wd[r * cols + j] as f64 * xd[t * cols + j] as f64).abs())
                        .sum();
                    assert!(
                        (got as f64 - e).abs() <= REL_TOL * mag + 1e-30,
                        "{dtype} {rows}x{cols} n={n} [{t},{r}]: {got} vs {e}"
                    );
                }
                for tier in cpu::available_tiers() {
                    let mut got = vec![f32::NAN; n * rows];
                    gemm_with(tier, &packed, &xq, &mut got).unwrap();
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{dtype} {tier} {rows}x{cols} n={n}"
                    );
                }
            }
        }
    }
}

/// Against the f32 activations the only extra error is the activations'
/// rounding: at most half a step (`d_x / 2`) per value, so
/// `|Δy| ≤ Σ_i |w_i| · d_x(i) / 2` (plus the f32 accumulation above).
#[test]
fn error_against_f32_activations_is_within_the_quantization_bound() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for dtype in TYPES {
        let (rows, cols, n) = (
            17usize,
            if dtype.block_size() == 256 { 512 } else { 288 },
            3usize,
        );
        let w = random_weight(&mut rng, dtype, rows, cols);
        let packed = PackedMatrix::pack(&w).unwrap().unwrap();
        let wd = dequantized(&w);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
        let mut xq = Q8Activations::default();
        xq.quantize(cpu::tier(), &x, n, cols).unwrap();
        let mut y = vec![0f32; n * rows];
        gemm_with(cpu::tier(), &packed, &xq, &mut y).unwrap();
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            for r in 0..rows {
                let wr = &wd[r * cols..(r + 1) * cols];
                let f32_dot: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                let bound: f64 = wr
                    .chunks(BLOCK)
                    .zip(xt.chunks(BLOCK))
                    .map(|(wb, xb)| {
                        let step = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                        wb.iter().map(|&v| v.abs() as f64).sum::<f64>() * step / 2.0
                    })
                    .sum();
                let mag: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let err = (y[t * rows + r] as f64 - f32_dot).abs();
                assert!(
                    err <= bound * (1.0 + 1e-4) + REL_TOL * mag,
                    "{dtype} [{t},{r}]: error {err} over bound {bound}"
                );
            }
        }
    }
}

#[test]
fn packing_refuses_other_types_and_bad_shapes_are_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let f = Tensor::from_f32(vec![2, 32], &[0.5; 64]).unwrap();
    assert!(PackedMatrix::pack(&f).unwrap().is_none());
    let w = random_weight(&mut rng, DType::Q8_0, 3, 64);
    let packed = PackedMatrix::pack(&w).unwrap().unwrap();
    let mut xq = Q8Activations::default();
    xq.quantize(SimdTier::Scalar, &[1.0; 96], 1, 96).unwrap();
    assert!(gemm_with(SimdTier::Scalar, &packed, &xq, &mut [0.0; 3]).is_err());
    xq.quantize(SimdTier::Scalar, &[1.0; 128], 2, 64).unwrap();
    assert!(gemm_with(SimdTier::Scalar, &packed, &xq, &mut [0.0; 5]).is_err());
    let mut y = [f32::NAN; 6];
    gemm_with(SimdTier::Scalar, &packed, &xq, &mut y).unwrap();
    assert!(y.iter().all(|v| v.is_finite()));
}

/// The k-quants at the extremes of their integer sums, every product of
/// one sign. Q6_K: every weight at `q - 32 = -32` with activations all at
/// -127 after quantization, then every weight at 31 with activations at
/// 127, sub-block scales of -128 and 127: each i16 partial sum (`8·32·127 =
/// 32512`) and i32 block sum (`2·128·16·32·127`) is as large as it can be,
/// and in the second case the AVX2 kernel's raw `Σ q x` (`8·63·127`) wraps
/// its i16 before the offset comes off. Q5_K: every `q` 31, every scale 63
/// and activations at 127, the largest i16 partial sum (`8·31·127`). Q8_0:
/// every weight at -128 (which no quantizer writes, but a file may hold)
/// or 127, every activation at ±127: the VNNI kernel's offset sums
/// `Σ (w + 128) x` at their largest (`32·255·127`) and at zero. A
/// saturated or wrongly wrapped sum would be off by far more than the
/// tolerance; the tiers must also agree bit for bit.
#[test]
fn largest_sums_neither_saturate_nor_wrap() {
    let (rows, cols, n) = (9usize, 512usize, 7usize);
    for (dtype, fill, x) in [
        (DType::Q6_K, 0x00u8, -1.5f32),
        (DType::Q6_K, 0xFF, 1.5),
        (DType::Q5_K, 0xFF, 1.5),
        (DType::Q8_0, 0x80, 1.5),
        (DType::Q8_0, 0x80, -1.5),
        (DType::Q8_0, 0x7F, 1.5),
        (DType::Q8_0, 0x7F, -1.5),
        // Codes 7 and 15: ±6, doubled ±12, in both nibbles.
        (DType::MXFP4, 0x77, 1.5),
        (DType::MXFP4, 0xFF, 1.5),
        (DType::MXFP4, 0x77, -1.5),
    ] {
        let block_values = dtype.block_size();
        let mut bytes = Vec::new();
        for b in 0..rows * cols / block_values {
            let mut block = vec![fill; dtype.block_bytes()];
            let d = half::f16::from_f32(0.01).to_le_bytes();
            if dtype == DType::Q8_0 {
                block[0..2].copy_from_slice(&d);
            } else if dtype == DType::MXFP4 {
                block[0] = 120;
            } else if dtype == DType::Q6_K {
                for (j, sc) in block[192..208].iter_mut().enumerate() {
                    *sc = if (b + j) % 3 == 0 { 127 } else { 0x80 };
                }
                block[208..210].copy_from_slice(&d);
            } else {
                // d, then a zero dmin: no minimum term.
                block[0..4].copy_from_slice(&[d[0], d[1], 0, 0]);
            }
            bytes.extend(block);
        }
        let w = Tensor::new(dtype, vec![rows, cols], Storage::Owned(bytes.into()), 0).unwrap();
        let packed = PackedMatrix::pack(&w).unwrap().unwrap();
        let wd = dequantized(&w);
        let mut xq = Q8Activations::default();
        xq.quantize(SimdTier::Scalar, &vec![x; n * cols], n, cols)
            .unwrap();
        let exact = gemm_ref(&wd, rows, &xq);
        let mut scalar = vec![f32::NAN; n * rows];
        gemm_with(SimdTier::Scalar, &packed, &xq, &mut scalar).unwrap();
        for tier in cpu::available_tiers() {
            let mut y = vec![f32::NAN; n * rows];
            gemm_with(tier, &packed, &xq, &mut y).unwrap();
            if matches!(dtype, DType::Q8_0 | DType::MXFP4) {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y), bits(&scalar), "{dtype} {tier} {fill:#x} {x}");
            }
            for (&got, &e) in y.iter().zip(&exact) {
                // Every product has the same sign: |e| is Σ|w·x| itself.
                assert!(
                    (got as f64 - e).abs() <= REL_TOL * e.abs(),
                    "{dtype} {tier} {fill:#x}: {got} vs {e}"
                );
            }
        }
    }
}

/// The types with int8 kernels are packed when int8 is asked for, and kept
/// as stored otherwise.
#[test]
fn linear_weights_of_packed_types_take_the_int8_path_when_asked() {
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    for dtype in TYPES {
        let w = random_weight(&mut rng, dtype, 9, 512);
        assert!(
            matches!(
                LinearWeight::prepare(w.clone(), true).unwrap(),
                LinearWeight::Int8(_)
            ),
            "{dtype}"
        );
        assert!(
            matches!(
                LinearWeight::prepare(w, false).unwrap(),
                LinearWeight::Float(_)
            ),
            "{dtype}"
        );
    }
}
