//! DeepSeek-V3's multi-token-prediction module against the reference
//! (`tools/reference/make_moe_fixtures.py`, transformers' MTP layer on the
//! tiny GigaChat3-shaped checkpoint): each draft row's logits, fed one
//! position at a time through the module's own cache.

mod common;

use common::ids;
use kvant_model::arch::decoder::{DecoderModel, LoadOptions, Logits, MlaPrefill};
use kvant_model::checkpoint::Checkpoint;
use kvant_model::ModelError;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// As the main reference test: f32 throughout, only summation order
/// differs (~1e-5 on logits of magnitude ~5).
const LOGIT_TOL: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn open(name: &str, mtp: bool) -> DecoderModel {
    open_with(name, mtp, MlaPrefill::Auto)
}

fn open_with(name: &str, mtp: bool, mla_prefill: MlaPrefill) -> DecoderModel {
    let ckpt = Checkpoint::open(&fixture(name)).expect("open");
    let opts = LoadOptions {
        mtp,
        mla_prefill,
        ..LoadOptions::F32
    };
    DecoderModel::load(&ckpt, ckpt.config().expect("config"), opts, None).expect("load")
}

/// The MTP rows of `name` (a checkpoint of deepseek-v3's weights) against
/// the reference; returns the largest difference over the rows whose MTP
/// expert choice wins by at least `skip_margin`.
fn mtp_error(name: &str, skip_margin: f64) -> f32 {
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("deepseek-v3").join("reference.json")).expect("ref"),
    )
    .expect("json");
    let m = open(name, true);
    assert!(m.has_mtp(), "{name}");
    let (h, vocab) = (m.config().hidden, m.config().vocab);
    let prompt = ids(&r["prompt_ids"]);
    let mut cache = m.new_cache(prompt.len() + 1).expect("cache");
    let (_, hidden) = m
        .forward_hidden(&prompt, &mut cache, Logits::All)
        .expect("forward");
    let want = r["mtp"]["logits"].as_array().expect("mtp logits");
    let margins: Vec<f64> = r["mtp"]["routing_margins"]
        .as_array()
        .expect("margins")
        .iter()
        .map(|m| m.as_f64().expect("margin"))
        .collect();
    assert_eq!(want.len(), prompt.len() - 1);
    let mut max_err = 0f32;
    for (i, row) in want.iter().enumerate() {
        let got = m
            .mtp_draft(
                &prompt[i + 1..i + 2],
                &hidden[i * h..(i + 1) * h],
                i,
                &mut cache,
            )
            .expect("mtp");
        assert_eq!(got.len(), vocab);
        let mut row_err = 0f32;
        for (g, w) in got.iter().zip(row.as_array().expect("row")) {
            row_err = row_err.max((g - w.as_f64().expect("f") as f32).abs());
        }
        if margins[i] >= skip_margin {
            max_err = max_err.max(row_err);
        }
    }
    eprintln!("{name}: MTP max |Δlogit| {max_err:.2e}");
    // The same rows in one pass give the last row bit for bit, when every
    // chunk runs on the absorbed path (a 12-row chunk from position 0
    // would otherwise run expanded).
    let m = open_with(name, true, MlaPrefill::Absorbed);
    let mut cache = m.new_cache(prompt.len() + 1).expect("cache");
    let (_, hidden) = m
        .forward_hidden(&prompt, &mut cache, Logits::All)
        .expect("forward");
    for (i, t) in prompt[1..].iter().enumerate() {
        m.mtp_draft(&[*t], &hidden[i * h..(i + 1) * h], i, &mut cache)
            .expect("mtp");
    }
    let mut again = m.new_cache(prompt.len() + 1).expect("cache");
    m.forward(&prompt, &mut again, Logits::None)
        .expect("forward");
    let n = prompt.len() - 1;
    let all = m
        .mtp_draft(&prompt[1..], &hidden[..n * h], 0, &mut again)
        .expect("mtp");
    let last = m
        .mtp_draft(&prompt[n..], &hidden[(n - 1) * h..n * h], n - 1, &mut cache)
        .expect("mtp");
    assert_eq!(all, last);
    max_err
}

#[test]
fn mtp_logits_match_the_reference() {
    let err = mtp_error("deepseek-v3", 0.0);
    assert!(err <= LOGIT_TOL, "MTP max |Δlogit| {err}");
}

/// The same weights in llama.cpp's GGUF layout with the MTP layer kept
/// (`blk.4.nextn.*`, `nextn_predict_layers`; made by
/// tools/bench/convert_deepseek_with_mtp.py, Q8_0). Q8_0 rounding of the
/// weights moves the main model's logits by up to 0.25 against the f32
/// reference (tools/reference/README.md); a misread MTP tensor moves these
/// by ≫ 1. The rounding also flips the MTP layer's closest expert choice
/// (row 9, margin 0.0004), so rows decided by less than 0.01 are left out,
/// as in the fast-numerics reference check.
#[test]
fn mtp_loads_from_gguf() {
    let err = mtp_error("mtp/deepseek-v3-mtp.Q8_0.gguf", 0.01);
    assert!(err <= 0.5, "MTP max |Δlogit| {err}");
}

#[test]
fn models_without_mtp_skip_it_cleanly() {
    let m = open("deepseek-v3-qnull", true);
    assert!(!m.has_mtp());
    let mut cache = m.new_cache(4).expect("cache");
    let h = m.config().hidden;
    let err = m.mtp_draft(&[5], &vec![0.0; h], 0, &mut cache).unwrap_err();
    assert!(matches!(err, ModelError::NoMtp), "{err}");
    // Not asked for: not loaded, and the KV cache has no layer for it.
    let m = open("deepseek-v3", false);
    assert!(!m.has_mtp());
    assert_eq!(m.kv_shape().n_layers, m.config().n_layers);
    let with = open("deepseek-v3", true);
    assert_eq!(with.kv_shape().n_layers, with.config().n_layers + 1);
    // Wrongly sized hidden input is a typed error.
    let mut cache = with.new_cache(4).expect("cache");
    let err = with
        .mtp_draft(&[5, 6], &vec![0.0; h], 0, &mut cache)
        .unwrap_err();
    assert!(matches!(err, ModelError::MtpHidden { .. }), "{err}");
}

/// Verifying a draft steps the cache back over it when it is rejected: a
/// model with linear-attention layers (whose state cannot run backwards)
/// refuses `--mtp` with a typed error before reading a weight.
#[test]
fn mtp_on_linear_attention_is_refused() {
    let ckpt = Checkpoint::open(&fixture("qwen3-next")).expect("open");
    let mut cfg = ckpt.config().expect("config");
    cfg.mtp_layers = 1;
    let opts = LoadOptions {
        mtp: true,
        ..LoadOptions::F32
    };
    let r = DecoderModel::load(&ckpt, cfg, opts, None);
    assert!(
        matches!(r, Err(ModelError::MtpUnsupported(_))),
        "{:?}",
        r.err()
    );
}
