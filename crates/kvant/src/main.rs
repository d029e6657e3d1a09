//! `kvant`: run LLM checkpoints from the command line.

mod args;
mod commands;
mod fetch;

use clap::Parser;

fn main() {
    let cli = args::Cli::parse();
    if let Err(e) = commands::run(cli) {
        eprintln!("kvant: error: {e:#}");
        std::process::exit(1);
    }
}
