//! Self-speculative decoding with DeepSeek-V3's MTP module (the tiny
//! GigaChat3-shaped fixture, which carries one) and DeepSeek-V4's
//! (`deepseek-v4-mtp`): the output is exactly
//! plain decoding's, greedy or sampled, at any context limit, across chat
//! turns that reuse the cache; and drafts do get accepted.

use kvant_engine::session::Session;
use kvant_engine::speculative::Policy;
use kvant_engine::EngineRequest;
use kvant_engine::SamplingParams;
use kvant_model::arch::decoder::LoadOptions;
use kvant_model::LoadedModel;
use std::path::Path;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

fn load_fixture(name: &str, mtp: bool, opts: LoadOptions) -> LoadedModel {
    kvant_model::load::load_with(&fixture(name), LoadOptions { mtp, ..opts })
        .expect("fixture loads")
}

fn request(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> EngineRequest {
    EngineRequest {
        ignore_eos: true,
        ..EngineRequest::new(prompt, max_tokens, sampling)
    }
}

fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// Runs `turns` (each a prompt extending the last conversation) on one
/// session of `capacity`; returns each turn's tokens and the drafts
/// proposed and accepted.
fn run(
    m: &LoadedModel,
    capacity: usize,
    turns: &[(Vec<u32>, usize, SamplingParams)],
) -> (Vec<Vec<u32>>, usize, usize) {
    run_with(m, capacity, turns, Policy::Always)
}

fn run_with(
    m: &LoadedModel,
    capacity: usize,
    turns: &[(Vec<u32>, usize, SamplingParams)],
    policy: Policy,
) -> (Vec<Vec<u32>>, usize, usize) {
    let mut s = Session::new(&m.model, &m.tokenizer, capacity).expect("session");
    s.set_speculation(policy);
    let (mut drafted, mut accepted) = (0, 0);
    let mut outs = Vec::new();
    for (prompt, n, sampling) in turns {
        let out = s
            .generate(&request(prompt.clone(), *n, sampling.clone()), &mut |_| {})
            .expect("generate");
        drafted += out.drafted;
        accepted += out.accepted;
        outs.push(out.token_ids);
    }
    (outs, drafted, accepted)
}

/// DeepSeek-V3's module, and DeepSeek-V4's (`deepseek-v4-mtp`, and the
/// same module from llama.cpp's separate `--mtp` GGUF): a rejected draft
/// there leaves the main model's and the module's rings, compressor tails
/// and entries to step back over it.
#[test]
fn mtp_decoding_equals_plain_decoding() {
    let v4_gguf = (
        "gguf/deepseek-v4.F32.gguf",
        Some("gguf/mtp-deepseek-v4.F32.gguf"),
    );
    let cases = [
        (("deepseek-v3", None), LoadOptions::F32),
        (("deepseek-v3", None), LoadOptions::default()),
        (("deepseek-v4-mtp", None), LoadOptions::F32),
        (("deepseek-v4-mtp", None), LoadOptions::default()),
        (v4_gguf, LoadOptions::F32),
        (v4_gguf, LoadOptions::default()),
    ];
    for ((name, drafter), opts) in cases {
        let plain = load_fixture(name, false, opts);
        let mtp = match drafter {
            Some(d) => kvant_model::load_files(&fixture(name), Some(&fixture(d)), opts, None)
                .expect("fixture loads"),
            None => load_fixture(name, true, opts),
        };
        assert!(mtp.model.has_mtp() && !plain.model.has_mtp());
        let p1: Vec<u32> = (0..17).map(|i| (i * 37 + 11) % 300).collect();
        let sampled = SamplingParams {
            temperature: 0.9,
            seed: 7,
            repeat_penalty: 1.1,
            ..SamplingParams::default()
        };
        // Greedy, then a sampled turn that extends the conversation, then a
        // prompt that diverges early (cache cut back).
        let (out1, ..) = run(&plain, 256, &[(p1.clone(), 40, greedy())]);
        let mut p2 = p1.clone();
        p2.extend_from_slice(&out1[0]);
        p2.extend_from_slice(&[5, 6, 7]);
        let mut p3 = p1[..4].to_vec();
        p3.extend_from_slice(&[9, 9, 9]);
        let turns = [
            (p1.clone(), 40, greedy()),
            (p2, 30, sampled.clone()),
            (p3, 25, greedy()),
        ];
        let (want, d0, _) = run(&plain, 256, &turns);
        let (got, drafted, accepted) = run(&mtp, 256, &turns);
        assert_eq!(d0, 0);
        assert_eq!(want, got, "{name} {opts:?}");
        // The adaptive policy drafts on some steps and not others.
        let (adaptive, ..) = run_with(&mtp, 256, &turns, Policy::Adaptive);
        assert_eq!(want, adaptive, "{name} {opts:?} adaptive");
        // Random weights: the module rarely guesses right (acceptance is
        // measured on a model built to agree, below).
        eprintln!("{name} {opts:?}: drafted {drafted}, accepted {accepted}");
        assert!(drafted > 50, "drafted {drafted}");
        // At the context limit: the same tokens, however the last steps fall.
        for cap in [20, 21, 22, 23, 24] {
            let t = [(p1.clone(), 40, greedy())];
            assert_eq!(
                run(&plain, cap, &t).0,
                run(&mtp, cap, &t).0,
                "{name} capacity {cap}"
            );
        }
    }
}

/// `deepseek-v3-mtp-echo` (tools/reference/make_mtp_echo_fixture.py) is
/// built so that its MTP module predicts the main model exactly: every
/// draft is accepted, and each forward pass after the prompt yields two
/// tokens — with the same output as plain decoding.
#[test]
fn accepted_drafts_give_two_tokens_per_pass() {
    for opts in [LoadOptions::F32, LoadOptions::default()] {
        let plain = load_fixture("deepseek-v3-mtp-echo", false, opts);
        let mtp = load_fixture("deepseek-v3-mtp-echo", true, opts);
        let req = request(vec![17, 4, 250, 9], 41, greedy());
        let mut s = Session::new(&plain.model, &plain.tokenizer, 128).expect("session");
        let want = s.generate(&req, &mut |_| {}).expect("plain");
        let mut s = Session::new(&mtp.model, &mtp.tokenizer, 128).expect("session");
        s.set_speculation(Policy::Always);
        let got = s.generate(&req, &mut |_| {}).expect("mtp");
        assert_eq!(want.token_ids, got.token_ids, "{opts:?}");
        eprintln!(
            "{opts:?}: {} tokens, {} passes after the prompt ({} plain), {}/{} drafts accepted",
            got.token_ids.len(),
            got.decode_steps,
            want.decode_steps,
            got.accepted,
            got.drafted
        );
        assert_eq!(got.accepted, got.drafted, "{opts:?}");
        assert_eq!(want.decode_steps, 40);
        assert_eq!(got.decode_steps, 20);
    }
}
