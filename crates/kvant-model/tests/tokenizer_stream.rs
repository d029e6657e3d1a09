//! `DecodeStream`: text streamed one id at a time never splits a UTF-8 character, and all of it
//! plus `flush` is exactly `decode` of the same ids, for random id sequences (single-byte tokens
//! included) on both a byte-level and a SentencePiece vocabulary.

mod tokenizer_fixtures;

use kvant_model::tokenizer::{GgufTokenizerSpec, Tokenizer};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokenizer_fixtures::{fixture, gguf_spec};

fn tokenizer(spec_file: &str) -> (Tokenizer, GgufTokenizerSpec) {
    let spec = gguf_spec(spec_file);
    (
        Tokenizer::from_gguf_spec(&spec).expect("tokenizer builds"),
        spec,
    )
}

/// Streams `ids`; returns the emitted pieces (flush last, when non-empty).
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut stream = tok.decode_stream(skip_special);
    let mut pieces: Vec<String> = ids
        .iter()
        .filter_map(|&id| stream.step(id).expect("valid id"))
        .collect();
    pieces.push(stream.flush());
    pieces.retain(|p| !p.is_empty());
    pieces
}

fn assert_stream_matches_decode(tok: &Tokenizer, ids: &[u32]) {
    for skip_special in [false, true] {
        let streamed = stream(tok, ids, skip_special).concat();
        let decoded = tok.decode(ids, skip_special).expect("valid ids");
        assert_eq!(
            streamed, decoded,
            "ids {ids:?}, skip_special {skip_special}"
        );
    }
}

/// Ids whose token is a single byte: byte-level alphabet characters or "<0xXX>".
fn single_byte_ids(spec: &GgufTokenizerSpec) -> Vec<u32> {
    (0u32..)
        .zip(&spec.tokens)
        .filter(|(_, t)| t.chars().count() == 1 || (t.len() == 6 && t.starts_with("<0x")))
        .map(|(id, _)| id)
        .collect()
}

fn random_sequences(spec_file: &str, seed: u64) {
    let (tok, spec) = tokenizer(spec_file);
    let bytes = single_byte_ids(&spec);
    assert!(
        bytes.len() >= 200,
        "{spec_file}: only {} single-byte tokens",
        bytes.len()
    );
    let vocab = tok.vocab_size() as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for _ in 0..400 {
        let len = rng.random_range(0..48);
        let byte_share = rng.random_range(0.0..1.0);
        let ids: Vec<u32> = (0..len)
            .map(|_| {
                if rng.random_bool(byte_share) {
                    bytes[rng.random_range(0..bytes.len())]
                } else {
                    rng.random_range(0..vocab)
                }
            })
            .collect();
        assert_stream_matches_decode(&tok, &ids);
    }
}

#[test]
fn random_byte_level_sequences_stream_like_decode() {
    random_sequences("smollm2-tokenizer.gguf", 17);
}

#[test]
fn random_sentencepiece_sequences_stream_like_decode() {
    random_sequences("spm-tokenizer.gguf", 29);
}

/// Real encodings decode to valid text, so no streamed piece may hold U+FFFD: a character
/// split over several tokens (emoji, CJK through byte fallback) must come out whole.
#[test]
fn encoded_text_streams_whole_characters() {
    for (spec_file, fixture_file) in [
        ("smollm2-tokenizer.gguf", "smollm2.json"),
        ("spm-tokenizer.gguf", "spm.json"),
    ] {
        let (tok, _) = tokenizer(spec_file);
        let fixture = fixture(fixture_file);
        for case in &fixture.cases {
            assert_stream_matches_decode(&tok, &case.ids);
            for piece in stream(&tok, &case.ids, false) {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "{spec_file}: broken piece {piece:?} in {:?}",
                    case.text
                );
            }
        }
    }
}

#[test]
fn byte_fallback_emoji_waits_for_its_last_byte() {
    let (tok, spec) = tokenizer("spm-tokenizer.gguf");
    let crab = "🦀";
    let ids = tok.encode(crab, false).expect("encode");
    let byte_tokens: Vec<&str> = ids
        .iter()
        .map(|&id| spec.tokens[id as usize].as_str())
        .collect();
    assert_eq!(
        byte_tokens.get(1..),
        Some(&["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"][..]),
        "{byte_tokens:?}"
    );
    let mut stream = tok.decode_stream(false);
    let steps: Vec<Option<String>> = ids
        .iter()
        .map(|&id| stream.step(id).expect("valid id"))
        .collect();
    // "▁" first: the dummy-prefix space is stripped, so nothing shows until the crab completes.
    assert_eq!(steps, [None, None, None, None, Some(crab.to_string())]);
    assert_eq!(stream.flush(), "");
}

#[test]
fn sentencepiece_strips_only_the_leading_space() {
    let (tok, _) = tokenizer("spm-tokenizer.gguf");
    let ids = tok.encode("  two spaces first", true).expect("encode");
    let pieces = stream(&tok, &ids, true);
    assert_eq!(pieces.concat(), "  two spaces first");
    assert_eq!(pieces.concat(), tok.decode(&ids, true).expect("decode"));
    // With BOS shown, the text starts with "<s>" and no space is stripped after it.
    let shown = stream(&tok, &ids, false).concat();
    assert_eq!(shown, tok.decode(&ids, false).expect("decode"));
    assert!(shown.starts_with("<s>   two"), "{shown:?}");
}

#[test]
fn an_unfinished_character_flushes_as_replacement() {
    let (tok, spec) = tokenizer("spm-tokenizer.gguf");
    let lead = (0u32..)
        .zip(&spec.tokens)
        .find(|(_, t)| *t == "<0xE2>")
        .map(|(id, _)| id)
        .expect("byte token");
    let mut stream = tok.decode_stream(false);
    assert_eq!(stream.step(lead).expect("valid id"), None);
    assert_eq!(stream.flush(), "\u{FFFD}");
    assert_eq!(tok.decode(&[lead], false).expect("decode"), "\u{FFFD}");
}
