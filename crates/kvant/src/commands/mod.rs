//! One module per subcommand.

mod bench;
mod chat;
mod generate;
mod info;
mod perplexity;
mod quantize;
mod serve;
mod tokenize;

use crate::args::{Cli, Command, ModelArg};
use crate::fetch;
use anyhow::{Context, Result};
use kvant_model::LoadedModel;

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

/// Resolves `--model` (or its defaults) and loads it.
pub fn load_model(arg: &ModelArg) -> Result<LoadedModel> {
    let path = fetch::resolve_model(arg.model.as_deref())?;
    kvant_model::load_with(&path, arg.load_options())
        .with_context(|| format!("loading {}", path.display()))
}

/// Reads a UTF-8 text file, naming the file and the byte offset of bad UTF-8.
pub fn read_utf8(path: &std::path::Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
