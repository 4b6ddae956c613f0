//! `GET /v1/models` and `GET /v1/models/{id}`: the served model, OpenAI's list shape plus what
//! the engine runs it with (context, quantization, KV-cache type, per-layer kernel plan).

use super::errors::ApiError;
use super::AppState;
use axum::extract::{Path, State};
use axum::Json;
use serde::Serialize;
use std::sync::Arc;
use tessera_engine::model::PlanEntry;

#[derive(Serialize)]
struct ModelList {
    object: &'static str,
    data: Vec<ModelCard>,
}

#[derive(Serialize)]
struct ModelCard {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    max_model_len: usize,
    quantization: String,
    quantization_config: Option<String>,
    kv_cache_type: String,
    kv_cache_bytes_per_token: f64,
    tensor_parallel_size: usize,
    plan: Vec<PlanEntry>,
}

fn card(state: &AppState) -> ModelCard {
    let info = state.engine.info();
    ModelCard {
        id: state.model_name().to_owned(),
        object: "model",
        created: state.created,
        owned_by: "tessera",
        max_model_len: info.max_model_len,
        quantization: info.quantization.clone(),
        quantization_config: info.quantization_config.clone(),
        kv_cache_type: info.kv_cache_type.clone(),
        kv_cache_bytes_per_token: info.kv_bytes_per_token,
        tensor_parallel_size: info.tensor_parallel_size,
        plan: info.plan.clone(),
    }
}

/// The list of served models (one).
pub async fn list(State(state): State<Arc<AppState>>) -> Json<impl Serialize> {
    Json(ModelList { object: "list", data: vec![card(&state)] })
}

/// One model by id (404 `model_not_found` for any other id).
pub async fn retrieve(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<impl Serialize>, ApiError> {
    state.check_model(Some(&id))?;
    Ok(Json(card(&state)))
}
