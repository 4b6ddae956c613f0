//! Request deadlines (`request_timeout`, `--request-timeout-secs`) and clients that half-close
//! their socket after sending a request.

use crate::harness::{connect, metric, parse_response, read_until_closed, shared, sse_events, Server};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

const RUNNING: &str = "tessera_num_requests_running";
const KV_USED: &str = "tessera_kv_cache_blocks_used";

async fn wait_for_metric(s: &Server, name: &str, want: impl Fn(f64) -> bool) {
    let t0 = Instant::now();
    while !want(metric(&s.metrics().await, name).unwrap()) {
        assert!(t0.elapsed() < Duration::from_secs(60), "{name} stuck");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn requests_past_their_deadline_get_408_and_free_their_kv() {
    let s = Server::start(&["--request-timeout-secs", "1", "--no-prefix-caching"]);
    wait_for_metric(&s, RUNNING, |v| v == 0.0).await;
    let idle_kv = metric(&s.metrics().await, KV_USED).unwrap();
    let long = json!({"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": true, "temperature": 0});
    // The server's default deadline.
    let (status, v) = s.post("/v1/completions", &long).await;
    assert_eq!((status, v["error"]["code"].as_str(), v["error"]["type"].as_str()), (408, Some("request_timeout"), Some("timeout_error")), "{v}");
    wait_for_metric(&s, RUNNING, |v| v == 0.0).await;
    wait_for_metric(&s, KV_USED, |v| v == idle_kv).await;
    // A request's own (shorter) deadline, streamed: an error event, then the end.
    let mut body = long.clone();
    body["stream"] = json!(true);
    body["request_timeout"] = json!(0.5);
    let events = s.stream("/v1/completions", body).await;
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "request_timeout", "{last}");
    let chat = json!({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 4000, "ignore_eos": true, "request_timeout": 0.5});
    let (status, v) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!((status, v["error"]["code"].as_str()), (408, Some("request_timeout")), "{v}");
    wait_for_metric(&s, RUNNING, |v| v == 0.0).await;
    wait_for_metric(&s, KV_USED, |v| v == idle_kv).await;
    assert!(metric(&s.metrics().await, "tessera_request_timeouts_total").unwrap() >= 3.0);
}

#[tokio::test]
async fn bad_request_timeouts_are_400_naming_the_field() {
    let s = shared();
    for bad in [json!(0), json!(-1), json!("soon"), json!(1e7), json!(true)] {
        let (status, v) = s.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 1, "request_timeout": bad})).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("request_timeout")), "{bad}: {v}");
    }
    let v = s.complete(json!({"prompt": "Hi", "max_tokens": 1, "request_timeout": 600})).await;
    assert_eq!(v["usage"]["completion_tokens"], 1);
}

/// Sends `body` to /v1/completions, shuts down the sending side, and reads the whole answer.
async fn half_closed(s: &Server, body: &Value) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut c = connect(s).await;
    let body = body.to_string();
    let req = format!("POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    c.write_all(req.as_bytes()).await.unwrap();
    c.shutdown().await.unwrap();
    let (bytes, closed) = read_until_closed(&mut c, Duration::from_secs(120)).await;
    assert!(closed, "still open");
    assert!(!bytes.is_empty(), "empty reply to a half-closed client");
    parse_response(&bytes)
}

#[tokio::test]
async fn a_half_closed_client_gets_its_answer_or_a_clean_abort() {
    let s = shared();
    let (status, headers, body) = half_closed(s, &json!({"prompt": "Hello", "max_tokens": 4})).await;
    assert!(headers.iter().any(|(k, v)| k == "content-type" && v == "application/json"));
    let v: Value = serde_json::from_slice(&body).unwrap();
    match status {
        200 => assert_eq!(v["usage"]["completion_tokens"], 4),
        499 => assert_eq!(v["error"]["code"], "client_closed_request", "{v}"),
        other => panic!("{other}: {v}"),
    }
    // Streamed: the whole stream.
    let (status, _, body) = half_closed(s, &json!({"prompt": "Hello", "max_tokens": 4, "stream": true})).await;
    assert_eq!(status, 200);
    let events = sse_events(&String::from_utf8(body).unwrap());
    assert_eq!(events.last().unwrap()["choices"][0]["finish_reason"], "length");
}
