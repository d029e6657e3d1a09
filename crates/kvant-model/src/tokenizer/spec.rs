//! The tokenizer a GGUF describes, as plain data: exactly the `tokenizer.ggml.*` keys llama.cpp's
//! converter writes. Keeping this free of any GGUF reader lets the tokenizer be built and tested
//! from JSON fixtures, and lets the checkpoint loader fill it from whatever reads the file.

use super::error::TokenizerError;

/// `tokenizer.ggml.*` metadata. Field names follow the keys (`token_type` → `token_types`,
/// `unknown_token_id` → `unk_id`, `padding_token_id` → `pad_id`, `add_bos_token` → `add_bos`).
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
pub struct GgufTokenizerSpec {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the byte-level BPE pre-tokenizer, e.g. "llama-bpe", "qwen2", "smollm".
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i32>>,
    /// "left right" pairs, best first.
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

/// llama.cpp's `llama_token_type`, which is also SentencePiece's piece type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    /// 0 or any value llama.cpp does not know; decoded like a normal token.
    Undefined,
}

impl TokenType {
    fn from_gguf(value: i32) -> Self {
        match value {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
}

impl GgufTokenizerSpec {
    /// Checks what the builders index by: array lengths and special ids. After this,
    /// `token_type` and the id getters cannot go out of bounds.
    pub(crate) fn validate(&self) -> Result<(), TokenizerError> {
        let n = self.tokens.len();
        if n == 0 {
            return Err(invalid("tokenizer.ggml.tokens is empty"));
        }
        if u32::try_from(n).is_err() {
            return Err(invalid(format!("{n} tokens do not fit 32-bit ids")));
        }
        if let Some(scores) = &self.scores {
            check_len("tokenizer.ggml.scores", scores.len(), n)?;
        }
        if let Some(types) = &self.token_types {
            check_len("tokenizer.ggml.token_type", types.len(), n)?;
        }
        let ids = [
            ("bos_token_id", self.bos_id),
            ("eos_token_id", self.eos_id),
            ("eot_token_id", self.eot_id),
            ("eom_token_id", self.eom_id),
            ("unknown_token_id", self.unk_id),
            ("padding_token_id", self.pad_id),
        ];
        for (key, id) in ids {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(invalid(format!(
                        "tokenizer.ggml.{key} = {id} is outside the vocabulary of {n}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The type of token `id`; every token is normal when the file lists no types.
    /// `id` must be below `tokens.len()` and the spec validated.
    pub(crate) fn token_type(&self, id: usize) -> TokenType {
        match &self.token_types {
            Some(types) => types
                .get(id)
                .map_or(TokenType::Undefined, |&t| TokenType::from_gguf(t)),
            None => TokenType::Normal,
        }
    }

    /// End-of-generation ids: eos, eot and eom, each once, in that order.
    pub(crate) fn end_ids(&self) -> Vec<u32> {
        let mut out = Vec::new();
        for id in [self.eos_id, self.eot_id, self.eom_id]
            .into_iter()
            .flatten()
        {
            if !out.contains(&id) {
                out.push(id);
            }
        }
        out
    }
}

fn check_len(key: &str, len: usize, tokens: usize) -> Result<(), TokenizerError> {
    if len == tokens {
        Ok(())
    } else {
        Err(invalid(format!(
            "{key} has {len} entries for {tokens} tokens"
        )))
    }
}

fn invalid(message: impl Into<String>) -> TokenizerError {
    TokenizerError::InvalidSpec(message.into())
}
