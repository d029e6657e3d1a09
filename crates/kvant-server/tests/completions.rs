//! `/v1/completions` and `/v1/chat/completions` end to end on the tiny
//! fixture model: shapes, streaming, logprobs, n, stop, seeds.

mod common;

use common::{streamed_text, tiny, TINY_NAME};
use serde_json::{json, Value};

const PROMPT: &str = "The quick brown fox";

fn greedy(extra: Value) -> Value {
    let mut body =
        json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    merge(&mut body, extra);
    body
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
        b.extend(e);
    }
}

fn chat_body(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        "max_tokens": 10, "temperature": 0, "ignore_eos": true,
    });
    merge(&mut body, extra);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_streamed_and_not_agree() {
    let s = tiny().await;
    let v = s
        .ok("/v1/completions", &greedy(json!({"model": TINY_NAME})))
        .await;
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], TINY_NAME);
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")));
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null());
    let text = choice["text"].as_str().expect("text").to_string();
    let prompt_tokens = s.tokenizer.encode(PROMPT, true).expect("encode").len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 12);

    let chunks = s
        .stream("/v1/completions", &greedy(json!({"stream": true})))
        .await;
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "usage without include_usage"
    );
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let ids: std::collections::HashSet<_> = chunks.iter().map(|c| c["id"].clone()).collect();
    assert_eq!(ids.len(), 1, "one id per stream");
    assert_eq!(
        streamed_text(&chunks, 0),
        (text.clone(), Some("length".into()))
    );

    // The same prompt as token ids, and as an array of one string.
    let ids = s.tokenizer.encode(PROMPT, true).expect("encode");
    for prompt in [json!(ids), json!([ids]), json!([PROMPT])] {
        let v = s
            .ok("/v1/completions", &greedy(json!({"prompt": prompt})))
            .await;
        assert_eq!(
            v["choices"][0]["text"].as_str(),
            Some(text.as_str()),
            "{prompt}"
        );
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_usage_sends_a_final_usage_chunk() {
    let s = tiny().await;
    for (path, body) in [
        (
            "/v1/completions",
            greedy(json!({"stream": true, "stream_options": {"include_usage": true}})),
        ),
        (
            "/v1/chat/completions",
            chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
        ),
    ] {
        let chunks = s.stream(path, &body).await;
        let (last, rest) = chunks.split_last().expect("chunks");
        assert_eq!(last["choices"], json!([]), "{path}");
        let u = &last["usage"];
        let completion = u["completion_tokens"].as_u64().expect("completion_tokens");
        assert_eq!(
            completion,
            body["max_tokens"].as_u64().expect("max_tokens"),
            "{path}"
        );
        assert_eq!(
            u["total_tokens"].as_u64(),
            Some(u["prompt_tokens"].as_u64().expect("prompt") + completion)
        );
        assert!(
            rest.iter()
                .all(|c| c["usage"].is_null() && c.get("usage").is_some()),
            "{path}"
        );
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streamed_and_not_agree() {
    let s = tiny().await;
    let v = s.ok("/v1/chat/completions", &chat_body(json!({}))).await;
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let text = choice["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    // The prompt is the template's rendering, tokenized without added specials.
    let rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n";
    let prompt_tokens = s.tokenizer.encode(rendered, false).expect("encode").len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 10);

    let chunks = s
        .stream("/v1/chat/completions", &chat_body(json!({"stream": true})))
        .await;
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let first = &chunks[0]["choices"][0];
    assert_eq!(first["delta"], json!({"role": "assistant", "content": ""}));
    let last = &chunks[chunks.len() - 1]["choices"][0];
    assert_eq!(last["delta"], json!({}));
    assert_eq!(streamed_text(&chunks, 0), (text, Some("length".into())));

    // max_completion_tokens wins over max_tokens; text parts join.
    let body = json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        "max_tokens": 3, "max_completion_tokens": 5, "ignore_eos": true,
    });
    let v = s.ok("/v1/chat/completions", &body).await;
    assert_eq!(v["usage"]["completion_tokens"], 5);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_logprobs_shape() {
    let s = tiny().await;
    let v = s
        .ok("/v1/completions", &greedy(json!({"logprobs": 3})))
        .await;
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    let n = tokens.len();
    assert_eq!(n, 12);
    let token_lps = lp["token_logprobs"].as_array().expect("token_logprobs");
    let tops = lp["top_logprobs"].as_array().expect("top_logprobs");
    let offsets = lp["text_offset"].as_array().expect("text_offset");
    assert_eq!((token_lps.len(), tops.len(), offsets.len()), (n, n, n));
    assert_eq!(offsets[0], 0);
    let mut expected_offset = 0;
    for i in 0..n {
        let tok = tokens[i].as_str().expect("token");
        let chosen = token_lps[i].as_f64().expect("logprob");
        assert!(chosen <= 0.0);
        assert_eq!(offsets[i].as_u64(), Some(expected_offset));
        expected_offset += tok.chars().count() as u64;
        let top = tops[i].as_object().expect("top map");
        assert!((1..=3).contains(&top.len()), "{top:?}");
        let best = top
            .values()
            .filter_map(Value::as_f64)
            .fold(f64::MIN, f64::max);
        // Greedy picks the most likely token.
        assert!(
            (best - chosen).abs() < 1e-5,
            "greedy token is not the top one: {best} vs {chosen}"
        );
    }

    // Streamed: each chunk's logprobs cover its token, and agree with the above.
    let chunks = s
        .stream(
            "/v1/completions",
            &greedy(json!({"logprobs": 3, "stream": true})),
        )
        .await;
    let streamed: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"].as_object().cloned())
        .flat_map(|o| o["token_logprobs"].as_array().cloned().unwrap_or_default())
        .collect();
    assert_eq!(&streamed, token_lps);
    let streamed_offsets: Vec<Value> = chunks
        .iter()
        .filter_map(|c| {
            c["choices"][0]["logprobs"]["text_offset"]
                .as_array()
                .cloned()
        })
        .flatten()
        .collect();
    assert_eq!(&streamed_offsets, offsets);

    // logprobs 0: the chosen token only.
    let v = s
        .ok("/v1/completions", &greedy(json!({"logprobs": 0})))
        .await;
    let tops = v["choices"][0]["logprobs"]["top_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(tops.len(), 12);
    assert!(tops
        .iter()
        .all(|t| t.as_object().is_some_and(|m| m.is_empty())));
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_shape() {
    let s = tiny().await;
    let body = chat_body(json!({"logprobs": true, "top_logprobs": 2}));
    let v = s.ok("/v1/chat/completions", &body).await;
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .cloned()
        .expect("content");
    assert_eq!(content.len(), 10);
    for entry in &content {
        let token = entry["token"].as_str().expect("token");
        let bytes = byte_list(&entry["bytes"]);
        assert_eq!(String::from_utf8_lossy(&bytes), token);
        assert!(entry["logprob"].as_f64().is_some_and(|l| l <= 0.0));
        let top = entry["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 2);
        assert!(top
            .iter()
            .all(|t| t["token"].is_string() && t["bytes"].is_array()));
        let l0 = top[0]["logprob"].as_f64().expect("lp");
        let l1 = top[1]["logprob"].as_f64().expect("lp");
        assert!(l0 >= l1, "most likely first");
    }
    // Without logprobs: null.
    let v = s
        .ok(
            "/v1/chat/completions",
            &chat_body(json!({"logprobs": false})),
        )
        .await;
    assert!(v["choices"][0]["logprobs"].is_null());

    // Streamed: one entry per token, same values.
    let mut stream_body = body.clone();
    merge(&mut stream_body, json!({"stream": true}));
    let chunks = s.stream("/v1/chat/completions", &stream_body).await;
    let streamed: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed, content);
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_use_consecutive_seeds() {
    let s = tiny().await;
    let sampled = |extra: Value| {
        let mut b =
            json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "ignore_eos": true});
        merge(&mut b, extra);
        b
    };
    let v = s
        .ok("/v1/completions", &sampled(json!({"n": 2, "seed": 41})))
        .await;
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].as_u64(), choices[1]["index"].as_u64()),
        (Some(0), Some(1))
    );
    assert_eq!(v["usage"]["completion_tokens"], 32);
    // Choice i is the single-choice run with seed + i.
    for (i, seed) in [(0, 41), (1, 42)] {
        let one = s
            .ok("/v1/completions", &sampled(json!({"seed": seed})))
            .await;
        assert_eq!(one["choices"][0]["text"], choices[i]["text"], "choice {i}");
    }
    // Streamed: both choices appear, each ends once, and match the above.
    let chunks = s
        .stream(
            "/v1/completions",
            &sampled(json!({"n": 2, "seed": 41, "stream": true})),
        )
        .await;
    for i in 0..2u64 {
        let (text, finish) = streamed_text(&chunks, i);
        assert_eq!(Some(text.as_str()), choices[i as usize]["text"].as_str());
        assert_eq!(finish.as_deref(), Some("length"));
    }
    // Chat streams announce the role of every choice first.
    let body = chat_body(json!({"n": 3, "stream": true, "temperature": 1.0, "seed": 7}));
    let chunks = s.stream("/v1/chat/completions", &body).await;
    let roles: Vec<u64> = chunks[..3]
        .iter()
        .map(|c| {
            assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
            c["choices"][0]["index"].as_u64().expect("index")
        })
        .collect();
    assert_eq!(roles, [0, 1, 2]);
    for i in 0..3 {
        assert_eq!(streamed_text(&chunks, i).1.as_deref(), Some("length"));
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_the_text() {
    let s = tiny().await;
    let long = greedy(json!({"max_tokens": 40}));
    let full = s.ok("/v1/completions", &long).await["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_string();
    // A two-character stop whose first occurrence is past the start.
    let chars: Vec<char> = full.chars().collect();
    let (cut, stop) = (3..chars.len().saturating_sub(2))
        .map(|i| {
            let stop: String = chars[i..i + 2].iter().collect();
            (i, stop)
        })
        .find(|(i, stop)| {
            full.find(stop.as_str()) == Some(chars[..*i].iter().collect::<String>().len())
        })
        .expect("a usable stop string in the output");
    let expected: String = chars[..cut].iter().collect();
    for stop_field in [json!(stop), json!(["\u{1}never", stop])] {
        let mut body = long.clone();
        merge(&mut body, json!({"stop": stop_field}));
        let v = s.ok("/v1/completions", &body).await;
        assert_eq!(v["choices"][0]["text"].as_str(), Some(expected.as_str()));
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        merge(&mut body, json!({"stream": true}));
        let chunks = s.stream("/v1/completions", &body).await;
        assert_eq!(
            streamed_text(&chunks, 0),
            (expected.clone(), Some("stop".into()))
        );
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_max_tokens_is_16_for_completions_and_the_context_for_chat() {
    let s = tiny().await;
    // OpenAI's (and vLLM's) default for /v1/completions.
    let v = s
        .ok(
            "/v1/completions",
            &json!({"prompt": PROMPT, "ignore_eos": true, "temperature": 0}),
        )
        .await;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let mut chat = chat_body(json!({}));
    if let Some(o) = chat.as_object_mut() {
        o.remove("max_tokens");
    }
    let v = s.ok("/v1/chat/completions", &chat).await;
    assert_eq!(
        v["usage"]["total_tokens"].as_u64(),
        Some(s.engine.context_length() as u64)
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    s.shutdown().await;
}

fn byte_list(v: &Value) -> Vec<u8> {
    v.as_array()
        .expect("bytes")
        .iter()
        .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()).expect("byte"))
        .collect()
}

/// A token that ends inside a UTF-8 character shows U+FFFD as its `token`,
/// but its `bytes` are exact: joined, they are the reply's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprob_bytes_rebuild_the_text() {
    let s = tiny().await;
    let mut partial = 0;
    for seed in 0..6 {
        let body = chat_body(
            json!({"logprobs": true, "top_logprobs": 1, "temperature": 1.0,
            "seed": seed, "max_tokens": 40}),
        );
        let v = s.ok("/v1/chat/completions", &body).await;
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content");
        let content = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .cloned()
            .expect("content");
        let mut joined = Vec::new();
        for entry in &content {
            let bytes = byte_list(&entry["bytes"]);
            let token = entry["token"].as_str().expect("token");
            if token.starts_with("<|") && token.ends_with("|>") {
                continue; // a control token (ignore_eos): no text
            }
            partial += usize::from(bytes != token.as_bytes());
            joined.extend(bytes);
        }
        assert_eq!(String::from_utf8_lossy(&joined), text, "seed {seed}");
    }
    assert!(
        partial > 0,
        "the random model produced no partial character to check"
    );
    s.shutdown().await;
}

/// `logit_bias`: +100 makes a token the greedy choice every time, -100
/// takes the greedy first token away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_moves_greedy_choices() {
    let s = tiny().await;
    let plain = s
        .ok("/v1/completions", &greedy(json!({"logprobs": 0})))
        .await;
    let first = plain["choices"][0]["logprobs"]["tokens"][0]
        .as_str()
        .expect("a token")
        .to_string();
    let t = s
        .ok(
            "/tokenize",
            &json!({"prompt": first, "add_special_tokens": false}),
        )
        .await;
    let first_id = t["tokens"][0].as_u64().expect("an id");
    let banned = s
        .ok(
            "/v1/completions",
            &greedy(json!({"logprobs": 0, "logit_bias": {first_id.to_string(): -100}})),
        )
        .await;
    assert_ne!(
        banned["choices"][0]["logprobs"]["tokens"][0].as_str(),
        Some(first.as_str())
    );
    let forced = s
        .ok(
            "/v1/chat/completions",
            &chat_body(json!({"logit_bias": {"65": 100}})),
        )
        .await;
    let t = s.ok("/tokenize", &json!({"prompt": forced["choices"][0]["message"]["content"], "add_special_tokens": false})).await;
    let ids: Vec<u64> = t["tokens"]
        .as_array()
        .expect("ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert!(!ids.is_empty() && ids.iter().all(|&i| i == 65), "{ids:?}");
    s.shutdown().await;
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| c["text"].as_str().expect("text").to_string())
        .collect()
}

/// A list of prompts is a batch: choice `p·n + j` continues prompt `p`
/// exactly as a request of that prompt alone, usage sums the prompts, and
/// the stream agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_prompts_is_a_batch() {
    let s = tiny().await;
    let prompts = ["The quick brown fox", "Hello there"];
    let mut alone = Vec::new();
    for p in prompts {
        alone.push(
            s.ok(
                "/v1/completions",
                &greedy(json!({"prompt": p, "max_tokens": 4})),
            )
            .await,
        );
    }
    let v = s
        .ok(
            "/v1/completions",
            &greedy(json!({"prompt": prompts, "n": 2, "max_tokens": 4})),
        )
        .await;
    let got = texts(&v);
    assert_eq!(got.len(), 4);
    for (i, text) in got.iter().enumerate() {
        assert_eq!(v["choices"][i]["index"], i);
        assert_eq!(text, &texts(&alone[i / 2])[0], "choice {i}");
    }
    let prompt_tokens: u64 = alone
        .iter()
        .filter_map(|a| a["usage"]["prompt_tokens"].as_u64())
        .sum();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 16);
    let chunks = s
        .stream(
            "/v1/completions",
            &greedy(json!({"prompt": prompts, "n": 2, "max_tokens": 4, "stream": true})),
        )
        .await;
    for (i, text) in got.iter().enumerate() {
        let streamed: String = chunks
            .iter()
            .filter_map(|c| c["choices"].as_array())
            .flatten()
            .filter(|c| c["index"] == i)
            .filter_map(|c| c["text"].as_str())
            .collect();
        assert_eq!(&streamed, text, "streamed choice {i}");
    }
    s.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_starts_each_choice_with_its_prompt() {
    let s = tiny().await;
    let plain = texts(&s.ok("/v1/completions", &greedy(json!({}))).await);
    let echoed = texts(
        &s.ok("/v1/completions", &greedy(json!({"echo": true})))
            .await,
    );
    assert_eq!(echoed, vec![format!("{PROMPT}{}", plain[0])]);
    let chunks = s
        .stream(
            "/v1/completions",
            &greedy(json!({"echo": true, "stream": true})),
        )
        .await;
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, echoed[0]);
    s.shutdown().await;
}

/// `best_of` runs its candidates with seeds `seed..seed+best_of` and returns
/// the `n` with the highest mean log-probability per token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn best_of_returns_the_most_likely_candidates() {
    let s = tiny().await;
    let sampled = |seed: u64| json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": seed, "logprobs": 0, "ignore_eos": true});
    let mut candidates = Vec::new();
    for j in 0..5u64 {
        let v = s.ok("/v1/completions", &sampled(40 + j)).await;
        let lps: Vec<f64> = v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .expect("logprobs")
            .iter()
            .filter_map(Value::as_f64)
            .collect();
        let mean = lps.iter().sum::<f64>() / lps.len() as f64;
        candidates.push((mean, texts(&v)[0].clone()));
    }
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut body = sampled(40);
    body["best_of"] = json!(5);
    body["n"] = json!(2);
    body.as_object_mut().map(|o| o.remove("logprobs"));
    let v = s.ok("/v1/completions", &body).await;
    assert_eq!(
        texts(&v),
        vec![candidates[0].1.clone(), candidates[1].1.clone()]
    );
    assert!(v["choices"][0]["logprobs"].is_null());
    assert_eq!(v["usage"]["completion_tokens"], 30);
    s.shutdown().await;
}

/// vLLM's `skip_special_tokens`: by default control tokens leave no text;
/// false keeps their spelling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_special_tokens_false_keeps_control_tokens() {
    let s = tiny().await;
    let im_start = s
        .tokenizer
        .encode("<|im_start|>", false)
        .expect("tokenizes");
    assert_eq!(im_start.len(), 1);
    let forced = |skip: bool| {
        json!({"prompt": "Hello", "max_tokens": 2, "ignore_eos": true, "temperature": 0,
            "logit_bias": {im_start[0].to_string(): 100}, "skip_special_tokens": skip})
    };
    let kept = s.ok("/v1/completions", &forced(false)).await;
    assert_eq!(kept["choices"][0]["text"], "<|im_start|><|im_start|>");
    let skipped = s.ok("/v1/completions", &forced(true)).await;
    assert_eq!(skipped["choices"][0]["text"], "");
    s.shutdown().await;
}
