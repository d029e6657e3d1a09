//! The MPI backend on real processes. Run by cargo (no launcher), this
//! re-launches its own executable under `mpirun -np 2` and `-np 3` and
//! checks that every rank succeeds in time; run by `mpirun`, it is one
//! rank: the collective checks of the in-process tests on the MPI world
//! and on splits of it, one line per rank, a non-zero exit (and an abort
//! of the job) on failure.

mod common;

use common::{check_collectives, Sums};
use kvant_dist::{
    launched_by_mpirun, Buffer, Collective, Comm, CommExt, Kind, Metered, MpiRuntime, NetModel,
    ReduceOp,
};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A rank's wait bound.
const TIMEOUT: Duration = Duration::from_secs(30);
/// mpirun's own bound on a job, and ours on mpirun.
const JOB_SECS: u64 = 100;
const KILL_AFTER: Duration = Duration::from_secs(120);

fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--list") {
        println!("mpi_ranks: test");
        return ExitCode::SUCCESS;
    }
    match launched_by_mpirun() {
        None => launch(),
        Some((rank, size)) => one_rank(rank, size),
    }
}

/// Whether this process runs as root (mpirun refuses root unless told).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

fn launch() -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("mpi_ranks: cannot find my own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mpirun = std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".into());
    for np in [2, 3] {
        let mut cmd = Command::new(&mpirun);
        if is_root() {
            cmd.arg("--allow-run-as-root");
        }
        cmd.args([
            "--oversubscribe",
            "--timeout",
            &JOB_SECS.to_string(),
            "-np",
            &np.to_string(),
        ])
        .arg(&exe)
        // Containers often forbid the ptrace that CMA single-copy needs.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
        let t = Instant::now();
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("mpi_ranks: cannot run {mpirun} (install Open MPI's mpirun, or set MPIRUN): {e}");
                return ExitCode::FAILURE;
            }
        };
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if t.elapsed() > KILL_AFTER => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => {
                    eprintln!("mpi_ranks: waiting for mpirun: {e}");
                    return ExitCode::FAILURE;
                }
            }
        };
        match status {
            Some(s) if s.success() => {
                println!("mpi_ranks: {np} ranks passed in {:.2?}", t.elapsed())
            }
            Some(s) => {
                eprintln!("mpi_ranks: {np} ranks failed: mpirun {s}");
                return ExitCode::FAILURE;
            }
            None => {
                eprintln!("mpi_ranks: {np} ranks did not finish within {KILL_AFTER:?}; killed");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

fn one_rank(rank: usize, size: usize) -> ExitCode {
    let (runtime, world) = match MpiRuntime::init(TIMEOUT) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("mpi rank {rank}/{size}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let t = Instant::now();
    let result = checks(&world, rank, size);
    let code = match result {
        Ok(n) => {
            println!(
                "mpi rank {rank}/{size}: ok, {n} collectives in {:.2?}",
                t.elapsed()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mpi rank {rank}/{size}: FAILED: {e}");
            // Ends every rank of the job at once instead of letting the
            // others wait for the timeout.
            world.abort(1);
            ExitCode::FAILURE
        }
    };
    drop(world);
    drop(runtime);
    code
}

fn checks(world: &Arc<dyn Comm>, rank: usize, size: usize) -> Result<usize, String> {
    if (world.rank(), world.size()) != (rank, size) {
        return Err(format!(
            "MPI says rank {} of {}",
            world.rank(),
            world.size()
        ));
    }
    let mut n = 0;
    for seed in [1u64, 7, 42] {
        n += check_collectives(world.as_ref(), seed, 4, Sums::Close)?;
    }
    let e = |e: kvant_dist::DistError| e.to_string();

    // A split: evens and odds, keys reversing the order.
    let child = world.split(rank % 2, size - rank).map_err(e)?;
    let members: Vec<usize> = (0..size).filter(|r| r % 2 == rank % 2).rev().collect();
    let want = members
        .iter()
        .position(|&r| r == rank)
        .ok_or("not in my own split")?;
    if (child.rank(), child.size()) != (want, members.len()) {
        return Err(format!(
            "split: rank {} of {}, want {want} of {}",
            child.rank(),
            child.size(),
            members.len()
        ));
    }
    let gathered = child
        .all_gather(Buffer::U32(vec![rank as u32]), vec![1; child.size()])
        .map_err(e)?
        .into_u32()
        .map_err(e)?;
    if gathered != members.iter().map(|&r| r as u32).collect::<Vec<_>>() {
        return Err(format!("split: members {gathered:?}, want {members:?}"));
    }
    n += check_collectives(child.as_ref(), 5, 2, Sums::Close)?;

    // Two communicators, posted in opposite orders by even and odd ranks.
    let a = world.split(0, rank).map_err(e)?;
    let b = world.split(0, rank).map_err(e)?;
    let sum = |c: &Arc<dyn Comm>, v: f32| {
        c.post(Collective::AllReduce {
            buf: Buffer::F32(vec![v]),
            op: ReduceOp::Sum,
        })
    };
    let (ra, rb) = if rank.is_multiple_of(2) {
        let ra = sum(&a, 1.0).map_err(e)?;
        (ra, sum(&b, 10.0).map_err(e)?)
    } else {
        let rb = sum(&b, 10.0).map_err(e)?;
        (sum(&a, 1.0).map_err(e)?, rb)
    };
    let (ga, gb) = (ra.wait().map_err(e)?, rb.wait().map_err(e)?);
    if ga != Buffer::F32(vec![size as f32]) || gb != Buffer::F32(vec![10.0 * size as f32]) {
        return Err(format!("crossed posts: {ga:?}, {gb:?}"));
    }
    n += 2;

    // A request dropped before it completes (the odd ranks join late):
    // the drop waits for it; the next collective still works.
    if rank % 2 == 1 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = Instant::now();
    drop(world.post(Collective::Barrier).map_err(e)?);
    if rank == 0 && size > 1 && t.elapsed() < Duration::from_millis(20) {
        return Err(format!(
            "a pending barrier was dropped after {:?}",
            t.elapsed()
        ));
    }
    world.barrier().map_err(e)?;
    n += 2;

    // Metered over MPI, with a modelled network: 2 ms per all-reduce step.
    let net = NetModel::new(Duration::from_millis(1), f64::INFINITY).ok_or("net model")?;
    let (metered, stats) = Metered::wrap(Arc::clone(world), Some(net));
    let t = Instant::now();
    let mut x = vec![1.0f32; 100];
    metered.all_reduce_sum(&mut x).map_err(e)?;
    let took = t.elapsed();
    let floor = net.time(Kind::AllReduce, size, 400);
    if x != vec![size as f32; 100] || took < floor {
        return Err(format!(
            "metered all-reduce: {took:?} < {floor:?}, or wrong values"
        ));
    }
    let s = stats.get(Kind::AllReduce);
    if (s.count, s.bytes_sent) != (1, 400) {
        return Err(format!("metered stats {s:?}"));
    }
    n += 1;
    Ok(n)
}
