//! One model over several ranks (threads here, through the in-process
//! communicator; the same code runs over MPI) against one process, on
//! every fixture architecture:
//! - tensor parallelism changes only the order of float sums: logits
//!   within a stated tolerance, greedy tokens identical;
//! - expert parallelism (alone, with data parallelism, with two-batch
//!   overlap, after re-placing experts with redundant replicas) and data
//!   parallelism give the same bits as one process, including for a
//!   data-parallel group with no requests.

mod common;
use common::{collect, fixture, submit};
use kvant_dist::Layout;
use kvant_engine::cluster::{forward_seq, run_worker, Cluster, Row, Want};
use kvant_engine::sampling::argmax;
use kvant_engine::serving::{
    EngineConfig, EngineHandle, EngineRequest, EngineThread, Rebalance, Shutdown,
};
use kvant_engine::SamplingParams;
use kvant_model::arch::decoder::{DecoderModel, SeqStep};
use kvant_model::tokenizer::Tokenizer;
use kvant_model::{load_parallel, load_with, LoadOptions, MlaPrefill, Parallel};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;
use std::time::Duration;

const DENSE: [&str; 8] = [
    "llama-gqa",
    "llama-gqa-bf16",
    "llama-mqa-tied",
    "llama-mqa-tied-f16",
    "mistral-swa",
    "qwen2-bias",
    "qwen3-qknorm",
    "gemma3-text",
];
const MOE: [&str; 7] = [
    "mixtral-moe",
    "qwen2-moe",
    "qwen3-moe",
    "deepseek-v2",
    "deepseek-v3",
    "deepseek-v3-qnull",
    // Sparse attention: every rank runs the whole indexer.
    "deepseek-v32",
];
/// Models that keep a state per sequence (window rings and compressor
/// tails, delta-rule states): it runs whole on every rank of a group, kept
/// in step by rank 0's copies.
const STATEFUL: [&str; 3] = ["deepseek-v4", "qwen3-next", "kimi-linear"];
const GGUF_DENSE: [&str; 3] = [
    "gguf/llama-gqa.Q4_0.gguf",
    "gguf/llama-gqa.Q8_0.gguf",
    "gguf/llama-mqa-tied.Q8_0.gguf",
];
const GGUF_MOE: [&str; 6] = [
    "gguf/mixtral-moe.Q8_0.gguf",
    "gguf/qwen2-moe-sparse.Q8_0.gguf",
    "gguf/qwen3-moe.Q8_0.gguf",
    "gguf/deepseek-v2.Q8_0.gguf",
    "gguf/deepseek-v3.Q8_0.gguf",
    "gguf/deepseek-v32.Q8_0.gguf",
];

#[derive(Clone, Copy, Debug)]
struct Par {
    tp: usize,
    dp: usize,
    ep: usize,
    overlap: bool,
}

const fn par(tp: usize, dp: usize, ep: usize, overlap: bool) -> Par {
    Par {
        tp,
        dp,
        ep,
        overlap,
    }
}

/// f32 activations, f32 cache: results closest to an f32 reference;
/// latent attention always absorbed, as `serve` runs it (the expanded
/// form is chosen per chunk length, and two-batch overlap halves the
/// chunks).
fn f32_opts() -> LoadOptions {
    LoadOptions {
        mla_prefill: MlaPrefill::Absorbed,
        ..LoadOptions::F32
    }
}

/// int8 activations (quantized fixtures), latent attention absorbed.
fn int8_opts() -> LoadOptions {
    LoadOptions {
        mla_prefill: MlaPrefill::Absorbed,
        ..LoadOptions::default()
    }
}

/// Runs `f` on rank 0 of `p` over `name`, the other ranks serving steps
/// on their threads.
fn with_cluster<R>(name: &str, opts: LoadOptions, p: Par, f: impl FnOnce(&Cluster) -> R) -> R {
    with_rank0(name, opts, p, |c, _| f(c))
}

/// [`with_cluster`], with the cluster shared and the tokenizer.
fn with_rank0<R>(
    name: &str,
    opts: LoadOptions,
    p: Par,
    f: impl FnOnce(&Arc<Cluster>, Arc<Tokenizer>) -> R,
) -> R {
    let world = (p.tp * p.dp).max(p.ep);
    let layout = Layout::new(world, p.tp, p.dp, p.ep).expect("layout");
    let path = fixture(name);
    let comms = kvant_dist::local::world(world, Duration::from_secs(60));
    std::thread::scope(|s| {
        let mut comms = comms.into_iter();
        let first = comms.next().expect("rank 0");
        for c in comms {
            let path = &path;
            s.spawn(move || {
                let par = Arc::new(Parallel::new(c, layout, p.overlap).expect("splits"));
                let m = load_parallel(path, opts, Some(par)).expect("rank loads");
                run_worker(&m.model).expect("worker");
            });
        }
        let par = Arc::new(Parallel::new(first, layout, p.overlap).expect("splits"));
        let m = load_parallel(&path, opts, Some(par)).expect("rank 0 loads");
        let cluster = Arc::new(Cluster::new(Arc::new(m.model)).expect("cluster"));
        let out = f(&cluster, Arc::new(m.tokenizer));
        cluster.shutdown().expect("shutdown");
        out
    })
}

/// What one sequence produced: the prompt's logits rows (all of them),
/// then each decode step's last row, and the greedy tokens.
struct Trace {
    rows: Vec<Vec<f32>>,
    tokens: Vec<u32>,
}

const STEPS: usize = 10;

fn prompt(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// Prefill in two chunks (all rows), then greedy decoding; every other
/// step asks only for the argmax, which must equal the full row's.
fn trace(model: &DecoderModel, cluster: Option<&Cluster>) -> Trace {
    let vocab = model.config().vocab;
    let p = prompt(vocab, 11, 7);
    let mut cache = match cluster {
        Some(c) => c.cache(64).expect("cache"),
        None => model.new_cache(64).expect("cache"),
    };
    let full = |r: Row| match r {
        Row::Logits(l) => l,
        Row::Argmax(_) | Row::Hidden(_) => panic!("asked for a whole row"),
    };
    let mut rows = Vec::new();
    for chunk in [&p[..6], &p[6..]] {
        let out = forward_seq(model, cluster, &mut cache, chunk, Want::All).expect("prefill");
        rows.extend(out.into_iter().map(full));
    }
    let mut next = argmax(rows.last().expect("rows")).expect("finite");
    let mut tokens = vec![next];
    for step in 0..STEPS {
        if step % 2 == 1 {
            let out =
                forward_seq(model, cluster, &mut cache, &[next], Want::LastArgmax).expect("decode");
            // One process takes the argmax of its whole row; a cluster
            // reduces each rank's slice to one pair: the tokens compared
            // below must agree.
            let Some(Row::Argmax(Some(t))) = out.into_iter().next() else {
                panic!("no argmax row")
            };
            next = t;
        } else {
            let out = forward_seq(model, cluster, &mut cache, &[next], Want::Last).expect("decode");
            let row = full(out.into_iter().next().expect("row"));
            next = argmax(&row).expect("finite");
            rows.push(row);
        }
        tokens.push(next);
    }
    Trace { rows, tokens }
}

fn single(name: &str, opts: LoadOptions) -> Trace {
    let m = load_with(&fixture(name), opts).expect("loads");
    trace(&m.model, None)
}

fn parallel(name: &str, opts: LoadOptions, p: Par) -> Trace {
    with_cluster(name, opts, p, |c| trace(c.model(), Some(c)))
}

fn max_abs(rows: &[Vec<f32>]) -> f32 {
    rows.iter().flatten().fold(0f32, |m, v| m.max(v.abs()))
}

/// Same greedy tokens; logits within `tol · max|logit|` (0: bitwise).
fn compare(what: &str, a: &Trace, b: &Trace, tol: f32) {
    assert_eq!(a.tokens, b.tokens, "{what}: greedy tokens");
    assert_eq!(a.rows.len(), b.rows.len(), "{what}: rows");
    let scale = max_abs(&a.rows);
    let mut worst = 0f32;
    for (ra, rb) in a.rows.iter().zip(&b.rows) {
        assert_eq!(ra.len(), rb.len(), "{what}: row length");
        for (x, y) in ra.iter().zip(rb) {
            if tol == 0.0 {
                assert_eq!(
                    x.to_bits(),
                    y.to_bits(),
                    "{what}: not bit-identical ({x} vs {y})"
                );
            }
            worst = worst.max((x - y).abs());
        }
    }
    eprintln!("{what}: max |Δlogit| / max |logit| = {:.3e}", worst / scale);
    assert!(
        worst <= tol * scale,
        "{what}: max |Δlogit| {worst} > {tol} × {scale}"
    );
}

/// Tensor parallelism with f32 activations: the sums of the row-parallel
/// products and of the vocabulary-parallel embedding change only the
/// order of float additions, a few ulps per layer. Measured: at most
/// 8.5e-7 of the largest logit over every fixture and layout here; 1e-5
/// leaves a factor of ten.
const TP_F32_TOL: f32 = 1e-5;

/// With int8 activations the same reordering can move an activation
/// across a rounding boundary of its 8-bit quantization (one step of
/// `max|x|/127` in one value of a block). Measured: 2.8e-3 of the largest
/// logit on the Qwen2-MoE Q8_0 fixture, at most 3.3e-7 on the others;
/// 1e-2 bounds it.
const TP_INT8_TOL: f32 = 1e-2;

/// Tensor parallelism on 2 ranks against one process: the f32 fixtures
/// in f32 numerics, the quantized ones with 8-bit activations.
fn tensor_parallel_matches_one_process(hf: &[&str], gguf: &[&str]) {
    let cases = hf.iter().map(|n| (n, f32_opts(), TP_F32_TOL));
    let cases = cases.chain(gguf.iter().map(|n| (n, int8_opts(), TP_INT8_TOL)));
    for (name, opts, tol) in cases {
        let want = single(name, opts);
        let got = parallel(name, opts, par(2, 1, 1, false));
        compare(&format!("{name} tp2"), &want, &got, tol);
    }
}

#[test]
fn tensor_parallel_matches_one_process_dense() {
    tensor_parallel_matches_one_process(&DENSE, &GGUF_DENSE);
}

#[test]
fn tensor_parallel_matches_one_process_moe_and_latent_attention() {
    tensor_parallel_matches_one_process(&MOE, &GGUF_MOE);
}

#[test]
fn tensor_parallel_with_uneven_heads_and_two_batch_overlap() {
    // qwen3-qknorm has 8 query and 2 KV heads: on 3 ranks KV head 0 is
    // on ranks 0 and 1 (2 query heads each) and KV head 1 on rank 2 (4);
    // the FFN's 128 columns and the vocabulary split 43/43/42 and so on.
    let name = "qwen3-qknorm";
    let want = single(name, f32_opts());
    compare(
        "qwen3 tp3",
        &want,
        &parallel(name, f32_opts(), par(3, 1, 1, false)),
        TP_F32_TOL,
    );
    compare(
        "qwen3 tp2 tbo",
        &want,
        &parallel(name, f32_opts(), par(2, 1, 1, true)),
        TP_F32_TOL,
    );
    // MQA: one KV head replicated on both ranks.
    let name = "llama-mqa-tied";
    let want = single(name, f32_opts());
    compare(
        "mqa tp4",
        &want,
        &parallel(name, f32_opts(), par(4, 1, 1, false)),
        TP_F32_TOL,
    );
}

#[test]
fn expert_parallel_is_bit_identical() {
    for name in MOE.into_iter().chain(GGUF_MOE).chain(STATEFUL) {
        let opts = match name.ends_with(".gguf") {
            true => int8_opts(),
            false => f32_opts(),
        };
        let want = single(name, opts);
        for (label, p) in [
            ("ep2", par(1, 1, 2, false)),
            // Group 1 has no requests: its rank still joins every layer.
            ("dp2 ep2", par(1, 2, 2, false)),
            ("ep2 tbo", par(1, 1, 2, true)),
            ("dp2 ep2 tbo", par(1, 2, 2, true)),
        ] {
            compare(
                &format!("{name} {label}"),
                &want,
                &parallel(name, opts, p),
                0.0,
            );
        }
    }
}

#[test]
fn expert_parallel_with_tensor_parallel_attention() {
    for name in ["deepseek-v3", "qwen3-moe"] {
        let want = single(name, f32_opts());
        let got = parallel(name, f32_opts(), par(2, 1, 2, false));
        compare(&format!("{name} tp2 ep2"), &want, &got, TP_F32_TOL);
        // Four ranks: two data-parallel groups of two tensor-parallel ranks.
        let got = parallel(name, f32_opts(), par(2, 2, 4, true));
        compare(&format!("{name} tp2 dp2 ep4 tbo"), &want, &got, TP_F32_TOL);
    }
}

#[test]
fn data_parallel_groups_run_their_own_sequences() {
    // Two groups, each with its own sequence in its own pool, one step
    // together: each gets what one process computes for it alone.
    for (name, p) in [
        ("llama-gqa", par(1, 2, 1, false)),
        ("deepseek-v3", par(1, 2, 2, false)),
        ("qwen2-moe", par(1, 2, 2, true)),
    ] {
        let opts = f32_opts();
        let m = load_with(&fixture(name), opts).expect("loads");
        let vocab = m.model.config().vocab;
        let prompts = [prompt(vocab, 9, 1), prompt(vocab, 5, 2)];
        let alone: Vec<Vec<f32>> = prompts
            .iter()
            .map(|p| {
                let mut cache = m.model.new_cache(32).expect("cache");
                let out = forward_seq(&m.model, None, &mut cache, p, Want::Last).expect("pass");
                match out.into_iter().next() {
                    Some(Row::Logits(l)) => l,
                    _ => panic!("no row"),
                }
            })
            .collect();
        let together = with_cluster(name, opts, p, |c| {
            let mut pool = c.pool(16, 4, 0).expect("pool");
            let table = [0u32, 1];
            let groups: Vec<Vec<(SeqStep<'_>, Want)>> = prompts
                .iter()
                .map(|p| {
                    vec![(
                        SeqStep {
                            tokens: p,
                            pos0: 0,
                            table: &table,
                            logits: Want::Last.logits(),
                            state: 0,
                        },
                        Want::Last,
                    )]
                })
                .collect();
            c.step(&mut pool, &groups).expect("step")
        });
        for (d, (rows, want)) in together.iter().zip(&alone).enumerate() {
            let [Row::Logits(got)] = rows.as_slice() else {
                panic!("group {d}: one whole row expected")
            };
            let same = got
                .iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name} group {d}: not the bits of one process");
        }
    }
}

#[test]
fn redundant_experts_change_no_output() {
    for name in ["deepseek-v3", "gguf/qwen3-moe.Q8_0.gguf"] {
        let opts = match name.ends_with(".gguf") {
            true => int8_opts(),
            false => f32_opts(),
        };
        let want = single(name, opts);
        let got = with_cluster(name, opts, par(1, 1, 2, false), |c| {
            // Loads from a first pass, then two redundant replicas per
            // layer placed from them.
            let _ = trace(c.model(), Some(c));
            c.rebalance(2).expect("rebalance");
            for p in c.model().expert_placements() {
                assert_eq!(p.physical(), p.experts() + 2);
            }
            trace(c.model(), Some(c))
        });
        compare(&format!("{name} eplb"), &want, &got, 0.0);
    }
}

#[test]
fn layouts_that_do_not_fit_the_model_are_errors() {
    // Expert parallelism on a dense model, and more ranks than heads.
    for (name, p, msg) in [
        ("llama-gqa", par(1, 1, 2, false), "mixture-of-experts"),
        ("llama-gqa", par(8, 1, 1, false), "attention heads"),
        ("mixtral-moe", par(1, 1, 8, false), "experts"),
        ("deepseek-v4", par(2, 1, 1, false), "tensor-parallel"),
        ("qwen3-next", par(2, 1, 2, false), "tensor-parallel"),
    ] {
        let world = (p.tp * p.dp).max(p.ep);
        let layout = Layout::new(world, p.tp, p.dp, p.ep).expect("layout");
        let comms = kvant_dist::local::world(world, Duration::from_secs(10));
        let errs: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let par = Arc::new(Parallel::new(c, layout, false).expect("splits"));
                        match load_parallel(&fixture(name), f32_opts(), Some(par)) {
                            Ok(_) => String::new(),
                            Err(e) => e.to_string(),
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect()
        });
        for e in errs {
            assert!(e.contains(msg), "{name} {p:?}: {e}");
        }
    }
}

/// 16 requests, every other one sampled at temperature 0.8 with its own
/// seed (whole logits rows cross the ranks), the others plain greedy
/// (only the argmax does).
fn requests(vocab: usize) -> Vec<EngineRequest> {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    (0..16)
        .map(|i| {
            let len = rng.random_range(3..40);
            let sampling = match i % 2 {
                0 => SamplingParams::greedy(),
                _ => SamplingParams {
                    temperature: 0.8,
                    seed: i,
                    ..SamplingParams::default()
                },
            };
            let prompt = (0..len)
                .map(|_| rng.random_range(3..vocab as u32))
                .collect();
            EngineRequest {
                sampling,
                ignore_eos: true,
                ..EngineRequest::greedy(prompt, 12)
            }
        })
        .collect()
}

/// An engine over `name` in one process, and [`requests`] for its vocabulary.
fn one_process(name: &str, opts: LoadOptions) -> (EngineHandle, EngineThread, Vec<EngineRequest>) {
    let m = load_with(&fixture(name), opts).expect("loads");
    let reqs = requests(m.model.config().vocab);
    let (h, t) = EngineHandle::start(
        Arc::new(m.model),
        Arc::new(m.tokenizer),
        EngineConfig::default(),
    )
    .expect("engine");
    (h, t, reqs)
}

/// A pool and step budget small enough to chunk prompts and preempt.
fn crowded() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        kv_blocks: 48,
        max_batch_tokens: 32,
        max_running: 8,
        ..EngineConfig::default()
    }
}

/// The serving engine over ranks: 16 concurrent requests (greedy and
/// sampled), chunked and preempted, each producing what it produces alone
/// in one process; with data parallelism the requests spread over the
/// groups.
#[test]
fn serving_over_ranks_matches_one_process() {
    // Every 3 steps, the experts re-placed with 2 redundant replicas.
    let eplb = Some(Rebalance {
        every: 3,
        redundant: 2,
    });
    for (name, opts, p, rebalance) in [
        (
            "gguf/llama-gqa.Q4_0.gguf",
            int8_opts(),
            par(1, 2, 1, false),
            None,
        ),
        ("deepseek-v3", f32_opts(), par(1, 2, 2, true), None),
        (
            "gguf/qwen2-moe-sparse.Q8_0.gguf",
            int8_opts(),
            par(1, 1, 2, false),
            eplb,
        ),
        (
            "gguf/deepseek-v3.Q8_0.gguf",
            int8_opts(),
            par(1, 2, 2, false),
            eplb,
        ),
        (
            "gguf/llama-gqa.Q8_0.gguf",
            int8_opts(),
            par(2, 1, 1, false),
            None,
        ),
        // State slots per group: snapshots kept and restored on the
        // group's ranks.
        ("deepseek-v4", int8_opts(), par(1, 2, 2, false), None),
        ("qwen3-next", f32_opts(), par(1, 1, 2, true), eplb),
    ] {
        let (h, t, reqs) = one_process(name, opts);
        let alone: Vec<Vec<u32>> = reqs
            .iter()
            .map(|r| collect(&submit(&h, r.clone())).0)
            .collect();
        h.shutdown(Shutdown::Drain);
        t.join().expect("engine stops");

        with_rank0(name, opts, p, |c, tok| {
            let cfg = EngineConfig {
                rebalance,
                ..crowded()
            };
            let (h, t) = EngineHandle::start_on_cluster(Arc::clone(c), tok, cfg).expect("engine");
            let rxs: Vec<_> = reqs.iter().map(|r| submit(&h, r.clone())).collect();
            for (i, rx) in rxs.iter().enumerate() {
                assert_eq!(collect(rx).0, alone[i], "{name} {p:?}: request {i}");
            }
            let m = h.metrics();
            assert_eq!(m.kv_blocks_total, 48 * p.dp);
            assert_eq!((m.kv_blocks_used, m.running, m.waiting), (0, 0, 0));
            assert_eq!(m.requests_finished, 16);
            assert!(m.preemptions > 0, "{name}: the small pools should preempt");
            assert_eq!(m.expert_rebalances > 0, rebalance.is_some(), "{name}");
            h.shutdown(Shutdown::Drain);
            t.join().expect("engine stops");
        });
    }
}

/// Embedding requests over ranks, batched with generation on a crowded
/// engine: the group's first rank sends each prompt's hidden states. Data
/// and expert parallelism give the bits one process gives; tensor
/// parallelism in f32 reorders sums only (within [`TP_F32_TOL`] of the
/// largest value).
#[test]
fn embeddings_over_ranks_match_one_process() {
    use kvant_engine::serving::Pooling;
    let embed = |h: &EngineHandle, ids: Vec<u32>, pooling: Pooling| {
        common::embedding(&common::embed(h, ids, pooling)).0
    };
    let pooling = |i: usize| [Pooling::Mean, Pooling::Last, Pooling::First][i % 3];
    for (name, opts, p, tol) in [
        ("llama-gqa", f32_opts(), par(2, 1, 1, false), TP_F32_TOL),
        ("deepseek-v3", f32_opts(), par(1, 2, 2, true), 0.0),
        (
            "gguf/llama-gqa.Q4_0.gguf",
            int8_opts(),
            par(1, 2, 1, false),
            0.0,
        ),
    ] {
        let (h, t, reqs) = one_process(name, opts);
        let alone: Vec<Vec<f32>> = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| embed(&h, r.prompt_ids.clone(), pooling(i)))
            .collect();
        h.shutdown(Shutdown::Drain);
        t.join().expect("engine stops");

        with_rank0(name, opts, p, |c, tok| {
            let (h, t) =
                EngineHandle::start_on_cluster(Arc::clone(c), tok, crowded()).expect("engine");
            // Generations alongside, so that hidden states and logits rows
            // cross the ranks in the same steps.
            let gens: Vec<_> = reqs.iter().map(|r| submit(&h, r.clone())).collect();
            let scale = alone.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
            for (i, r) in reqs.iter().enumerate() {
                let got = embed(&h, r.prompt_ids.clone(), pooling(i));
                assert_eq!(got.len(), alone[i].len(), "{name} {p:?}: prompt {i}");
                let worst = got
                    .iter()
                    .zip(&alone[i])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                match tol == 0.0 {
                    true => assert_eq!(got, alone[i], "{name} {p:?}: prompt {i}"),
                    false => assert!(worst <= tol * scale, "{name} {p:?}: {i}: {worst}"),
                }
            }
            for rx in &gens {
                collect(rx);
            }
            h.shutdown(Shutdown::Drain);
            t.join().expect("engine stops");
        });
    }
}

/// A chat over ranks whose second turn diverges from the first's answer:
/// the cache goes back to the state saved after the first prompt, on every
/// rank; the tokens equal one process's.
#[test]
fn sessions_over_ranks_go_back_to_the_saved_state() {
    use kvant_engine::session::Session;
    for (name, p) in [
        ("deepseek-v4", par(1, 1, 2, false)),
        ("qwen3-next", par(1, 2, 2, false)),
    ] {
        let opts = int8_opts();
        let turns = |model: &DecoderModel, tok: &Tokenizer, cluster: Option<&Cluster>| {
            let vocab = model.config().vocab;
            let mut s = match cluster {
                Some(c) => Session::on_cluster(c, tok, 128).expect("session"),
                None => Session::new(model, tok, 128).expect("session"),
            };
            let first = prompt(vocab, 13, 3);
            let mut second = first.clone();
            second.extend(prompt(vocab, 5, 4));
            [first, second]
                .into_iter()
                .map(|p| {
                    let req = EngineRequest {
                        ignore_eos: true,
                        ..EngineRequest::new(p, 12, SamplingParams::greedy())
                    };
                    s.generate(&req, &mut |_| {}).expect("generate").token_ids
                })
                .collect::<Vec<_>>()
        };
        let m = load_with(&fixture(name), opts).expect("loads");
        let want = turns(&m.model, &m.tokenizer, None);
        let got = with_rank0(name, opts, p, |c, tok| turns(c.model(), &tok, Some(c)));
        assert_eq!(want, got, "{name} {p:?}");
    }
}

/// A prompt that shares a prefix with an earlier one starts from the state
/// snapshot kept at the last shared block, on every rank of its group.
#[test]
fn prefix_cache_restores_over_ranks_match_one_process() {
    for (name, p) in [
        ("deepseek-v4", par(1, 1, 2, false)),
        ("qwen3-next", par(1, 1, 2, false)),
    ] {
        let opts = int8_opts();
        let m = load_with(&fixture(name), opts).expect("loads");
        let vocab = m.model.config().vocab;
        // Four blocks of 8: the first prompt's first chunk ends at the
        // fourth block's end, where its state is kept.
        let shared = prompt(vocab, 32, 11);
        let reqs: Vec<EngineRequest> = [12u64, 13]
            .into_iter()
            .map(|seed| {
                let p = [shared.clone(), prompt(vocab, 4, seed)].concat();
                EngineRequest {
                    ignore_eos: true,
                    ..EngineRequest::new(p, 10, SamplingParams::greedy())
                }
            })
            .collect();
        let cfg = EngineConfig {
            block_size: 8,
            ..EngineConfig::default()
        };
        let run = |h: &EngineHandle| -> Vec<(Vec<u32>, usize)> {
            reqs.iter()
                .map(|r| {
                    let (ids, _, usage) = collect(&submit(h, r.clone()));
                    (ids, usage.cached_tokens)
                })
                .collect()
        };
        let (h, t) = EngineHandle::start(Arc::new(m.model), Arc::new(m.tokenizer), cfg.clone())
            .expect("engine");
        let want = run(&h);
        h.shutdown(Shutdown::Drain);
        t.join().expect("engine stops");
        let got = with_rank0(name, opts, p, |c, tok| {
            let (h, t) =
                EngineHandle::start_on_cluster(Arc::clone(c), tok, cfg.clone()).expect("engine");
            let got = run(&h);
            h.shutdown(Shutdown::Drain);
            t.join().expect("engine stops");
            got
        });
        assert_eq!(want[1].1, 32, "{name}: four shared blocks of 8");
        assert_eq!(want, got, "{name} {p:?}");
    }
}
