//! One request inside the serving engine: its tokens, how many of them
//! have keys and values in the pool, its block table, and its
//! continuation (sampling, detokenization, where it ends).

use super::blocks::{BlockManager, ROOT};
use super::embedding::Pooled;
use super::request::{Event, EventSink, RequestId};
use super::shared::InFlight;
use crate::continuation::Continuation;
use crate::speculative::MtpState;
use std::time::Instant;

pub(super) struct Sequence<'t> {
    pub id: RequestId,
    /// The prompt, then the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Leading tokens whose keys and values are in the pool.
    pub computed: usize,
    /// Block table: position `j` lives in `blocks[j / block_size]`.
    pub blocks: Vec<u32>,
    /// Content ids of the leading blocks registered in the prefix cache.
    pub cids: Vec<u64>,
    /// Prompt tokens found in the prefix cache when first admitted.
    pub cached_tokens: Option<usize>,
    pub cont: Continuation<'t>,
    pub sink: EventSink,
    /// The sink has had its last event, or its client is gone.
    pub closed: bool,
    pub arrived: Instant,
    pub last_token: Option<Instant>,
    /// Its place in the MTP module's cache (models that carry one).
    pub mtp: Option<MtpState>,
    /// The module's guess at the token after the last sampled one, to be
    /// verified in the next pass together with it.
    pub draft: Option<u32>,
    /// Models that keep a state per sequence: the sequence's state slot
    /// while it runs, and at admission the content id of the cached block
    /// whose state snapshot it starts from.
    pub state: Option<usize>,
    /// The data-parallel group whose slot `state` is.
    pub state_group: usize,
    pub restore: Option<u64>,
    /// Its place among the accepted requests, given back before the last
    /// event is sent (a client that saw it may submit at once), or when
    /// the sequence is dropped.
    pub in_flight: Option<InFlight>,
    /// An embedding request: its prompt's pooling so far. It samples
    /// nothing, ends when its prompt has run, and never starts from the
    /// prefix cache (cached positions would give no hidden states).
    pub embed: Option<Pooled>,
}

impl Sequence<'_> {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next sample.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Tokens the next pass would take: with a draft, the sampled token
    /// and the draft.
    pub fn wanted(&self) -> usize {
        self.remaining() + usize::from(self.draft.is_some())
    }

    /// Sets how many leading tokens have keys in the pool (0 after a
    /// preemption, the prefix-cache hit at admission); the MTP module
    /// takes over from there (module inputs of shared blocks come with
    /// them). A model with a state per sequence (DeepSeek-V4) restores its
    /// module's window from the snapshot, which the module filled as far
    /// as it had drafted then: drafts after such a hit may guess worse,
    /// and are verified like any other.
    pub fn restart_at(&mut self, computed: usize) {
        self.computed = computed;
        self.draft = None;
        if let Some(e) = &mut self.embed {
            e.reset();
        }
        if let Some(m) = &mut self.mtp {
            *m = MtpState::starting_at(computed);
        }
    }

    /// Drops every block reference (finish, abort or preemption); the
    /// sequence would start over from its tokens.
    pub fn release_blocks(&mut self, bm: &mut BlockManager) {
        for &b in &self.blocks {
            bm.release(b);
        }
        self.blocks.clear();
        self.cids.clear();
        self.restart_at(0);
    }

    /// Sends the request's last event, a failure with `msg` (unless its
    /// client is gone or it already had its last event).
    pub fn fail(&mut self, msg: &str) {
        self.in_flight = None;
        if !self.closed {
            (self.sink)(Event::Failed(msg.to_string()));
            self.closed = true;
        }
    }

    /// Offers every newly filled block to the prefix cache.
    pub fn register_full_blocks(&mut self, bm: &mut BlockManager) {
        let bs = bm.block_size();
        while self.cids.len() < self.blocks.len() && (self.cids.len() + 1) * bs <= self.computed {
            let i = self.cids.len();
            let parent = self.cids.last().copied().unwrap_or(ROOT);
            let cid = bm.register(self.blocks[i], parent, &self.tokens[i * bs..(i + 1) * bs]);
            self.cids.push(cid);
        }
    }
}
