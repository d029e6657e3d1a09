//! `tokenizer.ggml.model = "gpt2"`: byte-level BPE from the vocabulary and merges, split first by
//! the regexes `tokenizer.ggml.pre` names (see `pre_tokenizer`).

use super::byte_level;
use super::error::TokenizerError;
use super::gguf_vocab::{add_special, added_tokens, vocab_map};
use super::parts::Parts;
use super::pieces::PieceTable;
use super::pre_tokenizer::{bpe_split, sequence};
use super::spec::{GgufTokenizerSpec, TokenType};
use std::collections::HashSet;
use tokenizers::models::bpe::{Merges, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::PreTokenizerWrapper;

pub(super) fn build(spec: &GgufTokenizerSpec) -> Result<Parts, TokenizerError> {
    let split = bpe_split(spec.pre.as_deref())?;
    // A byte whose token the vocabulary lacks (SmolLM2 has none for 0x04) is dropped from the
    // input, as llama.cpp and transformers drop it.
    let vocab = vocab_map(spec)?;
    let merges = parse_merges(spec.merges.as_deref().ok_or_else(|| {
        TokenizerError::InvalidSpec("byte-level BPE without tokenizer.ggml.merges".into())
    })?)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(split.ignore_merges)
        .build()
        .map_err(TokenizerError::Engine)?;

    let mut steps = split.pre_tokenizer()?;
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));
    let mut engine = tokenizers::Tokenizer::new(bpe);
    engine.with_pre_tokenizer(Some(sequence(steps)));
    let (special, plain) = added_tokens(spec);
    engine.add_special_tokens(&special);
    engine.add_tokens(&plain);

    let mut pieces = PieceTable::new(0);
    for (id, token) in spec.tokens.iter().enumerate() {
        match spec.token_type(id) {
            // llama.cpp prints control and user-defined tokens as their text, not byte-decoded.
            TokenType::Control | TokenType::Unknown | TokenType::Unused => {
                pieces.push(token.as_bytes(), true);
            }
            TokenType::UserDefined => pieces.push(token.as_bytes(), false),
            TokenType::Normal | TokenType::Byte | TokenType::Undefined => {
                pieces.push(&byte_level::token_bytes(token), false);
            }
        }
    }
    let pre = spec.pre.as_deref().unwrap_or("default");
    Ok(Parts {
        engine,
        pieces,
        add_special: add_special(spec, split.add_bos)?,
        bos: spec.bos_id,
        eos: spec.end_ids(),
        kind: format!("byte-level BPE ({pre})"),
    })
}

/// "left right" lines, split at the first space after the first byte as llama.cpp does. A
/// repeated pair keeps its first (best) rank.
fn parse_merges(lines: &[String]) -> Result<Merges, TokenizerError> {
    let mut seen = HashSet::with_capacity(lines.len());
    let mut merges = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        let not_a_pair =
            || TokenizerError::InvalidSpec(format!("merge {i} ({line:?}) is not two tokens"));
        let space = line
            .bytes()
            .skip(1)
            .position(|b| b == b' ')
            .map(|p| p + 1)
            .ok_or_else(not_a_pair)?;
        let left = line.get(..space).ok_or_else(not_a_pair)?;
        let right = line.get(space + 1..).ok_or_else(not_a_pair)?;
        if seen.insert((left, right)) {
            merges.push((left.to_string(), right.to_string()));
        }
    }
    Ok(merges)
}

#[cfg(test)]
mod tests {
    use super::parse_merges;

    #[test]
    fn merges_split_at_the_first_inner_space_and_keep_first_rank() {
        let lines = ["Ġ t", "a b", "Ġ t", "  x"].map(String::from);
        let merges = parse_merges(&lines).expect("valid merges");
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        assert_eq!(pairs, [("Ġ", "t"), ("a", "b"), (" ", "x")]);
        assert!(parse_merges(&["ab".to_string()]).is_err());
    }
}
