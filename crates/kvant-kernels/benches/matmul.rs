//! Linear-layer throughput per weight type, through the production path
//! (`LinearWeight`: int8 kernels with 8-bit activations for Q4_0/Q4_1/
//! Q5_0/Q8_0/Q4_K/Q5_K/Q6_K, the f32-activation kernels for the rest; the
//! `f32act` group runs the int8 types on the f32-activation path): GEMV
//! (one token, decoding) and GEMM (64 tokens, prefill) on a SmolLM2-sized
//! 1536×576 weight (1536×512 for the 256-weight k-quants and 128-wide FP8
//! blocks, whose rows must be whole blocks), plus the small projections that decide the
//! fork-join threshold and four weights too large for the caches.
//!
//! Criterion reports `Gelem/s` as GFLOP/s (2 FLOPs per multiply-add) and
//! `GiB/s` as weight bytes streamed per second: a one-token matmul reads
//! each weight once, so its GiB/s is the figure to hold against the memory
//! bandwidth, which the bench measures and prints first (and the `bandwidth`
//! bench on its own). `KVANT_SIMD=scalar` benchmarks the portable path and
//! `KVANT_THREADS=1` a single core. The activation quantization of the int8
//! path is inside the timed loop, as in a forward pass.
//!
//! `cargo bench -p kvant-kernels --bench matmul [-- FILTER]`

#[path = "../tests/common/mod.rs"]
mod common;

use common::random_row;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvant_core::{DType, Storage, Tensor};
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::linear::{LinearInput, LinearWeight};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;
use std::time::Duration;

fn random_weight(rng: &mut ChaCha8Rng, dtype: DType, out: usize, inp: usize) -> Tensor {
    let bytes = random_row(rng, dtype, out * inp);
    Tensor::new(dtype, vec![out, inp], Storage::Owned(bytes.into()), 0).expect("weight tensor")
}

fn bench_one(c: &mut Criterion, group: &str, dtype: DType, out: usize, inp: usize, tokens: usize) {
    let int8 = group != "f32act";
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let w = LinearWeight::prepare(random_weight(&mut rng, dtype, out, inp), int8).expect("weight");
    let mut q8 = Q8Activations::default();
    let x: Vec<f32> = (0..tokens * inp)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let mut y = vec![0f32; tokens * out];
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::ElementsAndBytes {
        elements: (2 * out * inp * tokens) as u64,
        bytes: w.byte_len() as u64,
    });
    let id = BenchmarkId::new(dtype.name(), format!("{out}x{inp}/n={tokens}"));
    g.bench_function(id, |b| {
        b.iter(|| {
            let input = LinearInput::new(black_box(&x), tokens, &mut q8, &[&w]).expect("input");
            w.forward(&input, &mut y).expect("forward")
        })
    });
    g.finish();
}

/// The types SmolLM2 and Gemma 3 use first, then the rest.
const TYPES: [DType; 16] = [
    DType::Q4_1,
    DType::Q8_0,
    DType::Q5_0,
    DType::Q4_K,
    DType::Q6_K,
    DType::Q4_0,
    DType::F16,
    DType::Q5_1,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q5_K,
    DType::BF16,
    DType::F32,
    DType::MXFP4,
    DType::NVFP4,
    DType::F8_B128,
];

fn shape(dtype: DType) -> (usize, usize) {
    if dtype.block_size() > 64 {
        (1536, 512)
    } else {
        (1536, 576)
    }
}

fn gemv(c: &mut Criterion) {
    for dtype in TYPES {
        let (out, inp) = shape(dtype);
        bench_one(c, "gemv", dtype, out, inp, 1);
    }
}

fn gemm(c: &mut Criterion) {
    for dtype in TYPES {
        let (out, inp) = shape(dtype);
        bench_one(c, "gemm", dtype, out, inp, 64);
    }
}

/// The int8 types again on the f32-activation path, for the comparison.
fn f32act(c: &mut Criterion) {
    for dtype in [
        DType::Q4_1,
        DType::Q8_0,
        DType::Q5_0,
        DType::Q4_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ] {
        let (out, inp) = shape(dtype);
        bench_one(c, "f32act", dtype, out, inp, 1);
        bench_one(c, "f32act", dtype, out, inp, 64);
    }
}

/// The measured peak next to which the GiB/s figures are read.
fn peaks(_: &mut Criterion) {
    let threads = kvant_kernels::pool::global().threads();
    let bw = kvant_kernels::bandwidth::measure_read_bandwidth(256 << 20, threads, 3);
    println!(
        "measured DRAM read bandwidth, {threads} thread(s): {:.2} GB/s ({:.2} GiB/s)",
        bw / 1e9,
        bw / (1u64 << 30) as f64
    );
}

/// SmolLM2's k/v (192×576), q/o (576×576) and down (576×1536) projections,
/// one token: where the fork-join threshold shows.
fn small(c: &mut Criterion) {
    for (out, inp) in [(192, 576), (576, 576), (576, 1536)] {
        bench_one(c, "small", DType::Q4_1, out, inp, 1);
    }
}

/// Weights larger than the last-level cache, as a whole model's are across
/// one token: SmolLM2's Q8_0 output layer (49152×576, 30 MB), a 42 MB
/// Q4_1 matrix, a 41 MB Q6_K output layer (49152×1024: `llama-quantize`
/// writes the output layer as Q6_K even in Q4_0 files), that one also on
/// the f32-activation path, and a Q4_K matrix of the same shape. Here the
/// figure to watch is GiB/s against the DRAM bandwidth.
fn dram(c: &mut Criterion) {
    bench_one(c, "dram", DType::Q8_0, 49152, 576, 1);
    bench_one(c, "dram", DType::Q4_1, 65536, 1024, 1);
    bench_one(c, "dram", DType::Q6_K, 49152, 1024, 1);
    bench_one(c, "dram", DType::Q4_K, 49152, 1024, 1);
    bench_one(c, "f32act", DType::Q6_K, 49152, 1024, 1);
    // Block-scaled FP8 (1.03 bytes a weight) against Q8_0 (1.06) of the
    // same shape, and MXFP4 (0.53) against Q4_0 (0.56).
    bench_one(c, "dram", DType::F8_B128, 49152, 1024, 1);
    bench_one(c, "dram", DType::Q8_0, 49152, 1024, 1);
    bench_one(c, "dram", DType::MXFP4, 49152, 1024, 1);
    bench_one(c, "dram", DType::Q4_0, 49152, 1024, 1);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = peaks, gemv, gemm, f32act, small, dram
}
criterion_main!(benches);
