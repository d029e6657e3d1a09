//! The expert-major order of a batch's (token, slot) assignments.
//!
//! Routing gives each token `top_k` experts; the experts' products want
//! each expert's tokens as one contiguous run, so that one GEMM per expert
//! covers them. A counting sort by expert gives that order in two passes
//! over the assignments; being stable, it keeps each expert's tokens in
//! ascending order, so the plan (and every product over it) depends only
//! on the routing, never on scheduling.

use crate::error::KernelError;
use std::ops::Range;

/// The sorted order of one batch's assignments. Its buffers are reused
/// from call to call: building a plan for a batch no larger than an
/// earlier one does not allocate.
#[derive(Clone, Debug, Default)]
pub struct MoePlan {
    top_k: usize,
    /// `offsets[e]..offsets[e + 1]`: expert `e`'s sorted positions.
    offsets: Vec<usize>,
    /// The next free position of each expert while sorting.
    cursor: Vec<usize>,
    /// Per sorted position: the source token and its slot.
    tokens: Vec<usize>,
    slots: Vec<usize>,
    /// Per assignment `t * top_k + slot`: its sorted position.
    positions: Vec<usize>,
}

impl MoePlan {
    /// Sorts the assignments `ids` (`[n_tokens, top_k]` expert ids) by expert.
    ///
    /// # Errors
    /// [`KernelError::IndexOutOfRange`] for an id of no expert (the plan is
    /// then empty); [`KernelError::LengthMismatch`] unless `ids` is whole
    /// rows of `top_k` (none when `top_k` is 0).
    pub fn build(
        &mut self,
        ids: &[u32],
        top_k: usize,
        n_experts: usize,
    ) -> Result<(), KernelError> {
        self.top_k = top_k;
        self.offsets.clear();
        self.offsets.resize(n_experts + 1, 0);
        self.tokens.clear();
        self.slots.clear();
        self.positions.clear();
        let whole = ids.len().checked_div(top_k).map_or(0, |n| n * top_k);
        crate::error::check_len("expert ids [n_tokens, top_k]", whole, ids.len())?;
        for &e in ids {
            if (e as usize) >= n_experts {
                self.offsets.fill(0);
                return Err(KernelError::IndexOutOfRange {
                    what: "expert id",
                    index: e as usize,
                    len: n_experts,
                });
            }
            self.offsets[e as usize + 1] += 1;
        }
        for e in 0..n_experts {
            self.offsets[e + 1] += self.offsets[e];
        }
        self.cursor.clear();
        self.cursor.extend_from_slice(&self.offsets[..n_experts]);
        self.tokens.resize(ids.len(), 0);
        self.slots.resize(ids.len(), 0);
        self.positions.resize(ids.len(), 0);
        for (a, &e) in ids.iter().enumerate() {
            let p = self.cursor[e as usize];
            self.cursor[e as usize] += 1;
            self.tokens[p] = a / top_k;
            self.slots[p] = a % top_k;
            self.positions[a] = p;
        }
        Ok(())
    }

    /// Experts the plan was built for.
    pub fn n_experts(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Assignments (tokens × `top_k`).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Expert `e`'s sorted positions (empty for an expert without tokens
    /// or one the plan does not have).
    pub fn range(&self, e: usize) -> Range<usize> {
        match (self.offsets.get(e), self.offsets.get(e + 1)) {
            (Some(&a), Some(&b)) => a..b,
            _ => 0..0,
        }
    }

    /// The experts that have tokens, with their sorted positions, by id.
    pub fn active(&self) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.offsets
            .windows(2)
            .enumerate()
            .filter(|(_, w)| w[0] < w[1])
            .map(|(e, w)| (e, w[0]..w[1]))
    }

    /// Per sorted position: the token it came from.
    pub fn tokens(&self) -> &[usize] {
        &self.tokens
    }

    /// Per sorted position: the token's slot it came from.
    pub fn slots(&self) -> &[usize] {
        &self.slots
    }

    /// Per assignment `t * top_k + slot`: its sorted position.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_by_expert_with_tokens_ascending() {
        // 4 tokens, top-2, 5 experts (expert 3 unused).
        let ids = [2, 0, 0, 4, 2, 1, 4, 0];
        let mut plan = MoePlan::default();
        plan.build(&ids, 2, 5).unwrap();
        assert_eq!(plan.len(), 8);
        assert_eq!(plan.range(0), 0..3);
        assert_eq!(plan.range(3), 6..6);
        assert_eq!(plan.range(7), 0..0);
        assert_eq!(plan.tokens(), &[0, 1, 3, 2, 0, 2, 1, 3]);
        assert_eq!(plan.slots(), &[1, 0, 1, 1, 0, 0, 1, 0]);
        let active: Vec<usize> = plan.active().map(|(e, _)| e).collect();
        assert_eq!(active, [0, 1, 2, 4]);
        for (a, &p) in plan.positions().iter().enumerate() {
            assert_eq!((plan.tokens()[p], plan.slots()[p]), (a / 2, a % 2));
            assert!(plan.range(ids[a] as usize).contains(&p));
        }
        // Rebuilt smaller: nothing of the larger plan survives.
        plan.build(&[3], 1, 4).unwrap();
        assert_eq!((plan.len(), plan.n_experts(), plan.range(3)), (1, 4, 0..1));
        assert_eq!(plan.active().count(), 1);
    }

    #[test]
    fn bad_ids_and_ragged_rows_are_errors() {
        let mut plan = MoePlan::default();
        assert!(matches!(
            plan.build(&[0, 5], 1, 5),
            Err(KernelError::IndexOutOfRange { index: 5, .. })
        ));
        assert!(plan.is_empty() && plan.active().count() == 0);
        assert!(plan.build(&[u32::MAX], 1, 3).is_err());
        assert!(plan.build(&[0, 1, 2], 2, 5).is_err());
        assert!(plan.build(&[0], 0, 5).is_err());
        plan.build(&[], 0, 5).unwrap();
        assert!(plan.is_empty());
    }
}
