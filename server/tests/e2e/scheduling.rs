//! Behaviour under concurrency: batching invariance, disconnects freeing KV blocks, queue
//! overflow, graceful shutdown. Each test has its own server (they watch its gauges or stop it).

use crate::harness::{metric, sse_events, texts, Server};
use futures_util::future::join_all;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const RUNNING: &str = "tessera_num_requests_running";
const KV_USED: &str = "tessera_kv_cache_blocks_used";

fn greedy(prompt: &str, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

#[tokio::test]
async fn concurrent_greedy_requests_equal_the_same_requests_alone() {
    let s = Server::start(&["--no-prefix-caching"]);
    let bodies = [
        greedy("The capital of France is", 12),
        greedy("Once upon a time", 16),
        greedy("def fibonacci(n):", 10),
        json!({"prompt": "Water boils at", "max_tokens": 12, "temperature": 0, "ignore_eos": true, "n": 2}),
        greedy(&"The quick brown fox jumps over the lazy dog. ".repeat(12), 8),
        json!({"prompt": "Paris is", "max_tokens": 12, "temperature": 0.8, "seed": 3, "ignore_eos": true}),
    ];
    let mut alone = Vec::new();
    for b in &bodies {
        alone.push(texts(&s.complete(b.clone()).await));
    }
    let together: Vec<Vec<String>> = join_all(bodies.iter().map(|b| s.complete(b.clone()))).await.iter().map(texts).collect();
    assert_eq!(together, alone);
}

async fn wait_for_metric(s: &Server, name: &str, want: impl Fn(f64) -> bool, what: &str) -> f64 {
    let t0 = Instant::now();
    loop {
        let text = s.metrics().await;
        let v = metric(&text, name).unwrap_or_else(|| panic!("{name} missing:\n{text}"));
        if want(v) {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{what}: {name} stuck at {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_client_that_goes_away_frees_its_kv_blocks() {
    let s = Server::start(&["--no-prefix-caching"]);
    let idle = wait_for_metric(&s, RUNNING, |v| v == 0.0, "idle").await;
    let idle_kv = metric(&s.metrics().await, KV_USED).unwrap();
    assert_eq!(idle, 0.0);
    let long = json!({"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": true, "temperature": 0});
    // Streaming: read the first chunk, then drop the connection.
    let mut body = long.clone();
    body["stream"] = json!(true);
    let mut resp = s.client().post(s.url("/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.chunk().await.unwrap().is_some());
    wait_for_metric(&s, KV_USED, |v| v > idle_kv, "streaming request running").await;
    drop(resp);
    wait_for_metric(&s, RUNNING, |v| v == 0.0, "after the stream was dropped").await;
    wait_for_metric(&s, KV_USED, |v| v == idle_kv, "after the stream was dropped").await;
    // Non-streaming: the client gives up while the server is still generating.
    let client = s.client().clone();
    let url = s.url("/v1/completions");
    let pending = tokio::spawn(async move { client.post(url).json(&long).send().await });
    wait_for_metric(&s, RUNNING, |v| v == 1.0, "non-streaming request running").await;
    pending.abort();
    wait_for_metric(&s, RUNNING, |v| v == 0.0, "after the client gave up").await;
    wait_for_metric(&s, KV_USED, |v| v == idle_kv, "after the client gave up").await;
}

#[tokio::test]
async fn a_full_queue_answers_503_while_running_requests_finish() {
    let s = Server::start(&["--max-num-seqs", "1", "--max-waiting-requests", "1"]);
    let body = greedy("Once upon a time", 24);
    let results = join_all((0..6).map(|_| s.post("/v1/completions", &body))).await;
    let ok: Vec<&Value> = results.iter().filter(|(st, _)| *st == 200).map(|(_, v)| v).collect();
    let refused: Vec<&Value> = results.iter().filter(|(st, _)| *st == 503).map(|(_, v)| v).collect();
    assert_eq!(ok.len() + refused.len(), 6, "{results:?}");
    assert!(!ok.is_empty() && !refused.is_empty(), "{results:?}");
    for v in &ok {
        assert_eq!(v["usage"]["completion_tokens"], 24);
    }
    for v in &refused {
        assert_eq!(v["error"]["type"], "server_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("overloaded"), "{v}");
    }
    let resp = s.client().post(s.url("/v1/completions")).json(&greedy("Hi", 2)).send().await.unwrap();
    assert_eq!(resp.status(), 200, "the server recovers");
}

#[tokio::test]
async fn sigterm_lets_short_requests_finish_aborts_long_ones_and_exits() {
    let s = Server::start(&["--shutdown-grace-secs", "2"]);
    let stream = |max_tokens: usize| {
        let mut b = greedy("Tell me a story.", max_tokens);
        b["stream"] = json!(true);
        s.client().post(s.url("/v1/completions")).json(&b).send()
    };
    let mut long = stream(5000).await.unwrap();
    assert!(long.chunk().await.unwrap().is_some());
    let short = stream(20).await.unwrap();
    s.signal(libc::SIGTERM);
    let (short_body, long_rest) = tokio::join!(short.text(), async {
        let mut rest = Vec::new();
        while let Some(c) = long.chunk().await.unwrap() {
            rest.extend_from_slice(&c);
        }
        rest
    });
    let short_events = sse_events(&short_body.unwrap());
    assert_eq!(short_events.last().unwrap()["choices"][0]["finish_reason"], "length", "finished within the grace period");
    let long_tail = String::from_utf8(long_rest).unwrap();
    assert!(long_tail.ends_with("data: [DONE]\n\n"), "{long_tail}");
    assert!(long_tail.contains("\"finish_reason\":\"abort\""), "aborted at the deadline: {long_tail}");
    let status = s.wait_exit(Duration::from_secs(30)).expect("the server exits after the grace period");
    assert!(status.success(), "{status:?}");
    s.wait_for_logs(|lines| lines.iter().any(|l| l.contains("shutting down")).then_some(())).await;
    assert!(s.client().get(s.url("/health")).send().await.is_err(), "no longer listening");
}

/// Issue 27's report, over HTTP: the same greedy request sent twice (the second a
/// prefix-cache hit) gives the same text and the same logprobs, bit for bit, as the first and
/// as a server with no prefix cache at all. (The engine test
/// `prefix_hits_and_chunking_do_not_change_results` covers chunk sizes, block sizes, hit
/// lengths and KV formats.)
#[tokio::test]
async fn a_prefix_cache_hit_answers_as_the_miss_did() {
    let body = json!({
        "prompt": "Once upon a time in a small village by the sea, there lived a fisherman who",
        "max_tokens": 48, "temperature": 0, "logprobs": 2,
    });
    let choice = |v: &Value| (v["choices"][0]["text"].clone(), v["choices"][0]["logprobs"].clone());
    let cached = Server::start(&[]);
    let miss = cached.complete(body.clone()).await;
    let hits_before = metric(&cached.metrics().await, "tessera_prefix_cache_hits_total").unwrap();
    let hit = cached.complete(body.clone()).await;
    let hits = metric(&cached.metrics().await, "tessera_prefix_cache_hits_total").unwrap() - hits_before;
    assert!(hits >= 16.0, "the second request was not a prefix-cache hit ({hits} tokens)");
    assert_eq!(choice(&hit), choice(&miss), "a prefix-cache hit changed the answer");
    drop(cached);
    let uncached = Server::start(&["--no-prefix-caching"]);
    assert_eq!(choice(&uncached.complete(body).await), choice(&miss), "the prefix cache changed the answer");
}
