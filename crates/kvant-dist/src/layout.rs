//! Sharding plans: how `--tp`, `--dp` and `--ep` lay a model out on the
//! ranks, and which heads, columns, vocabulary rows, tokens and experts
//! each rank then holds.
//!
//! Ranks are numbered `rank = d · G + r · T + t` with `G = world / D`
//! ranks per data-parallel group: `d` the data-parallel group (its own
//! requests and KV cache), `t` the position in a tensor-parallel group of
//! `T` ranks (attention heads, FFN columns and vocabulary rows split
//! among them), and `r` a replica of that group when expert parallelism
//! spreads the experts over more ranks than attention uses (`--ep 2`
//! alone on 2 ranks: attention replicated, experts halved). Every rank of
//! a data-parallel group holds the same tokens; with expert parallelism
//! each takes an even share of them into the mixture of experts and the
//! shares are gathered again after it ([`token_share`]).

use std::ops::Range;

/// Why flags cannot be laid out. Every rank checks the same flags and
/// fails the same way at start-up.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum LayoutError {
    #[error("--{flag} must be at least 1")]
    Zero { flag: &'static str },
    #[error("--tp {tp} × --dp {dp} = {} ranks, which does not divide the {world} ranks running", tp * dp)]
    NotDividing { tp: usize, dp: usize, world: usize },
    #[error("--tp {tp} × --dp {dp} uses {} of the {world} ranks running; the rest would only repeat their work (give --ep {world} for a mixture of experts, or run {} ranks)", tp * dp, tp * dp)]
    Idle { tp: usize, dp: usize, world: usize },
    #[error("--ep {ep} on {world} ranks: experts are spread over every rank (--ep {world}) or none (--ep 1)")]
    PartialEp { ep: usize, world: usize },
    #[error("--ep {ep} is larger than the {world} ranks running")]
    EpBeyondRanks { ep: usize, world: usize },
    #[error(
        "running on {world} ranks needs a layout: give --tp, --dp and/or --ep (e.g. --tp {world})"
    )]
    NoLayout { world: usize },
    #[error("--tp {tp} is larger than the model's {heads} attention heads")]
    TooFewHeads { tp: usize, heads: usize },
    #[error("--ep needs a mixture-of-experts model; this one has none")]
    NoExperts,
    #[error("--ep {ep} is larger than the model's {experts} experts per layer")]
    TooFewExperts { ep: usize, experts: usize },
    #[error("the model's {heads} attention heads do not divide into its {kv_heads} KV heads")]
    HeadGroups { heads: usize, kv_heads: usize },
    #[error("expert placement: {0}")]
    Placement(String),
}

/// The parallel degrees of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ranks in all.
    pub world: usize,
    /// Tensor-parallel degree of attention and dense feed-forward layers.
    pub tp: usize,
    /// Data-parallel groups, each with its own requests and KV cache.
    pub dp: usize,
    /// Ranks the routed experts are spread over: 1 or `world`.
    pub ep: usize,
}

/// Where one rank sits in a [`Layout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    pub rank: usize,
    /// Data-parallel group.
    pub dp: usize,
    /// Replica of the tensor-parallel group within the data-parallel group.
    pub replica: usize,
    /// Position in the tensor-parallel group.
    pub tp: usize,
}

/// What [`Layout::check_model`] needs to know of a model.
#[derive(Clone, Copy, Debug)]
pub struct ModelShape {
    pub heads: usize,
    /// KV heads of multi-head attention (latent attention: `None`, its one
    /// latent row per token is computed on every rank).
    pub kv_heads: Option<usize>,
    /// Routed experts per MoE layer, for a mixture of experts.
    pub experts: Option<usize>,
}

impl Layout {
    /// The single-process layout.
    #[cfg(test)]
    const SINGLE: Layout = Layout {
        world: 1,
        tp: 1,
        dp: 1,
        ep: 1,
    };

    /// Checks `--tp`, `--dp` and `--ep` against `world` ranks.
    ///
    /// # Errors
    /// A [`LayoutError`] saying which flag does not fit and what would.
    pub fn new(world: usize, tp: usize, dp: usize, ep: usize) -> Result<Layout, LayoutError> {
        for (flag, v) in [("tp", tp), ("dp", dp), ("ep", ep)] {
            if v == 0 {
                return Err(LayoutError::Zero { flag });
            }
        }
        if world > 1 && tp == 1 && dp == 1 && ep == 1 {
            return Err(LayoutError::NoLayout { world });
        }
        if ep > world {
            return Err(LayoutError::EpBeyondRanks { ep, world });
        }
        if ep != 1 && ep != world {
            return Err(LayoutError::PartialEp { ep, world });
        }
        let attn = tp.saturating_mul(dp);
        if attn > world || !world.is_multiple_of(attn) {
            return Err(LayoutError::NotDividing { tp, dp, world });
        }
        if attn != world && ep == 1 {
            return Err(LayoutError::Idle { tp, dp, world });
        }
        Ok(Layout { world, tp, dp, ep })
    }

    /// Checks the layout against a model's head and expert counts.
    ///
    /// # Errors
    /// A [`LayoutError`] naming the count that is too small.
    pub fn check_model(&self, m: &ModelShape) -> Result<(), LayoutError> {
        if self.tp > m.heads {
            return Err(LayoutError::TooFewHeads {
                tp: self.tp,
                heads: m.heads,
            });
        }
        if let Some(kv) = m.kv_heads {
            if kv == 0 || !m.heads.is_multiple_of(kv) {
                return Err(LayoutError::HeadGroups {
                    heads: m.heads,
                    kv_heads: kv,
                });
            }
        }
        if self.ep > 1 {
            match m.experts {
                None => return Err(LayoutError::NoExperts),
                Some(e) if self.ep > e => {
                    return Err(LayoutError::TooFewExperts {
                        ep: self.ep,
                        experts: e,
                    })
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Whether anything is split or spread (more than one rank).
    pub fn is_parallel(&self) -> bool {
        self.world > 1
    }

    /// Ranks of one data-parallel group (they hold the same tokens).
    pub fn group_size(&self) -> usize {
        self.world / self.dp
    }

    /// Copies of each tensor-parallel group within a data-parallel group.
    pub fn replicas(&self) -> usize {
        self.group_size() / self.tp
    }

    /// Whether the routed experts are spread over the ranks.
    pub fn expert_parallel(&self) -> bool {
        self.ep > 1
    }

    pub fn coords(&self, rank: usize) -> Coords {
        let g = self.group_size();
        Coords {
            rank,
            dp: rank / g,
            replica: (rank % g) / self.tp,
            tp: rank % self.tp,
        }
    }

    /// The first rank of data-parallel group `d`: the one that reports its
    /// results.
    pub fn group_leader(&self, d: usize) -> usize {
        d * self.group_size()
    }

    /// Whether `rank` sends its tensor-parallel shard of the output head
    /// (replicas hold the same values and stay silent).
    pub fn reports_logits(&self, rank: usize) -> bool {
        self.coords(rank).replica == 0
    }
}

/// Part `i` of `n` items cut into `parts` contiguous ranges as evenly as
/// possible (the first `n % parts` one item longer).
pub fn split_even(n: usize, parts: usize, i: usize) -> Range<usize> {
    let parts = parts.max(1);
    let (base, extra) = (n / parts, n % parts);
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    start.min(n)..(start + len).min(n)
}

/// [`split_even`] in whole `unit`s (a quantization block, so that a
/// block never straddles two ranks); the last unit may be partial when
/// `n` is not a multiple of it.
pub fn split_units(n: usize, unit: usize, parts: usize, i: usize) -> Range<usize> {
    let unit = unit.max(1);
    let r = split_even(n.div_ceil(unit), parts, i);
    (r.start * unit).min(n)..(r.end * unit).min(n)
}

/// The attention heads of tensor-parallel rank `t` of `parts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeadShard {
    /// Query heads.
    pub q: Range<usize>,
    /// KV heads their queries read (replicated on several ranks when
    /// there are fewer KV heads than ranks).
    pub kv: Range<usize>,
}

/// Splits `heads` query heads in groups over `kv_heads` KV heads (GQA;
/// `heads % kv_heads == 0`, see [`Layout::check_model`]) across `parts`
/// ranks. With at least as many KV heads as ranks the KV heads are split
/// as evenly as possible and each takes its query group (9 query and 3 KV
/// heads on 2 ranks: 6 + 3 and 2 + 1). With fewer, each KV head is
/// replicated on an even share of the ranks and its query group split
/// among them, so every rank attends with one KV head (MQA on 2 ranks:
/// the KV head on both, half the queries each).
pub fn head_shard(heads: usize, kv_heads: usize, parts: usize, t: usize) -> HeadShard {
    let kv_heads = kv_heads.max(1);
    let group = heads / kv_heads;
    if kv_heads >= parts {
        let kv = split_even(kv_heads, parts, t);
        return HeadShard {
            q: kv.start * group..kv.end * group,
            kv,
        };
    }
    // Which KV head serves rank t, and t's place among its ranks.
    let j = (0..kv_heads)
        .find(|&j| split_even(parts, kv_heads, j).contains(&t))
        .unwrap_or(kv_heads - 1);
    let ranks = split_even(parts, kv_heads, j);
    let q = split_even(group, ranks.len(), t - ranks.start);
    HeadShard {
        q: j * group + q.start..j * group + q.end,
        kv: j..j + 1,
    }
}

/// The rows of a data-parallel group's `n` tokens that rank `index` of its
/// `group` ranks routes through the mixture of experts under expert
/// parallelism.
pub fn token_share(n: usize, group: usize, index: usize) -> Range<usize> {
    split_even(n, group, index)
}

/// Where each routed expert of a layer lives: physical slots on ranks,
/// each holding one logical expert's weights; hot experts may have
/// several replicas (EPLB). Any replica computes the same bits, so the
/// placement never changes an output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Per rank, the logical expert of each of its slots, ascending.
    slots: Vec<Vec<u32>>,
    /// Per logical expert, its replicas as (rank, slot), ascending.
    replicas: Vec<Vec<(u32, u32)>>,
}

impl Placement {
    /// Expert `e` on the rank whose [`split_even`] share of the experts
    /// holds it: no redundancy.
    ///
    /// # Errors
    /// [`LayoutError::Placement`] for no experts or no ranks.
    pub fn contiguous(experts: usize, ranks: usize) -> Result<Placement, LayoutError> {
        let slots = (0..ranks)
            .map(|r| split_even(experts, ranks, r).map(|e| e as u32).collect())
            .collect();
        Placement::from_slots(experts, slots)
    }

    /// EPLB (DeepSeek's greedy policy): `redundant` extra replicas go one
    /// by one to the expert with the highest load per replica, then the
    /// replicas, heaviest first, to the least loaded rank that still has
    /// a free slot (and no replica of the same expert, while one such
    /// rank has room); every rank holds at most
    /// `⌈(experts + redundant) / ranks⌉` slots. Ties go to the lower
    /// expert id and the lower rank, so every rank computes the same
    /// placement from the same loads.
    ///
    /// # Errors
    /// [`LayoutError::Placement`] for no experts, no ranks, or more
    /// replicas than ranks could ever use.
    pub fn balanced(
        loads: &[u64],
        ranks: usize,
        redundant: usize,
    ) -> Result<Placement, LayoutError> {
        let n = loads.len();
        if n == 0 || ranks == 0 {
            return Err(LayoutError::Placement(format!(
                "{n} experts on {ranks} ranks"
            )));
        }
        let mut count = vec![1usize; n];
        for _ in 0..redundant {
            // Highest load per replica; an expert already on every rank
            // cannot usefully take another.
            let best = (0..n)
                .filter(|&e| count[e] < ranks)
                .max_by(|&a, &b| {
                    let (la, lb) = (
                        loads[a] as f64 / count[a] as f64,
                        loads[b] as f64 / count[b] as f64,
                    );
                    la.total_cmp(&lb).then(b.cmp(&a))
                })
                .ok_or_else(|| {
                    LayoutError::Placement(format!(
                        "{redundant} redundant replicas of {n} experts on {ranks} ranks"
                    ))
                })?;
            count[best] += 1;
        }
        let physical = n + redundant;
        let capacity = physical.div_ceil(ranks);
        let mut items: Vec<(f64, usize)> = (0..n)
            .flat_map(|e| std::iter::repeat_n((loads[e] as f64 / count[e] as f64, e), count[e]))
            .collect();
        items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut weight = vec![0f64; ranks];
        let mut slots: Vec<Vec<u32>> = vec![Vec::new(); ranks];
        for (w, e) in items {
            let pick = |avoid_dup: bool| {
                (0..ranks)
                    .filter(|&r| slots[r].len() < capacity)
                    .filter(|&r| !avoid_dup || !slots[r].contains(&(e as u32)))
                    .min_by(|&a, &b| weight[a].total_cmp(&weight[b]).then(a.cmp(&b)))
            };
            let r = pick(true)
                .or_else(|| pick(false))
                .ok_or_else(|| LayoutError::Placement("no rank has a free slot".into()))?;
            slots[r].push(e as u32);
            weight[r] += w;
        }
        for s in &mut slots {
            s.sort_unstable();
        }
        Placement::from_slots(n, slots)
    }

    fn from_slots(experts: usize, slots: Vec<Vec<u32>>) -> Result<Placement, LayoutError> {
        if experts == 0 || slots.is_empty() {
            return Err(LayoutError::Placement(format!(
                "{experts} experts on {} ranks",
                slots.len()
            )));
        }
        let mut replicas = vec![Vec::new(); experts];
        for (r, s) in slots.iter().enumerate() {
            for (i, &e) in s.iter().enumerate() {
                let list = replicas
                    .get_mut(e as usize)
                    .ok_or_else(|| LayoutError::Placement(format!("expert {e} of {experts}")))?;
                list.push((r as u32, i as u32));
            }
        }
        if let Some(e) = replicas.iter().position(Vec::is_empty) {
            return Err(LayoutError::Placement(format!("expert {e} is on no rank")));
        }
        Ok(Placement { slots, replicas })
    }

    pub fn ranks(&self) -> usize {
        self.slots.len()
    }

    pub fn experts(&self) -> usize {
        self.replicas.len()
    }

    /// The logical experts of rank `r`'s slots, ascending.
    pub fn on_rank(&self, r: usize) -> &[u32] {
        self.slots.get(r).map_or(&[], Vec::as_slice)
    }

    /// The replicas of logical expert `e` as (rank, slot).
    pub fn replicas(&self, e: usize) -> &[(u32, u32)] {
        self.replicas.get(e).map_or(&[], Vec::as_slice)
    }

    /// Physical slots in all (experts plus redundant replicas).
    pub fn physical(&self) -> usize {
        self.slots.iter().map(Vec::len).sum()
    }

    /// The replica that computes expert `e` for a token of rank `home`:
    /// one on `home` itself if there is one (no traffic), else the
    /// `salt`-th (a token's index, so that a hot expert's tokens spread
    /// over its replicas). `e` must be an expert of the placement.
    pub fn route(&self, e: usize, home: usize, salt: usize) -> (usize, usize) {
        let reps = self.replicas(e);
        let &(r, s) = reps
            .iter()
            .find(|&&(r, _)| r as usize == home)
            .unwrap_or(&reps[salt % reps.len().max(1)]);
        (r as usize, s as usize)
    }

    /// The heaviest rank's load over the mean, for `loads` routed by
    /// this placement with each expert's load spread evenly over its
    /// replicas (1.0 is perfect balance): what the tests measure a
    /// re-placement by.
    #[cfg(test)]
    fn imbalance(&self, loads: &[u64]) -> f64 {
        let per_rank: Vec<f64> = self
            .slots
            .iter()
            .map(|s| {
                s.iter()
                    .map(|&e| loads[e as usize] as f64 / self.replicas(e as usize).len() as f64)
                    .sum()
            })
            .collect();
        let mean = per_rank.iter().sum::<f64>() / per_rank.len() as f64;
        let max = per_rank.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 {
            max / mean
        } else {
            1.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_splits_cover_everything_once() {
        for n in 0..40 {
            for parts in 1..7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split_even(n, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == n / parts || r.len() == n / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, n);
                for unit in [1, 32, 256] {
                    let mut next = 0;
                    for i in 0..parts {
                        let r = split_units(n, unit, parts, i);
                        assert_eq!(r.start, next);
                        assert!(r.start.is_multiple_of(unit) || r.is_empty());
                        next = r.end;
                    }
                    assert_eq!(next, n);
                }
            }
        }
        assert_eq!(split_units(1536, 32, 2, 1), 768..1536);
        assert_eq!(split_units(48, 32, 2, 0), 0..32);
        assert_eq!(split_units(48, 32, 2, 1), 32..48);
    }

    #[test]
    fn heads_follow_kv_groups() {
        // SmolLM2-135M: 9 query heads, 3 KV heads.
        assert_eq!(head_shard(9, 3, 2, 0), HeadShard { q: 0..6, kv: 0..2 });
        assert_eq!(head_shard(9, 3, 2, 1), HeadShard { q: 6..9, kv: 2..3 });
        // MQA (Gemma 3 270M: 4 query heads, 1 KV head): replicated KV.
        assert_eq!(head_shard(4, 1, 2, 0), HeadShard { q: 0..2, kv: 0..1 });
        assert_eq!(head_shard(4, 1, 2, 1), HeadShard { q: 2..4, kv: 0..1 });
        // 3 KV heads on 4 ranks: KV head 0 on ranks 0 and 1.
        assert_eq!(head_shard(9, 3, 4, 0), HeadShard { q: 0..2, kv: 0..1 });
        assert_eq!(head_shard(9, 3, 4, 1), HeadShard { q: 2..3, kv: 0..1 });
        assert_eq!(head_shard(9, 3, 4, 3), HeadShard { q: 6..9, kv: 2..3 });
        // Every query head on exactly one rank, each with its own KV head.
        for (heads, kv) in [(9, 3), (8, 2), (4, 1), (12, 4), (6, 6), (16, 8)] {
            for parts in 1..=heads {
                let mut seen = vec![0; heads];
                for t in 0..parts {
                    let s = head_shard(heads, kv, parts, t);
                    assert!(
                        !s.q.is_empty(),
                        "{heads}/{kv} on {parts}: rank {t} has no heads"
                    );
                    for q in s.q.clone() {
                        seen[q] += 1;
                        assert!(s.kv.contains(&(q / (heads / kv))));
                    }
                    // One group size per rank: the kernel's GQA mapping holds.
                    assert_eq!(s.q.len() % s.kv.len(), 0);
                    let g = s.q.len() / s.kv.len();
                    for (i, q) in s.q.clone().enumerate() {
                        assert_eq!(s.kv.start + i / g, q / (heads / kv));
                    }
                }
                assert!(seen.iter().all(|&c| c == 1));
            }
        }
    }

    #[test]
    fn layouts_that_do_not_fit_are_refused() {
        assert_eq!(Layout::new(1, 1, 1, 1), Ok(Layout::SINGLE));
        assert!(Layout::new(2, 2, 1, 1).is_ok());
        assert!(Layout::new(2, 1, 2, 1).is_ok());
        assert!(Layout::new(2, 1, 1, 2).is_ok());
        assert!(Layout::new(2, 1, 2, 2).is_ok());
        assert!(Layout::new(4, 2, 2, 4).is_ok());
        assert!(Layout::new(4, 2, 1, 4).is_ok());
        assert_eq!(
            Layout::new(2, 3, 1, 1),
            Err(LayoutError::NotDividing {
                tp: 3,
                dp: 1,
                world: 2
            })
        );
        assert_eq!(
            Layout::new(2, 1, 1, 3),
            Err(LayoutError::EpBeyondRanks { ep: 3, world: 2 })
        );
        assert_eq!(
            Layout::new(2, 1, 1, 1),
            Err(LayoutError::NoLayout { world: 2 })
        );
        assert_eq!(
            Layout::new(4, 2, 1, 1),
            Err(LayoutError::Idle {
                tp: 2,
                dp: 1,
                world: 4
            })
        );
        assert_eq!(
            Layout::new(4, 1, 4, 2),
            Err(LayoutError::PartialEp { ep: 2, world: 4 })
        );
        assert_eq!(
            Layout::new(2, 0, 1, 1),
            Err(LayoutError::Zero { flag: "tp" })
        );
        let l = Layout::new(2, 1, 1, 2).unwrap();
        let dense = ModelShape {
            heads: 9,
            kv_heads: Some(3),
            experts: None,
        };
        assert_eq!(l.check_model(&dense), Err(LayoutError::NoExperts));
        let moe = ModelShape {
            experts: Some(1),
            ..dense
        };
        assert_eq!(
            l.check_model(&moe),
            Err(LayoutError::TooFewExperts { ep: 2, experts: 1 })
        );
        let tp = Layout::new(16, 16, 1, 1).unwrap();
        assert_eq!(
            tp.check_model(&dense),
            Err(LayoutError::TooFewHeads { tp: 16, heads: 9 })
        );
    }

    #[test]
    fn coordinates() {
        let l = Layout::new(8, 2, 2, 8).unwrap();
        assert_eq!((l.group_size(), l.replicas()), (4, 2));
        assert_eq!(
            l.coords(5),
            Coords {
                rank: 5,
                dp: 1,
                replica: 0,
                tp: 1
            }
        );
        assert_eq!(l.coords(6).replica, 1);
        assert!(l.reports_logits(5) && !l.reports_logits(6));
        assert_eq!(l.group_leader(1), 4);
    }

    #[test]
    fn placements() {
        let p = Placement::contiguous(9, 2).unwrap();
        assert_eq!(p.on_rank(0), &[0, 1, 2, 3, 4]);
        assert_eq!(p.on_rank(1), &[5, 6, 7, 8]);
        assert_eq!(p.route(6, 0, 3), (1, 1));
        assert_eq!(p.physical(), 9);
        // One hot expert: its replica goes to the other rank, and the
        // rest pack so the loads even out.
        let loads = [100, 10, 10, 10, 10, 10, 10, 10];
        let b = Placement::balanced(&loads, 2, 2).unwrap();
        assert_eq!(b.physical(), 10);
        assert_eq!(b.replicas(0).len(), 2);
        assert_ne!(b.replicas(0)[0].0, b.replicas(0)[1].0);
        assert!(b.imbalance(&loads) < Placement::contiguous(8, 2).unwrap().imbalance(&loads));
        for r in 0..2 {
            assert!(b.on_rank(r).len() <= 5);
        }
        // A token of rank 1 uses the replica on rank 1.
        assert_eq!(b.route(0, 1, 0).0, 1);
        for e in 0..8 {
            assert!(!b.replicas(e).is_empty());
        }
        assert!(Placement::balanced(&[], 2, 0).is_err());
        assert!(Placement::balanced(&[1, 1], 2, 3).is_err());
        // The same loads give the same placement.
        assert_eq!(b, Placement::balanced(&loads, 2, 2).unwrap());
    }
}
