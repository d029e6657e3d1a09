//! Row-wise training kernels (RMSNorm, fused add+RMSNorm, LayerNorm, RoPE,
//! SwiGLU/GeGLU) forward and backward, f32 and bf16, on 2 threads. They
//! are bandwidth-bound, so throughput is reported as GB/s of bytes read
//! plus bytes written (each tensor once, as the kernels touch memory);
//! read it against `cargo bench -p kvant-train --bench bandwidth`.
//!
//! `cargo bench -p kvant-train --bench train_rows`
//!
//! - `TRAIN_ROWS=norm,rope,glu` picks families (default all); `hot` adds
//!   the norms on 16 rows (in L2: the compute ceiling, not a bandwidth);
//! - `TRAIN_ROWS_CPU=1` skips criterion and runs each case on one thread,
//!   printing GB per second of that thread's CPU time (from
//!   `/proc/thread-self/schedstat`), a figure other processes sharing
//!   the cores do not move (they do move wall-clock GB/s).

use criterion::{BatchSize, Criterion, Throughput};
use half::bf16;
use kvant_kernels::{cpu, pool};
use kvant_train::glu::{glu_bwd, glu_fwd, Glu, GluBwd, GluFwd};
use kvant_train::norm::*;
use kvant_train::rope::{rope_apply, RopeIo, RopeLayout, RopeShape};
use kvant_train::Elem;
use std::time::{Duration, Instant};

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

/// A case's group and name, and the bytes one run moves.
struct Case<'a> {
    group: &'a str,
    name: &'a str,
    bytes: u64,
}

/// Where a case runs: criterion, or the CPU-time loop.
trait Runner {
    /// Times `f`, running `setup` (untimed) before every `f` if given.
    fn run(&mut self, c: Case<'_>, setup: Option<&mut dyn FnMut()>, f: &mut dyn FnMut());

    fn case(&mut self, group: &str, name: &str, bytes: u64, f: &mut dyn FnMut()) {
        self.run(Case { group, name, bytes }, None, f)
    }

    /// `setup` (untimed) before every `f`.
    fn case_batched(
        &mut self,
        group: &str,
        name: &str,
        bytes: u64,
        setup: &mut dyn FnMut(),
        f: &mut dyn FnMut(),
    ) {
        self.run(Case { group, name, bytes }, Some(setup), f)
    }
}

struct Crit<'a>(&'a mut Criterion);

impl Runner for Crit<'_> {
    fn run(&mut self, c: Case<'_>, setup: Option<&mut dyn FnMut()>, f: &mut dyn FnMut()) {
        let mut g = self.0.benchmark_group(c.group);
        g.throughput(Throughput::BytesDecimal(c.bytes));
        match setup {
            None => g.bench_function(c.name, |b| b.iter(&mut *f)),
            Some(setup) => g.bench_function(c.name, |b| {
                b.iter_batched(&mut *setup, |()| f(), BatchSize::PerIteration)
            }),
        };
        g.finish();
    }
}

/// This thread's CPU time in ns (first field of schedstat).
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

struct CpuTime;

impl Runner for CpuTime {
    fn run(&mut self, c: Case<'_>, setup: Option<&mut dyn FnMut()>, f: &mut dyn FnMut()) {
        let mut nothing = || {};
        let setup = setup.unwrap_or(&mut nothing);
        setup();
        f();
        let (mut cpu, mut wall, mut reps) = (0u64, Duration::ZERO, 0u64);
        while wall < Duration::from_secs(1) || reps < 3 {
            setup();
            let (c0, w0) = (cpu_ns(), Instant::now());
            f();
            cpu += cpu_ns() - c0;
            wall += w0.elapsed();
            reps += 1;
        }
        let gb = (c.bytes * reps) as f64 / 1e9;
        println!(
            "{}/{}: {:.2} GB/s of CPU time, {:.2} GB/s wall (1 thread, {reps} runs)",
            c.group,
            c.name,
            gb / (cpu as f64 / 1e9),
            gb / wall.as_secs_f64()
        );
    }
}

fn norms<E: Elem>(r: &mut dyn Runner, name: &str, rows: usize) {
    let cols = 4096usize;
    let n = rows * cols;
    let sz = std::mem::size_of::<E>() as u64;
    let group = format!("train_rows/{name}/norm {rows}x{cols}");
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
    let gemma = RmsNormArgs {
        offset: 1.0,
        casting: RmsCasting::Gemma,
        ..a
    };
    let bytes = |tensors: u64| tensors * n as u64 * sz;
    let tier = cpu::tier();
    r.case(&group, "rms fwd", bytes(2), &mut || {
        rms_norm_fwd(tier, a, RmsFwd::new(&x, &w, &mut y, &mut rstd)).unwrap()
    });
    r.case(&group, "rms fwd gemma", bytes(2), &mut || {
        rms_norm_fwd(tier, gemma, RmsFwd::new(&x, &w, &mut y, &mut rstd)).unwrap()
    });
    r.case(&group, "rms bwd", bytes(3), &mut || {
        rms_norm_bwd(tier, a, RmsBwd::new(&dy, &x, &w, &rstd, &mut dx, &mut dw)).unwrap()
    });
    r.case(&group, "rms bwd gemma", bytes(3), &mut || {
        rms_norm_bwd(
            tier,
            gemma,
            RmsBwd::new(&dy, &x, &w, &rstd, &mut dx, &mut dw),
        )
        .unwrap()
    });
    r.case(&group, "add+rms fwd", bytes(4), &mut || {
        let t = RmsFwd {
            residual: Some(&res),
            sum: Some(&mut s),
            ..RmsFwd::new(&x, &w, &mut y, &mut rstd)
        };
        rms_norm_fwd(tier, a, t).unwrap()
    });
    r.case(&group, "add+rms bwd", bytes(4), &mut || {
        let t = RmsBwd {
            dsum: Some(&res),
            ..RmsBwd::new(&dy, &x, &w, &rstd, &mut dx, &mut dw)
        };
        rms_norm_bwd(tier, a, t).unwrap()
    });
    r.case(&group, "layernorm fwd", bytes(2), &mut || {
        let t = LnFwd {
            x: &x,
            w: &w,
            b: &w,
            y: &mut y,
            mean: &mut mean,
            rstd: &mut rstd,
        };
        layer_norm_fwd(tier, cols, 1e-5, t).unwrap()
    });
    r.case(&group, "layernorm bwd", bytes(3), &mut || {
        let t = LnBwd {
            dy: &dy,
            x: &x,
            w: &w,
            mean: &mean,
            rstd: &rstd,
            dx: &mut dx,
            dw: &mut dw,
            db: &mut db,
        };
        layer_norm_bwd(tier, cols, t).unwrap()
    });
}

fn rope<E: Elem>(r: &mut dyn Runner, name: &str) {
    let (bt, h, s, d) = (4usize, 32usize, 512usize, 128usize);
    let n = bt * h * s * d;
    let sz = std::mem::size_of::<E>() as u64;
    let group = format!("train_rows/{name}/rope [{bt},{h},{s},{d}]");
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
    // x is rotated in place again and again; forward then backward keeps
    // its values where they started (up to rounding).
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
            r.case(
                &group,
                &format!("{label} {dir}"),
                2 * n as u64 * sz,
                &mut || {
                    let t = RopeIo {
                        x: &mut x,
                        src: None,
                        cos: &cos,
                        sin: &sin,
                    };
                    rope_apply(cpu::tier(), t, &sh, inverse).unwrap()
                },
            );
        }
    }
}

fn glu<E: Elem>(r: &mut dyn Runner, name: &str) {
    let (rows, cols) = (4096usize, 11008usize);
    let n = rows * cols;
    let sz = std::mem::size_of::<E>() as u64;
    let group = format!("train_rows/{name}/glu {rows}x{cols}");
    let a: Vec<E> = data(n, 1);
    let bv: Vec<E> = data(n, 2);
    let dc: Vec<E> = data(n, 3);
    let mut out: Vec<E> = data(n, 4);
    let xy = std::cell::RefCell::new((a.clone(), bv.clone()));
    for kind in [Glu::Swi, Glu::GeTanh] {
        r.case(
            &group,
            &format!("{kind:?} fwd"),
            3 * n as u64 * sz,
            &mut || glu_fwd(cpu::tier(), kind, GluFwd::new(&a, &bv, &mut out)).unwrap(),
        );
        // Reads dc, a, b; writes da, db over a, b. The inputs are restored
        // (untimed) before every run: gradients written over them would
        // shrink towards subnormals.
        r.case_batched(
            &group,
            &format!("{kind:?} bwd"),
            5 * n as u64 * sz,
            &mut || {
                let (x, y) = &mut *xy.borrow_mut();
                x.copy_from_slice(&a);
                y.copy_from_slice(&bv);
            },
            &mut || {
                let (x, y) = &mut *xy.borrow_mut();
                glu_bwd(cpu::tier(), kind, GluBwd::new(&dc, x, y)).unwrap()
            },
        );
    }
}

fn all(r: &mut dyn Runner) {
    let only = std::env::var("TRAIN_ROWS").unwrap_or_default();
    let on = |k: &str| only.is_empty() || only.split(',').any(|o| o == k);
    if on("norm") {
        norms::<f32>(r, "f32", 4096);
        norms::<bf16>(r, "bf16", 4096);
    }
    if only.split(',').any(|o| o == "hot") {
        norms::<f32>(r, "f32 in cache", 16);
        norms::<bf16>(r, "bf16 in cache", 16);
    }
    if on("rope") {
        rope::<f32>(r, "f32");
        rope::<bf16>(r, "bf16");
    }
    if on("glu") {
        glu::<f32>(r, "f32");
        glu::<bf16>(r, "bf16");
    }
}

fn main() {
    let cpu_mode = std::env::var("TRAIN_ROWS_CPU").is_ok_and(|v| v == "1");
    let threads = if cpu_mode { 1 } else { THREADS };
    if let Err(e) = pool::set_global_threads(threads) {
        eprintln!("train_rows: {e}");
    }
    if cpu_mode {
        all(&mut CpuTime);
        return;
    }
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10)
        .configure_from_args();
    all(&mut Crit(&mut c));
    c.final_summary();
}
