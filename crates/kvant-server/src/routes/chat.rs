//! `POST /v1/chat/completions`.

use crate::access_log::RequestStats;
use crate::api::chat::{
    AssistantMessage, ChatChoice, ChatChunk, ChatChunkChoice, ChatResponse, Delta,
};
use crate::api::usage::Usage;
use crate::api::Header;
use crate::body::JsonObject;
use crate::error::ApiError;
use crate::generation::{self, ChoiceOutput};
use crate::logprobs;
use crate::sse::{self, event, ChunkWriter};
use crate::state::{unix_now, AppState};
use crate::tools::{self, ToolFormat, ToolStream};
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

const ROLE: &str = "assistant";
/// The finish reason of a reply that calls tools.
const TOOL_CALLS: &str = "tool_calls";

pub async fn handle(
    State(state): State<Arc<AppState>>,
    stats: Option<Extension<Arc<RequestStats>>>,
    JsonObject(body): JsonObject,
) -> Result<Response, ApiError> {
    let (prompt, plan) = validate::chat::parse(&body, &state)?;
    let param = prompt.param();
    let (ids, constraint) = tokio::try_join!(
        prompt::tokenize(&state, prompt),
        constrain::compile(state.grammar_tables(), plan.grammar.as_ref())
    )?;
    let stats = stats.map(|Extension(s)| s).unwrap_or_default();
    let gen = generation::start(&state, vec![ids], &plan, constraint, param, stats)?;
    let model = &state.config().model_name;
    let tokenizer = Arc::clone(state.tokenizer());
    let with_logprobs = plan.logprobs.is_some();
    match plan.stream {
        Some(s) => {
            let writer = Chunks {
                header: Header::new("chatcmpl", "chat.completion.chunk", unix_now(), model),
                tokenizer,
                logprobs: with_logprobs,
                include_usage: s.include_usage,
                tools: plan
                    .tools
                    .map(|f| (0..gen.choices()).map(|_| ToolStream::new(f)).collect()),
            };
            Ok(sse::response(gen, writer, s.include_usage))
        }
        None => {
            let (outputs, usage) = generation::collect(gen).await?;
            let header = Header::new("chatcmpl", "chat.completion", unix_now(), model);
            let resp = response(
                header,
                &tokenizer,
                outputs,
                usage,
                with_logprobs,
                plan.tools,
            );
            Ok(Json(resp).into_response())
        }
    }
}

fn response(
    header: Header,
    tokenizer: &Tokenizer,
    outputs: Vec<ChoiceOutput>,
    usage: Usage,
    with_logprobs: bool,
    tools: Option<ToolFormat>,
) -> ChatResponse {
    ChatResponse::new(header, outputs, usage, |(index, o)| {
        let (content, calls) = match tools {
            Some(f) => tools::parse(f, &o.text),
            None => (o.text, Vec::new()),
        };
        let called = !calls.is_empty();
        ChatChoice {
            index,
            logprobs: with_logprobs.then(|| logprobs::chat(tokenizer, &o.logprobs)),
            message: AssistantMessage {
                role: ROLE,
                content: (!called || !content.is_empty()).then_some(content),
                tool_calls: called.then(|| calls.into_iter().map(|c| c.into_api(None)).collect()),
            },
            finish_reason: match called {
                true => Some(TOOL_CALLS),
                false => o.finish_reason.map(FinishReason::as_str),
            },
        }
    })
}

/// Stream chunks: each choice's role first, then text deltas, then an empty
/// delta carrying the finish reason.
struct Chunks {
    header: Header,
    tokenizer: Arc<Tokenizer>,
    logprobs: bool,
    include_usage: bool,
    /// Per choice, when the request has tools: its text with calls held back.
    tools: Option<Vec<ToolStream>>,
}

impl Chunks {
    fn chunk(&self, choice: ChatChunkChoice) -> Bytes {
        event(&ChatChunk::choice(&self.header, choice, self.include_usage))
    }

    fn content(&self, index: usize, text: String, lp: Option<TokenLogprob>) -> Bytes {
        let tokens: Vec<TokenLogprob> = lp.into_iter().collect();
        self.chunk(ChatChunkChoice {
            index,
            delta: Delta {
                content: Some(text),
                ..Delta::default()
            },
            logprobs: (self.logprobs && !tokens.is_empty())
                .then(|| logprobs::chat(&self.tokenizer, &tokens)),
            finish_reason: None,
        })
    }
}

impl ChunkWriter for Chunks {
    fn opening(&mut self, choices: usize) -> Vec<Bytes> {
        (0..choices)
            .map(|index| {
                self.chunk(ChatChunkChoice {
                    index,
                    delta: Delta {
                        role: Some(ROLE),
                        content: Some(String::new()),
                        ..Delta::default()
                    },
                    logprobs: None,
                    finish_reason: None,
                })
            })
            .collect()
    }

    fn token(&mut self, index: usize, text: String, lp: Option<TokenLogprob>) -> Option<Bytes> {
        let lp = lp.filter(|_| self.logprobs);
        let text = match self.tools.as_mut().and_then(|t| t.get_mut(index)) {
            Some(stream) => stream.push(&text),
            None => text,
        };
        if text.is_empty() && lp.is_none() {
            return None;
        }
        Some(self.content(index, text, lp))
    }

    fn finished(&mut self, index: usize, text: String, reason: FinishReason) -> Vec<Bytes> {
        let mut out = Vec::with_capacity(2);
        let (text, calls) = match self.tools.as_mut().and_then(|t| t.get_mut(index)) {
            Some(stream) => {
                let mut sent = stream.push(&text);
                let done = std::mem::replace(stream, ToolStream::new(stream.format()));
                let (rest, calls) = done.finish();
                sent.push_str(&rest);
                (sent, calls)
            }
            None => (text, Vec::new()),
        };
        if !text.is_empty() {
            out.push(self.content(index, text, None));
        }
        let called = !calls.is_empty();
        for (k, call) in calls.into_iter().enumerate() {
            out.push(self.chunk(ChatChunkChoice {
                index,
                delta: Delta {
                    tool_calls: Some(vec![call.into_api(Some(k))]),
                    ..Delta::default()
                },
                logprobs: None,
                finish_reason: None,
            }));
        }
        out.push(self.chunk(ChatChunkChoice {
            index,
            delta: Delta::default(),
            logprobs: None,
            finish_reason: Some(if called { TOOL_CALLS } else { reason.as_str() }),
        }));
        out
    }

    fn usage(&mut self, usage: Usage) -> Bytes {
        event(&ChatChunk::usage(&self.header, usage))
    }
}
