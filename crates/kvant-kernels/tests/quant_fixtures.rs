//! Dequantizers against gguf's NumPy port of ggml (tests/fixtures/quant, made by
//! tools/reference/make_quant_fixtures.py), and quantizers against ggml's own
//! reference quantizers (tests/fixtures/quant/quantize.json, made by
//! tools/reference/make_quantizer_fixtures.py through a llama.cpp build's
//! `libggml-base.so`).
//!
//! Both sides compute each value with the same f32 operations in the same
//! order (no fused multiply-add), so the comparisons are exact, bit for bit,
//! for the references and for every fast path on every tier this CPU has.

use kvant_core::DType;
use kvant_kernels::cpu;
use kvant_kernels::quant::{dequantize_row_ref, dequantize_row_with, quantize_row_with};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;

/// Every type the fixture script writes: all but F32, whose "dequantization" is a copy.
fn fixture_types() -> impl Iterator<Item = DType> {
    DType::ALL
        .into_iter()
        .filter(|&d| d != DType::F32 && d.ggml_id().is_some())
}

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

struct Case {
    source: String,
    raw: Vec<u8>,
    expected: Vec<f32>,
}

fn load(dtype: DType) -> Vec<Case> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quant")
        .join(format!("{}.json", dtype.name()));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run tools/reference/make_quant_fixtures.py",
            path.display()
        )
    });
    let json: serde_json::Value = serde_json::from_str(&text).expect("fixture JSON");
    assert_eq!(json["ggml_type"].as_u64(), dtype.ggml_id().map(u64::from));
    assert_eq!(json["block_size"].as_u64(), Some(dtype.block_size() as u64));
    assert_eq!(json["type_size"].as_u64(), Some(dtype.block_bytes() as u64));
    let cases = json["cases"].as_array().expect("cases");
    cases
        .iter()
        .map(|c| {
            let expected: Vec<f32> = hex(c["expected_f32_le"].as_str().expect("expected"))
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(c["elements"].as_u64(), Some(expected.len() as u64));
            Case {
                source: c["source"].as_str().expect("source").to_owned(),
                raw: hex(c["raw"].as_str().expect("raw")),
                expected,
            }
        })
        .collect()
}

fn assert_bits_equal(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: got {g:e}, gguf gives {w:e}"
        );
    }
}

#[test]
fn reference_dequantizers_match_gguf_exactly() {
    for dtype in fixture_types() {
        let cases = load(dtype);
        assert!(!cases.is_empty(), "{dtype}: no cases");
        for case in cases {
            let mut got = vec![f32::NAN; case.expected.len()];
            dequantize_row_ref(dtype, &case.raw, &mut got).expect("dequantize_row_ref");
            assert_bits_equal(
                &got,
                &case.expected,
                &format!("{dtype} {} ref", case.source),
            );
        }
    }
}

#[test]
fn fast_dequantizers_match_gguf_exactly_on_every_tier() {
    for dtype in fixture_types() {
        for case in load(dtype) {
            for tier in cpu::available_tiers() {
                let mut got = vec![f32::NAN; case.expected.len()];
                dequantize_row_with(tier, dtype, &case.raw, &mut got).expect("dequantize_row");
                let what = format!("{dtype} {} {tier}", case.source);
                assert_bits_equal(&got, &case.expected, &what);
            }
        }
    }
}

/// Q8_0, Q4_0, Q5_0 and Q4_K write ggml's bytes on ordinary and awkward
/// rows (zeros, constant groups, groups whose scale rounds to zero, outliers).
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
    assert_eq!(seen.len(), 5, "{seen:?}");
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
