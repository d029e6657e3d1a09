//! `kvant serve`: the OpenAI-compatible HTTP server.

use crate::args::{LogFormat, PoolingArg, ServeArgs};
use crate::ranks::{self, Run};
use anyhow::{bail, Context, Result};
use kvant_engine::serving::{EngineConfig, EngineHandle, Pooling, Rebalance};
use kvant_server::{AllowedOrigins, AppState, ServerConfig};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub fn run(a: ServeArgs) -> Result<()> {
    // Batch invariance is the server's promise (see `--mla-prefill`).
    let opts = a.model.load_options_or(kvant_model::MlaPrefill::Absorbed);
    let Some(run) = ranks::start(&a.model, &a.parallel, opts)? else {
        return Ok(());
    };
    let result = serve(a, &run);
    run.finish(result)
}

fn serve(a: ServeArgs, run: &Run) -> Result<()> {
    let kv_bytes = a.kv_cache_memory.bytes()?;
    let block_size = a.block_size;
    // Linear-attention layers' states (one per running sequence, and as
    // many snapshots for prefix caching) come out of the same budget.
    let snapshots = if a.no_prefix_caching {
        0
    } else {
        a.max_running
    };
    let per_state = run.model.state_shape().bytes_per_slot() as u64;
    let state_bytes = per_state.saturating_mul((a.max_running + snapshots) as u64);
    if per_state > 0 && state_bytes >= kv_bytes {
        bail!(
            "--kv-cache-memory {kv_bytes} bytes holds no KV blocks beside the recurrent states of \
             {} running sequences and {snapshots} prefix snapshots ({per_state} bytes each); \
             give more memory or lower --max-running",
            a.max_running
        );
    }
    // Per rank: each holds its share of the KV heads (rank 0 the largest).
    let kv_blocks = EngineConfig::blocks_for_bytes(
        &run.model,
        block_size,
        usize::try_from(kv_bytes - state_bytes).unwrap_or(usize::MAX),
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
        state_snapshots: snapshots,
        speculation: a.model.speculation(),
        rebalance: a.eplb_interval.map(|every| Rebalance {
            every,
            redundant: a.eplb_redundant,
        }),
    };
    let tokenizer = Arc::clone(&run.tokenizer);
    let (engine, thread) = match &run.cluster {
        Some(c) => EngineHandle::start_on_cluster(
            Arc::clone(c),
            Arc::clone(&tokenizer),
            engine_config.clone(),
        )?,
        None => EngineHandle::start(
            Arc::clone(&run.model),
            Arc::clone(&tokenizer),
            engine_config.clone(),
        )?,
    };
    let config = ServerConfig {
        model_name: a
            .served_model_name
            .unwrap_or_else(|| served_name(&run.path)),
        api_key: a.api_key.filter(|k| !k.is_empty()),
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        parse_special_in_content: a.parse_special_in_content,
        allowed_origins: AllowedOrigins::parse(&a.allowed_origins)?,
        pooling: match a.pooling {
            PoolingArg::Last => Pooling::Last,
            PoolingArg::Mean => Pooling::Mean,
            PoolingArg::Cls => Pooling::First,
        },
    };
    let model_name = config.model_name.clone();
    let state = AppState::new(
        engine.clone(),
        &engine_config,
        tokenizer,
        run.chat_template.clone(),
        config,
    );
    // The kernels have their own pool; the HTTP side needs few threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let watched = engine.clone();
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        let ranks = match &run.cluster {
            Some(c) => {
                let l = c.layout();
                format!(
                    ", {} ranks: --tp {} --dp {} --ep {}",
                    l.world, l.tp, l.dp, l.ep
                )
            }
            None => String::new(),
        };
        let mut signals =
            kvant_server::Signals::new().context("listening for SIGINT and SIGTERM")?;
        start_access_log(a.log_format);
        println!(
            "kvant serve: {model_name} on http://{addr} ({kv_blocks} KV blocks of {block_size} tokens{ranks})"
        );
        std::io::stdout().flush()?;
        // A signal ends the server, and so does an engine that stopped on
        // its own (ranks that lost one another). After a signal, a second
        // one aborts the requests still draining instead of waiting out
        // --shutdown-grace.
        let aborter = engine.clone();
        let stop = async move {
            let signalled = tokio::select! {
                () = signals.recv() => true,
                () = async {
                    while !watched.is_closed() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                } => false,
            };
            if signalled {
                eprintln!("kvant serve: shutting down; a second Ctrl-C aborts the requests in flight");
                tokio::spawn(async move {
                    signals.recv().await;
                    eprintln!("kvant serve: aborting the requests in flight");
                    aborter.shutdown(kvant_engine::serving::Shutdown::Abort);
                });
            }
        };
        kvant_server::serve(listener, state, stop)
            .await
            .context("serving")
    });
    // Whatever ended the server, stop the engine before waiting for it.
    engine.shutdown(kvant_engine::serving::Shutdown::Abort);
    drop(runtime);
    thread.join()?;
    served
}

/// Requests' log lines (target `kvant::access`) to stderr, info and above.
fn start_access_log(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false);
    // A subscriber set earlier (none is) would keep its own format.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
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
