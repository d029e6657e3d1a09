//! DeepSeek sparse attention (V3.2) against dense latent attention: a
//! token that sees no more positions than the indexer keeps attends to
//! all of them, so there the model is DeepSeek-V3 with the same weights,
//! bit for bit (both absorbed, whose rows are batch-invariant); past the
//! top-k it is not. The transformers comparisons live in
//! `reference_models.rs` and the indexer's own unit test.

mod common;

use common::ids;
use kvant_model::arch::decoder::{DecoderModel, LoadOptions, Logits, MlaPrefill};
use kvant_model::checkpoint::Checkpoint;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    common::fixtures().join("deepseek-v32")
}

/// The fixture with its config.json edited by `edit`, in a temporary dir.
fn variant(edit: impl Fn(&mut Value)) -> tempfile::TempDir {
    common::config_variant(&fixture(), edit)
}

fn logits(path: &Path, prompt: &[u32]) -> (Vec<f32>, usize) {
    let ckpt = Checkpoint::open(path).expect("checkpoint");
    let opts = LoadOptions {
        mla_prefill: MlaPrefill::Absorbed,
        ..LoadOptions::F32
    };
    let m = DecoderModel::load(&ckpt, ckpt.config().expect("config"), opts, None).expect("load");
    let mut cache = m.new_cache(prompt.len()).expect("cache");
    let out = m.forward(prompt, &mut cache, Logits::All).expect("forward");
    (out, m.config().vocab)
}

#[test]
fn within_the_top_k_sparse_attention_is_dense_attention() {
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("reference.json")).expect("reference"),
    )
    .expect("json");
    let prompt = ids(&r["prompt_ids"]);
    let topk = r["indexer"]["topk"].as_u64().expect("topk") as usize;
    assert!(
        prompt.len() > 2 * topk,
        "the prompt must reach past the top-k"
    );
    // The same weights as dense MLA (DeepSeek-V3 ignores the indexer's).
    let dense = variant(|c| {
        c["model_type"] = "deepseek_v3".into();
        c["architectures"] = serde_json::json!(["DeepseekV3ForCausalLM"]);
        c["rope_interleave"] = true.into();
    });
    // DeepSeek-V3.2 with a top-k beyond the prompt: never sparse.
    let wide = variant(|c| c["index_topk"] = 64.into());
    let (sparse, vocab) = logits(&fixture(), &prompt);
    let (dense, _) = logits(dense.path(), &prompt);
    let (wide, _) = logits(wide.path(), &prompt);
    let row = |l: &[f32], t: usize| l[t * vocab..(t + 1) * vocab].to_vec();
    for t in 0..prompt.len() {
        assert_eq!(row(&wide, t), row(&dense, t), "top-k 64, position {t}");
        match t < topk {
            true => assert_eq!(row(&sparse, t), row(&dense, t), "position {t}"),
            false => assert_ne!(row(&sparse, t), row(&dense, t), "position {t}"),
        }
    }
}

/// A decode step reads every position's indexer key but only the top-k
/// latent rows (what `kvant bench` counts against the roofline).
#[test]
fn a_step_reads_the_indexer_keys_and_the_top_k_rows() {
    let ckpt = Checkpoint::open(&fixture()).expect("checkpoint");
    let m = DecoderModel::load(
        &ckpt,
        ckpt.config().expect("config"),
        LoadOptions::F32,
        None,
    )
    .expect("load");
    let (cfg, shape) = (m.config(), m.kv_shape());
    let (ix, mla) = (cfg.indexer.expect("indexer"), cfg.mla.expect("mla"));
    let (latent, index) = (mla.latent_dim() * 4, ix.head_dim * 4);
    assert_eq!(shape.bytes_per_token(), cfg.n_layers * (latent + index));
    for pos in [0, 3, ix.topk - 1, ix.topk, 100] {
        let rows = (pos + 1).min(ix.topk);
        assert_eq!(
            m.kv_bytes_read(pos),
            cfg.n_layers * (latent * rows + index * (pos + 1)),
            "position {pos}"
        );
    }
}
