//! Hugging Face model directories: single-file and sharded weights, the
//! optional tokenizer/generation/chat-template files, and broken directories
//! (missing or escaping shards, bad JSON, missing files).

mod hostile;

use kvant_core::DType;
use kvant_model::hf::{HfDir, HfError, MAX_SIDE_FILE_LEN};
use safetensors::tensor::{serialize, TensorView};
use safetensors::Dtype;
use std::path::Path;

/// Writes a safetensors file of F32 tensors whose values are `seed + i`.
fn write_st(path: &Path, tensors: &[(&str, &[usize])], seed: f32) {
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|i| (seed + i as f32).to_le_bytes())
                .collect();
            (name.to_string(), shape.to_vec(), bytes)
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.as_str(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, serialize(views, None).unwrap()).unwrap();
}

fn write(dir: &Path, name: &str, contents: &str) {
    std::fs::write(dir.join(name), contents).unwrap();
}

/// A sharded directory: `a` and `b` in shard 1, `c` in shard 2.
fn sharded() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "config.json",
        r#"{"model_type": "llama", "hidden_size": 8}"#,
    );
    write_st(
        &d.join("model-00001-of-00002.safetensors"),
        &[("a", &[2, 3]), ("b", &[5])],
        1.0,
    );
    write_st(
        &d.join("model-00002-of-00002.safetensors"),
        &[("c", &[1, 4])],
        100.0,
    );
    write(
        d,
        "model.safetensors.index.json",
        r#"{"metadata": {"total_size": 60}, "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors"}}"#,
    );
    dir
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[track_caller]
fn expect_err(dir: &Path, needles: &[&str]) -> HfError {
    let opened = |_| "opened a broken directory".to_string();
    hostile::err_naming(HfDir::open(dir), opened, needles)
}

#[test]
fn single_file_with_every_side_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(
        d,
        "config.json",
        r#"{"model_type": "qwen2", "num_hidden_layers": 2}"#,
    );
    write_st(
        &d.join("model.safetensors"),
        &[("w", &[3, 1, 2]), ("v", &[7])],
        -2.5,
    );
    write(d, "tokenizer.json", "{}");
    write(d, "tokenizer_config.json", r#"{"bos_token": "<s>"}"#);
    write(d, "generation_config.json", r#"{"eos_token_id": [1, 2]}"#);
    write(d, "chat_template.jinja", "{{ messages }}✓");
    let h = HfDir::open(d).unwrap();
    assert_eq!(h.dir(), d);
    assert_eq!(h.config()["num_hidden_layers"], 2);
    assert_eq!(h.tensor_names().collect::<Vec<_>>(), ["v", "w"]);
    let w = h.tensor("w").unwrap();
    assert_eq!((w.dtype(), w.shape()), (DType::F32, &[3, 1, 2][..]));
    assert_eq!(f32s(w.bytes()), [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5]);
    // Views of the one mapping, not copies.
    assert_eq!(h.tensor("w").unwrap().bytes().as_ptr(), w.bytes().as_ptr());
    assert_eq!(
        h.tokenizer_json_path(),
        Some(d.join("tokenizer.json").as_path())
    );
    assert_eq!(h.tokenizer_config().unwrap()["bos_token"], "<s>");
    assert_eq!(h.generation_config().unwrap()["eos_token_id"][1], 2);
    assert_eq!(h.chat_template_file(), Some("{{ messages }}✓"));
    let err = h.tensor("missing").unwrap_err();
    assert!(err.to_string().contains("\"missing\""), "{err}");
}

#[test]
fn optional_files_may_be_absent() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", "{}");
    write_st(&dir.path().join("model.safetensors"), &[("w", &[1])], 0.0);
    let h = HfDir::open(dir.path()).unwrap();
    assert!(h.tokenizer_json_path().is_none());
    assert!(h.tokenizer_config().is_none());
    assert!(h.generation_config().is_none());
    assert!(h.chat_template_file().is_none());
}

#[test]
fn sharded_weights_map_each_shard_once() {
    let dir = sharded();
    let h = HfDir::open(dir.path()).unwrap();
    assert_eq!(h.tensor_names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(
        f32s(h.tensor("b").unwrap().bytes()),
        [1.0, 2.0, 3.0, 4.0, 5.0]
    );
    assert_eq!(
        f32s(h.tensor("c").unwrap().bytes()),
        [100.0, 101.0, 102.0, 103.0]
    );
    let (a, b) = (h.tensor("a").unwrap(), h.tensor("b").unwrap());
    // Same shard, same mapping: the two views are 24 bytes apart at most.
    let gap = (b.bytes().as_ptr() as isize - a.bytes().as_ptr() as isize).unsigned_abs();
    assert!(gap <= 24, "a and b lie {gap} bytes apart");
}

#[test]
fn single_file_wins_over_an_index() {
    let dir = sharded();
    write_st(
        &dir.path().join("model.safetensors"),
        &[("only", &[2])],
        0.0,
    );
    write(dir.path(), "model.safetensors.index.json", "not json");
    let h = HfDir::open(dir.path()).unwrap();
    assert_eq!(h.tensor_names().collect::<Vec<_>>(), ["only"]);
}

#[test]
fn broken_indexes() {
    let cases = [
        (
            r#"{"weight_map": {"a": "gone.safetensors"}}"#,
            "gone.safetensors",
        ),
        (
            r#"{"weight_map": {"a": "../model-00001-of-00002.safetensors"}}"#,
            "../",
        ),
        (r#"{"weight_map": {"a": "/etc/passwd"}}"#, "/etc/passwd"),
        (r#"{"weight_map": {"a": 3}}"#, "3"),
        (r#"{"weight_map": {"a": ""}}"#, "shard name"),
        (r#"{"weight_map": []}"#, "weight_map"),
        (r#"{"metadata": {}}"#, "weight_map"),
        (
            r#"{"weight_map": {"c": "model-00001-of-00002.safetensors"}}"#,
            "\"c\"",
        ),
        ("[1, 2", "index.json"),
    ];
    for (index, needle) in cases {
        let dir = sharded();
        write(dir.path(), "model.safetensors.index.json", index);
        let err = expect_err(dir.path(), &[needle]);
        match &err {
            HfError::MissingShard { .. }
            | HfError::BadShardName { .. }
            | HfError::NotAnObject { .. }
            | HfError::NotInShard { .. }
            | HfError::Json { .. } => {}
            other => panic!("{index}: unexpected {other}"),
        }
    }
    // A tensor in two shards is ambiguous.
    let dir = sharded();
    write_st(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &[("c", &[1]), ("a", &[1])],
        0.0,
    );
    let err = expect_err(dir.path(), &["\"a\"", "both"]);
    assert!(matches!(err, HfError::DuplicateTensor { .. }));
    // A shard that is not safetensors.
    let dir = sharded();
    write(dir.path(), "model-00002-of-00002.safetensors", "garbage");
    expect_err(dir.path(), &["model-00002-of-00002.safetensors"]);
}

#[test]
fn broken_directories() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let err = expect_err(d, &["config.json"]);
    assert!(matches!(err, HfError::MissingFile { .. }));
    write(d, "config.json", "{\"a\": ");
    assert!(matches!(
        expect_err(d, &["config.json"]),
        HfError::Json { .. }
    ));
    write(d, "config.json", "[1]");
    assert!(matches!(
        expect_err(d, &["config.json"]),
        HfError::NotAnObject { .. }
    ));
    write(d, "config.json", "{}");
    assert!(matches!(
        expect_err(d, &["model.safetensors"]),
        HfError::NoWeights { .. }
    ));
    write_st(&d.join("model.safetensors"), &[("w", &[1])], 0.0);
    assert!(HfDir::open(d).is_ok());

    write(d, "generation_config.json", "{,}");
    assert!(matches!(
        expect_err(d, &["generation_config.json"]),
        HfError::Json { .. }
    ));
    std::fs::remove_file(d.join("generation_config.json")).unwrap();
    write(d, "tokenizer_config.json", "\"just a string\"");
    assert!(matches!(
        expect_err(d, &["tokenizer_config.json"]),
        HfError::NotAnObject { .. }
    ));
    std::fs::remove_file(d.join("tokenizer_config.json")).unwrap();
    std::fs::write(d.join("chat_template.jinja"), [0xff, 0xfe]).unwrap();
    assert!(matches!(
        expect_err(d, &["chat_template.jinja"]),
        HfError::NotUtf8 { .. }
    ));
    std::fs::remove_file(d.join("chat_template.jinja")).unwrap();

    // An oversized side file is refused rather than read (sparse, so cheap).
    let big = std::fs::File::create(d.join("tokenizer_config.json")).unwrap();
    big.set_len(MAX_SIDE_FILE_LEN + 1).unwrap();
    assert!(matches!(
        expect_err(d, &["tokenizer_config.json"]),
        HfError::FileTooLarge { .. }
    ));
}
