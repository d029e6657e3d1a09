//! `kvant`: run LLM checkpoints from the command line.

mod args;
mod commands;
mod fetch;
mod progress;
mod ranks;

use clap::Parser;

fn main() {
    let cli = args::Cli::parse();
    // Start the kernels' pool before any kernel runs, with the chosen width.
    let result = kvant_kernels::pool::set_global_threads(cli.threads())
        .map_err(anyhow::Error::from)
        .and_then(|()| commands::run(cli));
    if let Err(e) = result {
        eprintln!("kvant: error: {e:#}");
        std::process::exit(1);
    }
}
