//! The serving engine on its own thread, and the cloneable handle clients
//! use to submit, abort and observe requests.
//!
//! The engine thread owns the model's KV pool and runs one step after
//! another while it has work, and sleeps on its command channel when idle.
//! Submissions are validated here, on the caller's thread, so a bad request
//! is refused before it reaches the engine and never disturbs other work.

use super::config::EngineConfig;
use super::embedding::Pooling;
use super::engine::Engine;
use super::metrics::{Metrics, MetricsSnapshot};
use super::request::{EventSink, RequestId, MAX_TOP_LOGPROBS};
use super::shared::Shared;
use crate::cluster::Cluster;
use crate::continuation::MIN_TOKENS;
use crate::error::EngineError;
use crate::request::EngineRequest;
use crate::sampling::SamplingError;
use kvant_model::arch::decoder::DecoderModel;
use kvant_model::tokenizer::Tokenizer;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Why a request was refused at submission.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens, but the model's context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("max_tokens must be at least {MIN_TOKENS}")]
    NoTokens,
    #[error("the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context of {context} tokens")]
    BeyondContext {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("the prompt plus max_tokens needs {needed} KV tokens, but the cache holds {capacity}")]
    BeyondCache { needed: usize, capacity: usize },
    #[error("the prompt has {prompt} tokens, but the KV cache holds {capacity}")]
    PromptBeyondCache { prompt: usize, capacity: usize },
    #[error("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {0}")]
    TooManyLogprobs(usize),
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(
        "logit_bias: token id {id} is outside the vocabulary of {vocab}, or its bias is not finite"
    )]
    BadLogitBias { id: u32, vocab: usize },
    #[error("sampling: {0}")]
    Sampling(#[from] SamplingError),
    #[error("too many requests are waiting; retry later")]
    QueueFull,
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// How [`EngineHandle::shutdown`] treats requests in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// Finish every submitted request, accept no new ones.
    Drain,
    /// Abort every request now (each gets its `Finished` event).
    Abort,
}

pub(super) enum Command {
    /// A request; with a pooling, an embedding of its prompt.
    Submit(RequestId, Box<EngineRequest>, Option<Pooling>, EventSink),
    Abort(RequestId),
    Shutdown(Shutdown),
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<Command>,
    shared: Arc<Shared>,
}

/// The engine thread; [`EngineThread::join`] waits for it after a shutdown.
pub struct EngineThread(JoinHandle<Result<(), EngineError>>);

impl EngineThread {
    /// Waits for the engine to stop; `Err` if it panicked (a bug) or the
    /// ranks of a parallel run lost one another.
    pub fn join(self) -> Result<(), EngineError> {
        self.0.join().map_err(|_| EngineError::EngineStopped)?
    }

    /// Whether the engine thread has stopped (after a shutdown, or on its
    /// own after a lost rank).
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

impl EngineHandle {
    /// Starts the engine thread over `model`, with a KV pool of
    /// `cfg.kv_blocks` blocks allocated now.
    pub fn start(
        model: Arc<DecoderModel>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<(EngineHandle, EngineThread), EngineError> {
        Self::start_with(model, None, tokenizer, cfg)
    }

    /// Starts the engine thread on rank 0 of `cluster` (the other ranks
    /// run [`crate::cluster::run_worker`]): every data-parallel group gets
    /// a pool of `cfg.kv_blocks` blocks on its ranks, and `cfg`'s limits
    /// apply to each group. While idle, the engine proves the ranks alive
    /// every quarter of the communication timeout.
    pub fn start_on_cluster(
        cluster: Arc<Cluster>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<(EngineHandle, EngineThread), EngineError> {
        let model = Arc::clone(cluster.model());
        Self::start_with(model, Some(cluster), tokenizer, cfg)
    }

    fn start_with(
        model: Arc<DecoderModel>,
        cluster: Option<Arc<Cluster>>,
        tokenizer: Arc<Tokenizer>,
        cfg: EngineConfig,
    ) -> Result<(EngineHandle, EngineThread), EngineError> {
        if cfg.block_size == 0 || cfg.kv_blocks == 0 || cfg.max_batch_tokens == 0 {
            return Err(EngineError::Config(
                "block size, KV blocks and the batch token budget must be positive".into(),
            ));
        }
        if cfg.max_running == 0 {
            return Err(EngineError::Config(
                "max running sequences must be positive".into(),
            ));
        }
        let spread = cluster
            .as_ref()
            .is_some_and(|c| c.layout().expert_parallel());
        match cfg.rebalance {
            Some(r) if r.every == 0 => {
                return Err(EngineError::Config(
                    "expert re-placement needs a positive step interval".into(),
                ))
            }
            Some(_) if !spread => {
                return Err(EngineError::Config(
                    "expert re-placement needs experts spread over ranks (--ep)".into(),
                ))
            }
            _ => {}
        }
        let groups = cluster.as_ref().map_or(1, |c| c.layout().dp);
        let shared = Arc::new(Shared {
            metrics: Metrics::default(),
            waiting: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            capacity: cfg
                .max_waiting
                .saturating_add(cfg.max_running.saturating_mul(groups)),
            closed: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            context: model.config().max_context,
            vocab: model.config().vocab,
            cache_tokens: cfg.kv_blocks * cfg.block_size,
            hidden: model.hidden_width(),
        });
        let pool = match &cluster {
            Some(c) => c.pool(cfg.block_size, cfg.kv_blocks, cfg.state_slots(&model))?,
            None => model.new_pool(cfg.block_size, cfg.kv_blocks, cfg.state_slots(&model))?,
        };
        shared
            .metrics
            .update(|m| m.kv_blocks_total = cfg.kv_blocks * groups);
        let (tx, rx) = mpsc::channel();
        let engine_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("kvant-engine".into())
            .spawn(move || {
                let mut engine = Engine::new(model, cluster, &tokenizer, pool, &cfg, engine_shared);
                run(&mut engine, &rx)
            })
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok((EngineHandle { tx, shared }, EngineThread(thread)))
    }

    /// Validates and queues a request; its events go to `sink`.
    pub fn submit(&self, req: EngineRequest, sink: EventSink) -> Result<RequestId, SubmitError> {
        let s = &self.shared;
        self.check_prompt(&req.prompt_ids)?;
        let prompt = req.prompt_ids.len();
        if let Some(&(id, _)) = req
            .logit_bias
            .iter()
            .find(|&&(id, b)| id as usize >= s.vocab || !b.is_finite())
        {
            return Err(SubmitError::BadLogitBias { id, vocab: s.vocab });
        }
        if prompt >= s.context {
            return Err(SubmitError::PromptTooLong {
                prompt,
                context: s.context,
            });
        }
        if req.max_tokens < MIN_TOKENS {
            return Err(SubmitError::NoTokens);
        }
        if prompt + req.max_tokens > s.context {
            return Err(SubmitError::BeyondContext {
                prompt,
                max_tokens: req.max_tokens,
                context: s.context,
            });
        }
        if prompt + req.max_tokens > s.cache_tokens {
            return Err(SubmitError::BeyondCache {
                needed: prompt + req.max_tokens,
                capacity: s.cache_tokens,
            });
        }
        if let Some(n) = req.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(SubmitError::TooManyLogprobs(n));
        }
        req.sampling.validate()?;
        self.queue(req, None, sink)
    }

    /// Validates and queues an embedding of `prompt_ids`: the model's
    /// hidden states after the final norm, pooled as `pooling` says, come
    /// back as one [`super::Event::Embedding`] (not normalized), then
    /// `Finished` with the prompt's usage. It runs batched with generation
    /// and never reuses cached prefixes.
    pub fn embed(
        &self,
        prompt_ids: Vec<u32>,
        pooling: Pooling,
        sink: EventSink,
    ) -> Result<RequestId, SubmitError> {
        let s = &self.shared;
        self.check_prompt(&prompt_ids)?;
        let prompt = prompt_ids.len();
        if prompt > s.context {
            return Err(SubmitError::PromptTooLong {
                prompt,
                context: s.context,
            });
        }
        if prompt > s.cache_tokens {
            return Err(SubmitError::PromptBeyondCache {
                prompt,
                capacity: s.cache_tokens,
            });
        }
        // Nothing is sampled: the request only carries the prompt.
        self.queue(EngineRequest::greedy(prompt_ids, 0), Some(pooling), sink)
    }

    /// Refuses a closed engine, an empty prompt and ids outside the
    /// vocabulary.
    fn check_prompt(&self, ids: &[u32]) -> Result<(), SubmitError> {
        let s = &self.shared;
        if s.closed.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        if ids.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= s.vocab) {
            return Err(SubmitError::TokenOutOfRange { id, vocab: s.vocab });
        }
        Ok(())
    }

    /// Reserves a place for a validated request and sends it to the engine.
    fn queue(
        &self,
        req: EngineRequest,
        embed: Option<Pooling>,
        sink: EventSink,
    ) -> Result<RequestId, SubmitError> {
        let s = &self.shared;
        // Reserve a place; the sequence gives it back when it ends (its
        // `InFlight`), the engine the waiting count on admission.
        let reserved = s
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < s.capacity).then_some(n + 1)
            });
        if reserved.is_err() {
            return Err(SubmitError::QueueFull);
        }
        s.waiting.fetch_add(1, Ordering::AcqRel);
        let id = s.next_id.fetch_add(1, Ordering::Relaxed);
        if self
            .tx
            .send(Command::Submit(id, Box::new(req), embed, sink))
            .is_err()
        {
            s.waiting.fetch_sub(1, Ordering::AcqRel);
            s.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(id)
    }

    /// Aborts a request (no-op when it already finished): its blocks are
    /// freed before the next step.
    pub fn abort(&self, id: RequestId) {
        // A stopped engine has nothing left to abort.
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Stops accepting requests; `mode` decides what happens to those in flight.
    /// The engine thread ends once none is left.
    pub fn shutdown(&self, mode: Shutdown) {
        self.shared.closed.store(true, Ordering::Release);
        let _ = self.tx.send(Command::Shutdown(mode));
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        let mut m = self.shared.metrics.snapshot();
        m.waiting = self.shared.waiting.load(Ordering::Acquire);
        m
    }

    /// Whether the engine accepts no more requests: it is shutting down,
    /// or stopped on its own (ranks of a parallel run lost one another).
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// The model's context length: prompt plus output tokens per request.
    pub fn context_length(&self) -> usize {
        self.shared.context
    }

    /// The length of an [`EngineHandle::embed`] vector: the model's hidden
    /// size (DeepSeek-V4: its residual streams side by side, see
    /// [`kvant_model::arch::decoder::Hidden`]).
    pub fn embedding_size(&self) -> usize {
        self.shared.hidden
    }
}

/// The engine thread's loop: apply commands, step while there is work,
/// block on the channel when idle (over ranks, waking to send a heartbeat
/// every quarter of the communication timeout). A failed step or heartbeat
/// over ranks ends the engine: every request is failed, new ones refused.
fn run(engine: &mut Engine<'_>, rx: &Receiver<Command>) -> Result<(), EngineError> {
    let idle_wait = engine
        .cluster()
        .map_or(Duration::from_secs(3600), |c| c.timeout() / 4);
    let mut draining = false;
    loop {
        let cmd = if engine.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => Some(Command::Shutdown(Shutdown::Drain)),
            }
        } else if draining {
            return Ok(());
        } else {
            match rx.recv_timeout(idle_wait) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(c) = engine.cluster() {
                        if let Err(e) = c.heartbeat() {
                            return Err(engine.fail(e));
                        }
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        };
        match cmd {
            Some(Command::Submit(id, req, embed, sink)) => engine.add(id, *req, embed, sink),
            Some(Command::Abort(id)) => engine.abort(id),
            Some(Command::Shutdown(mode)) => {
                draining = true;
                if mode == Shutdown::Abort {
                    engine.abort_all();
                }
            }
            None => {
                if let Err(e) = engine.step() {
                    return Err(engine.fail(e));
                }
            }
        }
    }
}
