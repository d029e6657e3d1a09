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

use super::super::ctx::Step;
use super::super::parallel::{collective, posted, Net};
use super::experts::ExpertTensors;
use super::routing::Router;
use super::scratch::{EpScratch, MoeLayerScratch};
use super::shared::SharedExperts;
use crate::ModelError;
use kvant_dist::layout::{token_share, Placement};
use kvant_dist::{Buffer, Collective, Comm, DistError};
use kvant_kernels::activation::Activation;
use kvant_kernels::cpu;
use kvant_kernels::int8::Q8Activations;
use kvant_kernels::moe::{combine, moe_ffn, moe_ffn_quantized, Experts, MoeScratch, Routing};
use std::future::Future;
use std::ops::Range;
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

/// Parts the combine of the other ranks' results is sent in: the first
/// travels while the experts compute the second (a part more costs one
/// more latency per layer and splits the experts' work thinner).
const PARTS: usize = 2;

/// Part `part` of a block of `n` assignments: `PARTS` near-equal ranges
/// in order.
fn part_of(n: usize, part: usize) -> Range<usize> {
    (n * part).div_ceil(PARTS)..(n * (part + 1)).div_ceil(PARTS)
}

/// The slot list entry of a slot this rank does not take.
const NONE: u32 = u32::MAX;

/// One pass of the layer on this rank: its sizes and its share of the
/// group's tokens.
struct Pass<'a> {
    act: Activation,
    /// Ranks in the world, this rank, the hidden size, experts per token.
    w: usize,
    me: usize,
    h: usize,
    k: usize,
    /// The share's rows (`[m, h]`).
    xs: &'a [f32],
    m: usize,
    /// Whether the rows travel as the 8-bit blocks the experts' int8
    /// kernels take.
    quantized: bool,
}

/// What the other ranks announced in the counts: per source rank, the
/// rows and assignments it sends here.
struct Arrivals {
    rows_from: Vec<usize>,
    assigns_from: Vec<usize>,
}

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

    /// The layer's output for the group's `n` tokens (see the module
    /// docs): route this rank's share, dispatch it, compute this rank's
    /// experts, combine their results, gather the group's shares.
    pub async fn forward(
        &self,
        router: &Router,
        shared: Option<&SharedExperts>,
        (act, tokens): (Activation, &[u32]),
        step: Step<'_, MoeLayerScratch>,
        net: &Net<'_>,
    ) -> Result<(), ModelError> {
        let Step { xn, n, q8, s, out } = step;
        let Some((_, streams)) = net.par else {
            return Err(ModelError::NotParallel("expert parallelism without ranks"));
        };
        let (world, group) = (&*streams.world, &*streams.group);
        let (h, k) = (router.hidden(), router.params.top_k);
        let share = token_share(n, group.size(), group.rank());
        let m = share.len();
        let xs = &xn[share.start * h..share.end * h];
        if m > 0 {
            let ts = tokens.get(share.clone()).unwrap_or_default();
            router.route(xs, ts, m, q8, &mut s.routes)?;
        }
        let placed = self.placed();
        let p = Pass {
            act,
            w: world.size(),
            me: self.rank,
            h,
            k,
            xs,
            m,
            quantized: placed.experts.takes_quantized(),
        };
        let e = &mut s.ep;
        self.plan(
            &placed.placement,
            &s.routes.ids[..m * k],
            k,
            share.start,
            p.w,
            e,
        );

        // Dispatch, 1: the counts; the shared experts while they travel.
        let counts = posted(world, p.counts(&placed.placement, e))?;
        if let Some(sh) = shared {
            sh.run(act, xs, m, q8, &mut s.shared)?;
        }
        let e = &mut s.ep;
        let from = p.arrivals(counts.await?.into_u32()?, &placed.placement, e)?;

        // Dispatch, 2: the rows and their slot lists; this rank's own rows'
        // experts run while the others' travel.
        let (own_slots, meta, rows) = p.dispatch(&from, e)?;
        let meta = posted(world, meta)?;
        let payload = posted(world, rows)?;
        let mut per_slot = vec![0usize; e.slot_expected.len()];
        let own_total = p.compute_own(&placed.experts, &own_slots, &mut per_slot, e)?;

        // The other ranks' rows: their results go back in PARTS parts, each
        // posted as soon as its experts are done, so the first part
        // travels while the next computes.
        let (slots, got) = (meta.await?.into_u32()?, payload.await?);
        let rows = p.receive(&slots, got, &from, &mut per_slot, own_total, e)?;
        let mut parts = Vec::with_capacity(PARTS);
        for part in 0..PARTS {
            let op = p.compute_part(&placed.experts, part, &from, rows.as_deref(), e)?;
            parts.push(posted(world, op)?);
        }
        drop(placed);

        let mine = &mut out[share.start * h..share.end * h];
        p.combine(parts, &s.routes.weights[..m * k], e, mine)
            .await?;
        if let Some(sh) = shared {
            sh.add(xs, m, &s.shared, mine);
        }
        gather(group, n, h, share, out).await
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

impl Pass<'_> {
    /// Dispatch, 1: how many rows and assignments go to each rank, and how
    /// many to each expert slot there (one all-to-all).
    fn counts(&self, placement: &Placement, e: &EpScratch) -> Collective {
        let w = self.w;
        let slots_of = |r: usize| placement.on_rank(r).len();
        let mut counts = Vec::with_capacity(2 * w + placement.physical());
        for d in 0..w {
            counts.extend([e.rows_to[d] as u32, e.assigns_to[d] as u32]);
            counts.extend_from_slice(&e.slot_counts[d]);
        }
        let mine = slots_of(self.me);
        Collective::AllToAllV {
            send: Buffer::U32(counts),
            send_counts: (0..w).map(|d| 2 + slots_of(d)).collect(),
            recv_counts: vec![2 + mine; w],
        }
    }

    /// The counts that came back: what each rank sends here, and (into
    /// `e.slot_expected`) what each of this rank's slots is to receive,
    /// checked later against the slot lists that arrive.
    fn arrivals(
        &self,
        got: Vec<u32>,
        placement: &Placement,
        e: &mut EpScratch,
    ) -> Result<Arrivals, ModelError> {
        let (w, mine) = (self.w, placement.on_rank(self.me).len());
        if got.len() != w * (2 + mine) {
            let n = got.len();
            return Err(DistError::Mismatch(format!("{n} counts from {w} ranks")).into());
        }
        let from = got.chunks_exact(2 + mine);
        let rows_from: Vec<usize> = from.clone().map(|c| c[0] as usize).collect();
        let assigns_from: Vec<usize> = from.clone().map(|c| c[1] as usize).collect();
        e.slot_expected.clear();
        e.slot_expected.resize(mine, 0);
        for c in from {
            for (x, &n) in e.slot_expected.iter_mut().zip(&c[2..]) {
                *x += n as usize;
            }
        }
        Ok(Arrivals {
            rows_from,
            assigns_from,
        })
    }

    /// Dispatch, 2: each token row once per other rank, with its slots
    /// there: in 8 bits when the experts quantize their input anyway (the
    /// same bits arrive as they would compute), else in f32. The rows this
    /// rank routes to its own slots stay here (`e.own_tokens`, and the
    /// slot lists returned first); the two all-to-alls to post follow.
    fn dispatch(
        &self,
        from: &Arrivals,
        e: &mut EpScratch,
    ) -> Result<(Vec<u32>, Collective, Collective), ModelError> {
        let (w, me, h, k, m, xs) = (self.w, self.me, self.h, self.k, self.m, self.xs);
        let row_len = match self.quantized {
            true => Q8Activations::row_bytes(h),
            false => h,
        };
        if self.quantized && m > 0 {
            e.xq.quantize(cpu::tier(), xs, m, h)?;
        }
        let mut rows_f32 = Vec::new();
        let mut rows_q8 = Vec::new();
        e.own_tokens.clear();
        for d in 0..w {
            for t in (0..m).filter(|&t| (0..k).any(|j| e.dest[t * k + j] == d)) {
                match (d == me, self.quantized) {
                    (true, _) => e.own_tokens.push(t),
                    (false, true) => e.xq.write_row(t, &mut rows_q8),
                    (false, false) => rows_f32.extend_from_slice(&xs[t * h..(t + 1) * h]),
                }
            }
        }
        let rows = match self.quantized {
            true => Buffer::U8(rows_q8),
            false => Buffer::F32(rows_f32),
        };
        // The slot lists come in destination order (see `plan`): this
        // rank's own stay.
        let own = e.rows_to[..me].iter().sum::<usize>() * k;
        let own_slots: Vec<u32> = e.meta.drain(own..own + e.rows_to[me] * k).collect();
        let others = |per: &[usize], unit: usize| -> Vec<usize> {
            (0..w)
                .map(|d| if d == me { 0 } else { per[d] * unit })
                .collect()
        };
        let meta = Collective::AllToAllV {
            send: Buffer::U32(std::mem::take(&mut e.meta)),
            send_counts: others(&e.rows_to, k),
            recv_counts: others(&from.rows_from, k),
        };
        let rows = Collective::AllToAllV {
            send: rows,
            send_counts: others(&e.rows_to, row_len),
            recv_counts: others(&from.rows_from, row_len),
        };
        Ok((own_slots, meta, rows))
    }

    /// This rank's experts over its own rows, one assignment per (row,
    /// slot), into `e.y_own`; returns the assignments. Every row's result
    /// is the kernel's for that row alone (it is batch invariant), so
    /// computing these apart from the other ranks' rows changes no bit.
    fn compute_own(
        &self,
        experts: &Experts,
        own_slots: &[u32],
        per_slot: &mut [usize],
        e: &mut EpScratch,
    ) -> Result<usize, ModelError> {
        let (h, k) = (self.h, self.k);
        let n_own = e.own_tokens.len();
        expand(own_slots, k, n_own, per_slot, &mut e.rows_at, &mut e.ids)?;
        for r in e.rows_at.iter_mut() {
            *r = e.own_tokens[*r];
        }
        let own_total = e.ids.len();
        e.y_own.resize(own_total * h, 0.0);
        let x = match self.quantized {
            true => {
                e.dup_q8.gather(&e.xq, &e.rows_at)?;
                Rows::Q8(&e.dup_q8)
            }
            false => {
                gather_f32(self.xs, h, &e.rows_at, &mut e.x_dup);
                Rows::F32(&e.x_dup)
            }
        };
        let (ones, kernel) = (&mut e.ones, &mut e.kernel);
        run_experts(experts, self.act, x, &e.ids, ones, kernel, &mut e.y_own)?;
        Ok(own_total)
    }

    /// The other ranks' slot lists and rows as they arrived: the
    /// assignments (`e.rows_at`, `e.ids`), checked against the counts, and
    /// the rows (`None` when they came in 8 bits, read into `e.got_q8`).
    fn receive(
        &self,
        slots: &[u32],
        got: Buffer,
        from: &Arrivals,
        per_slot: &mut [usize],
        own_total: usize,
        e: &mut EpScratch,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let me = self.me;
        let n_rows = (from.rows_from.iter().enumerate())
            .filter(|&(d, _)| d != me)
            .map(|(_, r)| r)
            .sum::<usize>();
        expand(slots, self.k, n_rows, per_slot, &mut e.rows_at, &mut e.ids)?;
        let total: usize = from.assigns_from.iter().sum();
        if own_total + e.ids.len() != total || per_slot != e.slot_expected {
            return Err(DistError::Mismatch(format!(
                "{} assignments arrived (per slot {per_slot:?}), the counts said {total} ({:?})",
                own_total + e.ids.len(),
                e.slot_expected
            ))
            .into());
        }
        Ok(match got {
            Buffer::U8(bytes) => {
                e.got_q8.read_rows(self.h, &bytes)?;
                None
            }
            got => Some(got.into_f32()?),
        })
    }

    /// Part `part` of the other ranks' assignments (each source's block cut
    /// the same way on both sides) through this rank's experts; returns
    /// the all-to-all that sends their results back.
    fn compute_part(
        &self,
        experts: &Experts,
        part: usize,
        from: &Arrivals,
        rows: Option<&[f32]>,
        e: &mut EpScratch,
    ) -> Result<Collective, ModelError> {
        let (w, me, h) = (self.w, self.me, self.h);
        e.part_ids.clear();
        e.part_rows.clear();
        let mut send_counts = vec![0; w];
        let mut start = 0;
        for d in (0..w).filter(|&d| d != me) {
            let r = part_of(from.assigns_from[d], part);
            e.part_ids
                .extend_from_slice(&e.ids[start + r.start..start + r.end]);
            e.part_rows
                .extend_from_slice(&e.rows_at[start + r.start..start + r.end]);
            send_counts[d] = r.len() * h;
            start += from.assigns_from[d];
        }
        let n = e.part_ids.len();
        e.y.resize(n * h, 0.0);
        let x = match rows {
            None => {
                e.dup_q8.gather(&e.got_q8, &e.part_rows)?;
                Rows::Q8(&e.dup_q8)
            }
            Some(rows) => {
                gather_f32(rows, h, &e.part_rows, &mut e.x_dup);
                Rows::F32(&e.x_dup)
            }
        };
        let (ids, y) = (&e.part_ids, &mut e.y);
        run_experts(experts, self.act, x, ids, &mut e.ones, &mut e.kernel, y)?;
        let recv_counts = (0..w)
            .map(|d| match d == me {
                true => 0,
                false => part_of(e.assigns_to[d], part).len() * h,
            })
            .collect();
        Ok(Collective::AllToAllV {
            send: Buffer::F32(e.y[..n * h].to_vec()),
            send_counts,
            recv_counts,
        })
    }

    /// Combine: the parts as they come back, then this rank's own
    /// results, summed with the router's `weights` into `mine` (the
    /// share's rows). Each assignment's row of `back`: its part, its
    /// destination's block there, its place in the block. The sum is the
    /// kernel's, in slot order.
    async fn combine<F>(
        &self,
        parts: Vec<F>,
        weights: &[f32],
        e: &mut EpScratch,
        mine: &mut [f32],
    ) -> Result<(), ModelError>
    where
        F: Future<Output = Result<Buffer, DistError>>,
    {
        let (w, me, h) = (self.w, self.me, self.h);
        let mut back = Vec::new();
        let mut part_base = [0usize; PARTS];
        for (b, p) in part_base.iter_mut().zip(parts) {
            *b = back.len() / h.max(1);
            back.extend_from_slice(&p.await?.into_f32()?);
        }
        let own_base = back.len() / h.max(1);
        back.extend_from_slice(&e.y_own);
        // Per (part, destination): where its block starts in `back`.
        let mut base = vec![[0usize; PARTS]; w];
        for (part, &pb) in part_base.iter().enumerate() {
            let mut at = pb;
            for d in (0..w).filter(|&d| d != me) {
                base[d][part] = at;
                at += part_of(e.assigns_to[d], part).len();
            }
        }
        e.positions.clear();
        for (&d, &p) in e.dest.iter().zip(&e.place) {
            e.positions.push(match d == me {
                true => own_base + p,
                false => {
                    let a = e.assigns_to[d];
                    let part = (0..PARTS)
                        .find(|&q| part_of(a, q).contains(&p))
                        .unwrap_or(0);
                    base[d][part] + p - part_of(a, part).start
                }
            });
        }
        combine(&back, &e.positions, weights, self.k, h, mine)?;
        Ok(())
    }
}

/// The group's shares of `out` (`[n, h]`, this rank's the rows `share`),
/// whole again on every rank of the group (all-gather).
async fn gather(
    group: &dyn Comm,
    n: usize,
    h: usize,
    share: Range<usize>,
    out: &mut [f32],
) -> Result<(), ModelError> {
    if group.size() == 1 {
        return Ok(());
    }
    let counts = (0..group.size())
        .map(|g| token_share(n, group.size(), g).len() * h)
        .collect();
    let op = Collective::AllGather {
        send: Buffer::F32(out[share.start * h..share.end * h].to_vec()),
        counts,
    };
    collective(group, op).await?.copy_to_f32(out)?;
    Ok(())
}

/// The rows an expert computation reads.
enum Rows<'a> {
    Q8(&'a Q8Activations),
    F32(&'a [f32]),
}

/// Appends one assignment per slot entry that is not [`NONE`] of `rows`
/// rows' slot lists (`k` entries each) to `rows_at` (the row) and `ids`
/// (the slot), after clearing both, and counts them in `per_slot`.
fn expand(
    slots: &[u32],
    k: usize,
    rows: usize,
    per_slot: &mut [usize],
    rows_at: &mut Vec<usize>,
    ids: &mut Vec<u32>,
) -> Result<(), ModelError> {
    rows_at.clear();
    ids.clear();
    if slots.len() != rows * k {
        let lists = slots.len() / k.max(1);
        return Err(DistError::Mismatch(format!("{lists} slot lists for {rows} rows")).into());
    }
    for (r, list) in slots.chunks_exact(k.max(1)).enumerate() {
        for &slot in list.iter().filter(|&&x| x != NONE) {
            let Some(n) = per_slot.get_mut(slot as usize) else {
                let msg = format!("slot {slot} of a rank with {}", per_slot.len());
                return Err(DistError::Mismatch(msg).into());
            };
            *n += 1;
            rows_at.push(r);
            ids.push(slot);
        }
    }
    Ok(())
}

/// `rows`' rows of `h` values at `at`, in that order, into `out`.
fn gather_f32(rows: &[f32], h: usize, at: &[usize], out: &mut Vec<f32>) {
    out.clear();
    for &r in at {
        out.extend_from_slice(&rows[r * h..(r + 1) * h]);
    }
}

/// Each assignment's expert (slot `ids[i]`) over row `i` of `x`,
/// unweighted, into `y` (one row per assignment).
fn run_experts(
    experts: &Experts,
    act: Activation,
    x: Rows<'_>,
    ids: &[u32],
    ones: &mut Vec<f32>,
    kernel: &mut MoeScratch,
    y: &mut [f32],
) -> Result<(), ModelError> {
    let n = ids.len();
    if n == 0 {
        return Ok(());
    }
    ones.clear();
    ones.resize(n, 1.0);
    let r = Routing {
        ids,
        weights: ones,
        n_tokens: n,
        top_k: 1,
    };
    match x {
        Rows::Q8(x) => moe_ffn_quantized(cpu::tier(), experts, act, x, &r, kernel, y)?,
        Rows::F32(x) => moe_ffn(cpu::tier(), experts, act, x, &r, kernel, y)?,
    }
    Ok(())
}
