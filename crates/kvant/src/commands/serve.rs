//! `kvant serve`: the OpenAI-compatible HTTP server.

use crate::args::ModelArg;
use crate::fetch;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvant_engine::serving::{EngineConfig, EngineHandle};
use kvant_server::memory::MemoryBudget;
use kvant_server::{AppState, ServerConfig};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the ready line shows it).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* [default: no key]
    #[arg(long)]
    pub api_key: Option<String>,
    /// Memory for the KV cache: a size (2GiB, 512MB) or a fraction of the memory available now (0.2).
    #[arg(long, default_value = "1GiB")]
    pub kv_cache_memory: MemoryBudget,
    /// Tokens one forward pass may carry (prefill chunks plus decodes).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Sequences generated at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests that may wait for a slot; beyond that the server answers 429.
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
    /// Seconds a shutdown (SIGINT, SIGTERM) lets requests in flight finish before aborting them.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let path = fetch::resolve_model(a.model.model.as_deref())?;
    let m = kvant_model::load_with(
        &path,
        // Batch invariance is the server's promise (see `--mla-prefill`).
        a.model.load_options_or(kvant_model::MlaPrefill::Absorbed),
    )
    .with_context(|| format!("loading {}", path.display()))?;
    let kv_bytes = a.kv_cache_memory.bytes()?;
    let block_size = a.block_size;
    let kv_blocks = EngineConfig::blocks_for_bytes(
        &m.model,
        block_size,
        usize::try_from(kv_bytes).unwrap_or(usize::MAX),
    );
    if kv_blocks == 0 {
        bail!("--kv-cache-memory {kv_bytes} bytes holds no KV block of {block_size} tokens; give more memory");
    }
    let engine_config = EngineConfig {
        block_size,
        kv_blocks,
        max_batch_tokens: a.max_batch_tokens,
        max_running: a.max_running,
        max_waiting: a.max_waiting,
        prefix_caching: !a.no_prefix_caching,
        speculation: a.model.speculation(),
    };
    let tokenizer = Arc::new(m.tokenizer);
    let (engine, thread) = EngineHandle::start(
        Arc::new(m.model),
        Arc::clone(&tokenizer),
        engine_config.clone(),
    )?;
    let config = ServerConfig {
        model_name: a.served_model_name.unwrap_or_else(|| served_name(&path)),
        api_key: a.api_key.filter(|k| !k.is_empty()),
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
    };
    let model_name = config.model_name.clone();
    let state = AppState::new(
        engine.clone(),
        &engine_config,
        tokenizer,
        m.chat_template.map(Arc::new),
        config,
    );
    // The kernels have their own pool; the HTTP side needs few threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        println!(
            "kvant serve: {model_name} on http://{addr} ({kv_blocks} KV blocks of {block_size} tokens)"
        );
        std::io::stdout().flush()?;
        kvant_server::serve(listener, state, kvant_server::shutdown_signal())
            .await
            .context("serving")
    });
    // Whatever ended the server, stop the engine before waiting for it.
    engine.shutdown(kvant_engine::serving::Shutdown::Abort);
    drop(runtime);
    thread.join()?;
    served
}

/// A checkpoint's default model name: the file stem of a .gguf, the name of
/// a Hugging Face directory.
fn served_name(path: &Path) -> String {
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    name.map_or_else(|| "kvant".to_string(), |n| n.to_string_lossy().into_owned())
}
