//! One module per subcommand.

mod bench;
mod chat;
mod generate;
mod info;
mod input;
mod perplexity;
mod quantize;
mod serve;
mod tokenize;

use crate::args::{Cli, Command};
use crate::fetch;
use anyhow::Result;
use input::read_utf8;

pub fn run(cli: Cli) -> Result<()> {
    let threads = cli.threads();
    match cli.command {
        Command::Bench(a) => bench::run(a, threads),
        Command::Chat(a) => chat::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Tokenize { model, text, file } => match (text, file) {
            (_, Some(f)) => tokenize::tokenize(&model, &read_utf8(&f)?),
            (Some(t), None) => tokenize::tokenize(&model, &t),
            (None, None) => anyhow::bail!("give TEXT or --file"),
        },
        Command::Detokenize { model, ids } => tokenize::detokenize(&model, &ids),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Quantize {
            input,
            output,
            kind,
        } => quantize::run(&input, &output, kind),
        Command::Info { model, json } => info::run(&model, json),
        Command::Fetch => {
            println!("{}", fetch::ensure_default_model()?.display());
            Ok(())
        }
    }
}
