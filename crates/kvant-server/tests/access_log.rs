//! The access log: one JSON line per request, with the client's request id
//! echoed, token counts and finish reasons for generations, errors at warn,
//! health polls at debug, and a client that leaves mid-stream at warn.

mod common;

use common::{real_model, start, tiny, Setup};
use serde_json::{json, Value};
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut b) = self.0.lock() {
            b.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Every line logged in this test binary (one global subscriber, JSON).
fn log() -> &'static Buffer {
    static LOG: OnceLock<Buffer> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Buffer::default();
        let writer = buf.clone();
        tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || writer.clone())
            .init();
        buf
    })
}

/// The access line of request `id`, waiting up to 10 s for it.
async fn line(id: &str) -> Value {
    for _ in 0..200 {
        let text = log()
            .0
            .lock()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let found = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["target"] == "kvant::access" && v["id"] == id)
            .collect::<Vec<_>>();
        match found.len() {
            0 => tokio::time::sleep(Duration::from_millis(50)).await,
            1 => return found[0].clone(),
            n => panic!("{n} lines for {id}"),
        }
    }
    panic!("no access line for {id}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_logs_one_line() {
    log();
    let s = tiny().await;
    let body = json!({"prompt": "The quick brown fox", "max_tokens": 5, "ignore_eos": true});
    let resp = s
        .post("/v1/completions")
        .json(&body)
        .header("x-request-id", "t-plain")
        .send()
        .await
        .expect("request");
    assert_eq!(
        resp.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
        Some("t-plain")
    );
    let v: Value = resp.json().await.expect("json");
    let l = line("t-plain").await;
    assert_eq!(l["level"], "INFO");
    assert_eq!(
        (
            l["method"].as_str(),
            l["path"].as_str(),
            l["status"].as_u64()
        ),
        (Some("POST"), Some("/v1/completions"), Some(200))
    );
    assert_eq!(l["prompt_tokens"], v["usage"]["prompt_tokens"]);
    assert_eq!(l["completion_tokens"], 5);
    assert_eq!(
        (l["finish"].as_str(), l["complete"].as_bool()),
        (Some("length"), Some(true))
    );
    assert!(l["ttft_ms"].as_f64() <= l["total_ms"].as_f64());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["n"] = json!(2);
    let resp = s
        .post("/v1/completions")
        .json(&streamed)
        .header("x-request-id", "t-stream")
        .send()
        .await
        .expect("request");
    resp.text().await.expect("the stream");
    let l = line("t-stream").await;
    assert_eq!(
        (l["completion_tokens"].as_u64(), l["finish"].as_str()),
        (Some(10), Some("length,length"))
    );
    assert_eq!(l["complete"], true);

    let bad = json!({"prompt": "x", "max_tokens": 0});
    let resp = s
        .post("/v1/completions")
        .json(&bad)
        .header("x-request-id", "t-bad")
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 400);
    let l = line("t-bad").await;
    assert_eq!(
        (l["level"].as_str(), l["status"].as_u64()),
        (Some("WARN"), Some(400))
    );

    let resp = s
        .get("/health")
        .header("x-request-id", "t-health")
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(line("t-health").await["level"], "DEBUG");

    // Without a usable id of the client's, the server makes one and returns it.
    let resp = s
        .post("/v1/completions")
        .json(&body)
        .header("x-request-id", "bad id")
        .send()
        .await
        .expect("request");
    let id = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .expect("an id");
    assert!(id.starts_with("req-"), "{id}");
    line(&id).await;
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_stream_is_a_warning() {
    log();
    let Some(model) = real_model() else { return };
    let s = start(&model, Setup::new("m")).await;
    let body = json!({"prompt": "Tell a long story.", "max_tokens": 2000, "ignore_eos": true, "stream": true});
    let mut resp = s
        .post("/v1/completions")
        .json(&body)
        .header("x-request-id", "t-gone")
        .send()
        .await
        .expect("request");
    assert!(resp.chunk().await.expect("a chunk").is_some());
    drop(resp);
    let l = line("t-gone").await;
    assert_eq!(
        (l["level"].as_str(), l["complete"].as_bool()),
        (Some("WARN"), Some(false))
    );
    assert!(l["completion_tokens"].as_u64() < Some(2000));
    s.shutdown().await;
}
