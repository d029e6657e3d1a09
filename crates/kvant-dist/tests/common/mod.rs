//! Collective checks shared by the in-process tests and the MPI ranks:
//! every rank draws every rank's inputs from one seed, so each computes
//! the expected results alone and compares its own.

#![allow(dead_code)]

use kvant_dist::{Buffer, Collective, Comm, CommExt, Elem, ReduceOp};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How f32 sums are compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sums {
    /// Bit-identical to the sum in rank order 0, 1, 2, … (the in-process
    /// backend's promise).
    RankOrder,
    /// Within 1e-5 of it (MPI adds in its own order); the bits are still
    /// checked identical on every rank.
    Close,
}

/// A generator for (seed, round, purpose, rank).
pub fn rng(seed: u64, round: u64, purpose: u64, rank: u64) -> ChaCha8Rng {
    let mut h = seed;
    for x in [round, purpose, rank] {
        h = (h ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }
    ChaCha8Rng::seed_from_u64(h)
}

/// A length: zero one time in five, sometimes large.
fn length(r: &mut ChaCha8Rng) -> usize {
    match r.random_range(0..10) {
        0 | 1 => 0,
        2 => r.random_range(1000..5000),
        _ => r.random_range(1..40),
    }
}

pub fn values(elem: Elem, r: &mut ChaCha8Rng, n: usize) -> Buffer {
    match elem {
        Elem::F32 => Buffer::F32((0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()),
        Elem::U32 => Buffer::U32((0..n).map(|_| r.random()).collect()),
        Elem::U8 => Buffer::U8((0..n).map(|_| r.random()).collect()),
    }
}

/// The element-wise reduction of `range` of every buffer, in rank order.
fn reduce(bufs: &[Buffer], op: ReduceOp, range: std::ops::Range<usize>) -> Buffer {
    macro_rules! fold {
        ($variant:ident, $f:expr) => {{
            let vs: Vec<&[_]> = bufs
                .iter()
                .map(|b| match b {
                    Buffer::$variant(v) => &v[range.clone()],
                    _ => unreachable!("mixed element types"),
                })
                .collect();
            let mut acc = vs[0].to_vec();
            for v in &vs[1..] {
                for (a, &b) in acc.iter_mut().zip(v.iter()) {
                    *a = $f(*a, b);
                }
            }
            Buffer::$variant(acc)
        }};
    }
    match (&bufs[0], op) {
        (Buffer::F32(_), ReduceOp::Sum) => fold!(F32, |a: f32, b: f32| a + b),
        (Buffer::F32(_), ReduceOp::Max) => fold!(F32, |a: f32, b: f32| if b > a { b } else { a }),
        (Buffer::U32(_), ReduceOp::Sum) => fold!(U32, |a: u32, b: u32| a.wrapping_add(b)),
        (Buffer::U32(_), ReduceOp::Max) => fold!(U32, |a: u32, b: u32| a.max(b)),
        (Buffer::U8(_), ReduceOp::Sum) => fold!(U8, |a: u8, b: u8| a.wrapping_add(b)),
        (Buffer::U8(_), ReduceOp::Max) => fold!(U8, |a: u8, b: u8| a.max(b)),
    }
}

/// Elements `range` of `b`.
fn part(b: &Buffer, range: std::ops::Range<usize>) -> Buffer {
    let mut out = Buffer::with_capacity(b.elem(), range.len());
    out.extend_from(b, range).expect("range inside the buffer");
    out
}

fn concat(parts: &[Buffer], elem: Elem) -> Buffer {
    let mut out = Buffer::with_capacity(elem, parts.iter().map(Buffer::len).sum());
    for p in parts {
        out.extend_from(p, 0..p.len()).expect("same element type");
    }
    out
}

/// Whether `got` is `want`: exactly, or f32 sums within 1e-5 with `Close`.
fn compare(what: &str, got: &Buffer, want: &Buffer, sum: bool, sums: Sums) -> Result<(), String> {
    if got.elem() != want.elem() || got.len() != want.len() {
        return Err(format!(
            "{what}: got {:?} × {}, want {:?} × {}",
            got.elem(),
            got.len(),
            want.elem(),
            want.len()
        ));
    }
    match (got, want) {
        (Buffer::F32(g), Buffer::F32(w)) if sum && sums == Sums::Close => {
            if let Some(i) = (0..g.len()).find(|&i| (g[i] - w[i]).abs() > 1e-5) {
                return Err(format!("{what}: element {i} is {}, want {}", g[i], w[i]));
            }
        }
        (Buffer::F32(g), Buffer::F32(w)) => {
            if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
                return Err(format!(
                    "{what}: element {i} is {} ({:#x}), want {} ({:#x})",
                    g[i],
                    g[i].to_bits(),
                    w[i],
                    w[i].to_bits()
                ));
            }
        }
        _ => {
            if got != want {
                return Err(format!("{what}: wrong values"));
            }
        }
    }
    Ok(())
}

/// Checks that every rank holds the same f32 bits in `x`.
fn same_bits_everywhere(comm: &dyn Comm, what: &str, x: &[f32]) -> Result<(), String> {
    let p = comm.size();
    let bits: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
    let all = comm
        .all_gather(Buffer::U32(bits.clone()), vec![x.len(); p])
        .map_err(|e| format!("{what}: gathering the bits: {e}"))?
        .into_u32()
        .map_err(|e| e.to_string())?;
    for r in 0..p {
        if all[r * x.len()..(r + 1) * x.len()] != bits[..] {
            return Err(format!(
                "{what}: rank {r} has other bits than rank {}",
                comm.rank()
            ));
        }
    }
    Ok(())
}

/// Counts for `p` ranks, some zero.
fn counts(r: &mut ChaCha8Rng, p: usize) -> Vec<usize> {
    (0..p)
        .map(|_| {
            if r.random_range(0..4) == 0 {
                0
            } else {
                r.random_range(1..30)
            }
        })
        .collect()
}

const ELEMS: [Elem; 3] = [Elem::F32, Elem::U32, Elem::U8];

/// One of each collective per round, `rounds` rounds, checked against
/// directly computed results; then some posted together and completed in
/// the other order. The number of collectives run.
pub fn check_collectives(
    comm: &dyn Comm,
    seed: u64,
    rounds: u64,
    sums: Sums,
) -> Result<usize, String> {
    let (me, p) = (comm.rank(), comm.size());
    let mut n = 0usize;
    let run = |n: &mut usize, what: &str, op: Collective| -> Result<Buffer, String> {
        *n += 1;
        comm.run(op)
            .map_err(|e| format!("{what} (rank {me} of {p}): {e}"))
    };
    for round in 0..rounds {
        let mut plan = rng(seed, round, 0, 0);
        // Every rank's input for purpose `k`.
        let inputs = |k: u64, elem: Elem, len: &dyn Fn(usize) -> usize| -> Vec<Buffer> {
            (0..p)
                .map(|r| values(elem, &mut rng(seed, round, k, r as u64), len(r)))
                .collect()
        };

        run(&mut n, "barrier", Collective::Barrier)?;

        for (k, elem) in ELEMS.into_iter().enumerate() {
            let root = plan.random_range(0..p);
            let len = length(&mut plan);
            let all = inputs(10 + k as u64, elem, &|_| len);
            let buf = if me == root {
                all[root].clone()
            } else {
                Buffer::zeros(elem, len)
            };
            let what = format!("round {round}: broadcast {elem:?} × {len} from {root}");
            let got = run(&mut n, &what, Collective::Broadcast { buf, root })?;
            compare(&what, &got, &all[root], false, sums)?;
        }

        let reductions = [
            (Elem::F32, ReduceOp::Sum),
            (Elem::F32, ReduceOp::Max),
            (Elem::U32, ReduceOp::Sum),
            (Elem::U32, ReduceOp::Max),
            (Elem::U8, ReduceOp::Max),
        ];
        for (k, (elem, op)) in reductions.into_iter().enumerate() {
            let len = length(&mut plan);
            let all = inputs(20 + k as u64, elem, &|_| len);
            let what = format!("round {round}: all-reduce {op:?} of {elem:?} × {len}");
            let got = run(
                &mut n,
                &what,
                Collective::AllReduce {
                    buf: all[me].clone(),
                    op,
                },
            )?;
            compare(
                &what,
                &got,
                &reduce(&all, op, 0..len),
                op == ReduceOp::Sum,
                sums,
            )?;
            if let Buffer::F32(x) = &got {
                n += 1;
                same_bits_everywhere(comm, &what, x)?;
            }
        }

        for (k, elem) in ELEMS.into_iter().enumerate() {
            let c = counts(&mut plan, p);
            let all = inputs(30 + k as u64, elem, &|r| c[r]);
            let what = format!("round {round}: all-gather {elem:?}, counts {c:?}");
            let got = run(
                &mut n,
                &what,
                Collective::AllGather {
                    send: all[me].clone(),
                    counts: c.clone(),
                },
            )?;
            compare(&what, &got, &concat(&all, elem), false, sums)?;
        }

        let scatters = [
            (Elem::F32, ReduceOp::Sum),
            (Elem::F32, ReduceOp::Max),
            (Elem::U32, ReduceOp::Sum),
            (Elem::U8, ReduceOp::Max),
        ];
        for (k, (elem, op)) in scatters.into_iter().enumerate() {
            let c = counts(&mut plan, p);
            let total: usize = c.iter().sum();
            let all = inputs(40 + k as u64, elem, &|_| total);
            let off: usize = c[..me].iter().sum();
            let what = format!("round {round}: reduce-scatter {op:?} of {elem:?}, counts {c:?}");
            let got = run(
                &mut n,
                &what,
                Collective::ReduceScatter {
                    send: all[me].clone(),
                    counts: c.clone(),
                    op,
                },
            )?;
            compare(
                &what,
                &got,
                &reduce(&all, op, off..off + c[me]),
                op == ReduceOp::Sum,
                sums,
            )?;
        }

        {
            let elem = ELEMS[plan.random_range(0..3)];
            // matrix[s][d]: elements rank s sends rank d.
            let matrix: Vec<Vec<usize>> = (0..p).map(|_| counts(&mut plan, p)).collect();
            let all = inputs(50, elem, &|s| matrix[s].iter().sum());
            let recv_counts: Vec<usize> = (0..p).map(|s| matrix[s][me]).collect();
            let want: Vec<Buffer> = (0..p)
                .map(|s| {
                    let off: usize = matrix[s][..me].iter().sum();
                    part(&all[s], off..off + matrix[s][me])
                })
                .collect();
            let what = format!("round {round}: all-to-all-v {elem:?}, matrix {matrix:?}");
            let got = run(
                &mut n,
                &what,
                Collective::AllToAllV {
                    send: all[me].clone(),
                    send_counts: matrix[me].clone(),
                    recv_counts,
                },
            )?;
            compare(&what, &got, &concat(&want, elem), false, sums)?;
        }
    }

    // Posted together, completed in the other order.
    let mut plan = rng(seed, rounds, 0, 0);
    let len = length(&mut plan);
    let all = (0..p)
        .map(|r| values(Elem::F32, &mut rng(seed, rounds, 60, r as u64), len))
        .collect::<Vec<_>>();
    let c = counts(&mut plan, p);
    let gathered = (0..p)
        .map(|r| values(Elem::U32, &mut rng(seed, rounds, 61, r as u64), c[r]))
        .collect::<Vec<_>>();
    let err = |e: kvant_dist::DistError| format!("non-blocking (rank {me} of {p}): {e}");
    let mut first = comm
        .post(Collective::AllReduce {
            buf: all[me].clone(),
            op: ReduceOp::Sum,
        })
        .map_err(err)?;
    let second = comm
        .post(Collective::AllGather {
            send: gathered[me].clone(),
            counts: c.clone(),
        })
        .map_err(err)?;
    let third = comm.post(Collective::Barrier).map_err(err)?;
    n += 3;
    first.test().map_err(err)?;
    third.wait().map_err(err)?;
    compare(
        "non-blocking all-gather",
        &second.wait().map_err(err)?,
        &concat(&gathered, Elem::U32),
        false,
        sums,
    )?;
    compare(
        "non-blocking all-reduce",
        &first.wait().map_err(err)?,
        &reduce(&all, ReduceOp::Sum, 0..len),
        true,
        sums,
    )?;

    // The typed forms.
    let mut x: Vec<f32> = (0..7).map(|i| (i * (me + 1)) as f32).collect();
    comm.all_reduce_sum(&mut x).map_err(err)?;
    let tri = (p * (p + 1) / 2) as f32;
    if x != (0..7).map(|i| i as f32 * tri).collect::<Vec<_>>() {
        return Err(format!("all_reduce_sum: {x:?}"));
    }
    let root = p - 1;
    let msg = (me == root).then(|| (0..(seed % 50) as u32).collect::<Vec<u32>>());
    let got = comm.broadcast_words(msg, root).map_err(err)?;
    if got != (0..(seed % 50) as u32).collect::<Vec<u32>>() {
        return Err(format!("broadcast_words: {got:?}"));
    }
    n += 3;
    Ok(n)
}
