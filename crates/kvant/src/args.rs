//! Command-line arguments.

use clap::{Args, Parser, Subcommand};
use kvant_engine::SamplingParams;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kvant",
    version,
    about = "Run large language models fast, on the CPU today"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Multi-turn chat with streamed replies (the default model if none given).
    Chat(ChatArgs),
    /// Generate a continuation of a prompt.
    Generate(GenerateArgs),
    /// Print the token ids of TEXT as a JSON array.
    Tokenize {
        #[command(flatten)]
        model: ModelArg,
        text: String,
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
}

#[derive(Args)]
pub struct ModelArg {
    /// A .gguf file or a Hugging Face model directory [default: $KVANT_MODEL, else SmolLM2-135M-Instruct Q4_1, fetched on first use]
    #[arg(long, short)]
    pub model: Option<PathBuf>,
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
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at.
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
    /// The UTF-8 text file to score.
    #[arg(long, short)]
    pub file: PathBuf,
    /// Window length in tokens.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    #[arg(long)]
    pub json: bool,
}
