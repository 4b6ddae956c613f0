//! Server-sent events as OpenAI streams them: `data: <json>\n\n` per event, then
//! `data: [DONE]\n\n`. A producer task writes frames into a channel that is the response body;
//! when the client goes away the body, and with it the receiver, is dropped, which the
//! producer sees at once ([`SseSender::next_or_closed`]).

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt};
use serde::Serialize;
use std::convert::Infallible;
use tokio::sync::mpsc;

/// The last event of every stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Frames waiting to be written (the engine keeps producing while the client reads slowly;
/// this only bounds the encoded backlog).
const BACKLOG: usize = 64;

/// One SSE event carrying `data`.
pub fn frame(data: &str) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// The writing half of an event stream.
pub struct SseSender {
    tx: mpsc::Sender<Result<Bytes, Infallible>>,
}

/// The client closed the connection.
#[derive(Debug)]
pub struct Closed;

impl SseSender {
    /// Sends one JSON event.
    pub async fn send_json(&self, value: &impl Serialize) -> Result<(), Closed> {
        let json = serde_json::to_string(value).expect("responses serialize");
        self.tx.send(Ok(frame(&json))).await.map_err(|_| Closed)
    }

    /// Sends one JSON event named `event` (an `event:` line before its data, as the Responses
    /// API's streams name theirs).
    pub async fn send_named(&self, event: &str, value: &impl Serialize) -> Result<(), Closed> {
        let json = serde_json::to_string(value).expect("responses serialize");
        self.tx.send(Ok(Bytes::from(format!("event: {event}\ndata: {json}\n\n")))).await.map_err(|_| Closed)
    }

    /// Sends `[DONE]`, ending the stream.
    pub async fn done(self) -> Result<(), Closed> {
        self.tx.send(Ok(Bytes::from_static(DONE))).await.map_err(|_| Closed)
    }

    /// The next item of `events`, or `None` when they end or the client has gone away
    /// (whichever comes first).
    pub async fn next_or_closed<S: Stream + Unpin>(&self, events: &mut S) -> Option<S::Item> {
        tokio::select! {
            biased;
            _ = self.tx.closed() => None,
            item = events.next() => item,
        }
    }
}

/// A sender and the streaming response reading from it.
pub fn channel() -> (SseSender, Response) {
    let (tx, rx) = mpsc::channel(BACKLOG);
    let body = Body::from_stream(tokio_stream(rx));
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream")),
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
    ];
    (SseSender { tx }, (headers, body).into_response())
}

fn tokio_stream<T: Send + 'static>(mut rx: mpsc::Receiver<T>) -> impl Stream<Item = T> + Send {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn frames_then_done() {
        let (tx, resp) = channel();
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "text/event-stream");
        let producer = tokio::spawn(async move {
            tx.send_json(&serde_json::json!({"a": 1})).await.unwrap();
            tx.send_json(&serde_json::json!({"b": "x\ny"})).await.unwrap();
            tx.done().await.unwrap();
        });
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        producer.await.unwrap();
        assert_eq!(&body[..], b"data: {\"a\":1}\n\ndata: {\"b\":\"x\\ny\"}\n\ndata: [DONE]\n\n");
    }

    #[tokio::test]
    async fn a_dropped_body_is_seen_while_waiting_for_events() {
        let (tx, resp) = channel();
        drop(resp);
        // `pending` never yields: only the closed channel can end the wait.
        let mut never = futures_util::stream::pending::<u32>();
        assert!(tx.next_or_closed(&mut never).await.is_none());
        assert!(tx.send_json(&1).await.is_err());
    }
}
