//! The α-β (Hockney) cost model of one collective: a message of `n` bytes
//! between two ranks takes `α + n/β`, with `α` the latency and `β` the
//! bandwidth. A collective costs what its algorithm's critical path of
//! such messages costs, with `p` ranks:
//!
//! | collective | algorithm | time |
//! |---|---|---|
//! | barrier | dissemination | `⌈log2 p⌉·α` |
//! | broadcast | binomial tree | `⌈log2 p⌉·(α + n/β)` |
//! | all-reduce | ring (reduce-scatter, then all-gather) | `2(p−1)·α + 2(p−1)/p · n/β` |
//! | all-gather | ring | `(p−1)·α + m/β` |
//! | reduce-scatter | ring | `(p−1)·α + m/β` |
//! | all-to-all-v | pairwise exchange | `(p−1)·α + max(s, r)/β` |
//!
//! `n` is the buffer's byte length (broadcast, all-reduce); `m` the bytes
//! this rank moves in the ring, the other ranks' shares of the vector
//! (`(p−1)/p · N` for a vector of `N` bytes in equal shares); `s` and `r`
//! what this rank sends to and receives from the others. One rank costs
//! nothing.
//!
//! The formulas are those of R. Thakur, R. Rabenseifner and W. Gropp,
//! "Optimization of Collective Communication Operations in MPICH",
//! *International Journal of High Performance Computing Applications*
//! 19(1), 2005, for the algorithms MPI libraries use on large messages
//! (where bandwidth, not latency, decides). They model a network without
//! contention in which a rank sends and receives at once; real libraries
//! switch algorithms by message size, so the model is a guide to the
//! order of magnitude and to how costs scale with `p` and `n`, not a
//! prediction to the microsecond.

use crate::comm::{Collective, Kind};
use std::time::Duration;

/// A network in the α-β model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NetModel {
    /// α: the time of a zero-byte message between two ranks.
    pub latency: Duration,
    /// β: bytes per second between two ranks. `f64::INFINITY` models a
    /// network of latency alone; a value that is not positive (or NaN)
    /// is treated as unlimited too ([`NetModel::new`] refuses it).
    pub bandwidth: f64,
}

impl NetModel {
    /// A model of `latency` and `bandwidth` bytes per second; `None` when
    /// the bandwidth is not positive (or NaN).
    pub fn new(latency: Duration, bandwidth: f64) -> Option<NetModel> {
        (bandwidth > 0.0).then_some(NetModel { latency, bandwidth })
    }

    /// The modelled time of `op` as seen by `rank` of `size` ranks (see
    /// the module documentation for the formulas).
    pub fn cost(&self, op: &Collective, rank: usize, size: usize) -> Duration {
        let (latency, transfer) = self.cost_parts(op, rank, size);
        latency.saturating_add(transfer)
    }

    /// [`NetModel::cost`] in its two terms: the latencies (`α` times the
    /// messages on the critical path) and the transfer (bytes over `β`),
    /// the part that occupies the rank's link.
    pub fn cost_parts(&self, op: &Collective, rank: usize, size: usize) -> (Duration, Duration) {
        let p = size;
        if p <= 1 {
            return (Duration::ZERO, Duration::ZERO);
        }
        let (sent, received) = op.bytes(rank, size);
        let pf = p as f64;
        let alpha = self.latency.as_secs_f64();
        let (messages, bytes) = match op {
            Collective::Barrier => (log2_ceil(p), 0.0),
            Collective::Broadcast { buf, .. } => {
                (log2_ceil(p), log2_ceil(p) * buf.byte_len() as f64)
            }
            Collective::AllReduce { buf, .. } => (
                2.0 * (pf - 1.0),
                2.0 * (pf - 1.0) / pf * buf.byte_len() as f64,
            ),
            // The ring forwards the other ranks' shares: this rank
            // receives them all in an all-gather, and sends partial sums
            // of them all in a reduce-scatter.
            Collective::AllGather { .. } => (pf - 1.0, received as f64),
            Collective::ReduceScatter { .. } => (pf - 1.0, sent as f64),
            Collective::AllToAllV { .. } => (pf - 1.0, sent.max(received) as f64),
        };
        (seconds(messages * alpha), seconds(self.transfer(bytes)))
    }

    /// The modelled time of a collective of `kind` on `ranks` ranks, where
    /// `bytes` is: nothing for a barrier; the buffer for a broadcast and
    /// an all-reduce; the whole vector (every rank's share, in equal
    /// shares) for an all-gather and a reduce-scatter; the larger of what
    /// one rank sends to and receives from the others for an all-to-all-v.
    pub fn time(&self, kind: Kind, ranks: usize, bytes: usize) -> Duration {
        let p = ranks;
        if p <= 1 {
            return Duration::ZERO;
        }
        let n = bytes as f64;
        let pf = p as f64;
        let alpha = self.latency.as_secs_f64();
        let secs = match kind {
            Kind::Barrier => log2_ceil(p) * alpha,
            Kind::Broadcast => log2_ceil(p) * (alpha + self.transfer(n)),
            Kind::AllReduce => 2.0 * (pf - 1.0) * alpha + self.transfer(2.0 * (pf - 1.0) / pf * n),
            Kind::AllGather | Kind::ReduceScatter => return self.ring(p, (pf - 1.0) / pf * n),
            Kind::AllToAllV => (pf - 1.0) * alpha + self.transfer(n),
        };
        seconds(secs)
    }

    /// `(p−1)·α + moved/β`.
    fn ring(&self, p: usize, moved: f64) -> Duration {
        if p <= 1 {
            return Duration::ZERO;
        }
        seconds((p as f64 - 1.0) * self.latency.as_secs_f64() + self.transfer(moved))
    }

    /// `bytes/β` in seconds.
    fn transfer(&self, bytes: f64) -> f64 {
        if self.bandwidth > 0.0 && self.bandwidth.is_finite() {
            bytes / self.bandwidth
        } else {
            0.0
        }
    }
}

/// `⌈log2 p⌉` for `p ≥ 1`.
fn log2_ceil(p: usize) -> f64 {
    f64::from(usize::BITS - p.saturating_sub(1).leading_zeros())
}

/// Seconds as a duration, saturating (a model never panics).
fn seconds(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs).unwrap_or(if secs > 0.0 {
        Duration::MAX
    } else {
        Duration::ZERO
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Buffer, ReduceOp};

    const US: Duration = Duration::from_micros(1);

    fn net() -> NetModel {
        // α = 10 µs, β = 1 MB/s: one byte costs 1 µs.
        NetModel::new(10 * US, 1e6).unwrap()
    }

    fn close(a: Duration, b: Duration) -> bool {
        a.abs_diff(b) <= Duration::from_nanos(2)
    }

    #[test]
    fn log2() {
        let got: Vec<f64> = (1..=9).map(log2_ceil).collect();
        assert_eq!(got, [0.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0, 4.0]);
    }

    #[test]
    fn one_rank_is_free() {
        let n = net();
        let op = Collective::AllReduce {
            buf: Buffer::F32(vec![0.0; 1000]),
            op: ReduceOp::Sum,
        };
        assert_eq!(n.cost(&op, 0, 1), Duration::ZERO);
        for k in Kind::ALL {
            assert_eq!(n.time(k, 1, 1 << 20), Duration::ZERO);
            assert_eq!(n.time(k, 0, 1 << 20), Duration::ZERO);
        }
    }

    #[test]
    fn formulas() {
        let n = net();
        // Barrier: ⌈log2 5⌉ = 3 latencies.
        assert!(close(n.cost(&Collective::Barrier, 0, 5), 30 * US));
        // Broadcast of 400 bytes on 4 ranks: 2 · (10 + 400) µs, on every rank.
        let b = Collective::Broadcast {
            buf: Buffer::F32(vec![0.0; 100]),
            root: 1,
        };
        for r in 0..4 {
            assert!(close(n.cost(&b, r, 4), 820 * US));
        }
        // All-reduce of 400 bytes on 4 ranks: 6·10 + 2·3/4·400 = 660 µs.
        let a = Collective::AllReduce {
            buf: Buffer::U32(vec![0; 100]),
            op: ReduceOp::Max,
        };
        assert!(close(n.cost(&a, 2, 4), 660 * US));
        assert!(close(n.time(Kind::AllReduce, 4, 400), 660 * US));
        // All-gather of 4 × 25 f32 (400 bytes): 3·10 + 300 = 330 µs.
        let g = Collective::AllGather {
            send: Buffer::F32(vec![0.0; 25]),
            counts: vec![25; 4],
        };
        assert!(close(n.cost(&g, 0, 4), 330 * US));
        assert!(close(n.time(Kind::AllGather, 4, 400), 330 * US));
        // Unequal shares: rank 0 owns 10 of 40 bytes, and moves the other 30.
        let g = Collective::AllGather {
            send: Buffer::U8(vec![0; 10]),
            counts: vec![10, 20, 10],
        };
        assert!(close(n.cost(&g, 0, 3), 50 * US));
        // Reduce-scatter of 400 bytes on 4 ranks, equal shares: as the all-gather.
        let s = Collective::ReduceScatter {
            send: Buffer::F32(vec![0.0; 100]),
            counts: vec![25; 4],
            op: ReduceOp::Sum,
        };
        assert!(close(n.cost(&s, 3, 4), 330 * US));
        assert!(close(n.time(Kind::ReduceScatter, 4, 400), 330 * US));
        // All-to-all-v: rank 1 of 3 sends 2+0 elements to others, receives 5+1.
        let v = Collective::AllToAllV {
            send: Buffer::F32(vec![0.0; 10]),
            send_counts: vec![2, 8, 0],
            recv_counts: vec![5, 8, 1],
        };
        assert!(close(n.cost(&v, 1, 3), (20 + 24) * US));
        assert!(close(n.time(Kind::AllToAllV, 3, 24), 44 * US));
    }

    #[test]
    fn malformed_collectives_do_not_panic() {
        // Counts the buffer does not hold: a tool may ask before validating.
        let s = Collective::ReduceScatter {
            send: Buffer::F32(vec![0.0; 1]),
            counts: vec![5, 0],
            op: ReduceOp::Sum,
        };
        assert!(net().cost(&s, 0, 2) >= 10 * US);
    }

    #[test]
    fn unlimited_bandwidth_and_saturation() {
        assert!(NetModel::new(US, 0.0).is_none());
        assert!(NetModel::new(US, f64::NAN).is_none());
        let latency_only = NetModel::new(US, f64::INFINITY).unwrap();
        assert!(close(
            latency_only.time(Kind::AllReduce, 3, usize::MAX),
            4 * US
        ));
        let bad = NetModel {
            latency: US,
            bandwidth: -1.0,
        };
        assert!(close(bad.time(Kind::Broadcast, 2, 1000), US));
        let slow = NetModel::new(Duration::MAX, 1e-300).unwrap();
        assert_eq!(slow.time(Kind::AllReduce, 8, usize::MAX), Duration::MAX);
    }
}
