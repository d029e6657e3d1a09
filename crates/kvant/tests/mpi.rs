//! `kvant` as MPI processes under `mpirun` (Open MPI, `--features mpi`):
//! layouts against one process, bad layouts, and ranks that hang or die.
//! As root, mpirun needs the allow-run-as-root variables; containers
//! without ptrace need the single-copy mechanism off: both are set here.

mod common;
use common::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn mpirun_cmd(np: usize, args: &[&str], tag: &str) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-np", &np.to_string()])
        .arg(env!("CARGO_BIN_EXE_kvant"))
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        // One thread per rank: two ranks on two cores.
        .env("KVANT_THREADS", "1")
        // Marks this job's processes, to find a rank's pid.
        .env("KVANT_TEST_TAG", tag)
        .env_remove("KVANT_MODEL");
    c
}

/// Runs `kvant args` on `np` ranks; kills the job after 300 s.
fn mpirun(np: usize, args: &[&str]) -> Output {
    let child = mpirun_cmd(np, args, "run")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun (install openmpi-bin)");
    wait_bounded(child, Duration::from_secs(300))
}

fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let t = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            panic!("mpirun still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

fn mpirun_ok(np: usize, args: &[&str]) -> String {
    let out = mpirun(np, args);
    assert!(
        out.status.success(),
        "mpirun -np {np} kvant {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn tiny(name: &str) -> String {
    fixture(&format!("models/{name}"))
        .to_str()
        .expect("path")
        .to_string()
}

/// Greedy tokens under `--tp 2` (two processes) equal one process's, in
/// f32 numerics (f32 activations and cache: the reordered sums of the
/// row-parallel products stay within rounding, see the engine's parallel
/// tests), on every fixture architecture and the real default model.
#[test]
fn tensor_parallel_generate_matches_one_process() {
    let prompt = "Hello, my name is";
    for name in [
        "llama-gqa",
        "llama-mqa-tied",
        "mistral-swa",
        "qwen2-bias",
        "qwen3-qknorm",
        "gemma3-text",
        "mixtral-moe",
        "qwen2-moe",
        "deepseek-v2",
        "deepseek-v3",
    ] {
        let m = tiny(name);
        let args = greedy_args(&m, prompt, 16, &[EXACT, &["--tp", "2"]].concat());
        let (one, two) = (strs(&args[..args.len() - 2]), strs(&args));
        let (one, two) = (json(&kvant_ok(&one)), json(&mpirun_ok(2, &two)));
        assert_eq!(ids(&two["token_ids"]), ids(&one["token_ids"]), "{name}");
    }
    let Some(model) = real_model() else { return };
    for prompt in ["The capital of France is a city that", "def fibonacci(n):"] {
        let args = greedy_args(&model, prompt, 32, &[EXACT, &["--tp", "2"]].concat());
        let (one, two) = (strs(&args[..args.len() - 2]), strs(&args));
        let (one, two) = (json(&kvant_ok(&one)), json(&mpirun_ok(2, &two)));
        assert_eq!(
            ids(&two["token_ids"]),
            ids(&one["token_ids"]),
            "SmolLM2 --tp 2: {prompt}"
        );
    }
}

fn ppl(model: &str, extra: &[&str], np: usize) -> f64 {
    let args = perplexity_args(model, 64, extra);
    let out = match np {
        1 => kvant_ok(&strs(&args)),
        _ => mpirun_ok(np, &strs(&args)),
    };
    json(&out)["ppl"].as_f64().expect("ppl")
}

/// Expert parallelism, alone, with data parallelism (the second group has
/// no requests) and with two-batch overlap: every logit is the bits of one
/// process, so the perplexity over a text is the same number (DeepSeek-V4
/// and Qwen3-Next too, whose states run on every rank).
#[test]
fn expert_parallel_perplexity_is_bit_identical() {
    for (name, numerics) in [
        ("deepseek-v3", EXACT),
        ("qwen2-moe", EXACT),
        ("gguf/deepseek-v3.Q8_0.gguf", &[][..]),
        ("gguf/mixtral-moe.Q8_0.gguf", &[][..]),
        // A state per sequence on every rank of its group.
        ("deepseek-v4", EXACT),
        ("qwen3-next", EXACT),
    ] {
        let m = tiny(name);
        let absorbed = [numerics, &["--mla-prefill", "absorbed"]].concat();
        let want = ppl(&m, &absorbed, 1);
        for layout in [
            &["--ep", "2"][..],
            &["--ep", "2", "--dp", "2"],
            &["--ep", "2", "--two-batch-overlap"],
        ] {
            let got = ppl(&m, &[absorbed.as_slice(), layout].concat(), 2);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{name} {layout:?}: {got} vs {want}"
            );
        }
    }
}

/// The real default model with its default numerics (8-bit activations)
/// under `--tp 2`. Tensor parallelism reorders float sums, and with 8-bit
/// activations a reordered sum can land an activation on the other side
/// of a rounding step: the result is another draw of the same rounding
/// noise, so the perplexity must move less than the 8-bit activations
/// themselves move it against f32 (measured at --ctx 64: 4.8e-4 against
/// 1.6e-3 relative). In f32 numerics, tensor parallelism is within
/// rounding.
#[test]
fn tensor_parallel_perplexity_of_the_real_model() {
    let Some(model) = real_model() else { return };
    let one = ppl(&model, &[], 1);
    let two = ppl(&model, &["--tp", "2"], 2);
    let exact = ppl(&model, EXACT, 1);
    let exact_two = ppl(&model, &[EXACT, &["--tp", "2"]].concat(), 2);
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    assert!(
        rel(two, one) < rel(one, exact),
        "--tp 2 moved the perplexity {} ({two} vs {one}), more than 8-bit activations do ({})",
        rel(two, one),
        rel(one, exact)
    );
    assert!(rel(exact_two, exact) < 1e-5, "{exact_two} vs {exact}");
}

/// Flags that cannot be laid out fail at start-up on every rank, with
/// the same message and status 1 (the engine's tests check each rank's
/// error with ranks as threads).
#[test]
fn layouts_that_do_not_fit_fail_on_every_rank() {
    let m = tiny("llama-gqa");
    for (flags, msg) in [
        (&["--tp", "3"][..], "does not divide the 2 ranks"),
        (&["--ep", "3"], "larger than the 2 ranks"),
        (&["--ep", "2"], "needs a mixture-of-experts model"),
        (&["--tp", "2", "--dp", "2"], "does not divide the 2 ranks"),
        (&[], "needs a layout"),
    ] {
        let args = greedy_args(&m, "hi", 2, flags);
        let out = mpirun(2, &strs(&args));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} succeeded");
        // Every rank stops with the message; mpirun ends the job at the
        // first, so the others' may not reach stderr.
        assert!(err.contains(msg), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let args = greedy_args(
        &tiny("mixtral-moe"),
        "hi",
        2,
        &["--ep", "2", "--tp", "2", "--dp", "1"],
    );
    let out = mpirun(2, &strs(&args));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let args = greedy_args(&tiny("qwen3-qknorm"), "hi", 2, &["--tp", "2"]);
    let out = mpirun(1, &strs(&args));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not divide the 1 ranks"), "{err}");
}

/// The pid of `rank` of the job tagged `tag`.
fn rank_pid(tag: &str, rank: usize) -> Option<u32> {
    let want = [
        format!("KVANT_TEST_TAG={tag}"),
        format!("OMPI_COMM_WORLD_RANK={rank}"),
    ];
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let env = std::fs::read(e.path().join("environ")).ok()?;
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let has = |v: &String| vars.contains(&v.as_bytes());
        want.iter().all(has).then_some(pid)
    })
}

/// Starts a 2-rank server and waits for its ready line.
fn serve(tag: &str, extra: &[&str]) -> Child {
    let m = tiny("deepseek-v3");
    let mut args = vec!["serve", "--model", &m, "--port", "0", "--ep", "2"];
    args.extend_from_slice(extra);
    let mut child = mpirun_cmd(2, &args, tag)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("ready line");
    assert!(line.contains("kvant serve:"), "{line}");
    child
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// A rank that hangs (stopped) is noticed by rank 0's next collective (an
/// idle server's heartbeat) within the timeout: every process ends, with
/// an error that says what happened.
#[test]
fn a_hung_rank_ends_the_job_with_a_clear_error() {
    let tag = "hung";
    let child = serve(tag, &["--dist-timeout", "3"]);
    let rank1 = rank_pid(tag, 1).expect("rank 1 runs");
    let t = Instant::now();
    signal(rank1, "-STOP");
    let out = wait_bounded(child, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    assert!(err.contains("no answer from every rank within 3s"), "{err}");
}

/// A rank that dies ends the job at once (mpirun notices).
#[test]
fn a_dead_rank_ends_the_job() {
    let tag = "dead";
    let child = serve(tag, &[]);
    let rank1 = rank_pid(tag, 1).expect("rank 1 runs");
    let t = Instant::now();
    signal(rank1, "-KILL");
    let out = wait_bounded(child, Duration::from_secs(60));
    assert!(!out.status.success());
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

/// SIGTERM to rank 0 shuts a multi-rank server down gracefully: rank 0
/// stops accepting, finishes, and tells the other ranks to stop; the job
/// exits 0.
#[test]
fn sigterm_to_rank_0_stops_every_rank_cleanly() {
    let tag = "term";
    let child = serve(tag, &["--shutdown-grace", "1"]);
    signal(rank_pid(tag, 0).expect("rank 0 runs"), "-TERM");
    let out = wait_bounded(child, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
