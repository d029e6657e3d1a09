//! f16 and bf16 weights repacked 8 rows interleaved (`halfpack`), on every
//! SIMD tier, against the scalar kernel (bit for bit: the same FMA chains
//! per lane) and the f64 product of the same weights, on seeded odd sizes.

use kvant_core::{DType, Storage, Tensor};
use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::halfpack::{gemm_with, HalfMatrix};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f32 accumulation over at most 1536 products in one chain: each FMA
/// rounds once (2^-24 relative), so the error is within `cols · 2^-24` of
/// Σ|w·x| (< 1e-4 at 1536 columns, and a few ulps in practice); one wrong or
/// missing product moves the sum by ~1e-3 of it.
const REL_TOL: f64 = 1e-5;

#[test]
fn every_tier_matches_the_scalar_kernel_and_the_f64_product() {
    for dtype in [DType::F16, DType::BF16] {
        every_tier_matches(dtype);
    }
}

fn every_tier_matches(dtype: DType) {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for &(rows, cols) in &[
        (1usize, 1usize),
        (7, 3),
        (8, 64),
        (9, 101),
        (33, 576),
        (20, 1536),
        (70, 200),
        (200, 77),
        (130, 300),
        // 38 groups: the AVX-512 decode tile's widest (16 groups) runs;
        // bands of 16, 16 and 6 groups.
        (300, 33),
        // Two full bands and one of a single group; four and one.
        (264, 45),
        (520, 17),
    ] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (bytes, wd): (Vec<[u8; 2]>, Vec<f32>) = w
            .iter()
            .map(|&v| match dtype {
                DType::BF16 => {
                    let h = half::bf16::from_f32(v);
                    (h.to_le_bytes(), h.to_f32())
                }
                _ => {
                    let h = half::f16::from_f32(v);
                    (h.to_le_bytes(), h.to_f32())
                }
            })
            .unzip();
        let bytes: Vec<u8> = bytes.concat();
        let t = Tensor::new(dtype, vec![rows, cols], Storage::Owned(bytes.into()), 0).unwrap();
        let packed = HalfMatrix::pack(&t).unwrap().unwrap();
        assert_eq!(packed.is_bf16(), dtype == DType::BF16);
        for n in [1usize, 2, 3, 5, 6, 7, 12, 13, 25] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut want = vec![f32::NAN; n * rows];
            gemm_with(SimdTier::Scalar, &packed, &x, n, &mut want).unwrap();
            for (i, &got) in want.iter().enumerate() {
                let (tk, r) = (i / rows, i % rows);
                let terms = (0..cols).map(|j| wd[r * cols + j] as f64 * x[tk * cols + j] as f64);
                let exact: f64 = terms.clone().sum();
                let mag: f64 = terms.map(f64::abs).sum();
                assert!(
                    (got as f64 - exact).abs() <= REL_TOL * mag + 1e-30,
                    "{dtype} {rows}x{cols} n={n} [{tk},{r}]: {got} vs {exact}"
                );
            }
            for tier in cpu::available_tiers() {
                let mut got = vec![f32::NAN; n * rows];
                gemm_with(tier, &packed, &x, n, &mut got).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{dtype} {tier} {rows}x{cols} n={n}"
                );
            }
        }
    }
}

#[test]
fn other_types_are_not_packed_and_bad_shapes_are_errors() {
    let f = Tensor::from_f32(vec![2, 3], &[0.5; 6]).unwrap();
    assert!(HalfMatrix::pack(&f).unwrap().is_none());
    let bytes: Vec<u8> = (0..12).flat_map(|_| half::f16::ONE.to_le_bytes()).collect();
    let t = Tensor::new(DType::F16, vec![3, 4], Storage::Owned(bytes.into()), 0).unwrap();
    let p = HalfMatrix::pack(&t).unwrap().unwrap();
    assert!(gemm_with(SimdTier::Scalar, &p, &[1.0; 5], 1, &mut [0.0; 3]).is_err());
    assert!(gemm_with(SimdTier::Scalar, &p, &[1.0; 8], 2, &mut [0.0; 5]).is_err());
    let mut y = [0f32; 6];
    gemm_with(SimdTier::Scalar, &p, &[1.0; 8], 2, &mut y).unwrap();
    assert_eq!(y, [4.0; 6]);
}

/// f16 and bf16 matrices take the packed kernels whatever the activation
/// choice (the packing is exact); f32 stays as stored.
#[test]
fn half_weights_are_packed_for_every_linear_layer() {
    use kvant_kernels::linear::LinearWeight;
    for dtype in [DType::F16, DType::BF16] {
        let t = Tensor::new(dtype, vec![3, 4], Storage::Owned(vec![0u8; 24].into()), 0).unwrap();
        for int8 in [false, true] {
            let w = LinearWeight::prepare(t.clone(), int8).unwrap();
            assert!(matches!(w, LinearWeight::Half(_)), "{dtype} int8={int8}");
        }
    }
    let f = Tensor::from_f32(vec![2, 3], &[0.5; 6]).unwrap();
    let w = LinearWeight::prepare(f, false).unwrap();
    assert!(matches!(w, LinearWeight::Float(_)));
}

/// bf16 weights packed for `vdpbf16ps` (where the CPU has AVX-512 BF16):
/// on that tier, within f32 summation error of the f64 product with the
/// activations rounded to bf16 (to nearest even), the same bits for a
/// token alone or in any batch; on the other tiers, the exact scalar
/// kernel's bits (the activations unrounded).
#[test]
fn bf16_pairs_round_only_the_activations_and_are_batch_invariant() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for &(rows, cols) in &[
        (1usize, 1usize),
        (9, 7),
        (33, 576),
        (130, 301),
        (200, 64),
        (264, 45),
    ] {
        let w: Vec<half::bf16> = (0..rows * cols)
            .map(|_| half::bf16::from_f32(rng.random_range(-1.0..1.0)))
            .collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = Tensor::new(
            DType::BF16,
            vec![rows, cols],
            Storage::Owned(bytes.into()),
            0,
        )
        .unwrap();
        let exact = HalfMatrix::pack(&t).unwrap().unwrap();
        let packed = HalfMatrix::pack_with(&t, true).unwrap().unwrap();
        let pairs = cpu::tier() == SimdTier::Avx512 && cpu::has_avx512_bf16();
        assert_eq!(packed.bf16_activations(), pairs);
        for n in [1usize, 2, 3, 12, 13, 25] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let mut want = vec![f32::NAN; n * rows];
            gemm_with(SimdTier::Scalar, &exact, &x, n, &mut want).unwrap();
            for tier in cpu::available_tiers() {
                let mut got = vec![f32::NAN; n * rows];
                gemm_with(tier, &packed, &x, n, &mut got).unwrap();
                if !(pairs && tier == SimdTier::Avx512) {
                    assert_eq!(bits(&got), bits(&want), "{tier} {rows}x{cols} n={n}");
                    continue;
                }
                for (i, &g) in got.iter().enumerate() {
                    let (tk, r) = (i / rows, i % rows);
                    let xb = |j: usize| half::bf16::from_f32(x[tk * cols + j]).to_f64();
                    let terms = (0..cols).map(|j| w[r * cols + j].to_f64() * xb(j));
                    let e: f64 = terms.clone().sum();
                    let mag: f64 = terms.map(f64::abs).sum();
                    // One f32 rounding per addition (two per pair).
                    let tol = cols as f64 * f32::EPSILON as f64 * mag;
                    assert!(
                        (g as f64 - e).abs() <= tol + 1e-30,
                        "{rows}x{cols} n={n} [{tk},{r}]: {g} vs {e}"
                    );
                }
                for tk in 0..n {
                    let mut one = vec![f32::NAN; rows];
                    gemm_with(tier, &packed, &x[tk * cols..(tk + 1) * cols], 1, &mut one).unwrap();
                    assert_eq!(
                        bits(&one),
                        bits(&got[tk * rows..(tk + 1) * rows]),
                        "n={n} token {tk}"
                    );
                }
            }
        }
    }
}
