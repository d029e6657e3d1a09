//! Tokenizers built from GGUF metadata or tokenizer.json, and incremental detokenization.
//!
//! Encoding runs on the Hugging Face `tokenizers` engine either way: a GGUF's `tokenizer.ggml.*`
//! keys become the equivalent engine pipeline (`gguf_bpe` for byte-level BPE, `gguf_spm` for
//! SentencePiece), and a tokenizer.json is loaded as written (`hf`). Decoding is kvant's own
//! (`pieces`): each token stands for a fixed run of bytes and text is the lossy UTF-8 of their
//! concatenation. That single rule is what lets [`DecodeStream`] promise that the text it streams
//! concatenates to exactly [`Tokenizer::decode`] of the same ids.

mod byte_fallback;
mod byte_level;
mod error;
mod gguf_bpe;
mod gguf_spm;
mod gguf_vocab;
mod hf;
mod parts;
mod pieces;
mod pre_tokenizer;
mod spec;
mod stream;

pub use error::TokenizerError;
pub use spec::GgufTokenizerSpec;
pub use stream::DecodeStream;

use parts::{AddSpecial, Parts};
use pieces::PieceTable;
use serde_json::Value;
use std::path::Path;

/// A checkpoint's tokenizer: text ↔ token ids, plus the special ids generation needs.
pub struct Tokenizer {
    engine: tokenizers::Tokenizer,
    /// `engine` with special-token matching off, made on first use.
    literal: std::sync::OnceLock<tokenizers::Tokenizer>,
    pieces: PieceTable,
    add_special: AddSpecial,
    bos: Option<u32>,
    eos: Vec<u32>,
    kind: String,
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF's metadata describes: "gpt2" (byte-level BPE, split as
    /// `tokenizer.ggml.pre` says) or "llama" (SentencePiece BPE with byte fallback).
    pub fn from_gguf_spec(spec: &GgufTokenizerSpec) -> Result<Self, TokenizerError> {
        spec.validate()?;
        let parts = match spec.model.as_str() {
            "gpt2" => gguf_bpe::build(spec)?,
            "llama" => gguf_spm::build(spec)?,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        Ok(Tokenizer::from_parts(parts))
    }

    /// Loads a Hugging Face tokenizer.json. BOS comes from `tokenizer_config["bos_token"]`
    /// (else `generation_config["bos_token_id"]`); the end-of-sequence ids from
    /// `generation_config["eos_token_id"]` (an id or a list), else `tokenizer_config["eos_token"]`.
    pub fn from_hf_files(
        tokenizer_json: &Path,
        tokenizer_config: Option<&Value>,
        generation_config: Option<&Value>,
    ) -> Result<Self, TokenizerError> {
        hf::build(tokenizer_json, tokenizer_config, generation_config).map(Tokenizer::from_parts)
    }

    fn from_parts(p: Parts) -> Self {
        Tokenizer {
            engine: p.engine,
            literal: std::sync::OnceLock::new(),
            pieces: p.pieces,
            add_special: p.add_special,
            bos: p.bos,
            eos: p.eos,
            kind: p.kind,
        }
    }

    /// Token ids for `text`. Special tokens written in the text (e.g. `<|im_start|>`) become
    /// their ids; `add_special` adds BOS/EOS as the checkpoint asks.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let engine_adds =
            add_special && matches!(self.add_special, AddSpecial::PostProcessor { .. });
        let encoding = self
            .engine
            .encode_fast(text, engine_adds)
            .map_err(TokenizerError::Engine)?;
        let ids = encoding.get_ids();
        Ok(match (&self.add_special, add_special) {
            (AddSpecial::Manual { bos, eos }, true) => {
                bos.iter().chain(ids).chain(eos.iter()).copied().collect()
            }
            _ => ids.to_vec(),
        })
    }

    /// Token ids for `text` with all of it taken as text: a control token's spelling inside it
    /// (`<|im_start|>` typed by a user) becomes the ordinary tokens of those characters. No
    /// BOS/EOS.
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let engine = self.literal.get_or_init(|| {
            let mut e = self.engine.clone();
            e.set_encode_special_tokens(true);
            e
        });
        let encoding = engine
            .encode_fast(text, false)
            .map_err(TokenizerError::Engine)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Whether [`Tokenizer::encode`] would read a control token out of `text`.
    pub fn has_control_text(&self, text: &str) -> Result<bool, TokenizerError> {
        let ids = self.encode(text, false)?;
        Ok(ids
            .iter()
            .any(|&id| matches!(self.pieces.entry(id), Some((_, true)))))
    }

    /// Text for `ids`; `skip_special` drops control tokens such as BOS and `<|im_end|>`.
    /// Bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.pieces.decode(ids, skip_special)
    }

    /// A stream that turns ids, fed one at a time, into text without splitting characters.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream::new(&self.pieces, skip_special)
    }

    /// The text of one token as it appears inside decoded text (so "▁the" is " the", and a lone
    /// byte of a multi-byte character is U+FFFD). Special tokens give their spelling.
    pub fn token_to_piece(&self, id: u32) -> Result<String, TokenizerError> {
        let piece = self.pieces.piece(id, false)?.unwrap_or_default();
        Ok(String::from_utf8_lossy(piece).into_owned())
    }

    /// The bytes `id` stands for in decoded text, and whether it is a control token (decoding
    /// with `skip_special` drops those); `None` for an id outside the vocabulary or one that names
    /// no token. Grammar engines build their token tries from this.
    pub fn token_bytes(&self, id: u32) -> Option<(&[u8], bool)> {
        self.pieces.entry(id)
    }

    /// Number of token ids: the model's embedding rows must cover it.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Ids that end generation: GGUF eos, eot and eom; for tokenizer.json the
    /// generation_config's eos ids.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Whether `encode(.., true)` starts with BOS.
    pub fn adds_bos(&self) -> bool {
        match self.add_special {
            AddSpecial::Manual { bos, .. } => bos.is_some(),
            AddSpecial::PostProcessor { adds_bos } => adds_bos,
        }
    }

    /// What kind of tokenizer this is, for `kvant info`: e.g. "byte-level BPE (smollm)".
    pub fn kind(&self) -> &str {
        &self.kind
    }
}
