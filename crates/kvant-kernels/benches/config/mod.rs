//! The criterion settings the attention and delta-rule benches share:
//! short warm-ups and runs, which keep their many cases within minutes.

use criterion::Criterion;
use std::time::Duration;

/// 0.3 s of warm-up, 2 s of measurement, 30 samples.
pub fn short() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}
