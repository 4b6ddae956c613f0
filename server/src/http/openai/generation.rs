//! Running a request's choices on the engine: submit them all (or none), then either collect
//! every choice's output or stream chunks as events arrive. Dropping the event streams (client
//! gone, error) aborts the choices still running, which frees their KV blocks.

use super::response::{Meta, Usage};
use crate::http::errors::ApiError;
use crate::http::sse::SseSender;
use futures_util::stream::{self, BoxStream, SelectAll};
use futures_util::StreamExt;
use prometheus::IntCounter;
use serde::Serialize;
use std::time::{Duration, Instant};
use tessera_engine::serve::{Engine, Event, FinishReason, GenRequest, RequestStream, StopReason, TokenLogprob};

/// The events of all choices of one request, tagged with the choice index.
pub type Events = SelectAll<BoxStream<'static, (usize, Event)>>;

/// Submits every request at once, or none (a request the waiting queue could never hold is
/// a 400 naming `n`; a queue without room for it now is a 503). Choices of the same prompt
/// share its prefill in the engine.
pub fn submit_all(engine: &Engine, reqs: Vec<GenRequest>) -> Result<Events, ApiError> {
    Ok(merge(engine.submit_all(reqs)?))
}

fn merge(streams: Vec<RequestStream>) -> Events {
    stream::select_all(streams.into_iter().enumerate().map(|(i, rs)| {
        stream::unfold(rs, |mut rs| async move { rs.next().await.map(|e| (e, rs)) }).map(move |e| (i, e)).boxed()
    }))
}

/// How a choice ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    /// Why.
    pub reason: FinishReason,
    /// The stop string or token that matched.
    pub stop_reason: Option<StopReason>,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// Everything one choice produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChoiceOutput {
    /// Prompt tokens with logprobs, when asked for.
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// Generated text.
    pub text: String,
    /// Generated tokens (with logprobs when asked for).
    pub tokens: Vec<TokenLogprob>,
    /// How it ended.
    pub finish: Option<Finish>,
}

/// A choice's `Finished` event as a [`Finish`]; `None` for other events.
pub(super) fn finish_of(event: &Event) -> Option<Finish> {
    match event {
        Event::Finished { reason, stop_reason, usage } => {
            Some(Finish { reason: *reason, stop_reason: stop_reason.clone(), completion_tokens: usage.completion_tokens, cached_tokens: usage.cached_tokens })
        }
        _ => None,
    }
}

fn engine_error(msg: &str) -> ApiError {
    ApiError::internal(format!("The engine failed the request: {msg}"))
}

/// Waits for every choice to finish.
pub async fn collect(mut events: Events, choices: usize) -> Result<Vec<ChoiceOutput>, ApiError> {
    let mut out = vec![ChoiceOutput::default(); choices];
    while let Some((i, event)) = events.next().await {
        let o = &mut out[i];
        match event {
            Event::PromptLogprobs(l) => o.prompt_logprobs = Some(l),
            Event::Delta { text, tokens } => {
                o.text.push_str(&text);
                o.tokens.extend(tokens);
            }
            Event::Error(msg) => return Err(engine_error(&msg)),
            finished => o.finish = finish_of(&finished),
        }
    }
    if out.iter().any(|o| o.finish.is_none()) {
        return Err(engine_error("a choice ended without finishing"));
    }
    Ok(out)
}

/// Completion tokens over all choices.
pub fn completion_tokens(outputs: &[ChoiceOutput]) -> usize {
    outputs.iter().filter_map(|o| o.finish.as_ref()).map(|f| f.completion_tokens).sum()
}

/// How an endpoint turns one choice's events into stream chunks (`None`: nothing to send).
pub trait ChunkShaper: Send + 'static {
    /// A chunk's choice object.
    type Choice: Serialize + Send + Sync;
    /// The chunks' `object`.
    const OBJECT: &'static str;
    /// A non-streamed response's choice object.
    type Whole: Serialize;
    /// A non-streamed response's `object`.
    const WHOLE_OBJECT: &'static str;
    /// A non-streamed choice from its collected output.
    fn whole(&self, choice: usize, output: ChoiceOutput) -> Self::Whole;
    /// Sent for each choice before any event.
    fn start(&mut self, choice: usize) -> Option<Self::Choice>;
    /// The choice's prompt logprobs.
    fn prompt_logprobs(&mut self, choice: usize, logprobs: Vec<TokenLogprob>) -> Option<Self::Choice>;
    /// New text and tokens.
    fn delta(&mut self, choice: usize, text: String, tokens: Vec<TokenLogprob>) -> Option<Self::Choice>;
    /// The choice's last chunk, carrying `finish_reason`.
    fn finish(&mut self, choice: usize, finish: Finish) -> Self::Choice;
}

/// A request's deadline (`request_timeout` or the server's default).
#[derive(Clone, Debug)]
pub struct Deadline {
    /// When it falls.
    pub at: Instant,
    /// The timeout it came from (for the message).
    pub after: Duration,
    /// Counts the requests that ran past it.
    pub counter: IntCounter,
}

impl Deadline {
    /// The 408 answered when the deadline has passed (counted and logged).
    pub fn expired(&self) -> ApiError {
        self.counter.inc();
        tracing::info!(timeout_secs = self.after.as_secs_f64(), "request timed out; aborting it");
        ApiError::timeout(format!(
            "The request did not finish within its timeout of {} s and was aborted.",
            self.after.as_secs_f64()
        ))
    }
}

/// Resolves at the deadline; never without one.
pub async fn until(deadline: Option<&Deadline>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.at.into()).await,
        None => std::future::pending().await,
    }
}

/// What a stream sent, for the request's log line.
#[derive(Debug, Default)]
pub struct StreamSummary {
    /// Tokens generated over all choices.
    pub completion_tokens: usize,
    /// The client went away before the end.
    pub disconnected: bool,
    /// The deadline passed before the end (an error event was sent).
    pub timed_out: bool,
}

/// Streams every choice's chunks, then (with `include_usage`) a usage chunk, then `[DONE]`.
/// An engine error, or the deadline passing, is sent as an `{"error": ...}` event and ends the
/// stream (the choices still running are aborted).
#[allow(clippy::too_many_arguments)]
pub async fn stream<S: ChunkShaper>(
    mut shaper: S,
    meta: Meta,
    mut events: Events,
    choices: usize,
    prompt_tokens: usize,
    include_usage: bool,
    deadline: Option<Deadline>,
    sse: SseSender,
) -> StreamSummary {
    let mut summary = StreamSummary::default();
    let usage_field = include_usage.then_some(None);
    let send = |choice: S::Choice| {
        let chunk = meta.envelope(S::OBJECT, vec![choice], usage_field);
        let sse = &sse;
        async move { sse.send_json(&chunk).await }
    };
    let mut open = true;
    for i in 0..choices {
        if let Some(c) = shaper.start(i) {
            open = open && send(c).await.is_ok();
        }
    }
    let mut failed = false;
    while open {
        let next = tokio::select! {
            next = sse.next_or_closed(&mut events) => next,
            () = until(deadline.as_ref()) => {
                summary.timed_out = true;
                let error = deadline.as_ref().map(Deadline::expired).expect("only a deadline expires");
                open = sse.send_json(&error.to_json()).await.is_ok();
                break;
            }
        };
        let Some((i, event)) = next else { break };
        let chunk = match event {
            Event::PromptLogprobs(l) => shaper.prompt_logprobs(i, l),
            Event::Delta { text, tokens } => shaper.delta(i, text, tokens),
            Event::Error(msg) => {
                tracing::error!(error = %msg, "engine error while streaming");
                failed = true;
                open = sse.send_json(&engine_error(&msg).to_json()).await.is_ok();
                break;
            }
            finished => finish_of(&finished).map(|f| {
                summary.completion_tokens += f.completion_tokens;
                shaper.finish(i, f)
            }),
        };
        if let Some(c) = chunk {
            open = send(c).await.is_ok();
        }
    }
    drop(events);
    if open && include_usage && !failed && !summary.timed_out {
        let usage = Usage::new(prompt_tokens, summary.completion_tokens);
        open = sse.send_json(&meta.envelope(S::OBJECT, Vec::<S::Choice>::new(), Some(Some(usage)))).await.is_ok();
    }
    summary.disconnected = !open || sse.done().await.is_err();
    summary
}
