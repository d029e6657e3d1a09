//! `kvant tokenize` and `kvant detokenize`.

use super::input::load_model;
use crate::args::ModelArg;
use anyhow::Result;

pub fn tokenize(model: &ModelArg, text: &str) -> Result<()> {
    let m = load_model(model)?;
    let ids = m.tokenizer.encode(text, true)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

pub fn detokenize(model: &ModelArg, ids: &[u32]) -> Result<()> {
    let m = load_model(model)?;
    println!("{}", m.tokenizer.decode(ids, false)?);
    Ok(())
}
