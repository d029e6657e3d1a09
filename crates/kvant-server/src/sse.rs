//! Streamed responses: server-sent events in OpenAI's chunk format, each
//! `data: {json}` followed by a blank line, closed by `data: [DONE]`.
//!
//! Chunks go out as the engine's events arrive, choices interleaved as
//! their tokens come. The endpoint decides what a chunk looks like
//! ([`ChunkWriter`]); this module runs the loop. If the client disconnects,
//! hyper drops the body, which drops the [`Generation`] and so aborts its
//! engine requests.

use crate::api::usage::Usage;
use crate::error::ApiError;
use crate::generation::Generation;
use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::HeaderValue;
use axum::response::Response;
use kvant_engine::serving::{Event, TokenLogprob};
use kvant_engine::FinishReason;
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;

/// What one endpoint's chunks look like.
pub trait ChunkWriter: Send + 'static {
    /// Chunks sent before any token (chat announces each choice's role).
    fn opening(&mut self, choices: usize) -> Vec<Bytes>;
    /// A token of choice `index`; `None` when there is nothing to send (its
    /// text is held back and no logprobs were asked for).
    fn token(&mut self, index: usize, text: String, logprob: Option<TokenLogprob>)
        -> Option<Bytes>;
    /// The end of choice `index`, with the text held back until now.
    fn finished(&mut self, index: usize, text: String, reason: FinishReason) -> Vec<Bytes>;
    /// The last chunk when usage was asked for: no choices, only the usage.
    fn usage(&mut self, usage: Usage) -> Bytes;
}

/// One event: `data: <json>`.
pub fn event(value: &impl Serialize) -> Bytes {
    match serde_json::to_vec(value) {
        Ok(json) => frame(&json),
        Err(e) => error_event(&ApiError::internal(format!("cannot encode a chunk: {e}"))),
    }
}

fn error_event(e: &ApiError) -> Bytes {
    frame(e.body().to_string().as_bytes())
}

fn frame(data: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// A `text/event-stream` response streaming `gen` through `writer`.
pub fn response<W: ChunkWriter>(gen: Generation, mut writer: W, include_usage: bool) -> Response {
    let choices = gen.choices();
    let stream = EventStream {
        queue: writer.opening(choices).into(),
        open: vec![true; choices],
        remaining: choices,
        usage: Usage::default(),
        include_usage,
        done: false,
        gen,
        writer,
    };
    let body = futures_util::stream::unfold(stream, |mut s| async move {
        s.next().await.map(|chunk| (Ok::<_, Infallible>(chunk), s))
    });
    let mut resp = Response::new(Body::from_stream(body));
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

struct EventStream<W> {
    gen: Generation,
    writer: W,
    /// Chunks ready to send.
    queue: VecDeque<Bytes>,
    /// Per choice: not finished yet.
    open: Vec<bool>,
    remaining: usize,
    usage: Usage,
    include_usage: bool,
    /// `[DONE]` (or an error) is queued; nothing follows.
    done: bool,
}

impl<W: ChunkWriter> EventStream<W> {
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(chunk) = self.queue.pop_front() {
                return Some(chunk);
            }
            if self.done {
                return None;
            }
            match self.gen.next().await {
                Some((index, Event::Token { text, logprob, .. })) => {
                    self.queue.extend(self.writer.token(index, text, logprob));
                }
                Some((
                    index,
                    Event::Finished {
                        reason,
                        text,
                        usage,
                    },
                )) => {
                    if let Some(open) = self.open.get_mut(index).filter(|o| **o) {
                        *open = false;
                        self.remaining -= 1;
                        self.gen.account(index, &usage, &mut self.usage);
                        self.queue.extend(self.writer.finished(index, text, reason));
                    }
                    if self.remaining == 0 {
                        self.gen.disarm();
                        if self.include_usage {
                            self.queue.push_back(self.writer.usage(self.usage));
                        }
                        self.queue.push_back(Bytes::from_static(DONE));
                        self.done = true;
                    }
                }
                Some((_, Event::Failed(msg))) => self.fail(&ApiError::internal(msg)),
                // Generations never embed.
                Some((_, Event::Embedding(_))) => {}
                None => self.fail(&ApiError::internal(
                    "the engine stopped before the response finished",
                )),
            }
        }
    }

    /// Ends the stream with an error event (the OpenAI clients raise it).
    fn fail(&mut self, e: &ApiError) {
        self.queue.push_back(error_event(e));
        self.done = true;
    }
}
