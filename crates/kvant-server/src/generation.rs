//! One API request's `n` engine requests and the events they send back.
//!
//! Each choice is submitted with a sink that forwards its events, tagged
//! with the choice index, into one unbounded channel: the engine thread
//! never waits on a client. When the receiving side is dropped (the client
//! went away, or the handler failed) the sinks start returning `false` and
//! the engine aborts those sequences; the [`Generation`]'s guard also aborts
//! them at once, so a request still waiting in the queue never runs.

use crate::access_log::RequestStats;
use crate::api::usage::Usage;
use crate::error::ApiError;
use crate::state::AppState;
use crate::validate::Plan;
use kvant_engine::grammar::Constraint;
use kvant_engine::serving::{
    EngineHandle, EngineRequest, Event, RequestId, TokenLogprob, Usage as EngineUsage,
};
use kvant_engine::FinishReason;
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// The choices of one request, in flight.
pub struct Generation {
    events: UnboundedReceiver<(usize, Event)>,
    /// The request's access-log figures.
    stats: Arc<RequestStats>,
    guard: AbortGuard,
    /// Choices of each prompt.
    per_prompt: usize,
    /// What each prompt has added to the usage so far.
    prompts: Vec<PromptUsage>,
}

#[derive(Clone, Copy, Default)]
struct PromptUsage {
    counted: bool,
    cached: usize,
}

/// Aborts the engine requests it holds when dropped, unless disarmed.
pub(crate) struct AbortGuard {
    engine: EngineHandle,
    ids: Vec<RequestId>,
    armed: bool,
}

impl AbortGuard {
    pub fn new(engine: EngineHandle) -> Self {
        AbortGuard {
            engine,
            ids: Vec::new(),
            armed: true,
        }
    }

    pub fn push(&mut self, id: RequestId) {
        self.ids.push(id);
    }

    /// Every request has finished: nothing is left to abort.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            for &id in &self.ids {
                self.engine.abort(id);
            }
        }
    }
}

/// Submits, for each prompt, `plan.best_of` (else `plan.n`) sequences
/// continuing it; choice `index` is prompt `index / per_prompt`'s sequence
/// `index % per_prompt`, sampled with the seed plus that sequence number.
/// All or none: if one is refused (say, the queue is full), those already
/// submitted are aborted.
pub fn start(
    state: &AppState,
    prompts: Vec<Vec<u32>>,
    plan: &Plan,
    constraint: Option<Constraint>,
    prompt_param: &str,
    stats: Arc<RequestStats>,
) -> Result<Generation, ApiError> {
    let engine = state.engine();
    let per_prompt = plan.best_of.unwrap_or(plan.n);
    // Ranking best_of candidates needs every token's log-probability.
    let logprobs = match plan.best_of {
        Some(_) => Some(plan.logprobs.unwrap_or(0)),
        None => plan.logprobs,
    };
    let seed = plan.seed.unwrap_or_else(rand::random);
    let (tx, events) = unbounded_channel();
    let mut guard = AbortGuard::new(engine.clone());
    let n_prompts = prompts.len();
    for (p, prompt_ids) in prompts.into_iter().enumerate() {
        let max_tokens = plan.max_tokens.unwrap_or_else(|| {
            // The endpoint's default, or what the context leaves; at least
            // the engine's minimum, so an overlong prompt is reported as
            // such rather than as `max_tokens` 0.
            let room = state
                .max_sequence_tokens()
                .saturating_sub(prompt_ids.len())
                .max(kvant_engine::continuation::MIN_TOKENS);
            plan.default_max_tokens.map_or(room, |d| d.min(room))
        });
        let base = EngineRequest {
            prompt_ids,
            max_tokens,
            sampling: plan.sampling.clone(),
            stop: plan.stop.clone(),
            ignore_eos: plan.ignore_eos,
            logprobs,
            constraint: constraint.clone(),
            logit_bias: plan.logit_bias.clone(),
            skip_special_tokens: plan.skip_special_tokens,
        };
        for j in 0..per_prompt {
            let index = p * per_prompt + j;
            let mut req = base.clone();
            req.sampling.seed = seed.wrapping_add(j as u64);
            let tx = tx.clone();
            let sink = Box::new(move |ev: Event| tx.send((index, ev)).is_ok());
            let id = engine
                .submit(req, sink)
                .map_err(|e| ApiError::from_submit(e, prompt_param))?;
            guard.push(id);
        }
    }
    Ok(Generation {
        events,
        stats,
        guard,
        per_prompt,
        prompts: vec![PromptUsage::default(); n_prompts],
    })
}

impl Generation {
    pub fn choices(&self) -> usize {
        self.prompts.len() * self.per_prompt
    }

    /// Adds finished choice `index`'s engine usage to `usage`: each prompt
    /// counts once however many choices continue it (its cached tokens: the
    /// most any of them found), the completions add up.
    pub fn account(&mut self, index: usize, u: &EngineUsage, usage: &mut Usage) {
        if let Some(p) = self.prompts.get_mut(index / self.per_prompt.max(1)) {
            if !std::mem::replace(&mut p.counted, true) {
                usage.prompt_tokens += u.prompt_tokens;
            }
            if u.cached_tokens > p.cached {
                usage.prompt_tokens_details.cached_tokens += u.cached_tokens - p.cached;
                p.cached = u.cached_tokens;
            }
        }
        usage.completion_tokens += u.completion_tokens;
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
    }

    /// The next event of any choice; `None` if the engine dropped every
    /// sink without finishing (it stopped).
    pub async fn next(&mut self) -> Option<(usize, Event)> {
        let next = self.events.recv().await;
        match &next {
            Some((_, Event::Token { .. })) => self.stats.token(),
            Some((_, Event::Finished { reason, usage, .. })) => self.stats.finished(*reason, usage),
            _ => {}
        }
        next
    }

    /// Every choice has finished: nothing is left to abort.
    pub fn disarm(&mut self) {
        self.guard.disarm();
    }
}

/// One finished choice.
#[derive(Debug, Default)]
pub struct ChoiceOutput {
    pub text: String,
    /// Per generated token, when logprobs were asked for.
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: Option<FinishReason>,
}

/// Waits for every choice to finish (a non-streamed response).
pub async fn collect(mut gen: Generation) -> Result<(Vec<ChoiceOutput>, Usage), ApiError> {
    let mut out: Vec<ChoiceOutput> = (0..gen.choices())
        .map(|_| ChoiceOutput::default())
        .collect();
    let mut usage = Usage::default();
    let mut open = gen.choices();
    while open > 0 {
        let Some((index, event)) = gen.next().await else {
            return Err(ApiError::internal(
                "the engine stopped before the response finished",
            ));
        };
        let Some(choice) = out.get_mut(index) else {
            continue;
        };
        match event {
            Event::Token { text, logprob, .. } => {
                choice.text.push_str(&text);
                choice.logprobs.extend(logprob);
            }
            Event::Finished {
                reason,
                text,
                usage: u,
            } => {
                choice.text.push_str(&text);
                if choice.finish_reason.replace(reason).is_none() {
                    open -= 1;
                    gen.account(index, &u, &mut usage);
                }
            }
            Event::Failed(msg) => return Err(ApiError::internal(msg)),
            // Generations never embed.
            Event::Embedding(_) => {}
        }
    }
    gen.disarm();
    Ok((out, usage))
}
