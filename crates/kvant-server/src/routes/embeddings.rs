//! `POST /v1/embeddings`: each input's hidden states after the model's
//! final norm, pooled as `--pooling` says and scaled to unit length (as
//! OpenAI's embeddings are, and llama.cpp's server by default), computed
//! by the engine batched with generation.

use crate::access_log::RequestStats;
use crate::api::embeddings::{EmbeddingData, EmbeddingResponse, EmbeddingUsage, EmbeddingValue};
use crate::body::JsonObject;
use crate::error::ApiError;
use crate::generation::AbortGuard;
use crate::state::AppState;
use crate::{prompt, validate};
use axum::extract::State;
use axum::{Extension, Json};
use base64::Engine as _;
use kvant_engine::serving::{Event, SubmitError};
use std::sync::Arc;
use tokio::sync::mpsc::unbounded_channel;

pub async fn handle(
    State(state): State<Arc<AppState>>,
    stats: Option<Extension<Arc<RequestStats>>>,
    JsonObject(body): JsonObject,
) -> Result<Json<EmbeddingResponse>, ApiError> {
    let (inputs, plan) = validate::embeddings::parse(&body, &state)?;
    let ids =
        futures_util::future::try_join_all(inputs.into_iter().map(|p| prompt::tokenize(&state, p)))
            .await?;
    let (vectors, usage) = embed_all(&state, ids).await?;
    if let Some(Extension(s)) = stats {
        s.prompts(usage.prompt_tokens);
    }
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, mut v)| {
            normalize(&mut v);
            let embedding = match plan.base64 {
                true => EmbeddingValue::Base64(base64_f32(&v)),
                false => EmbeddingValue::Float(v),
            };
            EmbeddingData {
                object: "embedding",
                index,
                embedding,
            }
        })
        .collect();
    Ok(Json(EmbeddingResponse {
        object: "list",
        data,
        model: state.config().model_name.clone(),
        usage,
    }))
}

/// Runs every prompt through the engine, as many at a time as its queue
/// takes: when it is full, the next waits for one of this request's to
/// finish (a 429 only when none of them is in flight). A client that goes
/// away aborts them all (the guard).
async fn embed_all(
    state: &AppState,
    prompts: Vec<Vec<u32>>,
) -> Result<(Vec<Vec<f32>>, EmbeddingUsage), ApiError> {
    let engine = state.engine();
    let pooling = state.config().pooling;
    let n = prompts.len();
    let (tx, mut events) = unbounded_channel();
    let mut guard = AbortGuard::new(engine.clone());
    let mut out: Vec<Option<Vec<f32>>> = vec![None; n];
    let mut usage = EmbeddingUsage::default();
    let mut pending = prompts.into_iter().enumerate().peekable();
    let mut in_flight = 0;
    loop {
        while let Some((index, ids)) = pending.peek() {
            let tx = tx.clone();
            let index = *index;
            let sink = Box::new(move |e: Event| tx.send((index, e)).is_ok());
            match engine.embed(ids.clone(), pooling, sink) {
                Ok(id) => {
                    guard.push(id);
                    in_flight += 1;
                    pending.next();
                }
                Err(SubmitError::QueueFull) if in_flight > 0 => break,
                Err(e) => return Err(ApiError::from_submit(e, "input")),
            }
        }
        if in_flight == 0 {
            break;
        }
        let Some((index, event)) = events.recv().await else {
            return Err(ApiError::internal(
                "the engine stopped before the embeddings were computed",
            ));
        };
        match event {
            Event::Embedding(v) => {
                if let Some(slot) = out.get_mut(index) {
                    *slot = Some(v);
                }
            }
            Event::Finished { usage: u, .. } => {
                in_flight -= 1;
                usage.prompt_tokens += u.prompt_tokens;
            }
            Event::Failed(msg) => return Err(ApiError::internal(msg)),
            Event::Token { .. } => {}
        }
    }
    guard.disarm();
    usage.total_tokens = usage.prompt_tokens;
    let vectors = out
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| ApiError::internal("an input finished without its embedding"))?;
    Ok((vectors, usage))
}

/// Scales `v` to unit Euclidean length (a zero vector stays zero).
fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        for x in v {
            *x = (f64::from(*x) / norm) as f32;
        }
    }
}

fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_length_and_base64_round_trip() {
        let mut v = vec![3.0, -4.0, 0.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, -0.8, 0.0]);
        let mut zero = vec![0.0; 4];
        normalize(&mut zero);
        assert_eq!(zero, vec![0.0; 4]);
        let b = base64_f32(&[1.0, -2.5]);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b)
            .expect("base64");
        let back: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(back, vec![1.0, -2.5]);
    }
}
