//! Gemma 3 270M (Q4_K_M GGUF) against transformers running the same GGUF
//! dequantized to float32 (`tests/fixtures/models/gemma3-270m-q4_k_m.reference.json`):
//! SentencePiece tokenization with BOS and control tokens, greedy decoding,
//! and perplexity with windows both inside and beyond the 512-token sliding window.

mod common;
use common::*;
use std::path::Path;

/// Greedy steps whose reference top-1/top-2 gap is below this are not compared,
/// nor any after them: kvant and transformers sum the same float32 products in
/// different orders, which moves logits by about 1e-4, so such a step may
/// legitimately flip and every later token then follows another prefix.
const MIN_COMPARED_MARGIN: f64 = 1e-3;

/// The bound on perplexity; identical float32 math lands far inside it.
const PPL_REL_TOL: f64 = 0.005;

/// `$KVANT_GEMMA3_MODEL` (set by `.ci/run` after fetching the GGUF). `None`
/// only when `KVANT_SKIP_REAL_MODEL=1`.
fn gemma3_model() -> Option<String> {
    if std::env::var("KVANT_SKIP_REAL_MODEL").as_deref() == Ok("1") {
        eprintln!("KVANT_SKIP_REAL_MODEL=1: skipping a real-model test");
        return None;
    }
    match std::env::var("KVANT_GEMMA3_MODEL") {
        Ok(p) if Path::new(&p).is_file() => Some(p),
        _ => panic!(
            "set KVANT_GEMMA3_MODEL to gemma-3-270m-q4_k_m.gguf (`bash .ci/run` fetches it into \
             the kvant cache dir), or KVANT_SKIP_REAL_MODEL=1 to skip real-model tests"
        ),
    }
}

fn reference() -> serde_json::Value {
    json(&std::fs::read_to_string(fixture("models/gemma3-270m-q4_k_m.reference.json")).unwrap())
}

/// Reference greedy steps before the first one whose margin is too small to pin.
fn comparable_steps(p: &serde_json::Value) -> usize {
    let margins = p["greedy_margins"].as_array().unwrap();
    margins
        .iter()
        .position(|m| m.as_f64().unwrap() < MIN_COMPARED_MARGIN)
        .unwrap_or(margins.len())
}

#[test]
fn greedy_continuations_match_transformers() {
    let Some(model) = gemma3_model() else { return };
    let r = reference();
    for p in r["prompts"].as_array().unwrap() {
        let out = json(&kvant_ok(&[
            "generate",
            "--model",
            &model,
            "--prompt",
            p["text"].as_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "32",
            "--ignore-eos",
            "--json",
        ]));
        let name = p["name"].as_str().unwrap();
        assert_eq!(
            ids(&out["prompt_token_ids"]),
            ids(&p["prompt_ids"]),
            "{name}: prompt ids"
        );
        let n = comparable_steps(p);
        assert!(
            n >= 8,
            "{name}: only {n} comparable steps; pick another prompt"
        );
        assert_eq!(
            ids(&out["token_ids"])[..n],
            ids(&p["greedy_ids"])[..n],
            "{name}: greedy ids over the first {n} steps"
        );
        assert_eq!(out["completion_tokens"], 32);
        assert_eq!(out["finish_reason"], "length");
    }
}

fn check_perplexity(model: &str, r: &serde_json::Value) {
    let file = fixture("text/ppl.txt");
    let ctx = r["window"].to_string();
    let out = json(&kvant_ok(&[
        "perplexity",
        "--model",
        model,
        "--file",
        file.to_str().unwrap(),
        "--ctx",
        &ctx,
        "--json",
    ]));
    let (got, want) = (out["ppl"].as_f64().unwrap(), r["ppl"].as_f64().unwrap());
    assert!(
        (got / want - 1.0).abs() < PPL_REL_TOL,
        "ctx {ctx}: ppl {got} vs {want}"
    );
    assert_eq!(out["tokens_scored"], r["tokens_scored"], "ctx {ctx}");
    assert_eq!(out["windows"], r["windows"], "ctx {ctx}");
}

#[test]
fn perplexity_within_half_a_percent_of_transformers() {
    let Some(model) = gemma3_model() else { return };
    check_perplexity(&model, &reference()["perplexity"]);
}

/// 1024-token windows: the local layers' 512-token window masks keys here.
#[test]
fn perplexity_beyond_the_sliding_window_matches_transformers() {
    let Some(model) = gemma3_model() else { return };
    check_perplexity(&model, &reference()["perplexity_long"]);
}

#[test]
fn tokenizer_matches_reference_ids() {
    let Some(model) = gemma3_model() else { return };
    for c in reference()["tokenizer_cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let got = json(&kvant_ok(&["tokenize", "--model", &model, text]));
        assert_eq!(ids(&got), ids(&c["ids"]), "{text:?}");
    }
}
