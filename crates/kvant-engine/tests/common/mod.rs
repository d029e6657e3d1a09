//! Helpers shared by the engine's integration tests (included with `mod common`).

#![allow(dead_code)]

use kvant_engine::serving::{EngineHandle, EngineRequest, Event, Usage};
use kvant_engine::FinishReason;
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
