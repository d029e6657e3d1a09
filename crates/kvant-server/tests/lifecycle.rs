//! Health, metrics, client disconnects and graceful shutdown (tiny fixture
//! model).

mod common;

use common::{parse_sse, start, streamed_text, tiny, tiny_model, Setup, TestServer, TINY_NAME};
use kvant_engine::serving::Shutdown;
use serde_json::{json, Value};
use std::time::Duration;

const COMPLETIONS: &str = "/v1/completions";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics() {
    let s = tiny().await;
    let resp = s.get("/health").send().await.expect("health");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.json::<Value>().await.expect("json")["status"], "ok");

    let resp = s.get("/metrics").send().await.expect("metrics");
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|c| c.to_str().ok())
        .map(str::to_string);
    assert!(ctype.is_some_and(|c| c.starts_with("text/plain")));
    // The engine publishes its pool size once its thread has set it up.
    let before = s
        .wait_metrics("the KV pool", |m| m["kvant_kv_blocks_total"] == 256.0)
        .await;
    for name in [
        "kvant_num_requests_waiting",
        "kvant_num_requests_running",
        "kvant_kv_blocks_used",
        "kvant_kv_blocks_free",
        "kvant_prefix_cache_queries_total",
        "kvant_prefix_cache_hits_total",
        "kvant_prefix_cache_hit_rate",
        "kvant_prompt_tokens_total",
        "kvant_generation_tokens_total",
        "kvant_num_preemptions_total",
        "kvant_request_success_total",
        "kvant_request_aborted_total",
        "kvant_time_to_first_token_seconds_count",
        "kvant_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
        "kvant_inter_token_latency_seconds_sum",
    ] {
        assert!(before.contains_key(name), "missing {name}");
    }
    assert_eq!(before["kvant_kv_blocks_free"], 256.0);

    // The same prompt twice: counters move, and the second run reuses the
    // first one's full KV blocks.
    let prompt = "one two three four five six seven eight nine ten eleven twelve ".repeat(4);
    let body = json!({"prompt": prompt, "max_tokens": 5, "ignore_eos": true});
    let first = s.ok(COMPLETIONS, &body).await;
    let second = s.ok(COMPLETIONS, &body).await;
    let prompt_tokens = first["usage"]["prompt_tokens"]
        .as_f64()
        .expect("prompt_tokens");
    assert!(
        prompt_tokens > 32.0,
        "the prompt should span several blocks"
    );
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .expect("cached");
    assert!(cached >= 16.0, "no prefix reuse: {second}");
    let m = s
        .wait_metrics("two finished requests", |m| {
            m["kvant_request_success_total"] >= before["kvant_request_success_total"] + 2.0
        })
        .await;
    let moved = |name: &str| m[name] - before[name];
    assert_eq!(moved("kvant_generation_tokens_total"), 10.0);
    assert_eq!(moved("kvant_time_to_first_token_seconds_count"), 2.0);
    assert_eq!(moved("kvant_inter_token_latency_seconds_count"), 8.0);
    assert!(moved("kvant_prompt_tokens_total") >= 2.0 * prompt_tokens - cached);
    assert!(moved("kvant_prefix_cache_hits_total") >= cached);
    assert!(m["kvant_prefix_cache_hit_rate"] > 0.0);
    s.shutdown().await;
}

/// A client that walks away mid-stream frees its sequence and leaves a
/// concurrent request's output exactly as it is alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_does_not_disturb_others() {
    let s = tiny().await;
    let steady = json!({"prompt": "Steady as she goes", "max_tokens": 64, "temperature": 0, "ignore_eos": true});
    let alone = s.ok(COMPLETIONS, &steady).await["choices"][0]["text"].clone();

    let leaver =
        json!({"prompt": "Leaving early", "max_tokens": 200, "ignore_eos": true, "stream": true});
    for _ in 0..3 {
        let mut resp = s
            .post(COMPLETIONS)
            .json(&leaver)
            .send()
            .await
            .expect("request");
        let concurrent = tokio::spawn({
            let client = s.client.clone();
            let url = format!("{}{COMPLETIONS}", s.url);
            let body = steady.clone();
            async move {
                let v: Value = client.post(url).json(&body).send().await?.json().await?;
                Ok::<_, reqwest::Error>(v)
            }
        });
        let first = resp.chunk().await.expect("first chunk");
        assert!(first.is_some_and(|c| c.starts_with(b"data: ")));
        drop(resp);
        let v = concurrent.await.expect("task").expect("concurrent request");
        assert_eq!(v["choices"][0]["text"], alone);
    }
    // Every request ended exactly once, finished or aborted.
    let ended = |m: &std::collections::HashMap<String, f64>| {
        m["kvant_request_success_total"] + m["kvant_request_aborted_total"]
    };
    s.wait_metrics("seven ended requests", |m| ended(m) == 7.0)
        .await;
    s.shutdown().await;
}

/// Once the engine takes no more requests, /health says so with a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_while_draining() {
    let s = tiny().await;
    let resp = s.get("/health").send().await.expect("health");
    assert_eq!(resp.status().as_u16(), 200);
    s.engine.shutdown(Shutdown::Drain);
    let resp = s.get("/health").send().await.expect("health");
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(
        resp.json::<Value>().await.expect("json")["status"],
        "draining"
    );
    s.shutdown().await;
}

/// The streamed text of completion request `body`, whose first chunk
/// arrived before the shutdown began and the rest after it.
async fn stream_across_shutdown(s: &mut TestServer, body: &Value) -> String {
    let mut resp = s
        .post(COMPLETIONS)
        .json(body)
        .send()
        .await
        .expect("request");
    let mut text = String::from_utf8(resp.chunk().await.expect("chunk").expect("first").to_vec())
        .expect("utf-8");
    s.begin_shutdown();
    while let Some(c) = resp.chunk().await.expect("chunk") {
        text.push_str(std::str::from_utf8(&c).expect("utf-8"));
    }
    text
}

/// A shutdown lets streams in flight finish (drain), then the server returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_streams() {
    let mut s = tiny().await;
    let body = json!({"prompt": "Drain me", "max_tokens": 120, "ignore_eos": true, "stream": true});
    let url = s.url.clone();
    let text = stream_across_shutdown(&mut s, &body).await;
    let chunks = parse_sse(&text, true);
    let (_, finish) = streamed_text(&chunks, 0);
    assert_eq!(finish.as_deref(), Some("length"), "drained to the end");
    s.finish().await;
    // Nothing listens any more.
    let after = reqwest::Client::new()
        .get(format!("{url}/health"))
        .send()
        .await;
    assert!(after.is_err());
}

/// With no grace period, streams in flight are aborted but still end with
/// their final chunk and `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_without_grace_aborts_but_closes_streams() {
    let mut setup = Setup::new(TINY_NAME);
    setup.server.shutdown_grace = Duration::ZERO;
    let mut s = start(&tiny_model(), setup).await;
    let body = json!({"prompt": "Abort me", "max_tokens": 200, "ignore_eos": true, "stream": true, "n": 4});
    let text = stream_across_shutdown(&mut s, &body).await;
    let chunks = parse_sse(&text, true);
    for i in 0..4 {
        assert!(
            streamed_text(&chunks, i).1.is_some(),
            "choice {i} has no final chunk"
        );
    }
    s.finish().await;
}
