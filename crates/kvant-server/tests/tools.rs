//! Tool calling end to end on a tiny fixture model behind a Hermes-style
//! template (Qwen 2.5's): `tool_choice` required or named always yields a
//! call whose arguments fit the function's schema, streamed and whole
//! responses agree, tool turns are accepted, and what cannot work is a 400.

mod common;

use common::{assert_error, start, streamed_text, tiny, Setup, TestServer, TINY_NAME};
use serde_json::{json, Value};
use std::path::Path;

/// A fixture of the same 320-token byte-level vocabulary with a 1,024-token
/// context: the tool list alone renders to about 700 tokens.
fn long_model() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama3-long")
}

fn hermes() -> Setup {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat/hermes_tools.json");
    let text = std::fs::read_to_string(path).expect("the fixture");
    let fixture: Value = serde_json::from_str(&text).expect("json");
    let mut setup = Setup::new(TINY_NAME);
    setup.template_source = fixture["template"].as_str().map(str::to_string);
    setup
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Today's weather.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now"}}
    ])
}

fn body(extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": tools(), "temperature": 1.0, "max_tokens": 200,
    });
    if let (Some(o), Value::Object(e)) = (b.as_object_mut(), extra) {
        o.extend(e);
    }
    b
}

fn check_call(call: &Value) -> (String, Value) {
    assert_eq!(call["type"], "function");
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")),
        "{call}"
    );
    let name = call["function"]["name"]
        .as_str()
        .expect("a name")
        .to_string();
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().expect("arguments"))
            .expect("the arguments are JSON");
    match name.as_str() {
        "get_weather" => {
            let city = args["city"].as_str().expect("a city");
            assert!(city.chars().count() <= 12, "{args}");
            let keys: Vec<&String> = args.as_object().expect("an object").keys().collect();
            assert!(keys.iter().all(|k| *k == "city" || *k == "unit"), "{args}");
            if let Some(u) = args.get("unit") {
                assert!(u == "celsius" || u == "fahrenheit", "{args}");
            }
        }
        "now" => assert!(args.is_object(), "{args}"),
        other => panic!("called {other}"),
    }
    (name, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demanded_calls_always_parse_into_the_schema() {
    let s = start(&long_model(), hermes()).await;
    for seed in 0..4 {
        let v = s
            .ok(
                "/v1/chat/completions",
                &body(json!({"tool_choice": "required", "n": 4, "seed": seed})),
            )
            .await;
        for c in v["choices"].as_array().expect("choices") {
            assert_eq!(c["finish_reason"], "tool_calls", "{c}");
            let calls = c["message"]["tool_calls"].as_array().expect("tool_calls");
            assert_eq!(calls.len(), 1, "{c}");
            check_call(&calls[0]);
        }
    }
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 9});
    let v = s.ok("/v1/chat/completions", &body(named.clone())).await;
    let (name, _) = check_call(&v["choices"][0]["message"]["tool_calls"][0]);
    assert_eq!(name, "get_weather");
    assert!(v["choices"][0]["message"]["content"].is_null());

    streams_the_same_call(&s, named, &v).await;
    s.shutdown().await;
}

/// The request `extra` streamed carries `whole`'s call, in one delta, and
/// no text.
async fn streams_the_same_call(s: &TestServer, extra: Value, whole: &Value) {
    let mut streamed = body(extra);
    streamed["stream"] = json!(true);
    let chunks = s.stream("/v1/chat/completions", &streamed).await;
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(deltas.len(), 1);
    assert_eq!(deltas[0]["index"], 0);
    assert_eq!(
        deltas[0]["function"],
        whole["choices"][0]["message"]["tool_calls"][0]["function"]
    );
    let (text, finish) = streamed_text(&chunks, 0);
    assert_eq!((text.as_str(), finish.as_deref()), ("", Some("tool_calls")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_turns_and_auto_answer_in_text() {
    let s = start(&long_model(), hermes()).await;
    let turns = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}
    ], "temperature": 0, "max_tokens": 8, "ignore_eos": true});
    let v = s.ok("/v1/chat/completions", &body(turns)).await;
    // A random model does not write <tool_call>: auto leaves its text as text.
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // tool_choice none renders no tools: a shorter prompt.
    let with = s
        .ok("/v1/chat/completions", &body(json!({"max_tokens": 1})))
        .await;
    let without = s
        .ok(
            "/v1/chat/completions",
            &body(json!({"max_tokens": 1, "tool_choice": "none"})),
        )
        .await;
    assert!(without["usage"]["prompt_tokens"].as_u64() < with["usage"]["prompt_tokens"].as_u64());
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_work_is_a_400() {
    let s = start(&long_model(), hermes()).await;
    let cases = [
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            "messages[0].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ];
    for (extra, param) in cases {
        let (status, v) = s.json("/v1/chat/completions", &body(extra.clone())).await;
        assert_error(status, &v, 400, Some(param), &extra.to_string());
    }
    s.shutdown().await;
    // The fixture's own template writes no tool calls: tools are refused,
    // tool_choice asking for a call without tools too.
    let s = tiny().await;
    let (status, v) = s.json("/v1/chat/completions", &body(json!({}))).await;
    assert_error(
        status,
        &v,
        400,
        Some("tools"),
        "tools with a plain template",
    );
    let (status, v) = s
        .json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
        )
        .await;
    assert_error(
        status,
        &v,
        400,
        Some("tool_choice"),
        "required without tools",
    );
    s.shutdown().await;
}

/// Llama 3 JSON and Mistral formats: a template that names their marker
/// gets demanded calls as the bare JSON those models write, read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama3_and_mistral_forms_call_too() {
    // Minimal templates: the tools as JSON, then the turns; what matters is
    // the marker that names the format.
    let templates = [
        "{{ '<|python_tag|>' if false }}{{ tools | tojson }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ",
        "{{ '[TOOL_CALLS]' if false }}{{ tools | tojson }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ",
    ];
    for template in templates {
        let mut setup = Setup::new(TINY_NAME);
        setup.template_source = Some(template.to_string());
        let s = start(&long_model(), setup).await;
        let v = s
            .ok(
                "/v1/chat/completions",
                &body(json!({"tool_choice": "required", "n": 3, "seed": 4})),
            )
            .await;
        for c in v["choices"].as_array().expect("choices") {
            assert_eq!(c["finish_reason"], "tool_calls", "{template}: {c}");
            check_call(&c["message"]["tool_calls"][0]);
        }
        s.shutdown().await;
    }
}

const DS_MARKERS: [&str; 5] = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
];

/// The long fixture with DeepSeek's five tool-call markers as control
/// tokens, in a copy: ids 315..320 are given to them (their byte-level
/// pieces and the merges that made them leave the vocabulary), so the
/// model keeps its 320-row embedding.
fn deepseek_vocab_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temp dir");
    for entry in std::fs::read_dir(long_model()).expect("the fixture") {
        let path = entry.expect("an entry").path();
        let to = dir.path().join(path.file_name().expect("a name"));
        std::fs::copy(&path, &to).expect("copied");
    }
    let path = dir.path().join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("read"))
        .expect("tokenizer.json");
    let vocab = tok["model"]["vocab"].as_object_mut().expect("a vocabulary");
    let gone: Vec<String> = vocab
        .iter()
        .filter(|(_, id)| id.as_u64().is_some_and(|id| id >= 315))
        .map(|(piece, _)| piece.clone())
        .collect();
    vocab.retain(|piece, _| !gone.contains(piece));
    let merges = tok["model"]["merges"].as_array_mut().expect("merges");
    merges.retain(|m| {
        let joined: String = m
            .as_array()
            .map(|pair| pair.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        !gone.contains(&joined)
    });
    let added = tok["added_tokens"].as_array_mut().expect("added tokens");
    for (i, m) in DS_MARKERS.iter().enumerate() {
        added.push(
            json!({"id": 315 + i, "content": m, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}),
        );
    }
    std::fs::write(&path, tok.to_string()).expect("written");
    dir
}

/// DeepSeek-V3 (fenced arguments) and V3.1 (bare): a demanded call is
/// written in the marker tokens, which such requests keep in the text, and
/// read back into `tool_calls`, streamed and whole alike; the vocabulary
/// without the markers cannot force a call (a 400 naming `tool_choice`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deepseek_calls_are_written_in_control_tokens() {
    let dir = deepseek_vocab_model();
    let templates = [
        "{{ '<｜tool▁calls▁begin｜>```json' if false }}{{ tools | tojson }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ",
        "{{ '<｜tool▁calls▁begin｜>' if false }}{{ tools | tojson }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ",
    ];
    for template in templates {
        let mut setup = Setup::new(TINY_NAME);
        setup.template_source = Some(template.to_string());
        let s = start(dir.path(), setup).await;
        let v = s
            .ok(
                "/v1/chat/completions",
                &body(json!({"tool_choice": "required", "n": 4, "seed": 2})),
            )
            .await;
        for c in v["choices"].as_array().expect("choices") {
            assert_eq!(c["finish_reason"], "tool_calls", "{template}: {c}");
            assert!(c["message"]["content"].is_null(), "{c}");
            check_call(&c["message"]["tool_calls"][0]);
        }
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "seed": 5});
        let whole = s.ok("/v1/chat/completions", &body(named.clone())).await;
        let (name, _) = check_call(&whole["choices"][0]["message"]["tool_calls"][0]);
        assert_eq!(name, "get_weather");
        streams_the_same_call(&s, named, &whole).await;
        s.shutdown().await;
    }
    let mut setup = Setup::new(TINY_NAME);
    setup.template_source = Some(templates[1].to_string());
    let s = start(&long_model(), setup).await;
    let (status, v) = s
        .json(
            "/v1/chat/completions",
            &body(json!({"tool_choice": "required"})),
        )
        .await;
    assert_error(status, &v, 400, Some("tool_choice"), "no marker tokens");
    s.shutdown().await;
}
