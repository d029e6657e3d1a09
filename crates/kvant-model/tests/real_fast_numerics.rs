//! The default, fast numerics (8-bit activations for Q4_0/Q4_1/Q5_0/Q8_0
//! weights, f16 KV cache) on the real models, against transformers running
//! the same GGUF dequantized to float32 (the fixtures of
//! `tools/reference/make_model_fixtures.py`).
//!
//! Free-running greedy text cannot be compared token for token: these
//! numerics move logits near the top by up to ~1 (measured: ≤ 1.10 on
//! SmolLM2, ≤ 0.74 on Gemma 3 over 4 prompts × 48 positions against the f32
//! path), and one flipped near-tie sends the rest of the text down another
//! path. So the reference's own greedy sequence is teacher-forced, and at
//! every step whose reference top-1/top-2 gap is at least
//! [`MIN_COMPARED_MARGIN`] the fast path must pick the same token.
//!
//! Needs `KVANT_MODEL` and `KVANT_GEMMA3_MODEL` (`bash .ci/run` fetches
//! both); with `KVANT_SKIP_REAL_MODEL=1` the tests are skipped.

mod common;

use common::ids;
use kvant_model::arch::decoder::{DecoderModel, Logits};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Twice the largest near-top logit deviation measured (see above): a gap
/// this wide cannot close under the fast path's noise.
const MIN_COMPARED_MARGIN: f64 = 2.5;

/// Last-prompt-position logits of the reference's top 20 tokens: the fast
/// path must stay within this of them. llama.cpp's own 8-bit activations
/// land 0.20–0.49 away on SmolLM2's four prompts; kvant's 0.18–0.44.
const TOP_LOGIT_TOL: f32 = 0.75;

fn model_path(var: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(var) {
        return Some(PathBuf::from(path));
    }
    if std::env::var("KVANT_SKIP_REAL_MODEL").as_deref() == Ok("1") {
        eprintln!("skipped: KVANT_SKIP_REAL_MODEL=1 and {var} is unset");
        return None;
    }
    panic!(
        "set {var} (`bash .ci/run` fetches the real models), or KVANT_SKIP_REAL_MODEL=1 to skip"
    );
}

fn check(model: &Path, fixture: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(fixture);
    let r: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let m: DecoderModel = kvant_model::load(model).unwrap().model;
    let vocab = m.config().vocab;
    let mut compared = 0;
    for p in r["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let prompt = ids(&p["prompt_ids"]);
        let greedy = ids(&p["greedy_ids"]);
        let margins: Vec<f64> = p["greedy_margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let seq: Vec<u32> = prompt.iter().chain(&greedy).copied().collect();
        let mut cache = m.new_cache(seq.len()).unwrap();
        let logits = m.forward(&seq, &mut cache, Logits::All).unwrap();
        let row = |pos: usize| &logits[pos * vocab..(pos + 1) * vocab];
        let last = row(prompt.len() - 1);
        for e in p["last_logits"]["top"].as_array().unwrap() {
            let (id, want) = (
                e[0].as_u64().unwrap() as usize,
                e[1].as_f64().unwrap() as f32,
            );
            assert!(
                (last[id] - want).abs() <= TOP_LOGIT_TOL,
                "{name}: logit of {id}: {} vs {want}",
                last[id]
            );
        }
        for (i, (&want, &margin)) in greedy.iter().zip(&margins).enumerate() {
            if margin < MIN_COMPARED_MARGIN {
                continue;
            }
            let r = row(prompt.len() - 1 + i);
            let top = (0..vocab).fold(0, |b, j| if r[j] > r[b] { j } else { b });
            assert_eq!(
                top as u32, want,
                "{name}: step {i} (reference margin {margin})"
            );
            compared += 1;
        }
    }
    assert!(
        compared >= 10,
        "{fixture}: only {compared} comparable steps"
    );
    eprintln!("{fixture}: {compared} teacher-forced steps agree");
}

#[test]
fn smollm2_fast_numerics_agree_with_transformers() {
    let Some(model) = model_path("KVANT_MODEL") else {
        return;
    };
    check(&model, "smollm2-135m-q4_1.reference.json");
}

#[test]
fn gemma3_fast_numerics_agree_with_transformers() {
    let Some(model) = model_path("KVANT_GEMMA3_MODEL") else {
        return;
    };
    check(&model, "gemma3-270m-q4_k_m.reference.json");
}
