//! `/v1/embeddings` on the tiny fixture model: each vector is the engine's
//! pooling of the model's hidden states at unit length, in the request's
//! order, as floats or base64; a batch larger than the queue waits rather
//! than failing; bad requests are 400s naming the field.

mod common;

use base64::Engine as _;
use common::{assert_error, start, tiny, tiny_model, Setup, TestServer, TINY_NAME};
use kvant_engine::serving::{EngineConfig, Event, Pooling};
use serde_json::{json, Value};

/// What the engine itself pools for `ids` (checked against the model's own
/// forward pass in kvant-engine's tests), scaled to unit length.
fn engine_vector(s: &TestServer, ids: &[u32], pooling: Pooling) -> Vec<f32> {
    let (tx, rx) = std::sync::mpsc::channel();
    s.engine
        .embed(ids.to_vec(), pooling, Box::new(move |e| tx.send(e).is_ok()))
        .expect("accepted");
    let v = match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(Event::Embedding(v)) => v,
        other => panic!("expected an embedding, got {other:?}"),
    };
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    v.iter().map(|&x| (f64::from(x) / norm) as f32).collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn from_base64(v: &Value) -> Vec<f32> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(v.as_str().expect("a string"))
        .expect("base64");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_the_models_pooled_hidden_states() {
    for pooling in [Pooling::Last, Pooling::Mean, Pooling::First] {
        let mut setup = Setup::new(TINY_NAME);
        setup.server.pooling = pooling;
        let s = start(&tiny_model(), setup).await;
        let texts = ["The quick brown fox", "jumps over", "the lazy dog."];
        let v = s
            .ok(
                "/v1/embeddings",
                &json!({"model": TINY_NAME, "input": texts, "encoding_format": "float"}),
            )
            .await;
        assert_eq!(v["object"], "list");
        assert_eq!(v["model"], TINY_NAME);
        let data = v["data"].as_array().expect("data");
        assert_eq!(data.len(), texts.len());
        let mut tokens = 0;
        for (i, (d, text)) in data.iter().zip(texts).enumerate() {
            assert_eq!(
                (d["object"].as_str(), d["index"].as_u64()),
                (Some("embedding"), Some(i as u64))
            );
            let ids = s.tokenizer.encode(text, true).expect("tokenizes");
            tokens += ids.len();
            let got = floats(&d["embedding"]);
            assert_eq!(got.len(), s.engine.embedding_size());
            assert_eq!(
                got,
                engine_vector(&s, &ids, pooling),
                "{pooling:?}: input {i}"
            );
        }
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": tokens, "total_tokens": tokens})
        );

        // base64 (the openai client's default) carries the same bits; token
        // ids embed as their text does.
        let ids = s.tokenizer.encode(texts[1], true).expect("tokenizes");
        let b = s
            .ok(
                "/v1/embeddings",
                &json!({"input": [ids], "encoding_format": "base64"}),
            )
            .await;
        assert_eq!(
            from_base64(&b["data"][0]["embedding"]),
            floats(&data[1]["embedding"])
        );
        s.shutdown().await;
    }
}

/// 40 inputs through a queue of 2 running and 1 waiting: they run a window
/// at a time, and come back in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_the_queue_waits_its_turn() {
    let mut setup = Setup::new(TINY_NAME);
    setup.engine = EngineConfig {
        max_running: 2,
        max_waiting: 1,
        ..setup.engine
    };
    let s = start(&tiny_model(), setup).await;
    let inputs: Vec<String> = (0..40).map(|i| format!("document number {i}")).collect();
    let v = s.ok("/v1/embeddings", &json!({"input": inputs})).await;
    let data = v["data"].as_array().expect("data");
    assert_eq!(data.len(), 40);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["index"].as_u64(), Some(i as u64));
        let alone = s.ok("/v1/embeddings", &json!({"input": inputs[i]})).await;
        assert_eq!(d["embedding"], alone["data"][0]["embedding"], "input {i}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_embedding_requests_are_400s_naming_the_field() {
    let s = tiny().await;
    let size = s.engine.embedding_size();
    let long = "word ".repeat(s.engine.context_length() + 10);
    let many: Vec<&str> = vec!["a"; 2049];
    for (body, param) in [
        (json!({}), "input"),
        (json!({"input": ""}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": ["a", ""]}), "input"),
        (json!({"input": 7}), "input"),
        (json!({"input": [1, "a"]}), "input"),
        (json!({"input": [10_000_000]}), "input"),
        (json!({"input": many}), "input"),
        (json!({"input": long}), "input"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "a", "dimensions": size - 1}), "dimensions"),
        (json!({"input": "a", "dimensions": "full"}), "dimensions"),
    ] {
        let (status, v) = s.json("/v1/embeddings", &body).await;
        assert_error(status, &v, 400, Some(param), &body.to_string());
    }
    let (status, v) = s
        .json("/v1/embeddings", &json!({"input": "a", "model": "other"}))
        .await;
    assert_error(status, &v, 404, None, "another model");
    let ok = s
        .ok(
            "/v1/embeddings",
            &json!({"input": "a", "dimensions": size, "user": "u"}),
        )
        .await;
    assert_eq!(ok["data"].as_array().map(Vec::len), Some(1));
    s.shutdown().await;
}
