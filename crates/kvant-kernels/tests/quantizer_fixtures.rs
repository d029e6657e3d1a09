//! Quantizers against ggml's own reference quantizers
//! (tests/fixtures/quant/quantize.json, made by
//! tools/reference/make_quantizer_fixtures.py through a llama.cpp build's
//! `libggml-base.so`): the same bytes, for Q8_0, Q4_0, Q5_0 and Q4_K, on
//! ordinary and awkward rows (zeros, constant groups, groups whose scale
//! rounds to zero, outliers), on every tier this CPU has; and each tier
//! against the scalar reference on many random blocks.

use kvant_core::DType;
use kvant_kernels::cpu;
use kvant_kernels::quant::quantize_row_with;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;

fn hex(s: &str) -> Vec<u8> {
    let pairs = s.as_bytes().chunks_exact(2);
    assert!(pairs.remainder().is_empty(), "odd hex length");
    pairs
        .map(|p| {
            let digits = std::str::from_utf8(p).expect("ASCII hex");
            u8::from_str_radix(digits, 16).expect("hex digit")
        })
        .collect()
}

#[test]
fn quantizers_write_ggmls_bytes() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/quant/quantize.json");
    let text = std::fs::read_to_string(&path).expect("the fixture");
    let json: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    let cases = json["cases"].as_array().expect("cases");
    let mut seen = std::collections::BTreeMap::new();
    for c in cases {
        let name = c["type"].as_str().expect("type");
        let dtype = DType::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .unwrap_or_else(|| panic!("unknown type {name}"));
        let x: Vec<f32> = hex(c["input_f32_le"].as_str().expect("input"))
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let want = hex(c["expected"].as_str().expect("expected"));
        let source = c["source"].as_str().expect("source");
        for tier in cpu::available_tiers() {
            let mut got = vec![0u8; want.len()];
            quantize_row_with(tier, dtype, &x, &mut got).expect("quantizes");
            if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
                let bb = dtype.block_bytes();
                panic!(
                    "{name} {source} {tier:?}: byte {at} (block {}, offset {}) is {:#04x}, ggml wrote {:#04x}",
                    at / bb,
                    at % bb,
                    got[at],
                    want[at]
                );
            }
        }
        *seen.entry(name).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
}

/// 3,000 random Q4_K blocks (magnitudes from 1e-30 to 1e4 per group, signs
/// mixed or one-sided, some groups flat or zero): every tier writes the
/// scalar reference's bytes.
#[test]
fn q4_k_tiers_match_the_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let n = 256 * 3000;
    let mut x = vec![0f32; n];
    for g in x.chunks_exact_mut(32) {
        let scale = 10f32.powf(rng.random_range(-30.0..4.0));
        let kind = rng.random_range(0..6);
        for v in g.iter_mut() {
            *v = match kind {
                0 => 0.0,
                1 => scale,
                2 => rng.random_range(0.0..1.0) * scale,
                3 => -rng.random_range(0.0..1.0) * scale,
                _ => rng.random_range(-1.0..1.0) * scale,
            };
        }
    }
    let bytes = DType::Q4_K.bytes_for(n).expect("whole blocks");
    let mut want = vec![0u8; bytes];
    quantize_row_with(cpu::SimdTier::Scalar, DType::Q4_K, &x, &mut want).expect("quantizes");
    for tier in cpu::available_tiers() {
        let mut got = vec![0u8; bytes];
        quantize_row_with(tier, DType::Q4_K, &x, &mut got).expect("quantizes");
        let at = got.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(at, None, "{tier:?}: first differing byte");
    }
}
