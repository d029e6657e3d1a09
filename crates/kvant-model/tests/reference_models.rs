//! Tiny random-weight checkpoints of every architecture switch, checked
//! against transformers (PyTorch, CPU, float32) outputs written by
//! `tools/reference/make_model_fixtures.py`.

mod common;

use common::{fixtures, greedy, ids, open};
use kvant_model::arch::decoder::{LoadOptions, Logits};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Max |logit difference|. Both sides compute in f32 from identical weights
/// (quantized files are dequantized exactly the same way); only summation
/// order differs, which moves logits of magnitude ~5 by ~1e-6. 1e-4 leaves
/// two orders of margin while catching any real mistake (a wrong rope pair,
/// a missing bias or norm shifts logits by ≥ 1e-2).
const LOGIT_TOL: f32 = 1e-4;
/// Relative perplexity tolerance (follows from LOGIT_TOL).
const PPL_REL_TOL: f64 = 1e-4;

/// The same checks on the default, fast numerics: 8-bit activations for
/// Q4_0/Q8_0 weights and an f16 KV cache. These random-weight models put
/// most of each 32-value activation block's magnitude in one or two values
/// (the worst case for per-block max scaling: the rest keep ~6 bits), so
/// their logits move by up to 0.18 (Q4_0 fixture; f16 KV alone: 3e-3), and
/// the MoE/latent-attention Q8_0 fixtures' by up to 0.32 (deepseek-v3:
/// 0.26 when prompts run absorbed, 0.32 expanded, whose 8-bit rounding
/// falls on the latent rows instead of the absorbed queries; deepseek-v2
/// 0.15 and 0.13). The kernels' error bounds are tested exactly in
/// kvant-kernels; here a loose bound still catches integration mistakes (a
/// misplaced weight or scale makes these logits garbage, |Δ| ≫ 1).
const FAST_LOGIT_TOL: f32 = 0.4;
const FAST_PPL_REL_TOL: f64 = 0.02;
/// Mixture-of-experts fixtures: on the fast path, positions whose expert
/// choice is decided by less than this router-score margin (recorded per
/// position as `routing_margins`) are left out. The 8-bit activations of
/// the layers below move router inputs enough to flip such a choice, which
/// changes that row by O(1) — as it does in llama.cpp (deepseek-v3 Q8_0:
/// position 5, margin 0.007, Δ 1.53 there, 1.52 here). Rows after it still
/// count: the flip reaches them only through attention. 0.02 since the
/// FP4-expert fixture (deepseek-v4-fp8: every expert's activations 8-bit,
/// 128-wide rows) moved a choice decided by 0.0145 (position 60, Δ 1.80);
/// at 0.01 before.
const FAST_ROUTING_MARGIN: f64 = 0.02;
/// Sparse-attention fixtures (DeepSeek-V3.2): likewise, positions whose
/// indexer top-k is decided by less than this index-score gap (recorded per
/// layer and position under `indexer`) in some layer. The fast path moves
/// the indexer's inputs (the query latent comes from 8-bit activations) by
/// ~1% of scores of magnitude ~1-3, which swaps the positions around such a
/// cut (deepseek-v32 Q8_0: positions 9, 14, 18 and 22, gaps 0.023, 0.016,
/// 0.002 and 0.007, move by 0.7-1.9; every other row by at most 0.24).
const FAST_INDEX_MARGIN: f64 = 0.03;

/// What one fixture check requires.
struct Tol {
    logit: f32,
    ppl_rel: f64,
    /// Greedy tokens identical (only for the f32 path: near-ties in these
    /// random models flip under the fast path's noise).
    greedy: bool,
}

const EXACT: Tol = Tol {
    logit: LOGIT_TOL,
    ppl_rel: PPL_REL_TOL,
    greedy: true,
};
const FAST: Tol = Tol {
    logit: FAST_LOGIT_TOL,
    ppl_rel: FAST_PPL_REL_TOL,
    greedy: false,
};

/// (checkpoint path, reference.json path) for every fixture.
fn cases() -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(fixtures()).expect("fixtures dir") {
        let p = e.expect("entry").path();
        if p.join("reference.json").is_file() {
            out.push((p.clone(), p.join("reference.json")));
        }
    }
    for e in std::fs::read_dir(fixtures().join("gguf")).expect("gguf fixtures dir") {
        let p = e.expect("entry").path();
        // `mtp-*.gguf`: llama.cpp's `--mtp` output holds an MTP module
        // only (deepseek_v4.rs runs it beside its main model).
        let module = p
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("mtp-"));
        if p.extension().is_some_and(|x| x == "gguf") && !module {
            let r = p.with_extension("reference.json");
            out.push((p, r));
        }
    }
    out.sort();
    assert!(
        out.len() >= 17,
        "expected every fixture, found {}",
        out.len()
    );
    out
}

#[test]
fn logits_greedy_and_perplexity_match_transformers() {
    let failures: Vec<String> = cases()
        .into_iter()
        .filter_map(|(ckpt, refp)| {
            std::panic::catch_unwind(|| check(&ckpt, &refp, LoadOptions::F32, &EXACT))
                .err()
                .map(|e| format!("{}: {:?}", ckpt.display(), e.downcast_ref::<String>()))
        })
        .collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn fast_numerics_stay_close_to_transformers() {
    for (ckpt, refp) in cases() {
        check(&ckpt, &refp, LoadOptions::default(), &FAST);
    }
}

fn check(ckpt: &Path, refp: &Path, opts: LoadOptions, tol: &Tol) {
    let name = ckpt.file_name().unwrap().to_string_lossy().to_string();
    let r: Value = serde_json::from_str(&std::fs::read_to_string(refp).unwrap()).unwrap();
    let m = open(ckpt, opts);
    let prompt = ids(&r["prompt_ids"]);
    let vocab = m.config().vocab;

    let mut cache = m.new_cache(prompt.len()).unwrap();
    let logits = m.forward(&prompt, &mut cache, Logits::All).unwrap();
    let want = r["logits"].as_array().unwrap();
    // Rows a fast path may route differently (see FAST_ROUTING_MARGIN).
    let mut skip: Vec<bool> = match (tol.greedy, r["routing_margins"].as_array()) {
        (false, Some(m)) => m
            .iter()
            .map(|x| x.as_f64().unwrap() < FAST_ROUTING_MARGIN)
            .collect(),
        _ => vec![false; prompt.len()],
    };
    if let (false, Some(layers)) = (tol.greedy, r["indexer"]["layers"].as_array()) {
        for l in layers {
            let first = l["first_sparse_pos"].as_u64().unwrap() as usize;
            for (i, m) in l["margins"].as_array().unwrap().iter().enumerate() {
                if first + i < skip.len() && m.as_f64().unwrap() < FAST_INDEX_MARGIN {
                    skip[first + i] = true;
                }
            }
        }
    }
    // Long-prompt fixtures record only some rows (`logit_rows`); the others
    // record every prompt position.
    let positions: Vec<usize> = match r["logit_rows"].as_array() {
        Some(rows) => rows.iter().map(|x| x.as_u64().unwrap() as usize).collect(),
        None => (0..want.len()).collect(),
    };
    assert_eq!(positions.len(), want.len(), "{name}: logit_rows");
    let mut max_err = 0f32;
    let (mut nll, mut want_nll, mut scored) = (0f64, 0f64, 0usize);
    for (&t, row) in positions.iter().zip(want) {
        if skip[t] {
            continue;
        }
        let got = &logits[t * vocab..(t + 1) * vocab];
        let row: Vec<f32> = row
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w.as_f64().unwrap() as f32)
            .collect();
        for (g, w) in got.iter().zip(&row) {
            max_err = max_err.max((g - w).abs());
        }
        if let Some(&next) = prompt.get(t + 1) {
            let ln = |l: &[f32]| kvant_kernels::softmax::log_sum_exp(l) - l[next as usize] as f64;
            want_nll += ln(&row);
        }
    }
    // The perplexity over every prompt position kvant computed.
    for (t, &next) in prompt.iter().enumerate().skip(1) {
        if skip[t - 1] {
            continue;
        }
        let got = &logits[(t - 1) * vocab..t * vocab];
        nll += kvant_kernels::softmax::log_sum_exp(got) - got[next as usize] as f64;
        scored += 1;
    }
    assert!(max_err <= tol.logit, "{name}: max |Δlogit| {max_err}");
    let ppl = (nll / scored as f64).exp();
    // The recorded ppl when every row counts; else the same rows' reference
    // (which needs every row recorded).
    let want_ppl = match skip.iter().any(|&s| s) {
        false => r["ppl"].as_f64().unwrap(),
        true => {
            assert_eq!(positions.len(), prompt.len(), "{name}: rows left out");
            (want_nll / scored as f64).exp()
        }
    };
    assert!(
        ((ppl - want_ppl) / want_ppl).abs() <= tol.ppl_rel,
        "{name}: ppl {ppl} vs {want_ppl}"
    );

    let skipped = skip.iter().filter(|&&s| s).count();
    eprintln!("{name}: max |Δlogit| {max_err:.2e}, ppl {ppl:.4} (want {want_ppl:.4}), {skipped} near-tie rows left out");
    if !tol.greedy {
        return;
    }
    let want_greedy = ids(&r["greedy_ids"]);
    let mut s = greedy(&m, &prompt, want_greedy.len());
    s.truncate(want_greedy.len());
    assert_eq!(s, want_greedy, "{name}: greedy continuation");
}
