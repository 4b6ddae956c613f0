//! The OpenAI-compatible generation endpoints, and vLLM's tokenizer endpoints.

pub mod chat;
pub mod completions;
mod generation;
mod logprobs;
mod request;
mod response;
pub mod responses;
mod structured;
pub mod tool_parsers;
pub mod tools;
pub mod tokenize;

use crate::http::conn::PeerSocket;
use crate::http::errors::ApiError;
use crate::http::{json, sse, AppState};
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use generation::{ChunkShaper, Deadline, Events};
use serde_json::Value;
use std::time::Instant;
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

/// What may cut a request short: its deadline and its client closing the connection.
pub struct Interrupts {
    deadline: Option<Deadline>,
    peer: Option<PeerSocket>,
}

/// Runs a request's validation (chat template rendering, tokenization, grammar compilation:
/// milliseconds of CPU for a long conversation or a large schema) on tokio's blocking pool, so
/// the async workers keep serving other connections meanwhile.
async fn off_the_runtime<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("validating the request failed: {e}")))?
}

/// Checks that new work is accepted and reads the body, all within the body timeout (the
/// connection's header-read timeout) and the server's request timeout; `started` is when the
/// request arrived.
async fn read_body(state: &AppState, body: Body, started: Instant) -> Result<Value, ApiError> {
    state.check_accepting()?;
    let mut limit = state.options.conn.header_read_timeout;
    if let Some(t) = state.options.request_timeout {
        limit = limit.min(t);
    }
    // A body still arriving when shutdown begins is not waited for.
    let read = async {
        tokio::select! {
            r = json::read_object(body, state.max_body_bytes()) => r,
            () = state.drain_started() => Err(ApiError::shutting_down()),
        }
    };
    match tokio::time::timeout_at((started + limit).into(), read).await {
        Ok(r) => r,
        Err(_) => {
            state.metrics.request_timeouts.inc();
            Err(ApiError::timeout(format!("The request body did not arrive within {} s.", limit.as_secs_f64())))
        }
    }
}

impl Interrupts {
    /// The request's deadline (from `request_timeout` or the server's default) and its client.
    fn new(state: &AppState, common: &CommonParams, started: Instant, peer: Option<PeerSocket>) -> Result<Self, ApiError> {
        let deadline = common.timeout(state.options.request_timeout)?.map(|after| Deadline {
            at: started + after,
            after,
            counter: state.metrics.request_timeouts.clone(),
        });
        Ok(Interrupts { deadline, peer })
    }

    async fn client_closed(&self) {
        match &self.peer {
            Some(p) => p.closed().await,
            None => std::future::pending().await,
        }
    }
}

/// Every choice's output, unless the deadline passes first (a 408) or the client closes its
/// side (499); either way the choices are aborted.
async fn collect(events: Events, choices: usize, interrupts: &Interrupts) -> Result<Vec<generation::ChoiceOutput>, ApiError> {
    tokio::select! {
        outputs = generation::collect(events, choices) => outputs,
        () = generation::until(interrupts.deadline.as_ref()) => {
            Err(interrupts.deadline.as_ref().map(Deadline::expired).expect("only a deadline expires"))
        }
        () = interrupts.client_closed() => {
            tracing::info!("the client closed its side of the connection; aborting the request");
            Err(ApiError::client_closed())
        }
    }
}

/// The response to submitted choices: an SSE stream fed from a task in the current span, or
/// (not streaming) every choice collected into one JSON body with usage. Past the deadline a
/// collected request is answered 408 and a stream gets an error event; a client that closes
/// its side before a collected answer is ready gets 499 (either way the choices are aborted).
async fn deliver<S: ChunkShaper>(
    shaper: S,
    meta: Meta,
    events: Events,
    choices: usize,
    prompt_tokens: usize,
    common: &CommonParams,
    interrupts: Interrupts,
) -> Result<Response, ApiError> {
    if !common.stream() {
        let outputs = collect(events, choices, &interrupts).await?;
        let completion_tokens = generation::completion_tokens(&outputs);
        let whole: Vec<S::Whole> = outputs.into_iter().enumerate().map(|(i, o)| shaper.whole(i, o)).collect();
        log_done(completion_tokens);
        let usage = Usage::new(prompt_tokens, completion_tokens);
        return Ok(axum::Json(meta.envelope(S::WHOLE_OBJECT, whole, Some(Some(usage)))).into_response());
    }
    let include_usage = common.include_usage();
    let (tx, resp) = sse::channel();
    let task = async move {
        let s = generation::stream(shaper, meta, events, choices, prompt_tokens, include_usage, interrupts.deadline, tx).await;
        if s.disconnected {
            tracing::info!(completion_tokens = s.completion_tokens, "client disconnected before the end of the stream");
        } else if !s.timed_out {
            log_done(s.completion_tokens);
        }
    };
    tokio::spawn(task.instrument(tracing::Span::current()));
    Ok(resp)
}
