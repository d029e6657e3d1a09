//! Tokenizers loaded from a Hugging Face tokenizer.json, against the ids transformers produced
//! (tools/reference/make_tokenizer_fixtures.py).

mod tokenizer_fixtures;

use kvant_model::tokenizer::{Tokenizer, TokenizerError};
use serde_json::{json, Value};
use std::path::PathBuf;
use tokenizer_fixtures::{fixture_path, read_json, Fixture};

fn load(dir: &str, generation_config: Option<&Value>) -> Result<Tokenizer, TokenizerError> {
    let config: Value = read_json(&fixture_path(dir).join("tokenizer_config.json"));
    Tokenizer::from_hf_files(
        &fixture_path(dir).join("tokenizer.json"),
        Some(&config),
        generation_config,
    )
}

#[test]
fn smollm2_tokenizer_json_gives_the_reference_ids() {
    let fixture: Fixture = read_json(&fixture_path("smollm2.json"));
    let tok = load("smollm2-hf", None).expect("tokenizer.json loads");
    assert_eq!(tok.kind(), "tokenizer.json BPE (byte-level)");
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(fixture.bos_id));
    assert_eq!(
        tok.eos_ids(),
        [fixture.eos_id],
        "eos from tokenizer_config's eos_token"
    );
    assert!(!tok.adds_bos());
    for case in &fixture.cases {
        assert_eq!(
            tok.encode(&case.text, false).expect("encode"),
            case.ids,
            "{:?}",
            case.text
        );
        assert_eq!(
            tok.encode(&case.text, true).expect("encode"),
            case.ids,
            "{:?}",
            case.text
        );
        assert_eq!(tok.decode(&case.ids, false).expect("decode"), case.decoded);
        assert_eq!(
            tok.decode(&case.ids, true).expect("decode"),
            case.decoded_skip_special
        );
    }
}

#[test]
fn generation_config_eos_ids_take_precedence() {
    let list = json!({"bos_token_id": 1, "eos_token_id": [2, 0, 2]});
    let tok = load("smollm2-hf", Some(&list)).expect("loads");
    assert_eq!(tok.eos_ids(), [2, 0]);
    let single = json!({"eos_token_id": 0});
    assert_eq!(
        load("smollm2-hf", Some(&single)).expect("loads").eos_ids(),
        [0]
    );
    let bad = json!({"eos_token_id": "two"});
    assert!(matches!(
        load("smollm2-hf", Some(&bad)),
        Err(TokenizerError::UnsupportedHf(_))
    ));
    let outside = json!({"eos_token_id": 49152});
    assert!(matches!(
        load("smollm2-hf", Some(&outside)),
        Err(TokenizerError::IdOutOfRange { id: 49152, .. })
    ));
}

/// The SentencePiece model as transformers saves it: Metaspace pre-tokenizer, a post-processor
/// that adds <s>, and the Replace/ByteFallback/Fuse/Strip decoder.
#[test]
fn sentencepiece_tokenizer_json_gives_transformers_ids() {
    let fixture: Fixture = read_json(&fixture_path("spm.json"));
    let tok = load("spm-hf", None).expect("tokenizer.json loads");
    assert_eq!(tok.kind(), "tokenizer.json BPE (SentencePiece)");
    assert!(tok.adds_bos());
    assert_eq!(tok.eos_ids(), [fixture.eos_id]);
    for case in &fixture.cases {
        let (Some(hf_ids), Some(hf_decoded)) = (&case.hf_ids, &case.hf_decoded) else {
            panic!("spm.json lacks transformers' ids for {:?}", case.text);
        };
        assert_eq!(
            &tok.encode(&case.text, false).expect("encode"),
            hf_ids,
            "{:?}",
            case.text
        );
        let with_bos = tok.encode(&case.text, true).expect("encode");
        assert_eq!(with_bos.first(), Some(&fixture.bos_id));
        assert_eq!(with_bos.get(1..), Some(hf_ids.as_slice()));
        assert_eq!(&tok.decode(hf_ids, false).expect("decode"), hf_decoded);
        assert_eq!(tok.decode(&case.ids, false).expect("decode"), case.decoded);
        assert_eq!(
            tok.decode(&case.ids, true).expect("decode"),
            case.decoded_skip_special
        );
    }
}

fn write_tokenizer_json(dir: &tempfile::TempDir, json: &Value) -> PathBuf {
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json.to_string()).expect("write tokenizer.json");
    path
}

fn word_level(decoder: Value, vocab: Value) -> Value {
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": decoder,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
}

#[test]
fn unsupported_files_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vocab = json!({"a": 0, "[UNK]": 1});
    let cases = [
        (
            word_level(
                json!({"type": "WordPiece", "prefix": "##", "cleanup": true}),
                vocab.clone(),
            ),
            "WordPiece",
        ),
        (word_level(Value::Null, vocab.clone()), "no decoder"),
        (
            word_level(
                json!({"type": "Sequence", "decoders": [
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
                {"type": "Fuse"}]}),
                vocab,
            ),
            "Strip",
        ),
        (
            word_level(
                json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
                json!({"a": 0, "[UNK]": 1_000_000}),
            ),
            "ids up to",
        ),
    ];
    for (json, expected) in cases {
        let path = write_tokenizer_json(&dir, &json);
        match Tokenizer::from_hf_files(&path, None, None) {
            Err(TokenizerError::UnsupportedHf(message)) => {
                assert!(
                    message.contains(expected),
                    "{message:?} should mention {expected:?}"
                )
            }
            other => panic!(
                "expected UnsupportedHf for {expected}, got {:?}",
                other.map(|t| t.kind().to_string())
            ),
        }
    }
    let missing = dir.path().join("missing.json");
    assert!(matches!(
        Tokenizer::from_hf_files(&missing, None, None),
        Err(TokenizerError::Io { .. })
    ));
    std::fs::write(dir.path().join("bad.json"), "{not json").expect("write");
    assert!(matches!(
        Tokenizer::from_hf_files(&dir.path().join("bad.json"), None, None),
        Err(TokenizerError::Json { .. })
    ));
}
