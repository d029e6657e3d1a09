//! Helpers shared by the model tests: the fixtures, and copies of them
//! whose KV rows are whole 32-value blocks (for the Q8_0/Q4_0 caches).

#![allow(dead_code)] // each test binary uses its own part

use kvant_model::arch::decoder::{DecoderModel, LoadOptions, Logits};
use kvant_model::checkpoint::Checkpoint;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};

/// A copy of the fixture directory `dir` with its config.json edited by
/// `edit`, in a temporary directory.
pub fn config_variant(dir: &Path, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let out = tempfile::tempdir().expect("tempdir");
    for e in std::fs::read_dir(dir).expect("fixture") {
        let p = e.expect("entry").path();
        std::fs::copy(&p, out.path().join(p.file_name().expect("name"))).expect("copy");
    }
    let path = out.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("json");
    edit(&mut cfg);
    std::fs::write(&path, cfg.to_string()).expect("write");
    out
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models")
}

pub fn open(path: &Path, opts: LoadOptions) -> DecoderModel {
    let load = || -> Result<DecoderModel, Box<kvant_model::ModelError>> {
        let ckpt = Checkpoint::open(path)?;
        Ok(DecoderModel::load(&ckpt, ckpt.config()?, opts, None)?)
    };
    load().unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A reference's token id list (`prompt_ids`, `greedy_ids`).
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Greedy decoding straight on the model (the engine crate sits above
/// this one): the prompt in one pass, then one token per pass.
pub fn greedy(m: &DecoderModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache(prompt.len() + n).expect("cache");
    let mut logits = m
        .forward(prompt, &mut cache, Logits::Last)
        .expect("forward");
    let mut out = Vec::new();
    for _ in 0..n {
        let next = logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &l)| if l > b.1 { (i, l) } else { b },
            )
            .0 as u32;
        out.push(next);
        logits = m
            .forward(&[next], &mut cache, Logits::Last)
            .expect("forward");
    }
    out
}

/// A copy of the Hugging Face fixture `name` (`llama-gqa` or
/// `deepseek-v3`) whose KV cache rows are one 32-value block, which the
/// fixtures' 16-value heads and 48-value latent rows are not:
///
/// - `llama-gqa`: the same weights read as 2 query heads and 1 KV head of
///   32 (the projections keep their shapes: 2·32 = 4·16 query rows, 1·32
///   = 2·16 key and value rows);
/// - `deepseek-v3`: `kv_lora_rank` 16 instead of 32, so the latent row is
///   16 + 16 rotary values: `kv_a_proj_with_mqa` keeps its first 16 and
///   its 16 rotary rows, `kv_a_layernorm` its first 16 weights and
///   `kv_b_proj` its first 16 columns.
///
/// Both stay random-weight models of the same kind; only the KV shape
/// changes. `deepseek-v3-dense` is the `deepseek-v3` copy cut to its first
/// layer, the dense one: latent attention without expert routing, whose
/// choices flip under small perturbations and change rows by O(1).
pub fn whole_block_fixture(name: &str) -> tempfile::TempDir {
    let dense = name == "deepseek-v3-dense";
    let name = if dense { "deepseek-v3" } else { name };
    let src = fixtures().join(name);
    let dir = tempfile::tempdir().expect("temp dir");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).expect("copy");
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).expect("config"))
            .expect("json");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("weights");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    match name {
        "llama-gqa" => {
            cfg["head_dim"] = 32.into();
            cfg["num_attention_heads"] = 2.into();
            cfg["num_key_value_heads"] = 1.into();
            for (n, t) in st.tensors() {
                out.push((n, t.shape().to_vec(), t.data().to_vec()));
            }
        }
        "deepseek-v3" => {
            let (old, new, rope) = (32usize, 16usize, 16usize);
            assert_eq!(cfg["kv_lora_rank"], old);
            cfg["kv_lora_rank"] = new.into();
            if dense {
                assert_eq!(cfg["first_k_dense_replace"], 1);
                cfg["num_hidden_layers"] = 1.into();
                cfg["num_nextn_predict_layers"] = 0.into();
            }
            for (n, t) in st.tensors() {
                assert_eq!(t.dtype(), safetensors::Dtype::F32, "{n}");
                let rows = |t: &TensorView<'_>, keep: &[std::ops::Range<usize>]| {
                    let cols = t.shape()[1] * 4;
                    keep.iter()
                        .flat_map(|r| t.data()[r.start * cols..r.end * cols].to_vec())
                        .collect::<Vec<u8>>()
                };
                let (shape, data) = if n.ends_with("kv_a_proj_with_mqa.weight") {
                    let keep = [0..new, old..old + rope];
                    (vec![new + rope, t.shape()[1]], rows(&t, &keep))
                } else if n.ends_with("kv_a_layernorm.weight") {
                    (vec![new], t.data()[..new * 4].to_vec())
                } else if n.ends_with("kv_b_proj.weight") {
                    let data = t
                        .data()
                        .chunks_exact(old * 4)
                        .flat_map(|row| row[..new * 4].to_vec())
                        .collect();
                    (vec![t.shape()[0], new], data)
                } else {
                    (t.shape().to_vec(), t.data().to_vec())
                };
                out.push((n, shape, data));
            }
        }
        _ => panic!("no whole-block variant of {name}"),
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, shape, data)| {
            let v = TensorView::new(safetensors::Dtype::F32, shape.clone(), data).expect("view");
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors"))
        .expect("write weights");
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_vec_pretty(&cfg).expect("json"),
    )
    .expect("write config");
    dir
}

/// `g` written again by [`GgufWriter`]: its metadata and tensors in file
/// order, nothing changed.
pub fn rewritten(g: &kvant_model::gguf::GgufFile) -> Vec<u8> {
    let mut w = kvant_model::gguf::GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add(k, v.clone()).unwrap();
    }
    // The writer borrows the tensors' bytes until it writes.
    let tensors: Vec<_> = g
        .tensor_infos()
        .iter()
        .map(|i| g.tensor(&i.name).unwrap())
        .collect();
    for (info, t) in g.tensor_infos().iter().zip(&tensors) {
        w.add_tensor(info.name.clone(), info.dtype, &info.shape, t.bytes())
            .unwrap();
    }
    w.to_bytes().unwrap()
}
