//! What the byte-level and SentencePiece GGUF builders share: the token → id map, the tokens
//! matched verbatim in text, and the BOS/EOS policy.

use super::error::TokenizerError;
use super::parts::AddSpecial;
use super::spec::{GgufTokenizerSpec, TokenType};
use tokenizers::models::bpe::Vocab;
use tokenizers::AddedToken;

/// Token text → id. Duplicates are refused as llama.cpp refuses them (the second spelling could
/// never be produced). Empty tokens are left out: no text encodes to them.
pub(super) fn vocab_map(spec: &GgufTokenizerSpec) -> Result<Vocab, TokenizerError> {
    let mut vocab = Vocab::with_capacity(spec.tokens.len());
    for (id, token) in spec.tokens.iter().enumerate() {
        if token.is_empty() {
            continue;
        }
        let id = u32::try_from(id).map_err(|_| too_many(spec))?;
        if let Some(first) = vocab.insert(token.clone(), id) {
            return Err(TokenizerError::InvalidSpec(format!(
                "token {token:?} appears twice in the vocabulary, as ids {first} and {id}"
            )));
        }
    }
    Ok(vocab)
}

/// Tokens llama.cpp matches whole in text before splitting it: control and unknown tokens as
/// special (dropped when decoding with `skip_special`), user-defined ones as plain added tokens.
/// None is normalized, so they match the raw text.
pub(super) fn added_tokens(spec: &GgufTokenizerSpec) -> (Vec<AddedToken>, Vec<AddedToken>) {
    let mut special = Vec::new();
    let mut plain = Vec::new();
    for (id, token) in spec.tokens.iter().enumerate() {
        if token.is_empty() {
            continue;
        }
        match spec.token_type(id) {
            TokenType::Control | TokenType::Unknown => {
                special.push(AddedToken::from(token.clone(), true).normalized(false));
            }
            TokenType::UserDefined => {
                plain.push(AddedToken::from(token.clone(), false).normalized(false));
            }
            _ => {}
        }
    }
    (special, plain)
}

/// BOS/EOS as the metadata says, with llama.cpp's defaults when a flag is absent. Asking for a
/// token the file does not name is an error, as in llama.cpp.
pub(super) fn add_special(
    spec: &GgufTokenizerSpec,
    default_bos: bool,
) -> Result<AddSpecial, TokenizerError> {
    let pick = |wanted: bool, id: Option<u32>, what: &str| match (wanted, id) {
        (false, _) => Ok(None),
        (true, Some(id)) => Ok(Some(id)),
        (true, None) => Err(TokenizerError::InvalidSpec(format!(
            "tokenizer.ggml.add_{what}_token is true but tokenizer.ggml.{what}_token_id is not set"
        ))),
    };
    Ok(AddSpecial::Manual {
        bos: pick(spec.add_bos.unwrap_or(default_bos), spec.bos_id, "bos")?,
        eos: pick(spec.add_eos.unwrap_or(false), spec.eos_id, "eos")?,
    })
}

fn too_many(spec: &GgufTokenizerSpec) -> TokenizerError {
    TokenizerError::InvalidSpec(format!(
        "{} tokens do not fit 32-bit ids",
        spec.tokens.len()
    ))
}
