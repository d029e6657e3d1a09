//! Fast row kernels (dequantize, row dot, matmul) on every SIMD tier this CPU
//! has, against the scalar references, on seeded random rows of odd sizes.
//!
//! Dequantizers must match the reference bit for bit. Dot products add in
//! a different order on each tier (lanes, tiles), so they are compared with
//! the f64 dot of the reference weights under [`REL_TOL`], like every other
//! f32 accumulation.

mod common;

use common::random_row;
use kvant_core::{DType, Storage, Tensor};
use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::matmul::{matmul, matmul_ref, matmul_with};
use kvant_kernels::quant;
use kvant_kernels::quant::{
    dequantize_row, dequantize_row_ref, dequantize_row_with, dot_row, dot_row_with,
};
use kvant_kernels::KernelError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f32 accumulation over at most a few thousand products: the error stays
/// far below 1e-5 of Σ|w·x| for random signs, while one wrong, missing or
/// duplicated term moves the result by ~1e-3 of it or more.
const REL_TOL: f64 = 1e-5;

/// Like [`random_row`], but with the minimum of each Q4_1/Q5_1 block set to
/// `-(levels/2)·d`, as a quantizer makes it for zero-centred weights: each
/// weight `d·q + m` is then a difference of nearly equal terms, which a
/// kernel that factored the block's `d·Σ q·x + m·Σ x` would round badly.
fn centred_row(rng: &mut ChaCha8Rng, dtype: DType, elements: usize) -> Vec<u8> {
    let half_levels = match dtype {
        DType::Q4_1 => 7.5f32,
        DType::Q5_1 => 15.5,
        _ => unreachable!("{dtype} has no per-block minimum"),
    };
    let mut row = random_row(rng, dtype, elements);
    for block in row.chunks_exact_mut(dtype.block_bytes()) {
        let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        let m = half::f16::from_f32(-half_levels * d);
        block[2..4].copy_from_slice(&m.to_le_bytes());
    }
    row
}

fn random_f32(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Row lengths of 1..=7 blocks, or odd lengths for the float types.
fn row_lengths(dtype: DType) -> Vec<usize> {
    if dtype.is_quantized() {
        (1..=7).map(|b| b * dtype.block_size()).collect()
    } else {
        vec![1, 7, 31, 67, 300, 1029]
    }
}

fn reference_values(dtype: DType, row: &[u8], elements: usize) -> Vec<f32> {
    let mut w = vec![f32::NAN; elements];
    dequantize_row_ref(dtype, row, &mut w).unwrap();
    w
}

fn assert_dot_close(got: f32, w: &[f32], x: &[f32], what: &str) {
    let want: f64 = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let scale: f64 = w
        .iter()
        .zip(x)
        .map(|(&a, &b)| (a as f64 * b as f64).abs())
        .sum();
    let err = (got as f64 - want).abs();
    assert!(
        err <= REL_TOL * scale + 1e-30,
        "{what}: got {got}, want {want}, error {err:e} over Σ|w·x| {scale:e}"
    );
}

#[test]
fn fast_dequantize_is_bit_identical_to_ref() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dtype in DType::ALL {
        for n in row_lengths(dtype) {
            let row = random_row(&mut rng, dtype, n);
            let want = reference_values(dtype, &row, n);
            assert!(
                want.iter().all(|v| v.is_finite()),
                "{dtype}: non-finite reference"
            );
            for tier in cpu::available_tiers() {
                let mut got = vec![f32::NAN; n];
                dequantize_row_with(tier, dtype, &row, &mut got).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype} {tier} n={n} element {i}: {g} vs {w}"
                    );
                }
            }
            let mut got = vec![f32::NAN; n];
            dequantize_row(dtype, &row, &mut got).unwrap();
            assert_eq!(got, want, "{dtype} start-up tier");
        }
    }
}

#[test]
fn dot_row_matches_f64_dot_of_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for dtype in DType::ALL {
        for n in row_lengths(dtype) {
            let row = random_row(&mut rng, dtype, n);
            check_dot_row(dtype, &row, &random_f32(&mut rng, n));
        }
    }
}

#[test]
fn dot_row_is_accurate_when_the_minimum_cancels_the_scale() {
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    for dtype in [DType::Q4_1, DType::Q5_1] {
        for n in row_lengths(dtype) {
            let row = centred_row(&mut rng, dtype, n);
            // Mostly positive activations make Σx large, so the two terms are large too.
            let x: Vec<f32> = (0..n).map(|_| rng.random_range(-0.2f32..1.0)).collect();
            check_dot_row(dtype, &row, &x);
        }
    }
}

fn check_dot_row(dtype: DType, row: &[u8], x: &[f32]) {
    let n = x.len();
    let w = reference_values(dtype, row, n);
    for tier in cpu::available_tiers() {
        let got = dot_row_with(tier, dtype, row, x).unwrap();
        assert_dot_close(got, &w, x, &format!("{dtype} {tier} n={n}"));
    }
    let got = dot_row(dtype, row, x).unwrap();
    assert_dot_close(got, &w, x, &format!("{dtype} start-up tier n={n}"));
}

/// A `[out, inp]` weight of random rows, stored one byte into its buffer so
/// every block is read from an unaligned address.
fn random_weight(rng: &mut ChaCha8Rng, dtype: DType, out: usize, inp: usize) -> Tensor {
    let mut bytes = vec![0xA5u8];
    for _ in 0..out {
        bytes.extend(random_row(rng, dtype, inp));
    }
    Tensor::new(dtype, vec![out, inp], Storage::Owned(bytes.into()), 1).unwrap()
}

fn check_matmul(tier: Option<SimdTier>, w: &Tensor, x: &[f32], n_tokens: usize) {
    let (out, inp) = (w.shape()[0], w.shape()[1]);
    let mut want = vec![f32::NAN; n_tokens * out];
    matmul_ref(w, x, n_tokens, &mut want).unwrap();
    let mut got = vec![f32::NAN; n_tokens * out];
    match tier {
        Some(t) => matmul_with(t, w, x, n_tokens, &mut got).unwrap(),
        None => matmul(w, x, n_tokens, &mut got).unwrap(),
    }
    let mut row = vec![0f32; inp];
    for (o, bytes) in w.bytes().chunks_exact(w.byte_len() / out).enumerate() {
        dequantize_row_ref(w.dtype(), bytes, &mut row).unwrap();
        for t in 0..n_tokens {
            let xt = &x[t * inp..(t + 1) * inp];
            let (g, r) = (got[t * out + o], want[t * out + o]);
            let what = format!(
                "{} {tier:?} [{out}x{inp}] t={t}/{n_tokens} o={o}",
                w.dtype()
            );
            assert_dot_close(g, &row, xt, &what);
            assert_dot_close(r, &row, xt, &format!("{what} (ref)"));
        }
    }
}

#[test]
fn matmul_matches_reference_for_every_dtype() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for dtype in DType::ALL {
        let inp = match dtype.block_size() {
            1 => 67,
            b => 3 * b,
        };
        // A last group of fewer than four rows (37 and 301 rows); tokens
        // go through the dot tiles of three (1, 2, 4, 5 and 7 leave every
        // remainder). `large_matmul_matches_reference`
        // covers the parallel split.
        for (out, tokens) in [(37, &[1usize, 2, 3, 7][..]), (301, &[1, 4, 5][..])] {
            let w = random_weight(&mut rng, dtype, out, inp);
            for &n_tokens in tokens {
                let x = random_f32(&mut rng, n_tokens * inp);
                for tier in cpu::available_tiers() {
                    check_matmul(Some(tier), &w, &x, n_tokens);
                }
                check_matmul(None, &w, &x, n_tokens);
            }
        }
    }
}

/// Calls are split across the pool only when each task gets enough work
/// (128 k multiply-adds), so a weight of a few MB runs the parallel paths,
/// with a ragged last task, for every type, with one token and with four. (When another test
/// holds the pool, the same tasks run on the calling thread.)
#[test]
fn large_matmul_matches_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    // 13 super-blocks per row: 1.1 MB even as Q2_K, the smallest type.
    let (out, inp) = (1001, 13 * 256);
    for dtype in DType::ALL {
        let w = random_weight(&mut rng, dtype, out, inp);
        for n_tokens in [1, 4] {
            let x = random_f32(&mut rng, n_tokens * inp);
            for tier in cpu::available_tiers() {
                check_matmul(Some(tier), &w, &x, n_tokens);
            }
        }
    }
}

#[test]
fn shape_errors_are_reported() {
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let w = random_weight(&mut rng, DType::Q4_0, 5, 64);
    let x = random_f32(&mut rng, 2 * 64);
    let mut y = vec![0f32; 2 * 5];
    assert!(matches!(
        matmul(&w, &x[..127], 2, &mut y),
        Err(KernelError::LengthMismatch { .. })
    ));
    assert!(matches!(
        matmul(&w, &x, 2, &mut y[..9]),
        Err(KernelError::LengthMismatch { .. })
    ));
    assert!(matches!(
        matmul_ref(&w, &x, 3, &mut y),
        Err(KernelError::LengthMismatch { .. })
    ));
    let flat = Tensor::new(
        DType::Q4_0,
        vec![320],
        Storage::Owned(vec![0u8; 180].into()),
        0,
    )
    .unwrap();
    assert!(matches!(
        matmul(&flat, &x, 1, &mut y),
        Err(KernelError::NotAMatrix { .. })
    ));

    let row = random_row(&mut rng, DType::Q4_K, 256);
    let mut dst = vec![0f32; 255];
    assert!(matches!(
        dequantize_row(DType::Q4_K, &row, &mut dst),
        Err(KernelError::Core(_))
    ));
    let x256 = random_f32(&mut rng, 256);
    assert!(matches!(
        dot_row(DType::Q4_K, &row[..143], &x256),
        Err(KernelError::LengthMismatch { .. })
    ));
    assert!(matches!(
        dequantize_row_ref(DType::Q6_K, &row, &mut [0f32; 256]),
        Err(KernelError::LengthMismatch { .. })
    ));
}

#[test]
fn empty_shapes_are_fine() {
    let empty = Tensor::new(
        DType::Q8_0,
        vec![3, 0],
        Storage::Owned(Vec::new().into()),
        0,
    )
    .unwrap();
    let mut y = vec![f32::NAN; 2 * 3];
    matmul(&empty, &[], 2, &mut y).unwrap();
    assert_eq!(y, vec![0.0; 6]);
    let mut y = vec![f32::NAN; 6];
    matmul_ref(&empty, &[], 2, &mut y).unwrap();
    assert_eq!(y, vec![0.0; 6]);
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let w = random_weight(&mut rng, DType::Q8_0, 3, 32);
    matmul(&w, &[], 0, &mut []).unwrap();
}

/// The Q8_0 quantizer round-trips within half a step of each block's scale
/// (plus up to 127 times the f16 rounding of the scale, 2⁻¹¹ relative), keeps zero blocks zero, and rejects
/// a destination of the wrong size.
#[test]
fn quantize_q8_0_round_trips() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for n in [32, 96, 32 * 17] {
        let mut x = random_f32(&mut rng, n);
        x[..32].iter_mut().for_each(|v| *v = 0.0);
        let mut q = vec![0u8; DType::Q8_0.bytes_for(n).expect("whole blocks")];
        quant::quantize_row_q8_0(&x, &mut q).expect("sizes agree");
        let mut back = vec![0f32; n];
        quant::dequantize_row_ref(DType::Q8_0, &q, &mut back).expect("sizes agree");
        for (xb, yb) in x.chunks_exact(32).zip(back.chunks_exact(32)) {
            let step = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (a, b) in xb.iter().zip(yb) {
                assert!(
                    (a - b).abs() <= (0.5 + 127.0 / 2048.0) * step + 1e-7,
                    "{a} vs {b}"
                );
            }
        }
        assert!(back[..32].iter().all(|&v| v == 0.0));
    }
    let mut short = vec![0u8; 33];
    assert!(quant::quantize_row_q8_0(&[0.0; 32], &mut short).is_err());
}

/// The Q4_0 quantizer follows ggml's `quantize_row_q4_0_ref`: the value of
/// largest magnitude maps to nibble 0 (`d = max / -8`), the others round
/// half up (`trunc(x / d + 8.5)`) and clamp at 15, so every value comes
/// back within half a step `|d|` (a full step at the clamped end), plus the
/// f16 rounding of `d`; zero blocks stay zero, a wrong size is an error.
#[test]
fn quantize_q4_0_matches_ggml_and_round_trips() {
    // A block worked by hand: x_j = j - 16, so max = -16, d = 2, and
    // nibble j = min(15, trunc((j - 16) / 2 + 8.5)).
    let x: Vec<f32> = (0..32).map(|j| j as f32 - 16.0).collect();
    let mut q = vec![0u8; 18];
    quant::quantize_row_q4_0(&x, &mut q).expect("one block");
    assert_eq!(half::f16::from_le_bytes([q[0], q[1]]).to_f32(), 2.0);
    let nib = |j: usize| ((j as f32 - 16.0) / 2.0 + 8.5).trunc().min(15.0) as u8;
    for j in 0..16 {
        assert_eq!(q[2 + j], nib(j) | (nib(j + 16) << 4), "byte {j}");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for n in [32, 96, 32 * 17] {
        let mut x = random_f32(&mut rng, n);
        x[..32].iter_mut().for_each(|v| *v = 0.0);
        let mut q = vec![0u8; DType::Q4_0.bytes_for(n).expect("whole blocks")];
        quant::quantize_row_q4_0(&x, &mut q).expect("sizes agree");
        let mut back = vec![0f32; n];
        quant::dequantize_row_ref(DType::Q4_0, &q, &mut back).expect("sizes agree");
        for (xb, yb) in x.chunks_exact(32).zip(back.chunks_exact(32)) {
            let step = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 8.0;
            // f16 rounding of d moves a value by at most 8 · 2⁻¹¹ steps.
            let slack = 8.0 / 2048.0 * step + 1e-7;
            for (a, b) in xb.iter().zip(yb) {
                let bound = match a.abs() / step > 7.5 {
                    true => step,
                    false => 0.5 * step,
                };
                assert!((a - b).abs() <= bound + slack, "{a} vs {b} (step {step})");
            }
        }
        assert!(back[..32].iter().all(|&v| v == 0.0));
    }
    let mut short = vec![0u8; 17];
    assert!(quant::quantize_row_q4_0(&[0.0; 32], &mut short).is_err());
}
