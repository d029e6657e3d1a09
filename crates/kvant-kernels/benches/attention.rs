//! One decode step of attention over a long context, per KV cache type:
//! SmolLM2-135M's shape (9 query heads, 3 KV heads of 64), one token
//! attending to 2048 positions, in one contiguous block (the CLI's cache)
//! and in blocks of 16 (`serve`'s pool); and DeepSeek-V3's latent cache
//! (16 heads, as on one rank of 8, over latent rows of 576 whose first 512
//! values are the values), in blocks of 16. Throughput is the KV bytes the
//! step reads; f16 and f32 show what widening costs over streaming, the
//! block types what reading their blocks directly costs.
//!
//! A prompt chunk: 512 tokens of SmolLM2's shape after 4096 cached ones,
//! f16 keys and values in blocks of 16; throughput is the chunk's
//! multiply-adds ×2 (q·k and p·v: `4 · head_dim` FLOPs per visible pair
//! and head), to hold against the cores' FMA peak.
//!
//! A whole decode step's attention over every layer (Gemma 3's three
//! global layers at 32k positions, SmolLM2's 30 at 8192), each layer's
//! cache its own contiguous block as the CLI holds it: more than the
//! last-level cache, so this is the DRAM stream of a decode step at depth
//! (one layer's 32 MB alone stays partly in a 32 MB L3); throughput is the
//! bytes read.
//!
//! `KVANT_THREADS=1 cargo bench -p kvant-kernels --bench attention`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvant_kernels::attention::{attention_dyn, AttnParams, KvBuffer, KvDType, KvLayer, SeqAttn};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;
use std::time::Duration;

const CONTEXT: usize = 2048;

fn decode(c: &mut Criterion) {
    let p = AttnParams {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        v_dim: 64,
        scale: 0.125,
        window: None,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let kv_dim = p.n_kv_heads * p.head_dim;
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
    let (k, v, q) = (
        rand(CONTEXT * kv_dim),
        rand(CONTEXT * kv_dim),
        rand(p.n_heads * p.head_dim),
    );
    let mut out = vec![0f32; p.n_heads * p.v_dim];
    let mut g = c.benchmark_group(format!("attention decode, {CONTEXT} positions"));
    for block_size in [CONTEXT, 16] {
        let table: Vec<u32> = (0..(CONTEXT / block_size) as u32).collect();
        for dtype in KvDType::ALL {
            let buf = |x: &[f32]| {
                let mut b = KvBuffer::zeroed(dtype, CONTEXT * kv_dim).expect("whole units");
                b.store_rows(x, (block_size, p.n_kv_heads, p.head_dim), &table, 0);
                b
            };
            let (kb, vb) = (buf(&k), buf(&v));
            let layer = KvLayer {
                k: &kb,
                v: Some(&vb),
                block_size,
            };
            let seqs = [SeqAttn {
                rows: 0..1,
                pos0: CONTEXT - 1,
                table: &table,
            }];
            g.throughput(Throughput::Bytes((kb.bytes() + vb.bytes()) as u64));
            g.bench_function(format!("{dtype}, blocks of {block_size}"), |b| {
                b.iter(|| attention_dyn(&p, black_box(&q), &layer, &seqs, &mut out))
            });
        }
    }
    g.finish();
}

fn latent(c: &mut Criterion) {
    let p = AttnParams {
        n_heads: 16,
        n_kv_heads: 1,
        head_dim: 576,
        v_dim: 512,
        scale: 0.07,
        window: None,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
    let (k, q) = (rand(CONTEXT * p.head_dim), rand(p.n_heads * p.head_dim));
    let mut out = vec![0f32; p.n_heads * p.v_dim];
    let block_size = 16;
    let table: Vec<u32> = (0..(CONTEXT / block_size) as u32).collect();
    let mut g = c.benchmark_group(format!("latent attention decode, {CONTEXT} positions"));
    for dtype in KvDType::ALL {
        let mut kb = KvBuffer::zeroed(dtype, CONTEXT * p.head_dim).expect("whole units");
        kb.store_rows(&k, (block_size, 1, p.head_dim), &table, 0);
        let layer = KvLayer {
            k: &kb,
            v: None,
            block_size,
        };
        let seqs = [SeqAttn {
            rows: 0..1,
            pos0: CONTEXT - 1,
            table: &table,
        }];
        g.throughput(Throughput::Bytes(kb.bytes() as u64));
        g.bench_function(format!("{dtype}, 16 heads, blocks of {block_size}"), |b| {
            b.iter(|| attention_dyn(&p, black_box(&q), &layer, &seqs, &mut out))
        });
    }
    g.finish();
}

fn prefill(c: &mut Criterion) {
    // A 512-token chunk (the engine's prefill chunk) of SmolLM2's heads
    // after 4096 tokens and of Gemma 3 270M's global layer (4 query heads
    // of 256 on one KV head) after 8192.
    let smol = AttnParams {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        v_dim: 64,
        scale: 0.125,
        window: None,
    };
    let gemma = AttnParams {
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 256,
        v_dim: 256,
        scale: 0.0625,
        window: None,
    };
    prefill_case(c, "smollm2", smol, 4096, 512);
    prefill_case(c, "gemma3", gemma, 8192, 512);
    decode_case(c, "gemma3", gemma, 32768);
    // Gemma 3's sliding-window layers (512 positions): a decode step at
    // 32k positions reads only its window, so it costs what one at 1k does.
    let local = AttnParams {
        window: Some(512),
        ..gemma
    };
    decode_case(c, "gemma3 sliding window 512", local, 1024);
    decode_case(c, "gemma3 sliding window 512", local, 32768);
    // A whole decode step's attention, every layer with its own cache, as
    // the CLI holds it (one contiguous block per layer): more bytes than
    // the last-level cache holds, so this is the DRAM stream a decode step
    // at depth reads (one layer's 32 MB alone stays partly in a 32 MB L3).
    layers_case(c, "gemma3 global layers", gemma, 32768, 3);
    layers_case(c, "smollm2", smol, 8192, 30);
}

/// One token attending to `ctx` positions in each of `layers` layers,
/// f16 caches of one contiguous block each; throughput is the bytes read.
fn layers_case(c: &mut Criterion, name: &str, p: AttnParams, ctx: usize, layers: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let kv_dim = p.n_kv_heads * p.head_dim;
    let dims = (ctx, p.n_kv_heads, p.head_dim);
    let table = [0u32];
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
    let caches: Vec<(KvBuffer, KvBuffer)> = (0..layers)
        .map(|_| {
            let mut k = KvBuffer::zeroed(KvDType::F16, ctx * kv_dim).expect("whole units");
            let mut v = KvBuffer::zeroed(KvDType::F16, ctx * kv_dim).expect("whole units");
            k.store_rows(&rand(ctx * kv_dim), dims, &table, 0);
            v.store_rows(&rand(ctx * kv_dim), dims, &table, 0);
            (k, v)
        })
        .collect();
    let q = rand(p.n_heads * p.head_dim);
    let mut out = vec![0f32; p.n_heads * p.v_dim];
    let seqs = [SeqAttn {
        rows: 0..1,
        pos0: ctx - 1,
        table: &table,
    }];
    let bytes: usize = caches.iter().map(|(k, v)| k.bytes() + v.bytes()).sum();
    let mut g = c.benchmark_group(format!(
        "attention decode step, {name}, {layers} layers x {ctx} positions"
    ));
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("f16, contiguous", |b| {
        b.iter(|| {
            for (k, v) in &caches {
                let layer = KvLayer {
                    k,
                    v: Some(v),
                    block_size: ctx,
                };
                attention_dyn(&p, black_box(&q), &layer, &seqs, &mut out);
            }
        })
    });
    g.finish();
}

/// One token attending to `ctx` positions (the last `window` of them in a
/// sliding-window layer).
fn decode_case(c: &mut Criterion, name: &str, p: AttnParams, ctx: usize) {
    let group = format!("attention decode, {name}, {ctx} positions");
    chunk_case(c, &group, p, ctx - 1, 1);
}

/// `chunk` tokens after `depth` cached ones.
fn prefill_case(c: &mut Criterion, name: &str, p: AttnParams, depth: usize, chunk: usize) {
    let group = format!("attention prefill, {name}, {chunk} tokens at depth {depth}");
    chunk_case(c, &group, p, depth, chunk);
}

/// `chunk` tokens after `depth` cached ones (a whole number of blocks in
/// all), f16 keys and values in blocks of 16; throughput is the FLOPs of
/// the pairs each token sees.
fn chunk_case(c: &mut Criterion, group: &str, p: AttnParams, depth: usize, chunk: usize) {
    let n = depth + chunk;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let kv_dim = p.n_kv_heads * p.head_dim;
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
    let (k, v, q) = (
        rand(n * kv_dim),
        rand(n * kv_dim),
        rand(chunk * p.n_heads * p.head_dim),
    );
    let mut out = vec![0f32; chunk * p.n_heads * p.v_dim];
    let block_size = 16;
    let table: Vec<u32> = (0..(n / block_size) as u32).collect();
    let buf = |x: &[f32]| {
        let mut b = KvBuffer::zeroed(KvDType::F16, n * kv_dim).expect("whole units");
        b.store_rows(x, (block_size, p.n_kv_heads, p.head_dim), &table, 0);
        b
    };
    let (kb, vb) = (buf(&k), buf(&v));
    let layer = KvLayer {
        k: &kb,
        v: Some(&vb),
        block_size,
    };
    let seqs = [SeqAttn {
        rows: 0..chunk,
        pos0: depth,
        table: &table,
    }];
    // Token t sees depth + t + 1 keys, or the window's last ones.
    let pairs: usize = (0..chunk)
        .map(|t| {
            let seen = depth + t + 1;
            p.window.map_or(seen, |w| w.min(seen))
        })
        .sum();
    let flops = 4 * p.head_dim * p.n_heads * pairs;
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(flops as u64));
    g.bench_function("f16, blocks of 16 (elements = FLOPs)", |b| {
        b.iter(|| attention_dyn(&p, black_box(&q), &layer, &seqs, &mut out))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = decode, latent, prefill
}
criterion_main!(benches);
