//! A sequence's logits do not depend on the batch it runs in: alone in a
//! pool of its own, or sharing forward passes with other sequences, with
//! its prompt cut into different chunks, in shuffled blocks. This is what
//! makes a served request's output independent of the load (the serving
//! engine's batch invariance), so it is checked bit for bit. Latent
//! attention keeps it when every chunk runs absorbed (what `kvant serve`
//! loads); in the default mode a chunk's form depends on its length, so
//! there only the other sequences in a pass must not matter.

mod common;

use common::{fixtures, open, whole_block_fixture};
use kvant_model::arch::decoder::{DecoderModel, LoadOptions, Logits, MlaPrefill, SeqStep};
use kvant_model::kv::{KvDType, KvPool};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const BLOCK: usize = 4;

/// A sequence being fed: all its tokens, and how many have run.
struct Feed {
    tokens: Vec<u32>,
    done: usize,
    table: Vec<u32>,
}

/// Runs every sequence to its end, `chunks[i]` tokens of sequence `i` per
/// pass (all sequences together in each pass), and returns each sequence's
/// last-token logits after every pass that ends at one of `probe` positions.
fn run(
    m: &DecoderModel,
    seqs: &[Vec<u32>],
    chunks: &[usize],
    rng: &mut ChaCha8Rng,
    probe: &[usize],
) -> Vec<Vec<Vec<f32>>> {
    let need: usize = seqs.iter().map(|s| s.len().div_ceil(BLOCK)).sum();
    // One state slot per sequence for linear-attention layers.
    let mut pool: KvPool = m.new_pool(BLOCK, need + 3, seqs.len()).expect("pool");
    let mut ids: Vec<u32> = (0..(need + 3) as u32).collect();
    ids.shuffle(rng);
    let mut ids = ids.into_iter();
    let mut feeds: Vec<Feed> = seqs
        .iter()
        .map(|s| Feed {
            tokens: s.clone(),
            done: 0,
            table: ids.by_ref().take(s.len().div_ceil(BLOCK)).collect(),
        })
        .collect();
    let vocab = m.config().vocab;
    let mut out = vec![Vec::new(); seqs.len()];
    while feeds.iter().any(|f| f.done < f.tokens.len()) {
        let mut steps = Vec::new();
        let mut who = Vec::new();
        for (i, f) in feeds.iter().enumerate() {
            if f.done == f.tokens.len() {
                continue;
            }
            let end = (f.done + chunks[i]).min(f.tokens.len());
            let probe_here = probe.contains(&end) || end == f.tokens.len();
            steps.push(SeqStep {
                tokens: &f.tokens[f.done..end],
                pos0: f.done,
                table: &f.table,
                logits: if probe_here {
                    Logits::Last
                } else {
                    Logits::None
                },
                state: i,
            });
            who.push((i, end, probe_here));
        }
        let logits = m.forward_batch(&mut pool, &steps).expect("forward");
        let mut row = 0;
        for (i, end, probed) in who {
            feeds[i].done = end;
            if probed {
                out[i].push(logits[row * vocab..(row + 1) * vocab].to_vec());
                row += 1;
            }
        }
    }
    out
}

#[test]
fn logits_do_not_depend_on_the_batch() {
    let mut paths = vec![
        fixtures().join("llama-gqa"),
        fixtures().join("gemma3-text"),
        fixtures().join("mistral-swa"),
        fixtures().join("llama-gqa-bf16"),
        fixtures().join("llama-mqa-tied-f16"),
        // Experts (the fused kernel's token grouping changes with the batch)
        // and latent attention (one KV row per token for all heads).
        fixtures().join("qwen2-moe"),
        fixtures().join("deepseek-v3"),
        fixtures().join("deepseek-v2"),
        // Sparse attention: each token's indexer selection (its key split
        // changes with the batch) and its gathered rows (top-8 of up to 29).
        fixtures().join("deepseek-v32"),
        // Linear attention: each sequence's state in its slot, its chunks
        // cut anywhere by the passes (the delta rule folds only at
        // absolute chunk ends).
        fixtures().join("qwen3-next"),
        fixtures().join("qwen3-5"),
        fixtures().join("qwen3-5-moe"),
        // Kimi Delta Attention: a decay per key channel.
        fixtures().join("kimi-linear"),
        // DeepSeek-V4: window rings and compressor tails in each slot,
        // compressed entries in the blocks of their windows' last tokens
        // (CSA every 4 tokens, HCA every 8: two blocks of 4), the
        // indexer's top-3 of them.
        fixtures().join("deepseek-v4"),
    ];
    paths.extend(
        [
            "llama-gqa.Q4_0.gguf",
            "llama-mqa-tied.Q8_0.gguf",
            "deepseek-v32.Q8_0.gguf",
        ]
        .iter()
        .map(|f| fixtures().join("gguf").join(f)),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for path in paths {
        for opts in [LoadOptions::default(), LoadOptions::F32] {
            let opts = LoadOptions {
                mla_prefill: MlaPrefill::Absorbed,
                ..opts
            };
            let what = format!("{} {opts:?}", path.display());
            assert_batch_invariant(&open(&path, opts), &mut rng, &what);
        }
    }
}

/// The same for the other cache types, on the copies of a multi-head and
/// a latent-attention fixture whose rows are whole 32-value blocks (so
/// the Q8_0 and Q4_0 caches hold them too): a stored row's rounding
/// depends on the row alone, so it does not depend on the batch either.
#[test]
fn every_cache_type_keeps_results_independent_of_the_batch() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for name in ["llama-gqa", "deepseek-v3"] {
        let dir = whole_block_fixture(name);
        for kv_dtype in [KvDType::Bf16, KvDType::Q8_0, KvDType::Q4_0] {
            for opts in [LoadOptions::default(), LoadOptions::F32] {
                let opts = LoadOptions {
                    mla_prefill: MlaPrefill::Absorbed,
                    kv_dtype,
                    ..opts
                };
                let what = format!("{name} (whole blocks) {opts:?}");
                assert_batch_invariant(&open(dir.path(), opts), &mut rng, &what);
            }
        }
    }
}

/// Three random sequences' logits at probe positions, each run alone one
/// token at a time, equal bit for bit those of runs together in chunks.
fn assert_batch_invariant(m: &DecoderModel, rng: &mut ChaCha8Rng, what: &str) {
    let vocab = m.config().vocab as u32;
    let lens = [29usize, 6, 17];
    let seqs: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.random_range(0..vocab)).collect())
        .collect();
    // Positions whose logits are compared: ends of prompt-like
    // prefixes and decode-like single steps.
    let probe = [5usize, 6, 12, 16, 17, 20, 28, 29];
    let alone: Vec<Vec<Vec<f32>>> = seqs
        .iter()
        .map(|s| {
            let mut r = run(m, std::slice::from_ref(s), &[1], rng, &probe);
            r.remove(0)
        })
        .collect();
    for chunks in [[1usize, 1, 1], [4, 1, 3], [29, 6, 17], [7, 2, 5]] {
        let together = run(m, &seqs, &chunks, rng, &probe);
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            // Compare the probes both runs hit (chunking skips some).
            let ends_a: Vec<usize> = probe_ends(lens[i], 1, &probe);
            let ends_b: Vec<usize> = probe_ends(lens[i], chunks[i], &probe);
            for (j, e) in ends_b.iter().enumerate() {
                let k = ends_a
                    .iter()
                    .position(|x| x == e)
                    .expect("alone probes all");
                assert!(a[k] == b[j], "{what} seq {i} chunks {chunks:?} at {e}");
            }
        }
    }
}

/// The positions at which `run` records logits for a sequence of `len`
/// tokens fed `chunk` at a time.
fn probe_ends(len: usize, chunk: usize, probe: &[usize]) -> Vec<usize> {
    (1..=len.div_ceil(chunk))
        .map(|s| (s * chunk).min(len))
        .filter(|e| probe.contains(e) || *e == len)
        .collect()
}

/// Default mode: a prompt chunk may run expanded. A sequence's logits
/// still do not depend on the other sequences in its passes (each chunk's
/// form is its own), and the expanded form is as accurate as the absorbed
/// one. In f32 the two agree to summation order (the reference tests'
/// 1e-4 on logits of magnitude ~5). With 8-bit activations their roundings
/// differ (the latent rows are quantized when expanded, the absorbed
/// queries otherwise), and on these tiny random models rounding alone
/// moves logits by up to ~3 (expert choices flip), so there the expanded
/// form's distance from the f32 absorbed result must stay within 1.5× the
/// absorbed form's own.
#[test]
fn expanded_prefill_is_independent_of_the_batch_and_as_accurate() {
    let paths = [
        fixtures().join("deepseek-v3"),
        fixtures().join("deepseek-v2"),
        fixtures().join("gguf/deepseek-v3.Q8_0.gguf"),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let absorbed = |opts| LoadOptions {
        mla_prefill: MlaPrefill::Absorbed,
        ..opts
    };
    for path in paths {
        let exact = open(&path, absorbed(LoadOptions::F32));
        let vocab = exact.config().vocab as u32;
        let lens = [41usize, 3, 23];
        let seqs: Vec<Vec<u32>> = lens
            .iter()
            .map(|&n| (0..n).map(|_| rng.random_range(0..vocab)).collect())
            .collect();
        let probe = [1usize, 2, 3, 23, 41];
        // Whole prompts from position 0 run expanded; single tokens absorbed.
        let chunks = [41usize, 1, 23];
        let alone = |m: &DecoderModel, rng: &mut ChaCha8Rng| -> Vec<Vec<Vec<f32>>> {
            seqs.iter()
                .enumerate()
                .map(|(i, s)| {
                    run(m, std::slice::from_ref(s), &chunks[i..=i], rng, &probe).remove(0)
                })
                .collect()
        };
        let want = alone(&exact, &mut rng);
        let max_diff = |a: &[Vec<Vec<f32>>]| {
            a.iter()
                .flatten()
                .flatten()
                .zip(want.iter().flatten().flatten())
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        };
        for opts in [LoadOptions::F32, LoadOptions::default()] {
            let auto = open(&path, opts);
            let got = alone(&auto, &mut rng);
            assert!(
                got != want,
                "{}: the long chunks ran expanded",
                path.display()
            );
            let together = run(&auto, &seqs, &chunks, &mut rng, &probe);
            assert!(together == got, "{} {opts:?}", path.display());
            let err = max_diff(&got);
            let bound = match opts.int8_activations {
                false => 1e-4,
                true => 1.5 * max_diff(&alone(&open(&path, absorbed(opts)), &mut rng)),
            };
            eprintln!(
                "{} {opts:?}: max |Δlogit| {err:.2e} (bound {bound:.2e})",
                path.display()
            );
            assert!(err <= bound, "{} {opts:?}: {err} > {bound}", path.display());
        }
    }
}

/// A sequence's state copied to another slot (a prefix-cache snapshot, a
/// preempted sequence restored from one) continues exactly as the
/// original: the copy takes every layer's whole state. (DeepSeek-V4's
/// layers keep states of different sizes: a layer that addressed its
/// slot by its own size instead of the slot's stride continued from
/// another region than the one copied.)
#[test]
fn a_state_copied_to_another_slot_continues_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for name in ["deepseek-v4", "qwen3-next", "kimi-linear"] {
        // Latent attention (Kimi Linear's) absorbed, as serving runs it:
        // chunks then take the arithmetic of single tokens.
        let opts = LoadOptions {
            mla_prefill: MlaPrefill::Absorbed,
            ..LoadOptions::default()
        };
        let m = open(&fixtures().join(name), opts);
        let vocab = m.config().vocab as u32;
        let toks: Vec<u32> = (0..54).map(|_| rng.random_range(0..vocab)).collect();
        let mut pool: KvPool = m.new_pool(BLOCK, 64, 4).expect("pool");
        let fwd = |pool: &mut KvPool, table: &[u32], slot: usize, from: usize, to: usize| {
            let step = SeqStep {
                tokens: &toks[from..to],
                pos0: from,
                table,
                logits: Logits::Last,
                state: slot,
            };
            m.forward_batch(pool, &[step]).expect("forward")
        };
        let blocks = toks.len().div_ceil(BLOCK) as u32;
        let first: Vec<u32> = (0..blocks).collect();
        let mut want = Vec::new();
        for p in 0..toks.len() {
            want.push(fwd(&mut pool, &first, 0, p, p + 1));
        }
        // Slot 1 runs to a block boundary, is copied to slot 3 through
        // slot 2 (a snapshot), and slot 3 goes on over the same cached
        // blocks and fresh ones.
        let cut = 9 * BLOCK;
        let second: Vec<u32> = (blocks..2 * blocks).collect();
        fwd(&mut pool, &second, 1, 0, 5);
        fwd(&mut pool, &second, 1, 5, cut);
        pool.copy_state(1, 2).expect("copy");
        pool.copy_state(2, 3).expect("copy");
        let mut third = second[..9].to_vec();
        third.extend(2 * blocks..3 * blocks - 9);
        let mut p = cut;
        for end in [cut + 11, toks.len() - 1, toks.len()] {
            let got = fwd(&mut pool, &third, 3, p, end);
            assert!(got == want[end - 1], "{name} at {end}");
            p = end;
        }
    }
}
