//! `tokenizer.ggml.model = "llama"`: SentencePiece BPE (Llama 2, Mistral v0.1, Gemma), as
//! llama.cpp's SPM tokenizer runs it: spaces become "▁", a "▁" is prefixed to every run of plain
//! text when `add_space_prefix` is set, adjacent symbols merge best-score-first into vocabulary
//! tokens, and characters outside the vocabulary fall back to `<0xXX>` byte tokens.
//!
//! The tokenizers engine merges by rank, so the ranks are recovered from the scores: every split
//! of a normal token into two normal tokens is a merge, ranked by the merged token's score. This
//! equals SentencePiece's choice except when two different splits of one token compete at the
//! same step (SentencePiece then takes the leftmost), which the fixtures do not hit.

use super::byte_fallback::{byte_token, parse_byte_token};
use super::error::TokenizerError;
use super::gguf_vocab::{add_special, added_tokens, vocab_map};
use super::parts::Parts;
use super::pieces::PieceTable;
use super::spec::{GgufTokenizerSpec, TokenType};
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence};
use tokenizers::NormalizerWrapper;

const SPACE: &str = "\u{2581}";
/// Longest token split into merges. Generating merges costs the square of a token's length, so
/// this bounds the work a hostile vocabulary can demand; real SentencePiece tokens are a few
/// dozen bytes, and a longer one stays reachable as a whole when it is an added token.
const MAX_MERGE_TOKEN_BYTES: usize = 256;

pub(super) fn build(spec: &GgufTokenizerSpec) -> Result<Parts, TokenizerError> {
    let scores = spec.scores.as_deref().ok_or_else(|| {
        TokenizerError::InvalidSpec("SentencePiece vocabulary without tokenizer.ggml.scores".into())
    })?;
    let vocab = vocab_map(spec)?;
    let merges = merges_from_scores(spec, scores, &vocab);
    let byte_fallback = (0..=255u8).any(|b| vocab.contains_key(&byte_token(b)));
    let unk = spec
        .unk_id
        .and_then(|id| spec.tokens.get(id as usize))
        .cloned();
    if !byte_fallback && unk.is_none() {
        return Err(TokenizerError::InvalidSpec(
            "SentencePiece vocabulary has neither <0xXX> byte tokens nor an unknown token".into(),
        ));
    }
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(byte_fallback)
        .fuse_unk(true);
    if let Some(unk) = unk {
        bpe = bpe.unk_token(unk);
    }
    let bpe = bpe.build().map_err(TokenizerError::Engine)?;

    let add_space_prefix = spec.add_space_prefix.unwrap_or(true);
    let mut normalizers = Vec::new();
    if add_space_prefix {
        // Normalizers run on each stretch of text between added tokens, so like llama.cpp this
        // prefixes the start and every stretch after a special token.
        normalizers.push(NormalizerWrapper::Prepend(Prepend::new(SPACE.into())));
    }
    normalizers.push(NormalizerWrapper::Replace(
        Replace::new(" ", SPACE).map_err(TokenizerError::Engine)?,
    ));
    let mut engine = tokenizers::Tokenizer::new(bpe);
    engine.with_normalizer(Some(NormalizerWrapper::Sequence(Sequence::new(
        normalizers,
    ))));
    let (special, plain) = added_tokens(spec);
    engine.add_special_tokens(&special);
    engine.add_tokens(&plain);

    let mut pieces = PieceTable::new(usize::from(add_space_prefix));
    for (id, token) in spec.tokens.iter().enumerate() {
        match spec.token_type(id) {
            TokenType::Control | TokenType::Unknown | TokenType::Unused => {
                pieces.push(token.as_bytes(), true);
            }
            TokenType::Byte => {
                let byte = parse_byte_token(token).ok_or_else(|| {
                    TokenizerError::InvalidSpec(format!("byte token {id} is {token:?}, not <0xXX>"))
                })?;
                pieces.push(&[byte], false);
            }
            TokenType::Normal | TokenType::UserDefined | TokenType::Undefined => {
                pieces.push(token.replace(SPACE, " ").as_bytes(), false);
            }
        }
    }
    Ok(Parts {
        engine,
        pieces,
        add_special: add_special(spec, true)?,
        bos: spec.bos_id,
        eos: spec.end_ids(),
        kind: "SentencePiece BPE".to_string(),
    })
}

/// Merge ranks from scores: best score first, ties by token id, then longer left half first.
fn merges_from_scores(spec: &GgufTokenizerSpec, scores: &[f32], vocab: &Vocab) -> Merges {
    let normal = |id: usize| spec.token_type(id) == TokenType::Normal;
    let normal_id = |text: &str| vocab.get(text).filter(|&&id| normal(id as usize)).is_some();
    let mut candidates = Vec::new();
    for (id, token) in spec.tokens.iter().enumerate() {
        if !normal(id) || token.len() > MAX_MERGE_TOKEN_BYTES {
            continue;
        }
        let score = scores.get(id).copied().unwrap_or(f32::NEG_INFINITY);
        for (at, _) in token.char_indices().skip(1) {
            let (left, right) = token.split_at(at);
            if normal_id(left) && normal_id(right) {
                candidates.push((score, id, left, right));
            }
        }
    }
    candidates.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(b.2.len().cmp(&a.2.len()))
    });
    candidates
        .into_iter()
        .map(|(_, _, left, right)| (left.to_string(), right.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_rank_by_the_merged_tokens_score() {
        let spec = GgufTokenizerSpec {
            model: "llama".into(),
            tokens: ["a", "b", "c", "ab", "bc", "abc"]
                .map(String::from)
                .to_vec(),
            scores: Some(vec![0.0, 0.0, 0.0, -2.0, -1.0, -3.0]),
            ..Default::default()
        };
        let vocab = vocab_map(&spec).expect("vocab");
        let scores = spec.scores.clone().unwrap_or_default();
        let merges = merges_from_scores(&spec, &scores, &vocab);
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        assert_eq!(pairs, [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]);
    }
}
