//! `kvant bench`: end-to-end prefill and decode speed of one model, and
//! decode speed as a fraction of its memory-bandwidth roofline.
//!
//! The prompt is `--prompt-tokens` token ids drawn uniformly over the
//! vocabulary from a fixed-seed ChaCha RNG, as llama-bench uses random
//! tokens: the speed of a forward pass does not depend on which ids it
//! sees, and no text file has to be found from the working directory.
//!
//! Each test runs at a depth `D` (`--depth`, a comma list, default 0), as
//! llama-bench's `-d`: the cache first holds `D` other random ids, run
//! through the model untimed in chunks of [`FILL_CHUNK`] once per depth.
//! A repetition rewinds the cache to those `D` tokens, then times one
//! forward pass over the whole prompt (prefill) and `--gen-tokens`
//! one-token passes, each fed the argmax of the previous logits (decode; no
//! sampler). One untimed warm-up repetition runs first at each depth;
//! medians, minima and maxima are over the rest.
//!
//! Decoding streams every weight once per token plus the KV cache its
//! attention reads (every earlier position of every layer, or the window's
//! positions in a sliding-window layer), so `roofline = bandwidth / (weight
//! bytes + KV bytes read, averaged over the decode steps)`, with the
//! bandwidth measured by [`kvant_kernels::bandwidth::measure_read_bandwidth`]
//! on the same thread count before the model loads.

use crate::args::BenchArgs;
use crate::ranks::{self, Run};
use anyhow::{bail, Context, Result};
use kvant_dist::KindStats;
use kvant_engine::cluster::{Row, Want};
use kvant_kernels::bandwidth::measure_read_bandwidth;
use kvant_model::kv::KvCache;
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
/// Seed of the context-fill ids (a stream apart from the prompt's; depth
/// `D` uses the first `D`).
const FILL_SEED: u64 = 0x6b76_616e_7464;
/// Tokens per forward pass while filling the cache to a depth: bounds the
/// activations, as a serving step's token budget does.
const FILL_CHUNK: usize = 512;

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
    if a.depth.is_empty() {
        bail!("--depth needs at least one depth");
    }
    for &depth in &a.depth {
        let fits = depth
            .checked_add(a.prompt_tokens)
            .and_then(|n| n.checked_add(a.gen_tokens))
            .is_some_and(|n| n <= max_context);
        match (fits, depth) {
            (true, _) => {}
            (false, 0) => bail!(
                "--prompt-tokens {} plus --gen-tokens {} exceeds the model's context length {max_context}",
                a.prompt_tokens,
                a.gen_tokens
            ),
            (false, _) => bail!(
                "--depth {depth} plus --prompt-tokens {} plus --gen-tokens {} exceeds the model's context length {max_context}",
                a.prompt_tokens,
                a.gen_tokens
            ),
        }
    }
    let vocab = model.config().vocab;
    let prompt = random_ids(vocab, a.prompt_tokens, PROMPT_SEED)?;
    let deepest = a.depth.iter().copied().max().unwrap_or(0);
    let fill = random_ids(vocab, deepest, FILL_SEED)?;
    let weight_bytes = model.weight_bytes();
    let mut kv_bytes_per_position = 0;
    let mut depths = Vec::with_capacity(a.depth.len());
    for &depth in &a.depth {
        let (row, kv_per_position) =
            bench_depth(a, run, &fill[..depth], &prompt, weight_bytes, bandwidth)?;
        kv_bytes_per_position = kv_per_position;
        depths.push(row);
    }
    let report = Report {
        path: &run.path,
        model_bytes,
        weight_bytes,
        threads,
        peak_rss: rss_reset.and_then(|()| peak_rss_bytes()),
        bandwidth,
        kv_bytes_per_position,
        layout: run.cluster.as_ref().map(|_| {
            (
                a.parallel.clone(),
                run.model.parallel().map_or(1, |p| p.layout.world),
            )
        }),
        depths,
    };
    if a.json {
        println!("{}", report.json(a));
    } else {
        report.print_table(a);
    }
    Ok(())
}

/// Fills a cache with `fill` (untimed, in chunks of [`FILL_CHUNK`]), then
/// runs the warm-up and the timed repetitions after it, each rewinding the
/// cache to `fill.len()` first. Returns the depth's results and the cache's
/// bytes per position.
fn bench_depth(
    a: &BenchArgs,
    run: &Run,
    fill: &[u32],
    prompt: &[u32],
    weight_bytes: usize,
    bandwidth: f64,
) -> Result<(DepthRow, usize)> {
    let depth = fill.len();
    let mut cache = run.cache(depth + prompt.len() + a.gen_tokens)?;
    let t0 = Instant::now();
    for chunk in fill.chunks(FILL_CHUNK) {
        run.forward(&mut cache, chunk, Want::None)?;
    }
    // Linear-attention layers' state at the depth, which every
    // repetition's rewind comes back to.
    run.save_state(&mut cache)?;
    let fill_secs = t0.elapsed().as_secs_f64();
    let warm_up = run_once(run, &mut cache, depth, prompt, a.gen_tokens)?;
    let mut prefill_runs = Vec::new();
    let mut decode_runs = Vec::new();
    let mut comm = [PhaseComm::default(), PhaseComm::default()];
    for _ in 0..a.repetitions {
        let t = run_once(run, &mut cache, depth, prompt, a.gen_tokens)?;
        prefill_runs.push(per_s(a.prompt_tokens, t.prefill_secs));
        if a.gen_tokens > 0 {
            decode_runs.push(per_s(a.gen_tokens, t.decode_secs));
        }
        for (total, phase) in comm.iter_mut().zip(t.comm) {
            total.add(&phase);
        }
    }
    // Decode step i runs the token at position depth + prompt + i.
    let first = depth + prompt.len();
    let kv_read = match a.gen_tokens {
        0 => run.model.kv_bytes_read(first) as f64,
        g => {
            let total: f64 = (first..first + g)
                .map(|pos| run.model.kv_bytes_read(pos) as f64)
                .sum();
            total / g as f64
        }
    };
    let bytes_per_token = weight_bytes as f64 + kv_read;
    let row = DepthRow {
        depth,
        fill_secs,
        prefill: Summary::of(&prefill_runs),
        decode: Summary::of(&decode_runs),
        prefill_runs,
        decode_runs,
        kv_bytes_read_per_token: kv_read,
        bytes_per_token,
        roofline: bandwidth / bytes_per_token,
        comm,
    };
    Ok((row, warm_up.kv_bytes_per_position))
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

/// One repetition after the first `depth` tokens of `cache`: the prompt
/// in one forward pass, then `gen` one-token passes.
fn run_once(
    run: &Run,
    cache: &mut KvCache,
    depth: usize,
    prompt: &[u32],
    gen: usize,
) -> Result<Timing> {
    run.truncate(cache, depth)?;
    let argmax = |rows: Vec<Row>| match rows.into_iter().next() {
        Some(Row::Argmax(Some(t))) => Ok(t),
        _ => bail!("the model returned no finite logits"),
    };
    take_comm(run);
    let t0 = Instant::now();
    let mut next = argmax(run.forward(cache, prompt, Want::LastArgmax)?)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let prefill_comm = take_comm(run);
    let t1 = Instant::now();
    for _ in 0..gen {
        next = argmax(run.forward(cache, &[next], Want::LastArgmax)?)?;
    }
    Ok(Timing {
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
        kv_bytes_per_position: cache.bytes().checked_div(cache.capacity()).unwrap_or(0),
        comm: [prefill_comm, take_comm(run)],
    })
}

fn random_ids(vocab: usize, n: usize, seed: u64) -> Result<Vec<u32>> {
    let vocab = u32::try_from(vocab)
        .ok()
        .filter(|&v| v > 0)
        .with_context(|| format!("vocabulary size {vocab} is not a usable token-id range"))?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
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
    peak_rss: Result<u64, String>,
    bandwidth: f64,
    kv_bytes_per_position: usize,
    /// The parallel flags and the number of ranks, for a parallel run.
    layout: Option<(crate::args::ParallelArgs, usize)>,
    /// One per `--depth`, in the order given.
    depths: Vec<DepthRow>,
}

/// The results at one depth.
struct DepthRow {
    depth: usize,
    /// The untimed context fill.
    fill_secs: f64,
    prefill: Option<Summary>,
    decode: Option<Summary>,
    prefill_runs: Vec<f64>,
    decode_runs: Vec<f64>,
    /// KV bytes a decode step's attention reads, averaged over the steps.
    kv_bytes_read_per_token: f64,
    bytes_per_token: f64,
    roofline: f64,
    /// Rank 0's prefill and decode collectives, summed over the timed
    /// repetitions.
    comm: [PhaseComm; 2],
}

impl DepthRow {
    /// The depth's fields; the decode fields are `null` with `--gen-tokens 0`.
    fn json(&self) -> serde_json::Map<String, serde_json::Value> {
        let (p, d) = (self.prefill, self.decode);
        let v = serde_json::json!({
            "depth": self.depth,
            "fill_secs": self.fill_secs,
            "prefill_tokens_per_s": p.map(|s| s.median),
            "prefill_tokens_per_s_min": p.map(|s| s.min),
            "prefill_tokens_per_s_max": p.map(|s| s.max),
            "decode_tokens_per_s": d.map(|s| s.median),
            "decode_tokens_per_s_min": d.map(|s| s.min),
            "decode_tokens_per_s_max": d.map(|s| s.max),
            "prefill_runs": self.prefill_runs,
            "decode_runs": self.decode_runs,
            "kv_bytes_read_per_token": self.kv_bytes_read_per_token,
            "bytes_per_token": self.bytes_per_token,
            "roofline_decode_tokens_per_s": self.roofline,
            "decode_roofline_fraction": d.map(|s| s.median / self.roofline),
        });
        match v {
            serde_json::Value::Object(m) => m,
            _ => serde_json::Map::new(),
        }
    }
}

/// The layout and rank 0's collectives per run at one depth.
fn parallel_json(
    (p, world): &(crate::args::ParallelArgs, usize),
    comm: &[PhaseComm; 2],
    a: &BenchArgs,
) -> serde_json::Value {
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
        "ranks": world,
        "tp": p.tp,
        "dp": p.dp,
        "ep": p.ep,
        "two_batch_overlap": p.two_batch_overlap,
        "net_latency_s": p.net_latency.map(|d| d.as_secs_f64()),
        "net_bandwidth_bytes_per_s": p.net_bandwidth.map(|g| g * 1e9),
        "prefill": phase(&comm[0], 1),
        "decode": phase(&comm[1], a.gen_tokens),
    })
}

fn print_parallel(
    (p, world): &(crate::args::ParallelArgs, usize),
    comm: &[PhaseComm; 2],
    a: &BenchArgs,
) {
    let reps = a.repetitions as f64;
    println!(
        "ranks      {} (--tp {} --dp {} --ep {}{})",
        world,
        p.tp,
        p.dp,
        p.ep,
        if p.two_batch_overlap {
            " --two-batch-overlap"
        } else {
            ""
        }
    );
    for (name, c) in [("prefill", &comm[0]), ("decode", &comm[1])] {
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

impl Report<'_> {
    /// One object: the run's fields, `depths` (one object per depth, in
    /// the order given), and at the top level the first depth's fields too
    /// (what a single-depth reader looks for). `peak_rss_bytes` is `null`
    /// (with `peak_rss_error` saying why) where the OS does not report it;
    /// `parallel` holds rank 0's collectives at the first depth.
    fn json(&self, a: &BenchArgs) -> serde_json::Value {
        let mut obj = serde_json::Map::new();
        let mut put = |k: &str, v: serde_json::Value| {
            obj.insert(k.to_string(), v);
        };
        put("model", self.path.display().to_string().into());
        put("model_bytes", self.model_bytes.into());
        put("weight_bytes", self.weight_bytes.into());
        put("threads", self.threads.into());
        put("prompt_tokens", a.prompt_tokens.into());
        put("gen_tokens", a.gen_tokens.into());
        put("repetitions", a.repetitions.into());
        put(
            "peak_rss_bytes",
            self.peak_rss.as_ref().ok().copied().into(),
        );
        if let Err(why) = &self.peak_rss {
            put("peak_rss_error", why.as_str().into());
        }
        put("bandwidth_bytes_per_s", self.bandwidth.into());
        put("kv_bytes_per_position", self.kv_bytes_per_position.into());
        put("simd_tier", kvant_kernels::cpu::tier().name().into());
        let parallel = match (&self.layout, self.depths.first()) {
            (Some(layout), Some(first)) => parallel_json(layout, &first.comm, a),
            _ => serde_json::Value::Null,
        };
        put("parallel", parallel);
        let rows: Vec<serde_json::Value> = self
            .depths
            .iter()
            .map(|d| serde_json::Value::Object(d.json()))
            .collect();
        put("depths", rows.into());
        if let Some(first) = self.depths.first() {
            obj.extend(first.json());
        }
        serde_json::Value::Object(obj)
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
            "threads    {} (SIMD {}), {} repetitions after a warm-up at each depth",
            self.threads,
            kvant_kernels::cpu::tier(),
            a.repetitions
        );
        let (pp, tg) = (
            format!("pp{} t/s", a.prompt_tokens),
            format!("tg{} t/s", a.gen_tokens),
        );
        println!(
            "{:>7} {pp:>12} {:>10} {:>10} {tg:>12} {:>10} {:>10} {:>10} {:>13} {:>7}",
            "depth", "min", "max", "min", "max", "MB/token", "roofline t/s", "roof%"
        );
        let cells = |s: Option<Summary>| match s {
            Some(s) => format!("{:>12.1} {:>10.1} {:>10.1}", s.median, s.min, s.max),
            None => format!("{:>12} {:>10} {:>10}", "skipped", "", ""),
        };
        for d in &self.depths {
            let roof = match d.decode {
                Some(s) => format!("{:.1}", 100.0 * s.median / d.roofline),
                None => "-".to_string(),
            };
            println!(
                "{:>7} {} {} {:>10.1} {:>13.1} {roof:>7}",
                d.depth,
                cells(d.prefill),
                cells(d.decode),
                mb(d.bytes_per_token),
                d.roofline,
            );
        }
        match &self.peak_rss {
            Ok(b) => println!("peak RSS   {:.1} MB", mb(*b as f64)),
            Err(why) => println!("peak RSS   unavailable: {why}"),
        }
        println!(
            "roofline   {:.2} GB/s read ÷ MB per token (weights + the KV cache a decode step reads, averaged over the steps)",
            self.bandwidth / 1e9,
        );
        if let (Some(layout), Some(first)) = (&self.layout, self.depths.first()) {
            print_parallel(layout, &first.comm, a);
        }
    }
}
