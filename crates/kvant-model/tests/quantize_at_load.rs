//! Quantization at load (`LoadOptions::quantize`): a Hugging Face f32
//! checkpoint quantized while loading runs the very weights that gguf-py's
//! quantizer (ggml's reference rounding) writes into the GGUF fixtures made
//! from it, so its logits match that GGUF's; and a mixture of experts
//! quantizes its experts too.

mod common;

use common::{fixtures, open};
use kvant_core::DType;
use kvant_model::arch::decoder::{LoadOptions, Logits};

fn logits(m: &kvant_model::arch::decoder::DecoderModel, prompt: &[u32]) -> Vec<f32> {
    let mut cache = m.new_cache(prompt.len()).expect("cache");
    m.forward(prompt, &mut cache, Logits::All).expect("forward")
}

/// The largest absolute difference between two logits vectors.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

const PROMPT: [u32; 9] = [1, 17, 203, 5, 99, 64, 250, 3, 42];

/// The same bytes, the same kernels: the logits agree to f32 reassociation
/// (the two loaders order q/k rows differently, which changes no value).
#[test]
fn hf_quantized_at_load_matches_the_gguf_of_the_same_weights() {
    for (q, file) in [
        (DType::Q8_0, "llama-gqa.Q8_0.gguf"),
        (DType::Q4_0, "llama-gqa.Q4_0.gguf"),
    ] {
        for int8 in [false, true] {
            let opts = LoadOptions {
                int8_activations: int8,
                ..LoadOptions::F32
            };
            let isq = open(
                &fixtures().join("llama-gqa"),
                LoadOptions {
                    quantize: Some(q),
                    ..opts
                },
            );
            let gguf = open(&fixtures().join("gguf").join(file), opts);
            let f32_model = open(&fixtures().join("llama-gqa"), opts);
            let (a, b, exact) = (
                logits(&isq, &PROMPT),
                logits(&gguf, &PROMPT),
                logits(&f32_model, &PROMPT),
            );
            let diff = max_diff(&a, &b);
            let moved = max_diff(&a, &exact);
            assert!(
                diff <= 1e-4,
                "{q:?} int8 {int8}: ISQ vs GGUF differ by {diff}"
            );
            assert!(moved > 1e-4, "{q:?}: quantizing changed nothing ({moved})");
        }
    }
}

/// Experts are weight matrices like any other: a MoE checkpoint quantized
/// at load keeps its logits close to the f32 model's and holds no f32
/// expert. Q4_K on this fixture's 64-value rows is Q5_0 throughout (the
/// fallback), its own kernels.
#[test]
fn moe_experts_quantize_too() {
    let path = fixtures().join("mixtral-moe");
    let f32_model = open(&path, LoadOptions::F32);
    let b = logits(&f32_model, &PROMPT);
    let scale = b.iter().map(|x| x.abs()).fold(0f32, f32::max);
    // Q8_0 rounds each weight by at most half a step of max|block|/127,
    // Q5_0 of max|block|/16, eight times coarser: measured 3.0% and 29% of
    // the logits' scale through this random model's two layers.
    for (q, tol, shrink) in [(DType::Q8_0, 0.05, 3), (DType::Q4_K, 0.5, 5)] {
        let quantized = open(
            &path,
            LoadOptions {
                quantize: Some(q),
                ..LoadOptions::F32
            },
        );
        let a = logits(&quantized, &PROMPT);
        let diff = max_diff(&a, &b);
        eprintln!("{q:?}: max |Δlogit| {:.4} of the scale", diff / scale);
        assert!(
            diff > 0.0 && diff < tol * scale,
            "{q:?}: diff {diff}, scale {scale}"
        );
        assert!(
            quantized.total_weight_bytes() < f32_model.total_weight_bytes() / shrink,
            "{q:?}: {} vs {}",
            quantized.total_weight_bytes(),
            f32_model.total_weight_bytes()
        );
    }
}

/// `quantize_gguf` on the f32 GGUF fixture writes, tensor for tensor, the
/// bytes gguf-py's quantizer wrote into the Q8_0 and Q4_0 fixtures of the
/// same weights, with the file type set; the file loads.
#[test]
fn requantized_gguf_matches_gguf_py() {
    use kvant_model::gguf::{GgufFile, Value};
    let dir = tempfile::tempdir().expect("a temp dir");
    let src = fixtures().join("gguf/llama-gqa.F32.gguf");
    for (q, file, ftype) in [
        (DType::Q8_0, "llama-gqa.Q8_0.gguf", 7),
        (DType::Q4_0, "llama-gqa.Q4_0.gguf", 2),
    ] {
        let dst = dir.path().join(file);
        let mut calls = 0;
        let report = kvant_model::quantize::quantize_gguf(&src, &dst, q, |_, _| calls += 1)
            .expect("quantizes");
        let (ours, theirs) = (
            GgufFile::open(&dst).expect("reads"),
            GgufFile::open(&fixtures().join("gguf").join(file)).expect("reads"),
        );
        assert_eq!(calls, ours.tensor_infos().len());
        assert_eq!(
            report.quantized,
            theirs
                .tensor_infos()
                .iter()
                .filter(|i| i.dtype == q)
                .count()
        );
        for info in theirs.tensor_infos() {
            let (a, b) = (
                ours.tensor(&info.name).expect("tensor"),
                theirs.tensor(&info.name).expect("tensor"),
            );
            assert_eq!(
                (a.dtype(), a.shape()),
                (b.dtype(), b.shape()),
                "{}",
                info.name
            );
            assert!(a.bytes() == b.bytes(), "{q:?} {}: bytes differ", info.name);
        }
        let ft = ours
            .metadata()
            .find(|(k, _)| *k == "general.file_type")
            .map(|(_, v)| v.clone());
        assert_eq!(ft, Some(Value::U32(ftype)));
        open(&dst, LoadOptions::F32);
    }
    // Q4_K: this fixture's rows (64 values) are not whole 256-value
    // blocks, so every matrix takes Q5_0, as llama-quantize gives them.
    let dst = dir.path().join("q4_k.gguf");
    let report = kvant_model::quantize::quantize_gguf(&src, &dst, DType::Q4_K, |_, _| {})
        .expect("quantizes");
    assert!(
        report.quantized > 0 && report.fallback == report.quantized,
        "{report:?}"
    );
    let ours = GgufFile::open(&dst).expect("reads");
    assert!(ours
        .tensor_infos()
        .iter()
        .all(|i| matches!(i.dtype, DType::Q5_0 | DType::F32)));
    // The file and the Hugging Face fixture quantized at load hold the same
    // bytes: the same logits, to f32 reassociation.
    let hf = open(
        &fixtures().join("llama-gqa"),
        LoadOptions {
            quantize: Some(DType::Q4_K),
            ..LoadOptions::F32
        },
    );
    let (a, b) = (
        logits(&open(&dst, LoadOptions::F32), &PROMPT),
        logits(&hf, &PROMPT),
    );
    let diff = max_diff(&a, &b);
    assert!(diff <= 1e-4, "q4_k file vs at load: {diff}");
    let e = kvant_model::quantize::quantize_gguf(
        &src,
        &dir.path().join("x.gguf"),
        DType::Q6_K,
        |_, _| {},
    );
    assert!(e.is_err());
}
