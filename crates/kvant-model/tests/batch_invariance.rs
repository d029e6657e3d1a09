//! A sequence's logits do not depend on the batch it runs in: alone in a
//! pool of its own, or sharing forward passes with other sequences, with
//! its prompt cut into different chunks, in shuffled blocks. This is what
//! makes a served request's output independent of the load (the serving
//! engine's batch invariance), so it is checked bit for bit.

use kvant_model::arch::decoder::{DecoderModel, LoadOptions, Logits, SeqStep};
use kvant_model::checkpoint::Checkpoint;
use kvant_model::kv::KvPool;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models")
}

fn open(path: &Path, opts: LoadOptions) -> DecoderModel {
    let ckpt = Checkpoint::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cfg = ckpt.config().expect("config");
    DecoderModel::load(&ckpt, cfg, opts).expect("load")
}

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
    let mut pool: KvPool = m.new_pool(BLOCK, need + 3).expect("pool");
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
    ];
    paths.extend(
        ["llama-gqa.Q4_0.gguf", "llama-mqa-tied.Q8_0.gguf"]
            .iter()
            .map(|f| fixtures().join("gguf").join(f)),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for path in paths {
        for opts in [LoadOptions::default(), LoadOptions::F32] {
            let m = open(&path, opts);
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
                    let mut r = run(&m, std::slice::from_ref(s), &[1], &mut rng, &probe);
                    r.remove(0)
                })
                .collect();
            for chunks in [[1usize, 1, 1], [4, 1, 3], [29, 6, 17], [7, 2, 5]] {
                let together = run(&m, &seqs, &chunks, &mut rng, &probe);
                for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
                    // Compare the probes both runs hit (chunking skips some).
                    let ends_a: Vec<usize> = probe_ends(lens[i], 1, &probe);
                    let ends_b: Vec<usize> = probe_ends(lens[i], chunks[i], &probe);
                    for (j, e) in ends_b.iter().enumerate() {
                        let k = ends_a
                            .iter()
                            .position(|x| x == e)
                            .expect("alone probes all");
                        assert!(
                            a[k] == b[j],
                            "{} {opts:?} seq {i} chunks {chunks:?} at {e}",
                            path.display()
                        );
                    }
                }
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
