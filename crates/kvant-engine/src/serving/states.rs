//! Who holds which recurrent-state slot: models with linear-attention
//! layers keep a fixed-size state per sequence (see `kvant_model::kv`)
//! besides its KV blocks.
//!
//! The pool has `running + snapshots` slots. A running sequence holds one
//! of the first `running` from admission to its end or preemption; as
//! there are as many as sequences may run, admission never waits for one.
//! The others hold snapshots for prefix caching: a state cannot be rebuilt
//! from cached KV blocks, so a block of a hybrid model's prefix is only
//! worth reusing where the state at its end was kept. When a step ends a
//! sequence at a block boundary whose block is registered in the prefix
//! cache, the engine copies its state into a snapshot slot keyed by that
//! block's content id (content ids are never reused, so a key can go stale
//! but never wrong); a later prompt with the same prefix restores the
//! deepest snapshot its cached blocks reach and recomputes from there.
//! Snapshots are evicted least recently used first.

use std::collections::{HashMap, VecDeque};

pub(super) struct StateSlots {
    /// Free slots for running sequences.
    free: Vec<usize>,
    /// Snapshot slots: by content id, and the ids from least to most
    /// recently used.
    snaps: HashMap<u64, usize>,
    lru: VecDeque<u64>,
    free_snaps: Vec<usize>,
}

impl StateSlots {
    /// Slots `0..running` for sequences, `running..running + snapshots`
    /// for snapshots.
    pub fn new(running: usize, snapshots: usize) -> Self {
        StateSlots {
            free: (0..running).rev().collect(),
            snaps: HashMap::new(),
            lru: VecDeque::new(),
            free_snaps: (running..running + snapshots).rev().collect(),
        }
    }

    /// A slot for a sequence (`None` only if more sequences run than the
    /// engine admits, a bug).
    pub fn take(&mut self) -> Option<usize> {
        self.free.pop()
    }

    pub fn give_back(&mut self, slot: usize) {
        debug_assert!(!self.free.contains(&slot));
        self.free.push(slot);
    }

    /// The snapshot at the end of the block with content id `cid`, if
    /// kept (and marks it used).
    pub fn snapshot(&mut self, cid: u64) -> Option<usize> {
        let slot = *self.snaps.get(&cid)?;
        self.touch(cid);
        Some(slot)
    }

    pub fn has_snapshot(&self, cid: u64) -> bool {
        self.snaps.contains_key(&cid)
    }

    /// A slot to keep the snapshot for `cid` in (evicting the least
    /// recently used one if none is free), or `None` when there is one
    /// already or no snapshot slots at all.
    pub fn keep(&mut self, cid: u64) -> Option<usize> {
        if self.snaps.contains_key(&cid) {
            self.touch(cid);
            return None;
        }
        let slot = match self.free_snaps.pop() {
            Some(s) => s,
            None => {
                let old = self.lru.pop_front()?;
                self.snaps.remove(&old)?
            }
        };
        self.snaps.insert(cid, slot);
        self.lru.push_back(cid);
        Some(slot)
    }

    fn touch(&mut self, cid: u64) {
        if let Some(i) = self.lru.iter().position(|&c| c == cid) {
            self.lru.remove(i);
            self.lru.push_back(cid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_snapshots_do_not_overlap_and_evict_lru() {
        let mut s = StateSlots::new(2, 2);
        let (a, b) = (s.take().unwrap(), s.take().unwrap());
        assert_eq!((a, b), (0, 1));
        assert_eq!(s.take(), None);
        s.give_back(a);
        assert_eq!(s.take(), Some(0));
        let x = s.keep(10).unwrap();
        let y = s.keep(11).unwrap();
        assert!(x >= 2 && y >= 2 && x != y);
        assert_eq!(s.keep(10), None, "already kept");
        // 11 is now the least recently used: a third evicts it.
        let z = s.keep(12).unwrap();
        assert_eq!(z, y);
        assert!(!s.has_snapshot(11) && s.has_snapshot(10) && s.has_snapshot(12));
        assert_eq!(s.snapshot(10), Some(x));
        assert_eq!(StateSlots::new(1, 0).keep(3), None);
    }
}
