//! The gated delta rule: linear attention whose per-head state is a
//! `dk × dv` matrix, updated by every token (Gated DeltaNet in Qwen3-Next
//! and Qwen3.5, Kimi Delta Attention in Kimi Linear):
//!
//! ```text
//! S_t = diag(α_t) S_{t-1} + k_t ⊗ δ_t,   δ_t = β_t (v_t − (diag(α_t) S_{t-1})ᵀ k_t)
//! o_t = S_tᵀ q_t
//! ```
//!
//! with `α_t = exp(g_t)`: one decay per head and token (Gated DeltaNet) or
//! one per key channel (KDA, `channel_decay`). `q` and `k` come
//! L2-normalised, `q` already scaled.
//!
//! **Chunk-aligned form.** Positions are cut into chunks of [`DeltaParams::chunk`]
//! at absolute multiples of the chunk size. A sequence's state is the
//! matrix `S0` at the start of its current chunk plus, for each token of
//! the chunk so far, its key `k_s`, its cumulative log-decay since the
//! chunk start `γ_s` and its corrected value `u_s` (the WY / UT-transform
//! form of the delta rule, solved by forward substitution):
//!
//! ```text
//! u_t = β_t (v_t − S0ᵀ (e^{γ_t} ⊙ k_t)) − Σ_{s<t} β_t ⟨k_t, k_s⟩_{γ_t−γ_s} u_s
//! o_t = S0ᵀ (e^{γ_t} ⊙ q_t) + Σ_{s≤t} ⟨q_t, k_s⟩_{γ_t−γ_s} u_s
//! ```
//!
//! where `⟨a, b⟩_γ = Σ_i a_i b_i e^{γ_i}` (a scalar `γ` for one decay per
//! head), and when a chunk is full, `S0 ← e^{γ_C} ⊙ S0 + Σ_s (e^{γ_C−γ_s} ⊙
//! k_s) ⊗ u_s`. Every `e^{…}` has a non-positive exponent: nothing
//! overflows, whatever the decay.
//!
//! **One arithmetic for prefill and decode.** A token's output and row are
//! computed from `S0` and the chunk's earlier rows by the same sums in the
//! same order whether the token arrives alone (decode) or among the other
//! tokens of a prompt chunk, and the chunk folds into `S0` only at absolute
//! chunk ends. So a sequence gets the same bits alone or batched, after a
//! chunked prefill split anywhere, and after a preemption recomputes it
//! (the batch invariance of the attention kernels). A separate recurrent
//! form for decode (`S` updated every token) would change those bits.
//!
//! **Cost per token and head**: the two state reads `S0ᵀ(·)` (`2·dk·dv`),
//! the fold (`dk·dv`, plus `dk·dv / C` for the decay), and the
//! intra-chunk sums (`2·c·(dk + dv)` at position `c` of the chunk); the
//! token-by-token recurrence costs `4·dk·dv`. The state reads of a prompt
//! chunk's tokens run four tokens at a time against each loaded row of
//! `S0` (a matrix product; the per-element sums keep their order).

use crate::cpu::{self, SimdTier};
use crate::pool::{self, DisjointSlice};
use crate::vecops;
use crate::KernelError;
use std::ops::Range;

/// Shape of a layer's delta-rule heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaParams {
    /// Query / key heads.
    pub n_k_heads: usize,
    /// Value heads, a multiple of the key heads, which `sharing` maps
    /// onto them.
    pub n_v_heads: usize,
    pub sharing: HeadSharing,
    pub dk: usize,
    pub dv: usize,
    /// Tokens per chunk (chunks start at absolute multiples of it).
    pub chunk: usize,
    /// One decay per key channel (KDA) instead of one per head.
    pub channel_decay: bool,
}

/// Which key head a value head reads when there are more value heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadSharing {
    /// Value head `h` reads key head `h / r` (`r` = value heads per key
    /// head): Hugging Face's order, value heads grouped by key head.
    Grouped,
    /// Value head `h` reads key head `h % n_k_heads`: llama.cpp's Qwen3.5
    /// GGUF files, whose converter tiles the value heads for ggml's
    /// broadcast.
    Tiled,
}

impl DeltaParams {
    /// The key head value head `h` reads.
    fn k_head(&self, h: usize) -> usize {
        match self.sharing {
            HeadSharing::Grouped => h / (self.n_v_heads / self.n_k_heads),
            HeadSharing::Tiled => h % self.n_k_heads,
        }
    }

    /// Checks that the shape is usable.
    ///
    /// # Errors
    /// [`KernelError::InvalidShape`] naming what is wrong.
    pub fn validate(&self) -> Result<(), KernelError> {
        let bad = |why: String| {
            Err(KernelError::InvalidShape {
                op: "delta rule",
                why,
            })
        };
        if self.n_k_heads == 0 || self.n_v_heads == 0 || self.dk == 0 || self.dv == 0 {
            return bad(format!("empty heads: {self:?}"));
        }
        if !self.n_v_heads.is_multiple_of(self.n_k_heads) {
            return bad(format!(
                "{} value heads are not a multiple of {} key heads",
                self.n_v_heads, self.n_k_heads
            ));
        }
        if self.chunk == 0 || self.chunk > 256 {
            return bad(format!("chunk of {} tokens (1..=256)", self.chunk));
        }
        if self.dk > 4096 || self.dv > 4096 {
            return bad(format!(
                "head sizes {} x {} (at most 4096)",
                self.dk, self.dv
            ));
        }
        Ok(())
    }

    /// Decay values per token and value head: `dk`, or 1.
    pub fn g_dim(&self) -> usize {
        if self.channel_decay {
            self.dk
        } else {
            1
        }
    }

    /// f32 values of one value head's state: `S0`, then the chunk's keys,
    /// rows `u` and cumulative decays.
    fn head_len(&self) -> usize {
        self.dk * self.dv + self.chunk * (self.dk + self.dv + self.g_dim())
    }

    /// f32 values of one sequence's state for one layer (every value head).
    pub fn state_len(&self) -> usize {
        self.n_v_heads * self.head_len()
    }
}

/// One sequence of a call: its tokens (rows of the call's inputs), the
/// position of the first, and its state's slot in the call's state buffer.
#[derive(Clone, Debug)]
pub struct DeltaSeq {
    pub rows: Range<usize>,
    pub pos0: usize,
    pub slot: usize,
}

/// A call's per-token inputs: `q`, `k` `[n, n_k_heads, dk]`, `v` `[n,
/// n_v_heads, dv]`, `beta` `[n, n_v_heads]`, `g` `[n, n_v_heads, g_dim]`
/// (log decays, at most 0).
#[derive(Clone, Copy, Debug)]
pub struct DeltaInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: &'a [f32],
    pub g: &'a [f32],
}

impl DeltaInputs<'_> {
    fn check(&self, p: &DeltaParams, n: usize) -> Result<(), KernelError> {
        let want = [
            ("delta rule q", self.q.len(), n * p.n_k_heads * p.dk),
            ("delta rule k", self.k.len(), n * p.n_k_heads * p.dk),
            ("delta rule v", self.v.len(), n * p.n_v_heads * p.dv),
            ("delta rule beta", self.beta.len(), n * p.n_v_heads),
            ("delta rule g", self.g.len(), n * p.n_v_heads * p.g_dim()),
        ];
        for (what, actual, expected) in want {
            if actual != expected {
                return Err(KernelError::LengthMismatch {
                    what,
                    expected,
                    actual,
                });
            }
        }
        Ok(())
    }
}

thread_local! {
    /// [`check_seqs`]'s marks, kept between calls (this runs per layer and
    /// step).
    static SEEN: std::cell::RefCell<Vec<bool>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Checks that `seqs` have rows inside `0..n`, each row in one sequence,
/// and distinct slots below `slots` (`seen` is scratch).
fn check_seqs(
    seqs: &[DeltaSeq],
    n: usize,
    slots: usize,
    seen: &mut Vec<bool>,
) -> Result<(), KernelError> {
    seen.clear();
    seen.resize(n + slots, false);
    let (rows_seen, slots_seen) = seen.split_at_mut(n);
    for s in seqs {
        if s.rows.start > s.rows.end || s.rows.end > n {
            let what = "delta rule sequence row";
            return Err(KernelError::IndexOutOfRange {
                what,
                index: s.rows.end,
                len: n,
            });
        }
        if s.slot >= slots || std::mem::replace(&mut slots_seen[s.slot], true) {
            let what = "delta rule state slot (unique per call)";
            return Err(KernelError::IndexOutOfRange {
                what,
                index: s.slot,
                len: slots,
            });
        }
        for r in s.rows.clone() {
            if std::mem::replace(&mut rows_seen[r], true) {
                let what = "delta rule row (each in one sequence)";
                return Err(KernelError::IndexOutOfRange {
                    what,
                    index: r,
                    len: n,
                });
            }
        }
        if s.pos0.checked_add(s.rows.len()).is_none() {
            let what = "delta rule position";
            return Err(KernelError::IndexOutOfRange {
                what,
                index: s.pos0,
                len: usize::MAX,
            });
        }
    }
    Ok(())
}

/// Runs the delta rule for every sequence of a ragged batch: reads and
/// advances each sequence's state (`states`, slots of
/// [`DeltaParams::state_len`] values; a sequence at position 0 starts from
/// zeros whatever its slot holds) and writes `out` `[n, n_v_heads, dv]`.
/// `(sequence, value head)` pairs run in parallel on the pool.
///
/// # Errors
/// A bad shape, inputs of the wrong length, sequences whose rows or slots
/// overlap or fall outside the buffers.
pub fn delta_rule(
    p: &DeltaParams,
    x: DeltaInputs<'_>,
    seqs: &[DeltaSeq],
    states: &mut [f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    delta_rule_with(cpu::tier(), p, x, seqs, states, out)
}

/// [`delta_rule`] on a given tier.
///
/// # Errors
/// As [`delta_rule`].
fn delta_rule_with(
    tier: SimdTier,
    p: &DeltaParams,
    x: DeltaInputs<'_>,
    seqs: &[DeltaSeq],
    states: &mut [f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    p.validate()?;
    let n = x.v.len() / (p.n_v_heads * p.dv);
    x.check(p, n)?;
    if out.len() != n * p.n_v_heads * p.dv {
        let (expected, actual) = (n * p.n_v_heads * p.dv, out.len());
        return Err(KernelError::LengthMismatch {
            what: "delta rule output",
            expected,
            actual,
        });
    }
    let slots = states.len() / p.state_len();
    SEEN.with_borrow_mut(|seen| check_seqs(seqs, n, slots, seen))?;
    let tier = cpu::clamp(tier);
    let (nv, hl) = (p.n_v_heads, p.head_len());
    let states = DisjointSlice::new(states);
    let out = DisjointSlice::new(out);
    let tasks = seqs.len() * nv;
    pool::global().run(tasks, &|i| {
        let (s, h) = (&seqs[i / nv], i % nv);
        let base = s.slot * p.state_len() + h * hl;
        // SAFETY: slots are unique per call (checked above), so no other
        // task touches this head's state.
        let state = unsafe { states.range(base..base + hl) };
        SCRATCH.with_borrow_mut(|sc| run_head(tier, p, &x, s, h, state, &out, sc));
    });
    Ok(())
}

thread_local! {
    /// Each pool thread's working rows, reused across calls.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// A task's working rows.
#[derive(Default)]
struct Scratch {
    /// Per token of a segment: `e^{γ} ⊙ k` and `e^{γ} ⊙ q`, `[t, dk]`, and
    /// their state reads, `[t, dv]`.
    kd: Vec<f32>,
    qd: Vec<f32>,
    w: Vec<f32>,
    inter: Vec<f32>,
    /// One row of `dv` and one of decay factors.
    u: Vec<f32>,
    e: Vec<f32>,
}

/// One value head of one sequence: its tokens in chunk segments.
#[allow(clippy::too_many_arguments)] // one task's operands, unpacked
fn run_head(
    tier: SimdTier,
    p: &DeltaParams,
    x: &DeltaInputs<'_>,
    seq: &DeltaSeq,
    h: usize,
    state: &mut [f32],
    out: &DisjointSlice<'_, f32>,
    sc: &mut Scratch,
) {
    let (dk, dv, c, gd) = (p.dk, p.dv, p.chunk, p.g_dim());
    let (s0, rest) = state.split_at_mut(dk * dv);
    let (ks, rest) = rest.split_at_mut(c * dk);
    let (us, gs) = rest.split_at_mut(c * dv);
    let kh = p.k_head(h);
    let mut t = seq.rows.start;
    let mut pos = seq.pos0;
    if pos == 0 {
        s0.fill(0.0);
    }
    while t < seq.rows.end {
        // The tokens up to the end of this chunk.
        let at = pos % c;
        let len = (c - at).min(seq.rows.end - t);
        let rows = t..t + len;
        let krow = |r: usize| &x.k[(r * p.n_k_heads + kh) * dk..][..dk];
        let qrow = |r: usize| &x.q[(r * p.n_k_heads + kh) * dk..][..dk];
        let grow = |r: usize| &x.g[(r * p.n_v_heads + h) * gd..][..gd];
        // Cumulative decays, continuing the chunk's.
        for (i, r) in rows.clone().enumerate() {
            let j = at + i;
            let (done, now) = gs.split_at_mut(j * gd);
            let now = &mut now[..gd];
            for (d, (n, &g)) in now.iter_mut().zip(grow(r)).enumerate() {
                let prev = if j == 0 { 0.0 } else { done[(j - 1) * gd + d] };
                *n = prev + g;
            }
            ks[j * dk..(j + 1) * dk].copy_from_slice(krow(r));
        }
        // Decayed keys and queries, and their reads of S0.
        sized(&mut sc.kd, len * dk);
        sized(&mut sc.qd, len * dk);
        for (i, r) in rows.clone().enumerate() {
            let gam = &gs[(at + i) * gd..(at + i + 1) * gd];
            decayed(krow(r), gam, &mut sc.kd[i * dk..(i + 1) * dk]);
            decayed(qrow(r), gam, &mut sc.qd[i * dk..(i + 1) * dk]);
        }
        sized(&mut sc.w, len * dv);
        sized(&mut sc.inter, len * dv);
        state_read(tier, s0, dk, dv, &sc.kd, &mut sc.w);
        state_read(tier, s0, dk, dv, &sc.qd, &mut sc.inter);
        // Forward substitution, token by token.
        for (i, r) in rows.clone().enumerate() {
            let j = at + i;
            let beta = x.beta[r * p.n_v_heads + h];
            let v = &x.v[(r * p.n_v_heads + h) * dv..][..dv];
            let gj = &gs[j * gd..(j + 1) * gd];
            sized(&mut sc.u, dv);
            for ((u, &v), &w) in sc.u.iter_mut().zip(v).zip(&sc.w[i * dv..(i + 1) * dv]) {
                *u = beta * (v - w);
            }
            let kj = &ks[j * dk..(j + 1) * dk];
            for s in 0..j {
                let a = beta
                    * decayed_dot(
                        tier,
                        kj,
                        &ks[s * dk..(s + 1) * dk],
                        gj,
                        &gs[s * gd..(s + 1) * gd],
                        &mut sc.e,
                    );
                vecops::axpy(tier, -a, &us[s * dv..(s + 1) * dv], &mut sc.u);
            }
            us[j * dv..(j + 1) * dv].copy_from_slice(&sc.u);
            // The output: the state's read, then the chunk's rows in order.
            // SAFETY: row `r` belongs to this sequence alone (checked by
            // the caller), and head `h` of it to this task.
            let o =
                unsafe { out.range((r * p.n_v_heads + h) * dv..(r * p.n_v_heads + h + 1) * dv) };
            o.copy_from_slice(&sc.inter[i * dv..(i + 1) * dv]);
            let q = qrow(r);
            for s in 0..=j {
                let b = decayed_dot(
                    tier,
                    q,
                    &ks[s * dk..(s + 1) * dk],
                    gj,
                    &gs[s * gd..(s + 1) * gd],
                    &mut sc.e,
                );
                vecops::axpy(tier, b, &us[s * dv..(s + 1) * dv], o);
            }
        }
        if at + len == c {
            fold(tier, p, s0, ks, us, gs, &mut sc.e);
        }
        t += len;
        pos += len;
    }
}

/// Resizes `v` to `n` values (contents unspecified until written).
fn sized(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
}

/// `out = e^{γ} ⊙ a` (a scalar `γ` broadcast).
fn decayed(a: &[f32], gam: &[f32], out: &mut [f32]) {
    match gam {
        [g] => {
            let e = g.exp();
            for (o, &x) in out.iter_mut().zip(a) {
                *o = e * x;
            }
        }
        _ => {
            for ((o, &x), &g) in out.iter_mut().zip(a).zip(gam) {
                *o = g.exp() * x;
            }
        }
    }
}

/// `⟨a, b⟩_{γa − γb}`: `(a · b) e^{γa − γb}` for one decay per head, else
/// `Σ_i a_i b_i e^{γa_i − γb_i}` (through `e`, a scratch row).
fn decayed_dot(
    tier: SimdTier,
    a: &[f32],
    b: &[f32],
    ga: &[f32],
    gb: &[f32],
    e: &mut Vec<f32>,
) -> f32 {
    match (ga, gb) {
        ([x], [y]) => crate::dot::dot_f32_with(tier, a, b) * (x - y).exp(),
        _ => {
            e.clear();
            e.extend(
                a.iter()
                    .zip(b)
                    .zip(ga.iter().zip(gb))
                    .map(|((&a, &b), (&x, &y))| a * b * (x - y).exp()),
            );
            vecops::sum(tier, e)
        }
    }
}

/// `out[t] = S0ᵀ x[t]` for each row `t` of `x` (`[t, dk]`): `out[t][j] =
/// Σ_i x[t][i] S0[i][j]`, the sum over `i` in order for every element, four
/// rows of `x` sharing each loaded row of `S0`.
fn state_read(tier: SimdTier, s0: &[f32], dk: usize, dv: usize, x: &[f32], out: &mut [f32]) {
    vecops::rows_times_matrix(tier, x, s0, dk, dv, out);
}

/// Folds a full chunk into `S0`: `S0[i] ← e^{γ_C,i} S0[i] + Σ_s e^{γ_C,i −
/// γ_s,i} k_s[i] u_s`, over the chunk's tokens in order.
#[allow(clippy::too_many_arguments)]
fn fold(
    tier: SimdTier,
    p: &DeltaParams,
    s0: &mut [f32],
    ks: &[f32],
    us: &[f32],
    gs: &[f32],
    e: &mut Vec<f32>,
) {
    let (dk, dv, c, gd) = (p.dk, p.dv, p.chunk, p.g_dim());
    let last = &gs[(c - 1) * gd..c * gd];
    let at = |g: &[f32], i: usize| if gd == 1 { g[0] } else { g[i] };
    sized(e, c);
    for i in 0..dk {
        let row = &mut s0[i * dv..(i + 1) * dv];
        vecops::scale(tier, at(last, i).exp(), row);
        for (s, coef) in e.iter_mut().enumerate() {
            *coef = (at(last, i) - at(&gs[s * gd..], i)).exp() * ks[s * dk + i];
        }
        for (s, &coef) in e.iter().enumerate() {
            vecops::axpy(tier, coef, &us[s * dv..(s + 1) * dv], row);
        }
    }
}

/// The full state `S_t` after a sequence's last token, from its
/// chunk-aligned state at position `pos` (the next token's position):
/// `e^{γ} ⊙ S0 + Σ_s (e^{γ − γ_s} ⊙ k_s) ⊗ u_s` over the chunk's rows so far,
/// `[n_v_heads, dk, dv]` into `out` (for tests and state snapshots).
///
/// # Errors
/// Buffers of the wrong length.
pub fn materialize(
    p: &DeltaParams,
    state: &[f32],
    pos: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    p.validate()?;
    let (dk, dv, c, gd) = (p.dk, p.dv, p.chunk, p.g_dim());
    for (what, actual, expected) in [
        ("delta rule state", state.len(), p.state_len()),
        (
            "materialized delta rule state",
            out.len(),
            p.n_v_heads * dk * dv,
        ),
    ] {
        if actual != expected {
            return Err(KernelError::LengthMismatch {
                what,
                expected,
                actual,
            });
        }
    }
    let filled = pos % c;
    for (st, o) in state
        .chunks_exact(p.head_len())
        .zip(out.chunks_exact_mut(dk * dv))
    {
        let (s0, rest) = st.split_at(dk * dv);
        let (ks, rest) = rest.split_at(c * dk);
        let (us, gs) = rest.split_at(c * dv);
        if pos == 0 {
            o.fill(0.0);
            continue;
        }
        let at = |g: &[f32], i: usize| if gd == 1 { g[0] } else { g[i] };
        let last = if filled == 0 {
            None
        } else {
            Some(&gs[(filled - 1) * gd..filled * gd])
        };
        for i in 0..dk {
            let gl = last.map_or(0.0, |l| at(l, i));
            for j in 0..dv {
                let mut v = gl.exp() * s0[i * dv + j];
                for s in 0..filled {
                    v += (gl - at(&gs[s * gd..], i)).exp() * ks[s * dk + i] * us[s * dv + j];
                }
                o[i * dv + j] = v;
            }
        }
    }
    Ok(())
}

/// The token-by-token reference in f64 (transformers'
/// `torch_recurrent_gated_delta_rule` and `recurrent_kimi_delta_attention`):
/// runs one sequence's `n` tokens from state `s` (`[n_v_heads, dk, dv]`,
/// updated in place) and returns the outputs `[n, n_v_heads, dv]`.
pub fn delta_rule_ref(p: &DeltaParams, x: DeltaInputs<'_>, s: &mut [f64]) -> Vec<f32> {
    let (nk, nv, dk, dv, gd) = (p.n_k_heads, p.n_v_heads, p.dk, p.dv, p.g_dim());
    let n = x.v.len() / (nv * dv);
    let mut out = vec![0f32; n * nv * dv];
    for t in 0..n {
        for h in 0..nv {
            let kh = p.k_head(h);
            let k = &x.k[(t * nk + kh) * dk..][..dk];
            let q = &x.q[(t * nk + kh) * dk..][..dk];
            let v = &x.v[(t * nv + h) * dv..][..dv];
            let g = &x.g[(t * nv + h) * gd..][..gd];
            let beta = x.beta[t * nv + h] as f64;
            let st = &mut s[h * dk * dv..(h + 1) * dk * dv];
            for i in 0..dk {
                let a = (if gd == 1 { g[0] } else { g[i] } as f64).exp();
                st[i * dv..(i + 1) * dv].iter_mut().for_each(|x| *x *= a);
            }
            for j in 0..dv {
                let mem: f64 = (0..dk).map(|i| st[i * dv + j] * k[i] as f64).sum();
                let delta = (v[j] as f64 - mem) * beta;
                for i in 0..dk {
                    st[i * dv + j] += k[i] as f64 * delta;
                }
            }
            for j in 0..dv {
                let o: f64 = (0..dk).map(|i| st[i * dv + j] * q[i] as f64).sum();
                out[(t * nv + h) * dv + j] = o as f32;
            }
        }
    }
    out
}

/// The causal depthwise convolution in front of the delta rule, with its
/// rolling state: for each channel `c` and token `t`, `y = act(Σ_{j<K}
/// w[c][j] · x[t − K + 1 + j])`, where inputs before the sequence's first
/// token come from `tail` (the last `K − 1` inputs of earlier calls, `[K −
/// 1, channels]`, zeros at position 0), and SiLU as `act` when `silu`.
/// `tail` is updated to this call's last `K − 1` inputs. `x` and `y` are
/// `[n, channels]`; `w` is `[channels, K]` (PyTorch's `Conv1d` weight
/// without its middle axis).
///
/// # Errors
/// Buffers of the wrong length.
pub fn causal_conv1d(
    x: &[f32],
    w: &[f32],
    kernel: usize,
    tail: &mut [f32],
    silu: bool,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let channels = tail.len() / kernel.saturating_sub(1).max(1);
    if kernel < 2 || tail.len() != (kernel - 1) * channels || w.len() != channels * kernel {
        let (expected, actual) = (channels * kernel, w.len());
        return Err(KernelError::LengthMismatch {
            what: "causal conv1d weight",
            expected,
            actual,
        });
    }
    if !x.len().is_multiple_of(channels.max(1)) || y.len() != x.len() {
        let (expected, actual) = (x.len(), y.len());
        return Err(KernelError::LengthMismatch {
            what: "causal conv1d rows",
            expected,
            actual,
        });
    }
    let n = x.len() / channels.max(1);
    let (k1, ch) = (kernel - 1, channels);
    // The input at offset `o` before token `t`'s own (o = 0 is x[t]).
    let input = |t: usize, o: usize, c: usize| -> f32 {
        if o <= t {
            x[(t - o) * ch + c]
        } else {
            tail[(k1 - (o - t)) * ch + c]
        }
    };
    for t in 0..n {
        for c in 0..ch {
            let mut acc = 0f32;
            for j in 0..kernel {
                acc += w[c * kernel + j] * input(t, k1 - j, c);
            }
            y[t * ch + c] = if silu {
                acc / (1.0 + (-acc).exp())
            } else {
                acc
            };
        }
    }
    // The new tail: the last K − 1 inputs, older first. In place (this
    // runs per layer and step): row `r` is input `r + n` of the old tail
    // and this call's rows together, a later row than `r` while it is
    // still in the tail, so rows are written in order before being read.
    for r in 0..k1 {
        let dst = r * ch..(r + 1) * ch;
        match (r + n).checked_sub(k1) {
            None => tail.copy_within((r + n) * ch..(r + n + 1) * ch, r * ch),
            Some(t) => tail[dst].copy_from_slice(&x[t * ch..(t + 1) * ch]),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn l2(x: &mut [f32], d: usize) {
        for r in x.chunks_exact_mut(d) {
            let n = r.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
            r.iter_mut().for_each(|v| *v /= n);
        }
    }

    struct Case {
        p: DeltaParams,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        beta: Vec<f32>,
        g: Vec<f32>,
    }

    impl Case {
        fn new(p: DeltaParams, n: usize, seed: u64) -> Case {
            Case::with_decay(p, n, seed, -3.0)
        }

        /// Log decays drawn from `[lo, 0)`: near 0 the state keeps growing.
        fn with_decay(p: DeltaParams, n: usize, seed: u64, lo: f32) -> Case {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut r = |len: usize, lo: f32, hi: f32| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(lo..hi)).collect()
            };
            let (mut q, mut k) = (
                r(n * p.n_k_heads * p.dk, -1.0, 1.0),
                r(n * p.n_k_heads * p.dk, -1.0, 1.0),
            );
            l2(&mut q, p.dk);
            l2(&mut k, p.dk);
            let scale = (p.dk as f32).sqrt().recip();
            q.iter_mut().for_each(|x| *x *= scale);
            Case {
                v: r(n * p.n_v_heads * p.dv, -1.0, 1.0),
                beta: r(n * p.n_v_heads, 0.0, 1.0),
                g: r(n * p.n_v_heads * p.g_dim(), lo, 0.0),
                q,
                k,
                p,
            }
        }

        fn inputs(&self, rows: Range<usize>) -> DeltaInputs<'_> {
            let p = &self.p;
            let qk = p.n_k_heads * p.dk;
            let vd = p.n_v_heads * p.dv;
            let gd = p.n_v_heads * p.g_dim();
            DeltaInputs {
                q: &self.q[rows.start * qk..rows.end * qk],
                k: &self.k[rows.start * qk..rows.end * qk],
                v: &self.v[rows.start * vd..rows.end * vd],
                beta: &self.beta[rows.start * p.n_v_heads..rows.end * p.n_v_heads],
                g: &self.g[rows.start * gd..rows.end * gd],
            }
        }

        /// Runs tokens `0..n` in calls cut at `cuts`, returning the outputs
        /// and the final state.
        fn run(&self, tier: SimdTier, n: usize, cuts: &[usize]) -> (Vec<f32>, Vec<f32>) {
            let p = &self.p;
            let mut state = vec![f32::NAN; 2 * p.state_len()];
            let mut out = vec![f32::NAN; n * p.n_v_heads * p.dv];
            let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c > 0 && c < n).collect();
            bounds.insert(0, 0);
            bounds.push(n);
            for w in bounds.windows(2) {
                let rows = w[0]..w[1];
                let o = &mut out[rows.start * p.n_v_heads * p.dv..rows.end * p.n_v_heads * p.dv];
                let seq = DeltaSeq {
                    rows: 0..rows.len(),
                    pos0: rows.start,
                    slot: 1,
                };
                delta_rule_with(tier, p, self.inputs(rows), &[seq], &mut state, o)
                    .expect("delta rule");
            }
            let mut s = vec![0f32; p.n_v_heads * p.dk * p.dv];
            materialize(p, &state[p.state_len()..], n, &mut s).expect("materialize");
            (out, s)
        }
    }

    fn params(
        nk: usize,
        nv: usize,
        dk: usize,
        dv: usize,
        chunk: usize,
        channel_decay: bool,
    ) -> DeltaParams {
        DeltaParams {
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            chunk,
            channel_decay,
            sharing: HeadSharing::Grouped,
        }
    }

    /// The chunk-aligned form against the f64 recurrence, on odd sizes and
    /// chunk sizes, both decays. f32 sums of tens of terms of unit-sized
    /// state: 2e-5 relative to the largest output (the token-by-token f32
    /// recurrence lands as far).
    #[test]
    fn chunked_form_matches_the_recurrence() {
        for (i, p) in [
            params(1, 1, 8, 8, 4, false),
            params(2, 4, 16, 12, 5, false),
            params(1, 2, 13, 7, 16, true),
            params(3, 3, 32, 33, 1, true),
            params(2, 2, 64, 64, 16, false),
        ]
        .into_iter()
        .enumerate()
        {
            let n = 53;
            // Strong decays, and weak ones under which the state grows.
            for lo in [-3.0, -0.05] {
                let case = Case::with_decay(p, n, 10 + i as u64, lo);
                let mut s = vec![0f64; p.n_v_heads * p.dk * p.dv];
                let want = delta_rule_ref(&p, case.inputs(0..n), &mut s);
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-3);
                for tier in cpu::available_tiers() {
                    let (got, state) = case.run(tier, n, &[]);
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 2e-5 * scale + 1e-6,
                            "{p:?} {tier}: {g} vs {w}"
                        );
                    }
                    let smax = s.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-3);
                    for (g, w) in state.iter().zip(&s) {
                        assert!(
                            ((*g as f64) - w).abs() <= 2e-5 * smax,
                            "{p:?} {tier} state: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    /// Tiled sharing is grouped sharing with the value heads reordered:
    /// value head `v·nk + g` tiled is head `g·r + v` grouped, bit for bit.
    #[test]
    fn tiled_heads_are_grouped_heads_reordered() {
        for cd in [false, true] {
            let (nk, r, n) = (3, 2, 37);
            let grouped = Case::new(params(nk, nk * r, 8, 5, 4, cd), n, 77);
            let p = grouped.p;
            let tp = DeltaParams {
                sharing: HeadSharing::Tiled,
                ..p
            };
            let nv = p.n_v_heads;
            // Tiled head i is grouped head `(i % nk) · r + i / nk`.
            let from = |i: usize| (i % nk) * r + i / nk;
            let permute = |x: &[f32], d: usize| -> Vec<f32> {
                let mut y = vec![0f32; x.len()];
                for t in 0..n {
                    for i in 0..nv {
                        let (src, dst) = ((t * nv + from(i)) * d, (t * nv + i) * d);
                        y[dst..dst + d].copy_from_slice(&x[src..src + d]);
                    }
                }
                y
            };
            let tiled = Case {
                p: tp,
                q: grouped.q.clone(),
                k: grouped.k.clone(),
                v: permute(&grouped.v, p.dv),
                beta: permute(&grouped.beta, 1),
                g: permute(&grouped.g, p.g_dim()),
            };
            for tier in cpu::available_tiers() {
                let (want, _) = grouped.run(tier, n, &[9]);
                let (got, _) = tiled.run(tier, n, &[9]);
                assert_eq!(got, permute(&want, p.dv), "{tier} channel decay {cd}");
            }
            let mut s = vec![0f64; nv * p.dk * p.dv];
            let want = delta_rule_ref(&p, grouped.inputs(0..n), &mut s);
            let mut s = vec![0f64; nv * p.dk * p.dv];
            let got = delta_rule_ref(&tp, tiled.inputs(0..n), &mut s);
            assert_eq!(got, permute(&want, p.dv));
        }
    }

    /// Calls cut anywhere (one token at a time, mid-chunk, at chunk ends)
    /// give the bits of one call.
    #[test]
    fn cuts_do_not_change_a_bit() {
        for p in [params(2, 4, 16, 12, 5, false), params(1, 2, 24, 8, 8, true)] {
            let n = 41;
            let case = Case::new(p, n, 3);
            for tier in cpu::available_tiers() {
                let (whole, s_whole) = case.run(tier, n, &[]);
                let every: Vec<usize> = (1..n).collect();
                for cuts in [vec![3, 10, 11, 25], vec![5, 10, 15, 20], every] {
                    let (got, s) = case.run(tier, n, &cuts);
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&whole), "{p:?} {tier} cuts {cuts:?}");
                    assert_eq!(bits(&s), bits(&s_whole), "{p:?} {tier} cuts {cuts:?}");
                }
            }
        }
    }

    /// Several sequences in one call: each as alone, whatever its slot and
    /// neighbours; a sequence at position 0 ignores what its slot held.
    #[test]
    fn sequences_of_a_batch_are_independent() {
        let p = params(2, 2, 16, 16, 4, false);
        let (na, nb) = (9, 14);
        let (a, b) = (Case::new(p, na, 1), Case::new(p, nb, 2));
        let tier = cpu::tier();
        let (alone_a, _) = a.run(tier, na, &[]);
        let (alone_b, _) = b.run(tier, nb, &[]);
        let cat = |x: &[f32], y: &[f32]| [x, y].concat();
        let (ia, ib) = (a.inputs(0..na), b.inputs(0..nb));
        let (q, k, v, beta, g) = (
            cat(ia.q, ib.q),
            cat(ia.k, ib.k),
            cat(ia.v, ib.v),
            cat(ia.beta, ib.beta),
            cat(ia.g, ib.g),
        );
        let x = DeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: &g,
        };
        let mut state: Vec<f32> = (0..3 * p.state_len()).map(|i| i as f32).collect();
        let mut out = vec![f32::NAN; (na + nb) * p.n_v_heads * p.dv];
        let seqs = [
            DeltaSeq {
                rows: na..na + nb,
                pos0: 0,
                slot: 0,
            },
            DeltaSeq {
                rows: 0..na,
                pos0: 0,
                slot: 2,
            },
        ];
        delta_rule(&p, x, &seqs, &mut state, &mut out).expect("batch");
        let split = na * p.n_v_heads * p.dv;
        assert_eq!(out[..split], alone_a[..]);
        assert_eq!(out[split..], alone_b[..]);
        // A slot twice, a row twice, rows past the end: errors.
        for bad in [
            vec![
                DeltaSeq {
                    rows: 0..1,
                    pos0: 0,
                    slot: 0,
                },
                DeltaSeq {
                    rows: 1..2,
                    pos0: 0,
                    slot: 0,
                },
            ],
            vec![
                DeltaSeq {
                    rows: 0..2,
                    pos0: 0,
                    slot: 0,
                },
                DeltaSeq {
                    rows: 1..3,
                    pos0: 0,
                    slot: 1,
                },
            ],
            vec![DeltaSeq {
                rows: 0..na + nb + 1,
                pos0: 0,
                slot: 0,
            }],
            vec![DeltaSeq {
                rows: 0..1,
                pos0: 0,
                slot: 3,
            }],
        ] {
            assert!(delta_rule(&p, x, &bad, &mut state, &mut out).is_err());
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(params(2, 3, 8, 8, 4, false).validate().is_err());
        assert!(params(1, 1, 8, 8, 0, false).validate().is_err());
        assert!(params(0, 1, 8, 8, 4, false).validate().is_err());
        let p = params(1, 1, 4, 4, 2, false);
        let x = DeltaInputs {
            q: &[0.0; 4],
            k: &[0.0; 4],
            v: &[0.0; 4],
            beta: &[0.0; 1],
            g: &[0.0; 2],
        };
        let mut state = vec![0.0; p.state_len()];
        let seq = [DeltaSeq {
            rows: 0..1,
            pos0: 0,
            slot: 0,
        }];
        assert!(delta_rule(&p, x, &seq, &mut state, &mut [0.0; 4]).is_err());
    }

    /// The convolution against its definition, and its tail carried across
    /// calls cut anywhere.
    #[test]
    fn conv_carries_its_tail() {
        let (ch, kernel, n) = (5usize, 4usize, 11usize);
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let x: Vec<f32> = (0..n * ch).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w: Vec<f32> = (0..ch * kernel)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut want = vec![0f32; n * ch];
        for t in 0..n {
            for c in 0..ch {
                let mut acc = 0f64;
                for j in 0..kernel {
                    let src = t as isize - (kernel - 1 - j) as isize;
                    if src >= 0 {
                        acc += w[c * kernel + j] as f64 * x[src as usize * ch + c] as f64;
                    }
                }
                want[t * ch + c] = (acc / (1.0 + (-acc).exp())) as f32;
            }
        }
        for cuts in [vec![0, n], vec![0, 1, 2, 7, n], (0..=n).collect::<Vec<_>>()] {
            let mut tail = vec![0f32; (kernel - 1) * ch];
            let mut got = vec![f32::NAN; n * ch];
            for w2 in cuts.windows(2) {
                let (a, b) = (w2[0] * ch, w2[1] * ch);
                causal_conv1d(&x[a..b], &w, kernel, &mut tail, true, &mut got[a..b]).expect("conv");
            }
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-5, "cuts {cuts:?}: {g} vs {w}");
            }
        }
    }
}
