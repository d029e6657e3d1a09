//! Expert parallelism: a MoE layer whose routed experts are spread over
//! the ranks (DeepSeek's and DeepEP's dispatch and combine).
//!
//! Every rank of a data-parallel group holds the group's tokens; each
//! takes an even share of them ([`token_share`]), routes it, and:
//! 1. **dispatch**: exchanges with every rank how many rows and expert
//!    assignments it will send, and how many to each of that rank's
//!    expert slots (one all-to-all of counts), then sends each
//!    token row once per destination rank, with the slots of that rank's
//!    experts it wants (all-to-alls of the slot lists and the rows). When
//!    the experts run on the int8 kernels the rows travel as the 8-bit
//!    blocks those kernels quantize them to anyway (32 values and two
//!    floats per block: 1.25 bytes a value instead of 4), so the experts
//!    see exactly the activations one process gives them;
//! 2. computes its own experts over the rows it received, one assignment
//!    per row and expert, with the fused kernel (`top_k = 1`, weight 1:
//!    each output is the expert's unweighted result);
//! 3. **combine**: sends each result back to the token's rank (a third
//!    all-to-all), which adds them with the router's weights in slot order
//!    and adds the shared experts, as one process does;
//! 4. gathers the shares of its group again (all-gather).
//!
//! Every expert output is computed by the same kernel arithmetic on the
//! same row as in one process (the kernels are batch invariant), and the
//! combine adds in the same order, so the layer's output is the same bits
//! whatever the placement. The shared experts run while the counts are in
//! flight.
//!
//! A rank that routes no tokens (no requests, or a share of zero rows) and
//! a rank that receives none for an expert are ordinary cases: it still
//! posts every collective, with empty parts.

use super::moe::{ExpertTensors, MoeFfn, MoeLayerScratch};
use super::parallel::{collective, posted, Net};
use crate::ModelError;
use kvant_dist::layout::{token_share, Placement};
use kvant_dist::{Buffer, Collective, DistError};
use kvant_kernels::activation::Activation;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::moe::{combine, moe_ffn, moe_ffn_quantized, Experts, MoeScratch};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// A layer's placement and its slots' prepared weights.
struct Placed {
    placement: Placement,
    experts: Experts,
}

pub(crate) struct ExpertParallel {
    rank: usize,
    /// Swapped whole by a re-placement; a pass holds its own `Arc`.
    placed: RwLock<Arc<Placed>>,
    /// Every expert's weights, to prepare other slots when re-placed.
    tensors: ExpertTensors,
    /// Assignments this rank routed to each logical expert since the
    /// last [`ExpertParallel::take_loads`].
    loads: Vec<AtomicU64>,
}

/// The buffers of one dispatch and combine, reused across passes.
#[derive(Default)]
pub(crate) struct EpScratch {
    /// Per destination rank: rows and assignments sent, and assignments
    /// per expert slot there.
    rows_to: Vec<usize>,
    assigns_to: Vec<usize>,
    slot_counts: Vec<Vec<u32>>,
    /// Assignments per slot of this rank, as the counts announce them.
    slot_expected: Vec<usize>,
    /// Per (token, slot) of the share: its destination rank, and its
    /// place among that rank's assignments.
    dest: Vec<usize>,
    place: Vec<usize>,
    /// Per (token, slot): its result's row among those that came back.
    positions: Vec<usize>,
    meta: Vec<u32>,
    x_dup: Vec<f32>,
    /// 8-bit dispatch: the share quantized, the rows received, and one
    /// row per assignment.
    xq: Q8Activations,
    got_q8: Q8Activations,
    dup_q8: Q8Activations,
    rows_at: Vec<usize>,
    ids: Vec<u32>,
    ones: Vec<f32>,
    y: Vec<f32>,
    kernel: MoeScratch,
}

/// The slot list entry of a slot this rank does not take.
const NONE: u32 = u32::MAX;

impl ExpertParallel {
    pub fn new(
        placement: Placement,
        rank: usize,
        tensors: ExpertTensors,
        experts: Experts,
    ) -> Self {
        let n = placement.experts();
        ExpertParallel {
            rank,
            placed: RwLock::new(Arc::new(Placed { placement, experts })),
            tensors,
            loads: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn placed(&self) -> Arc<Placed> {
        Arc::clone(&self.placed.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Bytes of this rank's slots' weights, and their number.
    pub fn slot_bytes(&self) -> (usize, usize) {
        let p = self.placed();
        (p.experts.byte_len(), p.experts.n_experts())
    }

    /// The assignments this rank routed to each expert since the last
    /// call, and resets them.
    pub fn take_loads(&self) -> Vec<u64> {
        self.loads
            .iter()
            .map(|l| l.swap(0, Ordering::Relaxed))
            .collect()
    }

    /// The current placement.
    pub fn placement(&self) -> Placement {
        self.placed().placement.clone()
    }

    /// Moves to `placement`: prepares this rank's new slots from the
    /// checkpoint's weights (outputs do not change: any replica of an
    /// expert computes the same bits).
    pub fn replace(&self, placement: Placement) -> Result<(), ModelError> {
        if placement.experts() != self.loads.len() {
            return Err(DistError::Mismatch(format!(
                "a placement of {} experts for a layer of {}",
                placement.experts(),
                self.loads.len()
            ))
            .into());
        }
        let experts = self.tensors.prepare(placement.on_rank(self.rank))?;
        *self.placed.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Placed { placement, experts });
        Ok(())
    }

    /// The layer's output for the group's `n` tokens (see the module docs).
    #[allow(clippy::too_many_arguments)] // the layer's step, unpacked
    pub async fn forward(
        &self,
        moe: &MoeFfn,
        act: Activation,
        xn: &[f32],
        n: usize,
        q8: &mut Q8Activations,
        s: &mut MoeLayerScratch,
        out: &mut [f32],
        net: &Net<'_>,
    ) -> Result<(), ModelError> {
        let Some((_, streams)) = net.par else {
            return Err(ModelError::NotParallel("expert parallelism without ranks"));
        };
        let (world, group) = (&*streams.world, &*streams.group);
        let (w, h, k) = (world.size(), moe.router.cols(), moe.params.top_k);
        let share = token_share(n, group.size(), group.rank());
        let m = share.len();
        let xs = &xn[share.start * h..share.end * h];
        if m > 0 {
            moe.route_tokens(xs, m, q8, s)?;
        }
        let placed = self.placed();
        let e = &mut s.ep;
        self.plan(&placed.placement, &s.ids[..m * k], k, share.start, w, e);

        // Dispatch, 1: how many rows and assignments go where, and how many
        // to each expert slot there.
        let slots_of = |r: usize| placed.placement.on_rank(r).len();
        let mut counts = Vec::with_capacity(2 * w + placed.placement.physical());
        for d in 0..w {
            counts.extend([e.rows_to[d] as u32, e.assigns_to[d] as u32]);
            counts.extend_from_slice(&e.slot_counts[d]);
        }
        let mine = slots_of(self.rank);
        let counts = posted(
            world,
            Collective::AllToAllV {
                send: Buffer::U32(counts),
                send_counts: (0..w).map(|d| 2 + slots_of(d)).collect(),
                recv_counts: vec![2 + mine; w],
            },
        )?;
        // The shared experts while the counts travel.
        moe.run_shared(act, xs, m, q8, s)?;
        let e = &mut s.ep;
        let got = counts.await?.into_u32()?;
        if got.len() != w * (2 + mine) {
            let n = got.len();
            return Err(DistError::Mismatch(format!("{n} counts from {w} ranks")).into());
        }
        let from = got.chunks_exact(2 + mine);
        let rows_from: Vec<usize> = from.clone().map(|c| c[0] as usize).collect();
        let assigns_from: Vec<usize> = from.clone().map(|c| c[1] as usize).collect();
        // What each of this rank's slots is to receive, checked below
        // against the slot lists that arrive.
        e.slot_expected.clear();
        e.slot_expected.resize(mine, 0);
        for c in from {
            for (x, &n) in e.slot_expected.iter_mut().zip(&c[2..]) {
                *x += n as usize;
            }
        }

        // Dispatch, 2: each token row once per destination, with its slots
        // there: in 8 bits when the experts quantize their input anyway
        // (the same bits arrive as they would compute), else in f32.
        let quantized = placed.experts.takes_quantized();
        let row_len = match quantized {
            true => Q8Activations::row_bytes(h),
            false => h,
        };
        let mut rows_f32 = Vec::new();
        let mut rows_q8 = Vec::new();
        if quantized && m > 0 {
            e.xq.quantize(kvant_kernels::cpu::tier(), xs, m, h)?;
        }
        for d in 0..w {
            for t in 0..m {
                if (0..k).any(|j| e.dest[t * k + j] == d) {
                    match quantized {
                        true => e.xq.write_row(t, &mut rows_q8),
                        false => rows_f32.extend_from_slice(&xs[t * h..(t + 1) * h]),
                    }
                }
            }
        }
        let rows = match quantized {
            true => Buffer::U8(rows_q8),
            false => Buffer::F32(rows_f32),
        };
        let meta = posted(
            world,
            Collective::AllToAllV {
                send: Buffer::U32(std::mem::take(&mut e.meta)),
                send_counts: e.rows_to.iter().map(|r| r * k).collect(),
                recv_counts: rows_from.iter().map(|r| r * k).collect(),
            },
        )?;
        let payload = posted(
            world,
            Collective::AllToAllV {
                send: rows,
                send_counts: e.rows_to.iter().map(|r| r * row_len).collect(),
                recv_counts: rows_from.iter().map(|r| r * row_len).collect(),
            },
        )?;
        let slots = meta.await?.into_u32()?;
        let got = payload.await?;

        // This rank's experts, one assignment per (row, slot).
        let total: usize = assigns_from.iter().sum();
        e.ids.clear();
        e.rows_at.clear();
        let n_rows = rows_from.iter().sum::<usize>();
        for r in 0..n_rows {
            let mine = slots.get(r * k..(r + 1) * k).ok_or_else(|| {
                DistError::Mismatch(format!(
                    "{} slot lists for {n_rows} rows",
                    slots.len() / k.max(1)
                ))
            })?;
            for &slot in mine.iter().filter(|&&x| x != NONE) {
                e.rows_at.push(r);
                e.ids.push(slot);
            }
        }
        let mut per_slot = vec![0usize; mine];
        for &slot in &e.ids {
            match per_slot.get_mut(slot as usize) {
                Some(n) => *n += 1,
                None => {
                    let msg = format!("slot {slot} of a rank with {mine}");
                    return Err(DistError::Mismatch(msg).into());
                }
            }
        }
        if e.ids.len() != total || per_slot != e.slot_expected {
            return Err(DistError::Mismatch(format!(
                "{} assignments arrived (per slot {per_slot:?}), the counts said {total} ({:?})",
                e.ids.len(),
                e.slot_expected
            ))
            .into());
        }
        e.ones.clear();
        e.ones.resize(total, 1.0);
        e.y.resize(total * h, 0.0);
        if total > 0 {
            let y = &mut e.y[..total * h];
            match got {
                Buffer::U8(bytes) => {
                    e.got_q8.read_rows(h, &bytes)?;
                    e.dup_q8.gather(&e.got_q8, &e.rows_at)?;
                    let (ids, ones) = (&e.ids, &e.ones);
                    let x = &e.dup_q8;
                    moe_ffn_quantized(&placed.experts, act, x, ids, ones, 1, &mut e.kernel, y)?;
                }
                got => {
                    let rows = got.into_f32()?;
                    e.x_dup.clear();
                    for &r in &e.rows_at {
                        e.x_dup.extend_from_slice(&rows[r * h..(r + 1) * h]);
                    }
                    let (ids, ones) = (&e.ids, &e.ones);
                    moe_ffn(
                        &placed.experts,
                        act,
                        &e.x_dup,
                        total,
                        ids,
                        ones,
                        1,
                        &mut e.kernel,
                        y,
                    )?;
                }
            }
        }
        drop(placed);

        // Combine: every result back to its token's rank.
        let back = collective(
            world,
            Collective::AllToAllV {
                send: Buffer::F32(e.y[..total * h].to_vec()),
                send_counts: assigns_from.iter().map(|a| a * h).collect(),
                recv_counts: e.assigns_to.iter().map(|a| a * h).collect(),
            },
        )
        .await?
        .into_f32()?;
        // Each assignment's row of `back`: its destination's block, then
        // its place there. The sum is the kernel's, in slot order.
        let mut base = vec![0usize; w];
        for d in 1..w {
            base[d] = base[d - 1] + e.assigns_to[d - 1];
        }
        e.positions.clear();
        e.positions
            .extend(e.dest.iter().zip(&e.place).map(|(&d, &p)| base[d] + p));
        let mine = &mut out[share.start * h..share.end * h];
        combine(&back, &e.positions, &s.weights[..m * k], k, h, mine)?;
        moe.add_shared(xs, m, s, mine);

        // The group's shares, whole again.
        if group.size() > 1 {
            let counts = (0..group.size())
                .map(|g| token_share(n, group.size(), g).len() * h)
                .collect();
            let op = Collective::AllGather {
                send: Buffer::F32(mine.to_vec()),
                counts,
            };
            collective(group, op).await?.copy_to_f32(out)?;
        }
        Ok(())
    }

    /// Where each of the share's assignments goes, the slot lists each
    /// destination gets (one per row sent), and the loads.
    fn plan(
        &self,
        p: &Placement,
        ids: &[u32],
        k: usize,
        first: usize,
        w: usize,
        e: &mut EpScratch,
    ) {
        let m = ids.len() / k.max(1);
        e.rows_to.clear();
        e.rows_to.resize(w, 0);
        e.assigns_to.clear();
        e.assigns_to.resize(w, 0);
        e.slot_counts.resize(w, Vec::new());
        for (d, c) in e.slot_counts.iter_mut().enumerate() {
            c.clear();
            c.resize(p.on_rank(d).len(), 0);
        }
        e.dest.clear();
        e.place.clear();
        for (a, &x) in ids.iter().enumerate() {
            let (d, _) = p.route(x as usize, self.rank, first + a / k);
            e.dest.push(d);
            if let Some(l) = self.loads.get(x as usize) {
                l.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Rows in destination order, tokens ascending, slots in order.
        e.place.resize(ids.len(), 0);
        e.meta.clear();
        for d in 0..w {
            for t in 0..m {
                let mine = (0..k).filter(|&j| e.dest[t * k + j] == d);
                if mine.clone().next().is_none() {
                    continue;
                }
                e.rows_to[d] += 1;
                for j in 0..k {
                    let a = t * k + j;
                    if e.dest[a] == d {
                        let (_, slot) = p.route(ids[a] as usize, self.rank, first + t);
                        e.meta.push(slot as u32);
                        e.slot_counts[d][slot] += 1;
                        e.place[a] = e.assigns_to[d];
                        e.assigns_to[d] += 1;
                    } else {
                        e.meta.push(NONE);
                    }
                }
            }
        }
    }
}
