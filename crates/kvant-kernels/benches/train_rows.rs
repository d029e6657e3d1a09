//! Row-wise training kernels (RMSNorm, fused add+RMSNorm, LayerNorm, RoPE,
//! SwiGLU/GeGLU) forward and backward, f32 and bf16, on 2 threads. They
//! are bandwidth-bound, so throughput is reported as GB/s of bytes read
//! plus bytes written (each tensor once, as the kernels touch memory);
//! read it against `cargo bench -p kvant-kernels --bench bandwidth`.
//!
//! `cargo bench -p kvant-kernels --bench train_rows`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use half::bf16;
use kvant_kernels::pool;
use kvant_kernels::train::glu::{glu_bwd, glu_fwd, Glu};
use kvant_kernels::train::norm::*;
use kvant_kernels::train::rope::{rope_apply, RopeLayout, RopeShape};
use kvant_kernels::train::Elem;
use std::time::Duration;

const THREADS: usize = 2;

fn data<E: Elem>(n: usize, seed: u32) -> Vec<E> {
    // A cheap deterministic spread in [-2, 2).
    (0..n)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
            E::from_f32((h >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0)
        })
        .collect()
}

fn norms<E: Elem>(c: &mut Criterion, name: &str, rows: usize) {
    let cols = 4096usize;
    let n = rows * cols;
    let sz = std::mem::size_of::<E>() as u64;
    let mut g = c.benchmark_group(format!("train_rows/{name}/norm {rows}x{cols}"));
    let x: Vec<E> = data(n, 1);
    let res: Vec<E> = data(n, 2);
    let dy: Vec<E> = data(n, 3);
    let w: Vec<E> = data(cols, 4);
    let (mut y, mut s, mut dx) = (data::<E>(n, 5), data::<E>(n, 6), data::<E>(n, 7));
    let (mut rstd, mut mean) = (vec![0f32; rows], vec![0f32; rows]);
    let (mut dw, mut db) = (vec![0f32; cols], vec![0f32; cols]);
    let a = RmsNormArgs {
        cols,
        eps: 1e-6,
        offset: 0.0,
        casting: RmsCasting::Llama,
    };
    let bytes = |tensors: u64| Throughput::BytesDecimal(tensors * n as u64 * sz);
    g.throughput(bytes(2));
    g.bench_function("rms fwd", |b| {
        b.iter(|| rms_norm_fwd(&x, &w, a, &mut y, &mut rstd).unwrap())
    });
    let gemma = RmsNormArgs {
        offset: 1.0,
        casting: RmsCasting::Gemma,
        ..a
    };
    g.bench_function("rms fwd gemma", |b| {
        b.iter(|| rms_norm_fwd(&x, &w, gemma, &mut y, &mut rstd).unwrap())
    });
    g.throughput(bytes(3));
    g.bench_function("rms bwd", |b| {
        b.iter(|| rms_norm_bwd(&dy, &x, &w, &rstd, a, &mut dx, &mut dw).unwrap())
    });
    g.throughput(bytes(4));
    g.bench_function("add+rms fwd", |b| {
        b.iter(|| add_rms_norm_fwd(&x, &res, &w, a, &mut y, &mut s, &mut rstd).unwrap())
    });
    g.bench_function("add+rms bwd", |b| {
        b.iter(|| add_rms_norm_bwd(&dy, &res, &x, &w, &rstd, a, &mut dx, &mut dw).unwrap())
    });
    g.throughput(bytes(2));
    g.bench_function("layernorm fwd", |b| {
        b.iter(|| layer_norm_fwd(&x, &w, &w, cols, 1e-5, &mut y, &mut mean, &mut rstd).unwrap())
    });
    g.throughput(bytes(3));
    g.bench_function("layernorm bwd", |b| {
        b.iter(|| {
            layer_norm_bwd(&dy, &x, &w, &mean, &rstd, cols, &mut dx, &mut dw, &mut db).unwrap()
        })
    });
    g.finish();
}

fn rope<E: Elem>(c: &mut Criterion, name: &str) {
    let (bt, h, s, d) = (4usize, 32usize, 512usize, 128usize);
    let n = bt * h * s * d;
    let sz = std::mem::size_of::<E>() as u64;
    let mut g = c.benchmark_group(format!("train_rows/{name}/rope [{bt},{h},{s},{d}]"));
    g.throughput(Throughput::BytesDecimal(2 * n as u64 * sz));
    let mut x: Vec<E> = data(n, 1);
    let cos: Vec<E> = data(s * d / 2, 2);
    let sin: Vec<E> = data(s * d / 2, 3);
    let shape = RopeShape {
        batch: bt,
        heads: h,
        seq: s,
        head_dim: d,
        rot_dim: d,
        strides: [h * s * d, s * d, d],
        per_batch_tables: false,
        layout: RopeLayout::HalfSplit,
    };
    // The rotations keep |x| (up to the random tables' scale), so x is
    // rotated in place again and again.
    for (label, sh) in [
        ("half-split", shape),
        (
            "half-split [b,s,h,d] memory",
            RopeShape {
                strides: [s * h * d, d, h * d],
                ..shape
            },
        ),
        (
            "interleaved",
            RopeShape {
                layout: RopeLayout::Interleaved,
                ..shape
            },
        ),
    ] {
        for inverse in [false, true] {
            let dir = if inverse { "bwd" } else { "fwd" };
            g.bench_function(format!("{label} {dir}"), |b| {
                b.iter(|| rope_apply(&mut x, &cos, &sin, &sh, inverse).unwrap())
            });
        }
    }
    g.finish();
}

fn glu<E: Elem>(c: &mut Criterion, name: &str) {
    let (rows, cols) = (4096usize, 11008usize);
    let n = rows * cols;
    let sz = std::mem::size_of::<E>() as u64;
    let mut g = c.benchmark_group(format!("train_rows/{name}/glu {rows}x{cols}"));
    let a: Vec<E> = data(n, 1);
    let bv: Vec<E> = data(n, 2);
    let dc: Vec<E> = data(n, 3);
    let mut out: Vec<E> = data(n, 4);
    for kind in [Glu::Swi, Glu::GeTanh] {
        g.throughput(Throughput::BytesDecimal(3 * n as u64 * sz));
        g.bench_function(format!("{kind:?} fwd"), |b| {
            b.iter(|| glu_fwd(kind, &a, &bv, &mut out).unwrap())
        });
        // Reads dc, a, b; writes da, db over a, b. The inputs are restored
        // (untimed) before every run: gradients written over them would
        // shrink towards subnormals.
        g.throughput(Throughput::BytesDecimal(5 * n as u64 * sz));
        g.bench_function(format!("{kind:?} bwd"), |b| {
            b.iter_batched_ref(
                || (a.clone(), bv.clone()),
                |(x, y)| glu_bwd(kind, &dc, x, y).unwrap(),
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

fn all(c: &mut Criterion) {
    if let Err(e) = pool::set_global_threads(THREADS) {
        eprintln!("train_rows: {e}");
    }
    let only = std::env::var("TRAIN_ROWS").unwrap_or_default();
    let on = |k: &str| only.is_empty() || only.split(',').any(|o| o == k);
    if on("norm") {
        norms::<f32>(c, "f32", 4096);
        norms::<bf16>(c, "bf16", 4096);
    }
    // In cache (L2): the kernels' compute ceiling, not a bandwidth figure.
    if only.split(',').any(|o| o == "hot") {
        norms::<f32>(c, "f32 in cache", 16);
        norms::<bf16>(c, "bf16 in cache", 16);
    }
    if on("rope") {
        rope::<f32>(c, "f32");
        rope::<bf16>(c, "bf16");
    }
    if on("glu") {
        glu::<f32>(c, "f32");
        glu::<bf16>(c, "bf16");
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10);
    targets = all
}
criterion_main!(benches);
