//! Self-speculative decoding with the model's own multi-token-prediction
//! (MTP) module (DeepSeek-V3, GigaChat3): each step, the module drafts the
//! token after the one just sampled, and one forward pass of the main
//! model over both verifies the draft and, when it holds, yields the
//! logits of the token after it — two tokens for one pass.
//!
//! The output is exactly what plain decoding gives, for any sampler: the
//! sampler runs on the main model's logits only, drawing in the same order
//! (the draft decides nothing but whether the second row's logits belong
//! to the sampled sequence), and the main model's rows are bit-identical
//! whether one or two tokens run per pass (the forward pass is batch
//! invariant).
//!
//! The drafter keeps the module's cache in step with the sequence: input
//! `i` of the module is token `i + 1` with the main model's hidden state at
//! position `i`; hidden states of positions the module has not consumed
//! yet wait in `pending`, so drafting can pause and resume (one draft
//! then catches up on every position in one pass).
//!
//! Whether a step drafts is the [`Policy`]'s call. Drafting pays when the
//! acceptance rate is high and a draft plus a two-token pass costs little
//! more than a one-token pass; a model whose output head is a large share
//! of its weights (the head runs in the draft too) or whose module guesses
//! badly loses. [`Policy::Adaptive`] measures the seconds per produced
//! token both ways and keeps the cheaper, re-measuring the other now and
//! then.

use crate::error::EngineError;
use kvant_model::arch::decoder::{DecoderModel, MtpStep};
use kvant_model::kv::KvCache;

/// When a decode step drafts with the MTP module.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Every step that has room.
    Always,
    /// When it is measured to be faster (see the module doc).
    #[default]
    Adaptive,
}

/// Steps measured before comparing the two ways.
const WINDOW: usize = 8;
/// Steps the cheaper way runs before the other is measured again.
const REMEASURE: usize = 256;

/// The adaptive policy's state: which way runs, and the measured cost per
/// produced token of each (exponential averages).
#[derive(Default)]
struct Meter {
    drafting: bool,
    cost: [Option<f64>; 2],
    /// Steps in the current way since it was chosen.
    steps: usize,
}

impl Meter {
    fn record(&mut self, secs: f64, tokens: usize) {
        let way = usize::from(self.drafting);
        self.steps += 1;
        // The first step after a switch carries the switch's catch-up.
        if self.steps > 1 {
            let c = secs / tokens.max(1) as f64;
            self.cost[way] = Some(match self.cost[way] {
                Some(old) => 0.75 * old + 0.25 * c,
                None => c,
            });
        }
        let other = 1 - way;
        let switch = match (self.cost[way], self.cost[other]) {
            _ if self.steps <= WINDOW => false,
            (_, None) => true,
            (Some(mine), Some(theirs)) => theirs < mine || self.steps > REMEASURE,
            (None, Some(_)) => false,
        };
        if switch {
            self.drafting = !self.drafting;
            self.steps = 0;
        }
    }
}

/// Whether decode steps draft: the policy, and the adaptive policy's
/// measurements. One per [`crate::session::Session`], one per serving
/// engine (there it measures whole decode steps of the batch).
pub(crate) struct Speculation {
    policy: Policy,
    meter: Meter,
}

impl Speculation {
    pub fn new(policy: Policy) -> Self {
        Speculation {
            policy,
            meter: Meter {
                drafting: true,
                ..Meter::default()
            },
        }
    }

    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
    }

    /// Whether the next decode step should draft.
    pub fn wants_draft(&self) -> bool {
        self.policy == Policy::Always || self.meter.drafting
    }

    /// Reports a decode step's time and the tokens it produced.
    pub fn record(&mut self, secs: f64, tokens: usize) {
        self.meter.record(secs, tokens);
    }
}

/// One sequence's place in the MTP module's cache: inputs `0..slots` are
/// stored; the main model's hidden states of positions `slots..` wait in
/// `pending` (`[rows, hidden]`).
#[derive(Clone, Default)]
pub(crate) struct MtpState {
    slots: usize,
    pending: Vec<f32>,
}

impl MtpState {
    /// A sequence whose module inputs below `slots` are already stored
    /// (0 for a fresh one; a prefix-cache hit's first uncached position).
    pub fn starting_at(slots: usize) -> Self {
        MtpState {
            slots,
            pending: Vec::new(),
        }
    }

    /// Forgets everything from position `keep` on (the sequence was cut
    /// back to `keep` tokens). Returns the position the main model must
    /// recompute from so that every hidden state the module still needs
    /// comes back (at most `keep`).
    pub fn truncate(&mut self, keep: usize, hidden: usize) -> usize {
        // Input `i` needs token `i + 1`, so only inputs below `keep - 1` survive.
        self.slots = self.slots.min(keep.saturating_sub(1));
        let have = self.pending.len() / hidden.max(1);
        let upto = (self.slots + have).min(keep);
        self.pending.truncate((upto - self.slots) * hidden);
        upto
    }

    /// Records hidden states of positions starting at the first one not
    /// pending yet.
    pub fn push_hidden(&mut self, rows: &[f32]) {
        self.pending.extend_from_slice(rows);
    }

    /// The module's step for drafting the token after `next`, which
    /// follows `tokens`: every pending position, the last fed `next`, in
    /// the sequence's block table and state slot. The caller runs it,
    /// then calls [`Self::consumed`].
    pub fn step<'a>(
        &'a self,
        tokens: &[u32],
        next: u32,
        (table, state): (&'a [u32], usize),
    ) -> (Vec<u32>, MtpInput<'a>) {
        // Inputs slots..slots+rows take tokens slots+1.. and end with `next`.
        let mut inputs: Vec<u32> = tokens.get(self.slots + 1..).unwrap_or(&[]).to_vec();
        inputs.push(next);
        (
            inputs,
            MtpInput {
                hidden: &self.pending,
                slot0: self.slots,
                table,
                state,
            },
        )
    }

    /// The pending positions went through the module.
    pub fn consumed(&mut self, hidden: usize) {
        self.slots += self.pending.len() / hidden.max(1);
        self.pending.clear();
    }
}

/// An [`MtpState::step`] without its tokens (kept apart so that a batch of
/// steps can borrow them): hidden rows, first slot, block table, state
/// slot.
pub(crate) struct MtpInput<'a> {
    pub hidden: &'a [f32],
    pub slot0: usize,
    pub table: &'a [u32],
    pub state: usize,
}

impl MtpInput<'_> {
    pub fn with<'a>(&'a self, tokens: &'a [u32]) -> MtpStep<'a> {
        MtpStep {
            tokens,
            hidden: self.hidden,
            slot0: self.slot0,
            table: self.table,
            state: self.state,
        }
    }
}

/// A [`crate::session::Session`]'s drafter: its sequence's module state
/// and its speculation policy.
pub(crate) struct MtpDrafter {
    pub state: MtpState,
    pub spec: Speculation,
    /// Where the module stood when the cache saved its per-sequence state
    /// ([`KvCache::save_state`]; models that keep one): a cache that goes
    /// back to that state puts the module back there too.
    pub saved: Option<(usize, MtpState)>,
}

impl MtpDrafter {
    pub fn new(policy: Policy) -> Self {
        MtpDrafter {
            state: MtpState::default(),
            spec: Speculation::new(policy),
            saved: None,
        }
    }

    /// Drafts the token after `next`, which follows `tokens` (whose keys
    /// are in `cache`), and returns the module's argmax.
    pub fn draft(
        &mut self,
        model: &DecoderModel,
        cache: &mut KvCache,
        tokens: &[u32],
        next: u32,
    ) -> Result<u32, EngineError> {
        let (inputs, input) = self.state.step(tokens, next, (&[], 0));
        // A mismatch of rows and tokens is the model's typed `MtpHidden` error.
        let logits = model.mtp_draft(&inputs, input.hidden, input.slot0, cache)?;
        self.state.consumed(model.hidden_width());
        // A draft is a guess the verifying pass checks: with no finite
        // logit, token 0 (rejected like any wrong guess).
        Ok(crate::sampling::argmax(&logits).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps whose cost per token is `costs[drafting]`;
    /// returns the share of steps that drafted.
    fn drive(m: &mut Meter, costs: [f64; 2], steps: usize) -> f64 {
        let mut drafted = 0;
        for _ in 0..steps {
            let way = usize::from(m.drafting);
            drafted += way;
            let tokens = 1 + way;
            m.record(costs[way] * tokens as f64, tokens);
        }
        drafted as f64 / steps as f64
    }

    #[test]
    fn the_cheaper_way_wins_and_the_other_is_remeasured() {
        let mut m = Meter {
            drafting: true,
            ..Meter::default()
        };
        // Drafting is dearer per token: after one window of each, plain
        // decoding runs, with a window of drafting every REMEASURE steps.
        let share = drive(&mut m, [1.0, 2.0], 2000);
        assert!(share < 0.1, "drafted {share}");
        assert!(!m.drafting || m.steps <= WINDOW + 1);
        // The costs swap (say the module starts guessing right): drafting
        // takes over within a re-measurement.
        drive(&mut m, [2.0, 1.0], REMEASURE + 4 * WINDOW);
        let share = drive(&mut m, [2.0, 1.0], 1000);
        assert!(share > 0.9, "drafted {share}");
    }
}
