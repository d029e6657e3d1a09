//! Training losses: cross-entropy forward + gradient (bytes moved: two
//! reads and one write of the logits) at rows 4096 × vocab 32000 in f32 and
//! bf16, and the fused linear cross-entropy at (n, h, v) = (1024, 512,
//! 32000) against its three GEMMs alone (logits `x·Wᵀ`, `dx = G·W`,
//! `dW = Gᵀ·x` on the whole `[n, v]`), whose difference is the epilogue's
//! (and the chunking's) overhead.
//!
//! Measured 2026-12-04 on 2 cores shared with other jobs (noisy, ±10%):
//! CE f32 90–96 ms (15–16 GiB/s), bf16 121–155 ms; both bound by the two
//! vector exponentials per value (perf), not by bytes. torch 2.15 eager
//! `cross_entropy` + backward, 2 threads, same shapes: 1159 ms f32, 525 ms
//! bf16. Linear CE on `train::gemm` (CPU seconds of the whole process,
//! the VM being shared: ~1 core was ours): f32 1.85 s with the default 64-row
//! chunks, 1.48 s at 128, 1.29–1.32 s at 256–1024 rows; bf16 1.46 s / 1.14 s
//! / 1.02–1.06 s. torch eager linear + CE + backward, 1 thread: f32 1.50 s,
//! bf16 0.65 s (all three of its bf16 GEMMs on AVX-512 BF16; here only the
//! logits are bf16 × bf16, `G` is f32). At 64 rows per chunk `W` is packed
//! three times and `dW` read and written once per 64 rows, which the
//! GEMMs' 128 flops per element cannot hide.
//!
//! `cargo bench -p kvant-train --bench train_losses`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use kvant_kernels::{cpu, pool};
use kvant_train::cross_entropy::{cross_entropy_fwd, CeArgs, CeOptions};
use kvant_train::gemm::{gemm, GemmArgs, MatRef};
use kvant_train::linear_ce::{linear_cross_entropy, LinearCeArgs, LinearCeGrads};
use kvant_train::Elem;
use rand::{Rng, SeedableRng};
use std::time::Duration;

fn ce<E: Elem>(c: &mut Criterion, name: &str) {
    let (rows, vocab) = (4096usize, 32000usize);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut logits: Vec<E> = (0..rows * vocab)
        .map(|_| E::from_f32(rng.random_range(-8.0..8.0)))
        .collect();
    let targets: Vec<i64> = (0..rows)
        .map(|_| rng.random_range(0..vocab as i64))
        .collect();
    let mut losses = vec![0f32; rows];
    let a = CeArgs {
        targets: &targets,
        vocab,
        options: CeOptions::default(),
    };
    let (pool, tier) = (pool::global(), cpu::tier());
    let mut g = c.benchmark_group("cross_entropy_fwd_grad");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Bytes(
        (3 * rows * vocab * size_of::<E>()) as u64,
    ));
    g.bench_function(name, |b| {
        // The gradient overwrites the logits: later runs see the gradient
        // (finite values), the same work.
        b.iter(|| cross_entropy_fwd(pool, tier, &a, &mut logits, &mut losses, true).unwrap())
    });
    g.finish();
}

fn linear<E: Elem>(c: &mut Criterion, name: &str) {
    let (n, h, v) = (1024usize, 512usize, 32000usize);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let x: Vec<E> = (0..n * h)
        .map(|_| E::from_f32(rng.random_range(-1.0..1.0)))
        .collect();
    let w: Vec<E> = (0..v * h)
        .map(|_| E::from_f32(rng.random_range(-0.05..0.05)))
        .collect();
    let targets: Vec<i64> = (0..n).map(|_| rng.random_range(0..v as i64)).collect();
    let mut losses = vec![0f32; n];
    let mut dx = vec![E::from_f32(0.0); n * h];
    let mut dw = vec![0f32; v * h];
    let a = LinearCeArgs {
        x: &x,
        w: &w,
        bias: None,
        hidden: h,
        ce: CeArgs {
            targets: &targets,
            vocab: v,
            options: CeOptions::default(),
        },
        row_scale: None,
        chunk: None,
    };
    let mut g = c.benchmark_group("linear_cross_entropy");
    g.sample_size(10).measurement_time(Duration::from_secs(20));
    g.bench_function(format!("fused_{name}"), |b| {
        b.iter(|| {
            let grads = LinearCeGrads {
                dx: &mut dx,
                dw: &mut dw,
                dbias: None,
            };
            linear_cross_entropy(&a, &mut losses, Some(grads)).unwrap()
        })
    });
    let mut logits = vec![0f32; n * v];
    let mut dxf = vec![0f32; n * h];
    g.bench_function(format!("three_gemms_{name}"), |b| {
        b.iter(|| {
            let xm = MatRef::row_major(&x[..], n, h).unwrap();
            let wm = MatRef::row_major(&w[..], v, h).unwrap();
            gemm(GemmArgs::new(xm, wm.t(), &mut logits, v)).unwrap();
            let gm = MatRef::row_major(&logits[..], n, v).unwrap();
            gemm(GemmArgs::new(gm, wm, &mut dxf, h)).unwrap();
            gemm(GemmArgs::new(gm.t(), xm, &mut dw, h)).unwrap();
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    ce::<f32>(c, "f32_4096x32000");
    ce::<bf16>(c, "bf16_4096x32000");
    linear::<f32>(c, "f32_1024x512x32000");
    linear::<bf16>(c, "bf16_1024x512x32000");
}

criterion_group!(train_losses, benches);
criterion_main!(train_losses);
