//! `kvant bench` on a tiny fixture GGUF: the JSON report's keys and values,
//! and clear errors (never a panic) for requests it cannot run.

mod common;
use common::*;

/// serde_json parses floats to within an ulp or two, not always exactly.
const JSON_REL_TOL: f64 = 1e-12;

fn tiny_gguf() -> String {
    fixture("models/gguf/llama-gqa.Q4_0.gguf")
        .to_str()
        .expect("utf-8 fixture path")
        .to_string()
}

fn positive(v: &serde_json::Value, key: &str) -> f64 {
    let x = v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"));
    assert!(x.is_finite() && x > 0.0, "{key} = {x}");
    x
}

/// The run every report test starts from: 8 prompt tokens, 4 generated, one thread.
const SMALL_RUN: [&str; 6] = [
    "--prompt-tokens",
    "8",
    "--gen-tokens",
    "4",
    "--threads",
    "1",
];

/// `kvant bench --model MODEL --json ARGS...`, its report parsed.
fn bench_json(model: &str, args: &[&str]) -> serde_json::Value {
    json(&kvant_ok(
        &[&["bench", "--model", model, "--json"], args].concat(),
    ))
}

fn rates(v: &serde_json::Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} is not an array in {v}"))
        .iter()
        .map(|x| x.as_f64().expect("a rate"))
        .collect()
}

#[test]
fn bench_json_reports_rates_and_roofline() {
    let model = tiny_gguf();
    let out = bench_json(&model, &[&SMALL_RUN[..], &["--repetitions", "2"]].concat());
    assert_eq!(out["model"], model.as_str());
    assert_eq!(out["threads"], 1);
    assert_eq!(out["prompt_tokens"], 8);
    assert_eq!(out["gen_tokens"], 4);
    assert_eq!(out["repetitions"], 2);
    let file_len = std::fs::metadata(&model).expect("fixture").len();
    assert_eq!(out["model_bytes"].as_u64(), Some(file_len));
    let weights = positive(&out, "weight_bytes");
    for key in [
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "peak_rss_bytes",
        "bandwidth_bytes_per_s",
        "roofline_decode_tokens_per_s",
        "decode_roofline_fraction",
    ] {
        positive(&out, key);
    }
    for key in ["prefill_runs", "decode_runs"] {
        let runs = rates(&out, key);
        assert_eq!(runs.len(), 2, "{key}");
        assert!(runs.iter().all(|r| r.is_finite() && *r > 0.0), "{key}");
    }
    // Decode steps at positions 8..12 read 9..13 cached positions (their
    // own included): 10.5 on average, on top of the weights.
    let kv = positive(&out, "kv_bytes_per_position");
    assert_eq!(positive(&out, "bytes_per_token"), weights + 10.5 * kv);
    let roofline = out["bandwidth_bytes_per_s"].as_f64().unwrap() / (weights + 10.5 * kv);
    let reported = positive(&out, "roofline_decode_tokens_per_s");
    assert!(
        (reported - roofline).abs() <= JSON_REL_TOL * roofline,
        "{reported} vs {roofline}"
    );
    assert!(["scalar", "avx2", "avx512"].contains(&out["simd_tier"].as_str().unwrap()));
    // Without --depth: one row, at depth 0, which the top level repeats.
    let rows = out["depths"].as_array().expect("depths");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["depth"], 0);
    assert_eq!(out["depth"], 0);
    assert_eq!(rows[0]["prefill_runs"], out["prefill_runs"]);
}

/// `--depth` runs every test after that many tokens in the cache: one row
/// per depth, in the order given, each counting the KV bytes its decode
/// steps read there.
#[test]
fn bench_depths_give_one_row_each() {
    let model = tiny_gguf();
    // The fixture's context is 256: 244 + 8 + 4 fills it exactly, so a
    // repetition that did not rewind the cache to the depth would overflow.
    let out = bench_json(
        &model,
        &[
            &SMALL_RUN[..],
            &["--repetitions", "2", "--depth", "100,0,244"],
        ]
        .concat(),
    );
    let weights = positive(&out, "weight_bytes");
    let kv = positive(&out, "kv_bytes_per_position");
    let rows = out["depths"].as_array().expect("depths");
    let depths: Vec<u64> = rows.iter().map(|r| r["depth"].as_u64().unwrap()).collect();
    assert_eq!(depths, [100, 0, 244]);
    for (row, depth) in rows.iter().zip([100.0, 0.0, 244.0]) {
        for key in [
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "roofline_decode_tokens_per_s",
            "decode_roofline_fraction",
        ] {
            positive(row, key);
        }
        assert_eq!(rates(row, "prefill_runs").len(), 2);
        assert_eq!(rates(row, "decode_runs").len(), 2);
        // Decode steps at depth + 8 + i read depth + 9 + i positions.
        let read = (depth + 10.5) * kv;
        assert_eq!(row["kv_bytes_read_per_token"].as_f64(), Some(read));
        assert_eq!(row["bytes_per_token"].as_f64(), Some(weights + read));
        assert!(row["fill_secs"].as_f64().is_some_and(|s| s >= 0.0));
    }
    assert!(positive(&rows[2], "fill_secs") > 0.0);
    // The top level repeats the first depth's row.
    assert_eq!(out["depth"], 100);
    assert_eq!(out["decode_runs"], rows[0]["decode_runs"]);
    assert_eq!(out["bytes_per_token"], rows[0]["bytes_per_token"]);
}

/// `--ctx-size` replaces the checkpoint's context: longer lets a bench
/// run past it (with a warning), shorter bounds it; 0 is a usage error.
#[test]
fn ctx_size_replaces_the_checkpoint_context() {
    let model = tiny_gguf();
    let args = |ctx: &'static str, depth: &'static str| {
        let run = [
            "--repetitions",
            "1",
            "--depth",
            depth,
            "--ctx-size",
            ctx,
            "--json",
        ];
        [
            &["bench", "--model", model.as_str()],
            &SMALL_RUN[..],
            &run[..],
        ]
        .concat()
    };
    // The fixture declares 256 positions: 300 + 12 runs only with a longer context.
    let out = kvant_ok(&args("320", "300"));
    assert_eq!(json(&out)["depth"], 300);
    let err = kvant_err(&args("100", "90"));
    assert!(
        err.contains("exceeds the model's context length 100"),
        "{err}"
    );
    let out = kvant(&args("0", "0"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--ctx-size"), "{stderr}");
    let info = json(&kvant_ok(&[
        "info",
        "--model",
        &model,
        "--ctx-size",
        "320",
        "--json",
    ]));
    assert_eq!(info["context_length"], 320);
    assert_eq!(info["trained_context_length"], 256);
}

/// A sliding-window layer's decode step reads only its window: the Gemma 3
/// fixture has window 8 in layers 0 and 2 and full attention in layer 1.
#[test]
fn bench_counts_only_the_window_of_sliding_layers() {
    let model = fixture("models/gemma3-text");
    let out = bench_json(
        model.to_str().expect("utf-8 fixture path"),
        &[&SMALL_RUN[..], &["--repetitions", "1", "--depth", "100"]].concat(),
    );
    let per_layer = positive(&out, "kv_bytes_per_position") / 3.0;
    // Two local layers read 8 positions each, the global one 110.5 on average.
    let read = per_layer * (8.0 + 8.0 + 110.5);
    assert_eq!(out["kv_bytes_read_per_token"].as_f64(), Some(read));
    assert_eq!(
        out["bytes_per_token"].as_f64(),
        Some(positive(&out, "weight_bytes") + read)
    );
}

#[test]
fn bench_without_decode_reports_null_decode_fields() {
    let out = bench_json(
        &tiny_gguf(),
        &[
            "--prompt-tokens",
            "5",
            "--gen-tokens",
            "0",
            "--repetitions",
            "1",
        ],
    );
    positive(&out, "prefill_tokens_per_s");
    assert!(out["decode_tokens_per_s"].is_null(), "{out}");
    assert!(out["decode_roofline_fraction"].is_null(), "{out}");
    assert!(rates(&out, "decode_runs").is_empty());
}

#[test]
fn bench_rejects_requests_it_cannot_run() {
    // The fixture's context is 256 tokens.
    let err = kvant_err(&[
        "bench",
        "--model",
        &tiny_gguf(),
        "--prompt-tokens",
        "250",
        "--gen-tokens",
        "7",
    ]);
    assert!(
        err.contains("exceeds the model's context length 256"),
        "{err}"
    );
    // Any depth that does not leave room for the test, even after one that does.
    let err = kvant_err(&[
        "bench",
        "--model",
        &tiny_gguf(),
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
        "--depth",
        "0,245",
    ]);
    assert!(
        err.contains("--depth 245 plus --prompt-tokens 8 plus --gen-tokens 4 exceeds the model's context length 256"),
        "{err}"
    );
    let err = kvant_err(&[
        "bench",
        "--model",
        &tiny_gguf(),
        "--depth",
        &usize::MAX.to_string(),
    ]);
    assert!(
        err.contains("exceeds the model's context length 256"),
        "{err}"
    );
    // A depth that is not a number is a usage error.
    for depth in ["1,x", "", "0,-5"] {
        let out = kvant(&["bench", "--model", &tiny_gguf(), "--depth", depth]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{depth:?}: {stderr}");
        assert!(stderr.contains("invalid value"), "{depth:?}: {stderr}");
    }
    // Zero prompt tokens, repetitions or threads are usage errors (exit 2).
    for args in [
        ["--prompt-tokens", "0"],
        ["--repetitions", "0"],
        ["--threads", "0"],
    ] {
        let out = kvant(&[&["bench", "--model", &tiny_gguf()], &args[..]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("must be at least 1"), "{args:?}: {stderr}");
    }
}

/// With ranks, the report names the layout and counts rank 0's
/// collectives per run: tensor parallelism's all-reduces (two per layer
/// and one for the embedding, per micro-batch) and the logits' way back.
#[test]
fn bench_reports_the_layout_and_its_collectives() {
    let model = tiny_gguf();
    let out = bench_json(
        &model,
        &[
            "--prompt-tokens",
            "8",
            "--gen-tokens",
            "4",
            "--repetitions",
            "2",
            "--tp",
            "2",
            "--net-latency",
            "50us",
            "--net-bandwidth",
            "10",
        ],
    );
    let p = &out["parallel"];
    assert_eq!((p["ranks"].as_u64(), p["tp"].as_u64()), (Some(2), Some(2)));
    assert_eq!(p["net_latency_s"].as_f64(), Some(50e-6));
    let layers = 2; // the fixture's
    let prefill = &p["prefill"]["collectives"];
    assert_eq!(
        prefill["all_reduce"]["count"].as_f64(),
        Some((2 * layers + 1) as f64)
    );
    assert_eq!(p["decode"]["steps"].as_u64(), Some(4));
    let decode = &p["decode"]["collectives"]["all_reduce"];
    assert_eq!(
        decode["count"].as_f64(),
        Some((4 * (2 * layers + 1)) as f64)
    );
    // 50 µs per all-reduce on 2 ranks (2(p-1)·α), at least.
    assert!(decode["modelled_secs"].as_f64().unwrap() >= 4.0 * 5.0 * 100e-6);
    assert!(p["decode"]["exposed_comm_secs"].as_f64().unwrap() > 0.0);
    // An idle layout has no rows to bench through.
    let plain = bench_json(
        &model,
        &[
            "--prompt-tokens",
            "8",
            "--gen-tokens",
            "2",
            "--repetitions",
            "1",
        ],
    );
    assert!(plain["parallel"].is_null());
}
