//! Helpers shared by the CLI integration tests (included with `mod common`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixture(rel: &str) -> PathBuf {
    repo().join("tests/fixtures").join(rel)
}

pub fn kvant(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvant"))
        .args(args)
        .env_remove("KVANT_MODEL")
        .output()
        .expect("running kvant")
}

/// Runs kvant, asserts success, returns stdout.
pub fn kvant_ok(args: &[&str]) -> String {
    let out = kvant(args);
    assert!(
        out.status.success(),
        "kvant {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Runs kvant expecting failure; returns stderr.
pub fn kvant_err(args: &[&str]) -> String {
    let out = kvant(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "kvant {args:?}: {stderr}");
    assert!(
        !stderr.contains("panicked"),
        "kvant {args:?} panicked: {stderr}"
    );
    stderr
}

/// The real default model: `$KVANT_MODEL` (set by `.ci/run` after
/// `kvant fetch`). `None` only when `KVANT_SKIP_REAL_MODEL=1`.
pub fn real_model() -> Option<String> {
    real_checkpoint(
        "KVANT_MODEL",
        "the default model (`cargo run -p kvant -- fetch` prints its path)",
    )
}

/// The real checkpoint `$var` names, `what` being what it should name.
/// `None` only when `KVANT_SKIP_REAL_MODEL=1`; panics when it is unset.
pub fn real_checkpoint(var: &str, what: &str) -> Option<String> {
    if std::env::var("KVANT_SKIP_REAL_MODEL").as_deref() == Ok("1") {
        eprintln!("KVANT_SKIP_REAL_MODEL=1: skipping a real-model test");
        return None;
    }
    match std::env::var(var) {
        Ok(p) if Path::new(&p).is_file() => Some(p),
        _ => panic!("set {var} to {what}, or KVANT_SKIP_REAL_MODEL=1 to skip real-model tests"),
    }
}

pub fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("bad JSON {s:?}: {e}"))
}

/// A transformers reference under `tests/fixtures/models/` (`NAME.reference.json`).
pub fn model_reference(name: &str) -> serde_json::Value {
    let path = fixture(&format!("models/{name}.reference.json"));
    json(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// 32 greedy tokens of reference prompt `p`, checked to start from the
/// reference's prompt ids; the output and the prompt's name.
pub fn greedy_from_reference<'a>(
    model: &str,
    p: &'a serde_json::Value,
) -> (serde_json::Value, &'a str) {
    let out = greedy_32(model, p["text"].as_str().expect("prompt text"), EXACT);
    let name = p["name"].as_str().expect("prompt name");
    assert_eq!(
        ids(&out["prompt_token_ids"]),
        ids(&p["prompt_ids"]),
        "{name}: prompt ids"
    );
    (out, name)
}

pub fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

/// Flags for kvant's f32 numerics (f32 activations and KV cache): the mode
/// in which outputs match an f32 reference to rounding.
pub const EXACT: &[&str] = &["--f32-activations", "--kv-cache-type", "f32"];

/// Reference greedy steps before the first one whose margin is below `min`.
pub fn comparable_steps(p: &serde_json::Value, min: f64) -> usize {
    let margins = p["greedy_margins"].as_array().expect("greedy_margins");
    margins
        .iter()
        .position(|m| m.as_f64().expect("margin") < min)
        .unwrap_or(margins.len())
}

/// `kvant generate` arguments for `n` greedy tokens of `text` as JSON, EOS
/// ignored, plus `extra` flags.
pub fn greedy_args(model: &str, text: &str, n: usize, extra: &[&str]) -> Vec<String> {
    let n = n.to_string();
    let base = [
        "generate",
        "--model",
        model,
        "--prompt",
        text,
        "--temperature",
        "0",
        "--max-tokens",
        &n,
        "--ignore-eos",
        "--json",
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// `kvant perplexity` arguments for the fixture text in windows of `ctx`
/// tokens, as JSON, plus `extra` flags.
pub fn perplexity_args(model: &str, ctx: usize, extra: &[&str]) -> Vec<String> {
    let file = fixture("text/ppl.txt");
    let file = file.to_str().expect("utf-8 fixture path");
    let ctx = ctx.to_string();
    let base = [
        "perplexity",
        "--model",
        model,
        "--file",
        file,
        "--ctx",
        &ctx,
        "--json",
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// Borrowed views of owned arguments.
pub fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `kvant generate` of `text`: greedy, 32 tokens, EOS ignored, JSON, plus `extra` flags.
pub fn greedy_32(model: &str, text: &str, extra: &[&str]) -> serde_json::Value {
    json(&kvant_ok(&strs(&greedy_args(model, text, 32, extra))))
}
