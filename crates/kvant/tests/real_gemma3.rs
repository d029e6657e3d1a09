//! Gemma 3 270M (Q4_K_M GGUF) against transformers running the same GGUF
//! dequantized to float32 (`tests/fixtures/models/gemma3-270m-q4_k_m.reference.json`):
//! SentencePiece tokenization with BOS and control tokens, greedy decoding,
//! and perplexity with windows both inside and beyond the 512-token sliding window.

mod common;
use common::*;

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
    real_checkpoint(
        "KVANT_GEMMA3_MODEL",
        "gemma-3-270m-q4_k_m.gguf (`bash .ci/run` fetches it into the kvant cache dir)",
    )
}

fn reference() -> serde_json::Value {
    model_reference("gemma3-270m-q4_k_m")
}

#[test]
fn greedy_continuations_match_transformers() {
    let Some(model) = gemma3_model() else { return };
    let r = reference();
    for p in r["prompts"].as_array().unwrap() {
        let (out, name) = greedy_from_reference(&model, p);
        let n = comparable_steps(p, MIN_COMPARED_MARGIN);
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

fn check_perplexity(model: &str, r: &serde_json::Value, extra: &[&str], tol: f64) {
    let file = fixture("text/ppl.txt");
    let ctx = r["window"].to_string();
    let mut args = vec![
        "perplexity",
        "--model",
        model,
        "--file",
        file.to_str().unwrap(),
        "--ctx",
        &ctx,
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = json(&kvant_ok(&args));
    let (got, want) = (out["ppl"].as_f64().unwrap(), r["ppl"].as_f64().unwrap());
    assert!(
        (got / want - 1.0).abs() < tol,
        "ctx {ctx}: ppl {got} vs {want}"
    );
    assert_eq!(out["tokens_scored"], r["tokens_scored"], "ctx {ctx}");
    assert_eq!(out["windows"], r["windows"], "ctx {ctx}");
}

#[test]
fn perplexity_within_half_a_percent_of_transformers() {
    let Some(model) = gemma3_model() else { return };
    check_perplexity(&model, &reference()["perplexity"], EXACT, PPL_REL_TOL);
}

/// The default numerics (8-bit activations on its Q5_0/Q8_0 tensors, f16
/// KV; kvant-model's `real_fast_numerics` checks their logits): perplexity
/// within 1%.
#[test]
fn fast_numerics_perplexity_within_one_percent() {
    let Some(model) = gemma3_model() else { return };
    check_perplexity(&model, &reference()["perplexity_long"], &[], 0.01);
}

/// 1024-token windows: the local layers' 512-token window masks keys here.
#[test]
fn perplexity_beyond_the_sliding_window_matches_transformers() {
    let Some(model) = gemma3_model() else { return };
    check_perplexity(&model, &reference()["perplexity_long"], EXACT, PPL_REL_TOL);
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
