//! One persistent, spinning thread pool for the process.
//!
//! A decode step of a 30-layer model runs a few hundred parallel kernels of
//! a few microseconds each, so the cost of starting and joining one is the
//! whole game: rayon's fork-join (6–20 µs measured here, with a parked
//! worker's futex wake on the critical path) cost more than it saved. As in
//! llama.cpp, workers here spin on a generation counter between jobs, so a
//! job reaches them in well under a microsecond, and only park after
//! [`SPIN`] of idleness (between requests, not between kernels).
//!
//! The spin adapts to the gaps between jobs ([`Shared::spin`]): a wait
//! that ends in parking starts the next at [`MIN_SPIN`], and each job
//! caught while spinning doubles it back up to [`SPIN`]. A decode loop,
//! whose gaps are microseconds, spins at [`SPIN`] after its first few
//! kernels; a caller whose jobs are milliseconds apart (training ops called
//! from PyTorch, one kvant op between torch ops) no longer leaves a worker
//! spinning for 2 ms against torch's own threads after each of its jobs.
//!
//! A job is `tasks` indices handed out by an atomic counter: whoever is
//! awake takes the next index, the caller included, so a worker that is
//! slow to wake never holds the caller up; the caller only waits for the
//! workers that actually joined (see [`Shared::active`]).
//!
//! Calls from inside a job, or while another thread's job is running (two
//! server threads, or tests running in parallel), run inline on the
//! calling thread: correct, never a deadlock, and the pool stays busy.

use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks: long enough to span the
/// serial gaps of a forward pass and sampling between tokens, short enough
/// that an idle process stops burning its cores at once.
const SPIN: Duration = Duration::from_millis(2);

/// The shortest spin, after a wait that ended in parking: covers the
/// back-to-back jobs of one kernel (norm then partial sums, FlashAttention's
/// three) so they still reach a spinning worker.
const MIN_SPIN: Duration = Duration::from_micros(50);

/// A job's work, borrowed for the duration of [`ThreadPool::run`].
type Job = dyn Fn(usize) + Sync;

/// State shared by the caller and the workers.
struct Shared {
    /// Bumped once per job; workers wait for it to change.
    generation: AtomicU64,
    /// The current job, valid while `open` (see [`ThreadPool::run`]).
    job: UnsafeCell<Option<&'static Job>>,
    tasks: AtomicUsize,
    next: AtomicUsize,
    /// Whether workers may still join the current job.
    open: AtomicBool,
    /// Workers inside the current job (joined and not yet left).
    active: AtomicUsize,
    /// Set when a task panicked; the caller re-raises after the join.
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Nanoseconds a waiting worker spins before it parks, between
    /// [`MIN_SPIN`] and [`SPIN`] (see the module doc); racy updates
    /// between workers only make one wait a little longer or shorter.
    spin: AtomicU64,
    /// Parking: a worker waits here once it has spun for `spin`.
    sleep: Mutex<()>,
    wake: Condvar,
    /// Workers parked (or about to park) on `wake`: a job notifies only
    /// when some are, so a decode step's jobs, whose workers all spin,
    /// skip the lock and the futex call (see [`ThreadPool::run`]).
    parked: AtomicUsize,
}

// SAFETY: `job` is written only by the submitting thread while it holds the
// pool's submit lock and no worker is active (`active == 0` with `open`
// false), and read by workers only after they registered in `active` and saw
// `open` (SeqCst), which orders the write before the read; every other field
// is atomic or a lock.
unsafe impl Sync for Shared {}

thread_local! {
    /// Set on pool workers and on a thread running a job, so nested calls run inline.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body` once on each of `threads` threads of another runtime's
/// team, the calling thread among them, and returns when all have
/// returned. See [`ThreadPool::on_team`].
pub type TeamRunner = fn(threads: usize, body: &(dyn Fn() + Sync));

/// A fixed set of worker threads plus the calling thread, or another
/// runtime's thread team ([`ThreadPool::on_team`]).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    submit: Mutex<()>,
    team: Option<(TeamRunner, usize)>,
}

impl ThreadPool {
    /// A pool with no threads of its own yet.
    fn bare() -> Self {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            open: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            spin: AtomicU64::new(SPIN.as_nanos() as u64),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            parked: AtomicUsize::new(0),
        });
        ThreadPool {
            shared,
            workers: Vec::new(),
            submit: Mutex::new(()),
            team: None,
        }
    }

    /// A pool running jobs on `threads` threads in all: the caller and
    /// `threads - 1` workers (none for 0 or 1).
    ///
    /// # Errors
    /// When the OS refuses to start a thread.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let mut pool = ThreadPool::bare();
        for i in 1..threads.max(1) {
            let s = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("kvant-worker-{i}"))
                .spawn(move || worker(&s))?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// A pool whose jobs run on `threads` threads of another runtime's
    /// team through `run`, with no threads of its own. For an embedding
    /// whose host keeps a team spinning between its own parallel regions
    /// (the Python package: torch's OpenMP threads spin about 5 ms after
    /// each torch op), so kvant's jobs run on those threads instead of
    /// competing with them for the cores. Tasks are handed out as in
    /// [`ThreadPool::run`]; nested calls run inline.
    pub fn on_team(threads: usize, run: TeamRunner) -> Self {
        let mut pool = ThreadPool::bare();
        pool.team = Some((run, threads.max(1)));
        pool
    }

    /// Threads that run a job: the workers and the caller (or the team).
    pub fn threads(&self) -> usize {
        match self.team {
            Some((_, n)) => n,
            None => self.workers.len() + 1,
        }
    }

    /// Runs `f(0) .. f(tasks - 1)`, each exactly once, spread over the pool;
    /// returns when all have finished. A panic in a task is re-raised here.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if tasks == 1 || IN_JOB.get() {
            return (0..tasks).for_each(f);
        }
        if let Some((team, threads)) = self.team {
            return run_on_team(team, threads, tasks, f);
        }
        if self.workers.is_empty() {
            return (0..tasks).for_each(f);
        }
        let _guard = match self.submit.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return (0..tasks).for_each(f),
        };
        let s = &*self.shared;
        // A worker that saw the previous job late may still be registering.
        while s.active.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: only the thread holding `submit` writes `job`, and no
        // worker reads it now: `open` is false and `active` is 0, and a
        // worker reads `job` only after registering in `active` and then
        // seeing `open` true, which happens after this write (SeqCst store
        // below). The `'static` lifetime is a lie confined to this call:
        // `f` outlives it because `run` returns only after `open` is false
        // again and `active` is back to 0, so no worker still holds `f`.
        unsafe {
            *s.job.get() = Some(std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f));
        }
        s.tasks.store(tasks, Relaxed);
        s.next.store(0, Relaxed);
        s.panicked.store(false, Relaxed);
        s.open.store(true, SeqCst);
        s.generation.fetch_add(1, SeqCst);
        // Wake parked workers, if any: a worker counts itself in `parked`
        // before its last check of `generation` (both SeqCst, as the bump
        // above and this load), so either it sees the new job or this sees
        // it parking; taking the lock orders the notify after that check.
        // Notifying unconditionally cost every job a futex system call on
        // the caller's critical path, workers spinning or not.
        if s.parked.load(SeqCst) > 0 {
            let _l = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        IN_JOB.set(true);
        let mine = catch_unwind(AssertUnwindSafe(|| take_tasks(s, f)));
        IN_JOB.set(false);
        s.open.store(false, SeqCst);
        while s.active.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(SeqCst) {
            panic!("a thread-pool task panicked");
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        self.shared.generation.fetch_add(1, SeqCst);
        {
            let _l = self.shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker only ends by returning; a join error would be a panic
            // outside a task, already reported by the runtime.
            let _ = w.join();
        }
    }
}

/// [`ThreadPool::run`] on a team: each team thread takes tasks from one
/// counter until it passes the end; the first panic is re-raised here once
/// every team thread has returned (a panic must not unwind through the
/// other runtime's frames).
fn run_on_team(team: TeamRunner, threads: usize, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    let next = AtomicUsize::new(0);
    let panic = Mutex::new(None);
    let body = || {
        let outer = IN_JOB.replace(true);
        let r = catch_unwind(AssertUnwindSafe(|| loop {
            let t = next.fetch_add(1, Relaxed);
            if t >= tasks {
                return;
            }
            f(t);
        }));
        IN_JOB.set(outer);
        if let Err(p) = r {
            // Skip what is left: the call fails anyway.
            next.store(tasks, Relaxed);
            panic
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(p);
        }
    };
    team(threads.min(tasks), &body);
    if let Some(p) = panic.into_inner().unwrap_or_else(|p| p.into_inner()) {
        resume_unwind(p);
    }
}

/// Runs tasks of the current job until the counter passes the end.
fn take_tasks(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let tasks = s.tasks.load(Relaxed);
    loop {
        let t = s.next.fetch_add(1, Relaxed);
        if t >= tasks {
            return;
        }
        f(t);
    }
}

fn worker(s: &Shared) {
    IN_JOB.set(true);
    let mut seen = 0u64;
    loop {
        seen = wait_for_job(s, seen);
        if s.shutdown.load(SeqCst) {
            return;
        }
        s.active.fetch_add(1, SeqCst);
        if s.open.load(SeqCst) {
            // SAFETY: registered in `active` and then saw `open` (both
            // SeqCst), so the submitter wrote `job` before opening and will
            // not return (ending `f`'s borrow) or write `job` again until
            // this worker leaves `active`.
            if let Some(f) = unsafe { *s.job.get() } {
                if catch_unwind(AssertUnwindSafe(|| take_tasks(s, f))).is_err() {
                    s.panicked.store(true, SeqCst);
                }
            }
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

/// Spins, then parks, until `generation` differs from `seen`; returns it.
fn wait_for_job(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let limit = Duration::from_nanos(s.spin.load(Relaxed));
    let mut spins = 0u32;
    loop {
        let g = s.generation.load(SeqCst);
        if g != seen {
            // `limit` is never below MIN_SPIN: doubling only grows it.
            let longer = (2 * limit).min(SPIN);
            s.spin.store(longer.as_nanos() as u64, Relaxed);
            return g;
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) && start.elapsed() > limit {
            s.spin.store(MIN_SPIN.as_nanos() as u64, Relaxed);
            let mut l = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            s.parked.fetch_add(1, SeqCst);
            let g = loop {
                let g = s.generation.load(SeqCst);
                if g != seen {
                    break g;
                }
                l = s.wake.wait(l).unwrap_or_else(|p| p.into_inner());
            };
            s.parked.fetch_sub(1, SeqCst);
            return g;
        }
    }
}

static GLOBAL: OnceLock<ThreadPool> = OnceLock::new();

/// The process's pool, started on first use with [`set_global_threads`]'s
/// count, else `KVANT_THREADS`, else one thread per available core.
///
/// # Panics
/// If the OS cannot start the worker threads at all.
pub fn global() -> &'static ThreadPool {
    GLOBAL.get_or_init(|| {
        let threads = std::env::var("KVANT_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(default_threads);
        ThreadPool::new(threads)
            .or_else(|_| ThreadPool::new(1))
            .unwrap_or_else(|e| panic!("cannot start the thread pool: {e}"))
    })
}

/// One thread per core the process may run on.
fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Errors of [`set_global_threads`].
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("the thread count must be at least 1")]
    ZeroThreads,
    #[error("the thread pool already runs {0} threads")]
    AlreadyStarted(usize),
    #[error("cannot start the thread pool: {0}")]
    Spawn(#[from] std::io::Error),
}

/// Starts the global pool on another runtime's team ([`ThreadPool::on_team`])
/// of `threads` threads; call before any kernel.
///
/// # Errors
/// [`PoolError::ZeroThreads`], or [`PoolError::AlreadyStarted`] when the
/// pool already runs (on its own threads or a team).
pub fn set_global_team(threads: usize, run: TeamRunner) -> Result<(), PoolError> {
    install(threads, || Ok(ThreadPool::on_team(threads, run)), false)
}

/// Starts the global pool with `threads` threads; call before any kernel.
///
/// # Errors
/// [`PoolError::ZeroThreads`], a failed thread start, or
/// [`PoolError::AlreadyStarted`] when the pool already runs with another count.
pub fn set_global_threads(threads: usize) -> Result<(), PoolError> {
    install(threads, || Ok(ThreadPool::new(threads)?), true)
}

/// Makes `make()`'s pool the global one. If a pool already runs, that is
/// fine only when `same_count_will_do` and it has `threads` threads.
fn install(
    threads: usize,
    make: impl FnOnce() -> Result<ThreadPool, PoolError>,
    same_count_will_do: bool,
) -> Result<(), PoolError> {
    if threads == 0 {
        return Err(PoolError::ZeroThreads);
    }
    let mut fresh = Some(make()?);
    let pool = GLOBAL.get_or_init(|| fresh.take().expect("set once"));
    let installed = fresh.is_none();
    match installed || (same_count_will_do && pool.threads() == threads) {
        true => Ok(()),
        false => Err(PoolError::AlreadyStarted(pool.threads())),
    }
}

/// A mutable slice that the tasks of one job write in disjoint ranges: the
/// one piece of unchecked sharing the parallel kernels need.
pub struct DisjointSlice<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: a `DisjointSlice` only hands out `&mut` sub-slices through the
// unsafe `range`, whose callers guarantee the ranges are disjoint, so sharing
// it between threads is sharing disjoint `&mut [T]`, which is `Send` for
// `T: Send`.
unsafe impl<T: Send> Send for DisjointSlice<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for DisjointSlice<'_, T> {}

impl<'a, T> DisjointSlice<'a, T> {
    pub fn new(s: &'a mut [T]) -> Self {
        DisjointSlice {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// Elements `r` of the slice.
    ///
    /// # Safety
    /// No other live reference from this `DisjointSlice` overlaps `r`.
    ///
    /// # Panics
    /// If `r` is not inside the slice.
    #[allow(clippy::mut_from_ref)] // disjointness is the caller's contract
    pub unsafe fn range(&self, r: std::ops::Range<usize>) -> &mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "range {r:?} of {}",
            self.len
        );
        // SAFETY: in bounds (asserted) of a slice borrowed mutably for 'a;
        // exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

impl<T: Copy> DisjointSlice<'_, T> {
    /// Writes `v[..live]` (`live <= W`) at element `at`: one fixed-size
    /// copy when `live == W`. A copy of run-time length is a `memmove`
    /// call per kernel tile, measured at 3.6% of Gemma 3's pp512 profile
    /// (the int8 tiles) and 2.8% of the BF16 copy of SmolLM2's (halfpack).
    ///
    /// # Safety
    /// No other live reference from this `DisjointSlice` overlaps
    /// `at..at + live`.
    ///
    /// # Panics
    /// If `live > W` or the range is not inside the slice.
    ///
    /// The partial copy is a cold function of its own: inline, the
    /// compiler merged the two copies into one `memcpy` call of a selected
    /// length (`perf`: `memmove` at 1.3% of a SmolLM2 Q8_0 decode step, a
    /// call per tile and token of the int8 kernels).
    #[inline(always)]
    pub unsafe fn write<const W: usize>(&self, at: usize, v: &[T; W], live: usize) {
        // SAFETY: the caller's contract.
        let dst = unsafe { self.range(at..at + live) };
        match <&mut [T; W]>::try_from(&mut *dst) {
            Ok(whole) => *whole = *v,
            Err(_) => copy_partial(dst, &v[..live]),
        }
    }
}

/// The tail of [`DisjointSlice::write`] (a matrix's last rows).
#[cold]
#[inline(never)]
fn copy_partial<T: Copy>(dst: &mut [T], src: &[T]) {
    dst.copy_from_slice(src)
}

/// `tasks` lowered to a whole multiple of `threads` (when at least
/// `threads`): equal tasks then end together, where e.g. 5 tasks on 2
/// threads leave one thread idle for a fifth of the job.
pub fn balanced_tasks(tasks: usize, threads: usize) -> usize {
    if threads > 0 && tasks >= threads {
        tasks / threads * threads
    } else {
        tasks
    }
}

/// Splits `n` items into at most `parts` contiguous ranges of a multiple of
/// `align` items (the last may be shorter); the i-th range of [`chunks`].
pub fn chunk(n: usize, parts: usize, align: usize, i: usize) -> std::ops::Range<usize> {
    let size = n.div_ceil(parts.max(1)).div_ceil(align.max(1)) * align.max(1);
    let lo = (i * size).min(n);
    lo..(lo + size).min(n)
}

/// How many ranges [`chunk`] makes of `n` items.
pub fn chunks(n: usize, parts: usize, align: usize) -> usize {
    let size = n.div_ceil(parts.max(1)).div_ceil(align.max(1)) * align.max(1);
    n.div_ceil(size.max(1))
}

/// Elements a row-wise operation (a norm, an activation, quantizing
/// activations, rotary embeddings) must cover before [`for_rows`] hands it
/// to the pool. A hand-out costs about a microsecond and a 640-wide norm
/// row a tenth of that, so a decode step's few rows stay on the caller,
/// while a prefill chunk's hundreds split: run serially, these operations
/// were 9% of a two-thread Gemma 3 prefill with the worker idle meanwhile.
pub const ROWS_MIN_PARALLEL: usize = 1 << 14;

/// Runs `f` on contiguous ranges that cover `0..rows` once each: one range
/// on the calling thread when the rows hold fewer than
/// [`ROWS_MIN_PARALLEL`] elements of `row_len` each, else one per thread of
/// the global pool. A row's result must not depend on its range (each
/// row computed on its own), so the split changes no bits.
pub fn for_rows(rows: usize, row_len: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    let parts = match rows.saturating_mul(row_len) < ROWS_MIN_PARALLEL {
        true => 1,
        false => global().threads().min(rows),
    };
    if parts <= 1 {
        return f(0..rows);
    }
    global().run(parts, &|i| f(chunk(rows, parts, 1, i)));
}

/// [`for_rows`] over the rows of `out`, `row_len` elements each (a partial
/// last row is left alone): `f` gets a range of rows and those rows.
pub fn for_rows_mut<T: Send>(
    out: &mut [T],
    row_len: usize,
    f: &(dyn Fn(std::ops::Range<usize>, &mut [T]) + Sync),
) {
    let Some(rows) = out.len().checked_div(row_len) else {
        return;
    };
    let d = DisjointSlice::new(out);
    for_rows(rows, row_len, &|r| {
        // SAFETY: `for_rows` hands out disjoint row ranges.
        f(r.clone(), unsafe {
            d.range(r.start * row_len..r.end * row_len)
        })
    });
}

/// [`for_rows_mut`] whose split is decided by `cost` per row (the
/// elements a row's computation reads, when that is far more than the row
/// it writes: one query's attention over thousands of cached rows).
pub fn for_rows_mut_cost<T: Send>(
    out: &mut [T],
    (row_len, cost): (usize, usize),
    f: &(dyn Fn(std::ops::Range<usize>, &mut [T]) + Sync),
) {
    let Some(rows) = out.len().checked_div(row_len) else {
        return;
    };
    let d = DisjointSlice::new(out);
    for_rows(rows, cost.max(row_len), &|r| {
        // SAFETY: `for_rows` hands out disjoint row ranges.
        f(r.clone(), unsafe {
            d.range(r.start * row_len..r.end * row_len)
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn a_costly_row_splits_by_its_cost() {
        // Four rows of 2 values, each standing for a large computation:
        // split over the pool, each row written once by its own range.
        let mut out = vec![0u32; 8];
        for_rows_mut_cost(&mut out, (2, ROWS_MIN_PARALLEL), &|r, o| {
            assert_eq!(o.len(), r.len() * 2);
            for (i, row) in r.zip(o.chunks_exact_mut(2)) {
                row.iter_mut().for_each(|v| *v += i as u32 + 1);
            }
        });
        assert_eq!(out, [1, 1, 2, 2, 3, 3, 4, 4]);
    }

    #[test]
    fn for_rows_covers_each_row_once_whatever_the_size() {
        for (rows, len) in [
            (0usize, 7usize),
            (1, 3),
            (5, 1),
            (3, ROWS_MIN_PARALLEL),
            (1000, 100),
        ] {
            let mut out = vec![0u32; rows * len + len / 2];
            for_rows_mut(&mut out, len, &|r, o| {
                assert_eq!(o.len(), r.len() * len);
                for (i, row) in r.zip(o.chunks_exact_mut(len)) {
                    row.iter_mut().for_each(|v| *v += i as u32 + 1);
                }
            });
            for (i, row) in out.chunks_exact(len).take(rows).enumerate() {
                assert!(
                    row.iter().all(|&v| v == i as u32 + 1),
                    "{rows}x{len} row {i}"
                );
            }
            // A partial last row is left alone.
            assert!(out[rows * len..].iter().all(|&v| v == 0));
        }
        for_rows_mut(&mut [1u8; 4], 0, &|_, _| panic!("no rows of length 0"));
    }

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3).unwrap();
        for tasks in [0usize, 1, 2, 3, 7, 64, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
                pool.run(tasks, &|t| {
                    hits[t].fetch_add(1, Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "tasks={tasks}");
            }
        }
    }

    /// A team of scoped threads, the caller among them, each running `body`.
    fn scoped_team(threads: usize, body: &(dyn Fn() + Sync)) {
        std::thread::scope(|sc| {
            for _ in 1..threads {
                sc.spawn(body);
            }
            body();
        });
    }

    #[test]
    fn a_team_runs_every_task_once_nests_inline_and_re_raises_panics() {
        let pool = ThreadPool::on_team(3, scoped_team);
        assert_eq!(pool.threads(), 3);
        let ids = Mutex::new(std::collections::HashSet::new());
        for tasks in [0usize, 1, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
            pool.run(tasks, &|t| {
                hits[t].fetch_add(1, Relaxed);
                // Nested: inline on this team thread.
                let me = std::thread::current().id();
                pool.run(2, &|_| assert_eq!(std::thread::current().id(), me));
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "tasks={tasks}");
        }
        // Tasks long enough that the caller cannot take them all.
        pool.run(12, &|_| {
            std::thread::sleep(Duration::from_millis(2));
            ids.lock().unwrap().insert(std::thread::current().id());
        });
        assert!(
            ids.lock().unwrap().len() > 1,
            "the team's threads took tasks"
        );
        survives_a_panic(&pool);
    }

    #[test]
    fn nested_and_concurrent_calls_run_inline() {
        let pool = Arc::new(ThreadPool::new(2).unwrap());
        let total = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..200 {
                        pool.run(8, &|_| {
                            pool.run(3, &|_| {
                                total.fetch_add(1, Relaxed);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Relaxed), 4 * 200 * 8 * 3);
    }

    /// A task's panic reaches the caller, and the pool runs the next job.
    fn survives_a_panic(pool: &ThreadPool) {
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(16, &|t| assert!(t != 11, "task 11"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(16, &|_| {
            n.fetch_add(1, Relaxed);
        });
        assert_eq!(n.load(Relaxed), 16);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let pool = ThreadPool::new(2).unwrap();
        survives_a_panic(&pool);
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = ThreadPool::new(2).unwrap();
        std::thread::sleep(SPIN * 3);
        let n = AtomicUsize::new(0);
        pool.run(100, &|_| {
            n.fetch_add(1, Relaxed);
        });
        assert_eq!(n.load(Relaxed), 100);
    }

    #[test]
    fn the_spin_drops_after_a_park_and_grows_back_with_close_jobs() {
        let pool = ThreadPool::new(2).unwrap();
        let spin = || Duration::from_nanos(pool.shared.spin.load(Relaxed));
        // Polled with a deadline: a loaded machine may run the worker late.
        let within = |want: Duration, job: &dyn Fn()| {
            let start = Instant::now();
            while spin() != want && start.elapsed() < Duration::from_secs(10) {
                job();
            }
            spin()
        };
        let idle = || std::thread::sleep(Duration::from_millis(1));
        assert_eq!(spin(), SPIN);
        assert_eq!(within(MIN_SPIN, &idle), MIN_SPIN, "the worker parks");
        // Jobs back to back: each one a spinning worker catches doubles it.
        let busy = || pool.run(4, &|_| std::hint::black_box(()));
        assert_eq!(within(SPIN, &busy), SPIN);
        assert_eq!(within(MIN_SPIN, &idle), MIN_SPIN);
    }

    #[test]
    fn balanced_task_counts_are_multiples_of_the_threads() {
        assert_eq!(balanced_tasks(5, 2), 4);
        assert_eq!(balanced_tasks(6, 2), 6);
        assert_eq!(balanced_tasks(1, 2), 1);
        assert_eq!(balanced_tasks(7, 3), 6);
        assert_eq!(balanced_tasks(4, 0), 4);
    }

    #[test]
    fn chunks_cover_the_range_aligned() {
        for n in [0usize, 1, 5, 17, 100, 1023] {
            for parts in [1usize, 2, 3, 8] {
                for align in [1usize, 4, 8] {
                    let c = chunks(n, parts, align);
                    assert!(c <= parts.max(1));
                    let mut next = 0;
                    for i in 0..c {
                        let r = chunk(n, parts, align, i);
                        assert_eq!(r.start, next);
                        assert!(r.start.is_multiple_of(align) && !r.is_empty());
                        next = r.end;
                    }
                    assert_eq!(next, n, "n={n} parts={parts} align={align}");
                }
            }
        }
    }
}
