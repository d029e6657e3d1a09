//! Numerically safe softmax and log-sum-exp over a row.

/// In-place softmax (subtracts the max first). An empty row is left alone.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

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
    fn softmax_sums_to_one_and_handles_large_values() {
        let mut x = vec![1000.0, 1000.0, 999.0, -1e30];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((x[0] - x[1]).abs() < 1e-7);
        assert_eq!(x[3], 0.0);
        let lse = log_sum_exp(&[1000.0, 1000.0]);
        assert!((lse - (1000.0 + 2f64.ln())).abs() < 1e-9);
    }
}
