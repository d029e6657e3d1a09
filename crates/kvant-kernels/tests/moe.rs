//! The mixture-of-experts layer on seeded random inputs of odd sizes:
//! - routing against the sorting reference (same ids, weights within
//!   [`WEIGHT_TOL`]) and hand-made cases of each rule (bias, groups, scale);
//! - the fused experts on every SIMD tier against the per-token f64
//!   reference, for F32, F16, BF16 and block-quantized experts with 8-bit
//!   and with f32 activations, under an error bound propagated through the
//!   layer (see [`error_bound`]);
//! - bit-exact batch invariance (a token alone, single-threaded, against
//!   the same token in batches of 37 in two orders);
//! - the grouped int8 product against one `gemm` per matrix, bit for bit;
//! - every argument error.

mod common;

use common::random_block;
use kvant_core::{DType, Storage, Tensor};
use kvant_kernels::activation::{gated_with, Activation};
use kvant_kernels::cpu::{self, SimdTier};
use kvant_kernels::halfpack;
use kvant_kernels::int8::{
    gemm_grouped_with, gemm_with, PackedFormat, PackedMatrix, Q8Activations, Segment, BLOCK,
};
use kvant_kernels::linear::LinearWeight;
use kvant_kernels::matmul::matmul_with;
use kvant_kernels::moe::{
    activation_f64, moe_ffn, moe_ffn_quantized, moe_ffn_ref, route, route_ref, Experts, GroupScore,
    MoeScratch, RouterInput, RouterParams, Routing, Scoring,
};
use kvant_kernels::quant::dequantize_row_ref;
use kvant_kernels::{pool, KernelError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Mutex;

/// Router weights: the kernel and the reference do the same f32 operations
/// on the same values, so they agree to the last bits of numbers below 1.
const WEIGHT_TOL: f32 = 1e-6;

/// f32 accumulation over at most a few hundred products: far below 1e-5
/// of Σ|w·x| for random signs (as in the int8 and quant kernel tests).
const REL_TOL: f64 = 1e-5;

/// The gating's polynomial exponential against the exact function:
/// activation.rs bounds it by 2e-6 of max(1, |value|) against libm in f32;
/// the margin covers that reference's own f32 rounding.
const ACT_TOL: f64 = 3e-6;

/// Largest slope of the activations (SiLU's derivative peaks at 1.0998,
/// GELU-tanh's at 1.129): an input error of δ moves the output by at most
/// this times δ.
const ACT_SLOPE: f64 = 1.13;

/// The propagated bound stays below this fraction of each output's
/// magnitude `Σ_slot |w| Σ_j |W_down[r, j]·a_j|`, so that it is never
/// vacuous. With f32 activations it is ~1e-5; the 8-bit intermediate's
/// half steps (`max|a| / 254` per value of a heavy-tailed block) reach
/// ~15% here. The fusion's bookkeeping is checked bit for bit against
/// the per-token composition of the kernels, not under this bound.
const MAX_BOUND_FRACTION: f64 = 0.25;

// ---------------------------------------------------------------- inputs

/// A random `[n, rows, cols]` stack of weights, as GGUF stores a layer's
/// experts: values in ±0.1 for float types; random quants and small
/// finite scales for block types (smaller for the k-quants, whose 6- and
/// 8-bit sub-scales multiply them).
fn random_stack(rng: &mut ChaCha8Rng, dtype: DType, n: usize, rows: usize, cols: usize) -> Tensor {
    let elements = n * rows * cols;
    let mut bytes = Vec::new();
    match dtype {
        DType::F32 => {
            (0..elements).for_each(|_| bytes.extend(rng.random_range(-0.1f32..0.1).to_le_bytes()))
        }
        DType::F16 => (0..elements).for_each(|_| {
            bytes.extend(half::f16::from_f32(rng.random_range(-0.1f32..0.1)).to_le_bytes())
        }),
        DType::BF16 => (0..elements).for_each(|_| {
            bytes.extend(half::bf16::from_f32(rng.random_range(-0.1f32..0.1)).to_le_bytes())
        }),
        _ => {
            let s = if dtype.block_size() == 256 {
                2e-3
            } else {
                2e-2
            };
            for _ in 0..elements / dtype.block_size() {
                bytes.extend(random_block(rng, dtype, s));
            }
        }
    }
    Tensor::new(dtype, vec![n, rows, cols], Storage::Owned(bytes.into()), 0).unwrap()
}

fn matrices(stack: &Tensor) -> Vec<Tensor> {
    (0..stack.shape()[0])
        .map(|i| stack.matrix(i).unwrap())
        .collect()
}

fn dequantized(w: &Tensor) -> Vec<f32> {
    let mut out = vec![f32::NAN; w.elements()];
    dequantize_row_ref(w.dtype(), w.bytes(), &mut out).unwrap();
    out
}

fn random_vec(rng: &mut ChaCha8Rng, n: usize, r: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-r..r)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

/// One layer's experts: the stored stacks and the prepared weights.
struct Layer {
    gate: Vec<Tensor>,
    up: Vec<Tensor>,
    down: Vec<Tensor>,
    experts: Experts,
    /// The prepared weights `Experts` was made of (gate, up, down).
    prepared: [Vec<LinearWeight>; 3],
    /// Whether gate/up and down run on 8-bit activations.
    q8_in: bool,
    q8_down: bool,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    gate_up: DType,
    down: DType,
    int8: bool,
    hidden: usize,
    ff: usize,
    n_experts: usize,
    top_k: usize,
    act: Activation,
}

fn layer(rng: &mut ChaCha8Rng, c: &Case) -> Layer {
    let gs = random_stack(rng, c.gate_up, c.n_experts, c.ff, c.hidden);
    let us = random_stack(rng, c.gate_up, c.n_experts, c.ff, c.hidden);
    let ds = random_stack(rng, c.down, c.n_experts, c.hidden, c.ff);
    let experts = Experts::from_stacks(&gs, &us, &ds, c.int8).unwrap();
    let (gate, up, down) = (matrices(&gs), matrices(&us), matrices(&ds));
    let prep = |ws: &[Tensor]| -> Vec<LinearWeight> {
        ws.iter()
            .map(|w| LinearWeight::prepare(w.clone(), c.int8).unwrap())
            .collect()
    };
    let prepared = [prep(&gate), prep(&up), prep(&down)];
    let packs = |d: DType| c.int8 && PackedFormat::for_dtype(d).is_some();
    Layer {
        gate,
        up,
        down,
        experts,
        prepared,
        q8_in: packs(c.gate_up),
        q8_down: packs(c.down),
    }
}

/// Softmax-routed ids and weights for `n` tokens (a real router's output).
fn routed(rng: &mut ChaCha8Rng, n: usize, n_experts: usize, top_k: usize) -> (Vec<u32>, Vec<f32>) {
    let logits = random_vec(rng, n * n_experts, 3.0);
    let mut ids = vec![u32::MAX; n * top_k];
    let mut w = vec![f32::NAN; n * top_k];
    let params = RouterParams::softmax(n_experts, top_k, true);
    let r = RouterInput::new(&params, &logits, None);
    route(&r, &mut ids, &mut w).unwrap();
    (ids, w)
}

/// `n` random tokens of a case (values in ±2) and their routing.
struct Batch {
    n: usize,
    x: Vec<f32>,
    ids: Vec<u32>,
    w: Vec<f32>,
}

impl Batch {
    fn random(rng: &mut ChaCha8Rng, c: &Case, n: usize) -> Batch {
        let x = random_vec(rng, n * c.hidden, 2.0);
        let (ids, w) = routed(rng, n, c.n_experts, c.top_k);
        Batch { n, x, ids, w }
    }

    fn routing(&self, c: &Case) -> Routing<'_> {
        Routing {
            ids: &self.ids,
            weights: &self.w,
            n_tokens: self.n,
            top_k: c.top_k,
        }
    }

    /// The fused layer's output for these tokens on `tier`.
    fn fused(&self, tier: SimdTier, l: &Layer, c: &Case, s: &mut MoeScratch) -> Vec<f32> {
        let mut out = vec![f32::NAN; self.n * c.hidden];
        moe_ffn(
            tier,
            &l.experts,
            c.act,
            &self.x,
            &self.routing(c),
            s,
            &mut out,
        )
        .unwrap();
        out
    }
}

// ------------------------------------------------------------- experts

/// Per-value half steps of 8-bit quantization of `v` (`max|block| / 254`).
fn half_steps(v: &[f64]) -> Vec<f64> {
    v.chunks(BLOCK)
        .flat_map(|b| {
            let step = b.iter().fold(0f64, |m, x| m.max(x.abs())) / 127.0;
            std::iter::repeat_n(step / 2.0, b.len())
        })
        .collect()
}

/// The error the kernel may make on token `t`'s outputs, with the
/// reference reading `x` (for 8-bit gate/up: the tokens as the kernel
/// quantized them, exactly), and the outputs' magnitudes. Propagated
/// through the layer, per value:
/// - gate and up: f32 accumulation, `REL_TOL · Σ|w·x|`;
/// - gating: `|act(g+δ)(u+ε) - act(g)u| ≤ ACT_SLOPE·|δ|·(|u|+|ε|) +
///   |act(g)|·|ε|`, plus the polynomial exponential's [`ACT_TOL`];
/// - 8-bit intermediate: at most half a step per value (as the int8 tests
///   state it), the step taken from the block's largest value plus its error;
/// - down: `Σ_j |W[r, j]|·err_j` plus f32 accumulation; the combine adds
///   `|w|` times that per slot, plus its own rounding.
fn error_bound(l: &Layer, c: &Case, x: &[f32], ids: &[u32], w: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (h, ff) = (c.hidden, c.ff);
    let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let mut bound = vec![0f64; h];
    let mut mag = vec![0f64; h];
    for (&e, &wt) in ids.iter().zip(w) {
        let e = e as usize;
        let (wg, wu, wd) = (
            dequantized(&l.gate[e]),
            dequantized(&l.up[e]),
            dequantized(&l.down[e]),
        );
        let mut a = vec![0f64; ff];
        let mut ea = vec![0f64; ff];
        for j in 0..ff {
            let row = |m: &[f32]| {
                let r = &m[j * h..(j + 1) * h];
                let v: f64 = r.iter().zip(&x).map(|(&p, &q)| p as f64 * q).sum();
                let s: f64 = r.iter().zip(&x).map(|(&p, &q)| (p as f64 * q).abs()).sum();
                (v, REL_TOL * s)
            };
            let ((g, eg), (u, eu)) = (row(&wg), row(&wu));
            let act_g = activation_f64(c.act, g);
            a[j] = act_g * u;
            let e = ACT_SLOPE * eg * (u.abs() + eu) + act_g.abs() * eu;
            ea[j] = e + ACT_TOL * (a[j].abs() + e).max(1.0);
        }
        let eps: Vec<f64> = if l.q8_down {
            let reach: Vec<f64> = a.iter().zip(&ea).map(|(a, e)| a.abs() + e).collect();
            half_steps(&reach)
                .iter()
                .zip(&ea)
                .map(|(q, e)| q + e)
                .collect()
        } else {
            ea
        };
        let wt = (wt as f64).abs();
        for r in 0..h {
            let row = &wd[r * ff..(r + 1) * ff];
            let m: f64 = row.iter().zip(&a).map(|(&p, q)| (p as f64 * q).abs()).sum();
            let err: f64 = row.iter().zip(&eps).map(|(&p, q)| p.abs() as f64 * q).sum();
            let acc: f64 = REL_TOL * (m + err);
            bound[r] += wt * (err + acc + REL_TOL * m);
            mag[r] += wt * m;
        }
    }
    (bound, mag)
}

/// The tokens as the int8 path multiplies them: quantized per row (the
/// same bits on every tier) and dequantized.
fn as_int8_sees(x: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut q = Q8Activations::default();
    q.quantize(SimdTier::Scalar, x, n, k).unwrap();
    q.dequantize()
}

fn cases() -> Vec<Case> {
    use Activation::{GeluTanh, Silu};
    let c = |gate_up, down, int8, hidden, ff, n_experts, top_k, act| Case {
        gate_up,
        down,
        int8,
        hidden,
        ff,
        n_experts,
        top_k,
        act,
    };
    vec![
        c(DType::F32, DType::F32, false, 96, 64, 5, 2, Silu),
        c(DType::F16, DType::F16, true, 160, 96, 9, 3, Silu),
        c(DType::BF16, DType::BF16, false, 96, 64, 5, 1, GeluTanh),
        c(DType::Q8_0, DType::Q8_0, true, 160, 96, 9, 4, Silu),
        c(DType::Q4_0, DType::Q4_0, true, 96, 64, 5, 1, Silu),
        c(DType::Q4_0, DType::Q4_0, false, 160, 64, 9, 3, GeluTanh),
        c(DType::Q4_K, DType::Q4_K, true, 256, 256, 5, 2, Silu),
        // Q4_K_M style: int8 gate/up, a down type without int8 kernels.
        c(DType::Q4_K, DType::Q6_K, true, 256, 256, 9, 2, Silu),
        c(DType::Q8_0, DType::F16, true, 96, 96, 5, 3, GeluTanh),
    ]
}

#[test]
fn experts_match_the_reference_on_every_tier() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    // One scratch for everything: stale buffers of a larger call must not leak.
    let mut scratch = MoeScratch::default();
    let mut worst = 0f64;
    for c in cases() {
        let l = layer(&mut rng, &c);
        assert_eq!(
            (l.experts.n_experts(), l.experts.hidden(), l.experts.ff()),
            (c.n_experts, c.hidden, c.ff)
        );
        for n in [7usize, 37, 1] {
            let b = Batch::random(&mut rng, &c, n);
            let (x, ids, w) = (&b.x, &b.ids, &b.w);
            let x_seen = if l.q8_in {
                as_int8_sees(x, n, c.hidden)
            } else {
                x.clone()
            };
            let want =
                moe_ffn_ref(&l.gate, &l.up, &l.down, c.act, &x_seen, &b.routing(&c)).unwrap();
            let bounds: Vec<(Vec<f64>, Vec<f64>)> = (0..n)
                .map(|t| {
                    let ts = t * c.top_k..(t + 1) * c.top_k;
                    let xt = &x_seen[t * c.hidden..(t + 1) * c.hidden];
                    error_bound(&l, &c, xt, &ids[ts.clone()], &w[ts])
                })
                .collect();
            for tier in cpu::available_tiers() {
                let got = b.fused(tier, &l, &c, &mut scratch);
                for (i, (&g, &r)) in got.iter().zip(&want).enumerate() {
                    let (t, o) = (i / c.hidden, i % c.hidden);
                    let (b, m) = (bounds[t].0[o], bounds[t].1[o]);
                    assert!(
                        (g as f64 - r).abs() <= b * (1.0 + 1e-6) + 1e-30,
                        "{c:?} {tier} n={n} [{t},{o}]: {g} vs {r}, bound {b:e}"
                    );
                    assert!(
                        b <= MAX_BOUND_FRACTION * m,
                        "{c:?}: vacuous bound {b} of {m}"
                    );
                    worst = worst.max(b / m.max(1e-30));
                }
            }
        }
    }
    eprintln!("largest bound / magnitude: {worst:.2e}");
}

/// `y = x · Wᵀ` for one token with the kernel `w` was prepared for.
fn forward_one(tier: SimdTier, w: &LinearWeight, x: &[f32], y: &mut [f32]) {
    match w {
        LinearWeight::Int8(p) => {
            let mut q = Q8Activations::default();
            q.quantize(tier, x, 1, x.len()).unwrap();
            gemm_with(tier, p, &q, y).unwrap();
        }
        LinearWeight::Half(p) => halfpack::gemm_with(tier, p, x, 1, y).unwrap(),
        LinearWeight::Float(t) => matmul_with(tier, t, x, 1, y).unwrap(),
    }
}

/// The fused layer is the unfused one, bit for bit: per token and slot,
/// the expert's three products by the existing kernels, the gating, and
/// the weighted sum in slot order. This checks the fusion's bookkeeping
/// (plan, gathers, grouped segments, combine) exactly, on every tier.
#[test]
fn the_fused_layer_is_the_per_token_composition_of_the_kernels() {
    let mut rng = ChaCha8Rng::seed_from_u64(27);
    let mut scratch = MoeScratch::default();
    for c in cases() {
        let l = layer(&mut rng, &c);
        let (h, ff, n) = (c.hidden, c.ff, 37);
        let b = Batch::random(&mut rng, &c, n);
        let (x, ids, w) = (&b.x, &b.ids, &b.w);
        for tier in cpu::available_tiers() {
            let fused = b.fused(tier, &l, &c, &mut scratch);
            let [wg, wu, wd] = &l.prepared;
            for t in 0..n {
                let xt = &x[t * h..(t + 1) * h];
                let mut want = vec![f32::NAN; h];
                for slot in 0..c.top_k {
                    let (e, wt) = (ids[t * c.top_k + slot] as usize, w[t * c.top_k + slot]);
                    let (mut g, mut u, mut y) = (vec![0f32; ff], vec![0f32; ff], vec![0f32; h]);
                    forward_one(tier, &wg[e], xt, &mut g);
                    forward_one(tier, &wu[e], xt, &mut u);
                    gated_with(tier, c.act, &mut g, &u);
                    forward_one(tier, &wd[e], &g, &mut y);
                    for (o, &v) in want.iter_mut().zip(&y) {
                        *o = if slot == 0 { wt * v } else { *o + wt * v };
                    }
                }
                assert_eq!(
                    bits(&fused[t * h..(t + 1) * h]),
                    bits(&want),
                    "{c:?} {tier} token {t}"
                );
            }
        }
    }
}

/// Token `t` alone, computed inside a pool task: nested pool calls run on
/// the calling thread, so this is the single-threaded result.
fn alone_single_threaded(l: &Layer, c: &Case, x: &[f32], ids: &[u32], w: &[f32]) -> Vec<f32> {
    let result = Mutex::new(Vec::new());
    pool::global().run(2, &|task| {
        if task == 0 {
            let mut s = MoeScratch::default();
            let mut out = vec![f32::NAN; c.hidden];
            let r = Routing {
                ids,
                weights: w,
                n_tokens: 1,
                top_k: c.top_k,
            };
            moe_ffn(cpu::tier(), &l.experts, c.act, x, &r, &mut s, &mut out).unwrap();
            *result.lock().unwrap() = out;
        }
    });
    result.into_inner().unwrap()
}

#[test]
fn a_token_gives_the_same_bits_alone_and_in_any_batch() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let n = 37;
    for c in cases() {
        let l = layer(&mut rng, &c);
        let h = c.hidden;
        let b = Batch::random(&mut rng, &c, n);
        let (x, ids, w) = (&b.x, &b.ids, &b.w);
        let mut s = MoeScratch::default();
        let batch = b.fused(cpu::tier(), &l, &c, &mut s);
        // The same tokens in reverse order.
        fn rev<T: Copy>(v: &[T], k: usize) -> Vec<T> {
            v.chunks(k).rev().flatten().copied().collect()
        }
        let reversed = Batch {
            n,
            x: rev(x, h),
            ids: rev(ids, c.top_k),
            w: rev(w, c.top_k),
        }
        .fused(cpu::tier(), &l, &c, &mut s);
        for t in 0..n {
            let ts = t * c.top_k..(t + 1) * c.top_k;
            let alone =
                alone_single_threaded(&l, &c, &x[t * h..(t + 1) * h], &ids[ts.clone()], &w[ts]);
            assert_eq!(
                bits(&alone),
                bits(&batch[t * h..(t + 1) * h]),
                "{c:?} token {t}"
            );
            let r = n - 1 - t;
            assert_eq!(
                bits(&alone),
                bits(&reversed[r * h..(r + 1) * h]),
                "{c:?} token {t} reversed"
            );
        }
    }
}

/// Quantized input (what expert parallelism sends) gives the bits of the
/// f32 rows it came from, for every case with int8 gate and up; the
/// others refuse it.
#[test]
fn quantized_input_gives_the_bits_of_its_f32_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let n = 13;
    for c in cases() {
        let l = layer(&mut rng, &c);
        let h = c.hidden;
        let b = Batch::random(&mut rng, &c, n);
        let mut s = MoeScratch::default();
        let want = b.fused(cpu::tier(), &l, &c, &mut s);
        let mut xq = Q8Activations::default();
        xq.quantize(cpu::tier(), &b.x, n, h).unwrap();
        let mut got = vec![f32::NAN; n * h];
        let tier = cpu::tier();
        let r = moe_ffn_quantized(
            tier,
            &l.experts,
            c.act,
            &xq,
            &b.routing(&c),
            &mut s,
            &mut got,
        );
        assert_eq!(l.experts.takes_quantized(), l.q8_in, "{c:?}");
        match l.q8_in {
            true => {
                r.unwrap();
                assert_eq!(bits(&got), bits(&want), "{c:?}");
            }
            false => assert!(r.is_err(), "{c:?}"),
        }
    }
}

#[test]
fn experts_check_their_arguments() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let q = |rng: &mut ChaCha8Rng, n, rows, cols, int8| -> Vec<LinearWeight> {
        matrices(&random_stack(rng, DType::Q4_0, n, rows, cols))
            .into_iter()
            .map(|w| LinearWeight::prepare(w, int8).unwrap())
            .collect()
    };
    let (g, u, d) = (
        q(&mut rng, 3, 64, 96, true),
        q(&mut rng, 3, 64, 96, true),
        q(&mut rng, 3, 96, 64, true),
    );
    let experts = Experts::new(g.clone(), u.clone(), d.clone()).unwrap();
    // Q4_0 repacks to the same bytes: 18 per 32 weights, 3 matrices an expert.
    assert_eq!(experts.expert_bytes(1), 3 * 64 * 96 / 32 * 18);
    assert_eq!(experts.byte_len(), 3 * experts.expert_bytes(0));

    let flat = Tensor::new(
        DType::F32,
        vec![4, 4],
        Storage::Owned(vec![0; 64].into()),
        0,
    )
    .unwrap();
    assert!(matches!(
        Experts::from_stacks(&flat, &flat, &flat, true),
        Err(KernelError::Core(kvant_core::CoreError::NotStacked { .. }))
    ));
    assert!(matches!(
        Experts::new(Vec::new(), Vec::new(), Vec::new()),
        Err(KernelError::LengthMismatch { .. })
    ));
    assert!(matches!(
        Experts::new(g.clone(), u[..2].to_vec(), d.clone()),
        Err(KernelError::LengthMismatch { .. })
    ));
    let mut wide = u.clone();
    wide[2] = q(&mut rng, 1, 64, 128, true).remove(0);
    assert!(matches!(
        Experts::new(g.clone(), wide, d.clone()),
        Err(KernelError::MatrixShape {
            what: "expert up",
            matrix: 2,
            ..
        })
    ));
    assert!(matches!(
        Experts::new(g.clone(), u.clone(), u.clone()),
        Err(KernelError::MatrixShape {
            what: "expert down",
            ..
        })
    ));
    let mut mixed = d.clone();
    mixed[1] = q(&mut rng, 1, 96, 64, false).remove(0);
    assert!(matches!(
        Experts::new(g, u, mixed),
        Err(KernelError::MatrixKind {
            what: "expert down",
            matrix: 1
        })
    ));

    let mut s = MoeScratch::default();
    let x = random_vec(&mut rng, 2 * 96, 1.0);
    let mut out = vec![f32::NAN; 2 * 96];
    let silu = Activation::Silu;
    fn routing<'a>(ids: &'a [u32], weights: &'a [f32], top_k: usize) -> Routing<'a> {
        Routing {
            ids,
            weights,
            n_tokens: 2,
            top_k,
        }
    }
    let err = moe_ffn(
        cpu::tier(),
        &experts,
        silu,
        &x,
        &routing(&[0, 3], &[1.0; 2], 1),
        &mut s,
        &mut out,
    );
    assert!(matches!(
        err,
        Err(KernelError::IndexOutOfRange {
            index: 3,
            len: 3,
            ..
        })
    ));
    assert!(out.iter().all(|v| v.is_nan()), "out written on an error");
    for (xl, ids, w, k, ol) in [
        (191usize, 2usize, 2usize, 1usize, 192usize),
        (192, 3, 2, 1, 192),
        (192, 2, 1, 1, 192),
        (192, 2, 2, 1, 96),
        (192, 4, 4, 1, 192),
    ] {
        let mut out = vec![f32::NAN; ol];
        let r = moe_ffn(
            cpu::tier(),
            &experts,
            silu,
            &x[..xl.min(192)],
            &routing(&vec![0; ids], &vec![1.0; w], k),
            &mut s,
            &mut out,
        );
        assert!(
            matches!(r, Err(KernelError::LengthMismatch { .. })),
            "{xl} {ids} {w} {ol}"
        );
    }
    // No slots: nothing routed, the output is zero.
    let none = routing(&[], &[], 0);
    moe_ffn(cpu::tier(), &experts, silu, &x, &none, &mut s, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 0.0));
}

// --------------------------------------------------------- grouped int8

#[test]
fn grouped_int8_matches_one_gemm_per_matrix_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let (rows, cols, n) = (19usize, 256usize, 37usize);
    let set_of = |rng: &mut ChaCha8Rng, dtype| -> Vec<PackedMatrix> {
        matrices(&random_stack(rng, dtype, 5, rows, cols))
            .iter()
            .map(|w| PackedMatrix::pack(w).unwrap().unwrap())
            .collect()
    };
    let sets = [set_of(&mut rng, DType::Q8_0), set_of(&mut rng, DType::Q4_K)];
    let x = random_vec(&mut rng, n * cols, 2.0);
    let mut xq = Q8Activations::default();
    xq.quantize(SimdTier::Scalar, &x, n, cols).unwrap();
    let seg = |set, matrix, tokens| Segment {
        set,
        matrix,
        tokens,
    };
    // Set 0 leaves tokens 17..20 uncovered and has an empty segment.
    let segments = [
        seg(0, 3, 0..5),
        seg(1, 2, 0..30),
        seg(0, 0, 5..5),
        seg(0, 1, 5..17),
        seg(1, 4, 30..37),
        seg(0, 4, 20..37),
    ];
    for tier in cpu::available_tiers() {
        let mut y0 = vec![f32::NAN; n * rows];
        let mut y1 = vec![f32::NAN; n * rows];
        let set_refs: [&[PackedMatrix]; 2] = [&sets[0], &sets[1]];
        gemm_grouped_with(tier, &set_refs, &segments, &xq, &mut [&mut y0, &mut y1]).unwrap();
        for (set, y) in [(0usize, &y0), (1, &y1)] {
            for t in 0..n {
                let got = &y[t * rows..(t + 1) * rows];
                let covering = segments
                    .iter()
                    .find(|s| s.set == set && s.tokens.contains(&t));
                match covering {
                    Some(s) => {
                        let mut want = vec![f32::NAN; n * rows];
                        gemm_with(tier, &sets[set][s.matrix], &xq, &mut want).unwrap();
                        let want = &want[t * rows..(t + 1) * rows];
                        assert_eq!(bits(got), bits(want), "{tier} set {set} token {t}");
                    }
                    None => assert!(got.iter().all(|v| v.is_nan()), "token {t} written"),
                }
            }
        }
    }
}

#[test]
fn gathered_activations_are_the_quantized_gathered_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(25);
    let (n, k) = (5usize, 96usize);
    let x = random_vec(&mut rng, n * k, 3.0);
    let mut xq = Q8Activations::default();
    xq.quantize(cpu::tier(), &x, n, k).unwrap();
    let rows = [4usize, 0, 4, 2];
    let picked: Vec<f32> = rows
        .iter()
        .flat_map(|&r| x[r * k..(r + 1) * k].iter().copied())
        .collect();
    let mut want = Q8Activations::default();
    want.quantize(cpu::tier(), &picked, rows.len(), k).unwrap();
    let mut got = Q8Activations::default();
    got.gather(&xq, &rows).unwrap();
    assert_eq!((got.n_tokens(), got.k()), (rows.len(), k));
    assert_eq!(bits(&got.dequantize()), bits(&want.dequantize()));
    assert!(matches!(
        got.gather(&xq, &[1, 5]),
        Err(KernelError::IndexOutOfRange { index: 5, .. })
    ));
    assert_eq!(got.n_tokens(), 0);
}

#[test]
fn grouped_int8_rejects_bad_segments() {
    let mut rng = ChaCha8Rng::seed_from_u64(26);
    let set: Vec<PackedMatrix> = matrices(&random_stack(&mut rng, DType::Q4_0, 2, 8, 64))
        .iter()
        .map(|w| PackedMatrix::pack(w).unwrap().unwrap())
        .collect();
    let mut xq = Q8Activations::default();
    xq.quantize(SimdTier::Scalar, &random_vec(&mut rng, 4 * 64, 1.0), 4, 64)
        .unwrap();
    let seg = |set, matrix, tokens| Segment {
        set,
        matrix,
        tokens,
    };
    let run = |segments: &[Segment], y_len: usize| {
        let mut y = vec![0f32; y_len];
        gemm_grouped_with(SimdTier::Scalar, &[&set], segments, &xq, &mut [&mut y])
    };
    assert!(run(&[seg(0, 0, 0..2), seg(0, 1, 2..4)], 32).is_ok());
    let range = |r: Result<(), KernelError>| matches!(r, Err(KernelError::SegmentRange { .. }));
    assert!(
        range(run(&[seg(0, 0, 0..3), seg(0, 1, 2..4)], 32)),
        "overlap"
    );
    assert!(
        range(run(&[seg(0, 0, 2..4), seg(0, 1, 0..2)], 32)),
        "descending"
    );
    assert!(range(run(&[seg(0, 0, 2..5)], 32)), "past the tokens");
    let index = |r: Result<(), KernelError>| matches!(r, Err(KernelError::IndexOutOfRange { .. }));
    assert!(index(run(&[seg(1, 0, 0..1)], 32)), "set");
    assert!(index(run(&[seg(0, 2, 0..1)], 32)), "matrix");
    assert!(matches!(
        run(&[seg(0, 0, 0..1)], 31),
        Err(KernelError::LengthMismatch { .. })
    ));
    let mut other = Q8Activations::default();
    other.quantize(SimdTier::Scalar, &[0.5; 96], 1, 96).unwrap();
    let mut y = vec![0f32; 8];
    assert!(gemm_grouped_with(
        SimdTier::Scalar,
        &[&set],
        &[seg(0, 0, 0..1)],
        &other,
        &mut [&mut y]
    )
    .is_err());
    let five: [&[PackedMatrix]; 5] = [&set, &set, &set, &set, &set];
    let (mut a, mut b, mut c, mut d, mut e) =
        ([0f32; 32], [0f32; 32], [0f32; 32], [0f32; 32], [0f32; 32]);
    assert!(gemm_grouped_with(
        SimdTier::Scalar,
        &five,
        &[],
        &xq,
        &mut [&mut a, &mut b, &mut c, &mut d, &mut e]
    )
    .is_err());
}

// --------------------------------------------------------------- routing

fn check_against_ref(
    p: &RouterParams,
    logits: &[f32],
    bias: Option<&[f32]>,
) -> (Vec<u32>, Vec<f32>) {
    let n = logits.len() / p.n_experts;
    let mut ids = vec![u32::MAX; n * p.top_k];
    let mut w = vec![f32::NAN; n * p.top_k];
    let r = RouterInput::new(p, logits, bias);
    route(&r, &mut ids, &mut w).unwrap();
    let mut ids_ref = vec![u32::MAX; n * p.top_k];
    let mut w_ref = vec![f32::NAN; n * p.top_k];
    route_ref(&r, &mut ids_ref, &mut w_ref).unwrap();
    assert_eq!(ids, ids_ref, "{p:?}");
    for (a, b) in w.iter().zip(&w_ref) {
        assert!((a - b).abs() <= WEIGHT_TOL, "{p:?}: {a} vs {b}");
    }
    for row in ids.chunks(p.top_k) {
        let mut s = row.to_vec();
        s.sort_unstable();
        s.dedup();
        assert_eq!(s.len(), p.top_k, "repeated expert in {row:?}");
        assert!(s.iter().all(|&e| (e as usize) < p.n_experts));
    }
    (ids, w)
}

#[test]
fn softmax_routing_is_top_k_of_the_probabilities() {
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for &(n_experts, top_k) in &[(5usize, 1usize), (5, 2), (9, 3), (9, 4), (64, 6), (60, 8)] {
        for norm in [false, true] {
            let p = RouterParams::softmax(n_experts, top_k, norm);
            let n = 37;
            let logits = random_vec(&mut rng, n * n_experts, 4.0);
            let (ids, w) = check_against_ref(&p, &logits, None);
            // Independently, in f64: the experts of the k largest logits
            // (softmax is monotone), weighted by their probabilities.
            for (t, row) in logits.chunks(n_experts).enumerate() {
                let mut order: Vec<usize> = (0..n_experts).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                let max = row.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
                let z: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
                let prob = |e: usize| (row[e] as f64 - max).exp() / z;
                let top: f64 = order[..top_k].iter().map(|&e| prob(e)).sum();
                for s in 0..top_k {
                    let e = order[s];
                    assert_eq!(ids[t * top_k + s] as usize, e);
                    let want = if norm { prob(e) / top } else { prob(e) };
                    assert!((w[t * top_k + s] as f64 - want).abs() <= WEIGHT_TOL as f64);
                }
            }
        }
    }
}

#[test]
fn grouped_and_biased_routing_matches_the_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(32);
    let deepseek_v3 = |n_experts, top_k, n_group, topk_group| RouterParams {
        n_experts,
        top_k,
        scoring: Scoring::Sigmoid,
        norm_topk: true,
        n_group,
        topk_group,
        group_score: GroupScore::SumTop2,
        scale: 2.5,
    };
    let deepseek_v2 = |n_experts, top_k, n_group, topk_group| RouterParams {
        n_experts,
        top_k,
        scoring: Scoring::Softmax,
        norm_topk: false,
        n_group,
        topk_group,
        group_score: GroupScore::Max,
        scale: 16.0,
    };
    let configs = [
        deepseek_v3(16, 4, 4, 2),
        deepseek_v3(64, 8, 8, 4),
        deepseek_v3(9, 3, 1, 1),
        deepseek_v3(12, 2, 6, 1),
        deepseek_v2(12, 3, 3, 2),
        deepseek_v2(64, 6, 8, 3),
        deepseek_v2(10, 4, 1, 1),
    ];
    for p in configs {
        for biased in [false, true] {
            let logits = random_vec(&mut rng, 37 * p.n_experts, 3.0);
            let bias = biased.then(|| random_vec(&mut rng, p.n_experts, 0.5));
            let (ids, w) = check_against_ref(&p, &logits, bias.as_deref());
            let gs = p.group_size();
            for (t, row) in ids.chunks(p.top_k).enumerate() {
                let mut groups: Vec<usize> = row.iter().map(|&e| e as usize / gs).collect();
                groups.sort_unstable();
                groups.dedup();
                assert!(groups.len() <= p.topk_group.max(1) || p.n_group == 1);
                if p.norm_topk {
                    let sum: f32 = w[t * p.top_k..(t + 1) * p.top_k].iter().sum();
                    assert!((sum - p.scale).abs() <= 1e-5 * p.scale, "{sum}");
                }
            }
        }
    }
    // NaN logits rank last; the selection stays k distinct experts.
    let p = deepseek_v3(16, 4, 4, 2);
    let mut logits = random_vec(&mut rng, 3 * 16, 3.0);
    for i in [0, 5, 17, 18, 40] {
        logits[i] = f32::NAN;
    }
    check_against_ref(&p, &logits, None);
}

#[test]
fn the_bias_steers_the_selection_but_not_the_weights() {
    let p = RouterParams {
        n_experts: 4,
        top_k: 2,
        scoring: Scoring::Sigmoid,
        norm_topk: true,
        n_group: 1,
        topk_group: 1,
        group_score: GroupScore::SumTop2,
        scale: 1.0,
    };
    let logits = [2.0f32, 1.0, 0.0, -1.0];
    let sig = |l: f32| 1.0 / (1.0 + (-l as f64).exp());
    let (ids, _) = check_against_ref(&p, &logits, None);
    assert_eq!(ids, [0, 1]);
    let (ids, w) = check_against_ref(&p, &logits, Some(&[0.0, 0.0, 0.0, 3.0]));
    assert_eq!(ids, [3, 0], "the bias lifts expert 3 to the top");
    let sum = sig(-1.0) + sig(2.0);
    assert!((w[0] as f64 - sig(-1.0) / sum).abs() <= WEIGHT_TOL as f64);
    assert!((w[1] as f64 - sig(2.0) / sum).abs() <= WEIGHT_TOL as f64);
}

#[test]
fn group_masking_can_exclude_the_best_expert() {
    // Groups of 2: group 0 holds the best expert but the lowest top-2
    // sum after group 3; groups 1 and 2 are kept.
    let mut p = RouterParams {
        n_experts: 8,
        top_k: 2,
        scoring: Scoring::Sigmoid,
        norm_topk: false,
        n_group: 4,
        topk_group: 2,
        group_score: GroupScore::SumTop2,
        scale: 1.0,
    };
    let logits = [5.0f32, -5.0, 1.0, 1.0, 0.5, 0.5, -1.0, -1.0];
    let (ids, w) = check_against_ref(&p, &logits, None);
    assert_eq!(ids, [2, 3], "ties keep the lower id first");
    let s1 = 1.0 / (1.0 + (-1.0f64).exp());
    assert!((w[0] as f64 - s1).abs() <= WEIGHT_TOL as f64 && w[0] == w[1]);
    // Scored by their best expert instead, group 0 is kept.
    p.group_score = GroupScore::Max;
    assert_eq!(check_against_ref(&p, &logits, None).0, [0, 2]);
    // Without groups, the best expert wins.
    p.n_group = 1;
    assert_eq!(check_against_ref(&p, &logits, None).0, [0, 2]);
}

#[test]
fn the_scale_multiplies_the_final_weights() {
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    for (scoring, norm) in [(Scoring::Softmax, false), (Scoring::Sigmoid, true)] {
        let mut p = RouterParams::softmax(16, 3, norm);
        p.scoring = scoring;
        let logits = random_vec(&mut rng, 7 * 16, 3.0);
        let (ids1, w1) = check_against_ref(&p, &logits, None);
        p.scale = 2.5;
        let (ids2, w2) = check_against_ref(&p, &logits, None);
        assert_eq!(ids1, ids2);
        for (a, b) in w1.iter().zip(&w2) {
            assert_eq!(a * 2.5, *b, "scaled after normalisation, exactly once");
        }
    }
}

#[test]
fn bad_router_arguments_are_errors() {
    let ok = RouterParams {
        n_experts: 8,
        top_k: 2,
        scoring: Scoring::Sigmoid,
        norm_topk: true,
        n_group: 4,
        topk_group: 2,
        group_score: GroupScore::SumTop2,
        scale: 1.0,
    };
    let logits = [0.5f32; 16];
    let attempt = |p: RouterParams, logits: &[f32], bias: Option<&[f32]>, slots: usize| {
        let mut ids = vec![0u32; slots];
        let mut w = vec![0f32; slots];
        let input = RouterInput::new(&p, logits, bias);
        let r = route(&input, &mut ids, &mut w);
        let r_ref = route_ref(&input, &mut ids, &mut w);
        assert_eq!(r.is_err(), r_ref.is_err());
        r
    };
    assert!(attempt(ok, &logits, None, 4).is_ok());
    let params = |f: fn(&mut RouterParams)| {
        let mut p = ok;
        f(&mut p);
        p
    };
    let bad_params = [
        params(|p| p.top_k = 0),
        params(|p| p.top_k = 9),
        params(|p| p.n_experts = 0),
        params(|p| p.n_group = 3),
        params(|p| p.n_group = 0),
        params(|p| p.topk_group = 5),
        params(|p| p.topk_group = 0),
        params(|p| p.top_k = 5),
        params(|p| {
            p.n_group = 8;
            p.topk_group = 4;
        }),
    ];
    for p in bad_params {
        assert!(
            matches!(
                attempt(p, &logits, None, 2 * p.top_k),
                Err(KernelError::RouterParams { .. })
            ),
            "{p:?}"
        );
    }
    // Group size 1 is fine when groups are scored by their maximum.
    let max_of_one = params(|p| {
        p.n_group = 8;
        p.topk_group = 4;
        p.group_score = GroupScore::Max;
    });
    assert!(attempt(max_of_one, &logits, None, 4).is_ok());
    let length = |r: Result<(), KernelError>| matches!(r, Err(KernelError::LengthMismatch { .. }));
    assert!(length(attempt(ok, &logits[..15], None, 4)), "ragged logits");
    assert!(length(attempt(ok, &logits, None, 3)), "ids");
    assert!(length(attempt(ok, &logits, Some(&[0.0; 7]), 4)), "bias");
}
