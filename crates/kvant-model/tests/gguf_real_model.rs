//! The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) opens with the
//! expected metadata and tensors, and GgufWriter rewrites it byte for byte.
//!
//! Needs `KVANT_MODEL` (path to the .gguf; `cargo run -p kvant -- fetch`
//! downloads it). With `KVANT_SKIP_REAL_MODEL=1` the tests are skipped.

mod common;

use kvant_core::DType;
use kvant_model::gguf::GgufFile;
use std::collections::BTreeMap;
use std::path::PathBuf;

fn real_model() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KVANT_MODEL") {
        return Some(PathBuf::from(path));
    }
    if std::env::var("KVANT_SKIP_REAL_MODEL").as_deref() == Ok("1") {
        eprintln!("skipped: KVANT_SKIP_REAL_MODEL=1 and KVANT_MODEL is unset");
        return None;
    }
    panic!(
        "set KVANT_MODEL to the SmolLM2-135M-Instruct Q4_1 GGUF (get it with `cargo run -p kvant -- fetch`), \
         or KVANT_SKIP_REAL_MODEL=1 to skip"
    );
}

#[test]
fn default_model_metadata_and_tensors() {
    let Some(path) = real_model() else { return };
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(g.alignment(), 32);
    let u = |k: &str| g.get_usize(k).unwrap().unwrap();
    assert_eq!(u("llama.block_count"), 30);
    assert_eq!(u("llama.context_length"), 8192);
    assert_eq!(u("llama.embedding_length"), 576);
    assert_eq!(u("llama.feed_forward_length"), 1536);
    assert_eq!(u("llama.attention.head_count"), 9);
    assert_eq!(u("llama.attention.head_count_kv"), 3);
    assert_eq!(u("llama.rope.dimension_count"), 64);
    assert_eq!(u("tokenizer.ggml.bos_token_id"), 1);
    assert_eq!(u("tokenizer.ggml.eos_token_id"), 2);
    assert_eq!(g.get_f32("llama.rope.freq_base").unwrap(), Some(100_000.0));
    assert_eq!(
        g.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        Some(1e-5)
    );
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), Some("smollm"));
    assert_eq!(
        g.get_bool("tokenizer.ggml.add_bos_token").unwrap(),
        Some(false)
    );
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(tokens.get(1).map(String::as_str), Some("<|im_start|>"));
    assert_eq!(
        g.get_i32_array("tokenizer.ggml.token_type")
            .unwrap()
            .unwrap()
            .len(),
        49152
    );
    assert_eq!(
        g.get_str_array("tokenizer.ggml.merges")
            .unwrap()
            .unwrap()
            .len(),
        48900
    );
    assert!(g
        .get_str("tokenizer.chat_template")
        .unwrap()
        .unwrap()
        .contains("<|im_start|>"));

    assert_eq!(g.tensor_infos().len(), 272);
    let mut by_type: BTreeMap<&str, usize> = BTreeMap::new();
    for info in g.tensor_infos() {
        *by_type.entry(info.dtype.name()).or_default() += 1;
        let t = g.tensor(&info.name).unwrap();
        assert_eq!(t.byte_len(), info.byte_len, "{}", info.name);
    }
    assert_eq!(
        by_type,
        BTreeMap::from([("F32", 61), ("Q4_1", 210), ("Q8_0", 1)])
    );
    let embd = g.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.dtype(), embd.shape()),
        (DType::Q8_0, &[49152, 576][..])
    );
    let down = g.tensor("blk.0.ffn_down.weight").unwrap();
    assert_eq!(
        (down.dtype(), down.shape()),
        (DType::Q4_1, &[576, 1536][..])
    );
    // Tied embeddings: no separate output matrix.
    assert!(g.tensor_info("output.weight").is_none());
    let err = g.tensor("output.weight").unwrap_err();
    assert!(err.to_string().contains("output.weight"), "{err}");
    let params: u64 = g.tensor_infos().iter().map(|t| t.elements()).sum();
    assert_eq!(params, 134_515_008);
}

#[test]
fn writer_reproduces_the_default_model_byte_for_byte() {
    let Some(path) = real_model() else { return };
    let g = GgufFile::open(&path).unwrap();
    let written = common::rewritten(&g);
    let original = std::fs::read(&path).unwrap();
    assert_eq!(written.len(), original.len());
    assert!(
        written == original,
        "rewritten file differs from the original"
    );
}
