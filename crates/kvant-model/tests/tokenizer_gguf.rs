//! Tokenizers built from GGUF metadata against reference ids: SmolLM2's byte-level BPE
//! (pre = "smollm", llama.cpp's split) and a SentencePiece BPE model with byte fallback, both
//! made by tools/reference/make_tokenizer_fixtures.py.

mod tokenizer_fixtures;

use kvant_model::tokenizer::{GgufTokenizerSpec, Tokenizer, TokenizerError};
use tokenizer_fixtures::{fixture, gguf_spec, Fixture};

fn check_cases(tok: &Tokenizer, fixture: &Fixture) {
    for case in &fixture.cases {
        let ids = tok.encode(&case.text, false).expect("encode");
        assert_eq!(ids, case.ids, "ids for {:?}", case.text);
        let decoded = tok.decode(&case.ids, false).expect("decode");
        assert_eq!(decoded, case.decoded, "decode of {:?}", case.text);
        let skipped = tok.decode(&case.ids, true).expect("decode");
        assert_eq!(
            skipped, case.decoded_skip_special,
            "decode (skip special) of {:?}",
            case.text
        );
    }
}

#[test]
fn tokenizers_can_be_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}

#[test]
fn smollm2_matches_reference_ids_and_text() {
    let spec: GgufTokenizerSpec = gguf_spec("smollm2-tokenizer.gguf");
    let fixture: Fixture = fixture("smollm2.json");
    let tok = Tokenizer::from_gguf_spec(&spec).expect("SmolLM2 tokenizer builds");
    assert_eq!(tok.kind(), "byte-level BPE (smollm)");
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(fixture.bos_id));
    assert_eq!(tok.eos_ids(), [fixture.eos_id]);
    assert!(!tok.adds_bos(), "SmolLM2's GGUF sets add_bos_token = false");
    check_cases(&tok, &fixture);
    // Without add_bos/add_eos, asking for special tokens changes nothing.
    let text = "Hello <|im_end|> world";
    assert_eq!(
        tok.encode(text, true).expect("encode"),
        tok.encode(text, false).expect("encode")
    );
    assert_eq!(
        tok.token_to_piece(fixture.eos_id).expect("piece"),
        "<|im_end|>"
    );
    assert_eq!(
        tok.token_to_piece(tok.encode(" the", false).expect("encode")[0])
            .expect("piece"),
        " the"
    );
}

#[test]
fn sentencepiece_matches_sentencepiece_ids_and_adds_bos() {
    let spec: GgufTokenizerSpec = gguf_spec("spm-tokenizer.gguf");
    let fixture: Fixture = fixture("spm.json");
    let tok = Tokenizer::from_gguf_spec(&spec).expect("SentencePiece tokenizer builds");
    assert_eq!(tok.kind(), "SentencePiece BPE");
    assert!(tok.adds_bos());
    assert_eq!(tok.eos_ids(), [fixture.eos_id]);
    check_cases(&tok, &fixture);
    for case in &fixture.cases {
        let with_bos = tok.encode(&case.text, true).expect("encode");
        assert_eq!(with_bos.first(), Some(&fixture.bos_id));
        assert_eq!(with_bos.get(1..), Some(case.ids.as_slice()));
    }
}

/// Without `add_space_prefix` nothing is prepended, so " text" encodes as "text" does with it.
#[test]
fn sentencepiece_without_space_prefix() {
    let spec: GgufTokenizerSpec = gguf_spec("spm-tokenizer.gguf");
    let fixture: Fixture = fixture("spm.json");
    let with = Tokenizer::from_gguf_spec(&spec).expect("builds");
    let without = Tokenizer::from_gguf_spec(&GgufTokenizerSpec {
        add_space_prefix: Some(false),
        ..spec
    })
    .expect("builds");
    for case in fixture
        .cases
        .iter()
        .filter(|c| !c.text.is_empty() && !c.text.contains('<'))
    {
        let ids = without
            .encode(&format!(" {}", case.text), false)
            .expect("encode");
        assert_eq!(
            ids,
            with.encode(&case.text, false).expect("encode"),
            "{:?}",
            case.text
        );
        assert_eq!(
            without.decode(&ids, false).expect("decode"),
            format!(" {}", case.text)
        );
    }
}

#[test]
fn invalid_metadata_is_a_clear_error() {
    let spec: GgufTokenizerSpec = gguf_spec("spm-tokenizer.gguf");
    let n = spec.tokens.len();
    let build = |spec: GgufTokenizerSpec| Tokenizer::from_gguf_spec(&spec).err();

    let err = build(GgufTokenizerSpec {
        model: "bert".into(),
        ..spec.clone()
    });
    assert!(matches!(err, Some(TokenizerError::UnsupportedModel(m)) if m == "bert"));

    let err = build(GgufTokenizerSpec {
        scores: Some(vec![0.0; n - 1]),
        ..spec.clone()
    });
    assert!(
        matches!(err, Some(TokenizerError::InvalidSpec(_))),
        "{err:?}"
    );

    let err = build(GgufTokenizerSpec {
        eos_id: Some(n as u32),
        ..spec.clone()
    });
    assert!(matches!(err, Some(TokenizerError::InvalidSpec(m)) if m.contains("eos_token_id")));

    let mut tokens = spec.tokens.clone();
    tokens[5] = tokens[4].clone();
    let err = build(GgufTokenizerSpec {
        tokens,
        ..spec.clone()
    });
    assert!(matches!(err, Some(TokenizerError::InvalidSpec(m)) if m.contains("twice")));

    let err = build(GgufTokenizerSpec {
        add_bos: Some(true),
        bos_id: None,
        ..spec.clone()
    });
    assert!(matches!(err, Some(TokenizerError::InvalidSpec(m)) if m.contains("bos_token_id")));

    let err = build(GgufTokenizerSpec {
        scores: None,
        ..spec.clone()
    });
    assert!(matches!(err, Some(TokenizerError::InvalidSpec(m)) if m.contains("scores")));

    let err = build(GgufTokenizerSpec {
        tokens: Vec::new(),
        scores: None,
        token_types: None,
        bos_id: None,
        eos_id: None,
        unk_id: None,
        ..spec
    });
    assert!(
        matches!(err, Some(TokenizerError::InvalidSpec(_))),
        "{err:?}"
    );
}

#[test]
fn invalid_byte_level_metadata_is_a_clear_error() {
    let spec: GgufTokenizerSpec = gguf_spec("smollm2-tokenizer.gguf");
    let build = |spec: GgufTokenizerSpec| Tokenizer::from_gguf_spec(&spec).err();

    let err = build(GgufTokenizerSpec {
        pre: Some("no-such-pre".into()),
        ..spec.clone()
    });
    assert!(matches!(err, Some(TokenizerError::UnknownPreTokenizer(p)) if p == "no-such-pre"));

    let err = build(GgufTokenizerSpec {
        merges: None,
        ..spec.clone()
    });
    assert!(matches!(err, Some(TokenizerError::InvalidSpec(m)) if m.contains("merges")));

    let mut merges = spec.merges.clone().unwrap_or_default();
    merges.push("notatoken Ġ".into());
    let err = build(GgufTokenizerSpec {
        merges: Some(merges),
        ..spec
    });
    assert!(matches!(err, Some(TokenizerError::Engine(_))), "{err:?}");
}

#[test]
fn out_of_range_ids_are_errors() {
    let tok = Tokenizer::from_gguf_spec(&gguf_spec("smollm2-tokenizer.gguf")).expect("builds");
    let n = tok.vocab_size() as u32;
    for id in [n, n + 1, u32::MAX] {
        assert!(matches!(
            tok.decode(&[1, id], false),
            Err(TokenizerError::IdOutOfRange { id: bad, vocab_size: 49152 }) if bad == id
        ));
        assert!(tok.token_to_piece(id).is_err());
        assert!(tok.decode_stream(false).step(id).is_err());
    }
}
