//! The in-process backend: every collective on 1 to 4 rank-threads, splits,
//! non-blocking completion, timeouts, lost ranks, abort and mismatches.

mod common;

use common::{check_collectives, Sums};
use kvant_dist::{local, Buffer, Collective, Comm, CommExt, DistError, ReduceOp};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(20);

/// Runs `f` on every rank of a new world, each on its own thread; the
/// results in rank order (a panicking rank's is `Err`).
fn on_ranks<T: Send>(
    size: usize,
    timeout: Duration,
    f: impl Fn(Arc<dyn Comm>) -> T + Sync,
) -> Vec<std::thread::Result<T>> {
    let comms = local::world(size, timeout);
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = comms.into_iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join()).collect()
    })
}

fn all_ok<T>(results: Vec<std::thread::Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|_| panic!("rank {r} panicked")))
        .collect()
}

#[test]
fn every_collective_on_one_to_four_ranks() {
    for size in 1..=4 {
        for seed in [1u64, 7, 42] {
            let got = all_ok(on_ranks(size, LONG, |c| {
                check_collectives(c.as_ref(), seed, 6, Sums::RankOrder)
            }));
            for (r, g) in got.into_iter().enumerate() {
                if let Err(e) = g {
                    panic!("{size} ranks, seed {seed}, rank {r}: {e}");
                }
            }
        }
    }
}

#[test]
fn f32_sums_follow_rank_order() {
    // (((1e8 + 1) - 1e8) + 1) in f32 is 1; another order gives 0 or 2.
    let got = all_ok(on_ranks(4, LONG, |c| {
        let v = [1e8f32, 1.0, -1e8, 1.0][c.rank()];
        let mut x = vec![v; 3];
        c.all_reduce_sum(&mut x).unwrap();
        x
    }));
    for x in got {
        assert_eq!(x, [1.0; 3]);
    }
}

#[test]
fn split_orders_by_key_then_rank() {
    let got = all_ok(on_ranks(5, LONG, |c| {
        let r = c.rank();
        // Evens and odds; keys reverse the order, except ranks 3 and 1 tie.
        let key = if r == 3 || r == 1 { 0 } else { 10 - r };
        let child = c.split(r % 2, key).unwrap();
        let gathered = child
            .all_gather(Buffer::U32(vec![r as u32]), vec![1; child.size()])
            .unwrap()
            .into_u32()
            .unwrap();
        let sub = child.split(0, 0).unwrap();
        let checked = check_collectives(child.as_ref(), 3, 2, Sums::RankOrder)
            .and_then(|_| check_collectives(sub.as_ref(), 4, 1, Sums::RankOrder));
        (child.rank(), child.size(), gathered, checked)
    }));
    let want = [
        (2, 3, vec![4, 2, 0]),
        (0, 2, vec![1, 3]),
        (1, 3, vec![4, 2, 0]),
        (1, 2, vec![1, 3]),
        (0, 3, vec![4, 2, 0]),
    ];
    for (r, ((rank, size, gathered, checked), want)) in got.into_iter().zip(want).enumerate() {
        assert_eq!((rank, size, gathered), want, "rank {r}");
        checked.unwrap();
    }
}

#[test]
fn split_children_progress_independently() {
    all_ok(on_ranks(4, LONG, |c| {
        let a = c.split(0, c.rank()).unwrap();
        let b = c.split(0, c.rank()).unwrap();
        let sum = |comm: &Arc<dyn Comm>, v: f32| {
            comm.post(Collective::AllReduce {
                buf: Buffer::F32(vec![v]),
                op: ReduceOp::Sum,
            })
            .unwrap()
        };
        // Even ranks post on A then B; odd ranks on B then A.
        let (ra, rb) = if c.rank().is_multiple_of(2) {
            let ra = sum(&a, 1.0);
            (ra, sum(&b, 10.0))
        } else {
            let rb = sum(&b, 10.0);
            (sum(&a, 1.0), rb)
        };
        assert_eq!(ra.wait().unwrap(), Buffer::F32(vec![4.0]));
        assert_eq!(rb.wait().unwrap(), Buffer::F32(vec![40.0]));

        // Two streams per rank, one per communicator, each blocking.
        std::thread::scope(|s| {
            for (comm, v) in [(&a, 1.0f32), (&b, 2.0)] {
                s.spawn(move || {
                    for i in 0..200 {
                        let mut x = [v, i as f32];
                        comm.all_reduce_sum(&mut x).unwrap();
                        assert_eq!(x, [4.0 * v, 4.0 * i as f32]);
                    }
                });
            }
        });
    }));
}

#[test]
fn posted_together_completed_in_the_other_order() {
    all_ok(on_ranks(3, LONG, |c| {
        let r = c.rank();
        let mut first = c
            .post(Collective::AllGather {
                send: Buffer::U8(vec![r as u8; r]),
                counts: vec![0, 1, 2],
            })
            .unwrap();
        let second = c
            .post(Collective::Broadcast {
                buf: Buffer::U32(vec![r as u32; 2]),
                root: 2,
            })
            .unwrap();
        let _ = first.test().unwrap();
        assert_eq!(second.wait().unwrap(), Buffer::U32(vec![2, 2]));
        // Test until complete without blocking.
        let t = Instant::now();
        while !first.test().unwrap() {
            assert!(t.elapsed() < LONG);
            std::thread::yield_now();
        }
        assert_eq!(first.wait().unwrap(), Buffer::U8(vec![1, 2, 2]));
    }));
}

#[test]
fn dropped_requests_do_not_block_later_collectives() {
    all_ok(on_ranks(3, LONG, |c| {
        for i in 0..20 {
            let r = c
                .post(Collective::AllReduce {
                    buf: Buffer::U32(vec![i]),
                    op: ReduceOp::Max,
                })
                .unwrap();
            if (i as usize + c.rank()).is_multiple_of(2) {
                drop(r);
            } else {
                assert_eq!(r.wait().unwrap(), Buffer::U32(vec![i]));
            }
        }
        c.barrier().unwrap();
    }));
}

#[test]
fn a_rank_that_never_posts_times_out_by_name() {
    let timeout = Duration::from_millis(200);
    let done = Barrier::new(3);
    let got = all_ok(on_ranks(3, timeout, |c| {
        if c.rank() == 2 {
            // Alive (holding its communicator) but silent.
            done.wait();
            return None;
        }
        let t = Instant::now();
        let err = c.barrier().unwrap_err();
        let waited = t.elapsed();
        done.wait();
        Some((err, waited))
    }));
    for (err, waited) in got.into_iter().flatten() {
        match err {
            DistError::Timeout { what, after } => {
                assert_eq!(after, timeout);
                assert!(what.contains("ranks [2]"), "{what}");
                assert!(what.contains("barrier"), "{what}");
            }
            other => panic!("{other:?}"),
        }
        assert!(waited >= timeout && waited < timeout * 10, "{waited:?}");
    }
}

#[test]
fn a_rank_that_returns_early_is_lost_at_once() {
    let got = all_ok(on_ranks(3, LONG, |c| {
        match c.rank() {
            // Joins one all-reduce, then leaves.
            2 => {
                drop(
                    c.post(Collective::AllReduce {
                        buf: Buffer::F32(vec![1.0]),
                        op: ReduceOp::Sum,
                    })
                    .unwrap(),
                );
                None
            }
            _ => {
                std::thread::sleep(Duration::from_millis(20));
                let mut x = [1.0];
                // The collective it joined completes without it...
                c.all_reduce_sum(&mut x).unwrap();
                assert_eq!(x, [3.0]);
                // ... the next one needs it.
                let t = Instant::now();
                let err = c.barrier().unwrap_err();
                Some((err, t.elapsed()))
            }
        }
    }));
    for (err, waited) in got.into_iter().flatten() {
        assert_eq!(
            err,
            DistError::RankLost {
                rank: 2,
                why: "left".into()
            }
        );
        assert!(waited < Duration::from_secs(2), "{waited:?}");
    }
}

#[test]
fn a_panicking_rank_is_lost() {
    let got = on_ranks(3, LONG, |c| {
        let child = c.split(0, 0).unwrap();
        if c.rank() == 1 {
            panic!("rank 1 fails on purpose");
        }
        let t = Instant::now();
        let err = child.barrier().unwrap_err();
        (err, t.elapsed())
    });
    assert!(got[1].is_err());
    for (r, g) in got.into_iter().enumerate().filter(|&(r, _)| r != 1) {
        let (err, waited) = g.unwrap_or_else(|_| panic!("rank {r} panicked"));
        assert_eq!(
            err,
            DistError::RankLost {
                rank: 1,
                why: "left".into()
            }
        );
        assert!(waited < Duration::from_secs(2));
    }
}

#[test]
fn abort_fails_every_rank_and_every_split() {
    let got = all_ok(on_ranks(3, LONG, |c| {
        let child = c.split(c.rank() % 2, 0).unwrap();
        let lost = DistError::RankLost {
            rank: 1,
            why: "aborted with code 7".into(),
        };
        let t = Instant::now();
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(30));
            c.abort(7);
            // Its own collectives fail too, on every communicator.
            assert_eq!(c.barrier().unwrap_err(), lost);
            assert_eq!(child.barrier().unwrap_err(), lost);
        } else {
            let pending = child.post(Collective::Barrier);
            // Rank 0 and 2 share the even child: its barrier may complete.
            let _ = pending.map(|r| r.wait());
            assert_eq!(c.barrier().unwrap_err(), lost);
            assert_eq!(child.barrier().unwrap_err(), lost);
            assert!(matches!(
                c.post(Collective::Barrier),
                Err(DistError::RankLost { rank: 1, .. })
            ));
        }
        t.elapsed()
    }));
    for waited in got {
        assert!(waited < Duration::from_secs(2), "{waited:?}");
    }
}

/// Each rank posts `op(rank)`; every rank must get a mismatch, and the
/// communicator must still work afterwards.
fn mismatch(size: usize, op: impl Fn(usize) -> Collective + Sync) {
    let got = all_ok(on_ranks(size, LONG, |c| {
        let out = c.run(op(c.rank()));
        c.barrier().unwrap();
        out
    }));
    for (r, g) in got.into_iter().enumerate() {
        match g {
            Err(DistError::Mismatch(m)) => assert!(!m.is_empty()),
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn disagreements_fail_every_rank() {
    let f32s = |n: usize| Buffer::F32(vec![0.0; n]);
    // Kinds.
    mismatch(2, |r| match r {
        0 => Collective::Barrier,
        _ => Collective::AllReduce {
            buf: f32s(1),
            op: ReduceOp::Sum,
        },
    });
    // Element types.
    mismatch(3, |r| Collective::AllReduce {
        buf: if r == 1 {
            Buffer::U32(vec![0])
        } else {
            f32s(1)
        },
        op: ReduceOp::Max,
    });
    // Lengths.
    mismatch(3, |r| Collective::AllReduce {
        buf: f32s(if r == 2 { 4 } else { 3 }),
        op: ReduceOp::Sum,
    });
    // Reductions.
    mismatch(2, |r| Collective::AllReduce {
        buf: f32s(2),
        op: if r == 0 { ReduceOp::Sum } else { ReduceOp::Max },
    });
    // Roots.
    mismatch(2, |r| Collective::Broadcast {
        buf: f32s(2),
        root: r,
    });
    // Broadcast lengths.
    mismatch(2, |r| Collective::Broadcast {
        buf: f32s(r + 1),
        root: 0,
    });
    // All-gather counts (each valid alone).
    mismatch(2, |r| Collective::AllGather {
        send: f32s(1),
        counts: if r == 0 { vec![1, 1] } else { vec![2, 1] },
    });
    // Reduce-scatter counts.
    mismatch(2, |r| Collective::ReduceScatter {
        send: f32s(2),
        counts: if r == 0 { vec![1, 1] } else { vec![2, 0] },
        op: ReduceOp::Sum,
    });
    // All-to-all: rank 0 sends rank 1 two elements; rank 1 expects one.
    mismatch(2, |_| Collective::AllToAllV {
        send: f32s(3),
        send_counts: vec![1, 2],
        recv_counts: vec![1, 1],
    });
    // Malformed on one rank only: it fails at the post, the others at the wait.
    mismatch(3, |r| Collective::AllGather {
        send: f32s(1),
        counts: if r == 1 { vec![1, 2, 1] } else { vec![1, 1, 1] },
    });
}

#[test]
fn malformed_posts_are_refused() {
    let c = &local::world(2, LONG)[0];
    let bad = [
        Collective::Broadcast {
            buf: Buffer::U8(vec![]),
            root: 2,
        },
        Collective::AllReduce {
            buf: Buffer::U8(vec![1]),
            op: ReduceOp::Sum,
        },
        Collective::AllGather {
            send: Buffer::U8(vec![1]),
            counts: vec![1],
        },
        Collective::AllToAllV {
            send: Buffer::U8(vec![1]),
            send_counts: vec![0, 0],
            recv_counts: vec![0, 0],
        },
    ];
    for op in bad {
        assert!(matches!(c.post(op), Err(DistError::Mismatch(_))));
    }
}
