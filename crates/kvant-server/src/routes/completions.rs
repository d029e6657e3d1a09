//! `POST /v1/completions`.

use crate::access_log::RequestStats;
use crate::api::completions::{
    CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse,
};
use crate::api::usage::Usage;
use crate::api::Header;
use crate::body::JsonObject;
use crate::error::ApiError;
use crate::generation::{self, ChoiceOutput};
use crate::logprobs::CompletionLogprobsBuilder;
use crate::prompt::PromptInput;
use crate::sse::{self, event, ChunkWriter};
use crate::state::{unix_now, AppState};
use crate::{constrain, prompt, validate};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use kvant_engine::serving::TokenLogprob;
use kvant_engine::FinishReason;
use kvant_model::tokenizer::Tokenizer;
use std::sync::Arc;

const OBJECT: &str = "text_completion";

pub async fn handle(
    State(state): State<Arc<AppState>>,
    stats: Option<Extension<Arc<RequestStats>>>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let (prompts, plan) = validate::completions::parse(&body, &state)?;
    let tokenizer = Arc::clone(state.tokenizer());
    // Each choice's echo: its prompt as text (token prompts decoded).
    let echoes: Option<Vec<String>> = plan.echo.then(|| {
        prompts
            .iter()
            .map(|p| match p {
                PromptInput::Text(t) => t.clone(),
                PromptInput::Tokens(ids) => tokenizer.decode(ids, false).unwrap_or_default(),
                PromptInput::Chat(..) => String::new(),
            })
            .collect()
    });
    let tokenized = futures_util::future::try_join_all(
        prompts.into_iter().map(|p| prompt::tokenize(&state, p)),
    );
    let (ids, constraint) = tokio::try_join!(
        tokenized,
        constrain::compile(state.grammar_tables(), plan.grammar.as_ref())
    )?;
    let stats = stats.map(|Extension(s)| s).unwrap_or_default();
    let gen = generation::start(&state, ids, &plan, constraint, "prompt", stats)?;
    let header = Header::new("cmpl", OBJECT, unix_now(), &state.config().model_name);
    let logprobs = plan.logprobs.is_some();
    match plan.stream {
        Some(s) => {
            let per_prompt = plan.n;
            let writer = Chunks {
                header,
                tokenizer,
                logprobs: logprobs.then(|| {
                    (0..gen.choices())
                        .map(|_| CompletionLogprobsBuilder::default())
                        .collect()
                }),
                include_usage: s.include_usage,
                echoes: echoes.map(|e| (e, per_prompt)),
            };
            Ok(sse::response(gen, writer, s.include_usage))
        }
        None => {
            let (mut outputs, usage) = generation::collect(gen).await?;
            if let Some(per_prompt) = plan.best_of {
                outputs = best_of(outputs, per_prompt, plan.n);
                if !logprobs {
                    outputs.iter_mut().for_each(|o| o.logprobs.clear());
                }
            }
            if let Some(echoes) = &echoes {
                for (i, o) in outputs.iter_mut().enumerate() {
                    if let Some(e) = echoes.get(i / plan.n.max(1)) {
                        o.text.insert_str(0, e);
                    }
                }
            }
            Ok(Json(response(header, &tokenizer, outputs, usage, logprobs)).into_response())
        }
    }
}

/// Of each prompt's `per_prompt` candidates (in order), the `n` with the
/// highest mean log-probability per token, best first (OpenAI's "best").
fn best_of(outputs: Vec<ChoiceOutput>, per_prompt: usize, n: usize) -> Vec<ChoiceOutput> {
    let score = |o: &ChoiceOutput| match o.logprobs.len() {
        0 => f32::NEG_INFINITY,
        len => o.logprobs.iter().map(|t| t.logprob).sum::<f32>() / len as f32,
    };
    let mut out = Vec::with_capacity(outputs.len() / per_prompt.max(1) * n);
    let mut it = outputs.into_iter().peekable();
    while it.peek().is_some() {
        let mut group: Vec<ChoiceOutput> = it.by_ref().take(per_prompt).collect();
        group.sort_by(|a, b| score(b).total_cmp(&score(a)));
        out.extend(group.into_iter().take(n));
    }
    out
}

fn response(
    header: Header,
    tokenizer: &Tokenizer,
    outputs: Vec<ChoiceOutput>,
    usage: Usage,
    logprobs: bool,
) -> CompletionResponse {
    CompletionResponse::new(header, outputs, usage, |(index, o)| CompletionChoice {
        index,
        logprobs: logprobs
            .then(|| CompletionLogprobsBuilder::default().entries(tokenizer, &o.logprobs)),
        text: o.text,
        finish_reason: o.finish_reason.map(FinishReason::as_str),
    })
}

/// Stream chunks: one per token with text (or a logprob), then the
/// choice's last with its finish reason.
struct Chunks {
    header: Header,
    tokenizer: Arc<Tokenizer>,
    /// Per choice, when logprobs were asked for.
    logprobs: Option<Vec<CompletionLogprobsBuilder>>,
    include_usage: bool,
    /// `echo`: each prompt's text and the choices per prompt; each choice's
    /// first chunk carries its prompt.
    echoes: Option<(Vec<String>, usize)>,
}

impl Chunks {
    fn chunk(&self, choice: CompletionChoice) -> Bytes {
        event(&CompletionChunk::choice(
            &self.header,
            choice,
            self.include_usage,
        ))
    }

    fn token_logprobs(
        &mut self,
        index: usize,
        lp: Option<TokenLogprob>,
    ) -> Option<CompletionLogprobs> {
        let builder = self.logprobs.as_mut()?.get_mut(index)?;
        let tokens: Vec<TokenLogprob> = lp.into_iter().collect();
        Some(builder.entries(&self.tokenizer, &tokens))
    }
}

impl ChunkWriter for Chunks {
    fn opening(&mut self, choices: usize) -> Vec<Bytes> {
        let Some((echoes, per_prompt)) = &self.echoes else {
            return Vec::new();
        };
        (0..choices)
            .filter_map(|index| {
                let text = echoes.get(index / (*per_prompt).max(1))?.clone();
                Some(self.chunk(CompletionChoice {
                    index,
                    text,
                    logprobs: None,
                    finish_reason: None,
                }))
            })
            .collect()
    }

    fn token(&mut self, index: usize, text: String, lp: Option<TokenLogprob>) -> Option<Bytes> {
        let logprobs = self.token_logprobs(index, lp);
        if text.is_empty() && logprobs.is_none() {
            return None;
        }
        Some(self.chunk(CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: None,
        }))
    }

    fn finished(&mut self, index: usize, text: String, reason: FinishReason) -> Vec<Bytes> {
        vec![self.chunk(CompletionChoice {
            index,
            text,
            logprobs: None,
            finish_reason: Some(reason.as_str()),
        })]
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        event(&CompletionChunk::usage(&self.header, usage))
    }
}
