//! Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE):
//! the recurrent state each linear layer keeps equals transformers', a
//! cache goes back to a saved state, and malformed configs are errors.
//! Logits, greedy tokens and perplexity against transformers are in
//! `reference_models.rs`, batch invariance in `batch_invariance.rs`.

mod common;

use common::{fixtures, ids, open};
use kvant_model::arch::decoder::{LoadOptions, Logits};
use kvant_model::config::ModelConfig;
use kvant_model::gguf::{GgufFile, GgufWriter, Value as GgufValue};
use kvant_model::ModelError;
use serde_json::Value;

const HYBRID: [&str; 4] = ["qwen3-next", "qwen3-5", "qwen3-5-moe", "kimi-linear"];

/// f32 states of sums over ~30 tokens of unit-scale terms: transformers'
/// chunked form and kvant's chunk-aligned one round differently by ~1e-6
/// of the state's scale; a wrong decay, gate or head order is ~1e-1.
const STATE_TOL: f32 = 1e-4;

fn rows(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("rows")
        .iter()
        .flat_map(|r| r.as_array().expect("row").iter())
        .map(|x| x.as_f64().expect("value") as f32)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn recurrent_state_after_the_prompt_equals_transformers() {
    for name in HYBRID {
        let dir = fixtures().join(name);
        let r: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let m = open(&dir, LoadOptions::F32);
        let prompt = ids(&r["prompt_ids"]);
        // The prompt in two passes cut mid-chunk: the state is the same.
        for cut in [prompt.len(), 5] {
            let mut cache = m.new_cache(prompt.len()).unwrap();
            m.forward(&prompt[..cut], &mut cache, Logits::None).unwrap();
            if cut < prompt.len() {
                m.forward(&prompt[cut..], &mut cache, Logits::None).unwrap();
            }
            for l in r["linear"].as_array().unwrap() {
                let layer = l["layer"].as_u64().unwrap() as usize;
                let (conv, state) = m.linear_state(&cache, layer).unwrap();
                let (want_conv, want_state) = (rows(&l["conv_tail"]), rows(&l["delta_state"]));
                let scale = want_state.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
                let d = max_diff(&state, &want_state);
                assert!(
                    d <= STATE_TOL * scale,
                    "{name} layer {layer} cut {cut}: state off by {d} (scale {scale})"
                );
                // The tail holds the layer's raw projections: f32 rounding
                // of its input after the layers below (the latent
                // attention and MoE of Kimi Linear's move it most), 1e-5
                // of their scale.
                let cscale = want_conv.iter().fold(1f32, |a, v| a.max(v.abs()));
                let d = max_diff(&conv, &want_conv);
                assert!(
                    d <= 1e-5 * cscale,
                    "{name} layer {layer} cut {cut}: conv tail off by {d}"
                );
            }
            // A full-attention layer has no state.
            assert!(m.linear_state(&cache, 2).is_err());
        }
    }
}

/// A saved state comes back on truncate; any other length goes back to
/// the start, and a forward pass from there gives the same logits.
#[test]
fn a_cache_rewinds_to_its_saved_state_or_to_the_start() {
    let m = open(&fixtures().join("qwen3-next"), LoadOptions::F32);
    let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 300).collect();
    let mut cache = m.new_cache(64).unwrap();
    m.forward(&ids[..20], &mut cache, Logits::None).unwrap();
    cache.save_state();
    let first = m.forward(&ids[20..], &mut cache, Logits::All).unwrap();
    cache.truncate(25);
    assert_eq!(cache.len(), 20, "back to the saved state");
    assert_eq!(
        m.forward(&ids[20..], &mut cache, Logits::All).unwrap(),
        first
    );
    cache.truncate(10);
    assert_eq!(cache.len(), 0, "before the saved state: the start");
    let all = m.forward(&ids, &mut cache, Logits::All).unwrap();
    let vocab = m.config().vocab;
    assert_eq!(&all[20 * vocab..], &first[..]);
}

#[test]
fn malformed_linear_configs_are_errors() {
    let base: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3-next/config.json")).unwrap(),
    )
    .unwrap();
    let with = |key: &str, v: Value| {
        let mut c = base.clone();
        c[key] = v;
        ModelConfig::from_hf_json(&c)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    assert!(with("linear_num_value_heads", 3.into()).contains("not a multiple"));
    assert!(with("linear_conv_kernel_dim", 1.into()).contains("linear_conv_kernel_dim"));
    assert!(with("layer_types", serde_json::json!(["linear_attention"])).contains("layer_types"));
    assert!(with("layer_types", serde_json::json!(["x", "x", "x", "x"])).contains("neither"));
    assert!(with("linear_key_head_dim", 0.into()).contains("linear_key_head_dim"));
    let mut c = base.clone();
    c.as_object_mut().unwrap().remove("layer_types");
    assert!(ModelConfig::from_hf_json(&c)
        .unwrap_err()
        .to_string()
        .contains("layer_types"));
    // Qwen3.5's published spelling: the text model inside `text_config`.
    let text: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen3-5/config.json")).unwrap(),
    )
    .unwrap();
    let nested = serde_json::json!({"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": false});
    let c = ModelConfig::from_hf_json(&nested).unwrap();
    assert_eq!(c.linear.unwrap().layers, [true, true, false, true]);
}

/// llama.cpp's metadata for the hybrids, bent one key at a time: each is a
/// config error naming the key (the tensors are not needed to see it).
#[test]
fn malformed_gguf_linear_metadata_is_an_error() {
    let g = GgufFile::open(&fixtures().join("gguf/qwen3-5.F32.gguf")).unwrap();
    let with = |key: &str, v: Option<GgufValue>| -> Result<ModelConfig, String> {
        let mut w = GgufWriter::new();
        for (k, old) in g.metadata() {
            match (k == key, &v) {
                (true, Some(new)) => w.add(k, new.clone()).unwrap(),
                (true, None) => {}
                (false, _) => w.add(k, old.clone()).unwrap(),
            }
        }
        let file = GgufFile::from_storage(kvant_core::Storage::Owned(w.to_bytes().unwrap().into()))
            .unwrap();
        ModelConfig::from_gguf(&file).map_err(|e| ModelError::from(e).to_string())
    };
    let cfg = with("", None).expect("the fixture's own metadata");
    let lc = cfg.linear.as_ref().expect("linear layers");
    assert_eq!(lc.layers, [true, true, false, true]);
    assert_eq!(
        (lc.k_dim, lc.v_dim, lc.n_k_heads, lc.n_v_heads),
        (16, 8, 2, 4)
    );
    let err = |key: &str, v: Option<GgufValue>| with(key, v).unwrap_err();
    assert!(err("qwen35.ssm.inner_size", Some(GgufValue::U32(30))).contains("inner_size"));
    assert!(err("qwen35.ssm.group_count", Some(GgufValue::U32(3))).contains("not a multiple"));
    assert!(err("qwen35.ssm.conv_kernel", Some(GgufValue::U32(1))).contains("conv_kernel"));
    assert!(err("qwen35.ssm.state_size", None).contains("qwen35.ssm.state_size"));
    let short = GgufValue::Array(vec![true, false].into());
    assert!(err("qwen35.attention.recurrent_layers", Some(short)).contains("layer_types"));
    // Without the per-layer list, every fourth layer is full attention.
    let cfg = with("qwen35.attention.recurrent_layers", None).unwrap();
    assert_eq!(cfg.linear.unwrap().layers, [true, true, true, false]);
}

/// Kimi Linear's published spelling (`linear_attn_config` with 1-based
/// layer lists, `first_k_dense_replace`) reads as transformers' does, and
/// bent lists are errors naming the key.
#[test]
fn kimi_linear_configs_in_both_spellings() {
    let base: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("kimi-linear/config.json")).unwrap(),
    )
    .unwrap();
    let want = ModelConfig::from_hf_json(&base).unwrap();
    let mut published = base.clone();
    let obj = published.as_object_mut().unwrap();
    for k in [
        "layer_types",
        "mlp_layer_types",
        "linear_num_heads",
        "linear_head_dim",
        "linear_conv_kernel_dim",
    ] {
        obj.remove(k);
    }
    obj.insert(
        "linear_attn_config".into(),
        serde_json::json!({"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 4,
                           "head_dim": 16, "short_conv_kernel_size": 4}),
    );
    obj.insert("first_k_dense_replace".into(), 1.into());
    let got = ModelConfig::from_hf_json(&published).unwrap();
    assert_eq!(got.linear, want.linear);
    assert_eq!(
        got.experts.as_ref().unwrap().layers,
        want.experts.as_ref().unwrap().layers
    );
    assert!(want.rope.nope && want.inv_freq(2, None).iter().all(|&f| f == 0.0));
    let with = |key: &str, v: Value| {
        let mut c = published.clone();
        c["linear_attn_config"][key] = v;
        ModelConfig::from_hf_json(&c).unwrap_err().to_string()
    };
    assert!(with("full_attn_layers", serde_json::json!([2, 3])).contains("exactly one"));
    assert!(with("kda_layers", serde_json::json!([0, 1, 2, 4])).contains("kda_layers"));
    let mut c = base.clone();
    c["mlp_layer_types"] = serde_json::json!(["dense", "sparse"]);
    assert!(ModelConfig::from_hf_json(&c)
        .unwrap_err()
        .to_string()
        .contains("mlp_layer_types"));
}
