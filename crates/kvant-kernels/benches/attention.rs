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

mod config;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use kvant_kernels::attention::{attention_dyn, AttnParams, KvBuffer, KvDType, KvLayer, SeqAttn};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;

const CONTEXT: usize = 2048;

/// SmolLM2-135M's attention: 9 query heads on 3 KV heads of 64.
const SMOL: AttnParams = AttnParams {
    n_heads: 9,
    n_kv_heads: 3,
    head_dim: 64,
    v_dim: 64,
    scale: 0.125,
    window: None,
};

fn rand_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0..2.0)).collect()
}

/// `x` stored as `dtype` rows of `dims` (block size, KV heads, head size)
/// through `table`.
fn cache(dtype: KvDType, x: &[f32], dims: (usize, usize, usize), table: &[u32]) -> KvBuffer {
    let mut b = KvBuffer::zeroed(dtype, x.len()).expect("whole units");
    b.store_rows(x, dims, table, 0);
    b
}

/// One sequence of `tokens` query tokens after `pos0` cached positions.
fn one_seq(tokens: usize, pos0: usize, table: &[u32]) -> [SeqAttn<'_>; 1] {
    [SeqAttn {
        rows: 0..tokens,
        pos0,
        table,
    }]
}

/// Times one attention call over `layer`, for the queries `q`.
fn bench_call(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: String,
    p: &AttnParams,
    q: &[f32],
    (layer, seqs): (&KvLayer<'_>, &[SeqAttn<'_>]),
) {
    let mut out = vec![0f32; q.len() / p.head_dim * p.v_dim];
    g.bench_function(name, |b| {
        b.iter(|| attention_dyn(p, black_box(q), layer, seqs, &mut out))
    });
}

fn decode(c: &mut Criterion) {
    let p = SMOL;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let kv_dim = p.n_kv_heads * p.head_dim;
    let (k, v, q) = (
        rand_vec(&mut rng, CONTEXT * kv_dim),
        rand_vec(&mut rng, CONTEXT * kv_dim),
        rand_vec(&mut rng, p.n_heads * p.head_dim),
    );
    let mut g = c.benchmark_group(format!("attention decode, {CONTEXT} positions"));
    for block_size in [CONTEXT, 16] {
        let table: Vec<u32> = (0..(CONTEXT / block_size) as u32).collect();
        let dims = (block_size, p.n_kv_heads, p.head_dim);
        for dtype in KvDType::ALL {
            let (kb, vb) = (
                cache(dtype, &k, dims, &table),
                cache(dtype, &v, dims, &table),
            );
            let layer = KvLayer {
                k: &kb,
                v: Some(&vb),
                block_size,
            };
            let seqs = one_seq(1, CONTEXT - 1, &table);
            g.throughput(Throughput::Bytes((kb.bytes() + vb.bytes()) as u64));
            let name = format!("{dtype}, blocks of {block_size}");
            bench_call(&mut g, name, &p, &q, (&layer, &seqs));
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
    let k = rand_vec(&mut rng, CONTEXT * p.head_dim);
    let q = rand_vec(&mut rng, p.n_heads * p.head_dim);
    let block_size = 16;
    let table: Vec<u32> = (0..(CONTEXT / block_size) as u32).collect();
    let mut g = c.benchmark_group(format!("latent attention decode, {CONTEXT} positions"));
    for dtype in KvDType::ALL {
        let kb = cache(dtype, &k, (block_size, 1, p.head_dim), &table);
        let layer = KvLayer {
            k: &kb,
            v: None,
            block_size,
        };
        let seqs = one_seq(1, CONTEXT - 1, &table);
        g.throughput(Throughput::Bytes(kb.bytes() as u64));
        let name = format!("{dtype}, 16 heads, blocks of {block_size}");
        bench_call(&mut g, name, &p, &q, (&layer, &seqs));
    }
    g.finish();
}

fn prefill(c: &mut Criterion) {
    // A 512-token chunk (the engine's prefill chunk) of SmolLM2's heads
    // after 4096 tokens and of Gemma 3 270M's global layer (4 query heads
    // of 256 on one KV head) after 8192.
    let smol = SMOL;
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
    let mut f16_cache = || {
        let x = rand_vec(&mut rng, ctx * kv_dim);
        cache(KvDType::F16, &x, dims, &table)
    };
    // Keys, then values, of each layer in turn.
    let caches: Vec<(KvBuffer, KvBuffer)> =
        (0..layers).map(|_| (f16_cache(), f16_cache())).collect();
    let q = rand_vec(&mut rng, p.n_heads * p.head_dim);
    let mut out = vec![0f32; p.n_heads * p.v_dim];
    let seqs = one_seq(1, ctx - 1, &table);
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
    let (k, v, q) = (
        rand_vec(&mut rng, n * kv_dim),
        rand_vec(&mut rng, n * kv_dim),
        rand_vec(&mut rng, chunk * p.n_heads * p.head_dim),
    );
    let block_size = 16;
    let table: Vec<u32> = (0..(n / block_size) as u32).collect();
    let dims = (block_size, p.n_kv_heads, p.head_dim);
    let (kb, vb) = (
        cache(KvDType::F16, &k, dims, &table),
        cache(KvDType::F16, &v, dims, &table),
    );
    let layer = KvLayer {
        k: &kb,
        v: Some(&vb),
        block_size,
    };
    let seqs = one_seq(chunk, depth, &table);
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
    let name = "f16, blocks of 16 (elements = FLOPs)".to_string();
    bench_call(&mut g, name, &p, &q, (&layer, &seqs));
    g.finish();
}

criterion_group! {
    name = benches;
    config = config::short();
    targets = decode, latent, prefill
}
criterion_main!(benches);
