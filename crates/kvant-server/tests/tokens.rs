//! `/tokenize` and `/detokenize` on the tiny fixture model: counts agree
//! with what the completion endpoints report, text round-trips, and bad
//! requests are 400s naming the field.

mod common;

use common::{assert_error, tiny, TINY_NAME};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_counts_what_the_endpoints_count() {
    let s = tiny().await;
    let prompt = "The quick brown fox <|im_start|> jumps";
    let t = s.ok("/tokenize", &json!({"prompt": prompt})).await;
    let done = s
        .ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    assert_eq!(t["count"], done["usage"]["prompt_tokens"]);
    assert_eq!(
        t["tokens"].as_array().map(Vec::len),
        t["count"].as_u64().map(|c| c as usize)
    );
    assert!(t["max_model_len"].as_u64().is_some_and(|m| m > 0));

    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_start|>"}]);
    let t = s
        .ok(
            "/tokenize",
            &json!({"messages": messages, "model": TINY_NAME}),
        )
        .await;
    let done = s
        .ok(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 1}),
        )
        .await;
    assert_eq!(t["count"], done["usage"]["prompt_tokens"]);
    let without = s
        .ok(
            "/tokenize",
            &json!({"messages": messages, "add_generation_prompt": false}),
        )
        .await;
    assert!(without["count"].as_u64() < t["count"].as_u64());

    // Without BOS/EOS, detokenize gives the text back.
    let plain = s
        .ok(
            "/tokenize",
            &json!({"prompt": prompt, "add_special_tokens": false, "return_token_strs": true}),
        )
        .await;
    let strs: Vec<&str> = plain["token_strs"]
        .as_array()
        .expect("token_strs")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(strs.concat(), prompt);
    let back = s
        .ok("/detokenize", &json!({"tokens": plain["tokens"]}))
        .await;
    assert_eq!(back["prompt"], prompt);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_token_requests_are_400s() {
    let s = tiny().await;
    let cases = [
        ("/tokenize", json!({}), None),
        (
            "/tokenize",
            json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
            None,
        ),
        ("/tokenize", json!({"prompt": 5}), Some("prompt")),
        ("/tokenize", json!({"messages": []}), Some("messages")),
        (
            "/tokenize",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            Some("messages[0].role"),
        ),
        ("/detokenize", json!({}), Some("tokens")),
        ("/detokenize", json!({"tokens": [1, -2]}), Some("tokens[1]")),
        (
            "/detokenize",
            json!({"tokens": [1, 99999999]}),
            Some("tokens"),
        ),
    ];
    for (path, body, param) in cases {
        let (status, v) = s.json(path, &body).await;
        assert_error(status, &v, 400, param, &format!("{path} {body}"));
    }
    let (status, v) = s
        .json("/tokenize", &json!({"prompt": "a", "model": "other"}))
        .await;
    assert_eq!(status, 404, "{v}");
    s.shutdown().await;
}
