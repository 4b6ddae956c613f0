//! The OpenAI-compatible generation endpoints.

pub mod chat;
pub mod completions;
mod generation;
mod logprobs;
mod request;
mod response;

use crate::http::errors::ApiError;
use crate::http::sse;
use axum::response::{IntoResponse, Response};
use generation::{ChunkShaper, Events};
use request::CommonParams;
use response::{Meta, Usage};
use std::future::Future;
use tracing::Instrument;

/// Runs a handler in the request's span (`request{id=…}`), logging refusals and failures.
async fn respond(id: String, handler: impl Future<Output = Result<Response, ApiError>>) -> Response {
    let span = tracing::info_span!("request", %id);
    async move {
        handler.await.unwrap_or_else(|e| {
            if e.status.is_server_error() {
                tracing::warn!(status = e.status.as_u16(), error = %e.message, "request failed");
            } else {
                tracing::info!(status = e.status.as_u16(), param = e.param.as_deref(), error = %e.message, "request refused");
            }
            e.into_response()
        })
    }
    .instrument(span)
    .await
}

fn log_request(p: &CommonParams, prompts: usize, choices: usize, prompt_tokens: usize) {
    tracing::info!(prompts, choices, prompt_tokens, max_tokens = p.max_tokens, stream = p.stream(), user = p.user.as_deref(), "request accepted");
}

fn log_done(completion_tokens: usize) {
    tracing::info!(completion_tokens, "request finished");
}

/// The response to submitted choices: an SSE stream fed from a task in the current span, or
/// (not streaming) every choice collected into one JSON body with usage.
async fn deliver<S: ChunkShaper>(
    shaper: S,
    meta: Meta,
    events: Events,
    choices: usize,
    prompt_tokens: usize,
    common: &CommonParams,
) -> Result<Response, ApiError> {
    if !common.stream() {
        let outputs = generation::collect(events, choices).await?;
        let completion_tokens = generation::completion_tokens(&outputs);
        let whole: Vec<S::Whole> = outputs.into_iter().enumerate().map(|(i, o)| shaper.whole(i, o)).collect();
        log_done(completion_tokens);
        let usage = Usage::new(prompt_tokens, completion_tokens);
        return Ok(axum::Json(meta.envelope(S::WHOLE_OBJECT, whole, Some(Some(usage)))).into_response());
    }
    let include_usage = common.include_usage();
    let (tx, resp) = sse::channel();
    let task = async move {
        let s = generation::stream(shaper, meta, events, choices, prompt_tokens, include_usage, tx).await;
        if s.disconnected {
            tracing::info!(completion_tokens = s.completion_tokens, "client disconnected before the end of the stream");
        } else {
            log_done(s.completion_tokens);
        }
    };
    tokio::spawn(task.instrument(tracing::Span::current()));
    Ok(resp)
}
