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
//! yet wait in `pending`.

use crate::error::EngineError;
use kvant_model::arch::decoder::DecoderModel;
use kvant_model::kv::KvCache;

#[derive(Default)]
pub(crate) struct MtpDrafter {
    /// Module inputs stored: positions `0..slots` consumed.
    slots: usize,
    /// Hidden states `[rows, hidden]` of positions `slots..slots + rows`.
    pending: Vec<f32>,
}

impl MtpDrafter {
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

    /// Drafts the token after `next`, which follows `tokens` (whose keys
    /// are in `cache`): feeds the module every pending position, the last
    /// with `next`, and returns its argmax.
    pub fn draft(
        &mut self,
        model: &DecoderModel,
        cache: &mut KvCache,
        tokens: &[u32],
        next: u32,
    ) -> Result<u32, EngineError> {
        let rows = self.pending.len() / model.config().hidden;
        // Inputs slots..slots+rows take tokens slots+1.. and end with `next`.
        let mut inputs: Vec<u32> = tokens.get(self.slots + 1..).unwrap_or(&[]).to_vec();
        inputs.push(next);
        // A mismatch with `rows` is the model's typed `MtpHidden` error.
        let logits = model.mtp_draft(&inputs, &self.pending, self.slots, cache)?;
        self.slots += rows;
        self.pending.clear();
        Ok(argmax(&logits))
    }
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0 as u32
}
