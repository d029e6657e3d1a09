//! `kvant bench`: end-to-end prefill and decode speed of one model, and
//! decode speed as a fraction of its memory-bandwidth roofline.
//!
//! The prompt is `--prompt-tokens` token ids drawn uniformly over the
//! vocabulary from a fixed-seed ChaCha RNG, as llama-bench uses random
//! tokens: the speed of a forward pass does not depend on which ids it
//! sees, and no text file has to be found from the working directory.
//!
//! Each repetition starts from an empty cache: one forward pass over the
//! whole prompt (prefill), then `--gen-tokens` one-token passes, each fed the
//! argmax of the previous logits (decode; no sampler). One untimed warm-up
//! repetition runs first; medians, minima and maxima are over the rest.
//!
//! Decoding streams every weight once per token plus the cache so far, so
//! `roofline = bandwidth / (weight bytes + KV bytes at the mean decode
//! position)`, with the bandwidth measured by
//! [`kvant_kernels::bandwidth::measure_read_bandwidth`] on the same thread
//! count before the model loads.

use crate::args::BenchArgs;
use crate::ranks::{self, Run};
use anyhow::{bail, Context, Result};
use kvant_dist::KindStats;
use kvant_engine::cluster::{Row, Want};
use kvant_kernels::bandwidth::measure_read_bandwidth;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::time::Instant;

/// 256 MiB, eight times a 32 MiB last-level cache, so the probe reads DRAM.
const PROBE_BYTES: usize = 256 << 20;
/// Probe passes; the best is kept.
const PROBE_REPEATS: usize = 5;
/// Seed of the prompt ids, fixed so every run times the same prompt.
const PROMPT_SEED: u64 = 0x6b76_616e_7462;

pub fn run(a: BenchArgs, threads: usize) -> Result<()> {
    // Probe before the model loads (on every rank of a parallel run, each
    // with its own threads): its buffer is freed before any timed run, and
    // resetting the high-water mark keeps it out of the peak RSS.
    let bandwidth = measure_read_bandwidth(PROBE_BYTES, threads, PROBE_REPEATS);
    let rss_reset = reset_peak_rss();
    let Some(run) = ranks::start(&a.model, &a.parallel, a.model.load_options())? else {
        return Ok(());
    };
    let result = bench(&a, &run, threads, bandwidth, rss_reset);
    run.finish(result)
}

fn bench(
    a: &BenchArgs,
    run: &Run,
    threads: usize,
    bandwidth: f64,
    rss_reset: Result<(), String>,
) -> Result<()> {
    let model_bytes = checkpoint_bytes(&run.path)?;
    let model = &run.model;
    let max_context = model.config().max_context;
    let fits = a
        .prompt_tokens
        .checked_add(a.gen_tokens)
        .is_some_and(|n| n <= max_context);
    if !fits {
        bail!(
            "--prompt-tokens {} plus --gen-tokens {} exceeds the model's context length {max_context}",
            a.prompt_tokens,
            a.gen_tokens
        );
    }
    let prompt = random_prompt(model.config().vocab, a.prompt_tokens)?;

    let warm_up = run_once(run, &prompt, a.gen_tokens)?;
    let mut prefill_runs = Vec::new();
    let mut decode_runs = Vec::new();
    let mut comm = [PhaseComm::default(), PhaseComm::default()];
    for _ in 0..a.repetitions {
        let t = run_once(run, &prompt, a.gen_tokens)?;
        prefill_runs.push(per_s(a.prompt_tokens, t.prefill_secs));
        if a.gen_tokens > 0 {
            decode_runs.push(per_s(a.gen_tokens, t.decode_secs));
        }
        for (total, phase) in comm.iter_mut().zip(t.comm) {
            total.add(&phase);
        }
    }
    let weight_bytes = model.weight_bytes();
    let mean_position = a.prompt_tokens as f64 + a.gen_tokens as f64 / 2.0;
    let bytes_per_token =
        weight_bytes as f64 + warm_up.kv_bytes_per_position as f64 * mean_position;
    let report = Report {
        path: &run.path,
        model_bytes,
        weight_bytes,
        threads,
        prefill: Summary::of(&prefill_runs),
        decode: Summary::of(&decode_runs),
        prefill_runs,
        decode_runs,
        peak_rss: rss_reset.and_then(|()| peak_rss_bytes()),
        bandwidth,
        kv_bytes_per_position: warm_up.kv_bytes_per_position,
        bytes_per_token,
        roofline: bandwidth / bytes_per_token,
        parallel: run.cluster.as_ref().map(|_| Parallel {
            args: a.parallel.clone(),
            world: run.model.parallel().map_or(1, |p| p.layout.world),
            comm,
        }),
    };
    if a.json {
        println!("{}", report.json(a));
    } else {
        report.print_table(a);
    }
    Ok(())
}

/// Seconds one repetition spent in each phase.
struct Timing {
    prefill_secs: f64,
    decode_secs: f64,
    /// Bytes one cached position takes over all layers, keys and values, in
    /// whatever element type the cache stores.
    kv_bytes_per_position: usize,
    /// Rank 0's collectives during prefill and decode.
    comm: [PhaseComm; 2],
}

/// Rank 0's collectives over a phase: per kind, and the time its forward
/// passes waited with nothing to compute.
#[derive(Clone, Default)]
struct PhaseComm {
    kinds: Vec<KindStats>,
    exposed_secs: f64,
}

impl PhaseComm {
    fn add(&mut self, other: &PhaseComm) {
        if self.kinds.is_empty() {
            self.kinds = other.kinds.clone();
        } else {
            for (a, b) in self.kinds.iter_mut().zip(&other.kinds) {
                a.count += b.count;
                a.bytes_sent += b.bytes_sent;
                a.bytes_received += b.bytes_received;
                a.inflight_secs += b.inflight_secs;
                a.blocked_secs += b.blocked_secs;
                a.modelled_secs += b.modelled_secs;
            }
        }
        self.exposed_secs += other.exposed_secs;
    }
}

/// What rank 0's collectives did since the last call (then zeroed).
fn take_comm(run: &Run) -> PhaseComm {
    let (Some(stats), Some(par)) = (&run.stats, run.model.parallel()) else {
        return PhaseComm::default();
    };
    let out = PhaseComm {
        kinds: stats.snapshot(),
        exposed_secs: par.take_exposed().as_secs_f64(),
    };
    stats.reset();
    out
}

fn run_once(run: &Run, prompt: &[u32], gen: usize) -> Result<Timing> {
    let mut cache = run.cache(prompt.len() + gen)?;
    let argmax = |rows: Vec<Row>| match rows.into_iter().next() {
        Some(Row::Argmax(Some(t))) => Ok(t),
        _ => bail!("the model returned no finite logits"),
    };
    take_comm(run);
    let t0 = Instant::now();
    let mut next = argmax(run.forward(&mut cache, prompt, Want::LastArgmax)?)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let prefill_comm = take_comm(run);
    let t1 = Instant::now();
    for _ in 0..gen {
        next = argmax(run.forward(&mut cache, &[next], Want::LastArgmax)?)?;
    }
    Ok(Timing {
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
        kv_bytes_per_position: cache.bytes().checked_div(cache.capacity()).unwrap_or(0),
        comm: [prefill_comm, take_comm(run)],
    })
}

fn random_prompt(vocab: usize, n: usize) -> Result<Vec<u32>> {
    let vocab = u32::try_from(vocab)
        .ok()
        .filter(|&v| v > 0)
        .with_context(|| format!("vocabulary size {vocab} is not a usable token-id range"))?;
    let mut rng = ChaCha8Rng::seed_from_u64(PROMPT_SEED);
    Ok((0..n).map(|_| rng.random_range(0..vocab)).collect())
}

fn per_s(tokens: usize, secs: f64) -> f64 {
    // A forward pass always takes time; the floor only rules out a division by zero.
    tokens as f64 / secs.max(1e-9)
}

/// Median, minimum and maximum of per-repetition rates.
#[derive(Clone, Copy)]
struct Summary {
    median: f64,
    min: f64,
    max: f64,
}

impl Summary {
    /// `None` for no runs (the decode test with `--gen-tokens 0`).
    fn of(runs: &[f64]) -> Option<Summary> {
        let mut v = runs.to_vec();
        v.sort_by(f64::total_cmp);
        let (&min, &max) = (v.first()?, v.last()?);
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 {
            v[mid]
        } else {
            (v[mid - 1] + v[mid]) / 2.0
        };
        Some(Summary { median, min, max })
    }
}

/// The `.gguf`'s size, or for a Hugging Face directory its safetensors files'.
fn checkpoint_bytes(path: &Path) -> Result<u64> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_dir() {
        return Ok(meta.len());
    }
    let mut total = 0u64;
    for entry in std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))? {
        let p = entry?.path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            total += std::fs::metadata(&p)?.len();
        }
    }
    Ok(total)
}

/// Restarts the kernel's peak-RSS count (`VmHWM`) from the current RSS
/// (Linux: `5` written to `/proc/self/clear_refs`).
fn reset_peak_rss() -> Result<(), String> {
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| {
        format!("cannot reset the peak RSS after the {PROBE_BYTES}-byte bandwidth probe ({e})")
    })
}

/// `VmHWM` from `/proc/self/status`, in bytes.
fn peak_rss_bytes() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("cannot read /proc/self/status ({e})"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| "no VmHWM line in /proc/self/status".to_string())
}

/// Everything measured, for either output.
struct Report<'a> {
    path: &'a Path,
    model_bytes: u64,
    weight_bytes: usize,
    threads: usize,
    prefill: Option<Summary>,
    decode: Option<Summary>,
    prefill_runs: Vec<f64>,
    decode_runs: Vec<f64>,
    peak_rss: Result<u64, String>,
    bandwidth: f64,
    kv_bytes_per_position: usize,
    bytes_per_token: f64,
    roofline: f64,
    /// The layout and rank 0's collectives, for a parallel run.
    parallel: Option<Parallel>,
}

struct Parallel {
    args: crate::args::ParallelArgs,
    world: usize,
    /// Prefill and decode, summed over the timed repetitions.
    comm: [PhaseComm; 2],
}

impl Parallel {
    fn json(&self, a: &BenchArgs) -> serde_json::Value {
        let p = &self.args;
        let reps = a.repetitions as f64;
        let phase = |c: &PhaseComm, steps: usize| {
            let kinds: serde_json::Map<String, serde_json::Value> = c
                .kinds
                .iter()
                .filter(|k| k.count > 0)
                .map(|k| {
                    (
                        k.kind.name().to_string(),
                        serde_json::json!({
                            "count": k.count as f64 / reps,
                            "bytes_sent": k.bytes_sent as f64 / reps,
                            "bytes_received": k.bytes_received as f64 / reps,
                            "inflight_secs": k.inflight_secs / reps,
                            "modelled_secs": k.modelled_secs / reps,
                        }),
                    )
                })
                .collect();
            let modelled: f64 = c.kinds.iter().map(|k| k.modelled_secs).sum();
            serde_json::json!({
                "steps": steps,
                "collectives": kinds,
                "modelled_comm_secs": modelled / reps,
                "exposed_comm_secs": c.exposed_secs / reps,
            })
        };
        serde_json::json!({
            "ranks": self.world,
            "tp": p.tp,
            "dp": p.dp,
            "ep": p.ep,
            "two_batch_overlap": p.two_batch_overlap,
            "net_latency_s": p.net_latency.map(|d| d.as_secs_f64()),
            "net_bandwidth_bytes_per_s": p.net_bandwidth.map(|g| g * 1e9),
            "prefill": phase(&self.comm[0], 1),
            "decode": phase(&self.comm[1], a.gen_tokens),
        })
    }

    fn print(&self, a: &BenchArgs) {
        let p = &self.args;
        let reps = a.repetitions as f64;
        println!(
            "ranks      {} (--tp {} --dp {} --ep {}{})",
            self.world,
            p.tp,
            p.dp,
            p.ep,
            if p.two_batch_overlap {
                " --two-batch-overlap"
            } else {
                ""
            }
        );
        for (name, c) in [("prefill", &self.comm[0]), ("decode", &self.comm[1])] {
            for k in c.kinds.iter().filter(|k| k.count > 0) {
                println!(
                    "{name:<10} {:<14} {:>8.0}×  {:>10.3} MB out  {:>9.3} ms in flight  (rank 0, per run)",
                    k.kind.name(),
                    k.count as f64 / reps,
                    k.bytes_sent as f64 / reps / 1e6,
                    k.inflight_secs / reps * 1e3,
                );
            }
            println!(
                "{name:<10} waiting on collectives with nothing to compute: {:.3} ms per run",
                c.exposed_secs / reps * 1e3
            );
        }
    }
}

impl Report<'_> {
    /// One object; the decode fields are `null` with `--gen-tokens 0`, and
    /// `peak_rss_bytes` is `null` (with `peak_rss_error` saying why) where
    /// the OS does not report it.
    fn json(&self, a: &BenchArgs) -> serde_json::Value {
        let (p, d) = (self.prefill, self.decode);
        let mut obj = serde_json::json!({
            "model": self.path.display().to_string(),
            "model_bytes": self.model_bytes,
            "weight_bytes": self.weight_bytes,
            "threads": self.threads,
            "prompt_tokens": a.prompt_tokens,
            "gen_tokens": a.gen_tokens,
            "repetitions": a.repetitions,
            "prefill_tokens_per_s": p.map(|s| s.median),
            "prefill_tokens_per_s_min": p.map(|s| s.min),
            "prefill_tokens_per_s_max": p.map(|s| s.max),
            "decode_tokens_per_s": d.map(|s| s.median),
            "decode_tokens_per_s_min": d.map(|s| s.min),
            "decode_tokens_per_s_max": d.map(|s| s.max),
            "prefill_runs": self.prefill_runs,
            "decode_runs": self.decode_runs,
            "peak_rss_bytes": self.peak_rss.as_ref().ok(),
            "bandwidth_bytes_per_s": self.bandwidth,
            "kv_bytes_per_position": self.kv_bytes_per_position,
            "bytes_per_token": self.bytes_per_token,
            "roofline_decode_tokens_per_s": self.roofline,
            "decode_roofline_fraction": d.map(|s| s.median / self.roofline),
            "simd_tier": kvant_kernels::cpu::tier().name(),
            "parallel": self.parallel.as_ref().map(|p| p.json(a)),
        });
        if let (Err(why), Some(map)) = (&self.peak_rss, obj.as_object_mut()) {
            map.insert("peak_rss_error".into(), why.as_str().into());
        }
        obj
    }

    fn print_table(&self, a: &BenchArgs) {
        let mb = |b: f64| b / 1e6;
        println!(
            "model      {} ({:.1} MB file, {:.1} MB weights)",
            self.path.display(),
            mb(self.model_bytes as f64),
            mb(self.weight_bytes as f64)
        );
        println!(
            "threads    {} (SIMD {}), {} repetitions after a warm-up",
            self.threads,
            kvant_kernels::cpu::tier(),
            a.repetitions
        );
        println!(
            "{:<10} {:>12} {:>12} {:>12}",
            "test", "median t/s", "min t/s", "max t/s"
        );
        let row = |name: String, s: Option<Summary>| match s {
            Some(s) => println!(
                "{name:<10} {:>12.1} {:>12.1} {:>12.1}",
                s.median, s.min, s.max
            ),
            None => println!("{name:<10} {:>12}", "skipped"),
        };
        row(format!("pp{}", a.prompt_tokens), self.prefill);
        row(format!("tg{}", a.gen_tokens), self.decode);
        match &self.peak_rss {
            Ok(b) => println!("peak RSS   {:.1} MB", mb(*b as f64)),
            Err(why) => println!("peak RSS   unavailable: {why}"),
        }
        println!(
            "roofline   {:.2} GB/s read ÷ {:.1} MB per token = {:.1} t/s decode",
            self.bandwidth / 1e9,
            mb(self.bytes_per_token),
            self.roofline
        );
        if let Some(d) = self.decode {
            println!(
                "decode     {:.1}% of the roofline",
                100.0 * d.median / self.roofline
            );
        }
        if let Some(p) = &self.parallel {
            p.print(a);
        }
    }
}
