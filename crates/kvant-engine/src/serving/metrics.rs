//! Serving counters and latency histograms, written by the engine thread
//! and read (as a snapshot) by whoever exports them.

use std::sync::Mutex;

/// Upper bounds (seconds) of the latency histograms' buckets, as
/// Prometheus `le` labels; a final `+Inf` bucket is implied.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A cumulative-friendly histogram: per-bucket counts (the last is `+Inf`),
/// the sum and the count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub counts: [u64; LATENCY_BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn observe(&mut self, secs: f64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.counts[i] += 1;
        self.sum += secs;
        self.count += 1;
    }

    /// Observations at or below each bucket's bound (Prometheus' `le`
    /// buckets), the last being the total.
    pub fn cumulative(&self) -> [u64; LATENCY_BUCKETS.len() + 1] {
        let mut out = self.counts;
        for i in 1..out.len() {
            out[i] += out[i - 1];
        }
        out
    }
}

/// Everything `/metrics` shows, at one instant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MetricsSnapshot {
    pub waiting: usize,
    pub running: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    /// Prompt tokens looked up in the prefix cache, and those found.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    pub preemptions: u64,
    /// Expert re-placements (EPLB) over ranks.
    pub expert_rebalances: u64,
    /// Tokens drafted by the MTP module and verified, and those accepted
    /// (self-speculative decoding).
    pub spec_drafted: u64,
    pub spec_accepted: u64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
}

/// The engine's live metrics.
#[derive(Default)]
pub struct Metrics(Mutex<MetricsSnapshot>);

impl Metrics {
    pub fn update(&self, f: impl FnOnce(&mut MetricsSnapshot)) {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_inclusive_and_cumulative() {
        let mut h = Histogram::default();
        for s in [0.005, 0.006, 40.0] {
            h.observe(s);
        }
        let c = h.cumulative();
        assert_eq!(c[0], 1);
        assert_eq!(c[1], 2);
        assert_eq!(c[LATENCY_BUCKETS.len() - 1], 2);
        assert_eq!(c[LATENCY_BUCKETS.len()], 3);
        assert_eq!(h.count, 3);
        assert!((h.sum - 40.011).abs() < 1e-9);
    }
}
