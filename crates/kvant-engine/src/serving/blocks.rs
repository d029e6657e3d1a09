//! The KV block manager: which blocks of the pool are free, which are
//! shared, and which full blocks can be found again by their tokens
//! (prefix caching).
//!
//! A full block is cached under the exact key (content id of the block
//! before it, its tokens), so a lookup can never return someone else's
//! keys and values: there is no hash to collide. Content ids are never
//! reused, so a key stays valid after its parent block is evicted (it just
//! cannot be reached any more). Blocks no sequence references stay cached
//! in the free list, least recently released first, and are evicted only
//! when allocation reaches them. Only full blocks are shared, and a
//! sequence only writes into blocks it allocated and has not yet filled, so
//! a shared block is never written.

use std::collections::HashMap;

const NIL: u32 = u32::MAX;

/// Content id of "no previous block" (the start of a sequence).
pub(super) const ROOT: u64 = 0;

/// Free and cached blocks, with reference counts.
pub(super) struct BlockManager {
    block_size: usize,
    refs: Vec<u32>,
    /// Cache entry of each block, if it holds a registered full block.
    entry: Vec<Option<(u64, Key)>>,
    cached: HashMap<Key, u32>,
    next_cid: u64,
    /// The free list, a doubly linked list over block ids: blocks with no
    /// reference, least recently released at the head.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    free: usize,
    prefix_caching: bool,
}

/// (content id of the previous block, this block's tokens).
type Key = (u64, Box<[u32]>);

impl BlockManager {
    pub fn new(n_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        let mut m = BlockManager {
            block_size,
            refs: vec![0; n_blocks],
            entry: vec![None; n_blocks],
            cached: HashMap::new(),
            next_cid: ROOT + 1,
            prev: vec![NIL; n_blocks],
            next: vec![NIL; n_blocks],
            head: NIL,
            tail: NIL,
            free: 0,
            prefix_caching,
        };
        for b in 0..n_blocks as u32 {
            m.push_back(b);
        }
        m
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks with no reference (some may still hold cached prefixes).
    pub fn free(&self) -> usize {
        self.free
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether full blocks are cached for reuse (prefix caching is on).
    pub fn caches(&self) -> bool {
        self.prefix_caching
    }

    /// The cached blocks (and their content ids) holding the longest prefix
    /// of `tokens` made of full blocks, leaving at least one token
    /// uncomputed (its logits are needed). Takes no reference.
    pub fn lookup(&self, tokens: &[u32]) -> Vec<(u32, u64)> {
        let mut found = Vec::new();
        if !self.prefix_caching {
            return found;
        }
        let usable = tokens.len().saturating_sub(1) / self.block_size;
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(self.block_size).take(usable) {
            let key = (parent, chunk.into());
            let Some(&b) = self.cached.get(&key) else {
                break;
            };
            let cid = match &self.entry[b as usize] {
                Some((cid, _)) => *cid,
                None => break,
            };
            found.push((b, cid));
            parent = cid;
        }
        found
    }

    /// Takes a reference to `b` (a lookup result), out of the free list if
    /// it was there.
    pub fn acquire(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.unlink(b);
        }
        self.refs[i] += 1;
    }

    /// A block for a sequence to write into, evicting the least recently
    /// released cached block if need be; `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        if let Some((_, key)) = self.entry[b as usize].take() {
            self.cached.remove(&key);
        }
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Drops a reference; an unreferenced block joins the free list's
    /// recent end, keeping its cached content until evicted.
    pub fn release(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.refs[i] > 0, "block {b} released twice");
        self.refs[i] = self.refs[i].saturating_sub(1);
        if self.refs[i] == 0 {
            self.push_back(b);
        }
    }

    /// Records that block `b` now holds `tokens` (a full block) after the
    /// block with content id `parent`; returns `b`'s content id, for the
    /// next block's key. If the same content is already cached elsewhere,
    /// `b` stays private and the existing block's id is returned, so
    /// later lookups keep finding one chain.
    pub fn register(&mut self, b: u32, parent: u64, tokens: &[u32]) -> u64 {
        if !self.prefix_caching {
            return ROOT;
        }
        if let Some((cid, _)) = &self.entry[b as usize] {
            return *cid;
        }
        let key: Key = (parent, tokens.into());
        if let Some(&other) = self.cached.get(&key) {
            if let Some((cid, _)) = &self.entry[other as usize] {
                return *cid;
            }
        }
        let cid = self.next_cid;
        self.next_cid += 1;
        self.cached.insert(key.clone(), b);
        self.entry[b as usize] = Some((cid, key));
        cid
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.free -= 1;
    }

    fn push_back(&mut self, b: u32) {
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates and registers the full blocks of `tokens`, as a sequence
    /// that computed them would; returns the blocks.
    fn fill(m: &mut BlockManager, tokens: &[u32]) -> Vec<u32> {
        let mut parent = ROOT;
        let mut blocks = Vec::new();
        for chunk in tokens.chunks(m.block_size()) {
            let b = m.allocate().expect("a free block");
            if chunk.len() == m.block_size() {
                parent = m.register(b, parent, chunk);
            }
            blocks.push(b);
        }
        blocks
    }

    #[test]
    fn finds_shared_prefixes_and_leaves_the_last_token() {
        let mut m = BlockManager::new(8, 4, true);
        let a: Vec<u32> = (0..10).collect();
        let blocks = fill(&mut m, &a);
        assert_eq!(m.free(), 5);
        // Same first 8 tokens, different after: two blocks found.
        let mut b = a[..8].to_vec();
        b.extend([99, 98]);
        let hit: Vec<u32> = m.lookup(&b).iter().map(|h| h.0).collect();
        assert_eq!(hit, blocks[..2]);
        // A prompt of exactly 8 cached tokens reuses only the first block:
        // its last token must be computed again, in a block of its own.
        assert_eq!(m.lookup(&a[..8]).len(), 1);
        // A different first block shares nothing, even if later blocks match.
        let mut c = a.clone();
        c[0] = 77;
        assert!(m.lookup(&c).is_empty());
    }

    #[test]
    fn released_blocks_stay_cached_until_evicted_lru_first() {
        let mut m = BlockManager::new(3, 2, true);
        let x = fill(&mut m, &[1, 2, 3, 4]);
        let y = fill(&mut m, &[5, 6]);
        for &b in x.iter().chain(&y) {
            m.release(b);
        }
        assert_eq!(m.free(), 3);
        assert_eq!(m.lookup(&[1, 2, 3, 4, 0]).len(), 2);
        // Reusing [1,2] takes it off the free list; allocation then evicts
        // the least recently released block ([3,4] was released before [5,6]).
        let hit = m.lookup(&[1, 2, 9]);
        m.acquire(hit[0].0);
        assert_eq!(m.allocate(), Some(x[1]));
        assert_eq!(m.lookup(&[1, 2, 3, 4, 0]).len(), 1);
        assert_eq!(m.lookup(&[5, 6, 0]).len(), 1);
        assert_eq!(m.allocate(), Some(y[0]));
        assert!(m.lookup(&[5, 6, 0]).is_empty());
        assert_eq!(m.allocate(), None);
    }

    #[test]
    fn an_evicted_parent_invalidates_its_children() {
        let mut m = BlockManager::new(2, 2, true);
        let x = fill(&mut m, &[1, 2, 3, 4]);
        m.release(x[0]);
        m.release(x[1]);
        // Evict the parent [1,2] and reuse its id for [7,8].
        let b = m.allocate().unwrap();
        assert_eq!(b, x[0]);
        let cid = m.register(b, ROOT, &[7, 8]);
        assert_ne!(cid, ROOT);
        // [3,4] is still cached under the old parent's content id, which
        // nothing can reach: a prompt [7,8,3,4,..] must not find it.
        assert_eq!(m.lookup(&[7, 8, 3, 4, 0]).len(), 1);
    }

    #[test]
    fn disabled_caching_never_shares() {
        let mut m = BlockManager::new(4, 2, false);
        fill(&mut m, &[1, 2, 3, 4]);
        assert!(m.lookup(&[1, 2, 3, 4, 5]).is_empty());
    }
}
