//! Constrained decoding end to end on a tiny real checkpoint (a Q4_0 GGUF
//! with a 320-token byte-level BPE vocabulary): sampled outputs match their
//! grammar, unconstrained requests batched with constrained ones keep their
//! tokens, and grammars the engine cannot compile are refused.

mod common;
use common::{collect, fixture, submit};
use kvant_engine::grammar::{Grammar, GrammarCompiler, GrammarError};
use kvant_engine::serving::{EngineConfig, EngineHandle, EngineRequest, EngineThread};
use kvant_engine::{FinishReason, SamplingParams};
use kvant_model::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::sync::Arc;

const DENSE: &str = "gguf/llama-gqa.Q4_0.gguf";

fn start() -> (EngineHandle, EngineThread, Arc<Tokenizer>, GrammarCompiler) {
    let m = kvant_model::load(&fixture(DENSE)).expect("fixture loads");
    let tokenizer = Arc::new(m.tokenizer);
    let compiler = GrammarCompiler::new(&tokenizer).expect("grammar tables build");
    let (h, t) = EngineHandle::start(
        Arc::new(m.model),
        Arc::clone(&tokenizer),
        EngineConfig::default(),
    )
    .expect("engine starts");
    (h, t, tokenizer, compiler)
}

/// A request sampled at temperature 1 (a random model spreads its
/// probability over many tokens, so the mask does the work).
fn sampled(prompt: Vec<u32>, seed: u64, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..SamplingParams::default()
        },
        ..EngineRequest::greedy(prompt, max_tokens)
    }
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": false
    })
}

fn check_object(v: &Value) -> Result<(), String> {
    let o = v.as_object().ok_or("not an object")?;
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    if keys != ["age", "name", "ok", "tags"] {
        return Err(format!("keys {keys:?}"));
    }
    let name = o["name"].as_str().ok_or("name is not a string")?;
    if name.chars().count() > 12 {
        return Err(format!("name {name:?} is longer than 12"));
    }
    let age = o["age"]
        .as_u64()
        .ok_or("age is not a non-negative integer")?;
    if age > 150 {
        return Err(format!("age {age} > 150"));
    }
    let tags = o["tags"].as_array().ok_or("tags is not an array")?;
    if tags.len() > 3
        || tags
            .iter()
            .any(|t| !["a", "bc", "def"].contains(&t.as_str().unwrap_or("")))
    {
        return Err(format!("tags {tags:?}"));
    }
    o["ok"].as_bool().ok_or("ok is not a boolean")?;
    Ok(())
}

#[test]
fn sampled_outputs_match_their_json_schema() {
    let (h, _t, tok, compiler) = start();
    let grammar = Grammar::JsonSchema(schema());
    let base = compiler.compile(&grammar).expect("schema compiles");
    let rxs: Vec<_> = (0..24u64)
        .map(|seed| {
            let mut req = sampled(vec![1, 40 + seed as u32, 7], seed, 200);
            req.constraint = Some(base.clone());
            submit(&h, req)
        })
        .collect();
    for (seed, rx) in rxs.iter().enumerate() {
        let (ids, reason, _) = collect(rx);
        let text = tok.decode(&ids, true).expect("decodes");
        assert_eq!(reason, FinishReason::Stop, "seed {seed}: {text:?}");
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        if let Err(e) = check_object(&v) {
            panic!("seed {seed}: {text} breaks the schema: {e}");
        }
    }
}

#[test]
fn sampled_outputs_match_their_regex_and_lark_grammar() {
    let (h, _t, tok, compiler) = start();
    let cases = [
        (
            Grammar::Regex(r"[a-z]{2,6}( [a-z]{1,5}){1,3}\.".into()),
            r"^[a-z]{2,6}( [a-z]{1,5}){1,3}\.$",
        ),
        (
            Grammar::Lark("start: \"(\" num (\"+\" num)* \")\"\nnum: /[1-9][0-9]{0,2}/".into()),
            r"^\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2})*\)$",
        ),
    ];
    for (grammar, check) in cases {
        let c = compiler.compile(&grammar).expect("grammar compiles");
        let check = regex::Regex::new(check).expect("check regex");
        let rxs: Vec<_> = (0..12u64)
            .map(|seed| {
                let mut req = sampled(vec![1, 9, 9 + seed as u32], seed, 120);
                req.constraint = Some(c.clone());
                submit(&h, req)
            })
            .collect();
        for rx in &rxs {
            let (ids, reason, _) = collect(rx);
            let text = tok.decode(&ids, true).expect("decodes");
            assert!(check.is_match(&text), "{grammar:?}: {text:?}");
            assert_eq!(reason, FinishReason::Stop, "{text:?}");
        }
    }
}

/// Masks change only the sequences they belong to: a plain request batched
/// with constrained ones samples exactly the tokens it samples alone.
#[test]
fn plain_requests_beside_constrained_ones_keep_their_tokens() {
    let (h, _t, _tok, compiler) = start();
    let plain = |seed: u64| {
        let mut r = sampled(vec![1, 60 + seed as u32, 5, 6], seed, 40);
        r.ignore_eos = true;
        r
    };
    let alone: Vec<Vec<u32>> = (0..4).map(|s| collect(&submit(&h, plain(s))).0).collect();
    let c = compiler
        .compile(&Grammar::JsonSchema(schema()))
        .expect("schema compiles");
    let mut rxs = Vec::new();
    for seed in 0..4u64 {
        let mut req = sampled(vec![1, 2, 3], 100 + seed, 200);
        req.constraint = Some(c.clone());
        rxs.push((None, submit(&h, req)));
        rxs.push((Some(seed as usize), submit(&h, plain(seed))));
    }
    for (plain_index, rx) in &rxs {
        let (ids, _, _) = collect(rx);
        if let Some(i) = plain_index {
            assert_eq!(&ids, &alone[*i], "plain request {i}");
        }
    }
}

#[test]
fn grammars_that_cannot_compile_are_refused_with_the_reason() {
    let m = kvant_model::load(&fixture(DENSE)).expect("fixture loads");
    let compiler = GrammarCompiler::new(&m.tokenizer).expect("grammar tables build");
    let bad = [
        Grammar::Regex("(unclosed".into()),
        Grammar::Lark("start: undefined_rule".into()),
        Grammar::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
        Grammar::JsonSchema(json!({"type": "no-such-type"})),
        Grammar::JsonSchema(json!({"$ref": "#/$defs/missing"})),
    ];
    for g in bad {
        match compiler.compile(&g) {
            Err(GrammarError::Compile(msg)) => assert!(!msg.is_empty(), "{g:?}"),
            other => panic!("{g:?} gave {other:?}"),
        }
    }
    let any = compiler
        .compile(&Grammar::JsonSchema(json!({"type": "object"})))
        .expect("any object compiles");
    drop(any);
}
