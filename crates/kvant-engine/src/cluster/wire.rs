//! The messages rank 0 broadcasts to the other ranks of a parallel run,
//! as `u32` words: every rank decodes the same plan and so computes the
//! same batch shapes, counts and block tables.

use kvant_model::arch::decoder::{Logits, SeqStep};

/// How rank 0 wants a sequence's logits rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// No rows (a prompt chunk that does not end its prompt).
    None,
    /// The last token's row, in full (sampling).
    Last,
    /// The last token's argmax only: each rank reduces its vocabulary
    /// slice to one (value, id) pair, so no logits row crosses the ranks.
    LastArgmax,
    /// Every token's row, in full (perplexity).
    All,
    /// No logits: every token's hidden state after the final norm, from
    /// the group's first rank (an embedding's prompt).
    Hidden,
}

impl Want {
    fn code(self) -> u32 {
        match self {
            Want::None => 0,
            Want::Last => 1,
            Want::LastArgmax => 2,
            Want::All => 3,
            Want::Hidden => 4,
        }
    }

    fn from_code(c: u32) -> Option<Want> {
        [
            Want::None,
            Want::Last,
            Want::LastArgmax,
            Want::All,
            Want::Hidden,
        ]
        .into_iter()
        .find(|w| w.code() == c)
    }

    /// What the model computes for it.
    pub fn logits(self) -> Logits {
        match self {
            Want::None => Logits::None,
            Want::Last | Want::LastArgmax => Logits::Last,
            Want::All => Logits::All,
            Want::Hidden => Logits::Hidden,
        }
    }

    /// Logits rows of a sequence of `tokens` tokens.
    pub fn rows(self, tokens: usize) -> usize {
        self.logits().rows(tokens)
    }
}

/// One sequence's part of a step, owned (as decoded by a worker).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqPlan {
    pub tokens: Vec<u32>,
    pub pos0: usize,
    pub table: Vec<u32>,
    pub want: Want,
    /// Its state slot (models that keep a state per sequence).
    pub state: usize,
}

impl SeqPlan {
    pub fn step(&self) -> SeqStep<'_> {
        SeqStep {
            tokens: &self.tokens,
            pos0: self.pos0,
            table: &self.table,
            logits: self.want.logits(),
            state: self.state,
        }
    }
}

/// What rank 0 tells the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Nothing to do: proves rank 0 is alive while it is idle.
    Heartbeat,
    /// Stop serving steps.
    Shutdown,
    /// Make a new KV pool of `n_blocks` blocks of `block_size` tokens and
    /// `slots` state slots (replacing any earlier one).
    Pool {
        block_size: usize,
        n_blocks: usize,
        slots: usize,
    },
    /// Copy state slot `from` to `to` in data-parallel group `group`'s
    /// pools (a prefix-cache snapshot kept or restored, a session's saved
    /// state), as rank 0 did in its own.
    CopyState {
        group: usize,
        from: usize,
        to: usize,
    },
    /// One forward pass: per data-parallel group, its sequences; with
    /// two-batch overlap or not.
    Step {
        overlap: bool,
        groups: Vec<Vec<SeqPlan>>,
    },
    /// Re-place every MoE layer's experts from the loads observed so far,
    /// with `redundant` extra replicas per layer.
    Rebalance { redundant: usize },
}

/// Why a message could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed step message: {0}")]
pub struct WireError(&'static str);

const HEARTBEAT: u32 = 0;
const SHUTDOWN: u32 = 1;
const POOL: u32 = 2;
const STEP: u32 = 3;
const REBALANCE: u32 = 4;
const COPY_STATE: u32 = 5;

/// Encodes a step without copying it into [`SeqPlan`]s first.
pub fn encode_step(
    overlap: bool,
    groups: &[Vec<(SeqStep<'_>, Want)>],
) -> Result<Vec<u32>, WireError> {
    let word = |n: usize| u32::try_from(n).map_err(|_| WireError("a count beyond u32"));
    let mut w = vec![STEP, u32::from(overlap), word(groups.len())?];
    for g in groups {
        w.push(word(g.len())?);
        for (s, want) in g {
            w.extend([want.code(), word(s.state)?, word(s.pos0)?]);
            w.push(word(s.tokens.len())?);
            w.extend_from_slice(s.tokens);
            w.push(word(s.table.len())?);
            w.extend_from_slice(s.table);
        }
    }
    Ok(w)
}

impl Msg {
    pub fn encode(&self) -> Result<Vec<u32>, WireError> {
        let word = |n: usize| u32::try_from(n).map_err(|_| WireError("a count beyond u32"));
        Ok(match self {
            Msg::Heartbeat => vec![HEARTBEAT],
            Msg::Shutdown => vec![SHUTDOWN],
            Msg::Pool {
                block_size,
                n_blocks,
                slots,
            } => vec![POOL, word(*block_size)?, word(*n_blocks)?, word(*slots)?],
            Msg::CopyState { group, from, to } => {
                vec![COPY_STATE, word(*group)?, word(*from)?, word(*to)?]
            }
            Msg::Rebalance { redundant } => vec![REBALANCE, word(*redundant)?],
            Msg::Step { overlap, groups } => {
                let steps: Vec<Vec<(SeqStep<'_>, Want)>> = groups
                    .iter()
                    .map(|g| g.iter().map(|s| (s.step(), s.want)).collect())
                    .collect();
                encode_step(*overlap, &steps)?
            }
        })
    }

    pub fn decode(words: &[u32]) -> Result<Msg, WireError> {
        let mut r = Reader { w: words, at: 0 };
        let msg = match r.next()? {
            HEARTBEAT => Msg::Heartbeat,
            SHUTDOWN => Msg::Shutdown,
            POOL => Msg::Pool {
                block_size: r.next()? as usize,
                n_blocks: r.next()? as usize,
                slots: r.next()? as usize,
            },
            COPY_STATE => Msg::CopyState {
                group: r.next()? as usize,
                from: r.next()? as usize,
                to: r.next()? as usize,
            },
            REBALANCE => Msg::Rebalance {
                redundant: r.next()? as usize,
            },
            STEP => {
                let overlap = match r.next()? {
                    0 => false,
                    1 => true,
                    _ => return Err(WireError("an overlap flag that is not 0 or 1")),
                };
                let n_groups = r.next()? as usize;
                let mut groups = Vec::with_capacity(n_groups.min(words.len()));
                for _ in 0..n_groups {
                    let n = r.next()? as usize;
                    let mut seqs = Vec::with_capacity(n.min(words.len()));
                    for _ in 0..n {
                        let want = Want::from_code(r.next()?)
                            .ok_or(WireError("an unknown logits kind"))?;
                        let state = r.next()? as usize;
                        let pos0 = r.next()? as usize;
                        let len = r.next()? as usize;
                        let tokens = r.take(len)?.to_vec();
                        let len = r.next()? as usize;
                        let table = r.take(len)?.to_vec();
                        seqs.push(SeqPlan {
                            tokens,
                            pos0,
                            table,
                            want,
                            state,
                        });
                    }
                    groups.push(seqs);
                }
                Msg::Step { overlap, groups }
            }
            _ => return Err(WireError("an unknown message kind")),
        };
        if r.at != words.len() {
            return Err(WireError("trailing words"));
        }
        Ok(msg)
    }
}

struct Reader<'a> {
    w: &'a [u32],
    at: usize,
}

impl<'a> Reader<'a> {
    fn next(&mut self) -> Result<u32, WireError> {
        let v = *self.w.get(self.at).ok_or(WireError("truncated"))?;
        self.at += 1;
        Ok(v)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u32], WireError> {
        let end = self.at.checked_add(n).ok_or(WireError("truncated"))?;
        let s = self.w.get(self.at..end).ok_or(WireError("truncated"))?;
        self.at = end;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let step = Msg::Step {
            overlap: true,
            groups: vec![
                vec![
                    SeqPlan {
                        tokens: vec![5, 6, 7],
                        pos0: 0,
                        table: vec![3, 4],
                        want: Want::Last,
                        state: 0,
                    },
                    SeqPlan {
                        tokens: vec![9],
                        pos0: 40,
                        table: vec![0, 1, 2],
                        want: Want::LastArgmax,
                        state: 3,
                    },
                ],
                vec![SeqPlan {
                    tokens: vec![1, 2],
                    pos0: 4,
                    table: vec![7],
                    want: Want::Hidden,
                    state: 1,
                }],
                vec![],
            ],
        };
        for m in [
            Msg::Heartbeat,
            Msg::Shutdown,
            Msg::Pool {
                block_size: 16,
                n_blocks: 100,
                slots: 4,
            },
            Msg::CopyState {
                group: 1,
                from: 2,
                to: 0,
            },
            Msg::Rebalance { redundant: 2 },
            step,
        ] {
            assert_eq!(Msg::decode(&m.encode().unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn malformed_messages_are_errors() {
        assert!(Msg::decode(&[]).is_err());
        assert!(Msg::decode(&[99]).is_err());
        assert!(Msg::decode(&[POOL, 16, 4]).is_err());
        assert!(Msg::decode(&[COPY_STATE, 0, 1]).is_err());
        assert!(Msg::decode(&[HEARTBEAT, 0]).is_err());
        assert!(Msg::decode(&[STEP, 0, 1, 1, 1, 0, 0, u32::MAX]).is_err());
        assert!(Msg::decode(&[STEP, 0, 1, 1, 9, 0, 0, 0, 0]).is_err());
        assert!(Msg::decode(&[STEP, 0, u32::MAX]).is_err());
        assert!(Msg::decode(&[STEP, 2, 0]).is_err());
    }
}
