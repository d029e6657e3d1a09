//! Routing: the experts each token goes to, and their weights.
//!
//! The semantics are those of transformers 5.24's routers, one parameter
//! set for all of them:
//! - Mixtral: softmax over all experts, top-k, always renormalised.
//! - Qwen2-MoE, Qwen3-MoE: softmax, top-k, renormalised if `norm_topk_prob`.
//! - DeepSeek-V2: softmax, top-k; `topk_method = "group_limited_greedy"`
//!   first keeps the `topk_group` groups with the largest single score
//!   ([`GroupScore::Max`]; "greedy" is `n_group = 1`); the weights are
//!   never renormalised (transformers ignores `norm_topk_prob` there) and
//!   are multiplied by `routed_scaling_factor`.
//! - DeepSeek-V3: sigmoid scores; the `e_score_correction_bias` is added
//!   for the selection only; groups score the sum of their two best biased
//!   scores ([`GroupScore::SumTop2`]); the weights are the unbiased scores,
//!   divided by their sum plus 1e-20 if `norm_topk_prob`, then multiplied
//!   by `routed_scaling_factor`.
//!
//! Renormalisation always adds the 1e-20: a softmax's top-k sum is at
//! least `1 / n_experts`, whose f32 ulp is far above 1e-20, so for softmax
//! scores it is the exact quotient Mixtral and Qwen compute without it.
//!
//! Each token's slots are in descending order of the selection value, ties
//! to the lower expert id (torch leaves the order of `topk(sorted=False)`
//! and of ties unspecified; the experts' output is a sum, so only its
//! rounding depends on the order). A NaN selection value ranks as -∞.

use crate::error::{check_len, checked_mul, KernelError};
use std::cell::Cell;

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// Softmax over all experts (max-subtracted, f32).
    Softmax,
    /// An independent sigmoid per expert.
    Sigmoid,
    /// `sqrt(softplus(l))` per expert (DeepSeek-V4), softplus as torch
    /// computes it: `l` itself above 20, `ln(1 + e^l)` below.
    SqrtSoftplus,
}

/// `sqrt(softplus(l))` with torch's softplus (threshold 20, `log1p`).
pub(crate) fn sqrt_softplus(l: f32) -> f32 {
    let sp = if l > 20.0 { l } else { l.exp().ln_1p() };
    sp.sqrt()
}

/// How a group of experts is scored for grouped selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupScore {
    /// The sum of the group's two best selection values (DeepSeek-V3).
    SumTop2,
    /// The group's best selection value (DeepSeek-V2's group_limited_greedy).
    Max,
}

/// One router's configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterParams {
    pub n_experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Renormalise the `top_k` selected weights to sum 1.
    pub norm_topk: bool,
    /// Groups of `n_experts / n_group` consecutive experts; 1 selects from
    /// all experts directly.
    pub n_group: usize,
    /// Groups kept (when `n_group > 1`).
    pub topk_group: usize,
    pub group_score: GroupScore,
    /// `routed_scaling_factor`: multiplies the final weights (1.0 = none).
    pub scale: f32,
}

impl RouterParams {
    /// Plain softmax top-k (Mixtral with `norm_topk`, Qwen-MoE).
    pub fn softmax(n_experts: usize, top_k: usize, norm_topk: bool) -> Self {
        RouterParams {
            n_experts,
            top_k,
            scoring: Scoring::Softmax,
            norm_topk,
            n_group: 1,
            topk_group: 1,
            group_score: GroupScore::Max,
            scale: 1.0,
        }
    }

    /// Experts per group.
    pub fn group_size(&self) -> usize {
        self.n_experts / self.n_group.max(1)
    }

    /// Checks that the parameters describe a possible selection.
    ///
    /// # Errors
    /// [`KernelError::RouterParams`] naming the first bad value.
    pub fn validate(&self) -> Result<(), KernelError> {
        let range = |what, value, min, max| {
            if (min..=max).contains(&value) {
                Ok(())
            } else {
                Err(KernelError::RouterParams {
                    what,
                    value,
                    min,
                    max,
                })
            }
        };
        range("n_experts", self.n_experts, 1, u32::MAX as usize)?;
        range("top_k", self.top_k, 1, self.n_experts)?;
        range("n_group", self.n_group, 1, self.n_experts)?;
        range("n_experts % n_group", self.n_experts % self.n_group, 0, 0)?;
        if self.n_group > 1 {
            range("topk_group", self.topk_group, 1, self.n_group)?;
            let kept = self.topk_group * self.group_size();
            range("top_k (of the experts in kept groups)", self.top_k, 1, kept)?;
            if self.group_score == GroupScore::SumTop2 {
                range("group size (SumTop2)", self.group_size(), 2, self.n_experts)?;
            }
        }
        Ok(())
    }
}

/// Per-call scratch, kept per thread so routing does not allocate per
/// token (nor per call once the sizes have been seen).
#[derive(Default)]
struct Scratch {
    /// Unbiased scores of one token's experts.
    score: Vec<f32>,
    /// Selection values (score + bias, NaN as -∞).
    key: Vec<f32>,
    /// Each group's score, then the kept groups' ids and scores.
    group_key: Vec<f32>,
    kept_ids: Vec<u32>,
    kept_keys: Vec<f32>,
}

thread_local! {
    static SCRATCH: Cell<Scratch> = Cell::new(Scratch::default());
}

/// One call's router input: its parameters, the `logits`
/// (`[n_tokens, n_experts]` router outputs in f32) and `bias`
/// (`[n_experts]`, DeepSeek-V3's `e_score_correction_bias`, added to the
/// scores for the selection only). [`route`] and its reference take it
/// and check it with [`RouterInput::check`].
#[derive(Clone, Copy, Debug)]
pub struct RouterInput<'a> {
    pub params: &'a RouterParams,
    pub logits: &'a [f32],
    pub bias: Option<&'a [f32]>,
}

impl<'a> RouterInput<'a> {
    /// The input in one line (tests, benches and the layers build it per call).
    pub fn new(params: &'a RouterParams, logits: &'a [f32], bias: Option<&'a [f32]>) -> Self {
        RouterInput {
            params,
            logits,
            bias,
        }
    }

    /// Validates the input and the outputs `ids` and `weights` of a
    /// routing; returns the token count.
    ///
    /// # Errors
    /// As [`route`].
    pub fn check(&self, ids: &[u32], weights: &[f32]) -> Result<usize, KernelError> {
        let p = self.params;
        p.validate()?;
        let n_tokens = self.logits.len() / p.n_experts;
        check_len(
            "router logits [n_tokens, n_experts]",
            n_tokens * p.n_experts,
            self.logits.len(),
        )?;
        let slots = checked_mul("route", n_tokens, p.top_k)?;
        check_len("router ids [n_tokens, top_k]", slots, ids.len())?;
        check_len("router weights [n_tokens, top_k]", slots, weights.len())?;
        if let Some(b) = self.bias {
            check_len("router bias [n_experts]", p.n_experts, b.len())?;
        }
        Ok(n_tokens)
    }
}

/// Routes `r.logits`: writes `ids` and `weights` (`[n_tokens, top_k]`
/// each), each token's slots in descending order of selection value, ties
/// to the lower expert id.
///
/// # Errors
/// [`KernelError::RouterParams`] for parameters [`RouterParams::validate`]
/// rejects; [`KernelError::LengthMismatch`] unless `logits` is whole rows,
/// `ids` and `weights` hold `top_k` values per row and `bias` (if any)
/// `n_experts`.
pub fn route(r: &RouterInput<'_>, ids: &mut [u32], weights: &mut [f32]) -> Result<(), KernelError> {
    let n_tokens = r.check(ids, weights)?;
    let p = r.params;
    let mut s = SCRATCH.take();
    s.score.resize(p.n_experts, 0.0);
    s.key.resize(p.n_experts, 0.0);
    s.group_key.resize(p.n_group, 0.0);
    s.kept_ids.resize(p.topk_group.min(p.n_group), 0);
    s.kept_keys.resize(p.topk_group.min(p.n_group), 0.0);
    let rows = r.logits.chunks_exact(p.n_experts).take(n_tokens);
    let outs = ids
        .chunks_exact_mut(p.top_k)
        .zip(weights.chunks_exact_mut(p.top_k));
    for (row, (ids, weights)) in rows.zip(outs) {
        route_token(p, row, r.bias, &mut s, ids, weights);
    }
    SCRATCH.set(s);
    Ok(())
}

/// Routes by a table (DeepSeek-V4's hash-routed layers): token `t` goes
/// to the experts `table[t]` (`top_k` per token, a frozen token-id →
/// expert map), weighted by its scores of those experts (the router's
/// scoring of `r.logits`), renormalised and scaled as [`route`] does;
/// the bias plays no part. `ids` keep the table's order.
///
/// # Errors
/// As [`route`], and [`KernelError::IndexOutOfRange`] for a token
/// outside the table or an expert id outside the router.
pub fn route_by_table(
    r: &RouterInput<'_>,
    (table, tokens): (&[u32], &[u32]),
    ids: &mut [u32],
    weights: &mut [f32],
) -> Result<(), KernelError> {
    let n_tokens = r.check(ids, weights)?;
    let p = r.params;
    check_len("hash-routed tokens", n_tokens, tokens.len())?;
    let rows = table.len() / p.top_k;
    let mut s = SCRATCH.take();
    s.score.resize(p.n_experts, 0.0);
    let score = &mut s.score;
    let outs = ids
        .chunks_exact_mut(p.top_k)
        .zip(weights.chunks_exact_mut(p.top_k));
    for ((row, &t), (ids, weights)) in r.logits.chunks_exact(p.n_experts).zip(tokens).zip(outs) {
        let t = t as usize;
        if t >= rows {
            return Err(KernelError::IndexOutOfRange {
                what: "hash-routed token",
                index: t,
                len: rows,
            });
        }
        scores(p.scoring, row, score);
        for ((id, w), &e) in ids
            .iter_mut()
            .zip(weights.iter_mut())
            .zip(&table[t * p.top_k..])
        {
            *w = *score.get(e as usize).ok_or(KernelError::IndexOutOfRange {
                what: "hash-routed expert",
                index: e as usize,
                len: p.n_experts,
            })?;
            *id = e;
        }
        finish_weights(p, weights);
    }
    SCRATCH.set(s);
    Ok(())
}

/// A selection value with NaN ranked lowest.
fn rank_key(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v
    }
}

/// Offers `(id, key)` to the descending top list `ids[..*len]` (capacity
/// `ids.len()`). Offered in ascending id order, equal keys keep the lower
/// id first: a newcomer only passes strictly smaller keys.
fn offer(ids: &mut [u32], keys: &mut [f32], len: &mut usize, id: u32, key: f32) {
    let cap = ids.len();
    if *len == cap {
        if key <= keys[cap - 1] {
            return;
        }
        *len -= 1;
    }
    let mut j = *len;
    while j > 0 && keys[j - 1] < key {
        ids[j] = ids[j - 1];
        keys[j] = keys[j - 1];
        j -= 1;
    }
    ids[j] = id;
    keys[j] = key;
    *len += 1;
}

/// Scores one token's logits into `score` (softmax or sigmoid, in f32).
fn scores(scoring: Scoring, logits: &[f32], score: &mut [f32]) {
    match scoring {
        Scoring::Softmax => {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0f32;
            for (s, &l) in score.iter_mut().zip(logits) {
                *s = (l - max).exp();
                sum += *s;
            }
            let inv = 1.0 / sum;
            for s in score.iter_mut() {
                *s *= inv;
            }
        }
        Scoring::Sigmoid => {
            for (s, &l) in score.iter_mut().zip(logits) {
                *s = 1.0 / (1.0 + (-l).exp());
            }
        }
        Scoring::SqrtSoftplus => {
            for (s, &l) in score.iter_mut().zip(logits) {
                *s = sqrt_softplus(l);
            }
        }
    }
}

/// A group's score from its selection values (already NaN-ranked).
fn group_score(how: GroupScore, keys: &[f32]) -> f32 {
    match how {
        GroupScore::Max => keys.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)),
        GroupScore::SumTop2 => {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in keys {
                if v > a {
                    (a, b) = (v, a);
                } else if v > b {
                    b = v;
                }
            }
            a + b
        }
    }
}

/// Final weights from the selected experts' unbiased scores, in place.
fn finish_weights(p: &RouterParams, weights: &mut [f32]) {
    if p.norm_topk {
        // transformers: `w / (Σ w + 1e-20)` (DeepSeek-V3); see the module doc.
        let denom = weights.iter().sum::<f32>() + 1e-20;
        for w in weights.iter_mut() {
            *w /= denom;
        }
    }
    for w in weights.iter_mut() {
        *w *= p.scale;
    }
}

fn route_token(
    p: &RouterParams,
    logits: &[f32],
    bias: Option<&[f32]>,
    s: &mut Scratch,
    ids: &mut [u32],
    weights: &mut [f32],
) {
    scores(p.scoring, logits, &mut s.score);
    for (e, (k, &v)) in s.key.iter_mut().zip(&s.score).enumerate() {
        *k = rank_key(bias.map_or(v, |b| v + b[e]));
    }
    let gs = p.group_size();
    let mut len = 0;
    if p.n_group > 1 {
        for (gk, keys) in s.group_key.iter_mut().zip(s.key.chunks_exact(gs)) {
            *gk = rank_key(group_score(p.group_score, keys));
        }
        let mut kept = 0;
        for (g, &k) in s.group_key.iter().enumerate() {
            offer(&mut s.kept_ids, &mut s.kept_keys, &mut kept, g as u32, k);
        }
        // Candidates in ascending id order, so ties keep the lower id.
        s.kept_ids.sort_unstable();
        for &g in &s.kept_ids {
            let first = g as usize * gs;
            for (e, &k) in (first..).zip(&s.key[first..first + gs]) {
                offer(ids, weights, &mut len, e as u32, k);
            }
        }
    } else {
        for (e, &k) in s.key.iter().enumerate() {
            offer(ids, weights, &mut len, e as u32, k);
        }
    }
    for (w, &id) in weights.iter_mut().zip(ids.iter()) {
        *w = s.score[id as usize];
    }
    finish_weights(p, weights);
}
