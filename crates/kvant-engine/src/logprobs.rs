//! Log-probabilities of generated tokens under the model's distribution
//! (the raw logits, before penalties and truncation), as OpenAI reports them.

/// A generated token's log-probability under the model (before sampling's
/// penalties and truncation) and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// Most likely first.
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability in `logits` and the `top` most likely tokens
/// (most likely first, ties by id), in one pass plus a pass for the
/// normaliser: no sort of the vocabulary.
pub(crate) fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    let log_z = max as f64 + z.ln();
    let lp = |l: f32| {
        if l.is_finite() {
            (l as f64 - log_z) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if !l.is_finite() || (best.len() == top && l <= best[top - 1].1) {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    TokenLogprob {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_plain_log_softmax() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5, f32::NEG_INFINITY];
        let z: f64 = logits[..5].iter().map(|&l| (l as f64).exp()).sum();
        let t = token_logprob(&logits, 4, 3);
        assert!((t.logprob as f64 - (0.5 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = t.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, [1, 3, 0]);
        assert!((t.top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert!(token_logprob(&logits, 5, 0).top.is_empty());
        assert_eq!(token_logprob(&logits, 5, 0).logprob, f32::NEG_INFINITY);
    }
}
