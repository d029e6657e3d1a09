//! The gated delta rule (`kvant_kernels::delta`) on one Gated DeltaNet
//! layer of Qwen3.5-0.8B's shape (16 key and 16 value heads of 128): a
//! prompt chunk of 512 tokens from the start, and one decode token at
//! positions 520 and 16392 (both 8 tokens into a chunk of 16: the state is
//! one matrix per head plus the chunk's rows, so the cost must not depend
//! on the position).
//!
//! The same prefill with a decay per key channel (Kimi Delta Attention;
//! Kimi Linear's layers have 32 heads of 128, here 16 for the same work
//! per head).
//!
//! Throughput is FLOPs: twice the chunk-aligned form's multiply-adds per
//! token and head at position `c` of its chunk, `3·dk·dv + 2·c·(dk + dv)`
//! (two reads of the state, the fold amortised over the chunk, the
//! intra-chunk sums; see the module docs), to hold against the cores' FMA
//! peak.
//!
//! `cargo bench -p kvant-kernels --bench delta` (`KVANT_THREADS=1` for one core)

mod config;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvant_kernels::delta::{delta_rule, DeltaInputs, DeltaParams, DeltaSeq, HeadSharing};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;

const P: DeltaParams = DeltaParams {
    n_k_heads: 16,
    n_v_heads: 16,
    sharing: HeadSharing::Grouped,
    dk: 128,
    dv: 128,
    chunk: 16,
    channel_decay: false,
};

/// Random inputs for `n` tokens: unit-norm keys, queries scaled by
/// `1/√dk`, decays in `[-1, 0)`.
/// Kimi Delta Attention's decay per key channel, otherwise `P`.
const KDA: DeltaParams = DeltaParams {
    channel_decay: true,
    ..P
};

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    beta: Vec<f32>,
    g: Vec<f32>,
}

impl Inputs {
    fn new(n: usize) -> Inputs {
        Inputs::with(&P, n)
    }

    fn with(p: &DeltaParams, n: usize) -> Inputs {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut r = |len: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..len).map(|_| rng.random_range(lo..hi)).collect()
        };
        let qk = n * P.n_k_heads * P.dk;
        let (mut q, mut k) = (r(qk, -1.0, 1.0), r(qk, -1.0, 1.0));
        for (x, scale) in [(&mut q, 1.0 / (P.dk as f32).sqrt()), (&mut k, 1.0)] {
            for h in x.chunks_exact_mut(P.dk) {
                let norm = h.iter().map(|v| v * v).sum::<f32>().sqrt();
                h.iter_mut().for_each(|v| *v *= scale / norm);
            }
        }
        Inputs {
            v: r(n * P.n_v_heads * P.dv, -1.0, 1.0),
            beta: r(n * P.n_v_heads, 0.0, 1.0),
            g: r(n * p.n_v_heads * p.g_dim(), -1.0, 0.0),
            q,
            k,
        }
    }

    fn view(&self) -> DeltaInputs<'_> {
        DeltaInputs {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            beta: &self.beta,
            g: &self.g,
        }
    }
}

/// FLOPs of tokens at positions `pos` (see the file docs).
fn flops(pos: std::ops::Range<usize>) -> u64 {
    let per_head = |p: usize| {
        let c = p % P.chunk;
        2 * (3 * P.dk * P.dv + 2 * c * (P.dk + P.dv))
    };
    pos.map(|p| (per_head(p) * P.n_v_heads) as u64).sum()
}

fn prefill(c: &mut Criterion) {
    let n = 512;
    let mut g = c.benchmark_group("delta rule prefill, Qwen3.5-0.8B layer, 512 tokens");
    for (name, p) in [
        ("per-head decay (elements = FLOPs)", P),
        ("per-channel decay, KDA (elements = FLOPs)", KDA),
    ] {
        let x = Inputs::with(&p, n);
        let mut state = vec![0f32; p.state_len()];
        let mut out = vec![0f32; n * p.n_v_heads * p.dv];
        let seqs = [DeltaSeq {
            rows: 0..n,
            pos0: 0,
            slot: 0,
        }];
        g.throughput(Throughput::Elements(flops(0..n)));
        g.bench_function(name, |b| {
            b.iter(|| {
                delta_rule(&p, black_box(x.view()), &seqs, &mut state, &mut out).expect("shape")
            })
        });
    }
    g.finish();
}

fn decode(c: &mut Criterion) {
    let x = Inputs::new(1);
    let mut out = vec![0f32; P.n_v_heads * P.dv];
    let mut g = c.benchmark_group("delta rule decode, Qwen3.5-0.8B layer, one token");
    for pos in [520, 16392] {
        // A state whose chunk already holds the positions before `pos`.
        let warm = Inputs::new(pos % P.chunk);
        let mut state = vec![0f32; P.state_len()];
        let mut scratch = vec![0f32; (pos % P.chunk) * P.n_v_heads * P.dv];
        let start = [DeltaSeq {
            rows: 0..pos % P.chunk,
            pos0: pos - pos % P.chunk,
            slot: 0,
        }];
        delta_rule(&P, warm.view(), &start, &mut state, &mut scratch).expect("shape");
        let seqs = [DeltaSeq {
            rows: 0..1,
            pos0: pos,
            slot: 0,
        }];
        g.throughput(Throughput::Elements(flops(pos..pos + 1)));
        g.bench_function(format!("position {pos} (elements = FLOPs)"), |b| {
            // The same step again each time: the chunk's row at `pos` is
            // rewritten, so the work per call stays that of position `pos`.
            b.iter(|| {
                delta_rule(&P, black_box(x.view()), &seqs, &mut state, &mut out).expect("shape")
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = config::short();
    targets = prefill, decode
}
criterion_main!(benches);
