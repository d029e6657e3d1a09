//! The in-process backend: ranks are threads of one process.
//!
//! [`world`] makes one communicator per rank; each goes to its own thread.
//! A communicator's ranks share a `Group`: a table of collectives keyed
//! by sequence number (the n-th post of every rank forms the n-th
//! collective, MPI's matching rule), each slot gathering the ranks'
//! contributions. [`Comm::post`] deposits this rank's contribution and
//! returns; the rank that completes a slot computes every rank's result
//! (sums in rank order 0, 1, 2, …, so that every rank gets the same bits)
//! and wakes the waiters. Ranks that disagree about a collective (kind,
//! element type, lengths, root, counts) all get [`DistError::Mismatch`].
//!
//! All the groups of one world (the communicators of [`world`] and every
//! [`Comm::split`] of them) share a `World` that knows which ranks are
//! still there: a rank whose last communicator handle is dropped (its
//! thread returned or panicked) has *left*, and a collective that still
//! waits for it fails at once with [`DistError::RankLost`] instead of
//! waiting for the timeout; [`Comm::abort`] fails every collective of the
//! world. Ranks in these errors are world ranks (the rank in [`world`]'s
//! list), which for the world's own communicators are the ranks.
//!
//! [`Comm::split`] all-gathers every rank's (color, key) through the
//! parent; the first member of each new group to come back creates the
//! group's shared state and publishes it in a registry of the parent,
//! keyed by the all-gather's sequence number and the color, where the
//! other members find it.

use crate::comm::{Buffer, Collective, Comm, Elem, Kind, ReduceOp, Request};
use crate::error::DistError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

/// One communicator per rank of a new world of `size` ranks (none for 0),
/// in rank order. Hand each to its own thread; a wait lasts at most
/// `timeout`.
pub fn world(size: usize, timeout: Duration) -> Vec<Arc<dyn Comm>> {
    local_world(size, timeout)
        .into_iter()
        .map(|c| c as Arc<dyn Comm>)
        .collect()
}

fn local_world(size: usize, timeout: Duration) -> Vec<Arc<LocalComm>> {
    let world = Arc::new(World {
        next_group: AtomicU64::new(0),
        state: Mutex::new(WorldState {
            handles: vec![0; size],
            left: vec![false; size],
            aborted: None,
        }),
        groups: Mutex::new(Vec::new()),
    });
    let group = Group::new(&world, (0..size).collect(), timeout);
    (0..size)
        .map(|rank| Arc::new(LocalComm::new(Arc::clone(&group), rank)))
        .collect()
}

/// Locks `m`, ignoring poisoning: the state behind every lock here is
/// left consistent at every point a panic could occur.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the groups of one world share.
struct World {
    next_group: AtomicU64,
    state: Mutex<WorldState>,
    /// Every group of the world, to wake their waiters when a rank fails.
    groups: Mutex<Vec<Weak<Group>>>,
}

struct WorldState {
    /// Live communicator handles of each world rank.
    handles: Vec<usize>,
    /// World ranks whose last handle was dropped.
    left: Vec<bool>,
    /// The world rank that aborted, and its code.
    aborted: Option<(usize, i32)>,
}

impl World {
    /// The failure every collective of the world now reports, if any.
    fn aborted(&self) -> Option<DistError> {
        lock(&self.state)
            .aborted
            .map(|(rank, code)| DistError::RankLost {
                rank,
                why: format!("aborted with code {code}"),
            })
    }

    /// Wakes every waiter of every group, after a change of the world's
    /// state. The group list is copied first so that no group lock is
    /// taken while the list's lock is held (a split takes them the other
    /// way round).
    fn wake_all(&self) {
        let groups: Vec<Arc<Group>> = {
            let mut list = lock(&self.groups);
            list.retain(|g| g.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for g in groups {
            // Taking the lock orders this wake-up after any waiter's check
            // of the world state, so none misses it.
            let _st = lock(&g.state);
            g.cv.notify_all();
        }
    }
}

/// The shared state of one communicator.
struct Group {
    id: u64,
    world: Arc<World>,
    /// The world rank of each rank of the group.
    members: Vec<usize>,
    timeout: Duration,
    state: Mutex<GroupState>,
    cv: Condvar,
}

struct GroupState {
    /// Each rank's next sequence number.
    next_seq: Vec<u64>,
    slots: HashMap<u64, Slot>,
    /// Children of splits: (the split's sequence number, color) → the
    /// child's state and how many members have still to pick it up.
    children: HashMap<(u64, usize), (Arc<Group>, usize)>,
}

impl Group {
    fn new(world: &Arc<World>, members: Vec<usize>, timeout: Duration) -> Arc<Group> {
        let size = members.len();
        let group = Arc::new(Group {
            id: world.next_group.fetch_add(1, Ordering::Relaxed),
            world: Arc::clone(world),
            members,
            timeout,
            state: Mutex::new(GroupState {
                next_seq: vec![0; size],
                slots: HashMap::new(),
                children: HashMap::new(),
            }),
            cv: Condvar::new(),
        });
        let mut list = lock(&world.groups);
        list.retain(|g| g.strong_count() > 0);
        list.push(Arc::downgrade(&group));
        drop(list);
        group
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    /// "communicator 3 (rank 1 of 2, world ranks [0, 2])".
    fn describe(&self, rank: usize) -> String {
        format!(
            "communicator {} (rank {rank} of {}, world ranks {:?})",
            self.id,
            self.size(),
            self.members
        )
    }
}

/// One collective of a group, gathering its ranks' contributions.
struct Slot {
    kind: Kind,
    ops: Vec<Option<Collective>>,
    posted: Vec<bool>,
    /// Ranks whose request is gone (waited, dropped, or never made).
    released: Vec<bool>,
    state: SlotState,
}

enum SlotState {
    /// Waiting for contributions.
    Gathering,
    /// Every rank posted; the last one computes the results.
    Computing,
    /// Each rank's result, taken by its request.
    Done(Vec<Option<Buffer>>),
    Failed(DistError),
}

impl Slot {
    fn new(kind: Kind, size: usize) -> Slot {
        Slot {
            kind,
            ops: (0..size).map(|_| None).collect(),
            posted: vec![false; size],
            released: vec![false; size],
            state: SlotState::Gathering,
        }
    }
}

/// A rank's handle on a group.
struct LocalComm {
    group: Arc<Group>,
    rank: usize,
}

impl LocalComm {
    fn new(group: Arc<Group>, rank: usize) -> LocalComm {
        let w = group.members[rank];
        lock(&group.world.state).handles[w] += 1;
        LocalComm { group, rank }
    }

    /// Deposits `op` (already validated, or `Err` with why it is not) as
    /// this rank's next contribution: the request, and the error to
    /// return instead of it when `op` is malformed.
    fn deposit(
        &self,
        op: Result<Collective, (Kind, DistError)>,
    ) -> (LocalRequest, Result<(), DistError>) {
        let g = &self.group;
        let rank = self.rank;
        let kind = match &op {
            Ok(op) => op.kind(),
            Err((kind, _)) => *kind,
        };
        let mut st = lock(&g.state);
        let seq = st.next_seq[rank];
        st.next_seq[rank] += 1;
        let size = g.size();
        let slot = st.slots.entry(seq).or_insert_with(|| Slot::new(kind, size));
        slot.posted[rank] = true;
        let mut local_error = Ok(());
        let mut complete = None;
        let gathering = matches!(slot.state, SlotState::Gathering);
        match op {
            Err((_, e)) => {
                if gathering {
                    // Malformed here: the others cannot complete it either.
                    let why = match &e {
                        DistError::Mismatch(m) => m.clone(),
                        other => other.to_string(),
                    };
                    slot.state = SlotState::Failed(DistError::Mismatch(format!(
                        "{} #{seq} on {}: rank {rank}: {why}",
                        kind.name(),
                        g.describe(rank),
                    )));
                    slot.ops.iter_mut().for_each(|o| *o = None);
                    g.cv.notify_all();
                }
                slot.released[rank] = true;
                local_error = Err(e);
            }
            Ok(op) if gathering => {
                let disagreement = slot
                    .ops
                    .iter()
                    .enumerate()
                    .filter_map(|(q, o)| o.as_ref().map(|o| (q, o)))
                    .find_map(|(q, other)| disagree(rank, &op, q, other).err());
                if let Some(why) = disagreement {
                    slot.state = SlotState::Failed(DistError::Mismatch(format!(
                        "collective #{seq} on {}: {why}",
                        g.describe(rank)
                    )));
                    slot.ops.iter_mut().for_each(|o| *o = None);
                    g.cv.notify_all();
                } else {
                    slot.ops[rank] = Some(op);
                    if slot.posted.iter().all(|&p| p) {
                        slot.state = SlotState::Computing;
                        complete = Some(
                            slot.ops
                                .iter_mut()
                                .filter_map(Option::take)
                                .collect::<Vec<_>>(),
                        );
                    }
                }
            }
            // A collective that already failed: this rank gets its error.
            Ok(_) => {}
        }
        drop(st);
        if let Some(ops) = complete {
            // Computed outside the lock, so that the other ranks can test
            // and post meanwhile.
            let result = compute(ops, size);
            let mut st = lock(&g.state);
            if let Some(slot) = st.slots.get_mut(&seq) {
                slot.state = match result {
                    Ok(bufs) => SlotState::Done(
                        bufs.into_iter()
                            .zip(&slot.released)
                            .map(|(b, &gone)| (!gone).then_some(b))
                            .collect(),
                    ),
                    Err(e) => SlotState::Failed(e),
                };
                if slot.released.iter().all(|&r| r) {
                    st.slots.remove(&seq);
                }
            }
            g.cv.notify_all();
        }
        let req = LocalRequest {
            group: Arc::clone(g),
            rank,
            seq,
            kind,
            outcome: None,
            released: local_error.is_err(),
        };
        (req, local_error)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let world = &self.group.world;
        let w = self.group.members[self.rank];
        let gone = {
            let mut st = lock(&world.state);
            st.handles[w] = st.handles[w].saturating_sub(1);
            let gone = st.handles[w] == 0 && st.aborted.is_none() && !st.left[w];
            if gone {
                st.left[w] = true;
            }
            gone
        };
        if gone {
            world.wake_all();
        }
    }
}

impl Comm for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    fn post(&self, op: Collective) -> Result<Box<dyn Request>, DistError> {
        Ok(Box::new(self.post_local(op)?))
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>, DistError> {
        let size = self.size();
        let mut mine = Vec::with_capacity(16);
        mine.extend_from_slice(&(color as u64).to_le_bytes());
        mine.extend_from_slice(&(key as u64).to_le_bytes());
        let req = self.post_local(Collective::AllGather {
            send: Buffer::U8(mine),
            counts: vec![16; size],
        })?;
        let seq = req.seq;
        let all = Box::new(req).wait()?.into_u8()?;
        let word = |i: usize| -> Result<u64, DistError> {
            let bytes = all
                .get(8 * i..8 * i + 8)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .ok_or_else(|| {
                    DistError::Backend(format!("split: {} bytes of (color, key)", all.len()))
                })?;
            Ok(u64::from_le_bytes(bytes))
        };
        let mut same: Vec<(u64, usize)> = Vec::new();
        for r in 0..size {
            if word(2 * r)? == color as u64 {
                same.push((word(2 * r + 1)?, r));
            }
        }
        same.sort_unstable();
        let new_rank = same
            .iter()
            .position(|&(_, r)| r == self.rank)
            .ok_or_else(|| {
                DistError::Backend(format!("split: rank {} is not in its own color", self.rank))
            })?;
        let members: Vec<usize> = same.iter().map(|&(_, r)| self.group.members[r]).collect();
        let g = &self.group;
        let child = {
            let mut st = lock(&g.state);
            let found = match st.children.get_mut(&(seq, color)) {
                Some((child, left)) => {
                    *left -= 1;
                    Some((Arc::clone(child), *left == 0))
                }
                None => None,
            };
            match found {
                Some((child, last)) => {
                    if last {
                        st.children.remove(&(seq, color));
                    }
                    child
                }
                None => {
                    // The first member back creates the child (registering
                    // it with the world takes the world's group list; no
                    // waker holds that list while taking a group lock).
                    let child = Group::new(&g.world, members.clone(), g.timeout);
                    if members.len() > 1 {
                        st.children
                            .insert((seq, color), (Arc::clone(&child), members.len() - 1));
                    }
                    child
                }
            }
        };
        Ok(Arc::new(LocalComm::new(child, new_rank)))
    }

    fn timeout(&self) -> Duration {
        self.group.timeout
    }

    fn abort(&self, code: i32) {
        let world = &self.group.world;
        let w = self.group.members[self.rank];
        {
            let mut st = lock(&world.state);
            if st.aborted.is_none() {
                st.aborted = Some((w, code));
            }
        }
        world.wake_all();
    }
}

impl LocalComm {
    fn post_local(&self, op: Collective) -> Result<LocalRequest, DistError> {
        if let Some(e) = self.group.world.aborted() {
            return Err(e);
        }
        let kind = op.kind();
        let checked = match op.validate(self.rank, self.size()) {
            Ok(()) => Ok(op),
            Err(e) => Err((kind, e)),
        };
        let (req, local) = self.deposit(checked);
        local.map(|()| req)
    }
}

/// Whether ranks `a` and `b` agree about one collective: `Err` says how
/// they do not.
fn disagree(a: usize, x: &Collective, b: usize, y: &Collective) -> Result<(), String> {
    let describe = |r: usize, op: &Collective| format!("rank {r} posted {}", summary(op));
    let differ = |what: &str| {
        Err(format!(
            "{}, {} ({what} differ)",
            describe(a, x),
            describe(b, y)
        ))
    };
    if x.kind() != y.kind() {
        return differ("kinds");
    }
    if x.elem() != y.elem() {
        return differ("element types");
    }
    match (x, y) {
        (Collective::Broadcast { buf: p, root: r }, Collective::Broadcast { buf: q, root: s }) => {
            if r != s {
                return differ("roots");
            }
            if p.len() != q.len() {
                return differ("lengths");
            }
        }
        (Collective::AllReduce { buf: p, op: o }, Collective::AllReduce { buf: q, op: u }) => {
            if o != u {
                return differ("reductions");
            }
            if p.len() != q.len() {
                return differ("lengths");
            }
        }
        (Collective::AllGather { counts: c, .. }, Collective::AllGather { counts: d, .. })
            if c != d =>
        {
            return differ("counts");
        }
        (
            Collective::ReduceScatter {
                counts: c, op: o, ..
            },
            Collective::ReduceScatter {
                counts: d, op: u, ..
            },
        ) => {
            if o != u {
                return differ("reductions");
            }
            if c != d {
                return differ("counts");
            }
        }
        (
            Collective::AllToAllV {
                send_counts: sa,
                recv_counts: ra,
                ..
            },
            Collective::AllToAllV {
                send_counts: sb,
                recv_counts: rb,
                ..
            },
        ) => {
            if sa.get(b) != rb.get(a) {
                return Err(format!(
                    "all_to_all_v: rank {a} sends {:?} elements to rank {b}, which expects {:?}",
                    sa.get(b),
                    rb.get(a)
                ));
            }
            if sb.get(a) != ra.get(b) {
                return Err(format!(
                    "all_to_all_v: rank {b} sends {:?} elements to rank {a}, which expects {:?}",
                    sb.get(a),
                    ra.get(b)
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// "all_reduce(F32 × 10, Sum)", for error messages.
fn summary(op: &Collective) -> String {
    let kind = op.kind().name();
    match op {
        Collective::Barrier => kind.to_string(),
        Collective::Broadcast { buf, root } => {
            format!("{kind}({:?} × {}, root {root})", buf.elem(), buf.len())
        }
        Collective::AllReduce { buf, op } => {
            format!("{kind}({:?} × {}, {op:?})", buf.elem(), buf.len())
        }
        Collective::AllGather { send, counts } => {
            format!("{kind}({:?}, counts {counts:?})", send.elem())
        }
        Collective::ReduceScatter { send, counts, op } => {
            format!("{kind}({:?}, counts {counts:?}, {op:?})", send.elem())
        }
        Collective::AllToAllV {
            send,
            send_counts,
            recv_counts,
        } => format!(
            "{kind}({:?}, send counts {send_counts:?}, receive counts {recv_counts:?})",
            send.elem()
        ),
    }
}

/// A posted collective of the in-process backend.
struct LocalRequest {
    group: Arc<Group>,
    rank: usize,
    seq: u64,
    kind: Kind,
    /// The result, once seen.
    outcome: Option<Result<Buffer, DistError>>,
    /// Whether this rank's slot entry is already released.
    released: bool,
}

impl LocalRequest {
    /// The result if the collective is over (the world failed, it
    /// completed, it failed, or a rank it waits for left).
    fn poll(&mut self, st: &mut GroupState) -> Option<Result<Buffer, DistError>> {
        if let Some(e) = self.group.world.aborted() {
            return Some(Err(e));
        }
        let Some(slot) = st.slots.get_mut(&self.seq) else {
            return Some(Err(DistError::Backend(format!(
                "{} #{} on {}: the collective's state is gone",
                self.kind.name(),
                self.seq,
                self.group.describe(self.rank)
            ))));
        };
        match &mut slot.state {
            SlotState::Done(results) => Some(results[self.rank].take().ok_or_else(|| {
                DistError::Backend(format!(
                    "{} #{}: result already taken",
                    self.kind.name(),
                    self.seq
                ))
            })),
            SlotState::Failed(e) => Some(Err(e.clone())),
            SlotState::Computing => None,
            SlotState::Gathering => {
                let ws = lock(&self.group.world.state);
                let lost = (0..slot.posted.len())
                    .filter(|&r| !slot.posted[r])
                    .map(|r| self.group.members[r])
                    .find(|&w| ws.left.get(w).copied().unwrap_or(false));
                lost.map(|rank| {
                    Err(DistError::RankLost {
                        rank,
                        why: "left".into(),
                    })
                })
            }
        }
    }

    /// Polls under the group's lock, keeping the outcome.
    fn poll_locked(&mut self, st: &mut GroupState) -> bool {
        if self.outcome.is_none() {
            self.outcome = self.poll(st);
        }
        self.outcome.is_some()
    }

    /// The timeout error, naming the ranks that have not posted.
    fn timed_out(&self, st: &GroupState) -> DistError {
        let missing: Vec<usize> = st
            .slots
            .get(&self.seq)
            .map(|s| (0..s.posted.len()).filter(|&r| !s.posted[r]).collect())
            .unwrap_or_default();
        let world_missing: Vec<usize> = missing.iter().map(|&r| self.group.members[r]).collect();
        DistError::Timeout {
            what: format!(
                "{} #{} on {}: ranks {missing:?} (world ranks {world_missing:?}) have not posted it",
                st.slots.get(&self.seq).map_or(self.kind, |s| s.kind).name(),
                self.seq,
                self.group.describe(self.rank)
            ),
            after: self.group.timeout,
        }
    }

    fn release(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        let mut st = lock(&self.group.state);
        if let Some(slot) = st.slots.get_mut(&self.seq) {
            slot.released[self.rank] = true;
            if let SlotState::Done(results) = &mut slot.state {
                results[self.rank] = None;
            }
            if slot.released.iter().all(|&r| r) && !matches!(slot.state, SlotState::Computing) {
                st.slots.remove(&self.seq);
            }
        }
    }
}

impl Request for LocalRequest {
    fn test(&mut self) -> Result<bool, DistError> {
        if self.outcome.is_none() {
            let group = Arc::clone(&self.group);
            let mut st = lock(&group.state);
            self.poll_locked(&mut st);
        }
        match &self.outcome {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(e.clone()),
        }
    }

    fn wait(mut self: Box<Self>) -> Result<Buffer, DistError> {
        if self.outcome.is_none() {
            let group = Arc::clone(&self.group);
            let deadline = Instant::now() + group.timeout;
            let mut st = lock(&group.state);
            while !self.poll_locked(&mut st) {
                let now = Instant::now();
                if now >= deadline {
                    let e = self.timed_out(&st);
                    self.outcome = Some(Err(e));
                    break;
                }
                st = group
                    .cv
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
        self.release();
        self.outcome.take().unwrap_or_else(|| {
            Err(DistError::Backend(format!(
                "{} #{}: no outcome",
                self.kind.name(),
                self.seq
            )))
        })
    }
}

impl Drop for LocalRequest {
    fn drop(&mut self) {
        self.release();
    }
}

/// The element types, for the arithmetic of the reductions.
trait Value: Copy {
    fn slice(b: &Buffer) -> Option<&[Self]>;
    fn buffer(v: Vec<Self>) -> Buffer;
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
}

impl Value for f32 {
    fn slice(b: &Buffer) -> Option<&[f32]> {
        match b {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }

    fn buffer(v: Vec<f32>) -> Buffer {
        Buffer::F32(v)
    }

    /// Max keeps `a` unless `b > a` (C's comparison: a NaN in `a` stays,
    /// one in `b` is skipped).
    fn combine(op: ReduceOp, a: f32, b: f32) -> f32 {
        match op {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => {
                if b > a {
                    b
                } else {
                    a
                }
            }
        }
    }
}

impl Value for u32 {
    fn slice(b: &Buffer) -> Option<&[u32]> {
        match b {
            Buffer::U32(v) => Some(v),
            _ => None,
        }
    }

    fn buffer(v: Vec<u32>) -> Buffer {
        Buffer::U32(v)
    }

    /// Sums wrap, as C's unsigned arithmetic (and MPI) does.
    fn combine(op: ReduceOp, a: u32, b: u32) -> u32 {
        match op {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
        }
    }
}

impl Value for u8 {
    fn slice(b: &Buffer) -> Option<&[u8]> {
        match b {
            Buffer::U8(v) => Some(v),
            _ => None,
        }
    }

    fn buffer(v: Vec<u8>) -> Buffer {
        Buffer::U8(v)
    }

    fn combine(op: ReduceOp, a: u8, b: u8) -> u8 {
        match op {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => a.max(b),
        }
    }
}

/// Every rank's result of one collective, from every rank's contribution
/// (validated, and agreeing, in rank order).
fn compute(ops: Vec<Collective>, size: usize) -> Result<Vec<Buffer>, DistError> {
    if ops.len() != size {
        return Err(DistError::Backend(format!(
            "{} contributions for {size} ranks",
            ops.len()
        )));
    }
    match ops.first().and_then(Collective::elem) {
        None => Ok((0..size).map(|_| Buffer::U8(Vec::new())).collect()),
        Some(Elem::F32) => compute_typed::<f32>(&ops),
        Some(Elem::U32) => compute_typed::<u32>(&ops),
        Some(Elem::U8) => compute_typed::<u8>(&ops),
    }
}

/// The values a rank contributes.
fn data<T: Value>(op: &Collective) -> Option<&[T]> {
    match op {
        Collective::Barrier => Some(&[]),
        Collective::Broadcast { buf, .. } | Collective::AllReduce { buf, .. } => T::slice(buf),
        Collective::AllGather { send, .. }
        | Collective::ReduceScatter { send, .. }
        | Collective::AllToAllV { send, .. } => T::slice(send),
    }
}

fn compute_typed<T: Value>(ops: &[Collective]) -> Result<Vec<Buffer>, DistError> {
    let size = ops.len();
    let bad = || DistError::Backend("contributions of mixed kinds or types".into());
    let inputs: Vec<&[T]> = ops
        .iter()
        .map(|op| data::<T>(op).ok_or_else(bad))
        .collect::<Result<_, _>>()?;
    // The element-wise reduction of `range` of every input, in rank order.
    let reduce = |op: ReduceOp, range: std::ops::Range<usize>| -> Result<Vec<T>, DistError> {
        let mut acc = inputs[0].get(range.clone()).ok_or_else(bad)?.to_vec();
        for x in &inputs[1..] {
            let x = x.get(range.clone()).ok_or_else(bad)?;
            for (a, &b) in acc.iter_mut().zip(x) {
                *a = T::combine(op, *a, b);
            }
        }
        Ok(acc)
    };
    let same_for_all =
        |v: Vec<T>| -> Vec<Buffer> { (0..size).map(|_| T::buffer(v.clone())).collect() };
    match &ops[0] {
        Collective::Barrier => Ok((0..size).map(|_| Buffer::U8(Vec::new())).collect()),
        Collective::Broadcast { root, .. } => {
            let src = inputs.get(*root).ok_or_else(bad)?;
            Ok(same_for_all(src.to_vec()))
        }
        Collective::AllReduce { op, .. } => Ok(same_for_all(reduce(*op, 0..inputs[0].len())?)),
        Collective::AllGather { counts, .. } => {
            let mut all = Vec::with_capacity(counts.iter().sum());
            for x in &inputs {
                all.extend_from_slice(x);
            }
            Ok(same_for_all(all))
        }
        Collective::ReduceScatter { counts, op, .. } => {
            let mut off = 0;
            let mut out = Vec::with_capacity(size);
            for &c in counts {
                out.push(T::buffer(reduce(*op, off..off + c)?));
                off += c;
            }
            Ok(out)
        }
        Collective::AllToAllV { .. } => {
            let send_counts = |op: &Collective| -> Result<Vec<usize>, DistError> {
                match op {
                    Collective::AllToAllV { send_counts, .. } => Ok(send_counts.clone()),
                    _ => Err(bad()),
                }
            };
            let counts: Vec<Vec<usize>> = ops.iter().map(send_counts).collect::<Result<_, _>>()?;
            let mut out = Vec::with_capacity(size);
            for dst in 0..size {
                let mut v = Vec::new();
                for (src, x) in inputs.iter().enumerate() {
                    let c = &counts[src];
                    let off: usize = c[..dst].iter().sum();
                    v.extend_from_slice(x.get(off..off + c[dst]).ok_or_else(bad)?);
                }
                out.push(T::buffer(v));
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CommExt;

    #[test]
    fn one_rank_world() {
        let w = world(1, Duration::from_secs(1));
        let c = &w[0];
        assert_eq!((c.rank(), c.size()), (0, 1));
        let mut x = [1.0, 2.0];
        c.all_reduce_sum(&mut x).unwrap();
        assert_eq!(x, [1.0, 2.0]);
        c.barrier().unwrap();
        assert!(world(0, Duration::from_secs(1)).is_empty());
    }

    #[test]
    fn slots_are_freed() {
        let w = local_world(2, Duration::from_secs(5));
        std::thread::scope(|s| {
            for c in &w {
                s.spawn(move || {
                    for i in 0..10 {
                        let r = c.post(Collective::Barrier).unwrap();
                        if i % 2 == 0 {
                            r.wait().unwrap();
                        } else {
                            drop(r);
                        }
                    }
                    // A malformed post on one rank fails the other's too.
                    let bad = Collective::AllGather {
                        send: Buffer::F32(vec![1.0]),
                        counts: vec![c.rank(); 2],
                    };
                    let r = c.post(bad);
                    if c.rank() == 1 {
                        assert!(matches!(r.unwrap().wait(), Err(DistError::Mismatch(_))));
                    } else {
                        assert!(matches!(r, Err(DistError::Mismatch(_))));
                    }
                    c.barrier().unwrap();
                });
            }
        });
        let st = lock(&w[0].group.state);
        assert!(
            st.slots.is_empty(),
            "slots left: {:?}",
            st.slots.keys().collect::<Vec<_>>()
        );
        assert!(st.children.is_empty());
    }
}
