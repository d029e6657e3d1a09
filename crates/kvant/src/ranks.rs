//! Starting a run on one rank or several: processes that `mpirun` started
//! (the `mpi` feature), or, without a launcher, threads of this process
//! (for machines without MPI, and tests). Rank 0 runs the command; the
//! others load their share of the model and serve its steps until rank 0
//! says stop. Every rank checks the same flags, so a layout that does not
//! fit fails the same way everywhere at start-up.

use crate::args::{ModelArg, ParallelArgs};
use crate::fetch;
use anyhow::{bail, Context, Result};
#[cfg(feature = "mpi")]
use kvant_dist::{Comm, CommExt};
use kvant_dist::{DistError, Layout, Metered, Stats};
use kvant_engine::cluster::{forward_seq, run_worker, Cluster, Row, Want};
use kvant_engine::{EngineError, Session};
use kvant_model::arch::decoder::DecoderModel;
use kvant_model::chat::ChatTemplate;
use kvant_model::kv::KvCache;
use kvant_model::tokenizer::Tokenizer;
use kvant_model::{LoadOptions, ModelError, ModelInfo, Parallel};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Rank 0's loaded model, and the run it leads.
pub struct Run {
    pub model: Arc<DecoderModel>,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub info: ModelInfo,
    pub path: PathBuf,
    /// The other ranks, when there are any.
    pub cluster: Option<Arc<Cluster>>,
    /// Rank 0's collectives (count, bytes, time), when there are ranks.
    pub stats: Option<Arc<Stats>>,
    /// Ranks running as threads of this process.
    threads: Vec<JoinHandle<Result<()>>>,
    #[cfg(feature = "mpi")]
    _mpi: Option<kvant_dist::MpiRuntime>,
}

/// Loads the model on this rank. Returns `None` on ranks other than 0,
/// after they have served the whole run; rank 0 (or the only process)
/// gets the [`Run`] to lead, and ends it with [`Run::finish`].
///
/// # Errors
/// A layout that does not fit the ranks or the model, a model that does
/// not load, a lost rank.
pub fn start(model: &ModelArg, p: &ParallelArgs, opts: LoadOptions) -> Result<Option<Run>> {
    let timeout = Duration::from_secs(p.dist_timeout as u64);
    match kvant_dist::launched_by_mpirun() {
        // Under mpirun, the layout is the processes' (one process asking
        // for --tp 2 is an error, not threads).
        Some((_, size)) if size > 1 || p.is_parallel() => start_mpi(model, p, opts, timeout, size),
        _ if p.is_parallel() => start_threads(model, p, opts, timeout).map(Some),
        _ => {
            let path = fetch::resolve_model(model.model.as_deref())?;
            let m = kvant_model::load_files(&path, model.mtp_model.as_deref(), opts, None)
                .with_context(|| format!("loading {}", path.display()))?;
            if opts.mtp && !m.model.has_mtp() {
                bail!(
                    "--mtp: {} has no multi-token-prediction module (llama.cpp's converter \
                     writes DeepSeek-V4's to a GGUF of its own: pass it with --mtp-model)",
                    path.display()
                );
            }
            Run::lead(m, path, None, Vec::new()).map(Some)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn start_mpi(
    _: &ModelArg,
    _: &ParallelArgs,
    _: LoadOptions,
    _: Duration,
    size: usize,
) -> Result<Option<Run>> {
    bail!(
        "mpirun started this kvant as one of {size} ranks, but it was built without MPI: \
         rebuild with `cargo build --release -p kvant --features mpi` (or run without mpirun: \
         --tp/--dp/--ep then run ranks as threads)"
    )
}

#[cfg(feature = "mpi")]
fn start_mpi(
    model: &ModelArg,
    p: &ParallelArgs,
    opts: LoadOptions,
    timeout: Duration,
    _: usize,
) -> Result<Option<Run>> {
    let (mpi, world) = kvant_dist::MpiRuntime::init(timeout).context("starting MPI")?;
    let rank = world.rank();
    // Rank 0 fetches the default model if needed; the others find it in
    // the cache after the barrier (a shared file system is assumed, as
    // for the checkpoint itself).
    let path = match rank {
        0 => or_abort(&*world, fetch::resolve_model(model.model.as_deref()))?,
        _ => PathBuf::new(),
    };
    or_abort(
        &*world,
        world
            .barrier()
            .context("waiting for rank 0 to find the model"),
    )?;
    let path = match rank {
        0 => path,
        _ => or_abort(&*world, fetch::resolve_model(model.model.as_deref()))?,
    };
    let (world, stats) = Metered::wrap(world, p.net_model());
    let layout = Layout::new(world.size(), p.tp, p.dp, p.ep).map_err(DistError::from)?;
    let par = Arc::new(or_abort(
        &*world,
        Parallel::new(Arc::clone(&world), layout, p.two_batch_overlap).map_err(anyhow::Error::from),
    )?);
    let m = load(&path, model.mtp_model.as_deref(), opts, Arc::clone(&par))?;
    if rank != 0 {
        // A signal ends a run through rank 0, which shuts it down (a server
        // lets requests finish) and then tells the others to stop: mpirun
        // forwards SIGINT and SIGTERM to every rank (and kills the job a
        // few seconds later), so a worker must not die of them first. A
        // rank 0 that dies is noticed by mpirun, or by the heartbeat
        // timeout.
        let _signals = outlive_signals()?;
        if let Err(e) = run_worker(&m.model) {
            eprintln!("kvant: error: rank {rank}: {e}");
            world.abort(1);
            bail!("rank {rank}: {e}");
        }
        return Ok(None);
    }
    let mut run = Run::lead(m, path, Some(stats), Vec::new())?;
    run._mpi = Some(mpi);
    Ok(Some(run))
}

/// Ranks as threads: rank 0 on this thread, the others spawned.
fn start_threads(
    model: &ModelArg,
    p: &ParallelArgs,
    opts: LoadOptions,
    timeout: Duration,
) -> Result<Run> {
    let size = (p.tp * p.dp).max(p.ep);
    let layout = Layout::new(size, p.tp, p.dp, p.ep).map_err(DistError::from)?;
    let path = fetch::resolve_model(model.model.as_deref())?;
    let mut comms = kvant_dist::local::world(size, timeout).into_iter();
    let first = comms.next().context("no rank 0")?;
    let (first, stats) = Metered::wrap(first, p.net_model());
    let mut threads = Vec::new();
    for (i, comm) in comms.enumerate() {
        let (path, overlap) = (path.clone(), p.two_batch_overlap);
        let drafter = model.mtp_model.clone();
        let comm = Metered::with_stats(comm, p.net_model(), Arc::new(Stats::new()));
        let spawned = std::thread::Builder::new()
            .name(format!("kvant-rank-{}", i + 1))
            .spawn(move || -> Result<()> {
                let par = Parallel::new(Arc::clone(&comm), layout, overlap);
                let served = par
                    .map_err(anyhow::Error::from)
                    .and_then(|par| load(&path, drafter.as_deref(), opts, Arc::new(par)))
                    .and_then(|m| run_worker(&m.model).map_err(anyhow::Error::from));
                if served.is_err() {
                    // Rank 0 must not wait for this one until the timeout.
                    comm.abort(1);
                }
                served
            });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                first.abort(1);
                return Err(e).context("starting a rank thread");
            }
        }
    }
    let loaded = Parallel::new(Arc::clone(&first), layout, p.two_batch_overlap)
        .map_err(anyhow::Error::from)
        .and_then(|par| load(&path, model.mtp_model.as_deref(), opts, Arc::new(par)));
    match loaded {
        Ok(m) => Run::lead(m, path, Some(stats), threads),
        Err(e) => {
            first.abort(1);
            // The other ranks failed the same way, or now fail at once. If
            // this rank only saw another go, that one's error says why.
            let mut cause = None;
            for (i, t) in threads.into_iter().enumerate() {
                if let Ok(Err(err)) = t.join() {
                    if cause.is_none() && !lost_rank(&err) {
                        cause = Some(err.context(format!("rank {}", i + 1)));
                    }
                }
            }
            match cause {
                Some(c) if lost_rank(&e) => Err(c),
                _ => Err(e),
            }
        }
    }
}

fn load(
    path: &Path,
    drafter: Option<&Path>,
    opts: LoadOptions,
    par: Arc<Parallel>,
) -> Result<kvant_model::LoadedModel> {
    kvant_model::load_files(path, drafter, opts, Some(par))
        .with_context(|| format!("loading {}", path.display()))
}

/// Keeps SIGINT and SIGTERM from ending this process while the returned
/// runtime lives (tokio's handlers replace the default action).
#[cfg(feature = "mpi")]
fn outlive_signals() -> Result<tokio::runtime::Runtime> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting a signal runtime")?;
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let _guard = rt.enter();
        for kind in [SignalKind::interrupt(), SignalKind::terminate()] {
            // Never polled: registering is what replaces the default action.
            std::mem::forget(signal(kind).context("ignoring a signal on a worker rank")?);
        }
    }
    Ok(rt)
}

/// `r`, aborting every rank when it is an error (so none waits for this
/// one until its timeout).
#[cfg(feature = "mpi")]
fn or_abort<T>(world: &dyn Comm, r: Result<T>) -> Result<T> {
    if let Err(e) = &r {
        eprintln!("kvant: error: rank {}: {e:#}", world.rank());
        world.abort(1);
    }
    r
}

impl Run {
    fn lead(
        m: kvant_model::LoadedModel,
        path: PathBuf,
        stats: Option<Arc<Stats>>,
        threads: Vec<JoinHandle<Result<()>>>,
    ) -> Result<Run> {
        let i = &m.info;
        if i.context_length > i.trained_context_length {
            eprintln!(
                "kvant: warning: a context of {} tokens runs past the {} the checkpoint declares",
                i.context_length, i.trained_context_length
            );
        }
        let model = Arc::new(m.model);
        // A model loaded with ranks leads them (this is rank 0).
        let cluster = match model.parallel() {
            Some(_) => Some(Arc::new(Cluster::new(Arc::clone(&model))?)),
            None => None,
        };
        Ok(Run {
            model,
            tokenizer: Arc::new(m.tokenizer),
            chat_template: m.chat_template.map(Arc::new),
            info: m.info,
            path,
            cluster,
            stats,
            threads,
            #[cfg(feature = "mpi")]
            _mpi: None,
        })
    }

    /// A generation session over this run's model (and its ranks).
    pub fn session(&self, capacity: usize) -> Result<Session<'_>> {
        Ok(match &self.cluster {
            Some(c) => Session::on_cluster(c, &self.tokenizer, capacity)?,
            None => Session::new(&self.model, &self.tokenizer, capacity)?,
        })
    }

    /// A one-sequence KV cache of `capacity` tokens (on every rank).
    pub fn cache(&self, capacity: usize) -> Result<KvCache> {
        Ok(match &self.cluster {
            Some(c) => c.cache(capacity)?,
            None => self.model.new_cache(capacity)?,
        })
    }

    /// Saves the state of `cache` to go back to (see
    /// [`KvCache::save_state`]), on every rank.
    pub fn save_state(&self, cache: &mut KvCache) -> Result<()> {
        Ok(kvant_engine::cluster::save_state(
            self.cluster.as_deref(),
            cache,
        )?)
    }

    /// Cuts `cache` back to `len` tokens (see [`KvCache::truncate`]), on
    /// every rank.
    pub fn truncate(&self, cache: &mut KvCache, len: usize) -> Result<()> {
        Ok(kvant_engine::cluster::truncate(
            self.cluster.as_deref(),
            cache,
            len,
        )?)
    }

    /// One forward pass of the sequence in `cache` over `tokens`.
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32], want: Want) -> Result<Vec<Row>> {
        Ok(forward_seq(
            &self.model,
            self.cluster.as_deref(),
            cache,
            tokens,
            want,
        )?)
    }

    /// Ends the run with the command's `result`: the other ranks are told
    /// to stop, or, after a lost rank, the job is aborted (MPI ends every
    /// process; ranks as threads fail at once); in-process ranks are
    /// joined.
    pub fn finish(self, result: Result<()>) -> Result<()> {
        let Run {
            cluster, threads, ..
        } = self;
        let mut result = result;
        if let Some(c) = &cluster {
            let lost = result.as_ref().err().is_some_and(lost_rank);
            if lost || c.shutdown().is_err() {
                if let Err(e) = &result {
                    eprintln!("kvant: error: {e:#}");
                }
                c.abort();
            }
        }
        for t in threads {
            let served = t
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank thread panicked")));
            if let (true, Err(e)) = (result.is_ok(), served) {
                result = Err(e);
            }
        }
        result
    }
}

/// Whether `e` comes from a lost (dead, hung or aborted) rank.
fn lost_rank(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<DistError>()
            .is_some_and(DistError::is_communication)
            || c.downcast_ref::<EngineError>()
                .is_some_and(EngineError::is_communication)
            || c.downcast_ref::<ModelError>()
                .is_some_and(ModelError::is_communication)
    })
}
