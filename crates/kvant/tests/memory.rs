//! Peak memory of `kvant generate` on the default model: weights stay
//! mmap'd in their stored type, so the peak RSS must stay under 1.5× the
//! GGUF file size plus the KV cache.
//!
//! Each test first evicts the model file from the page cache, so the run
//! reads it from disk as on a machine that did not just write it: there
//! the page cache holds it in large folios (ext4 on Linux 6.x), a read
//! fault maps up to 2 MiB at once, and pages the loader released came
//! back mapped around every small tensor it read (SmolLM2 Q4_1: 170.5 MB
//! against 140.8 MB with the file cached in small pages, on one Zen 4 VM).

mod common;
use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Asks the kernel to drop `path`'s clean pages from the page cache
/// (`posix_fadvise(POSIX_FADV_DONTNEED)`, this file only: no root
/// needed), so the next reader faults them in from disk.
fn evict_from_page_cache(path: &str) {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).expect("open the model");
    // SAFETY: an advisory call on a descriptor that `file` keeps open for
    // its duration; it reads and writes no memory of ours.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise on {path}");
}

/// The child's high-water RSS (`VmHWM`), polled until it exits. VmHWM is
/// monotonic, and generation runs at steady memory after loading, so the
/// last reading is the peak.
fn peak_rss_of(mut cmd: Command) -> usize {
    let mut child = cmd.stdout(Stdio::null()).spawn().expect("spawn kvant");
    let status_path = format!("/proc/{}/status", child.id());
    let mut peak_kb = 0usize;
    loop {
        if let Ok(s) = std::fs::read_to_string(&status_path) {
            if let Some(kb) = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            {
                peak_kb = peak_kb.max(kb);
            }
        }
        if let Some(st) = child.try_wait().expect("wait") {
            assert!(st.success(), "kvant failed");
            return peak_kb * 1024;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn generate_peak_rss_is_bounded_by_the_file_size() {
    let Some(model) = real_model() else { return };
    evict_from_page_cache(&model);
    let max_tokens = 48;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvant"));
    cmd.args([
        "generate",
        "--model",
        &model,
        "--prompt",
        "Once upon a time",
        "--temperature",
        "0",
    ])
    .args(["--max-tokens", &max_tokens.to_string(), "--ignore-eos"]);
    let peak = peak_rss_of(cmd);
    // SmolLM2-135M: 30 layers × (K, V) × 192 values × 4 bytes per token; the
    // prompt is under 16 tokens.
    let kv_bytes = (16 + max_tokens) * 30 * 2 * 192 * 4;
    let file = std::fs::metadata(&model).unwrap().len() as usize;
    let limit = file * 3 / 2 + kv_bytes;
    eprintln!(
        "peak RSS {:.1} MB, limit {:.1} MB",
        peak as f64 / 1e6,
        limit as f64 / 1e6
    );
    assert!(peak > 0 && peak < limit, "peak RSS {peak} vs limit {limit}");
}

/// `kvant perplexity` at a long window scores it in chunks and never holds
/// a `[ctx, vocab]` logits matrix: at `--ctx 4096` on the default model
/// (vocabulary 49,152) that matrix alone would be 805 MB, against a limit
/// of 1.5× the GGUF, the f16 KV cache for the window and 256 MB for one
/// chunk's logits and the activations.
#[test]
fn perplexity_peak_rss_does_not_grow_with_window_times_vocab() {
    let Some(model) = real_model() else { return };
    evict_from_page_cache(&model);
    let ctx = 4096;
    // About 4,600 tokens: one full window and a short one.
    let text = std::fs::read_to_string(fixture("text/jargon-4.4.7.txt")).expect("text fixture");
    let cut = text
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i >= 20_000)
        .expect("a long text");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("long.txt");
    std::fs::write(&file, &text[..cut]).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvant"));
    cmd.args(["perplexity", "--model", &model, "--file"])
        .arg(&file)
        .args(["--ctx", &ctx.to_string(), "--json"]);
    let peak = peak_rss_of(cmd);
    // SmolLM2-135M: 30 layers × (K, V) × 192 values × 2 bytes (f16) per token.
    let kv_bytes = ctx * 30 * 2 * 192 * 2;
    let gguf = std::fs::metadata(&model).unwrap().len() as usize;
    let limit = gguf * 3 / 2 + kv_bytes + (256 << 20);
    eprintln!(
        "peak RSS {:.1} MB, limit {:.1} MB ([ctx, vocab] logits alone: {:.1} MB)",
        peak as f64 / 1e6,
        limit as f64 / 1e6,
        (ctx * 49_152 * 4) as f64 / 1e6
    );
    assert!(peak > 0 && peak < limit, "peak RSS {peak} vs limit {limit}");
}
