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
    let (prompt, plan) = validate::completions::parse(&body, &state)?;
    let param = prompt.param();
    let (ids, constraint) = tokio::try_join!(
        prompt::tokenize(&state, prompt),
        constrain::compile(&state, plan.grammar.as_ref())
    )?;
    let stats = stats.map(|Extension(s)| s).unwrap_or_default();
    let gen = generation::start(&state, ids, &plan, constraint, param, stats)?;
    let header = Header::new("cmpl", OBJECT, unix_now(), &state.config().model_name);
    let tokenizer = Arc::clone(state.tokenizer());
    let logprobs = plan.logprobs.is_some();
    match plan.stream {
        Some(s) => {
            let writer = Chunks {
                header,
                tokenizer,
                logprobs: logprobs.then(|| {
                    (0..gen.choices())
                        .map(|_| CompletionLogprobsBuilder::default())
                        .collect()
                }),
                include_usage: s.include_usage,
            };
            Ok(sse::response(gen, writer, s.include_usage))
        }
        None => {
            let (outputs, usage) = generation::collect(gen).await?;
            Ok(Json(response(header, &tokenizer, outputs, usage, logprobs)).into_response())
        }
    }
}

fn response(
    header: Header,
    tokenizer: &Tokenizer,
    outputs: Vec<ChoiceOutput>,
    usage: Usage,
    logprobs: bool,
) -> CompletionResponse {
    let choices = outputs
        .into_iter()
        .enumerate()
        .map(|(index, o)| CompletionChoice {
            index,
            logprobs: logprobs
                .then(|| CompletionLogprobsBuilder::default().entries(tokenizer, &o.logprobs)),
            text: o.text,
            finish_reason: o.finish_reason.map(FinishReason::as_str),
        })
        .collect();
    CompletionResponse {
        header,
        choices,
        usage,
    }
}

/// Stream chunks: one per token with text (or a logprob), then the
/// choice's last with its finish reason.
struct Chunks {
    header: Header,
    tokenizer: Arc<Tokenizer>,
    /// Per choice, when logprobs were asked for.
    logprobs: Option<Vec<CompletionLogprobsBuilder>>,
    include_usage: bool,
}

impl Chunks {
    fn chunk(&self, choice: CompletionChoice) -> Bytes {
        event(&CompletionChunk {
            header: &self.header,
            choices: vec![choice],
            usage: self.include_usage.then_some(None),
        })
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
    fn opening(&mut self, _choices: usize) -> Vec<Bytes> {
        Vec::new()
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
        event(&CompletionChunk {
            header: &self.header,
            choices: Vec::new(),
            usage: Some(Some(usage)),
        })
    }
}
