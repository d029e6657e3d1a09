//! `kvant`: run LLM checkpoints from the command line.

mod args;
mod commands;
mod fetch;

use clap::Parser;

fn main() {
    let cli = args::Cli::parse();
    // Run the whole command on a pool worker: the forward pass's fork-joins
    // then start from inside the pool instead of waking it from outside and
    // parking the main thread on every matmul.
    let result = rayon::ThreadPoolBuilder::new()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|pool| pool.install(|| commands::run(cli)));
    if let Err(e) = result {
        eprintln!("kvant: error: {e:#}");
        std::process::exit(1);
    }
}
