//! The MPI backend (feature `mpi`): one rank per process, on Open MPI
//! through rsmpi.
//!
//! [`MpiRuntime::init`] initialises MPI (at least `MPI_THREAD_SERIALIZED`)
//! and returns the world communicator; the runtime finalizes MPI when it
//! is dropped, so it must live until the end of the program, after every
//! communicator and request.
//!
//! Collectives are MPI's non-blocking ones (`MPI_Ibcast`,
//! `MPI_Iallreduce`, `MPI_Iallgatherv`, `MPI_Ireduce_scatter`,
//! `MPI_Ialltoallv`, `MPI_Ibarrier`) through rsmpi's raw FFI. A request
//! owns everything MPI reads or writes until completion: the send and
//! receive buffers (the `Vec`s' heap storage, which does not move when
//! the request moves) and the count and displacement arrays (MPI reads
//! them during the operation, not only at the post). [`Request::test`] is
//! one `MPI_Test`; [`Request::wait`] calls `MPI_Test` until a deadline
//! (the communicator's timeout), spinning a few hundred times, then
//! yielding, then sleeping tens of microseconds between tests, so that a
//! waiting rank leaves the cores to a rank still computing (oversubscribed
//! hosts, or compute threads beside the communicating one). A request
//! dropped before completion is waited for (up to the timeout); if it
//! still has not completed, its buffers are leaked rather than freed
//! under MPI's feet.
//!
//! Every MPI call of the process goes through one `Mutex`, so that the
//! communicators are `Sync` with `MPI_THREAD_SERIALIZED`: two threads may
//! post and test, never at once. Errors come back as return codes (the
//! communicators use `MPI_ERRORS_RETURN`) and become
//! [`DistError::Backend`]. Open MPI has no progress thread: a request
//! moves only while some thread is inside MPI, so test requests between
//! their post and their wait.
//!
//! Unlike the in-process backend, this one cannot see which rank is
//! missing from a collective that does not complete, nor check that the
//! ranks agree about counts (MPI reports what it can, as backend errors);
//! a dead peer usually makes `mpirun` end the whole job.

use crate::comm::{Buffer, Collective, Comm, Elem, Kind, ReduceOp, Request};
use crate::error::DistError;
use ::mpi::environment::{Threading, Universe};
use ::mpi::ffi;
use ::mpi::topology::{Color, Communicator, SimpleCommunicator};
use ::mpi::traits::AsRaw;
use std::ffi::{c_int, c_void};
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};

/// Serialises every MPI call of the process (`MPI_THREAD_SERIALIZED`).
static MPI_LOCK: Mutex<()> = Mutex::new(());

fn mpi_lock() -> MutexGuard<'static, ()> {
    MPI_LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The MPI library of the process: finalizes MPI when dropped.
pub struct MpiRuntime {
    universe: Option<Universe>,
}

impl MpiRuntime {
    /// Initialises MPI with `MPI_THREAD_SERIALIZED` and returns the
    /// runtime (keep it until the end of the program) and the world
    /// communicator, whose waits last at most `timeout`.
    ///
    /// # Errors
    /// [`DistError::Backend`] when MPI was already initialised, provides
    /// less than `MPI_THREAD_SERIALIZED`, or fails.
    pub fn init(timeout: Duration) -> Result<(MpiRuntime, Arc<dyn Comm>), DistError> {
        let guard = mpi_lock();
        let (universe, provided) = ::mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| {
                DistError::Backend("MPI is already initialised in this process".into())
            })?;
        if provided < Threading::Serialized {
            // Dropping the universe finalizes MPI.
            drop(universe);
            return Err(DistError::Backend(format!(
                "MPI provides threading level {provided:?}; kvant needs Serialized"
            )));
        }
        let handle = CommHandle::new(SimpleCommunicator::world());
        drop(guard);
        // On an error from here, dropping the runtime finalizes MPI.
        let runtime = MpiRuntime {
            universe: Some(universe),
        };
        let handle = handle?;
        let comm: Arc<dyn Comm> = Arc::new(MpiComm {
            handle: Arc::new(handle),
            timeout,
        });
        Ok((runtime, comm))
    }
}

impl Drop for MpiRuntime {
    fn drop(&mut self) {
        let _g = mpi_lock();
        // Finalizes MPI (rsmpi's `Universe::drop`).
        drop(self.universe.take());
    }
}

/// `Err` with MPI's message for a return code other than `MPI_SUCCESS`.
/// Call with [`MPI_LOCK`] held.
fn check(code: c_int, what: &str) -> Result<(), DistError> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: `text` has room for MPI_MAX_ERROR_STRING characters and the
    // terminator, as MPI_Error_string requires; `len` is a valid int. The
    // caller holds MPI_LOCK (serialised calls).
    let rc = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast(), &mut len) };
    let message = if rc == ffi::MPI_SUCCESS as c_int {
        let n = usize::try_from(len).unwrap_or(0).min(text.len());
        String::from_utf8_lossy(&text[..n]).into_owned()
    } else {
        "unknown error".to_string()
    };
    Err(DistError::Backend(format!(
        "{what}: MPI error {code}: {message}"
    )))
}

/// `Err` when MPI is finalized (calling it then is erroneous). Call with
/// [`MPI_LOCK`] held.
fn alive(what: &str) -> Result<(), DistError> {
    if ::mpi::is_finalized() {
        return Err(DistError::Backend(format!(
            "{what}: MPI is already finalized"
        )));
    }
    Ok(())
}

/// One MPI communicator, freed (when it is not the world's) on drop.
struct CommHandle {
    comm: ManuallyDrop<SimpleCommunicator>,
    raw: ffi::MPI_Comm,
    rank: usize,
    size: usize,
}

// SAFETY: an MPI communicator handle is a process-wide object, not bound
// to the thread that created it, and the MPI library was initialised with
// MPI_THREAD_SERIALIZED, which allows calls from any thread provided no
// two run at once. Every use of `comm` and `raw` (the MPI calls of this
// module, and the drop) happens with MPI_LOCK held, so sending the handle
// to another thread or sharing it between threads never lets two threads
// call MPI at once.
unsafe impl Send for CommHandle {}
// SAFETY: as for `Send`: all access goes through MPI_LOCK.
unsafe impl Sync for CommHandle {}

impl CommHandle {
    /// Wraps `comm`, making its errors return codes. Call with
    /// [`MPI_LOCK`] held.
    fn new(comm: SimpleCommunicator) -> Result<CommHandle, DistError> {
        let raw = comm.as_raw();
        // SAFETY: `raw` is the live communicator `comm` owns, and
        // RSMPI_ERRORS_RETURN a predefined error handler; the caller holds
        // MPI_LOCK.
        check(
            unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) },
            "MPI_Comm_set_errhandler",
        )?;
        let rank = usize::try_from(comm.rank())
            .map_err(|_| DistError::Backend(format!("MPI rank {}", comm.rank())))?;
        let size = usize::try_from(comm.size())
            .map_err(|_| DistError::Backend(format!("MPI size {}", comm.size())))?;
        Ok(CommHandle {
            comm: ManuallyDrop::new(comm),
            raw,
            rank,
            size,
        })
    }
}

impl Drop for CommHandle {
    fn drop(&mut self) {
        let _g = mpi_lock();
        if !::mpi::is_finalized() {
            // SAFETY: `comm` is dropped exactly once, here, while MPI is
            // still initialised (freeing a communicator after
            // MPI_Finalize would be erroneous); MPI_LOCK is held.
            unsafe { ManuallyDrop::drop(&mut self.comm) };
        }
        // After MPI_Finalize the handle is left as it is: there is
        // nothing left to free it with.
    }
}

/// A communicator of the MPI backend.
struct MpiComm {
    handle: Arc<CommHandle>,
    timeout: Duration,
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.handle.rank
    }

    fn size(&self) -> usize {
        self.handle.size
    }

    fn post(&self, op: Collective) -> Result<Box<dyn Request>, DistError> {
        let (rank, size) = (self.rank(), self.size());
        op.validate(rank, size)?;
        let kind = op.kind();
        let mut pending = Pending::prepare(op, rank)?;
        {
            let _g = mpi_lock();
            alive(kind.name())?;
            // SAFETY: `pending` owns every buffer and array the call reads
            // or writes, sized by `prepare` to the counts it passes; they
            // stay alive and in place (heap storage) until MPI reports
            // completion or, failing that, are leaked (MpiRequest's drop).
            // The communicator is live (`self.handle`), MPI_LOCK is held.
            if let Err(e) = unsafe { pending.start(self.handle.raw) } {
                // Whether MPI took the buffers is unknown: keep them.
                std::mem::forget(pending);
                return Err(e);
            }
        }
        Ok(Box::new(MpiRequest {
            pending: Some(pending),
            result: None,
            handle: Arc::clone(&self.handle),
            timeout: self.timeout,
            kind,
        }))
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Comm>, DistError> {
        let color = c_int::try_from(color)
            .map_err(|_| DistError::Mismatch(format!("split color {color} is beyond MPI's int")))?;
        let key = c_int::try_from(key)
            .map_err(|_| DistError::Mismatch(format!("split key {key} is beyond MPI's int")))?;
        // MPI_Comm_split blocks without a deadline: meet the other ranks
        // first in a non-blocking exchange that does have one.
        let words = [color, key].map(|v| v as u32);
        self.post(Collective::AllGather {
            send: Buffer::U32(words.to_vec()),
            counts: vec![2; self.size()],
        })?
        .wait()?;
        let _g = mpi_lock();
        alive("MPI_Comm_split")?;
        let child = self
            .handle
            .comm
            .split_by_color_with_key(Color::with_value(color), key)
            .ok_or_else(|| DistError::Backend("MPI_Comm_split returned no communicator".into()))?;
        let handle = CommHandle::new(child)?;
        Ok(Arc::new(MpiComm {
            handle: Arc::new(handle),
            timeout: self.timeout,
        }))
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `MPI_Abort` on the world communicator: ends every process of the
    /// job. When another thread holds the MPI lock past the timeout (it
    /// is stuck inside MPI), the process exits with `code` instead, and
    /// `mpirun` ends the job because a rank exited without finalizing.
    fn abort(&self, code: i32) {
        let deadline = Instant::now() + self.timeout.min(Duration::from_secs(10));
        let guard = loop {
            match MPI_LOCK.try_lock() {
                Ok(g) => break Some(g),
                Err(TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(TryLockError::WouldBlock) => break None,
            }
        };
        if let Some(_g) = guard {
            if !::mpi::is_finalized() {
                // SAFETY: MPI is initialised and not finalized, the lock is
                // held, and MPI_COMM_WORLD is a predefined communicator.
                unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
            }
        } else {
            eprintln!("kvant-dist: another thread is stuck inside MPI; exiting with code {code}");
        }
        std::process::exit(code);
    }
}

/// The MPI datatype of `e`.
fn datatype(e: Elem) -> ffi::MPI_Datatype {
    // SAFETY: reading constants that rsmpi's C shim defines (initialised
    // at load time, never written).
    unsafe {
        match e {
            Elem::F32 => ffi::RSMPI_FLOAT,
            Elem::U32 => ffi::RSMPI_UINT32_T,
            Elem::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: as in `datatype`.
    unsafe {
        match op {
            ReduceOp::Sum => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
        }
    }
}

fn ptr(b: &Buffer) -> *const c_void {
    match b {
        Buffer::F32(v) => v.as_ptr().cast(),
        Buffer::U32(v) => v.as_ptr().cast(),
        Buffer::U8(v) => v.as_ptr().cast(),
    }
}

fn ptr_mut(b: &mut Buffer) -> *mut c_void {
    match b {
        Buffer::F32(v) => v.as_mut_ptr().cast(),
        Buffer::U32(v) => v.as_mut_ptr().cast(),
        Buffer::U8(v) => v.as_mut_ptr().cast(),
    }
}

/// `b`, or for an empty buffer one with a real allocation. An empty
/// `Vec` points to its alignment (`0x1` for bytes), and Open MPI's
/// `MPI_IN_PLACE` *is* `(void*)1`: passed as a send buffer it would mean
/// "in place", and `MPI_Ibcast` refuses it. Heap memory is never there.
fn allocated(b: Buffer) -> Buffer {
    if b.is_empty() {
        Buffer::with_capacity(b.elem(), 1)
    } else {
        b
    }
}

/// `n` as an MPI count.
fn count(n: usize, what: &str) -> Result<c_int, DistError> {
    c_int::try_from(n).map_err(|_| {
        DistError::Mismatch(format!("{what}: {n} elements is beyond MPI's int counts"))
    })
}

/// Counts and their displacements (running sums) as MPI ints; the total
/// must fit too.
fn counts_and_displacements(
    c: &[usize],
    what: &str,
) -> Result<(Vec<c_int>, Vec<c_int>), DistError> {
    let mut counts = Vec::with_capacity(c.len());
    let mut displs = Vec::with_capacity(c.len());
    let mut off = 0usize;
    for &n in c {
        displs.push(count(off, what)?);
        counts.push(count(n, what)?);
        off = off
            .checked_add(n)
            .ok_or_else(|| DistError::Mismatch(format!("{what}: counts overflow")))?;
    }
    count(off, what)?;
    Ok((counts, displs))
}

/// The collective MPI is to run, with everything it reads and writes.
struct Pending {
    op: PendingOp,
    raw: ffi::MPI_Request,
    /// What this rank contributes (unused by a broadcast, which works in
    /// `recv`).
    send: Buffer,
    /// The result.
    recv: Buffer,
    /// Counts and displacements, per the operation.
    ints: [Vec<c_int>; 4],
}

enum PendingOp {
    Barrier,
    Broadcast { root: c_int },
    AllReduce { op: ReduceOp },
    AllGather,
    ReduceScatter { op: ReduceOp },
    AllToAllV,
}

// SAFETY: the MPI request handle is a process-wide object, usable from
// any thread under MPI_THREAD_SERIALIZED; this module touches it only
// with MPI_LOCK held. The buffers are plain owned vectors.
unsafe impl Send for Pending {}

impl Pending {
    /// Allocates the result and the MPI count arrays for `op` (valid, on
    /// `rank`); no MPI call.
    fn prepare(op: Collective, rank: usize) -> Result<Pending, DistError> {
        let what = op.kind().name();
        let elem = op.elem().unwrap_or(Elem::U8);
        let empty = || Buffer::U8(Vec::new());
        let (op, send, recv, ints) = match op {
            Collective::Barrier => (PendingOp::Barrier, empty(), empty(), Default::default()),
            Collective::Broadcast { buf, root } => {
                count(buf.len(), what)?;
                let root = count(root, what)?;
                (
                    PendingOp::Broadcast { root },
                    empty(),
                    buf,
                    Default::default(),
                )
            }
            Collective::AllReduce { buf, op } => {
                count(buf.len(), what)?;
                let recv = Buffer::zeros(elem, buf.len());
                (PendingOp::AllReduce { op }, buf, recv, Default::default())
            }
            Collective::AllGather { send, counts } => {
                let (c, d) = counts_and_displacements(&counts, what)?;
                let recv = Buffer::zeros(elem, counts.iter().sum());
                (
                    PendingOp::AllGather,
                    send,
                    recv,
                    [c, d, Vec::new(), Vec::new()],
                )
            }
            Collective::ReduceScatter { send, counts, op } => {
                let (c, _) = counts_and_displacements(&counts, what)?;
                let mine = counts.get(rank).copied().unwrap_or(0);
                let recv = Buffer::zeros(elem, mine);
                (
                    PendingOp::ReduceScatter { op },
                    send,
                    recv,
                    [c, Vec::new(), Vec::new(), Vec::new()],
                )
            }
            Collective::AllToAllV {
                send,
                send_counts,
                recv_counts,
            } => {
                let (sc, sd) = counts_and_displacements(&send_counts, what)?;
                let (rc, rd) = counts_and_displacements(&recv_counts, what)?;
                let recv = Buffer::zeros(elem, recv_counts.iter().sum());
                (PendingOp::AllToAllV, send, recv, [sc, sd, rc, rd])
            }
        };
        Ok(Pending {
            op,
            send: allocated(send),
            recv: allocated(recv),
            // SAFETY: reading a constant of rsmpi's C shim.
            raw: unsafe { ffi::RSMPI_REQUEST_NULL },
            ints,
        })
    }

    /// Starts the non-blocking collective on `comm`.
    ///
    /// # Safety
    /// MPI_LOCK must be held, MPI initialised and not finalized, `comm` a
    /// live communicator of the ranks `prepare` was called for, and
    /// `self` must not be dropped (only leaked) before `MPI_Test` reports
    /// completion: MPI reads `send` and `ints` and writes `recv` until then.
    unsafe fn start(&mut self, comm: ffi::MPI_Comm) -> Result<(), DistError> {
        let dt = datatype(self.recv.elem());
        let send = ptr(&self.send);
        let n_send = count(self.send.len(), "send")?;
        let n_recv = count(self.recv.len(), "receive")?;
        let recv = ptr_mut(&mut self.recv);
        let [a, b, c, d] = &self.ints;
        let req: *mut ffi::MPI_Request = &mut self.raw;
        // SAFETY (for each call): the pointers address the owned buffers
        // and arrays, whose lengths match the counts passed (`prepare`
        // sized `recv` from the same counts, `validate` checked `send`
        // against them); the caller upholds the rest.
        let (rc, name) = match self.op {
            PendingOp::Barrier => (unsafe { ffi::MPI_Ibarrier(comm, req) }, "MPI_Ibarrier"),
            PendingOp::Broadcast { root } => (
                unsafe { ffi::MPI_Ibcast(recv, n_recv, dt, root, comm, req) },
                "MPI_Ibcast",
            ),
            PendingOp::AllReduce { op } => (
                unsafe { ffi::MPI_Iallreduce(send, recv, n_send, dt, mpi_op(op), comm, req) },
                "MPI_Iallreduce",
            ),
            PendingOp::AllGather => (
                unsafe {
                    ffi::MPI_Iallgatherv(
                        send,
                        n_send,
                        dt,
                        recv,
                        a.as_ptr(),
                        b.as_ptr(),
                        dt,
                        comm,
                        req,
                    )
                },
                "MPI_Iallgatherv",
            ),
            PendingOp::ReduceScatter { op } => (
                unsafe {
                    ffi::MPI_Ireduce_scatter(send, recv, a.as_ptr(), dt, mpi_op(op), comm, req)
                },
                "MPI_Ireduce_scatter",
            ),
            PendingOp::AllToAllV => (
                unsafe {
                    ffi::MPI_Ialltoallv(
                        send,
                        a.as_ptr(),
                        b.as_ptr(),
                        dt,
                        recv,
                        c.as_ptr(),
                        d.as_ptr(),
                        dt,
                        comm,
                        req,
                    )
                },
                "MPI_Ialltoallv",
            ),
        };
        check(rc, name)
    }
}

/// A posted MPI collective.
struct MpiRequest {
    /// Until completion.
    pending: Option<Pending>,
    /// After completion, until the wait.
    result: Option<Buffer>,
    /// Keeps the communicator alive while the collective runs.
    handle: Arc<CommHandle>,
    timeout: Duration,
    kind: Kind,
}

/// Spins, then yields, then sleeps between tests.
struct Backoff(u32);

impl Backoff {
    const SPINS: u32 = 300;
    const YIELDS: u32 = 100;
    const SLEEP: Duration = Duration::from_micros(30);

    fn snooze(&mut self) {
        if self.0 < Self::SPINS {
            for _ in 0..16 {
                std::hint::spin_loop();
            }
        } else if self.0 < Self::SPINS + Self::YIELDS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Self::SLEEP);
        }
        self.0 = self.0.saturating_add(1);
    }
}

impl MpiRequest {
    /// One `MPI_Test`: whether the collective is complete.
    fn test_once(&mut self) -> Result<bool, DistError> {
        if self.result.is_some() {
            return Ok(true);
        }
        let Some(p) = self.pending.as_mut() else {
            return Err(DistError::Backend(format!(
                "{}: the request failed before",
                self.kind.name()
            )));
        };
        let mut flag: c_int = 0;
        let rc = {
            let _g = mpi_lock();
            if let Err(e) = alive(self.kind.name()) {
                self.leak();
                return Err(e);
            }
            // SAFETY: `p.raw` is the active request `start` made, `flag` a
            // valid int, RSMPI_STATUS_IGNORE MPI's "no status"; MPI_LOCK is
            // held.
            let rc = unsafe { ffi::MPI_Test(&mut p.raw, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
            check(rc, "MPI_Test")
        };
        if let Err(e) = rc {
            // Whether MPI still uses the buffers is unknown: keep them.
            self.leak();
            return Err(e);
        }
        if flag == 0 {
            return Ok(false);
        }
        if let Some(p) = self.pending.take() {
            self.result = Some(p.recv);
        }
        Ok(true)
    }

    /// Tests until complete or `deadline`.
    fn test_until(&mut self, deadline: Instant) -> Result<bool, DistError> {
        let mut backoff = Backoff(0);
        loop {
            if self.test_once()? {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            backoff.snooze();
        }
    }

    /// Gives up a collective that may still run: MPI may still read and
    /// write its buffers, so they are never freed.
    fn leak(&mut self) {
        if let Some(p) = self.pending.take() {
            std::mem::forget(p);
        }
    }
}

impl Request for MpiRequest {
    fn test(&mut self) -> Result<bool, DistError> {
        self.test_once()
    }

    fn wait(mut self: Box<Self>) -> Result<Buffer, DistError> {
        let deadline = Instant::now() + self.timeout;
        if !self.test_until(deadline)? {
            self.leak();
            return Err(DistError::Timeout {
                what: format!(
                    "{} on an MPI communicator (rank {} of {}; MPI cannot tell which ranks did not join)",
                    self.kind.name(),
                    self.handle.rank,
                    self.handle.size
                ),
                after: self.timeout,
            });
        }
        self.result
            .take()
            .ok_or_else(|| DistError::Backend(format!("{}: no result", self.kind.name())))
    }
}

impl Drop for MpiRequest {
    fn drop(&mut self) {
        if self.pending.is_some() {
            let deadline = Instant::now() + self.timeout;
            // An error leaks the buffers already; nothing else to report.
            if !matches!(self.test_until(deadline), Ok(true)) {
                self.leak();
            }
        }
    }
}
