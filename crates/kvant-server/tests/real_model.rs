//! The real default model (`$KVANT_MODEL`) behind the server: a chat answer
//! that must be right and end with its turn, and client disconnects that
//! must free the engine.

mod common;

use common::{real_model, start, streamed_text, Setup};
use serde_json::{json, Value};
use std::time::Duration;

const NAME: &str = "SmolLM2-135M-Instruct.Q4_1";
/// Far more tokens than a test waits for: only an abort ends these requests soon.
const ENDLESS: usize = 2000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_answers_and_streams_the_same_text() {
    let Some(model) = real_model() else { return };
    let s = start(&model, Setup::new(NAME)).await;
    let body = json!({
        "model": NAME,
        "messages": [{"role": "user", "content": "What is 2+2? Answer with one number."}],
        "max_tokens": 64,
        "temperature": 0,
    });
    let v = s.ok("/v1/chat/completions", &body).await;
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    assert!(answer.contains('4'), "{answer:?}");
    // The end-of-turn token ends it, and is not part of the text.
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(!answer.contains("<|im_end|>"));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = s.stream("/v1/chat/completions", &streamed).await;
    let (text, finish) = streamed_text(&chunks, 0);
    assert_eq!(text, answer);
    assert_eq!(finish.as_deref(), v["choices"][0]["finish_reason"].as_str());
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnects_abort_the_request() {
    let Some(model) = real_model() else { return };
    let s = start(&model, Setup::new(NAME)).await;
    let aborted = |m: &std::collections::HashMap<String, f64>| m["kvant_request_aborted_total"];
    let prompt = "Write a very long story about a lighthouse keeper.";

    // A stream dropped after its first chunk.
    let body = json!({"prompt": prompt, "max_tokens": ENDLESS, "ignore_eos": true, "stream": true});
    let mut resp = s
        .post("/v1/completions")
        .json(&body)
        .send()
        .await
        .expect("request");
    assert!(resp.chunk().await.expect("chunk").is_some());
    drop(resp);
    let m = s
        .wait_metrics("one aborted request", |m| aborted(m) == 1.0)
        .await;
    assert!(m["kvant_generation_tokens_total"] < ENDLESS as f64);

    // A non-streamed request whose client gives up waiting.
    let body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": ENDLESS, "ignore_eos": true});
    let gave_up = s
        .post("/v1/chat/completions")
        .json(&body)
        .timeout(Duration::from_millis(500))
        .send()
        .await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    let m = s
        .wait_metrics("two aborted requests, none running", |m| {
            aborted(m) == 2.0 && m["kvant_num_requests_running"] == 0.0
        })
        .await;
    assert_eq!(m["kvant_request_success_total"], 0.0);
    let v: Value = s
        .ok(
            "/v1/completions",
            &json!({"prompt": "Hello", "max_tokens": 3}),
        )
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 3);
    s.shutdown().await;
}
