//! A rank's place in a parallel run and the communication of its forward
//! pass: tensor-parallel sums, the gathers of a data-parallel group, and
//! the all-to-alls of expert parallelism.
//!
//! The forward pass is written as `async` code whose only suspension
//! points are collectives: `post` the collective, `await` it. With one
//! micro-batch the awaits complete as they come (post, then wait). With
//! two (two-batch overlap), [`drive`] polls both in turn, so while one
//! waits for its all-reduce or its experts' tokens, the other computes;
//! the async functions are the coroutines SGLang's two-batch overlap
//! builds from its yield points. Polling is also what drives MPI's
//! progress (Open MPI has no progress thread): every poll of a pending
//! collective tests it, between one micro-batch's operations and the
//! next. Each micro-batch posts on its own communicators ([`Streams`]),
//! so the two may post in any interleaving on different ranks without
//! breaking MPI's rule that a communicator's collectives are posted in
//! the same order everywhere.

use crate::ModelError;
use kvant_dist::layout::Coords;
use kvant_dist::{Buffer, Collective, Comm, DistError, Layout, ReduceOp, Request};
use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// One micro-batch's communicators.
pub struct Streams {
    /// The tensor-parallel group (attention heads, FFN columns, vocabulary).
    pub tp: Arc<dyn Comm>,
    /// The data-parallel group: every rank holding the same tokens.
    pub group: Arc<dyn Comm>,
    /// Every rank: expert-parallel dispatch and combine.
    pub world: Arc<dyn Comm>,
}

/// A rank's layout and communicators.
pub struct Parallel {
    pub layout: Layout,
    pub coords: Coords,
    /// The world, for what runs outside the forward pass (the step plan,
    /// the logits).
    pub world: Arc<dyn Comm>,
    /// Per micro-batch.
    streams: [Streams; 2],
    /// Split each rank's batch into two micro-batches whose communication
    /// overlaps the other's compute.
    pub two_batch_overlap: bool,
    /// Nanoseconds forward passes spent with every micro-batch waiting on
    /// a collective: the communication no compute hid.
    exposed_ns: AtomicU64,
}

impl Parallel {
    pub(crate) fn exposed_counter(&self) -> &AtomicU64 {
        &self.exposed_ns
    }

    /// Splits `world` into the groups `layout` needs, twice (one set per
    /// micro-batch). Collective: every rank calls it with the same layout.
    ///
    /// # Errors
    /// [`DistError::Mismatch`] when `world`'s size is not the layout's,
    /// else what the splits return.
    pub fn new(
        world: Arc<dyn Comm>,
        layout: Layout,
        two_batch_overlap: bool,
    ) -> Result<Parallel, DistError> {
        if world.size() != layout.world {
            return Err(DistError::Mismatch(format!(
                "a layout for {} ranks on a communicator of {}",
                layout.world,
                world.size()
            )));
        }
        let rank = world.rank();
        let coords = layout.coords(rank);
        let streams = |_| -> Result<Streams, DistError> {
            Ok(Streams {
                tp: world.split(rank / layout.tp, rank)?,
                group: world.split(coords.dp, rank)?,
                world: world.split(0, rank)?,
            })
        };
        let streams = [streams(0)?, streams(1)?];
        Ok(Parallel {
            layout,
            coords,
            world,
            streams,
            two_batch_overlap,
            exposed_ns: AtomicU64::new(0),
        })
    }

    /// The time forward passes spent waiting on collectives with nothing
    /// to compute (communication not hidden), since the last call.
    pub fn take_exposed(&self) -> Duration {
        Duration::from_nanos(self.exposed_ns.swap(0, Ordering::Relaxed))
    }

    pub fn rank(&self) -> usize {
        self.coords.rank
    }

    pub(crate) fn streams(&self, micro_batch: usize) -> &Streams {
        &self.streams[micro_batch.min(1)]
    }
}

/// A posted collective as a future: each poll tests it.
struct Pending(Option<Box<dyn Request>>);

thread_local! {
    /// Whether a task got past a collective (or its turn) in the current
    /// round of [`drive`], and so computed.
    static PROGRESS: Cell<bool> = const { Cell::new(false) };
}

/// A suspension point is over: the task computes again.
fn progressed() {
    PROGRESS.with(|p| p.set(true));
}

impl Future for Pending {
    type Output = Result<Buffer, DistError>;

    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(mut req) = self.0.take() else {
            let twice = DistError::Mismatch("a collective awaited twice".into());
            return Poll::Ready(Err(twice));
        };
        match req.test() {
            Err(e) => Poll::Ready(Err(e)),
            Ok(true) => {
                progressed();
                Poll::Ready(req.wait())
            }
            Ok(false) => {
                self.0 = Some(req);
                Poll::Pending
            }
        }
    }
}

/// Posts `op` on `comm` now; the returned future completes it (what the
/// caller computes before awaiting overlaps the transfer).
pub(crate) fn posted(
    comm: &dyn Comm,
    op: Collective,
) -> Result<impl Future<Output = Result<Buffer, DistError>>, ModelError> {
    Ok(Pending(Some(comm.post(op)?)))
}

/// Posts `op` on `comm` and waits for it, suspending the micro-batch
/// meanwhile.
pub(crate) async fn collective(comm: &dyn Comm, op: Collective) -> Result<Buffer, ModelError> {
    Ok(posted(comm, op)?.await?)
}

/// The order of two micro-batches' attention: the second may run a
/// layer's attention only after the first has (its tokens may continue
/// the first's sequence, whose keys it reads from the cache).
#[derive(Default)]
pub(crate) struct Order {
    /// Layers whose attention the first micro-batch has run.
    first_done: Cell<usize>,
}

impl Order {
    /// Marks the first micro-batch's attention of layer `index` done.
    pub fn done(&self, index: usize) {
        self.first_done.set(self.first_done.get().max(index + 1));
    }

    /// Ready once the first micro-batch has run layer `index`'s attention.
    pub fn after_first(&self, index: usize) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |_| match self.first_done.get() > index {
            true => {
                progressed();
                Poll::Ready(())
            }
            false => Poll::Pending,
        })
    }
}

/// What one micro-batch's layers communicate through.
pub(crate) struct Net<'a> {
    /// `None` in a single process: nothing is communicated.
    pub par: Option<(&'a Parallel, &'a Streams)>,
    /// Two micro-batches: this one's place and their shared order.
    pub order: Option<(usize, &'a Order)>,
}

impl<'a> Net<'a> {
    /// The single-process net: every collective is a no-op.
    pub const LOCAL: Net<'static> = Net {
        par: None,
        order: None,
    };

    /// Sums `x` over the tensor-parallel group, in place.
    pub async fn tp_sum(&self, x: &mut [f32]) -> Result<(), ModelError> {
        let Some((_, s)) = self.par.filter(|(p, _)| p.layout.tp > 1) else {
            return Ok(());
        };
        let op = Collective::AllReduce {
            buf: Buffer::F32(x.to_vec()),
            op: ReduceOp::Sum,
        };
        Ok(collective(&*s.tp, op).await?.copy_to_f32(x)?)
    }

    /// Waits, if this is the second of two micro-batches, until the first
    /// has run layer `index`'s attention.
    pub async fn before_attention(&self, index: usize) {
        if let Some((1, order)) = self.order {
            order.after_first(index).await;
        }
    }

    /// Marks, if this is the first of two micro-batches, layer `index`'s
    /// attention done.
    pub fn after_attention(&self, index: usize) {
        if let Some((0, order)) = self.order {
            order.done(index);
        }
    }
}

/// A micro-batch's forward pass, pinned where its caller keeps it (on the
/// stack: no allocation per pass) so that two of any shape can be driven
/// together.
pub(crate) type Task<'p, 'a> = Pin<&'p mut (dyn Future<Output = Result<(), ModelError>> + 'a)>;

/// Runs `tasks` to completion, polling each in turn (see the module
/// docs); returns the first error. The time every task waited on a
/// collective is added to `exposed`. While every task waits, it keeps
/// testing (the real transport underneath, MPI, moves data only when
/// tested) and yields the core now and then: a rank per core waits by
/// polling, as MPI does (sleeping instead made the next compute slower
/// here, by up to a third on a VM whose idle cores are descheduled).
///
/// # Panics
/// With more than 64 tasks (a pass has one or two micro-batches).
pub(crate) fn drive(
    tasks: &mut [Task<'_, '_>],
    exposed: Option<&AtomicU64>,
) -> Result<(), ModelError> {
    let mut cx = Context::from_waker(Waker::noop());
    assert!(tasks.len() <= 64, "at most 64 tasks");
    // Bit `t`: task `t` has finished.
    let mut done = 0u64;
    let mut spins = 0u32;
    let mut blocked_since: Option<Instant> = None;
    // A task's first poll computes up to its first collective.
    let mut first = true;
    loop {
        let round = Instant::now();
        PROGRESS.with(|p| p.set(first));
        first = false;
        for (i, t) in tasks.iter_mut().enumerate() {
            if done & (1 << i) != 0 {
                continue;
            }
            if let Poll::Ready(r) = t.as_mut().poll(&mut cx) {
                r?;
                done |= 1 << i;
            }
        }
        let computed = PROGRESS.with(Cell::get);
        if let (true, Some(since), Some(e)) = (computed, blocked_since, exposed) {
            let ns = u64::try_from(round.saturating_duration_since(since).as_nanos());
            e.fetch_add(ns.unwrap_or(u64::MAX), Ordering::Relaxed);
        }
        if done.count_ones() as usize == tasks.len() {
            return Ok(());
        }
        if computed {
            blocked_since = None;
            spins = 0;
            continue;
        }
        blocked_since.get_or_insert(round);
        spins += 1;
        if spins > SPINS_BEFORE_YIELD {
            std::thread::yield_now();
        }
    }
}

/// Tests [`drive`] makes before it starts yielding the core between them.
const SPINS_BEFORE_YIELD: u32 = 64;
