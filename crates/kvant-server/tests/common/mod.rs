//! A server over loopback for the integration tests (included with `mod common`).

#![allow(dead_code)]

use kvant_engine::serving::{EngineConfig, EngineHandle, EngineThread};
use kvant_model::chat::ChatTemplate;
use kvant_model::tokenizer::Tokenizer;
use kvant_server::{AppState, ServerConfig};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub const TINY_NAME: &str = "llama-gqa";

pub fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama-gqa")
}

/// The real default model: `$KVANT_MODEL`. `None` only when
/// `KVANT_SKIP_REAL_MODEL=1`.
pub fn real_model() -> Option<PathBuf> {
    if std::env::var("KVANT_SKIP_REAL_MODEL").as_deref() == Ok("1") {
        eprintln!("KVANT_SKIP_REAL_MODEL=1: skipping a real-model test");
        return None;
    }
    match std::env::var("KVANT_MODEL") {
        Ok(p) if Path::new(&p).is_file() => Some(PathBuf::from(p)),
        _ => panic!(
            "set KVANT_MODEL to the default model (`cargo run -p kvant -- fetch` prints its path), \
             or KVANT_SKIP_REAL_MODEL=1 to skip real-model tests"
        ),
    }
}

/// How to start a test server.
pub struct Setup {
    pub engine: EngineConfig,
    pub server: ServerConfig,
    /// Serve the checkpoint's chat template (false: a model without one).
    pub chat_template: bool,
    /// Serve this template's text instead of the checkpoint's.
    pub template_source: Option<String>,
}

impl Setup {
    pub fn new(name: &str) -> Self {
        Setup {
            engine: EngineConfig {
                block_size: 16,
                kv_blocks: 256,
                max_batch_tokens: 256,
                max_running: 16,
                max_waiting: 64,
                ..EngineConfig::default()
            },
            server: ServerConfig::new(name),
            chat_template: true,
            template_source: None,
        }
    }
}

pub struct TestServer {
    pub url: String,
    pub client: reqwest::Client,
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    thread: Option<EngineThread>,
}

pub async fn start(model: &Path, setup: Setup) -> TestServer {
    let m = kvant_model::load(model).expect("loading the model");
    let tokenizer = Arc::new(m.tokenizer);
    let (engine, thread) = EngineHandle::start(
        Arc::new(m.model),
        Arc::clone(&tokenizer),
        setup.engine.clone(),
    )
    .expect("starting the engine");
    let template = match &setup.template_source {
        Some(src) => Some(ChatTemplate::new(src, None, None).expect("the template compiles")),
        None => m.chat_template.filter(|_| setup.chat_template),
    }
    .map(Arc::new);
    let state = AppState::new(
        engine.clone(),
        &setup.engine,
        Arc::clone(&tokenizer),
        template,
        setup.server,
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(kvant_server::serve(listener, state, async {
        let _ = rx.await;
    }));
    TestServer {
        url,
        client: reqwest::Client::new(),
        engine,
        tokenizer,
        stop: Some(tx),
        task,
        thread: Some(thread),
    }
}

pub async fn tiny() -> TestServer {
    start(&tiny_model(), Setup::new(TINY_NAME)).await
}

impl TestServer {
    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.post(format!("{}{path}", self.url))
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.get(format!("{}{path}", self.url))
    }

    /// POSTs `body`; returns the status and the parsed JSON answer.
    pub async fn json(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.post(path).json(body).send().await.expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
        (status, v)
    }

    /// POSTs `body`, expecting 200; returns the JSON answer.
    pub async fn ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.json(path, body).await;
        assert_eq!(status, 200, "{path} {body}: {v}");
        v
    }

    /// POSTs a streaming request, expecting 200; returns the chunks before
    /// `[DONE]` (which must end the stream).
    pub async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let resp = self.post(path).json(body).send().await.expect("request");
        assert_eq!(resp.status().as_u16(), 200);
        let ctype = resp.headers().get("content-type").cloned();
        assert_eq!(
            ctype.as_ref().and_then(|c| c.to_str().ok()),
            Some("text/event-stream")
        );
        let text = resp.text().await.expect("body");
        parse_sse(&text, true)
    }

    pub async fn metrics(&self) -> std::collections::HashMap<String, f64> {
        let text = self
            .get("/metrics")
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text");
        parse_prometheus(&text)
    }

    /// Polls `/metrics` until `done` holds (the engine updates its counters
    /// around the events it sends, not before them).
    pub async fn wait_metrics(
        &self,
        what: &str,
        done: impl Fn(&std::collections::HashMap<String, f64>) -> bool,
    ) -> std::collections::HashMap<String, f64> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let m = self.metrics().await;
            if done(&m) {
                return m;
            }
            assert!(
                Instant::now() < deadline,
                "metrics never showed {what}: {m:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Triggers the graceful shutdown and waits for the server and the engine.
    pub async fn shutdown(mut self) {
        self.begin_shutdown();
        self.finish().await;
    }

    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    /// Waits for the server to return (after `begin_shutdown`) and the engine to stop.
    pub async fn finish(mut self) {
        let served = tokio::time::timeout(Duration::from_secs(60), &mut self.task)
            .await
            .expect("the server did not stop");
        served.expect("server task").expect("serve");
        if let Some(t) = self.thread.take() {
            tokio::task::spawn_blocking(move || t.join())
                .await
                .expect("join task")
                .expect("the engine thread panicked");
        }
    }
}

/// `data:` payloads of an event stream, parsed, up to `[DONE]`.
pub fn parse_sse(text: &str, require_done: bool) -> Vec<Value> {
    let mut out = Vec::new();
    let mut done = false;
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        assert!(!done, "data after [DONE]: {block:?}");
        let data = block
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an event: {block:?}"));
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(serde_json::from_str(data).unwrap_or_else(|e| panic!("bad chunk ({e}): {data}")));
    }
    assert!(
        done || !require_done,
        "the stream did not end with [DONE]: {text}"
    );
    out
}

/// `name{labels} value` lines of Prometheus text; every line must parse.
pub fn parse_prometheus(text: &str) -> std::collections::HashMap<String, f64> {
    let mut out = std::collections::HashMap::new();
    for line in text.lines() {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") {
            continue;
        }
        let (name, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line {line:?}"));
        let v: f64 = value
            .parse()
            .unwrap_or_else(|e| panic!("bad value in {line:?}: {e}"));
        assert!(
            out.insert(name.to_string(), v).is_none(),
            "duplicate sample {name}"
        );
    }
    out
}

/// The text a streamed completion or chat choice adds up to, and its finish reason.
pub fn streamed_text(chunks: &[Value], index: u64) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for c in chunks {
        for choice in c["choices"].as_array().expect("choices") {
            if choice["index"].as_u64() != Some(index) {
                continue;
            }
            let piece = if choice.get("delta").is_some() {
                choice["delta"]["content"].as_str()
            } else {
                choice["text"].as_str()
            };
            assert!(finish.is_none(), "a chunk after the finish: {c}");
            text.push_str(piece.unwrap_or(""));
            if let Some(r) = choice["finish_reason"].as_str() {
                finish = Some(r.to_string());
            }
        }
    }
    (text, finish)
}

/// Asserts an OpenAI-style error answer with `status` and `param`.
pub fn assert_error(status: u16, v: &Value, want_status: u16, param: Option<&str>, ctx: &str) {
    assert_eq!(status, want_status, "{ctx}: {v}");
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{ctx}: {v}"
    );
    assert!(e["type"].is_string(), "{ctx}: {v}");
    assert!(e.get("code").is_some(), "{ctx}: {v}");
    if let Some(p) = param {
        assert_eq!(e["param"].as_str(), Some(p), "{ctx}: {v}");
    }
}
