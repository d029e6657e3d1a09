//! A decode-shaped mixture-of-experts call (1 token, 64 Q4_0 experts,
//! top-6, hidden 1024, ff 256: the expert shape of the small MoE models)
//! against the memory roofline: a token reads only its 6 experts'
//! weights, so the speed limit is `read bandwidth / those bytes`.
//!
//! "cold": each call routes a fresh random token through the next of
//! several layers whose experts together far exceed the last-level cache,
//! as a decode step does; "hot": the same call repeated, its 2.6 MB of
//! weights cache-resident, which shows the fixed costs (routing plan,
//! quantization, two fork-joins, combine). "unfused" is the cold case run
//! the obvious way instead: per routed expert, gate and up as one
//! `forward_batch`, the gating, and down (two fork-joins per expert).
//!
//! `cargo bench -p kvant-kernels --bench moe`

use kvant_core::{DType, Storage, Tensor};
use kvant_kernels::activation::{gated, Activation};
use kvant_kernels::bandwidth::measure_read_bandwidth;
use kvant_kernels::cpu;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{forward_batch, LinearInput, LinearWeight};
use kvant_kernels::moe::{moe_ffn, route, Experts, MoeScratch, RouterInput, RouterParams, Routing};
use kvant_kernels::pool;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

const N_EXPERTS: usize = 64;
const TOP_K: usize = 6;
const HIDDEN: usize = 1024;
const FF: usize = 256;
/// 4 layers of 28 MB of experts: several times a 32 MB last-level cache.
const LAYERS: usize = 4;
/// Calls per measurement; the best of [`ROUNDS`] measurements is kept
/// (interference from other processes only ever slows a round down).
const CALLS: usize = 400;
const ROUNDS: usize = 5;

/// A random Q4_0 `[n, rows, cols]` stack (random quants, small scales).
fn stack(rng: &mut ChaCha8Rng, n: usize, rows: usize, cols: usize) -> Tensor {
    let dtype = DType::Q4_0;
    let blocks = n * rows * cols / dtype.block_size();
    let mut bytes = vec![0u8; blocks * dtype.block_bytes()];
    rng.fill(&mut bytes[..]);
    for b in bytes.chunks_exact_mut(dtype.block_bytes()) {
        let d = half::f16::from_f32(rng.random_range(-0.02f32..0.02));
        b[..2].copy_from_slice(&d.to_le_bytes());
    }
    Tensor::new(dtype, vec![n, rows, cols], Storage::Owned(bytes.into()), 0).unwrap()
}

/// A layer's experts, fused and as the separate weights (gate, up, down).
struct Layer {
    experts: Experts,
    weights: [Vec<LinearWeight>; 3],
}

fn layer(rng: &mut ChaCha8Rng) -> Layer {
    let mut prep = |rows, cols| -> Vec<LinearWeight> {
        let s = stack(rng, N_EXPERTS, rows, cols);
        (0..N_EXPERTS)
            .map(|i| LinearWeight::prepare(s.matrix(i).unwrap(), true).unwrap())
            .collect()
    };
    let weights = [prep(FF, HIDDEN), prep(FF, HIDDEN), prep(HIDDEN, FF)];
    let [gate, up, down] = weights.clone();
    Layer {
        experts: Experts::new(gate, up, down).unwrap(),
        weights,
    }
}

/// The per-expert way: 2 fork-joins per routed expert.
struct Unfused {
    q8: Q8Activations,
    gate: Vec<f32>,
    up: Vec<f32>,
    y: Vec<f32>,
}

impl Unfused {
    fn call(&mut self, l: &Layer, x: &[f32], ids: &[u32], w: &[f32], out: &mut [f32]) {
        let [gate, up, down] = &l.weights;
        out.fill(0.0);
        for (&e, &wt) in ids.iter().zip(w) {
            let e = e as usize;
            let input = LinearInput::new(x, 1, &mut self.q8, &[&gate[e]]).unwrap();
            forward_batch(
                &input,
                &mut [(&gate[e], &mut self.gate), (&up[e], &mut self.up)],
            )
            .unwrap();
            gated(Activation::Silu, &mut self.gate, &self.up);
            let input = LinearInput::new(&self.gate, 1, &mut self.q8, &[&down[e]]).unwrap();
            down[e].forward(&input, &mut self.y).unwrap();
            out.iter_mut().zip(&self.y).for_each(|(o, &v)| *o += wt * v);
        }
    }
}

/// One token's routing: random logits through a softmax top-k.
fn routed(rng: &mut ChaCha8Rng) -> ([u32; TOP_K], [f32; TOP_K]) {
    let logits: Vec<f32> = (0..N_EXPERTS)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let (mut ids, mut w) = ([0u32; TOP_K], [0f32; TOP_K]);
    let p = RouterParams::softmax(N_EXPERTS, TOP_K, true);
    let r = RouterInput::new(&p, &logits, None);
    route(&r, &mut ids, &mut w).unwrap();
    (ids, w)
}

type Call = ([u32; TOP_K], [f32; TOP_K], Vec<f32>);

/// Best seconds per call over the rounds, and the weight bytes per call.
fn measure(layers: &[Layer], calls: &[Call], fused: bool) -> (f64, f64) {
    let mut scratch = MoeScratch::default();
    let mut unfused = Unfused {
        q8: Q8Activations::default(),
        gate: vec![0.0; FF],
        up: vec![0.0; FF],
        y: vec![0.0; HIDDEN],
    };
    let mut out = vec![0f32; HIDDEN];
    let bytes: usize = calls
        .iter()
        .enumerate()
        .map(|(i, (ids, _, _))| {
            let l = &layers[i % layers.len()].experts;
            ids.iter()
                .map(|&e| l.expert_bytes(e as usize))
                .sum::<usize>()
        })
        .sum();
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        let t0 = Instant::now();
        for (i, (ids, w, x)) in calls.iter().enumerate() {
            let l = &layers[i % layers.len()];
            if fused {
                let (e, silu) = (&l.experts, Activation::Silu);
                let r = Routing {
                    ids,
                    weights: w,
                    n_tokens: 1,
                    top_k: TOP_K,
                };
                moe_ffn(cpu::tier(), e, silu, x, &r, &mut scratch, &mut out).unwrap();
            } else {
                unfused.call(l, x, ids, w, &mut out);
            }
        }
        best = best.min(t0.elapsed().as_secs_f64() / calls.len() as f64);
    }
    (best, bytes as f64 / calls.len() as f64)
}

fn main() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let layers: Vec<Layer> = (0..LAYERS).map(|_| layer(&mut rng)).collect();
    let threads = pool::global().threads();
    let bw = measure_read_bandwidth(256 << 20, threads, 5);
    println!(
        "moe decode: 1 token, {N_EXPERTS} Q4_0 experts of [{FF}x{HIDDEN}] x3, top-{TOP_K}, \
         {threads} thread(s); {:.1} MB of experts per layer; read bandwidth {:.2} GB/s",
        layers[0].experts.byte_len() as f64 / 1e6,
        bw / 1e9
    );
    let call = |rng: &mut ChaCha8Rng| {
        let (ids, w) = routed(rng);
        let x: Vec<f32> = (0..HIDDEN).map(|_| rng.random_range(-2.0..2.0)).collect();
        (ids, w, x)
    };
    let cold: Vec<_> = (0..CALLS).map(|_| call(&mut rng)).collect();
    let hot: Vec<_> = vec![call(&mut rng); CALLS];
    let runs = [
        ("cold", &cold, &layers[..], true),
        ("hot", &hot, &layers[..1], true),
        ("unfused", &cold, &layers[..], false),
    ];
    for (name, calls, used, fused) in runs {
        let (secs, bytes) = measure(used, calls, fused);
        let gbs = bytes / secs / 1e9;
        println!(
            "{name}: {:.1} us/call, {:.2} MB of weights read, {gbs:.2} GB/s = {:.0}% of the read bandwidth",
            secs * 1e6,
            bytes / 1e6,
            100.0 * gbs * 1e9 / bw
        );
    }
}
