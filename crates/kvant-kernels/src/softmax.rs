//! Numerically safe log-sum-exp over a row: the normaliser of a log-softmax
//! (perplexity's negative log-likelihoods). Attention and the training
//! kernels keep their own online forms.

/// `log Σ exp(x)`, accumulated in f64 so perplexity over long files stays exact.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return max;
    }
    let s: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + s.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_sum_exp_handles_large_values() {
        let lse = log_sum_exp(&[1000.0, 1000.0]);
        assert!((lse - (1000.0 + 2f64.ln())).abs() < 1e-9);
    }
}
