//! Operational endpoints (never behind the API key): `/health`, `/version`, `/metrics`.

use super::errors::ApiError;
use super::AppState;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use prometheus::{Encoder, TextEncoder};
use serde_json::json;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tessera_engine::serve::vllm_families;

/// 200 `{"status": "ok"}` while the engine serves; 503 with Retry-After once shutdown has
/// begun (`shutting_down`) or if the engine thread died (`engine_stopped`), the body an
/// OpenAI-shaped error whose `code` (and top-level `status`) says which.
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    let down = if state.shutting_down.load(Ordering::SeqCst) {
        ApiError::shutting_down()
    } else if !state.engine.is_running() {
        ApiError { code: Some("engine_stopped"), ..ApiError::internal("The engine has stopped.") }
    } else {
        return Json(json!({"status": "ok"})).into_response();
    };
    let mut body = down.to_json();
    body["status"] = json!(down.code);
    let mut resp = super::json_response(StatusCode::SERVICE_UNAVAILABLE, &body);
    resp.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    resp
}

/// `{"version": "<crate version>"}`.
pub async fn version() -> Json<serde_json::Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// The engine's registry in Prometheus' text format, Tessera's `tessera_` names followed by
/// vLLM's `vllm:` names for the same series (labelled `model_name` with the served name).
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let encoder = TextEncoder::new();
    let mut buf = Vec::new();
    let mut families = state.engine.registry().gather();
    families.extend(vllm_families(&families, state.model_name(), state.engine.info().block_size));
    match encoder.encode(&families, &mut buf) {
        Ok(()) => ([(header::CONTENT_TYPE, encoder.format_type().to_owned())], buf).into_response(),
        Err(e) => super::errors::ApiError::internal(format!("encoding metrics failed: {e}")).into_response(),
    }
}
