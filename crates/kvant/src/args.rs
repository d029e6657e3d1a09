//! Command-line arguments.

use clap::{Args, Parser, Subcommand};
use kvant_engine::SamplingParams;
use std::num::NonZeroUsize;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kvant",
    version,
    about = "Run large language models fast, on the CPU today"
)]
pub struct Cli {
    /// Worker threads for every command [default: all cores]
    #[arg(long, global = true, value_name = "N", value_parser = thread_count)]
    threads: Option<NonZeroUsize>,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The one place the process's thread count comes from: `--threads`,
    /// else every core the OS lets this process use, shared evenly with
    /// the other ranks mpirun started on this node.
    pub fn threads(&self) -> usize {
        if let Some(n) = self.threads {
            return n.get();
        }
        let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        let local = ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
            .iter()
            .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(1);
        (cores / local).max(1)
    }
}

/// A thread pool far wider than any CPU only thrashes (or fails to spawn).
const MAX_THREADS: usize = 1024;

fn thread_count(s: &str) -> Result<NonZeroUsize, String> {
    match NonZeroUsize::new(at_least_one(s)?) {
        Some(n) if n.get() <= MAX_THREADS => Ok(n),
        _ => Err(format!("must be between 1 and {MAX_THREADS}")),
    }
}

/// Parses a count that must be positive, with a message that says so.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Subcommand)]
pub enum Command {
    /// Multi-turn chat with streamed replies (the default model if none given).
    Chat(ChatArgs),
    /// Generate a continuation of a prompt.
    Generate(GenerateArgs),
    /// Print the token ids of TEXT (or of a UTF-8 file) as a JSON array.
    Tokenize {
        #[command(flatten)]
        model: ModelArg,
        #[arg(required_unless_present = "file")]
        text: Option<String>,
        /// Tokenize this file's text instead (for texts too long for a command line).
        #[arg(long, short, conflicts_with = "text")]
        file: Option<PathBuf>,
    },
    /// Print the text of token IDS.
    Detokenize {
        #[command(flatten)]
        model: ModelArg,
        #[arg(required = true)]
        ids: Vec<u32>,
    },
    /// Perplexity of a text file over non-overlapping windows.
    Perplexity(PerplexityArgs),
    /// Describe a checkpoint.
    Info {
        #[command(flatten)]
        model: ModelArg,
        #[arg(long)]
        json: bool,
    },
    /// Download the default model into the cache (if absent) and print its path.
    Fetch,
    /// Measure prefill and decode speed against the memory-bandwidth roofline.
    Bench(BenchArgs),
    /// Serve an OpenAI-compatible HTTP API (completions, chat, streaming, metrics).
    Serve(ServeArgs),
    /// Write a GGUF with its float weight matrices quantized (the bytes `llama-quantize --pure`
    /// writes); to quantize a Hugging Face checkpoint, load it with --quantize instead.
    Quantize {
        /// The GGUF to read (F32, F16 or BF16 weights are quantized; others are copied).
        input: PathBuf,
        /// The GGUF to write.
        output: PathBuf,
        #[arg(long = "type", value_enum)]
        kind: QuantizeArg,
    },
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("drafting").args(["mtp", "mtp_model"]).multiple(true)))]
pub struct ModelArg {
    /// A .gguf file or a Hugging Face model directory [default: $KVANT_MODEL, else SmolLM2-135M-Instruct Q4_1, fetched on first use]
    #[arg(long, short)]
    pub model: Option<PathBuf>,
    /// Keep activations in f32 for block-quantized weights (Q4_0, Q4_1,
    /// Q5_0, Q8_0, the K-quants) instead of quantizing them to 8 bits, and
    /// for BF16 weights instead of rounding them to bf16 on CPUs with
    /// AVX-512 BF16 (slower; closest to an f32 reference).
    #[arg(long)]
    pub f32_activations: bool,
    /// Element type of the KV cache: f16 halves the memory and the bytes
    /// attention reads per token; f32 keeps keys and values exact; bf16
    /// keeps f32's range at f16's size; q8_0 and q4_0 (ggml's 32-value
    /// blocks, 34 and 18 bytes) need rows of a multiple of 32 values.
    #[arg(long, value_enum, default_value_t = KvCacheType::F16)]
    pub kv_cache_type: KvCacheType,
    /// Load the checkpoint's multi-token-prediction layer (DeepSeek-V3,
    /// GigaChat3) and decode self-speculatively with it: the same tokens,
    /// up to two per forward pass.
    #[arg(long)]
    pub mtp: bool,
    /// Read the multi-token-prediction module from this file instead of
    /// the checkpoint (DeepSeek-V4 as llama.cpp's `convert_hf_to_gguf.py
    /// --mtp` writes it: a GGUF of its own); implies --mtp.
    #[arg(long, value_name = "GGUF")]
    pub mtp_model: Option<PathBuf>,
    /// With --mtp: draft at every step, instead of only while drafting is
    /// measured to be faster than plain decoding.
    #[arg(long, requires = "drafting")]
    pub mtp_always: bool,
    /// How latent-attention models (DeepSeek-V2/V3, GigaChat3) run prompt
    /// chunks: `auto` in whichever of the expanded and absorbed forms is
    /// cheaper (the default, but for `serve`); `absorbed` always on the
    /// decode path, so that results never depend on how requests were
    /// batched (`serve`'s default).
    #[arg(long, value_enum)]
    pub mla_prefill: Option<MlaPrefillArg>,
    /// Context length in tokens instead of the checkpoint's (llama.cpp's
    /// -c): shorter bounds the caches; longer runs positions the model was
    /// not trained on (for benchmarks at depth; its outputs there are
    /// whatever those positions give).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub ctx_size: Option<u32>,
    /// Quantize the checkpoint's float weight matrices (F32, F16 or BF16, as
    /// in Hugging Face safetensors; dense and MoE; the embedding and output
    /// head too) while loading, rounded as ggml's reference quantizer rounds
    /// them, and run them on the integer kernels. q4_k: matrices whose rows
    /// are not whole 256-value blocks take q5_0, as llama-quantize gives
    /// them. Norms and routers stay as stored.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeArg>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum QuantizeArg {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_k")]
    Q4K,
}

impl QuantizeArg {
    pub fn dtype(self) -> kvant_core::DType {
        match self {
            QuantizeArg::Q8_0 => kvant_core::DType::Q8_0,
            QuantizeArg::Q4_0 => kvant_core::DType::Q4_0,
            QuantizeArg::Q4K => kvant_core::DType::Q4_K,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantizeArg::Q8_0 => "q8_0",
            QuantizeArg::Q4_0 => "q4_0",
            QuantizeArg::Q4K => "q4_k",
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum MlaPrefillArg {
    Auto,
    Absorbed,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum KvCacheType {
    F16,
    F32,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

impl ModelArg {
    /// The speculation policy `--mtp-always` asks for.
    pub fn speculation(&self) -> kvant_engine::speculative::Policy {
        match self.mtp_always {
            true => kvant_engine::speculative::Policy::Always,
            false => kvant_engine::speculative::Policy::Adaptive,
        }
    }

    /// Load options for the single-stream commands.
    pub fn load_options(&self) -> kvant_model::LoadOptions {
        self.load_options_or(kvant_model::MlaPrefill::Auto)
    }

    /// Load options with `mla_prefill` standing in for an absent
    /// `--mla-prefill`.
    pub fn load_options_or(
        &self,
        mla_prefill: kvant_model::MlaPrefill,
    ) -> kvant_model::LoadOptions {
        kvant_model::LoadOptions {
            int8_activations: !self.f32_activations,
            kv_dtype: match self.kv_cache_type {
                KvCacheType::F16 => kvant_model::kv::KvDType::F16,
                KvCacheType::F32 => kvant_model::kv::KvDType::F32,
                KvCacheType::Bf16 => kvant_model::kv::KvDType::Bf16,
                KvCacheType::Q8_0 => kvant_model::kv::KvDType::Q8_0,
                KvCacheType::Q4_0 => kvant_model::kv::KvDType::Q4_0,
            },
            mtp: self.mtp || self.mtp_model.is_some(),
            mla_prefill: match self.mla_prefill {
                None => mla_prefill,
                Some(MlaPrefillArg::Auto) => kvant_model::MlaPrefill::Auto,
                Some(MlaPrefillArg::Absorbed) => kvant_model::MlaPrefill::Absorbed,
            },
            context_length: self.ctx_size.map(|n| n as usize),
            quantize: self.quantize.map(QuantizeArg::dtype),
            progress: Some(crate::progress::layer_loaded),
        }
    }
}

/// How a run is laid out over ranks: processes started by `mpirun`, or,
/// without it, threads of this process.
#[derive(Args, Clone, Debug)]
pub struct ParallelArgs {
    /// Tensor-parallel ranks: attention heads, feed-forward columns and
    /// the vocabulary split among them.
    #[arg(long, default_value_t = 1, value_parser = at_least_one, help_heading = "Parallelism")]
    pub tp: usize,
    /// Data-parallel groups, each with its own requests and KV cache.
    #[arg(long, default_value_t = 1, value_parser = at_least_one, help_heading = "Parallelism")]
    pub dp: usize,
    /// Ranks the routed experts of a mixture of experts are spread over
    /// (1, or every rank).
    #[arg(long, default_value_t = 1, value_parser = at_least_one, help_heading = "Parallelism")]
    pub ep: usize,
    /// Split each step's batch into two micro-batches, one communicating
    /// while the other computes.
    #[arg(long, help_heading = "Parallelism")]
    pub two_batch_overlap: bool,
    /// Seconds a rank waits for the others in a collective before it
    /// declares one lost and ends the job.
    #[arg(long, default_value_t = 120, value_parser = at_least_one, value_name = "SECS", help_heading = "Parallelism")]
    pub dist_timeout: usize,
    /// Model a network for studying overlap on one machine: every
    /// collective completes no sooner than this latency (e.g. 20us, 1ms)
    /// plus its bytes over --net-bandwidth after it is posted.
    #[arg(long, value_name = "TIME", value_parser = duration, requires = "net_bandwidth", help_heading = "Parallelism")]
    pub net_latency: Option<std::time::Duration>,
    /// The modelled network's bandwidth in GB/s (with --net-latency).
    #[arg(long, value_name = "GB/s", value_parser = positive, requires = "net_latency", help_heading = "Parallelism")]
    pub net_bandwidth: Option<f64>,
}

impl ParallelArgs {
    /// Whether the flags ask for more than one rank.
    pub fn is_parallel(&self) -> bool {
        self.tp > 1 || self.dp > 1 || self.ep > 1
    }

    /// The modelled network, if one was asked for.
    pub fn net_model(&self) -> Option<kvant_dist::NetModel> {
        let (latency, gb_s) = (self.net_latency?, self.net_bandwidth?);
        kvant_dist::NetModel::new(latency, gb_s * 1e9)
    }
}

/// `20us`, `1.5ms`, `2s`, `300ns`.
fn duration(s: &str) -> Result<std::time::Duration, String> {
    let split = s
        .find(|c: char| c.is_ascii_alphabetic())
        .ok_or_else(|| format!("`{s}` needs a unit: ns, us, ms or s"))?;
    let (num, unit) = s.split_at(split);
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|e| format!("`{num}` is not a number ({e})"))?;
    let secs = match unit {
        "ns" => v * 1e-9,
        "us" | "µs" => v * 1e-6,
        "ms" => v * 1e-3,
        "s" => v,
        _ => return Err(format!("unknown unit `{unit}`: use ns, us, ms or s")),
    };
    std::time::Duration::try_from_secs_f64(secs).map_err(|e| e.to_string())
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        Ok(_) => Err("must be a positive number".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// 0 disables.
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Divides positive logits (multiplies negative ones) of recent tokens; 1 disables.
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of each token among the last --penalty-last-n.
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it occurs among the last --penalty-last-n.
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// How many recent tokens, prompt included, the penalties look at (llama.cpp's
    /// --repeat-last-n). `kvant serve` counts differently, as OpenAI and vLLM do: every
    /// generated token and none of the prompt.
    #[arg(long, default_value_t = 64)]
    pub penalty_last_n: usize,
    /// RNG seed [default: random]
    #[arg(long)]
    pub seed: Option<u64>,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Stop when this string appears (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: self.penalty_last_n,
            seed: self.seed.unwrap_or_else(random_seed),
        }
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// The prompt text.
    #[arg(
        long,
        short,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    pub prompt: Option<String>,
    /// Read the prompt from a UTF-8 file.
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Apply the chat template to the prompt as one user message.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// The UTF-8 text file to score.
    #[arg(long, short)]
    pub file: PathBuf,
    /// Window length in tokens.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// Prompt length of the prefill test (random token ids, as llama-bench uses).
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    pub prompt_tokens: usize,
    /// Tokens decoded one at a time after the prompt; 0 skips the decode test.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Tokens already in the cache before each test (untimed), as
    /// llama-bench's -d; a comma list gives one result per depth.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub depth: Vec<usize>,
    /// Timed runs after one warm-up; medians are reported.
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    pub repetitions: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the ready line shows it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* [default: no key]; the
    /// environment variable keeps the key out of `ps`
    #[arg(long, env = "KVANT_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Memory for the KV cache: a size (2GiB, 512MB) or a fraction of the memory available now (0.2).
    #[arg(long, default_value = "1GiB")]
    pub kv_cache_memory: kvant_server::memory::MemoryBudget,
    /// Tokens one forward pass may carry (prefill chunks plus decodes).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Sequences generated at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests that may wait for a slot; beyond that the server answers 429
    /// (a burst fills the free running slots and then these first).
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Do not reuse the KV cache of earlier prompts that share a prefix.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// The model name clients use [default: the checkpoint's file or directory name]
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// With --ep: every STEPS engine steps, re-place each MoE layer's
    /// experts from the loads routed since the last time (EPLB). Outputs
    /// do not change.
    #[arg(long, value_name = "STEPS", value_parser = at_least_one)]
    pub eplb_interval: Option<usize>,
    /// With --eplb-interval: extra replicas of the hottest experts per
    /// layer (each rank holds at most ⌈(experts + N) / ranks⌉).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        requires = "eplb_interval"
    )]
    pub eplb_redundant: usize,
    /// Seconds a shutdown (SIGINT, SIGTERM) lets requests in flight finish before aborting them.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
    /// Read control tokens (e.g. `<|im_start|>`) out of chat message text as the template's
    /// own. By default such text is plain characters, so a user cannot forge a system turn.
    #[arg(long)]
    pub parse_special_in_content: bool,
    /// Browser origins allowed to call the API (CORS), comma-separated `scheme://host[:port]`,
    /// or `*` for any. Default: no CORS headers.
    #[arg(long, value_name = "ORIGINS", value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// The access log on stderr: one line per request (id, status, tokens, timings; errors and
    /// aborts at warn), as text or one JSON object per line.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// How /v1/embeddings pools a prompt's hidden states (after the final norm; vectors are
    /// scaled to unit length): the last token's, as decoder embedding models (e5-mistral,
    /// gte-Qwen, Qwen3-Embedding) are trained; the mean over tokens; or the first token's.
    #[arg(long, value_enum, default_value = "last")]
    pub pooling: PoolingArg,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PoolingArg {
    Last,
    Mean,
    Cls,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}
