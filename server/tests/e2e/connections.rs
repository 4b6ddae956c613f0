//! Connections and shutdown: the connection limit, header-read and keep-alive timeouts, the
//! open-file limit, drains a load balancer can see, and a second signal. Each test has its own
//! server (they fill it, time it out or stop it).

use crate::harness::{connect, json_of, metric, parse_response, read_until_closed, sse_events, Server};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Generous bound on anything the server should do "at once" or after a 1 s timeout.
const SOON: Duration = Duration::from_secs(30);

async fn send(stream: &mut TcpStream, bytes: &str) {
    stream.write_all(bytes.as_bytes()).await.unwrap();
}

/// Polls /metrics until `name` satisfies `want` (the request may be refused at the limit).
async fn wait_for_metric(s: &Server, name: &str, want: impl Fn(f64) -> bool) -> f64 {
    let t0 = Instant::now();
    loop {
        if let Ok(resp) = s.client().get(s.url("/metrics")).send().await {
            if resp.status() == 200 {
                let text = resp.text().await.unwrap();
                if let Some(v) = metric(&text, name).filter(|v| want(*v)) {
                    return v;
                }
            }
        }
        assert!(t0.elapsed() < SOON, "{name} never got there");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn half_sent_requests_and_idle_connections_are_closed() {
    let s = Server::start(&["--header-read-timeout-secs", "1", "--keep-alive-timeout-secs", "1"]);
    // Nothing sent.
    let mut idle = connect(&s).await;
    // Half the headers.
    let mut half_headers = connect(&s).await;
    send(&mut half_headers, "GET /health HTTP/1.1\r\nHost: localhost\r\n").await;
    // Headers, then half the body: answered 408 (JSON) once the body is overdue.
    let mut half_body = connect(&s).await;
    send(
        &mut half_body,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
    )
    .await;
    // A whole request, answered, then nothing more: closed after the keep-alive timeout.
    let mut kept = connect(&s).await;
    send(&mut kept, "GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n").await;
    for (name, stream) in [("idle", &mut idle), ("half headers", &mut half_headers), ("kept alive", &mut kept)] {
        let (bytes, closed) = read_until_closed(stream, SOON).await;
        assert!(closed, "{name}: still open after {SOON:?}");
        if name == "kept alive" {
            assert_eq!(parse_response(&bytes).0, 200);
        }
    }
    let (bytes, closed) = read_until_closed(&mut half_body, SOON).await;
    assert!(closed, "half body: still open");
    let (status, headers, body) = parse_response(&bytes);
    assert_eq!(status, 408, "{}", String::from_utf8_lossy(&bytes));
    assert!(headers.iter().any(|(k, v)| k == "content-type" && v == "application/json"));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "request_timeout", "{v}");
    let text = s.metrics().await;
    assert!(metric(&text, "tessera_request_timeouts_total").unwrap() >= 1.0);
    assert!(text.contains("tessera_http_connection_timeouts_total"), "{text}");
}

#[tokio::test]
async fn at_the_connection_limit_health_still_answers_and_the_rest_get_503() {
    const MAX: usize = 8;
    let s = Server::start_with_soft_nofile(&["--max-connections", &MAX.to_string()], 256);
    s.wait_for_logs(|l| l.iter().any(|l| l.contains("raised the open-file soft limit") && l.contains("256")).then_some(())).await;
    let mut idle = Vec::new();
    for _ in 0..MAX {
        idle.push(connect(&s).await);
    }
    // Connections are accepted in order: this one is over the limit.
    let resp = s.client().get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned()).as_deref(), Some("1"));
    let (status, v) = json_of(resp).await;
    assert_eq!((status, v["error"]["code"].as_str()), (503, Some("too_many_connections")), "{v}");
    s.wait_for_logs(|l| l.iter().any(|l| l.contains("connection limit reached")).then_some(())).await;
    // To make room, one idle connection was closed.
    let t0 = Instant::now();
    'found: loop {
        for c in &idle {
            let mut b = [0u8; 1];
            match c.try_read(&mut b) {
                Ok(0) => break 'found,
                Err(e) if e.kind() != std::io::ErrorKind::WouldBlock => break 'found,
                _ => {}
            }
        }
        assert!(t0.elapsed() < SOON, "no idle connection was closed to make room");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Full again (and more): health still answers, served over the limit if need be.
    for _ in 0..4 {
        idle.push(connect(&s).await);
    }
    for _ in 0..3 {
        let (status, body) = s.get("/health").await;
        assert_eq!((status, serde_json::from_str::<Value>(&body).unwrap()), (200, json!({"status": "ok"})));
    }
    assert!(wait_for_metric(&s, "tessera_http_connections_refused_total", |v| v >= 1.0).await >= 1.0);
    wait_for_metric(&s, "tessera_http_connections_reclaimed_total", |v| v >= 1.0).await;
    wait_for_metric(&s, "tessera_http_connections_open", |v| v >= 1.0 && v <= MAX as f64).await;
}

/// At the limit, the connection closed to make room is an idle one, never one whose request
/// is arriving (closing it would reset the client mid-request).
#[tokio::test]
async fn at_the_connection_limit_a_request_being_sent_is_not_closed() {
    let s = Server::start_with_soft_nofile(&["--max-connections", "2"], 256);
    let mut sending = connect(&s).await;
    let body = r#"{"prompt": "Hello", "max_tokens": 2, "temperature": 0}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let (first, rest) = request.split_at(20);
    send(&mut sending, first).await;
    let mut idle = connect(&s).await;
    // Both accepted (the accept loop takes them at once), then one more: over the limit,
    // answered 503, and one connection is closed to make room.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut over = connect(&s).await;
    send(&mut over, "GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n").await;
    let (bytes, _) = read_until_closed(&mut over, SOON).await;
    assert_eq!(parse_response(&bytes).0, 503, "{}", String::from_utf8_lossy(&bytes));
    let (_, closed) = read_until_closed(&mut idle, SOON).await;
    assert!(closed, "the idle connection was not closed to make room");
    // The one mid-request is still open and its request is answered.
    send(&mut sending, rest).await;
    let (bytes, closed) = read_until_closed(&mut sending, SOON).await;
    assert!(closed);
    assert_eq!(parse_response(&bytes).0, 200, "{}", String::from_utf8_lossy(&bytes));
}

#[tokio::test]
async fn sigterm_closes_idle_and_half_sent_connections_at_once() {
    let s = Server::start(&["--shutdown-grace-secs", "60", "--header-read-timeout-secs", "300", "--keep-alive-timeout-secs", "300"]);
    let mut idle = connect(&s).await;
    let mut half = connect(&s).await;
    send(&mut half, "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n\r\n{\"pro").await;
    // Both accepted (plus the /metrics request's own connection).
    wait_for_metric(&s, "tessera_http_connections_open", |v| v >= 3.0).await;
    let t0 = Instant::now();
    s.signal(libc::SIGTERM);
    for (name, stream) in [("idle", &mut idle), ("half-sent", &mut half)] {
        let (_, closed) = read_until_closed(stream, SOON).await;
        assert!(closed, "{name}: still open");
    }
    let status = s.wait_exit(SOON).expect("exits without waiting for the grace period");
    assert!(status.success(), "{status:?}");
    assert!(t0.elapsed() < SOON);
}

#[tokio::test]
async fn on_sigterm_health_turns_503_while_running_requests_finish() {
    let s = Server::start(&["--shutdown-grace-secs", "240"]);
    let body = json!({"prompt": "Tell me a story.", "max_tokens": 1000, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut running = s.client().post(s.url("/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(running.status(), 200);
    let mut streamed = running.chunk().await.unwrap().unwrap().to_vec();
    s.signal(libc::SIGTERM);
    s.wait_for_logs(|l| l.iter().any(|l| l.contains("shutting down")).then_some(())).await;
    // The listener is still open: health says shutting_down, new work is refused.
    let resp = s.client().get(s.url("/health")).send().await.expect("still listening while draining");
    assert_eq!(resp.headers()["retry-after"], "1");
    let (status, v) = json_of(resp).await;
    assert_eq!((status, v["status"].as_str(), v["error"]["code"].as_str()), (503, Some("shutting_down"), Some("shutting_down")), "{v}");
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Hi"}]})),
    ] {
        let resp = s.client().post(s.url(path)).json(&body).send().await.unwrap();
        assert_eq!(resp.headers()["retry-after"], "1", "{path}");
        let (status, v) = json_of(resp).await;
        assert_eq!((status, v["error"]["code"].as_str()), (503, Some("shutting_down")), "{path}: {v}");
    }
    // The running stream finishes within the grace period.
    while let Some(c) = running.chunk().await.unwrap() {
        streamed.extend_from_slice(&c);
    }
    let events = sse_events(&String::from_utf8(streamed).unwrap());
    assert_eq!(events.last().unwrap()["choices"][0]["finish_reason"], "length");
    let status = s.wait_exit(Duration::from_secs(60)).expect("exits once the stream is done");
    assert!(status.success(), "{status:?}");
    assert!(s.client().get(s.url("/health")).send().await.is_err(), "the listener closed at the end");
}

#[tokio::test]
async fn a_second_sigterm_exits_at_once() {
    // The delay keeps the listener open (health 503) long after the signal.
    let s = Server::start(&["--shutdown-delay-secs", "600"]);
    s.signal(libc::SIGTERM);
    s.wait_for_logs(|l| l.iter().any(|l| l.contains("shutting down")).then_some(())).await;
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 503, "listening through the delay");
    assert!(s.wait_exit(Duration::from_secs(1)).is_none(), "the delay holds the listener open");
    s.signal(libc::SIGTERM);
    let status = s.wait_exit(SOON).expect("a second signal exits at once");
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status:?}");
}
