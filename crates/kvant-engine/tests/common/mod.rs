//! Helpers shared by the engine's integration tests (included with `mod common`).

#![allow(dead_code)]

use kvant_engine::serving::{EngineConfig, EngineHandle, EngineRequest, Event, Pooling, Usage};
use kvant_engine::FinishReason;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver};
use std::time::Duration;

/// A fixture checkpoint under `tests/fixtures/models`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

/// Submits `req`; its events arrive on the returned channel.
pub fn submit(h: &EngineHandle, req: EngineRequest) -> Receiver<Event> {
    let (tx, rx) = channel();
    h.submit(req, Box::new(move |e| tx.send(e).is_ok()))
        .expect("accepted");
    rx
}

/// Waits for a request's events; returns its tokens, finish reason and usage.
pub fn collect(rx: &Receiver<Event>) -> (Vec<u32>, FinishReason, Usage) {
    let mut ids = Vec::new();
    loop {
        match rx
            .recv_timeout(Duration::from_secs(60))
            .expect("an event in time")
        {
            Event::Token { id, .. } => ids.push(id),
            Event::Finished { reason, usage, .. } => return (ids, reason, usage),
            Event::Failed(e) => panic!("request failed: {e}"),
            Event::Embedding(_) => panic!("an embedding for a generation request"),
        }
    }
}

/// A greedy request for `max_tokens` tokens, end-of-sequence ignored.
pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        ignore_eos: true,
        ..EngineRequest::greedy(prompt, max_tokens)
    }
}

/// A small pool and step budget: 16 requests of [`prompts`] get their
/// prompts chunked and some of them preempted.
pub fn crowded() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        kv_blocks: 64,
        max_batch_tokens: 40,
        max_running: 12,
        ..EngineConfig::default()
    }
}

/// `n` prompts of 3 to 69 ids in `3..250`.
pub fn prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(3..70);
            (0..len).map(|_| rng.random_range(3..250)).collect()
        })
        .collect()
}

/// Submits an embedding of `ids`; its events arrive on the returned channel.
pub fn embed(h: &EngineHandle, ids: Vec<u32>, pooling: Pooling) -> Receiver<Event> {
    let (tx, rx) = channel();
    h.embed(ids, pooling, Box::new(move |e| tx.send(e).is_ok()))
        .expect("accepted");
    rx
}

/// Waits for an embedding request's vector (not empty), then its usage.
pub fn embedding(rx: &Receiver<Event>) -> (Vec<f32>, Usage) {
    let wait = || rx.recv_timeout(Duration::from_secs(60)).expect("an event");
    let v = match wait() {
        Event::Embedding(v) => {
            assert!(!v.is_empty(), "an empty embedding");
            v
        }
        e => panic!("expected the embedding, got {e:?}"),
    };
    match wait() {
        Event::Finished { reason, usage, .. } => {
            assert_eq!(reason, FinishReason::Stop);
            (v, usage)
        }
        e => panic!("expected the end, got {e:?}"),
    }
}

/// Fixture `name` loaded as `kvant serve` loads it (latent attention always
/// absorbed, so that outputs cannot depend on the load); with its MTP
/// module when `mtp`.
pub fn load_fixture(name: &str, mtp: bool) -> kvant_model::LoadedModel {
    let opts = kvant_model::LoadOptions {
        mla_prefill: kvant_model::MlaPrefill::Absorbed,
        mtp,
        ..kvant_model::LoadOptions::default()
    };
    kvant_model::load_with(&fixture(name), opts).expect("fixture loads")
}

/// An engine over [`load_fixture`]`(name, mtp)`.
pub fn start_fixture(
    name: &str,
    mtp: bool,
    cfg: EngineConfig,
) -> (EngineHandle, kvant_engine::serving::EngineThread) {
    let m = load_fixture(name, mtp);
    EngineHandle::start(
        std::sync::Arc::new(m.model),
        std::sync::Arc::new(m.tokenizer),
        cfg,
    )
    .expect("engine starts")
}
