//! Batch invariance on the real default model (SmolLM2-135M-Instruct
//! Q4_1, `$KVANT_MODEL`): each of 16 concurrent greedy requests produces
//! exactly the tokens it produces when sent alone.

use kvant_engine::serving::{EngineConfig, EngineHandle, EngineRequest, Event, Shutdown};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

/// `$KVANT_MODEL`, or `None` with `KVANT_SKIP_REAL_MODEL=1`.
fn real_model() -> Option<String> {
    if std::env::var("KVANT_SKIP_REAL_MODEL").as_deref() == Ok("1") {
        eprintln!("KVANT_SKIP_REAL_MODEL=1: skipping a real-model test");
        return None;
    }
    match std::env::var("KVANT_MODEL") {
        Ok(p) if std::path::Path::new(&p).is_file() => Some(p),
        _ => panic!(
            "set KVANT_MODEL to the default model (`cargo run -p kvant -- fetch` prints its path), \
             or KVANT_SKIP_REAL_MODEL=1 to skip real-model tests"
        ),
    }
}

fn submit(h: &EngineHandle, prompt: Vec<u32>) -> Receiver<Event> {
    let (tx, rx) = channel();
    let req = EngineRequest {
        ignore_eos: true,
        ..EngineRequest::greedy(prompt, 32)
    };
    h.submit(req, Box::new(move |e| tx.send(e).is_ok()))
        .expect("accepted");
    rx
}

fn tokens(rx: &Receiver<Event>) -> Vec<u32> {
    let mut ids = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(300)).expect("an event") {
            Event::Token { id, .. } => ids.push(id),
            Event::Finished { .. } => return ids,
            Event::Failed(e) => panic!("{e}"),
            Event::Embedding(_) => panic!("an embedding for a generation request"),
        }
    }
}

#[test]
fn sixteen_concurrent_requests_match_their_solo_runs() {
    let Some(path) = real_model() else { return };
    let m = kvant_model::load(std::path::Path::new(&path)).expect("model loads");
    let tok = &m.tokenizer;
    let texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away,",
        "Water boils at",
        "Привет! Как дела?",
        "List three prime numbers:",
        "The quick brown fox",
        "In 1969, astronauts",
    ];
    // 16 prompts: 8 texts, each alone and behind a shared long preamble
    // (prefix-cache hits on the second use).
    let preamble = "You are a helpful assistant. Answer briefly and precisely. ".repeat(6);
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .flat_map(|t| [t.to_string(), format!("{preamble}{t}")])
        .map(|t| tok.encode(&t, true).expect("encodes"))
        .collect();
    let (h, t) = EngineHandle::start(
        Arc::new(m.model),
        Arc::new(m.tokenizer),
        EngineConfig {
            max_batch_tokens: 64,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| tokens(&submit(&h, p.clone())))
        .collect();
    let rxs: Vec<Receiver<Event>> = prompts.iter().map(|p| submit(&h, p.clone())).collect();
    for (i, rx) in rxs.iter().enumerate() {
        assert_eq!(tokens(rx), alone[i], "prompt {i}");
    }
    assert!(h.metrics().prefix_cache_hits > 0);
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
}
