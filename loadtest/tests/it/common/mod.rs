//! A scripted OpenAI-compatible server on 127.0.0.1:0 for the load tester's tests.
//!
//! Each prompt is a script of `key=value` words that says how to answer:
//! - `ttft=MS`: first text chunk MS after the request arrived (default 0);
//! - `gap=MS`: chunk k is sent at `ttft + k*gap` from arrival, on a fixed schedule (default 0);
//! - `chunks=N`: text chunks (default 3), each `piece` (default ` hello`);
//! - `usage=N`: a final usage-only chunk (empty `choices`) with `completion_tokens` N;
//! - `fail`: HTTP 500 with body `boom`; `error_after=N`: an error event after N chunks;
//! - `split`: every event is written in three pieces (one inside a UTF-8 character) 5 ms apart;
//! - `role`: (chat) a role-only chunk at arrival, before the first text;
//! - `preempt`, `cached`: bump the `/metrics` preemption and prefix-cache-hit counters.
//!
//! Non-streaming requests get one JSON body at `ttft + (chunks-1)*gap`.


use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{sleep, sleep_until, Instant};

/// Counters the server keeps.
#[derive(Default)]
pub struct Counters {
    pub requests: AtomicUsize,
    pub in_flight: AtomicUsize,
    pub max_in_flight: AtomicUsize,
    pub preemptions: AtomicUsize,
    pub cache_hits: AtomicUsize,
    /// Every prompt received, in arrival order.
    pub prompts: std::sync::Mutex<Vec<String>>,
    /// The last `Authorization` header received.
    pub authorization: std::sync::Mutex<Option<String>>,
}

/// A running test server.
pub struct TestServer {
    pub url: String,
    pub counters: Arc<Counters>,
}

impl TestServer {
    /// Starts a server on an ephemeral loopback port.
    pub async fn start() -> Self {
        let counters = Arc::new(Counters::default());
        let app = Router::new()
            .route("/v1/completions", post(|s, h, b| handle(s, h, b, false)))
            .route("/v1/chat/completions", post(|s, h, b| handle(s, h, b, true)))
            .route("/v1/models", get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "scripted"}]})) }))
            .route("/metrics", get(metrics))
            .with_state(counters.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        TestServer { url, counters }
    }
}

/// Counts requests in flight for as long as it lives.
struct InFlight(Arc<Counters>);

impl InFlight {
    fn new(c: Arc<Counters>) -> Self {
        let now = c.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        c.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(c)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A parsed prompt script.
#[derive(Clone, Debug)]
struct Script {
    ttft: u64,
    gap: u64,
    chunks: usize,
    piece: String,
    usage: Option<u64>,
    fail: bool,
    error_after: Option<usize>,
    split: bool,
    role: bool,
}

impl Script {
    fn parse(prompt: &str) -> Self {
        let mut s = Script {
            ttft: 0,
            gap: 0,
            chunks: 3,
            piece: " hello".into(),
            usage: None,
            fail: false,
            error_after: None,
            split: false,
            role: false,
        };
        for word in prompt.split_whitespace() {
            let (k, v) = word.split_once('=').unwrap_or((word, ""));
            match k {
                "ttft" => s.ttft = v.parse().unwrap(),
                "gap" => s.gap = v.parse().unwrap(),
                "chunks" => s.chunks = v.parse().unwrap(),
                "piece" => s.piece = v.replace('_', " "),
                "usage" => s.usage = Some(v.parse().unwrap()),
                "fail" => s.fail = true,
                "error_after" => s.error_after = Some(v.parse().unwrap()),
                "split" => s.split = true,
                "role" => s.role = true,
                _ => {}
            }
        }
        s
    }
}

async fn handle(State(c): State<Arc<Counters>>, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    let arrived = Instant::now();
    let auth = headers.get("authorization").map(|v| v.to_str().unwrap().to_string());
    *c.authorization.lock().unwrap() = auth;
    let guard = InFlight::new(c.clone());
    c.requests.fetch_add(1, Ordering::SeqCst);
    let req: Value = serde_json::from_slice(&body).unwrap();
    let prompt =
        if chat { req["messages"][0]["content"].as_str() } else { req["prompt"].as_str() }.unwrap().to_string();
    c.prompts.lock().unwrap().push(prompt.clone());
    if prompt.split_whitespace().any(|w| w == "preempt") {
        c.preemptions.fetch_add(1, Ordering::SeqCst);
    }
    if prompt.split_whitespace().any(|w| w == "cached") {
        c.cache_hits.fetch_add(1, Ordering::SeqCst);
    }
    let script = Script::parse(&prompt);
    if script.fail {
        return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response();
    }
    let (ttft, gap) = (script.ttft, script.gap);
    let chunk_at = move |k: usize| arrived + Duration::from_millis(ttft + k as u64 * gap);
    if req["stream"] != json!(true) {
        sleep_until(chunk_at(script.chunks.saturating_sub(1))).await;
        let text = script.piece.repeat(script.chunks);
        let choice =
            if chat { json!({"message": {"role": "assistant", "content": text}}) } else { json!({"text": text}) };
        let mut resp = json!({"choices": [choice]});
        if let Some(n) = script.usage {
            resp["usage"] = json!({"prompt_tokens": 3, "completion_tokens": n});
        }
        return axum::Json(resp).into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let in_flight = guard;
        let split = script.split;
        let send = |event: String| {
            let tx = tx.clone();
            async move {
                let bytes = event.into_bytes();
                if split {
                    // Cut inside the event, and inside the 2-byte "é" the piece text carries.
                    let cut = bytes.iter().position(|&b| b == 0xC3).map_or(bytes.len() / 2, |i| i + 1);
                    for part in [&bytes[..3], &bytes[3..cut], &bytes[cut..]] {
                        let _ = tx.send(Bytes::copy_from_slice(part)).await;
                        sleep(Duration::from_millis(5)).await;
                    }
                } else {
                    let _ = tx.send(Bytes::from(bytes)).await;
                }
            }
        };
        if chat && script.role {
            send(sse(&json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))).await;
        }
        for k in 0..script.chunks {
            if script.error_after == Some(k) {
                send(sse(&json!({"error": {"message": "engine died", "code": 500}}))).await;
                return;
            }
            sleep_until(chunk_at(k)).await;
            let choice = if chat {
                json!({"index": 0, "delta": {"content": script.piece}})
            } else {
                json!({"index": 0, "text": script.piece})
            };
            send(sse(&json!({"choices": [choice]}))).await;
        }
        // No longer in flight once the text is out: the client may send its next request as
        // soon as it reads [DONE].
        drop(in_flight);
        if let Some(n) = script.usage {
            send(sse(&json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}))).await;
        }
        send("data: [DONE]\n\n".into()).await;
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx)) });
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap()
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

async fn metrics(State(c): State<Arc<Counters>>) -> String {
    let requests = c.requests.load(Ordering::SeqCst);
    format!(
        "# TYPE test:requests_total counter\ntest:requests_total {requests}\n\
         test:num_preemptions_total{{model=\"scripted\"}} {}\n\
         test:prefix_cache_queries_total {}\n\
         test:prefix_cache_hits_total {}\n\
         test:latency_bucket{{le=\"1\"}} {requests}\n",
        c.preemptions.load(Ordering::SeqCst),
        requests * 10,
        c.cache_hits.load(Ordering::SeqCst) * 10,
    )
}

/// Writes `prompts` one per line into a temp file for `--dataset-name prompts`.
pub fn prompts_file(prompts: &[&str]) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), prompts.join("\n")).unwrap();
    f
}

/// The default model (the README's test command fetches it).
pub fn default_model() -> PathBuf {
    tessera_engine::default_model::for_tests()
}
