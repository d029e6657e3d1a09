//! kvant's jobs on torch's OpenMP threads.
//!
//! torch runs its CPU ops on an OpenMP team (libgomp in the PyPI wheels)
//! whose threads spin for a while after each parallel region: about 5 ms
//! by libgomp's default spin count. A kvant op started right after a
//! torch op on a pool of its own then shared the cores with those
//! spinning threads (torch's LayerNorm forward took 8 ms where kvant's,
//! faster on its own, took 11–14). Handing kvant's jobs to the same team
//! (`GOMP_parallel`, found in the process by name) runs them on the
//! threads that are already awake, and leaves no second pool spinning
//! against torch's next op.

use kvant_kernels::pool;
use std::ffi::c_void;
use std::sync::OnceLock;

/// libgomp's `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)`
/// on a team of `num_threads` threads, the caller among them, and returns
/// when all have returned. Its C ABI has been stable since GCC 4.9, and
/// LLVM's and Intel's OpenMP runtimes export it too.
type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, u32, u32);

fn gomp_parallel() -> Option<GompParallel> {
    static F: OnceLock<Option<GompParallel>> = OnceLock::new();
    *F.get_or_init(|| {
        // SAFETY: a lookup in the process's global scope by a NUL-terminated name.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"GOMP_parallel".as_ptr()) };
        // SAFETY: the symbol is `GOMP_parallel`, whose signature is `GompParallel`.
        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, GompParallel>(p) })
    })
}

/// Runs the `&dyn Fn` behind `data` on one team thread.
extern "C" fn run_body(data: *mut c_void) {
    // SAFETY: `data` points at the `&(dyn Fn() + Sync)` that `on_team`
    // passed, which outlives the `GOMP_parallel` call running this.
    let body = unsafe { &*(data as *const &(dyn Fn() + Sync)) };
    // The pool's team body catches its tasks' panics; one escaping here
    // would unwind through C frames, so it ends the process instead.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).is_err() {
        std::process::abort();
    }
}

/// The pool's [`pool::TeamRunner`] on torch's team.
fn on_team(threads: usize, body: &(dyn Fn() + Sync)) {
    match gomp_parallel() {
        Some(parallel) => {
            let body: &(dyn Fn() + Sync) = body;
            let data = &body as *const &(dyn Fn() + Sync) as *mut c_void;
            // SAFETY: `run_body` reads `data` as the `&dyn Fn` it points at,
            // alive for this call; `threads` fits (the pool's size).
            unsafe {
                parallel(
                    run_body,
                    data,
                    u32::try_from(threads).unwrap_or(u32::MAX),
                    0,
                )
            }
        }
        None => body(),
    }
}

/// Starts kvant's global pool on torch's OpenMP team of `threads` threads.
/// `Ok(false)` when no OpenMP runtime is loaded (the caller then starts a
/// pool of kvant's own).
pub fn use_torch_team(threads: usize) -> Result<bool, pool::PoolError> {
    if gomp_parallel().is_none() {
        return Ok(false);
    }
    pool::set_global_team(threads, on_team).map(|()| true)
}
