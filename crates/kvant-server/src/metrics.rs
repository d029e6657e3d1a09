//! `/metrics` in Prometheus' text exposition format (version 0.0.4).

use kvant_engine::serving::{Histogram, MetricsSnapshot, LATENCY_BUCKETS};
use std::fmt::Write;

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The engine's metrics at one instant, as Prometheus text.
pub fn render(m: &MetricsSnapshot) -> String {
    let mut out = String::new();
    let w = &mut out;
    let gauge = |w: &mut String, name, help, v: f64| sample(w, name, "gauge", help, v);
    let counter = |w: &mut String, name, help, v: u64| sample(w, name, "counter", help, v as f64);
    gauge(
        w,
        "kvant_num_requests_waiting",
        "Requests queued, not yet running.",
        m.waiting as f64,
    );
    gauge(
        w,
        "kvant_num_requests_running",
        "Sequences being generated.",
        m.running as f64,
    );
    let total = m.kv_blocks_total;
    let used = m.kv_blocks_used.min(total);
    gauge(
        w,
        "kvant_kv_blocks_total",
        "KV cache blocks in the pool.",
        total as f64,
    );
    gauge(
        w,
        "kvant_kv_blocks_used",
        "KV cache blocks held by sequences.",
        used as f64,
    );
    gauge(
        w,
        "kvant_kv_blocks_free",
        "KV cache blocks free.",
        (total - used) as f64,
    );
    gauge(
        w,
        "kvant_kv_cache_usage_ratio",
        "Fraction of KV cache blocks in use.",
        ratio(used as f64, total as f64),
    );
    counter(
        w,
        "kvant_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        m.prefix_cache_queries,
    );
    counter(
        w,
        "kvant_prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        m.prefix_cache_hits,
    );
    gauge(
        w,
        "kvant_prefix_cache_hit_rate",
        "Prefix cache hits over queries since start-up.",
        ratio(m.prefix_cache_hits as f64, m.prefix_cache_queries as f64),
    );
    counter(
        w,
        "kvant_spec_decode_num_draft_tokens_total",
        "Tokens drafted by the MTP module and verified.",
        m.spec_drafted,
    );
    counter(
        w,
        "kvant_spec_decode_num_accepted_tokens_total",
        "Drafted tokens the main model accepted.",
        m.spec_accepted,
    );
    counter(
        w,
        "kvant_prompt_tokens_total",
        "Prompt tokens processed.",
        m.prompt_tokens,
    );
    counter(
        w,
        "kvant_generation_tokens_total",
        "Tokens generated.",
        m.generation_tokens,
    );
    counter(
        w,
        "kvant_num_preemptions_total",
        "Sequences preempted to free KV blocks.",
        m.preemptions,
    );
    counter(
        w,
        "kvant_expert_rebalances_total",
        "Expert re-placements from observed loads (EPLB, --eplb-interval).",
        m.expert_rebalances,
    );
    counter(
        w,
        "kvant_request_success_total",
        "Requests that finished (stop or length).",
        m.requests_finished,
    );
    counter(
        w,
        "kvant_request_aborted_total",
        "Requests aborted (client gone or shutdown).",
        m.requests_aborted,
    );
    histogram(
        w,
        "kvant_time_to_first_token_seconds",
        "Time from submission to the first generated token.",
        &m.time_to_first_token,
    );
    histogram(
        w,
        "kvant_inter_token_latency_seconds",
        "Time between consecutive generated tokens of a sequence.",
        &m.inter_token_latency,
    );
    out
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

fn header(w: &mut String, name: &str, kind: &str, help: &str) {
    // Writing to a String cannot fail.
    let _ = writeln!(w, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn sample(w: &mut String, name: &str, kind: &str, help: &str, v: f64) {
    header(w, name, kind, help);
    let _ = writeln!(w, "{name} {v}");
}

fn histogram(w: &mut String, name: &str, help: &str, h: &Histogram) {
    header(w, name, "histogram", help);
    let cumulative = h.cumulative();
    let bounds = LATENCY_BUCKETS.iter().map(|b| b.to_string());
    for (le, n) in bounds.chain(["+Inf".to_string()]).zip(cumulative) {
        let _ = writeln!(w, "{name}_bucket{{le=\"{le}\"}} {n}");
    }
    let _ = writeln!(w, "{name}_sum {}\n{name}_count {}", h.sum, h.count);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line is a comment or `name{labels} value` with a numeric value.
    #[test]
    fn renders_parseable_text() {
        let mut m = MetricsSnapshot {
            waiting: 2,
            kv_blocks_total: 10,
            kv_blocks_used: 4,
            prefix_cache_queries: 8,
            prefix_cache_hits: 2,
            ..Default::default()
        };
        m.time_to_first_token.observe(0.02);
        m.time_to_first_token.observe(50.0);
        let text = render(&m);
        let mut values = std::collections::HashMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
            let v: f64 = value.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
            values.insert(name.to_string(), v);
        }
        assert_eq!(values["kvant_num_requests_waiting"], 2.0);
        assert_eq!(values["kvant_kv_blocks_free"], 6.0);
        assert_eq!(values["kvant_prefix_cache_hit_rate"], 0.25);
        let ttft = "kvant_time_to_first_token_seconds";
        assert_eq!(values[&format!("{ttft}_bucket{{le=\"0.025\"}}")], 1.0);
        assert_eq!(values[&format!("{ttft}_bucket{{le=\"30\"}}")], 1.0);
        assert_eq!(values[&format!("{ttft}_bucket{{le=\"+Inf\"}}")], 2.0);
        assert_eq!(values[&format!("{ttft}_count")], 2.0);
    }
}
