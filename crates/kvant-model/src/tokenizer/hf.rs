//! A Hugging Face `tokenizer.json`, run by the tokenizers engine as written, with BOS/EOS taken
//! from `tokenizer_config.json` and `generation_config.json` as transformers takes them.
//!
//! Decoding uses kvant's piece rule (see `pieces`), so the file's decoder must be one that rule
//! reproduces: `ByteLevel` (GPT-2, Llama 3, Qwen, SmolLM, DeepSeek), or SentencePiece's
//! `Replace("▁", " ")`, `ByteFallback`, `Fuse`, `Strip(" ", n, 0)` sequence (Llama 2, Mistral,
//! Gemma). Anything else is refused rather than decoded differently from transformers.

use super::byte_fallback::parse_byte_token;
use super::byte_level;
use super::error::TokenizerError;
use super::parts::{AddSpecial, Parts};
use super::pieces::PieceTable;
use serde_json::Value;
use std::path::Path;
use std::str::FromStr;

const SPACE: &str = "\u{2581}";

pub(super) fn build(
    path: &Path,
    tokenizer_config: Option<&Value>,
    generation_config: Option<&Value>,
) -> Result<Parts, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let json: Value = serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let rule = DecodeRule::from_json(json.get("decoder"))?;
    let engine = tokenizers::Tokenizer::from_str(&text).map_err(TokenizerError::Engine)?;

    let vocab = engine.get_vocab(true);
    let size = vocab.values().max().map_or(0, |&max| max as usize + 1);
    // Ids come from the file: refuse a sparse range rather than allocate for it.
    if size == 0 || size > vocab.len().saturating_mul(2) {
        return Err(unsupported(format!(
            "{} tokens with ids up to {}",
            vocab.len(),
            size.saturating_sub(1)
        )));
    }
    let added = engine.get_added_tokens_decoder();
    let mut pieces = PieceTable::new(rule.strip_leading);
    for id in 0..size as u32 {
        match engine.id_to_token(id) {
            Some(token) => pieces.push(
                &rule.piece(&token),
                added.get(&id).is_some_and(|t| t.special),
            ),
            None => pieces.push_missing(),
        }
    }

    let id_of = |key: &str, value: &Value| -> Result<u32, TokenizerError> {
        let text = token_text(value)
            .ok_or_else(|| unsupported(format!("tokenizer_config {key} is not a token")))?;
        engine.token_to_id(text).ok_or_else(|| {
            unsupported(format!(
                "tokenizer_config {key} {text:?} is not in the vocabulary"
            ))
        })
    };
    let bos = match tokenizer_config
        .and_then(|c| c.get("bos_token"))
        .filter(|v| !v.is_null())
    {
        Some(v) => Some(id_of("bos_token", v)?),
        None => match generation_config
            .and_then(|g| g.get("bos_token_id"))
            .filter(|v| !v.is_null())
        {
            Some(v) => Some(id_value("bos_token_id", v)?),
            None => None,
        },
    };
    let mut eos = Vec::new();
    match generation_config
        .and_then(|g| g.get("eos_token_id"))
        .filter(|v| !v.is_null())
    {
        Some(Value::Array(ids)) => {
            for v in ids {
                eos.push(id_value("eos_token_id", v)?);
            }
        }
        Some(v) => eos.push(id_value("eos_token_id", v)?),
        None => {
            if let Some(v) = tokenizer_config
                .and_then(|c| c.get("eos_token"))
                .filter(|v| !v.is_null())
            {
                eos.push(id_of("eos_token", v)?);
            }
        }
    }
    let mut seen = Vec::with_capacity(eos.len());
    eos.retain(|id| {
        let first = !seen.contains(id);
        seen.push(*id);
        first
    });
    for &id in bos.iter().chain(&eos) {
        if id as usize >= size {
            return Err(TokenizerError::IdOutOfRange {
                id,
                vocab_size: size,
            });
        }
    }

    // The post-processor adds whatever the checkpoint's template says; look at what it adds.
    let empty = engine
        .encode_fast("", true)
        .map_err(TokenizerError::Engine)?;
    let adds_bos = bos.is_some() && empty.get_ids().first() == bos.as_ref();
    let model = json
        .get("model")
        .and_then(|m| m.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("tokenizer");
    Ok(Parts {
        engine,
        pieces,
        add_special: AddSpecial::PostProcessor { adds_bos },
        bos,
        eos,
        kind: format!("tokenizer.json {model} ({})", rule.name),
    })
}

/// How each token maps to bytes, read off the file's decoder.
#[derive(Debug)]
struct DecodeRule {
    name: &'static str,
    byte_level: bool,
    /// "▁" decodes to a space.
    replace_space: bool,
    /// "<0xXX>" decodes to that byte.
    byte_fallback: bool,
    strip_leading: usize,
}

impl DecodeRule {
    fn from_json(decoder: Option<&Value>) -> Result<Self, TokenizerError> {
        let decoder = decoder
            .filter(|d| !d.is_null())
            .ok_or_else(|| unsupported("it names no decoder".into()))?;
        let byte_level = DecodeRule {
            name: "byte-level",
            byte_level: true,
            replace_space: false,
            byte_fallback: false,
            strip_leading: 0,
        };
        match type_of(decoder) {
            "ByteLevel" => Ok(byte_level),
            "Sequence" => {
                let steps = decoder
                    .get("decoders")
                    .and_then(Value::as_array)
                    .ok_or_else(|| unsupported("a Sequence decoder without decoders".into()))?;
                if let [only] = steps.as_slice() {
                    if type_of(only) == "ByteLevel" {
                        return Ok(byte_level);
                    }
                }
                Self::sentencepiece(steps)
            }
            other => Err(unsupported(format!("decoder {other:?}"))),
        }
    }

    fn sentencepiece(steps: &[Value]) -> Result<Self, TokenizerError> {
        let mut rule = DecodeRule {
            name: "SentencePiece",
            byte_level: false,
            replace_space: false,
            byte_fallback: false,
            strip_leading: 0,
        };
        let mut fused = false;
        for step in steps {
            match type_of(step) {
                "Replace"
                    if step.pointer("/pattern/String").and_then(Value::as_str) == Some(SPACE)
                        && step.get("content").and_then(Value::as_str) == Some(" ") =>
                {
                    rule.replace_space = true;
                }
                // Byte tokens are recognised one by one, so before the tokens are fused.
                "ByteFallback" if !fused => rule.byte_fallback = true,
                "Fuse" => fused = true,
                // After fusing, Strip acts on the whole text.
                "Strip"
                    if fused
                        && step.get("content").and_then(Value::as_str) == Some(" ")
                        && step.get("stop").and_then(Value::as_u64) == Some(0) =>
                {
                    let start = step.get("start").and_then(Value::as_u64).unwrap_or(0);
                    rule.strip_leading = usize::try_from(start)
                        .map_err(|_| unsupported(format!("Strip start {start}")))?;
                }
                _ => return Err(unsupported(format!("decoder step {step}"))),
            }
        }
        Ok(rule)
    }

    fn piece(&self, token: &str) -> Vec<u8> {
        if self.byte_level {
            return byte_level::token_bytes(token);
        }
        if self.byte_fallback {
            if let Some(byte) = parse_byte_token(token) {
                return vec![byte];
            }
        }
        if self.replace_space {
            token.replace(SPACE, " ").into_bytes()
        } else {
            token.as_bytes().to_vec()
        }
    }
}

fn type_of(value: &Value) -> &str {
    value.get("type").and_then(Value::as_str).unwrap_or("")
}

/// A special token in tokenizer_config.json: a string, or an AddedToken object.
fn token_text(value: &Value) -> Option<&str> {
    value
        .as_str()
        .or_else(|| value.get("content").and_then(Value::as_str))
}

fn id_value(key: &str, value: &Value) -> Result<u32, TokenizerError> {
    value
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| unsupported(format!("generation_config {key} {value} is not a token id")))
}

fn unsupported(message: String) -> TokenizerError {
    TokenizerError::UnsupportedHf(message)
}
