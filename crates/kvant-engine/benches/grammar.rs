//! What structured output costs on the default model's 49,152-token
//! vocabulary: building the grammar tables (once per server), compiling a
//! typical schema (once per request), and the mask plus commit of each
//! generated token (once per token per constrained sequence, on the engine
//! thread between the forward pass and the sample).
//!
//! `KVANT_MODEL=path/to/SmolLM2-135M-Instruct.Q4_1.gguf cargo bench -p kvant-engine --bench grammar`
//! (the default is kvant's download cache; without the file nothing runs).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvant_engine::grammar::{Grammar, GrammarCompiler};
use serde_json::json;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

fn model_path() -> Option<PathBuf> {
    let p = std::env::var_os("KVANT_MODEL")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/kvant/SmolLM2-135M-Instruct.Q4_1.gguf"))
        })?;
    p.exists().then_some(p)
}

/// A function-call-like schema: strings with bounds, an enum, numbers, an
/// array of objects and a nested object.
fn typical_schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "hourly": {"type": "boolean"},
            "stations": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string", "pattern": "^[A-Z]{4}$"},
                        "lat": {"type": "number"},
                        "lon": {"type": "number"}
                    },
                    "required": ["id", "lat", "lon"],
                    "additionalProperties": false
                },
                "maxItems": 4
            },
            "notes": {"type": ["string", "null"]}
        },
        "required": ["city", "unit", "days", "hourly", "stations", "notes"],
        "additionalProperties": false
    })
}

const INSTANCE: &str = r#"{"city": "San Francisco", "unit": "celsius", "days": 7, "hourly": false, "stations": [{"id": "KSFO", "lat": 37.619, "lon": -122.375}, {"id": "KOAK", "lat": 37.721, "lon": -122.221}], "notes": "Foggy mornings are expected near the coast, clearing by noon."}"#;

fn grammar(c: &mut Criterion) {
    let Some(path) = model_path() else {
        eprintln!("grammar bench: no model (set KVANT_MODEL); skipped");
        return;
    };
    let m = kvant_model::load(&path).expect("the model loads");
    let tok = m.tokenizer;
    let vocab = m.model.config().vocab;
    let mut g = c.benchmark_group(format!("grammar/{} tokens", tok.vocab_size()));
    g.sample_size(10);
    g.bench_function("build tables", |b| {
        b.iter(|| black_box(GrammarCompiler::new(&tok).expect("tables")))
    });
    let compiler = GrammarCompiler::new(&tok).expect("tables");
    let schema = Grammar::JsonSchema(typical_schema());
    g.bench_function("compile typical schema", |b| {
        b.iter(|| black_box(compiler.compile(&schema).expect("compiles")))
    });
    let ids = tok.encode(INSTANCE, false).expect("tokenizes");
    let fresh = compiler.compile(&schema).expect("compiles");
    let mut row = vec![0.0f32; vocab];
    g.throughput(Throughput::Elements(ids.len() as u64));
    g.bench_function("mask + commit, per token of a typical output", |b| {
        b.iter(|| {
            let mut c = fresh.clone();
            for &t in &ids {
                // A fresh row each step, as the forward pass gives (the
                // fill is part of the time: an upper bound).
                row.fill(0.0);
                c.mask(&mut row).expect("mask");
                assert!(row[t as usize].is_finite(), "the instance fits the schema");
                c.commit(t).expect("commit");
            }
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = grammar
}
criterion_main!(benches);
