//! What one job on the thread pool costs: hand-out plus join of tasks that
//! do nothing (the floor every parallel kernel pays), and of 8 tasks that
//! each touch a cache line. A decode step of a 30-layer model runs about
//! ten jobs per layer, so 300 × this figure is the per-token
//! synchronization cost.
//!
//! `cargo bench -p kvant-kernels --bench pool`

use criterion::{criterion_group, criterion_main, Criterion};
use kvant_kernels::pool;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

fn fork_join(c: &mut Criterion) {
    let p = pool::global();
    let mut g = c.benchmark_group(format!("pool/{}threads", p.threads()));
    g.bench_function("empty job, 1 task per thread", |b| {
        b.iter(|| {
            p.run(black_box(p.threads()), &|t| {
                black_box(t);
            })
        })
    });
    let lines: Vec<AtomicU64> = (0..64).map(|_| AtomicU64::new(0)).collect();
    g.bench_function("8 tasks touching a line each", |b| {
        b.iter(|| {
            p.run(8, &|t| {
                lines[t * 8].fetch_add(1, Ordering::Relaxed);
            })
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(50);
    targets = fork_join
}
criterion_main!(benches);
