//! A communicator wrapper that meters every collective and, optionally,
//! models a network.
//!
//! [`Metered::wrap`] counts, per [`Kind`], the collectives posted, the
//! bytes each sends and receives ([`Collective::bytes`]), the seconds from
//! post to completion (*in flight*: what overlapping can hide) and the
//! seconds the caller spent blocked in [`Request::wait`] (what it did
//! not hide).
//!
//! With a [`NetModel`], a request does not complete before its modelled
//! cost has passed: the model is a NIC that moves the data while the
//! cores compute, so the delay runs from the post and compute between
//! post and wait hides it. The rank has one link: collectives in flight
//! together share it, each one's transfer (`bytes/β`) starting when the
//! previous one's ends, while their latencies (`α` terms) overlap. A
//! collective posted at `t` on an idle link completes at `t + cost`. The model *adds to* the real transport's time and never
//! replaces it: a request completes when both the inner request has
//! completed and the modelled time has passed, so a real transport slower
//! than the model is seen as it is. Over the in-process backend (whose
//! transfers take microseconds) the model decides; over MPI on one host
//! it turns shared-memory transfers into those of the modelled network.

use crate::comm::{Collective, Comm, Kind, Request};
use crate::cost::NetModel;
use crate::error::DistError;
use crate::Buffer;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One kind's totals.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KindStats {
    pub kind: Kind,
    /// Collectives posted.
    pub count: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Seconds from post to completion, summed over completed collectives.
    pub inflight_secs: f64,
    /// Seconds callers spent in [`Request::wait`], summed.
    pub blocked_secs: f64,
    /// Seconds the network model charged (α + bytes/β per collective),
    /// summed; 0 without a model.
    pub modelled_secs: f64,
}

#[derive(Default)]
struct Counters {
    count: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    inflight_ns: AtomicU64,
    blocked_ns: AtomicU64,
    modelled_ns: AtomicU64,
}

/// The totals of a metered communicator and its splits; thread-safe.
#[derive(Default)]
pub struct Stats {
    kinds: [Counters; Kind::ALL.len()],
}

fn index(kind: Kind) -> usize {
    match kind {
        Kind::Barrier => 0,
        Kind::Broadcast => 1,
        Kind::AllReduce => 2,
        Kind::AllGather => 3,
        Kind::ReduceScatter => 4,
        Kind::AllToAllV => 5,
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Stats {
    pub fn new() -> Stats {
        Stats::default()
    }

    /// Every kind's totals, in [`Kind::ALL`] order (kinds never posted
    /// included, with zeros).
    pub fn snapshot(&self) -> Vec<KindStats> {
        Kind::ALL.iter().map(|&k| self.get(k)).collect()
    }

    /// One kind's totals.
    pub fn get(&self, kind: Kind) -> KindStats {
        let c = &self.kinds[index(kind)];
        let secs = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed)).as_secs_f64();
        KindStats {
            kind,
            count: c.count.load(Ordering::Relaxed),
            bytes_sent: c.bytes_sent.load(Ordering::Relaxed),
            bytes_received: c.bytes_received.load(Ordering::Relaxed),
            inflight_secs: secs(&c.inflight_ns),
            blocked_secs: secs(&c.blocked_ns),
            modelled_secs: secs(&c.modelled_ns),
        }
    }

    /// Sets every total to zero. Collectives in flight meanwhile still
    /// add their times when they complete.
    pub fn reset(&self) {
        for c in &self.kinds {
            for a in [
                &c.count,
                &c.bytes_sent,
                &c.bytes_received,
                &c.inflight_ns,
                &c.blocked_ns,
                &c.modelled_ns,
            ] {
                a.store(0, Ordering::Relaxed);
            }
        }
    }

    fn posted(&self, kind: Kind, sent: usize, received: usize, cost: Option<Duration>) {
        let c = &self.kinds[index(kind)];
        c.count.fetch_add(1, Ordering::Relaxed);
        if let Some(d) = cost {
            c.modelled_ns.fetch_add(nanos(d), Ordering::Relaxed);
        }
        c.bytes_sent.fetch_add(sent as u64, Ordering::Relaxed);
        c.bytes_received
            .fetch_add(received as u64, Ordering::Relaxed);
    }

    fn inflight(&self, kind: Kind, d: Duration) {
        self.kinds[index(kind)]
            .inflight_ns
            .fetch_add(nanos(d), Ordering::Relaxed);
    }

    fn blocked(&self, kind: Kind, d: Duration) {
        self.kinds[index(kind)]
            .blocked_ns
            .fetch_add(nanos(d), Ordering::Relaxed);
    }
}

/// A communicator that meters its collectives (see the module docs).
pub struct Metered {
    inner: Arc<dyn Comm>,
    stats: Arc<Stats>,
    net: Option<NetModel>,
    /// When the modelled link is free again: shared by the splits of one
    /// metered communicator (one rank's collectives).
    link: Arc<Mutex<Instant>>,
}

impl Metered {
    /// Wraps `inner`; the statistics it keeps, shared with its splits.
    pub fn wrap(inner: Arc<dyn Comm>, net: Option<NetModel>) -> (Arc<dyn Comm>, Arc<Stats>) {
        let stats = Arc::new(Stats::new());
        (Metered::with_stats(inner, net, Arc::clone(&stats)), stats)
    }

    /// Wraps `inner`, adding to existing `stats` (several communicators
    /// metered together).
    pub fn with_stats(
        inner: Arc<dyn Comm>,
        net: Option<NetModel>,
        stats: Arc<Stats>,
    ) -> Arc<dyn Comm> {
        let link = Arc::new(Mutex::new(Instant::now()));
        Arc::new(Metered {
            inner,
            stats,
            net,
            link,
        })
    }
}

impl Comm for Metered {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn post(&self, op: Collective) -> Result<Box<dyn Request>, DistError> {
        let (rank, size) = (self.rank(), self.size());
        // Byte counts and costs assume a well-formed collective.
        op.validate(rank, size)?;
        let kind = op.kind();
        let (sent, received) = op.bytes(rank, size);
        let parts = self.net.map(|n| n.cost_parts(&op, rank, size));
        let posted = Instant::now();
        let inner = self.inner.post(op)?;
        let deadline = parts.map(|(latency, transfer)| {
            let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*link).max(posted);
            *link = start.checked_add(transfer).unwrap_or(start);
            link.checked_add(latency).unwrap_or(*link)
        });
        let cost = parts.map(|(l, t)| l.saturating_add(t));
        self.stats.posted(kind, sent, received, cost);
        Ok(Box::new(MeteredRequest {
            inner: Some(inner),
            kind,
            posted,
            deadline,
            completed: false,
            stats: Arc::clone(&self.stats),
        }))
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>, DistError> {
        let child = self.inner.split(color, key)?;
        Ok(Arc::new(Metered {
            inner: child,
            stats: Arc::clone(&self.stats),
            net: self.net,
            link: Arc::clone(&self.link),
        }))
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn abort(&self, code: i32) {
        self.inner.abort(code);
    }
}

struct MeteredRequest {
    inner: Option<Box<dyn Request>>,
    kind: Kind,
    posted: Instant,
    /// `posted + cost`, with a network model.
    deadline: Option<Instant>,
    /// Whether the in-flight time is recorded.
    completed: bool,
    stats: Arc<Stats>,
}

impl MeteredRequest {
    fn complete(&mut self, at: Instant) {
        if !self.completed {
            self.completed = true;
            self.stats
                .inflight(self.kind, at.saturating_duration_since(self.posted));
        }
    }

    fn gone() -> DistError {
        DistError::Backend("a metered request used after its wait".into())
    }
}

impl Request for MeteredRequest {
    fn test(&mut self) -> Result<bool, DistError> {
        let inner = self.inner.as_mut().ok_or_else(Self::gone)?;
        // Progress the transport even before the modelled deadline.
        let done = inner.test()?;
        let now = Instant::now();
        if !done || self.deadline.is_some_and(|d| now < d) {
            return Ok(false);
        }
        self.complete(now);
        Ok(true)
    }

    fn wait(mut self: Box<Self>) -> Result<Buffer, DistError> {
        let inner = self.inner.take().ok_or_else(Self::gone)?;
        let start = Instant::now();
        let result = inner.wait();
        if result.is_ok() {
            if let Some(d) = self.deadline {
                let now = Instant::now();
                if now < d {
                    std::thread::sleep(d - now);
                }
            }
            self.complete(Instant::now());
        }
        self.stats.blocked(self.kind, start.elapsed());
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{CommExt, ReduceOp};
    use crate::local;

    const LONG: Duration = Duration::from_secs(10);

    /// Runs `f(rank, comm)` on every rank of a metered local world.
    fn on_ranks<T: Send>(
        size: usize,
        net: Option<NetModel>,
        f: impl Fn(&dyn Comm) -> T + Sync,
    ) -> (Vec<T>, Vec<Arc<Stats>>) {
        let comms: Vec<(Arc<dyn Comm>, Arc<Stats>)> = local::world(size, LONG)
            .into_iter()
            .map(|c| Metered::wrap(c, net))
            .collect();
        let out = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|(c, _)| s.spawn(|| f(c.as_ref())))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (out, comms.into_iter().map(|(_, s)| s).collect())
    }

    #[test]
    fn counts_and_bytes() {
        let (_, stats) = on_ranks(3, None, |c| {
            let mut x = vec![1.0f32; 10];
            c.all_reduce_sum(&mut x).unwrap();
            c.all_reduce_sum(&mut x).unwrap();
            c.barrier().unwrap();
            let counts = vec![1, 2, 3];
            let send = Buffer::U8(vec![0; counts[c.rank()]]);
            c.all_gather(send, counts).unwrap();
            // A split shares the statistics.
            let child = c.split(0, 0).unwrap();
            child.barrier().unwrap();
            assert_eq!(x, [9.0; 10]);
        });
        for (rank, s) in stats.iter().enumerate() {
            let ar = s.get(Kind::AllReduce);
            assert_eq!((ar.count, ar.bytes_sent, ar.bytes_received), (2, 80, 80));
            assert!(ar.inflight_secs > 0.0 && ar.blocked_secs > 0.0);
            let ag = s.get(Kind::AllGather);
            // (The split's own exchange runs on the inner communicator.)
            let mine = [1, 2, 3][rank];
            assert_eq!(ag.count, 1);
            assert_eq!(ag.bytes_sent, (mine * 2) as u64);
            assert_eq!(ag.bytes_received, (6 - mine) as u64);
            assert_eq!(s.get(Kind::Barrier).count, 2);
            assert_eq!(
                s.get(Kind::Broadcast),
                KindStats {
                    kind: Kind::Broadcast,
                    count: 0,
                    bytes_sent: 0,
                    bytes_received: 0,
                    inflight_secs: 0.0,
                    blocked_secs: 0.0,
                    modelled_secs: 0.0,
                }
            );
            let snap = s.snapshot();
            assert_eq!(snap.len(), Kind::ALL.len());
            assert_eq!(snap.iter().map(|k| k.kind).collect::<Vec<_>>(), Kind::ALL);
            s.reset();
            assert!(s
                .snapshot()
                .iter()
                .all(|k| k.count == 0 && k.blocked_secs == 0.0));
        }
    }

    #[test]
    fn the_model_delays_completion() {
        let net = NetModel::new(Duration::from_millis(2), f64::INFINITY).unwrap();
        // Barrier on 2 ranks: one latency, 2 ms.
        let (waits, stats) = on_ranks(2, Some(net), |c| {
            let t = Instant::now();
            let r = c.post(Collective::Barrier).unwrap();
            r.wait().unwrap();
            t.elapsed()
        });
        for w in waits {
            assert!(w >= Duration::from_millis(2), "{w:?}");
        }
        for s in stats {
            assert_eq!(s.get(Kind::Barrier).modelled_secs, 0.002);
        }
    }

    #[test]
    fn collectives_in_flight_share_the_link() {
        // 1000 f32 all-reduced on 2 ranks move 4000 bytes: 20 ms at 200 kB/s.
        let net = NetModel::new(Duration::from_millis(1), 200e3).unwrap();
        let (gaps, stats) = on_ranks(2, Some(net), |c| {
            let child = c.split(0, c.rank()).unwrap();
            let op = || Collective::AllReduce {
                buf: Buffer::F32(vec![1.0; 1000]),
                op: crate::ReduceOp::Sum,
            };
            let t = Instant::now();
            let a = c.post(op()).unwrap();
            let b = child.post(op()).unwrap();
            // The second transfer starts when the first one's ends; their
            // latencies overlap: 22 ms, then 42 ms (not 44).
            a.wait().unwrap();
            let ta = t.elapsed();
            b.wait().unwrap();
            (ta, t.elapsed())
        });
        for (ta, tb) in gaps {
            // Without the shared link both would complete at 22 ms.
            assert!(ta >= Duration::from_millis(22), "{ta:?}");
            assert!(tb >= Duration::from_millis(42), "{tb:?}");
        }
        for s in stats {
            let ar = s.get(Kind::AllReduce);
            // Each one's own cost: 2 latencies and 20 ms.
            assert!(
                (ar.modelled_secs - 2.0 * 0.022).abs() < 1e-9,
                "{}",
                ar.modelled_secs
            );
        }
    }

    #[test]
    fn test_is_false_before_the_deadline() {
        let net = NetModel::new(Duration::from_millis(50), f64::INFINITY).unwrap();
        on_ranks(2, Some(net), |c| {
            let mut r = c.post(Collective::Barrier).unwrap();
            let t = Instant::now();
            // The inner barrier completes in microseconds; the model says 50 ms.
            while !r.test().unwrap() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let waited = t.elapsed();
            assert!(waited >= Duration::from_millis(45), "{waited:?}");
            r.wait().unwrap();
        });
    }

    #[test]
    fn compute_hides_the_delay() {
        let net = NetModel::new(Duration::from_millis(20), f64::INFINITY).unwrap();
        let (blocked, stats) = on_ranks(2, Some(net), |c| {
            let r = c
                .post(Collective::AllReduce {
                    buf: Buffer::F32(vec![1.0; 4]),
                    op: ReduceOp::Sum,
                })
                .unwrap();
            // "Compute" longer than the 40 ms the all-reduce costs.
            std::thread::sleep(Duration::from_millis(60));
            let t = Instant::now();
            assert_eq!(r.wait().unwrap(), Buffer::F32(vec![2.0; 4]));
            t.elapsed()
        });
        for (b, s) in blocked.iter().zip(&stats) {
            assert!(
                *b < Duration::from_millis(15),
                "blocked {b:?} after compute"
            );
            let k = s.get(Kind::AllReduce);
            assert!(k.blocked_secs < 0.015, "{k:?}");
            assert!(k.inflight_secs >= 0.04, "{k:?}");
        }
    }

    #[test]
    fn errors_pass_through() {
        let (_, stats) = on_ranks(1, None, |c| {
            let bad = Collective::Broadcast {
                buf: Buffer::U8(vec![]),
                root: 3,
            };
            assert!(matches!(c.post(bad), Err(DistError::Mismatch(_))));
            // Counts the buffer does not hold: refused, not miscounted.
            let bad = Collective::ReduceScatter {
                send: Buffer::F32(vec![1.0]),
                counts: vec![5],
                op: ReduceOp::Sum,
            };
            assert!(matches!(c.post(bad), Err(DistError::Mismatch(_))));
            assert_eq!(c.timeout(), LONG);
        });
        assert_eq!(stats[0].get(Kind::Broadcast).count, 0);
        assert_eq!(stats[0].get(Kind::ReduceScatter).count, 0);
    }
}
