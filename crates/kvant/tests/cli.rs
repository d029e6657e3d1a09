//! The CLI on the tiny fixture checkpoints: outputs, JSON shape, and clear
//! errors (exit 1, `kvant: error: …`, never a panic) on bad input.

mod common;
use common::*;

fn tiny(name: &str) -> String {
    fixture(&format!("models/{name}"))
        .to_str()
        .unwrap()
        .to_string()
}

fn reference(name: &str) -> serde_json::Value {
    json(&std::fs::read_to_string(fixture(&format!("models/{name}/reference.json"))).unwrap())
}

#[test]
fn generate_json_matches_reference_greedy() {
    for name in ["llama-gqa", "qwen2-bias", "mistral-swa"] {
        let r = reference(name);
        let n = r["greedy_ids"].as_array().unwrap().len();
        let text = r["prompt_text"].as_str().unwrap();
        let out = json(&kvant_ok(&strs(&greedy_args(&tiny(name), text, n, &[]))));
        assert_eq!(
            ids(&out["prompt_token_ids"]),
            ids(&r["prompt_ids"]),
            "{name}"
        );
        assert_eq!(ids(&out["token_ids"]), ids(&r["greedy_ids"]), "{name}");
        assert_eq!(
            out["prompt_tokens"],
            r["prompt_ids"].as_array().unwrap().len()
        );
        assert_eq!(out["completion_tokens"].as_u64(), Some(n as u64));
        assert_eq!(out["finish_reason"], "length");
        assert!(out["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(out["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(out["text"].is_string());
    }
}

#[test]
fn seeded_sampling_is_reproducible() {
    let run = |seed: &str| {
        kvant_ok(&[
            "generate",
            "--model",
            &tiny("llama-gqa"),
            "--prompt",
            "hello",
            "--temperature",
            "1.0",
            "--seed",
            seed,
            "--max-tokens",
            "24",
            "--ignore-eos",
            "--json",
        ])
    };
    let a = json(&run("7"));
    assert_eq!(a["token_ids"], json(&run("7"))["token_ids"]);
    assert_ne!(a["token_ids"], json(&run("8"))["token_ids"]);
}

#[test]
fn info_describes_checkpoints() {
    let out = json(&kvant_ok(&[
        "info",
        "--model",
        &tiny("qwen3-qknorm"),
        "--json",
    ]));
    assert_eq!(out["architecture"], "qwen3");
    assert_eq!(out["format"], "safetensors");
    assert_eq!(out["vocab_size"], 320);
    let gguf = fixture("models/gguf/llama-gqa.Q4_0.gguf");
    let out = json(&kvant_ok(&[
        "info",
        "--model",
        gguf.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(out["format"], "gguf");
    assert!(out["tensor_dtypes"]["Q4_0"].as_u64().unwrap() > 0);
    assert!(out["parameters"].as_u64().unwrap() > 10_000);
    let text = kvant_ok(&["info", "--model", gguf.to_str().unwrap()]);
    assert!(text.contains("llama"), "{text}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let e = kvant_err(&["info", "--model", missing.to_str().unwrap()]);
    assert!(e.contains("no model at"), "{e}");

    // Truncated and garbage GGUF files.
    let good = std::fs::read(fixture("models/gguf/llama-gqa.Q8_0.gguf")).unwrap();
    for len in [0, 3, 20, 200, good.len() / 2, good.len() - 1] {
        let p = dir.path().join(format!("trunc{len}.gguf"));
        std::fs::write(&p, &good[..len]).unwrap();
        let e = kvant_err(&["info", "--model", p.to_str().unwrap()]);
        assert!(e.contains("kvant: error:"), "{e}");
    }
    let p = dir.path().join("garbage.gguf");
    std::fs::write(&p, vec![0xABu8; 4096]).unwrap();
    kvant_err(&["generate", "--model", p.to_str().unwrap(), "--prompt", "x"]);

    // Invalid UTF-8 in a prompt file names the file.
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, b"ok \xff\xfe").unwrap();
    let e = kvant_err(&[
        "generate",
        "--model",
        &tiny("llama-gqa"),
        "--prompt-file",
        bad.to_str().unwrap(),
    ]);
    assert!(
        e.contains("not valid UTF-8") && e.contains("offset 3"),
        "{e}"
    );

    // A prompt longer than the context (256 positions).
    let long = "word ".repeat(400);
    let e = kvant_err(&[
        "generate",
        "--model",
        &tiny("llama-gqa"),
        "--prompt",
        &long,
        "--max-tokens",
        "4",
    ]);
    assert!(e.contains("context"), "{e}");

    // Out-of-range sampling parameters.
    let e = kvant_err(&[
        "generate",
        "--model",
        &tiny("llama-gqa"),
        "--prompt",
        "a",
        "--top-p",
        "0",
    ]);
    assert!(e.contains("top_p"), "{e}");

    // Out-of-vocabulary ids.
    let e = kvant_err(&["detokenize", "--model", &tiny("llama-gqa"), "99999"]);
    assert!(e.contains("99999"), "{e}");
}

/// A block cache type (`q8_0`, `q4_0`) on a model whose KV rows are not
/// whole 32-value blocks (the fixtures' heads of 16, deepseek-v3's
/// latent rows of 48) stops at load with an error naming the type and
/// the row size; the element types run on any model.
#[test]
fn kv_cache_types_that_cannot_hold_the_rows_are_clear_errors() {
    for (name, dtype, what) in [
        ("llama-gqa", "q8_0", "key and value rows have 16 values"),
        ("deepseek-v3", "q4_0", "latent rows have 48 values"),
    ] {
        let model = tiny(name);
        for cmd in ["generate", "bench"] {
            let mut args = vec![cmd, "--model", &model, "--kv-cache-type", dtype];
            args.extend(match cmd {
                "generate" => ["--prompt", "hi", "--max-tokens", "2"],
                _ => ["--prompt-tokens", "4", "--gen-tokens", "2"],
            });
            let e = kvant_err(&args);
            assert!(
                e.contains(&format!("a {dtype} KV cache")) && e.contains(what),
                "{e}"
            );
        }
    }
    for dtype in ["bf16", "f32", "f16"] {
        kvant_ok(&[
            "generate",
            "--model",
            &tiny("deepseek-v3"),
            "--kv-cache-type",
            dtype,
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
        ]);
    }
}

/// `tokenize --file` gives what `tokenize TEXT` gives for the file's text
/// (here the reference prompt, whose ids are recorded), and TEXT and
/// --file are one or the other.
#[test]
fn tokenize_reads_a_file() {
    let r = reference("llama-gqa");
    let text = r["prompt_text"].as_str().expect("prompt_text");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prompt.txt");
    std::fs::write(&path, text).unwrap();
    let path = path.to_str().unwrap();
    let model = tiny("llama-gqa");
    let from_file = json(&kvant_ok(&["tokenize", "--model", &model, "--file", path]));
    assert_eq!(from_file, r["prompt_ids"]);
    assert_eq!(
        from_file,
        json(&kvant_ok(&["tokenize", "--model", &model, text]))
    );
    let both = kvant(&["tokenize", "--model", &model, "--file", path, "x"]);
    assert_eq!(both.status.code(), Some(2));
    let neither = kvant(&["tokenize", "--model", &model]);
    assert_eq!(neither.status.code(), Some(2));
    let e = kvant_err(&[
        "tokenize",
        "--model",
        &model,
        "--file",
        "/nonexistent/x.txt",
    ]);
    assert!(e.contains("/nonexistent/x.txt"), "{e}");
}

#[test]
fn chat_needs_a_template() {
    // A copy of a tiny checkpoint whose tokenizer_config.json lacks the template.
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("models/llama-gqa");
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.path().join("tokenizer_config.json");
    let mut cfg = json(&std::fs::read_to_string(&cfg_path).unwrap());
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let model = dir.path().to_str().unwrap();
    let e = kvant_err(&["generate", "--model", model, "--chat", "--prompt", "hi"]);
    assert!(e.contains("no chat template"), "{e}");
    // Without --chat the same checkpoint generates.
    kvant_ok(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--max-tokens",
        "3",
    ]);
}

#[test]
fn chat_runs_several_turns_from_stdin() {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvant"))
        .args([
            "chat",
            "--model",
            &tiny("qwen2-bias"),
            "--temperature",
            "0",
            "--max-tokens",
            "6",
        ])
        .args(["--system", "Be brief."])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"hello there\nand again\n/reset\nthird\n/exit\n")
        .unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // One line of reply per user turn.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches('\n').count(), 3, "{stdout:?}");
    assert_eq!(stderr.matches("> ").count(), 5, "{stderr}");
}

#[test]
fn stop_strings_cut_the_text_and_finish_with_stop() {
    let r = reference("llama-mqa-tied");
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            &tiny("llama-mqa-tied"),
            "--prompt",
            r["prompt_text"].as_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--json",
        ]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        json(&kvant_ok(&args))
    };
    let full = gen(&[]);
    let text = full["text"].as_str().unwrap().to_string();
    // Stop on a short piece from the middle of the greedy text.
    let chars: Vec<char> = text.chars().collect();
    let mid = chars.len() / 2;
    let stop: String = chars[mid..(mid + 2).min(chars.len())].iter().collect();
    let first = text.find(&stop).unwrap();
    let cut = gen(&["--stop", &stop]);
    assert_eq!(cut["finish_reason"], "stop", "{cut}");
    assert_eq!(cut["text"].as_str().unwrap(), &text[..first]);
}

/// Without mpirun, `--tp`, `--dp` and `--ep` run ranks as threads of one
/// process, over the same communicator interface MPI ranks use: greedy
/// tokens as one process gives them (f32 numerics for tensor
/// parallelism; expert and data parallelism are bit-identical anyway).
#[test]
fn ranks_as_threads_generate_what_one_process_does() {
    for (name, flags) in [
        ("llama-gqa", &["--tp", "2"][..]),
        ("gemma3-text", &["--tp", "2", "--two-batch-overlap"]),
        ("deepseek-v3", &["--ep", "2", "--dp", "2"]),
        ("qwen2-moe", &["--ep", "2"]),
    ] {
        let m = tiny(name);
        let exact = [EXACT, &["--mla-prefill", "absorbed"]].concat();
        let base = greedy_args(&m, "Once upon a time", 12, &exact);
        let one = json(&kvant_ok(&strs(&base)));
        let many = json(&kvant_ok(&[&strs(&base)[..], flags].concat()));
        assert_eq!(
            ids(&many["token_ids"]),
            ids(&one["token_ids"]),
            "{name} {flags:?}"
        );
    }
}

#[test]
fn layouts_that_do_not_fit_are_clear_errors() {
    let m = tiny("llama-gqa");
    for (flags, msg) in [
        (&["--ep", "2"][..], "needs a mixture-of-experts model"),
        (&["--tp", "8"], "larger than the model's 4 attention heads"),
        (&["--tp", "2", "--ep", "3"], "does not divide the 3 ranks"),
        (&["--net-latency", "20us"], "--net-bandwidth"),
        (&["--tp", "0"], "at least 1"),
    ] {
        let args = [&["generate", "--model", &m, "--prompt", "hi"][..], flags].concat();
        let out = kvant(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(err.contains(msg), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // Expert re-placement without experts spread over ranks.
    let err = kvant_err(&[
        "serve",
        "--model",
        &m,
        "--port",
        "0",
        "--eplb-interval",
        "4",
    ]);
    assert!(
        err.contains("needs experts spread over ranks (--ep)"),
        "{err}"
    );
}

/// A kvant built without MPI that mpirun starts as one of several ranks
/// says so instead of running the whole model once per rank.
#[cfg(not(feature = "mpi"))]
#[test]
fn a_build_without_mpi_refuses_to_be_one_of_several_ranks() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvant"))
        .args(["generate", "--model", &tiny("llama-gqa"), "--prompt", "hi"])
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .output()
        .expect("kvant");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("built without MPI") && err.contains("--features mpi"),
        "{err}"
    );
}

/// DeepSeek-V4's module from llama.cpp's separate `--mtp` GGUF: the same
/// tokens as without it, drafts made; a file that is not that model's
/// module is an error naming it.
#[test]
fn mtp_model_from_its_own_gguf() {
    let main = tiny("gguf/deepseek-v4.F32.gguf");
    let drafter = tiny("gguf/mtp-deepseek-v4.F32.gguf");
    let text = "the quick brown fox";
    let plain = json(&kvant_ok(&strs(&greedy_args(&main, text, 24, &[]))));
    let extra = ["--mtp-model", drafter.as_str(), "--mtp-always"];
    let drafted = json(&kvant_ok(&strs(&greedy_args(&main, text, 24, &extra))));
    assert_eq!(plain["token_ids"], drafted["token_ids"]);
    assert!(drafted["mtp_drafted"].as_u64().unwrap() > 0, "{drafted}");
    for wrong in [main.as_str(), &tiny("gguf/deepseek-v32.Q8_0.gguf")] {
        let err = kvant_err(&strs(&greedy_args(&main, text, 4, &["--mtp-model", wrong])));
        assert!(err.contains("the MTP file does not fit the model"), "{err}");
    }
    // --mtp-always without a module to draft with is a usage error.
    let out = kvant(&strs(&greedy_args(&main, text, 4, &["--mtp-always"])));
    assert_eq!(out.status.code(), Some(2));
}

/// `--mtp` on a checkpoint without a module says so (and where DeepSeek-V4
/// GGUFs keep theirs) instead of decoding without drafts.
#[test]
fn mtp_without_a_module_is_an_error() {
    let main = tiny("gguf/deepseek-v4.F32.gguf");
    let err = kvant_err(&strs(&greedy_args(&main, "hi", 4, &["--mtp"])));
    assert!(err.contains("--mtp-model"), "{err}");
}
