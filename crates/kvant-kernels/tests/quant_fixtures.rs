//! Dequantizers against gguf's NumPy port of ggml (tests/fixtures/quant, made by
//! tools/reference/make_quant_fixtures.py).
//!
//! Both compute each weight with the same f32 operations in the same order
//! (no fused multiply-add), so the comparison is exact, bit for bit, for the
//! reference and for every fast path on every tier this CPU has.

use kvant_core::DType;
use kvant_kernels::cpu;
use kvant_kernels::quant::{dequantize_row_ref, dequantize_row_with};
use std::path::PathBuf;

/// Every type the fixture script writes: all but F32, whose "dequantization" is a copy.
fn fixture_types() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|&d| d != DType::F32)
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
    assert_eq!(json["ggml_type"].as_u64(), Some(dtype.ggml_id() as u64));
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
