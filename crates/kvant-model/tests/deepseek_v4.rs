//! DeepSeek-V4 beyond the transformers comparison (`reference_models.rs`)
//! and batch invariance (`batch_invariance.rs`): the published config keys
//! give the same model as transformers 5's, the SwiGLU clamp is live, and
//! malformed checkpoints are errors, not panics or wrong outputs.

mod common;

use common::{fixtures, ids};
use kvant_model::arch::decoder::{DecoderModel, LoadOptions, Logits};
use kvant_model::checkpoint::Checkpoint;
use kvant_model::ModelError;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    fixtures().join("deepseek-v4")
}

/// The fixture with its config.json edited by `edit`, in a temporary dir.
fn variant(edit: impl Fn(&mut Value)) -> tempfile::TempDir {
    common::config_variant(&fixture(), edit)
}

fn load(path: &Path) -> Result<DecoderModel, Box<ModelError>> {
    let ckpt = Checkpoint::open(path)?;
    Ok(DecoderModel::load(
        &ckpt,
        ckpt.config()?,
        LoadOptions::F32,
        None,
    )?)
}

fn prompt() -> Vec<u32> {
    let r: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("reference.json")).expect("reference"),
    )
    .expect("json");
    ids(&r["prompt_ids"])
}

fn logits(path: &Path) -> Vec<f32> {
    let m = load(path).expect("load");
    let p = prompt();
    let mut cache = m.new_cache(p.len()).expect("cache");
    m.forward(&p, &mut cache, Logits::All).expect("forward")
}

/// DeepSeek's published configs say `compress_ratios` per layer (0, 4,
/// 128, with `compress_rate_hca` overriding HCA's rate as transformers
/// folds it), `num_hash_layers`, `qk_rope_head_dim`, `rope_theta`,
/// `compress_rope_theta` and a top-level `rope_scaling` for the compressed
/// layers: the same model, bit for bit.
#[test]
fn the_published_config_keys_give_the_same_model() {
    let published = variant(|c| {
        let o = c.as_object_mut().expect("object");
        for k in [
            "layer_types",
            "compress_rates",
            "mlp_layer_types",
            "rope_parameters",
            "partial_rotary_factor",
        ] {
            o.remove(k);
        }
        o.insert("compress_ratios".into(), json!([0, 4, 128, 4]));
        o.insert("compress_rate_hca".into(), json!(8));
        o.insert("num_hash_layers".into(), json!(1));
        o.insert("qk_rope_head_dim".into(), json!(8));
        o.insert(
            "rope_scaling".into(),
            json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                   "beta_fast": 32.0, "beta_slow": 1.0}),
        );
    });
    assert!(logits(published.path()) == logits(&fixture()));
}

/// Every SwiGLU is clamped (routed and shared experts, as transformers,
/// DeepSeek's reference and llama.cpp's converter all do): the fixture's
/// limit of 1.5 clips about 17% of the gate and up values, so lifting it
/// changes the logits.
#[test]
fn the_swiglu_clamp_is_live() {
    let unclamped = variant(|c| c["swiglu_limit"] = json!(1e6));
    let (a, b) = (logits(&fixture()), logits(unclamped.path()));
    let moved = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(moved > 0.1, "lifting the clamp moved logits by {moved}");
}

/// Configs a forward could not run are errors naming the key.
#[test]
fn malformed_configs_are_errors() {
    type Edit = fn(&mut Value);
    let bad: [(&str, Edit); 7] = [
        ("compress_rates", |c| {
            c["compress_rates"]["compressed_sparse_attention"] = json!(3)
        }),
        ("hc_mult", |c| c["hc_mult"] = json!(0)),
        ("o_groups", |c| c["o_groups"] = json!(3)),
        ("layer_types", |c| {
            c["layer_types"] = json!(["sliding_attention", "full_attention", "x", "y"])
        }),
        ("layer_types", |c| {
            c["layer_types"] = json!(["sliding_attention"])
        }),
        ("mlp_layer_types", |c| {
            c["mlp_layer_types"] = json!(["hash_moe", "dense", "moe", "moe"])
        }),
        ("qk_rope_head_dim", |c| {
            let o = c.as_object_mut().expect("object");
            o.remove("partial_rotary_factor");
            o.insert("qk_rope_head_dim".into(), json!(7));
        }),
    ];
    for (key, edit) in bad {
        let dir = variant(edit);
        let err = load(dir.path())
            .err()
            .unwrap_or_else(|| panic!("{key}: loaded"));
        assert!(err.to_string().contains(key), "{key}: {err}");
    }
}

/// A layer routed by a table needs the table, a layer routed by scores
/// has none, and the table's experts exist.
#[test]
fn hash_tables_must_match_the_config_and_the_experts() {
    // The config says layer 1 is hash-routed; its checkpoint has no table.
    let dir = variant(|c| c["mlp_layer_types"] = json!(["hash_moe", "hash_moe", "moe", "moe"]));
    let err = load(dir.path()).err().expect("loaded");
    assert!(err.to_string().contains("tid2eid"), "{err}");
    // Layer 0's table names expert 99 of 8.
    let dir = variant(|_| {});
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let name = "model.layers.0.ffn.gate.tid2eid";
    let mut table = st.tensor(name).expect("table").data().to_vec();
    table[..8].copy_from_slice(&99i64.to_le_bytes());
    let mut views: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != name)
        .collect();
    let t = st.tensor(name).expect("table");
    views.push((
        name.into(),
        TensorView::new(t.dtype(), t.shape().to_vec(), &table).expect("view"),
    ));
    safetensors::serialize_to_file(views, None, &path).expect("write");
    let err = load(dir.path()).err().expect("loaded");
    assert!(err.to_string().contains("expert id 99"), "{err}");
}

/// Compressed entries sit in the block of their window's last token, so a
/// block must hold whole windows (or a window whole blocks).
#[test]
fn pools_whose_blocks_split_windows_are_refused() {
    let m = load(&fixture()).expect("load");
    assert!(matches!(
        m.new_pool(6, 8, 2),
        Err(ModelError::KvBlockSize {
            block_size: 6,
            compress: 4
        })
    ));
    assert!(m.new_pool(8, 8, 2).is_ok() && m.new_pool(2, 8, 2).is_ok());
}

/// DeepSeek-V4-Flash's cache (transformers' `DeepseekV4Config` defaults:
/// 43 layers, 20 CSA and 23 HCA, head 512, indexer keys 128, window
/// 128) against what the same 43 layers would cache as DeepSeek-V3.2
/// (latent 512 + rope 64 and an indexer key of 128 per token and layer)
/// and as dense latent attention (V3: the latent only), all in f16, per
/// sequence at 4k, 32k and 128k tokens, as kvant lays them out: V4's
/// entries per layer at its own rate (a quarter of a 640-value row per
/// token in CSA layers, 1/128 of a 512-value row in HCA layers), its
/// window rings and compressor tails in f32 state slots.
#[test]
fn v4_flash_caches_a_fraction_of_latent_attention_at_long_context() {
    use kvant_model::config::ModelConfig;
    use kvant_model::kv::{EntryShape, KvDType, KvShape, StateShape};
    let cfg = ModelConfig::from_hf_json(&json!({
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096,
        "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "q_lora_rank": 1024, "o_lora_rank": 1024,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
        "max_position_embeddings": 1048576,
    }))
    .expect("V4-Flash config");
    let v4 = cfg.v4.as_ref().expect("V4");
    let per_token = EntryShape::deepseek_v4(v4, cfg.head_dim, 43).bytes_per_token(KvDType::F16);
    let state = StateShape::deepseek_v4(v4, cfg.head_dim, 43).bytes_per_slot();
    let latent = |index_dim| KvShape {
        n_layers: 43,
        n_kv_heads: 1,
        head_dim: 576,
        latent: true,
        index_dim,
        dtype: KvDType::F16,
    };
    let (v32, mla) = (latent(128).bytes_per_token(), latent(0).bytes_per_token());
    let csa = v4
        .layers
        .iter()
        .filter(|l| **l == kvant_model::config::V4Attention::Csa)
        .count();
    eprintln!(
        "V4-Flash: {csa} CSA, {} HCA layers; state {state} B per sequence",
        43 - csa
    );
    eprintln!("tokens    V4                 V3.2-style         dense MLA");
    for n in [4096usize, 32768, 131072] {
        let v4_bytes = n * per_token + state;
        let mb = |b: usize| b as f64 / 1e6;
        eprintln!(
            "{n:>6}  {:>8.1} MB {:>5} B/t  {:>8.1} MB {:>5} B/t  {:>8.1} MB {:>5} B/t",
            mb(v4_bytes),
            v4_bytes / n,
            mb(n * v32),
            v32,
            mb(n * mla),
            mla
        );
        assert!(v4_bytes < n * mla && mla < v32, "{n} tokens");
    }
    // Rows per token: 20 layers × 1280 / 4 + 23 × 1024 / 128.
    assert_eq!(per_token, 20 * 320 + 23 * 8);
    let n = 131072;
    let ratio = (n * mla) as f64 / (n * per_token + state) as f64;
    assert!(ratio > 6.0, "dense MLA / V4 at 128k: {ratio}");
}

/// DeepSeek-V4's multi-token-prediction module (`deepseek-v4-mtp`:
/// tools/reference/make_v4_mtp_fixture.py; an HCA block, so the module
/// keeps a ring, a compressor tail and compressed entries) against
/// DeepSeek's `MTPBlock` computed from transformers' parts. Fed one
/// position per pass (the module's caches carried across passes), and the
/// prompt in one pass: the same last row, bit for bit.
#[test]
fn v4_mtp_logits_match_the_reference() {
    let dir = fixtures().join("deepseek-v4-mtp");
    let ckpt = Checkpoint::open(&dir).expect("open");
    let opts = LoadOptions {
        mtp: true,
        ..LoadOptions::F32
    };
    let m = DecoderModel::load(&ckpt, ckpt.config().expect("config"), opts, None).expect("load");
    // The main model's f32 logits sit within 1e-5 of transformers'; the
    // module adds one more block over its streams, summed in another
    // order: 1e-4 is ten times the main model's error, and a wrong
    // position, window or stream moves logits by 1e-1 or more.
    check_mtp(
        &m,
        &reference(&dir.join("reference.json")),
        1e-4,
        "safetensors",
    );
}

/// The same module as llama.cpp's converter writes it with `--mtp`: a
/// GGUF of its own beside the main model's (`make_v4_mtp_fixture.py
/// --converter`), `e_proj`/`h_proj` fused into a Q8_0 `eh_proj`; its
/// reference takes them dequantized from that tensor.
#[test]
fn v4_mtp_from_llama_cpp_s_separate_gguf() {
    let dir = fixtures().join("gguf");
    let main = Checkpoint::open(&dir.join("deepseek-v4.F32.gguf")).expect("open");
    let drafter = Checkpoint::open(&dir.join("mtp-deepseek-v4.F32.gguf")).expect("open");
    let cfg = main.config().expect("config");
    assert_eq!(cfg.mtp_layers, 0, "the main file holds no module");
    let m = DecoderModel::load_with_drafter(&main, Some(&drafter), cfg, LoadOptions::F32, None)
        .expect("load");
    assert_eq!(m.config().mtp_layers, 1);
    // As the safetensors module (same tolerance and reasons): the Q8_0
    // projection moves these logits by up to 3e-2 from the float one's,
    // so a module that ignored the stored encoding would fail here.
    let r = reference(&dir.join("mtp-deepseek-v4.F32.reference.json"));
    check_mtp(&m, &r, 1e-4, "GGUF --mtp");
    // The module's file alone is no model, and says so.
    let alone = DecoderModel::load(
        &drafter,
        drafter.config().expect("config"),
        LoadOptions::F32,
        None,
    );
    assert!(
        matches!(alone, Err(ModelError::OnlyMtp)),
        "{:?}",
        alone.err()
    );
    // The main file itself, or another model's, is no MTP file.
    let other = Checkpoint::open(&dir.join("deepseek-v32.Q8_0.gguf")).expect("open");
    for d in [&main, &other] {
        let cfg = main.config().expect("config");
        let err =
            DecoderModel::load_with_drafter(&main, Some(d), cfg, LoadOptions::F32, None).err();
        assert!(matches!(err, Some(ModelError::MtpFile(_))), "{err:?}");
    }
}

fn reference(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("reference")).expect("json")
}

/// The module's logits against `r["mtp"]`: fed one position per pass
/// (its caches carried across passes), then the prompt in one pass (the
/// same last row, bit for bit); a hidden row of the wrong width is a typed
/// error.
fn check_mtp(m: &DecoderModel, r: &Value, tol: f32, label: &str) {
    assert!(m.has_mtp());
    let (hw, vocab) = (m.hidden_width(), m.config().vocab);
    assert_eq!(hw, 3 * m.config().hidden);
    let prompt = ids(&r["prompt_ids"]);
    let n = prompt.len() - 1;
    let mut cache = m.new_cache(prompt.len() + 1).expect("cache");
    let (_, hidden) = m
        .forward_hidden(&prompt, &mut cache, Logits::All)
        .expect("forward");
    assert_eq!(hidden.len(), prompt.len() * hw);
    let want = r["mtp"]["logits"].as_array().expect("mtp logits");
    assert_eq!(want.len(), n);
    let (mut max_err, mut argmax_same) = (0f32, 0);
    let mut last = Vec::new();
    for (i, row) in want.iter().enumerate() {
        last = m
            .mtp_draft(
                &prompt[i + 1..i + 2],
                &hidden[i * hw..(i + 1) * hw],
                i,
                &mut cache,
            )
            .expect("mtp");
        assert_eq!(last.len(), vocab);
        let row: Vec<f32> = row
            .as_array()
            .expect("row")
            .iter()
            .map(|v| v.as_f64().expect("f") as f32)
            .collect();
        for (g, w) in last.iter().zip(&row) {
            max_err = max_err.max((g - w).abs());
        }
        let top = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b]));
        argmax_same += usize::from(top(&last) == top(&row));
    }
    eprintln!(
        "deepseek-v4 MTP ({label}): max |Δlogit| {max_err:.2e}, argmax equal at {argmax_same}/{n}"
    );
    assert!(max_err < tol, "{label}: {max_err}");
    assert_eq!(argmax_same, n, "{label}");
    let mut again = m.new_cache(prompt.len() + 1).expect("cache");
    m.forward(&prompt, &mut again, Logits::None)
        .expect("forward");
    let all = m
        .mtp_draft(&prompt[1..], &hidden[..n * hw], 0, &mut again)
        .expect("mtp");
    assert_eq!(all, last, "{label}");
    let short = m.mtp_draft(&prompt[1..2], &hidden[..hw - 1], 0, &mut again);
    assert!(
        matches!(short, Err(ModelError::MtpHidden { .. })),
        "{short:?}"
    );
}

/// The FP8/FP4 fixture (`tools/reference/make_v4_fp8_fixture.py`) is read
/// as stored: its linears as e4m3 rows with their block scales, its experts
/// as MXFP4 blocks, never widened (its logits against transformers are in
/// `reference_models.rs`).
#[test]
fn fp8_and_fp4_weights_stay_as_stored() {
    use kvant_core::DType;
    use kvant_model::hf::HfDir;
    let dir = fixtures().join("deepseek-v4-fp8");
    let hf = HfDir::open(&dir).expect("open");
    for (name, dtype) in [
        ("model.layers.1.attn.wq_a.weight", DType::F8_B128),
        ("model.layers.2.attn.wkv.weight", DType::F8_B128),
        ("model.layers.1.attn.indexer.wq_b.weight", DType::F8_B128),
        // An f32 `weight_scale_inv` instead of an e8m0 `.scale`.
        (
            "model.layers.0.ffn.shared_experts.w2.weight",
            DType::F8_B128,
        ),
        ("model.layers.3.ffn.experts.5.w2.weight", DType::MXFP4),
        ("model.layers.1.attn.compressor.wkv.weight", DType::F32),
    ] {
        assert_eq!(hf.tensor(name).expect(name).dtype(), dtype, "{name}");
    }
    // Every stored weight's values as f32 would take this many bytes.
    let f32_bytes: usize = hf
        .tensor_names()
        .filter(|n| !n.ends_with(".scale") && !n.ends_with("_scale_inv") && !n.ends_with("tid2eid"))
        .map(|n| 4 * hf.tensor(n).expect(n).shape().iter().product::<usize>())
        .sum();
    for opts in [LoadOptions::F32, LoadOptions::default()] {
        let ckpt = Checkpoint::open(&dir).expect("open");
        let m =
            DecoderModel::load(&ckpt, ckpt.config().expect("config"), opts, None).expect("load");
        // FP4 experts (0.53 bytes a weight), FP8 linears (1.03) and f32
        // rest: about a quarter of f32; experts widened would be 0.9.
        let ratio = m.total_weight_bytes() as f64 / f32_bytes as f64;
        assert!(ratio < 0.35, "{ratio}");
    }
}

/// FP8 weights without their scales, or with a scale grid of another
/// shape, are typed errors naming the tensor.
#[test]
fn malformed_block_scaled_weights_are_errors() {
    let src = fixtures().join("deepseek-v4-fp8");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let target = "model.layers.1.attn.wo_b";
    let scale = format!("{target}.scale");
    let one = [127u8];
    // wo_b is 128×128: its grid is [1, 1]; [1, 1, 1] is another shape.
    for (grid, want) in [(None, "block scales"), (Some(vec![1, 1, 1]), "grid")] {
        let dir = tempfile::tempdir().expect("tmp");
        for f in std::fs::read_dir(&src).expect("dir") {
            let f = f.expect("entry").path();
            std::fs::copy(&f, dir.path().join(f.file_name().expect("name"))).expect("copy");
        }
        let mut views: Vec<(String, TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| *n != scale)
            .collect();
        if let Some(shape) = grid {
            let view = TensorView::new(safetensors::Dtype::F8_E8M0, shape, &one).expect("view");
            views.push((scale.clone(), view));
        }
        let path = dir.path().join("model.safetensors");
        safetensors::serialize_to_file(views, None, &path).expect("write");
        let err = load(dir.path()).err().expect("loaded");
        let msg = err.to_string();
        assert!(msg.contains(target) && msg.contains(want), "{msg}");
    }
}
