//! The tokenizer fixtures shared by the tokenizer tests: reference ids and
//! texts that tools/reference/make_tokenizer_fixtures.py wrote from
//! transformers, the tokenizer-only GGUFs and tokenizer.json folders.

#![allow(dead_code)] // each test binary uses its own part

use kvant_model::tokenizer::GgufTokenizerSpec;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// A reference file (`smollm2.json`, `spm.json`).
#[derive(Deserialize)]
pub struct Fixture {
    pub bos_id: u32,
    pub eos_id: u32,
    pub cases: Vec<Case>,
}

/// One text and what transformers made of it (the `hf_*` fields where the
/// tokenizer.json tokenizer differs from the GGUF one).
#[derive(Deserialize)]
pub struct Case {
    pub text: String,
    pub ids: Vec<u32>,
    pub decoded: String,
    pub decoded_skip_special: String,
    pub hf_ids: Option<Vec<u32>>,
    pub hf_decoded: Option<String>,
}

pub fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizer")
        .join(name)
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A reference file of the fixture folder, by name.
pub fn fixture(name: &str) -> Fixture {
    read_json(&fixture_path(name))
}

/// The tokenizer keys of a tokenizer-only fixture GGUF, read through the
/// same adapter `kvant_model::load` uses.
pub fn gguf_spec(name: &str) -> GgufTokenizerSpec {
    let path = fixture_path(name);
    let g = kvant_model::gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    kvant_model::load::tokenizer_spec(&g).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
