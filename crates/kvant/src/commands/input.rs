//! What subcommands read besides their flags: the model `--model` names
//! (fetched by default), and text files.

use crate::args::ModelArg;
use crate::fetch;
use anyhow::{Context, Result};
use kvant_model::LoadedModel;

/// Resolves `--model` (or its defaults) and loads it.
pub fn load_model(arg: &ModelArg) -> Result<LoadedModel> {
    let path = fetch::resolve_model(arg.model.as_deref())?;
    kvant_model::load_files(&path, arg.mtp_model.as_deref(), arg.load_options(), None)
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
