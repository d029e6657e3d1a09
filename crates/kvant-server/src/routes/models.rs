//! `GET /v1/models` and `GET /v1/models/{id}`: the one model served.

use crate::api::models::{ModelCard, ModelList};
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Path, State};
use axum::Json;
use std::sync::Arc;

fn card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.config().model_name.clone(),
        object: "model",
        created: state.created(),
        owned_by: "kvant",
        max_model_len: state.engine().context_length(),
    }
}

pub async fn list(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![card(&state)],
    })
}

pub async fn get(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    if id == state.config().model_name {
        Ok(Json(card(&state)))
    } else {
        Err(ApiError::model_not_found(&id))
    }
}
