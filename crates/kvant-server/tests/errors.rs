//! Every refusal is an OpenAI-style error with the right status and
//! `param`, and no input makes the server fail (tiny fixture model).

mod common;

use common::{assert_error, start, tiny, tiny_model, Setup, TINY_NAME};
use kvant_engine::serving::EngineRequest;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

fn with(base: &Value, extra: Value) -> Value {
    let mut b = base.clone();
    if let (Some(o), Value::Object(e)) = (b.as_object_mut(), extra) {
        o.extend(e);
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_400_naming_the_field() {
    let s = tiny().await;
    let ctx = s.engine.context_length();
    let prompt = json!({"prompt": "Hello", "max_tokens": 4});
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let user = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
    let cases: Vec<(&str, Value, Option<&str>)> = vec![
        // Types.
        (
            COMPLETIONS,
            with(&prompt, json!({"temperature": "hot"})),
            Some("temperature"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"max_tokens": -1})),
            Some("max_tokens"),
        ),
        (COMPLETIONS, with(&prompt, json!({"n": 1.5})), Some("n")),
        (
            COMPLETIONS,
            with(&prompt, json!({"stream": "yes"})),
            Some("stream"),
        ),
        (CHAT, with(&chat, json!({"logprobs": 2})), Some("logprobs")),
        (CHAT, json!({"messages": "Hi"}), Some("messages")),
        (
            CHAT,
            json!({"messages": [{"content": "Hi"}]}),
            Some("messages[0]"),
        ),
        (
            CHAT,
            json!({"messages": [{"role": 1, "content": "Hi"}]}),
            Some("messages[0].role"),
        ),
        // Prompts.
        (COMPLETIONS, json!({"max_tokens": 4}), Some("prompt")),
        (COMPLETIONS, json!({"prompt": ""}), Some("prompt")),
        (COMPLETIONS, json!({"prompt": []}), Some("prompt")),
        (COMPLETIONS, json!({"prompt": ["a", ""]}), Some("prompt")),
        (COMPLETIONS, json!({"prompt": [1, -2]}), Some("prompt")),
        (COMPLETIONS, json!({"prompt": [999_999]}), Some("prompt")),
        (COMPLETIONS, json!({"prompt": vec![5; ctx]}), Some("prompt")),
        (CHAT, json!({"max_tokens": 4}), Some("messages")),
        (CHAT, json!({"messages": []}), Some("messages")),
        (
            CHAT,
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            Some("messages[0].role"),
        ),
        (
            CHAT,
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            Some("messages[0].tool_call_id"),
        ),
        (
            CHAT,
            user(json!([{"type": "image_url", "image_url": {"url": "x"}}])),
            Some("messages[0].content[0].type"),
        ),
        // No parts: OpenAI's 400, not an empty turn.
        (CHAT, user(json!([])), Some("messages[0].content")),
        (CHAT, user(json!("word ".repeat(2 * ctx))), Some("messages")),
        // Lengths.
        (
            COMPLETIONS,
            with(&prompt, json!({"max_tokens": 0})),
            Some("max_tokens"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"max_tokens": ctx})),
            Some("max_tokens"),
        ),
        (
            CHAT,
            with(&chat, json!({"max_completion_tokens": 0})),
            Some("max_completion_tokens"),
        ),
        (
            CHAT,
            with(&chat, json!({"max_tokens": 100_000})),
            Some("max_tokens"),
        ),
        // Sampling ranges.
        (
            COMPLETIONS,
            with(&prompt, json!({"temperature": 2.5})),
            Some("temperature"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"temperature": -0.1})),
            Some("temperature"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"top_p": 0})),
            Some("top_p"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"top_p": 1.5})),
            Some("top_p"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"top_k": -2})),
            Some("top_k"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"min_p": 1.5})),
            Some("min_p"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"presence_penalty": 3})),
            Some("presence_penalty"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"frequency_penalty": -3})),
            Some("frequency_penalty"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"repetition_penalty": 0})),
            Some("repetition_penalty"),
        ),
        (COMPLETIONS, with(&prompt, json!({"n": 0})), Some("n")),
        (COMPLETIONS, with(&prompt, json!({"n": 17})), Some("n")),
        (
            COMPLETIONS,
            with(&prompt, json!({"stop": ["a", "b", "c", "d", "e"]})),
            Some("stop"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"stop": [1]})),
            Some("stop"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"stop": ""})),
            Some("stop"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"logprobs": 21})),
            Some("logprobs"),
        ),
        (
            CHAT,
            with(&chat, json!({"top_logprobs": 2})),
            Some("top_logprobs"),
        ),
        (
            CHAT,
            with(&chat, json!({"logprobs": true, "top_logprobs": 21})),
            Some("top_logprobs"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"stream_options": {"include_usage": true}})),
            Some("stream_options"),
        ),
        // Known but unsupported.
        (
            CHAT,
            with(
                &chat,
                json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
            ),
            Some("tools"),
        ),
        (
            CHAT,
            with(&chat, json!({"tool_choice": "required"})),
            Some("tool_choice"),
        ),
        (
            CHAT,
            with(&chat, json!({"functions": [{"name": "f"}]})),
            Some("functions"),
        ),
        (
            CHAT,
            with(&chat, json!({"function_call": {"name": "f"}})),
            Some("function_call"),
        ),
        (
            CHAT,
            with(
                &chat,
                json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
            ),
            Some("response_format"),
        ),
        (
            CHAT,
            with(
                &chat,
                json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "wobbly"}}}}),
            ),
            Some("response_format"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"guided_regex": "(unclosed"})),
            Some("guided_regex"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"guided_grammar": "start: nowhere"})),
            Some("guided_grammar"),
        ),
        (
            CHAT,
            with(&chat, json!({"response_format": {"type": "xml"}})),
            Some("response_format.type"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"echo": true, "logprobs": 1})),
            Some("echo"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"best_of": 2, "stream": true})),
            Some("best_of"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"best_of": 1, "n": 2})),
            Some("best_of"),
        ),
        (
            COMPLETIONS,
            with(
                &prompt,
                json!({"prompt": ["a", "b", "c"], "n": 16, "best_of": 50}),
            ),
            Some("prompt"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"suffix": "end"})),
            Some("suffix"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"logit_bias": {"five": 10}})),
            Some("logit_bias"),
        ),
        (
            CHAT,
            with(&chat, json!({"logit_bias": {"5": 101}})),
            Some("logit_bias.5"),
        ),
        (
            CHAT,
            with(&chat, json!({"logit_bias": {"5": "up"}})),
            Some("logit_bias.5"),
        ),
        (
            COMPLETIONS,
            with(&prompt, json!({"logit_bias": {"99999999": 1}})),
            Some("logit_bias"),
        ),
    ];
    for (path, body, param) in &cases {
        let (status, v) = s.json(path, body).await;
        let short: String = body.to_string().chars().take(120).collect();
        assert_error(status, &v, 400, *param, &format!("{path} {short}"));
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // Defaults and unknown fields are fine.
    let fine = with(
        &prompt,
        json!({"echo": false, "best_of": 1, "suffix": "", "logit_bias": {}, "user": "u", "whatever": [1]}),
    );
    s.ok(COMPLETIONS, &fine).await;
    let fine = with(
        &chat,
        json!({"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "model": TINY_NAME}),
    );
    s.ok(CHAT, &fine).await;
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_and_routes() {
    let s = tiny().await;
    for raw in ["{", "", "[1, 2]", "\"text\"", "{\"prompt\": \"a\",}"] {
        let resp = s
            .post(COMPLETIONS)
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.expect("a JSON error");
        assert_error(status, &v, 400, None, raw);
    }
    let resp = s.get("/v1/nothing").send().await.expect("request");
    let status = resp.status().as_u16();
    assert_error(
        status,
        &resp.json().await.expect("json"),
        404,
        None,
        "unknown path",
    );
    let resp = s.get(COMPLETIONS).send().await.expect("request");
    let status = resp.status().as_u16();
    assert_error(
        status,
        &resp.json().await.expect("json"),
        405,
        None,
        "GET completions",
    );
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_is_404() {
    let s = tiny().await;
    for (path, body) in [
        (COMPLETIONS, json!({"prompt": "a", "model": "gpt-4o"})),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": "a"}], "model": "gpt-4o"}),
        ),
    ] {
        let (status, v) = s.json(path, &body).await;
        assert_error(status, &v, 404, Some("model"), path);
        assert_eq!(v["error"]["code"], "model_not_found");
    }
    let resp = s.get("/v1/models/gpt-4o").send().await.expect("request");
    assert_eq!(resp.status().as_u16(), 404);
    let list: Value = s
        .get("/v1/models")
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["id"], TINY_NAME);
    assert_eq!(list["data"][0]["object"], "model");
    let one: Value = s
        .get(&format!("/v1/models/{TINY_NAME}"))
        .send()
        .await
        .expect("model")
        .json()
        .await
        .expect("json");
    assert_eq!(one["id"], TINY_NAME);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_guards_v1_only() {
    let mut setup = Setup::new(TINY_NAME);
    setup.server.api_key = Some("sesame".into());
    let s = start(&tiny_model(), setup).await;
    let body = json!({"prompt": "a", "max_tokens": 2});
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("sesame"),
        Some("Basic sesame"),
    ] {
        let mut req = s.post(COMPLETIONS).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.expect("request");
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.expect("json");
        assert_error(status, &v, 401, None, &format!("{auth:?}"));
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let resp = s.get("/v1/models").send().await.expect("request");
    assert_eq!(resp.status().as_u16(), 401);
    for guarded in ["/tokenize", "/detokenize"] {
        let resp = s.post(guarded).json(&body).send().await.expect("request");
        assert_eq!(resp.status().as_u16(), 401, "{guarded}");
    }
    let resp = s
        .post(COMPLETIONS)
        .json(&body)
        .header("authorization", "Bearer sesame")
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    for open in ["/health", "/metrics"] {
        let resp = s.get(open).send().await.expect("request");
        assert_eq!(resp.status().as_u16(), 200, "{open}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_429() {
    let mut setup = Setup::new(TINY_NAME);
    setup.engine.max_running = 1;
    setup.engine.max_waiting = 0;
    let s = start(&tiny_model(), setup).await;
    // The one running slot, held: the request's event sink blocks the
    // engine thread on its first token until the gate opens, so it stays
    // in flight however slow this test is.
    let (open, gate) = std::sync::mpsc::channel::<()>();
    let gate = std::sync::Mutex::new(gate);
    let held = EngineRequest {
        ignore_eos: true,
        ..EngineRequest::greedy(vec![1, 2, 3], 4)
    };
    let id = s
        .engine
        .submit(
            held,
            Box::new(move |_| {
                let _ = gate
                    .lock()
                    .map(|g| g.recv_timeout(std::time::Duration::from_secs(60)));
                true
            }),
        )
        .expect("the held request");
    for (path, body) in [
        (COMPLETIONS, json!({"prompt": "a", "max_tokens": 2})),
        (
            CHAT,
            json!({"messages": [{"role": "user", "content": "a"}], "stream": true}),
        ),
    ] {
        let (status, v) = s.json(path, &body).await;
        assert_error(status, &v, 429, None, path);
        assert_eq!(v["error"]["code"], "queue_full");
        let resp = s.post(path).json(&body).send().await.expect("request");
        let retry = resp
            .headers()
            .get("retry-after")
            .and_then(|h| h.to_str().ok());
        assert_eq!(retry, Some("1"), "{path}");
    }
    s.engine.abort(id);
    drop(open);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_without_a_template_is_400() {
    let mut setup = Setup::new(TINY_NAME);
    setup.chat_template = false;
    let s = start(&tiny_model(), setup).await;
    let (status, v) = s
        .json(
            CHAT,
            &json!({"messages": [{"role": "user", "content": "a"}]}),
        )
        .await;
    assert_error(status, &v, 400, None, "no template");
    s.ok(COMPLETIONS, &json!({"prompt": "a", "max_tokens": 2}))
        .await;
    s.shutdown().await;
}

/// Random JSON of random shapes in every known field: the answer is always
/// 200 or an OpenAI error (never a panic, a hang or a plain-text body).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_fields_never_break_the_server() {
    const BODIES: usize = 300;
    let s = tiny().await;
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let fields = [
        "model",
        "prompt",
        "messages",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop",
        "logprobs",
        "top_logprobs",
        "echo",
        "best_of",
        "suffix",
        "logit_bias",
        "tools",
        "response_format",
    ];
    for i in 0..BODIES {
        let mut body = serde_json::Map::new();
        for f in fields {
            if rng.random_bool(0.4) {
                body.insert(f.to_string(), random_value(&mut rng, 2));
            }
        }
        // Keep valid requests short.
        if rng.random_bool(0.7) {
            body.insert("max_tokens".into(), json!(rng.random_range(1..4)));
        }
        let path = if i % 2 == 0 { COMPLETIONS } else { CHAT };
        let body = Value::Object(body);
        let resp = s.post(path).json(&body).send().await.expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.expect("body");
        if status == 200 {
            continue;
        }
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!([400, 404].contains(&status), "{status} for {body}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    s.wait_metrics("an idle engine", |m| m["kvant_num_requests_running"] == 0.0)
        .await;
    s.ok(
        COMPLETIONS,
        &json!({"prompt": "still alive", "max_tokens": 2}),
    )
    .await;
    s.shutdown().await;
}

fn random_value(rng: &mut ChaCha8Rng, depth: u32) -> Value {
    match rng.random_range(0..if depth == 0 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => json!(rng.random_bool(0.5)),
        2 => json!(rng.random_range(-3i64..40)),
        3 => json!(rng.random_range(-3.0f64..3.0)),
        4 => {
            json!(["", "a", "Hi", "user", "text", "<|im_end|>", TINY_NAME][rng.random_range(0..7)])
        }
        5 => json!(rng.random_range(0u64..u64::MAX)),
        6 => Value::Array(
            (0..rng.random_range(0..4))
                .map(|_| random_value(rng, depth - 1))
                .collect(),
        ),
        _ => {
            let keys = ["role", "content", "type", "text", "include_usage"];
            let mut m = serde_json::Map::new();
            for k in keys {
                if rng.random_bool(0.5) {
                    m.insert(k.into(), random_value(rng, depth - 1));
                }
            }
            Value::Object(m)
        }
    }
}

/// `--allowed-origins`: a listed origin gets CORS headers, a preflight is
/// answered before the key check, other origins (and a server without the
/// option) get none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_answers_listed_origins_only() {
    const UI: &str = "https://ui.example";
    let mut setup = Setup::new(TINY_NAME);
    setup.server.api_key = Some("sesame".into());
    setup.server.allowed_origins =
        kvant_server::AllowedOrigins::parse(&[UI.to_string()]).expect("an origin");
    let s = start(&tiny_model(), setup).await;
    let allow = |r: &reqwest::Response| {
        r.headers()
            .get("access-control-allow-origin")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let preflight = s
        .client
        .request(reqwest::Method::OPTIONS, format!("{}{CHAT}", s.url))
        .header("origin", UI)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type",
        )
        .send()
        .await
        .expect("preflight");
    assert_eq!(preflight.status().as_u16(), 200);
    assert_eq!(allow(&preflight).as_deref(), Some(UI));
    let body = json!({"prompt": "a", "max_tokens": 2});
    let call = |origin: &'static str| {
        s.post(COMPLETIONS)
            .json(&body)
            .header("authorization", "Bearer sesame")
            .header("origin", origin)
            .send()
    };
    let resp = call(UI).await.expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(allow(&resp).as_deref(), Some(UI));
    let resp = call("https://evil.example").await.expect("request");
    assert_eq!(allow(&resp), None);
    s.shutdown().await;

    let s = tiny().await;
    let resp = s
        .post(COMPLETIONS)
        .json(&body)
        .header("origin", UI)
        .send()
        .await
        .expect("request");
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(allow(&resp), None);
    s.shutdown().await;
}
