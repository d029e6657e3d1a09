//! The serving engine end to end on a tiny real checkpoint (a Q4_0 GGUF
//! with its tokenizer): batch invariance under load, chunked prefill,
//! preemption, prefix caching, aborts, validation and shutdown; the load
//! test also on a mixture of experts with latent attention (DeepSeek-V3)
//! and one with a gated shared expert (Qwen2-MoE).

mod common;
use common::{collect, crowded, greedy, prompts, start_fixture, submit};
use kvant_engine::serving::{
    EngineConfig, EngineHandle, EngineRequest, EngineThread, Event, MetricsSnapshot, Shutdown,
    SubmitError,
};
use kvant_engine::speculative::Policy;
use kvant_engine::{FinishReason, SamplingParams};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

const DENSE: &str = "gguf/llama-gqa.Q4_0.gguf";

fn start(cfg: EngineConfig) -> (EngineHandle, EngineThread) {
    start_with(DENSE, cfg)
}

fn start_with(name: &str, cfg: EngineConfig) -> (EngineHandle, EngineThread) {
    start_fixture(name, false, cfg)
}

/// Every request's greedy tokens are the same alone and among 16
/// concurrent ones, even when the step budget chunks their prompts and a
/// small pool forces preemptions (recomputed from the prefix cache).
/// `deepseek-v32` attends sparsely (top-8) past its 8th position, with its
/// indexer keys in the same blocks as the latent rows. `qwen3-next`,
/// `qwen3-5-moe` and `kimi-linear` (per-channel decay, latent attention in
/// its fourth layer) carry a recurrent state per sequence in three of
/// their four layers (state slots, snapshots at block boundaries for the
/// prefix cache, restored after preemption). `deepseek-v4` keeps window
/// rings and compressor tails in its slots and compressed entries in the
/// blocks.
#[test]
fn outputs_do_not_depend_on_load() {
    for name in [
        DENSE,
        "deepseek-v3",
        "qwen2-moe",
        "deepseek-v32",
        "qwen3-next",
        "qwen3-5-moe",
        "kimi-linear",
        "deepseek-v4",
    ] {
        outputs_do_not_depend_on_load_of(name, 1);
    }
    // These prompts have DeepSeek-V4 sequences preempted and restored from
    // snapshots in the middle of their windows.
    outputs_do_not_depend_on_load_of("deepseek-v4", 3);
}

fn outputs_do_not_depend_on_load_of(name: &str, seed: u64) {
    let ps = prompts(16, seed);
    let (h, t) = start_with(name, EngineConfig::default());
    let alone: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| collect(&submit(&h, greedy(p.clone(), 24))).0)
        .collect();
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();

    let (h, t) = start_with(name, crowded());
    let rxs: Vec<Receiver<Event>> = ps
        .iter()
        .map(|p| submit(&h, greedy(p.clone(), 24)))
        .collect();
    for (i, rx) in rxs.iter().enumerate() {
        let (ids, reason, usage) = collect(rx);
        assert_eq!(ids, alone[i], "{name}: request {i}");
        assert_eq!(reason, FinishReason::Length);
        assert_eq!(usage.completion_tokens, 24);
        assert_eq!(usage.prompt_tokens, ps[i].len());
    }
    let m = h.metrics();
    assert!(
        m.preemptions > 0,
        "the small pool should force preemptions: {m:?}"
    );
    assert_eq!(m.kv_blocks_used, 0, "every block released");
    assert_eq!((m.running, m.waiting), (0, 0));
    assert_eq!(m.requests_finished, 16);
    assert_eq!(m.generation_tokens, 16 * 24);
    assert_eq!(m.time_to_first_token.count, 16);
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
}

/// A prompt sharing a prefix with earlier work reuses its blocks, and
/// produces what it produces with caching off (for sparse attention too,
/// whose cached blocks carry the indexer keys the suffix scores, and for
/// linear attention and DeepSeek-V4, which restart from the state
/// snapshot kept at the last shared block's end).
#[test]
fn prefix_cache_hits_change_nothing_but_work() {
    for name in [DENSE, "deepseek-v32", "qwen3-next", "deepseek-v4"] {
        prefix_cache_hits_change_nothing_but_work_of(name);
    }
}

fn prefix_cache_hits_change_nothing_but_work_of(name: &str) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let shared: Vec<u32> = (0..50).map(|_| rng.random_range(3..250)).collect();
    let with_suffix = |s: &[u32]| [shared.as_slice(), s].concat();
    let (a, b) = (with_suffix(&[7, 8, 9]), with_suffix(&[10, 11]));
    let mut outs = Vec::new();
    for caching in [true, false] {
        let (h, t) = start_with(
            name,
            EngineConfig {
                block_size: 8,
                prefix_caching: caching,
                ..EngineConfig::default()
            },
        );
        let (first, _, u1) = collect(&submit(&h, greedy(a.clone(), 10)));
        let (second, _, u2) = collect(&submit(&h, greedy(b.clone(), 10)));
        assert_eq!(u1.cached_tokens, 0);
        let m = h.metrics();
        if caching {
            // 50 shared tokens: 6 full blocks of 8.
            assert_eq!(u2.cached_tokens, 48);
            assert_eq!(m.prefix_cache_hits, 48);
        } else {
            assert_eq!(u2.cached_tokens, 0);
        }
        assert_eq!(m.prefix_cache_queries, (a.len() + b.len()) as u64);
        outs.push((first, second));
        h.shutdown(Shutdown::Drain);
        t.join().unwrap();
    }
    assert_eq!(outs[0], outs[1], "{name}");
}

/// Requests that arrive together with a shared uncached prefix compute it
/// once: the later one waits for the earlier one's blocks, then reuses them.
#[test]
fn a_prefix_in_flight_is_computed_once() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let shared: Vec<u32> = (0..50).map(|_| rng.random_range(3..250)).collect();
    let (a, b) = (
        [shared.as_slice(), &[7]].concat(),
        [shared.as_slice(), &[8]].concat(),
    );
    let (h, t) = start(EngineConfig {
        block_size: 8,
        ..EngineConfig::default()
    });
    let (ra, rb) = (submit(&h, greedy(a, 4)), submit(&h, greedy(b, 4)));
    let (ua, ub) = (collect(&ra).2, collect(&rb).2);
    assert_eq!(ua.cached_tokens, 0);
    assert_eq!(ub.cached_tokens, 48);
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
}

/// An aborted request, or one whose client went away, frees its blocks
/// at once and leaves a concurrent request's output unchanged.
#[test]
fn aborts_free_blocks_and_disturb_nobody() {
    let ps = prompts(2, 3);
    let (h, t) = start(EngineConfig::default());
    let expected = collect(&submit(&h, greedy(ps[0].clone(), 40))).0;

    let steady = submit(&h, greedy(ps[0].clone(), 40));
    // A client that goes away after its third token.
    let mut seen = 0;
    let (tx, gone) = channel();
    h.submit(
        greedy(ps[1].clone(), 150),
        Box::new(move |e| {
            seen += 1;
            let _ = tx.send(e);
            seen < 3
        }),
    )
    .unwrap();
    // Abort `long` once it has produced something. Its sink holds the
    // engine thread at its first token until the abort is queued: on a
    // loaded machine the tiny fixture otherwise could finish all 150 tokens
    // before this thread got to send it (it did, once, under a full test run).
    let (ltx, long) = channel();
    let (at_first, held) = channel();
    let (release, go) = channel::<()>();
    let mut first = true;
    h.submit(
        greedy(ps[1].clone(), 150),
        Box::new(move |e| {
            let _ = ltx.send(e);
            if std::mem::take(&mut first) {
                let _ = at_first.send(());
                let _ = go.recv_timeout(Duration::from_secs(60));
            }
            true
        }),
    )
    .unwrap();
    held.recv_timeout(Duration::from_secs(60)).unwrap();
    let first = long.recv_timeout(Duration::from_secs(60)).unwrap();
    assert!(matches!(first, Event::Token { .. }));
    // Its id is the last submitted: ids count up from 1 per engine. Commands
    // are taken before each step, so the abort lands before the next token.
    h.abort(4);
    release.send(()).unwrap();
    let (ids, reason, _) = collect(&steady);
    assert_eq!(ids, expected);
    assert_eq!(reason, FinishReason::Length);
    let aborted = loop {
        match long.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Finished { reason, .. } => break reason,
            Event::Token { .. } => continue,
            e @ (Event::Failed(_) | Event::Embedding(_)) => panic!("{e:?}"),
        }
    };
    assert_eq!(aborted, FinishReason::Abort);
    for _ in 0..3 {
        let e = gone.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(matches!(e, Event::Token { .. }));
    }
    assert!(
        gone.recv_timeout(Duration::from_millis(300)).is_err(),
        "no events after the client left"
    );
    // The engine thread may still be publishing: wait for a quiet state.
    for _ in 0..100 {
        let m = h.metrics();
        if m.running == 0 && m.kv_blocks_used == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let m = h.metrics();
    assert_eq!(m.kv_blocks_used, 0);
    assert_eq!(m.requests_aborted, 2);
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
}

#[test]
fn bad_requests_are_refused_at_submission() {
    let (h, t) = start(EngineConfig {
        kv_blocks: 8,
        block_size: 16,
        ..EngineConfig::default()
    });
    let ctx = h.context_length();
    let refuse = |req: EngineRequest| h.submit(req, Box::new(|_| true)).unwrap_err();
    assert_eq!(refuse(greedy(vec![], 4)), SubmitError::EmptyPrompt);
    assert_eq!(refuse(greedy(vec![5], 0)), SubmitError::NoTokens);
    assert!(matches!(
        refuse(greedy(vec![5; ctx], 1)),
        SubmitError::PromptTooLong { .. }
    ));
    assert!(matches!(
        refuse(greedy(vec![5; 10], ctx)),
        SubmitError::BeyondContext { .. }
    ));
    assert!(matches!(
        refuse(greedy(vec![5; 100], 100)),
        SubmitError::BeyondCache { .. }
    ));
    assert!(matches!(
        refuse(greedy(vec![1_000_000], 1)),
        SubmitError::TokenOutOfRange { .. }
    ));
    let mut r = greedy(vec![5], 1);
    r.logprobs = Some(21);
    assert_eq!(refuse(r), SubmitError::TooManyLogprobs(21));
    let mut r = greedy(vec![5], 1);
    r.sampling.top_p = 0.0;
    assert!(matches!(refuse(r), SubmitError::Sampling(_)));
    h.shutdown(Shutdown::Drain);
    assert_eq!(refuse(greedy(vec![5], 1)), SubmitError::ShuttingDown);
    t.join().unwrap();
}

/// A burst fills the running slots and then the waiting ones before any
/// request is refused, and every ended request gives its place back.
#[test]
fn a_burst_fills_running_and_waiting_before_the_queue_is_full() {
    for (running, waiting) in [(2, 2), (1, 0)] {
        let (h, t) = start(EngineConfig {
            max_running: running,
            max_waiting: waiting,
            ..EngineConfig::default()
        });
        for _round in 0..2 {
            // None may end during the burst: the sinks hold the engine
            // thread on its first event until the gate opens.
            let (open, gate) = channel::<()>();
            let gate = Arc::new(std::sync::Mutex::new(gate));
            let results: Vec<_> = (0..10)
                .map(|_| {
                    let (tx, rx) = channel();
                    let gate = Arc::clone(&gate);
                    let sink = move |e| {
                        let _ = gate.lock().map(|g| g.recv_timeout(Duration::from_secs(60)));
                        tx.send(e).is_ok()
                    };
                    h.submit(greedy(vec![5, 6, 7], 8), Box::new(sink))
                        .map(|_| rx)
                })
                .collect();
            drop(open);
            let accepted: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
            assert_eq!(accepted.len(), running + waiting, "{running} + {waiting}");
            for r in &results {
                if let Err(e) = r {
                    assert_eq!(*e, SubmitError::QueueFull);
                }
            }
            // Every accepted one runs to its end; then there is room again.
            for rx in accepted {
                assert_eq!(collect(rx).1, FinishReason::Length);
            }
        }
        h.shutdown(Shutdown::Drain);
        t.join().unwrap();
    }
}

/// Logprobs come with every token when asked, the sampled token among the
/// alternatives of a greedy run, most likely first.
#[test]
fn logprobs_and_stop_strings() {
    let (h, t) = start(EngineConfig::default());
    let mut r = greedy(prompts(1, 4).remove(0), 6);
    r.logprobs = Some(3);
    let rx = submit(&h, r);
    let mut n = 0;
    loop {
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Token { id, logprob, .. } => {
                let lp = logprob.expect("logprobs requested");
                assert_eq!(lp.token, id);
                assert_eq!(lp.top.len(), 3);
                assert_eq!(lp.top[0].0, id, "greedy picks the most likely");
                assert!((lp.top[0].1 - lp.logprob).abs() < 1e-6 && lp.logprob <= 0.0);
                assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
                n += 1;
            }
            Event::Finished { .. } => break,
            e @ (Event::Failed(_) | Event::Embedding(_)) => panic!("{e:?}"),
        }
    }
    assert_eq!(n, 6);
    h.shutdown(Shutdown::Abort);
    t.join().unwrap();
}

/// Shutting down with `Abort` ends running requests with an abort event.
/// The sink holds the engine thread at the first token until the shutdown
/// is sent, so the request cannot run to its length first (it did, now and
/// then, when the test thread lost the core for 200 tiny steps).
#[test]
fn shutdown_abort_ends_streams() {
    let (h, t) = start(EngineConfig::default());
    let (tx, rx) = channel();
    let (go, wait) = channel::<()>();
    let mut first = true;
    h.submit(
        greedy(vec![5, 6, 7], 200),
        Box::new(move |e| {
            let token = matches!(e, Event::Token { .. });
            let sent = tx.send(e).is_ok();
            if token && std::mem::take(&mut first) {
                // Dropped sender or a signal: either way, go on.
                let _ = wait.recv();
            }
            sent
        }),
    )
    .expect("accepted");
    assert!(matches!(
        rx.recv_timeout(Duration::from_secs(60)).unwrap(),
        Event::Token { .. }
    ));
    h.shutdown(Shutdown::Abort);
    go.send(()).unwrap();
    let mut tokens = 1;
    let reason = loop {
        match rx.recv_timeout(Duration::from_secs(60)).unwrap() {
            Event::Finished { reason, .. } => break reason,
            Event::Token { .. } => tokens += 1,
            _ => continue,
        }
    };
    assert_eq!(reason, FinishReason::Abort);
    assert!(tokens < 200, "{tokens}");
    t.join().unwrap();
}

/// Runs `reqs` concurrently on fixture `name` (with its MTP module if
/// `mtp`, drafting at every step); returns each request's tokens and the
/// engine's counters.
fn run_all(
    name: &str,
    mtp: bool,
    cfg: EngineConfig,
    reqs: &[EngineRequest],
) -> (Vec<Vec<u32>>, MetricsSnapshot) {
    let cfg = EngineConfig {
        speculation: Policy::Always,
        ..cfg
    };
    let (h, t) = start_fixture(name, mtp, cfg);
    let rxs: Vec<Receiver<Event>> = reqs.iter().map(|r| submit(&h, r.clone())).collect();
    let outs: Vec<Vec<u32>> = rxs.iter().map(|rx| collect(rx).0).collect();
    let m = h.metrics();
    h.shutdown(Shutdown::Drain);
    t.join().unwrap();
    (outs, m)
}

/// Self-speculative decoding in the engine: the DeepSeek-V3 and V4
/// fixtures' MTP modules drafting at every step (V4's state steps back
/// over each rejected draft), under 16 concurrent requests with
/// chunked prompts and preemptions (recomputed, the module's state with
/// them), gives every request exactly the tokens the engine gives without
/// the module, greedy or sampled.
#[test]
fn mtp_drafting_changes_no_output() {
    let reqs: Vec<EngineRequest> = prompts(16, 3)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut req = greedy(p, 24);
            if i % 2 == 1 {
                req.sampling = SamplingParams {
                    temperature: 0.9,
                    seed: i as u64,
                    ..SamplingParams::default()
                };
            }
            req
        })
        .collect();
    for name in ["deepseek-v3", "deepseek-v4-mtp"] {
        let (plain, _) = run_all(name, false, crowded(), &reqs);
        let (spec, m) = run_all(name, true, crowded(), &reqs);
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!(a, b, "{name} request {i}");
        }
        eprintln!(
            "{name}: {} of {} drafts accepted, {} preemptions",
            m.spec_accepted, m.spec_drafted, m.preemptions
        );
        assert!(m.spec_drafted > 16, "{m:?}");
        assert!(m.preemptions > 0, "{m:?}");
        assert_eq!(m.generation_tokens, 16 * 24);
    }
}

/// `deepseek-v3-mtp-echo`'s module predicts its main model exactly
/// (tools/reference/make_mtp_echo_fixture.py): in the engine too every
/// verified draft is accepted, so requests advance two tokens per pass,
/// with the tokens plain decoding gives.
#[test]
fn mtp_echo_drafts_are_all_accepted() {
    let reqs = [
        greedy(vec![17, 4, 250, 9], 41),
        greedy(vec![3, 99, 41, 8, 8, 120, 7], 41),
    ];
    let name = "deepseek-v3-mtp-echo";
    let (plain, _) = run_all(name, false, EngineConfig::default(), &reqs);
    let (spec, m) = run_all(name, true, EngineConfig::default(), &reqs);
    assert_eq!(plain, spec);
    // 41 tokens each: the first from the prompt's pass, then 20 verifying
    // passes (the last may stop at one token).
    assert_eq!(m.spec_accepted, m.spec_drafted, "{m:?}");
    assert!(m.spec_drafted >= 2 * 19, "{m:?}");
}
