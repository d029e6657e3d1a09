//! The routed experts' feed-forward blocks, run expert-major.
//!
//! `out[t] = Σ_slot w[t, slot] · down_e(act(gate_e(x_t)) ⊙ up_e(x_t))` with
//! `e = ids[t, slot]`, computed without a per-token or per-expert loop of
//! kernel calls:
//! 1. the assignments are sorted by expert ([`MoePlan`]) and the token rows
//!    gathered in that order, so each expert's tokens are one run;
//! 2. int8 experts: the tokens are quantized once and the quantized rows
//!    gathered; gate and up of every expert with tokens run as one
//!    [`int8::gemm_grouped`] job, then the gating, one quantization of the
//!    whole intermediate batch, and down as a second job: two fork-joins a
//!    layer whatever the number of experts. f16 and other weights run one
//!    product per active expert over its run (their kernels take f32 rows);
//! 3. each token sums its slots' outputs in slot order.
//!
//! Batch invariance: every kernel here computes each (row, token) value
//! the same way whatever the other tokens of the call (see `int8`,
//! `halfpack`, `matmul`), activation quantization and gating are per row
//! and per value, and the combine runs each token's slots in a fixed order
//! and never mixes tokens; so a token's output is the same bits alone or
//! in any batch, on any number of threads. Experts without tokens are never
//! touched.

use super::plan::MoePlan;
use super::routing::Routing;
use crate::activation::{gated_with, Activation};
use crate::cpu::SimdTier;
use crate::error::{check_len, checked_mul, KernelError};
use crate::group::MatrixGroup;
use crate::int8::{self, PackedMatrix, Q8Activations, Segment};
use crate::linear::LinearWeight;
use crate::pool::{self, DisjointSlice};
use kvant_core::Tensor;

/// A layer's routed experts: per expert, gate `[ff, hidden]`, up
/// `[ff, hidden]` and down `[hidden, ff]`.
#[derive(Clone, Debug)]
pub struct Experts {
    gate: MatrixGroup,
    up: MatrixGroup,
    down: MatrixGroup,
    n_experts: usize,
    hidden: usize,
    ff: usize,
}

impl Experts {
    /// Takes each projection's weights, expert by expert (as
    /// [`LinearWeight::prepare`] made them from the stacked tensor's
    /// matrices).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] unless there is at least one expert
    /// and as many gates, ups and downs; [`KernelError::MatrixShape`] when
    /// an expert's shapes differ from expert 0's gate `[ff, hidden]`;
    /// [`KernelError::MatrixKind`] when one projection's experts were
    /// prepared for different kernels.
    pub fn new(
        gate: Vec<LinearWeight>,
        up: Vec<LinearWeight>,
        down: Vec<LinearWeight>,
    ) -> Result<Self, KernelError> {
        let n_experts = gate.len();
        check_len("experts (at least one)", n_experts.max(1), n_experts)?;
        check_len("expert up weights", n_experts, up.len())?;
        check_len("expert down weights", n_experts, down.len())?;
        let (ff, hidden) = (gate[0].rows(), gate[0].cols());
        Ok(Experts {
            gate: MatrixGroup::new("expert gate", gate, [ff, hidden])?,
            up: MatrixGroup::new("expert up", up, [ff, hidden])?,
            down: MatrixGroup::new("expert down", down, [hidden, ff])?,
            n_experts,
            hidden,
            ff,
        })
    }

    /// Prepares a layer's stacked expert tensors (GGUF's `ffn_gate_exps`,
    /// `ffn_up_exps` `[n_expert, ff, hidden]` and `ffn_down_exps`
    /// `[n_expert, hidden, ff]`), matrix by matrix, with
    /// [`LinearWeight::prepare`].
    ///
    /// # Errors
    /// A [`kvant_core::CoreError`] unless each stack is 3-D, and as
    /// [`Experts::new`].
    pub fn from_stacks(
        gate: &Tensor,
        up: &Tensor,
        down: &Tensor,
        int8: bool,
    ) -> Result<Self, KernelError> {
        let prepare = |stack| LinearWeight::prepare_stack(stack, int8);
        Experts::new(prepare(gate)?, prepare(up)?, prepare(down)?)
    }

    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The experts' intermediate size.
    pub fn ff(&self) -> usize {
        self.ff
    }

    /// Bytes of every expert's weights.
    pub fn byte_len(&self) -> usize {
        (0..self.n_experts).map(|e| self.expert_bytes(e)).sum()
    }

    /// Bytes of expert `e`'s weights: what one token routed to it reads.
    ///
    /// # Panics
    /// If `e >= n_experts()`.
    pub fn expert_bytes(&self, e: usize) -> usize {
        self.gate.matrix_bytes(e) + self.up.matrix_bytes(e) + self.down.matrix_bytes(e)
    }
}

/// Buffers of [`moe_ffn`], reused from call to call (a batch no larger
/// than an earlier one allocates nothing).
#[derive(Debug, Default)]
pub struct MoeScratch {
    plan: MoePlan,
    /// The tokens, quantized once (int8 gate/up).
    xq: Q8Activations,
    /// `xq`'s rows in plan order.
    gathered_q8: Q8Activations,
    /// The token rows in plan order (f32 gate/up).
    gathered: Vec<f32>,
    /// `[n_assign, ff]`; `gate` becomes the gated intermediate.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// The intermediate, quantized (int8 down).
    inter_q8: Q8Activations,
    /// `[n_assign, hidden]`: each assignment's expert output.
    down: Vec<f32>,
    segments: Vec<Segment>,
}

impl MoeScratch {
    /// The last call's plan (which expert got which tokens).
    pub fn plan(&self) -> &MoePlan {
        &self.plan
    }
}

/// The values of the combine below which it runs on the calling thread:
/// handing out a pool job (~1 µs) costs more than adding these up.
const MIN_PARALLEL_COMBINE: usize = 64 << 10;

/// `out[t] = Σ_slot weights[t, slot] · down_e(act(gate_e(x_t)) ⊙ up_e(x_t))`,
/// `e = ids[t, slot]`, on `tier` (lowered to one the CPU supports; the
/// layers pass [`crate::cpu::tier`]). `x` and `out` are `[n_tokens, hidden]`
/// (`out` is overwritten), `ids` and `weights` `[n_tokens, top_k]` (see
/// [`Routing`] and [`super::route`]).
///
/// # Errors
/// [`KernelError::LengthMismatch`] if a slice disagrees with the shapes,
/// [`KernelError::IndexOutOfRange`] for an id of no expert; `out` is then
/// untouched.
pub fn moe_ffn(
    tier: SimdTier,
    experts: &Experts,
    act: Activation,
    x: &[f32],
    r: &Routing<'_>,
    scratch: &mut MoeScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    r.check_rows("moe input [n_tokens, hidden]", experts.hidden, x.len())?;
    run(tier, experts, act, Input::F32(x), r, scratch, out)
}

impl Experts {
    /// Whether gate and up run on the int8 kernels, so that the layer's
    /// input can come already quantized ([`moe_ffn_quantized`]).
    pub fn takes_quantized(&self) -> bool {
        self.gate.int8().is_some() && self.up.int8().is_some()
    }
}

/// [`moe_ffn`] over tokens that arrive already quantized (expert
/// parallelism sends 8-bit rows, a third of the f32 bytes): the same
/// bits as [`moe_ffn`] on the f32 rows they were quantized from, since
/// that quantizes them the same way.
///
/// # Errors
/// As [`moe_ffn`]; [`KernelError::LengthMismatch`] when `x` is not
/// `[n_tokens, hidden]` or the experts' gate and up are not int8 (see
/// [`Experts::takes_quantized`]).
pub fn moe_ffn_quantized(
    tier: SimdTier,
    experts: &Experts,
    act: Activation,
    x: &Q8Activations,
    r: &Routing<'_>,
    scratch: &mut MoeScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_len("quantized moe input columns", experts.hidden, x.k())?;
    check_len("quantized moe input rows", r.n_tokens, x.n_tokens())?;
    if !experts.takes_quantized() {
        return Err(KernelError::LengthMismatch {
            what: "int8 gate and up weights for quantized moe input",
            expected: 2,
            actual: usize::from(experts.gate.int8().is_some())
                + usize::from(experts.up.int8().is_some()),
        });
    }
    run(tier, experts, act, Input::Q8(x), r, scratch, out)
}

/// The tokens a MoE call runs.
enum Input<'a> {
    F32(&'a [f32]),
    /// Already quantized (int8 gate and up only).
    Q8(&'a Q8Activations),
}

fn run(
    tier: SimdTier,
    experts: &Experts,
    act: Activation,
    x: Input<'_>,
    r: &Routing<'_>,
    scratch: &mut MoeScratch,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (h, ff) = (experts.hidden, experts.ff);
    let n_tokens = r.n_tokens;
    r.check_rows("moe output [n_tokens, hidden]", h, out.len())?;
    let n_assign = r.check()?;
    let s = scratch;
    s.plan.build(r.ids, r.top_k, experts.n_experts)?;
    let inter_len = checked_mul("moe", n_assign, ff)?;
    let out_len = checked_mul("moe", n_assign, h)?;
    if n_assign == 0 {
        out.fill(0.0);
        return Ok(());
    }
    s.gate.resize(inter_len, 0.0);
    s.up.resize(inter_len, 0.0);
    s.down.resize(out_len, 0.0);

    // Gate and up: the int8 projections as one grouped job.
    let (gate_q8, up_q8) = (experts.gate.int8(), experts.up.int8());
    if gate_q8.is_some() || up_q8.is_some() {
        let xq = match x {
            Input::F32(x) => {
                s.xq.quantize(tier, x, n_tokens, h)?;
                &s.xq
            }
            Input::Q8(q) => q,
        };
        s.gathered_q8.gather(xq, s.plan.tokens())?;
        s.segments.clear();
        let mut sets: [&[PackedMatrix]; 2] = [&[], &[]];
        let mut ys: [&mut [f32]; 2] = [&mut [], &mut []];
        let mut m = 0;
        for (p, y) in [(gate_q8, &mut s.gate), (up_q8, &mut s.up)] {
            if let Some(p) = p {
                sets[m] = p;
                ys[m] = y;
                m += 1;
            }
        }
        for (e, r) in s.plan.active() {
            for set in 0..m {
                s.segments.push(Segment {
                    set,
                    matrix: e,
                    tokens: r.clone(),
                });
            }
        }
        int8::gemm_grouped_with(tier, &sets[..m], &s.segments, &s.gathered_q8, &mut ys[..m])?;
    }
    if gate_q8.is_none() || up_q8.is_none() {
        // Checked in `moe_ffn_quantized`: quantized input has int8 gate and up.
        let Input::F32(x) = x else {
            return Err(KernelError::LengthMismatch {
                what: "f32 input for float expert weights",
                expected: n_tokens * h,
                actual: 0,
            });
        };
        s.gathered.clear();
        for &t in s.plan.tokens() {
            s.gathered.extend_from_slice(&x[t * h..(t + 1) * h]);
        }
        for (proj, y) in [(&experts.gate, &mut s.gate), (&experts.up, &mut s.up)] {
            if proj.int8().is_none() {
                proj.forward_runs(tier, s.plan.active(), &s.gathered, &mut s.xq, y)?;
            }
        }
    }
    gated_with(tier, act, &mut s.gate, &s.up);

    // Down.
    experts
        .down
        .forward_runs(tier, s.plan.active(), &s.gate, &mut s.inter_q8, &mut s.down)?;
    combine(&s.down, s.plan.positions(), r.weights, r.top_k, h, out)
}

/// `out[t] = Σ_slot w[t, slot] · y[positions[t, slot]]` over rows of
/// `h` values, slots in order (the first written, the others added): a
/// fixed sequence of roundings per token whichever thread runs it, and
/// whichever rank computed the rows of `y` (expert parallelism combines
/// with it too, which is what makes its output the bits of one process).
///
/// # Errors
/// [`KernelError::LengthMismatch`] unless `positions` and `weights` hold
/// `top_k` entries per row of `out`, [`KernelError::IndexOutOfRange`] for
/// a position past `y`'s rows; `out` is then untouched.
pub fn combine(
    y: &[f32],
    positions: &[usize],
    weights: &[f32],
    top_k: usize,
    h: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let k = top_k;
    let n_tokens = out.len() / h.max(1);
    check_len(
        "combined rows [n_tokens, h]",
        checked_mul("combine", n_tokens, h)?,
        out.len(),
    )?;
    let n_assign = checked_mul("combine", n_tokens, k)?;
    check_len(
        "combine positions [n_tokens, top_k]",
        n_assign,
        positions.len(),
    )?;
    check_len("combine weights [n_tokens, top_k]", n_assign, weights.len())?;
    let rows = y.len() / h.max(1);
    if let Some(&p) = positions.iter().find(|&&p| p >= rows) {
        return Err(KernelError::IndexOutOfRange {
            what: "combined row",
            index: p,
            len: rows,
        });
    }
    let token = |t: usize, o: &mut [f32]| {
        for slot in 0..k {
            let a = t * k + slot;
            let w = weights[a];
            let p = positions[a];
            let yr = &y[p * h..(p + 1) * h];
            if slot == 0 {
                for (o, &v) in o.iter_mut().zip(yr) {
                    *o = w * v;
                }
            } else {
                for (o, &v) in o.iter_mut().zip(yr) {
                    *o += w * v;
                }
            }
        }
    };
    let p = pool::global();
    let tasks = (out.len().saturating_mul(k) / MIN_PARALLEL_COMBINE)
        .clamp(1, p.threads())
        .min(n_tokens);
    if tasks <= 1 {
        for (t, o) in out.chunks_exact_mut(h.max(1)).enumerate() {
            token(t, o);
        }
        return Ok(());
    }
    let dst = DisjointSlice::new(out);
    p.run(pool::chunks(n_tokens, tasks, 1), &|i| {
        for t in pool::chunk(n_tokens, tasks, 1, i) {
            // SAFETY: token `t`'s row belongs to this task only (the chunks
            // of `0..n_tokens` are disjoint).
            token(t, unsafe { dst.range(t * h..(t + 1) * h) });
        }
    });
    Ok(())
}
