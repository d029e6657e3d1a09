//! `train::gemm` at the linear cross-entropy's three shapes (n, h, v) =
//! (256, 512, 32000): logits `X·Wᵀ` (NT), `dX = G·W` (NN), `dW = Gᵀ·X`
//! (TN), f32 and bf16 inputs; throughput in elements/s is FLOP/s. The
//! machine is shared, so wall-clock numbers here swing 2x; the measured
//! per-thread CPU-time table against torch is in `train::gemm`'s doc.
//!
//! `cargo bench -p kvant-train --bench train_gemm`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use half::bf16;
use kvant_train::gemm::{gemm, GemmArgs, MatRef};
use kvant_train::Elem;
use rand::{Rng, SeedableRng};
use std::time::Duration;

fn shapes<E: Elem>(c: &mut Criterion, name: &str) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut rand = |len: usize| -> Vec<E> {
        (0..len)
            .map(|_| E::from_f32(rng.random_range(-1.0f32..1.0)))
            .collect()
    };
    let mut g = c.benchmark_group("train_gemm");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    // (label, m, n, k, A transposed, B transposed)
    for (label, m, n, k, ta, tb) in [
        ("nt_256x32000x512", 256, 32000, 512, false, true),
        ("nn_256x512x32000", 256, 512, 32000, false, false),
        ("tn_32000x512x256", 32000, 512, 256, true, false),
    ] {
        let a = rand(m * k);
        let b = rand(k * n);
        let mut cm = vec![0f32; m * n];
        g.throughput(Throughput::Elements((2 * m * n * k) as u64));
        g.bench_function(format!("{label}_{name}"), |bch| {
            bch.iter(|| {
                let am = match ta {
                    false => MatRef::row_major(&a[..], m, k).unwrap(),
                    true => MatRef::row_major(&a[..], k, m).unwrap().t(),
                };
                let bm = match tb {
                    false => MatRef::row_major(&b[..], k, n).unwrap(),
                    true => MatRef::row_major(&b[..], n, k).unwrap().t(),
                };
                gemm(GemmArgs::new(am, bm, &mut cm, n)).unwrap();
            })
        });
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    shapes::<f32>(c, "f32");
    shapes::<bf16>(c, "bf16");
}

criterion_group!(train_gemm, benches);
criterion_main!(train_gemm);
