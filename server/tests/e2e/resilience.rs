//! A bounded flood: 1,000 concurrent connections of mixed behaviour (streaming to the end,
//! disconnecting mid-stream, reading slowly, writing the request slowly, idle keep-alive,
//! plain completions) for a minute against one server. Only 200s and 503s may come back, the
//! server's resident memory stays bounded, and afterwards the KV cache and the queues are
//! back to idle and the server answers at once.

use super::harness::{metric, Server};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Concurrent connections.
const CONNECTIONS: usize = 1000;
/// How long the flood lasts.
const FLOOD: Duration = Duration::from_secs(60);

/// What a connection does, in turn.
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    /// A streamed completion read to its end.
    Stream,
    /// A streamed completion dropped after its first bytes.
    Disconnect,
    /// A streamed completion read a few bytes at a time with pauses.
    SlowReader,
    /// The request written a few bytes at a time with pauses.
    SlowWriter,
    /// `/health` on a keep-alive connection, then idle, then `/health` again.
    Idle,
    /// A non-streamed completion.
    Plain,
}

const BEHAVIOURS: [Behaviour; 6] =
    [Behaviour::Stream, Behaviour::Disconnect, Behaviour::SlowReader, Behaviour::SlowWriter, Behaviour::Idle, Behaviour::Plain];

fn completion(addr: &str, stream: bool, i: usize) -> Vec<u8> {
    let body = format!(r#"{{"prompt": "Request {i}: the weather today is", "max_tokens": 8, "temperature": 0, "stream": {stream}}}"#);
    format!("POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())
        .into_bytes()
}

fn health(addr: &str) -> Vec<u8> {
    format!("GET /health HTTP/1.1\r\nhost: {addr}\r\n\r\n").into_bytes()
}

/// The status code of a response's first bytes.
fn status(head: &[u8]) -> Option<u16> {
    let line = std::str::from_utf8(head.split(|&b| b == b'\n').next()?).ok()?;
    line.split(' ').nth(1)?.parse().ok()
}

/// Reads until the status line is in; `None` when the server closed first.
async fn read_status(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<u16> {
    let mut chunk = [0u8; 4096];
    while !buf.contains(&b'\n') {
        let n = match s.read(&mut chunk).await {
            Ok(n) => n,
            Err(e) => {
                eprintln!("flood: reading the status failed: {e}");
                return None;
            }
        };
        if n == 0 {
            eprintln!("flood: closed before a status ({} bytes)", buf.len());
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    status(buf)
}

/// Reads to the end of a `connection: close` response, `pause` between small reads.
async fn drain(s: &mut TcpStream, pause: Option<Duration>) {
    let mut chunk = vec![0u8; if pause.is_some() { 16 } else { 8192 }];
    while let Ok(n) = s.read(&mut chunk).await {
        if n == 0 {
            break;
        }
        if let Some(p) = pause {
            tokio::time::sleep(p).await;
        }
    }
}

/// One exchange of `b`; returns the status (or `None` if the connection failed).
async fn exchange(addr: &str, b: Behaviour, i: usize) -> Option<u16> {
    let mut s = match TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("flood: connecting failed: {e}");
            return None;
        }
    };
    let mut buf = Vec::new();
    match b {
        Behaviour::Stream | Behaviour::Disconnect | Behaviour::SlowReader | Behaviour::Plain => {
            let mut req = completion(addr, !matches!(b, Behaviour::Plain), i);
            // One request per connection: the server closes after the response.
            let at = req.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
            req.splice(at..at, b"\r\nconnection: close".iter().copied());
            s.write_all(&req).await.ok()?;
            let code = read_status(&mut s, &mut buf).await?;
            match b {
                Behaviour::Disconnect => {}
                Behaviour::SlowReader => drain(&mut s, Some(Duration::from_millis(50))).await,
                _ => drain(&mut s, None).await,
            }
            Some(code)
        }
        Behaviour::SlowWriter => {
            let mut req = completion(addr, false, i);
            let at = req.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
            req.splice(at..at, b"\r\nconnection: close".iter().copied());
            for part in req.chunks(24) {
                if let Err(e) = s.write_all(part).await {
                    // A server may answer before the request is all sent (RFC 9112 9.5): read it.
                    let code = read_status(&mut s, &mut buf).await;
                    eprintln!("flood: writing slowly failed ({e}); the answer: {code:?} {:?}", String::from_utf8_lossy(&buf));
                    return code;
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            let code = read_status(&mut s, &mut buf).await?;
            drain(&mut s, None).await;
            Some(code)
        }
        Behaviour::Idle => {
            s.write_all(&health(addr)).await.ok()?;
            let code = read_status(&mut s, &mut buf).await?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            // The keep-alive connection may have been closed by the server meanwhile; a new
            // one must work.
            let mut buf2 = Vec::new();
            let second = match s.write_all(&health(addr)).await {
                Ok(()) => read_status(&mut s, &mut buf2).await,
                Err(_) => None,
            };
            if second.is_none() {
                let mut t = TcpStream::connect(addr).await.ok()?;
                t.write_all(&health(addr)).await.ok()?;
                return read_status(&mut t, &mut buf2).await.filter(|&c| c == code);
            }
            second
        }
    }
}

/// The resident set of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// This process's open-file limit raised to its hard limit (a thousand sockets).
fn raise_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(lim.rlim_cur >= 2 * CONNECTIONS as u64 + 64, "open-file hard limit {} is too low for the flood", lim.rlim_max);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_mixed_connections_for_a_minute() {
    raise_fd_limit();
    // The connection limit well above the flood: the server's side of a dropped connection
    // lingers until its next write, and at the limit the server closes connections it counts
    // as idle (the limit's own behaviour is `connections::at_the_connection_limit_...`).
    let server = Server::start(&["--kv-cache-memory", "64MiB", "--max-num-seqs", "8", "--max-waiting-requests", "64", "--max-connections", "6000"]);
    let addr = server.base.trim_start_matches("http://").to_string();
    let before = rss(server.pid());
    let statuses: Arc<[AtomicUsize; 600]> = Arc::new(std::array::from_fn(|_| AtomicUsize::new(0)));
    let failed = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + FLOOD;
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let (addr, statuses, failed) = (addr.clone(), Arc::clone(&statuses), Arc::clone(&failed));
        tasks.push(tokio::spawn(async move {
            let mut i = c;
            while Instant::now() < deadline {
                let b = BEHAVIOURS[i % BEHAVIOURS.len()];
                match tokio::time::timeout(Duration::from_secs(60), exchange(&addr, b, i)).await {
                    Ok(Some(code)) => {
                        statuses[usize::from(code).min(599)].fetch_add(1, Ordering::Relaxed);
                        if code == 503 {
                            // As a client honouring Retry-After would, rather than a hot loop.
                            tokio::time::sleep(Duration::from_millis(250)).await;
                        }
                    }
                    other => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        eprintln!("flood: {b:?} exchange {i} failed: {}", if other.is_err() { "timed out" } else { "no status" });
                    }
                }
                i += CONNECTIONS;
            }
        }));
    }
    let mut peak = before;
    while tasks.iter().any(|t| !t.is_finished()) {
        peak = peak.max(rss(server.pid()));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let counts: Vec<(usize, usize)> =
        statuses.iter().enumerate().map(|(c, n)| (c, n.load(Ordering::Relaxed))).filter(|&(_, n)| n > 0).collect();
    let ok = statuses[200].load(Ordering::Relaxed);
    assert!(counts.iter().all(|&(c, _)| c == 200 || c == 503), "statuses other than 200 and 503: {counts:?}");
    if failed.load(Ordering::Relaxed) > 0 {
        for l in server.logs().iter().filter(|l| l.contains("WARN") || l.contains("ERROR")).take(20) {
            eprintln!("server: {l}");
        }
    }
    assert_eq!(failed.load(Ordering::Relaxed), 0, "exchanges that failed or got no status (statuses {counts:?})");
    assert!(ok > CONNECTIONS, "too few requests served: {counts:?}");
    // Bounded: the pool is 64 MiB; connections, queues and buffers stay within 512 MiB more.
    assert!(peak < before + (512 << 20), "RSS grew from {} MiB to {} MiB", before >> 20, peak >> 20);
    // Back to idle: no running or waiting request, no KV block in use, /health at once.
    let idle = Instant::now();
    loop {
        let m = server.metrics().await;
        let busy = ["tessera_num_requests_running", "tessera_num_requests_waiting", "tessera_kv_cache_usage_perc"]
            .map(|n| metric(&m, n).unwrap_or_else(|| panic!("no {n}")));
        if busy.iter().all(|&v| v == 0.0) {
            break;
        }
        assert!(idle.elapsed() < Duration::from_secs(10), "not idle 10 s after the flood: {busy:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let t0 = Instant::now();
    let (code, _) = tokio::time::timeout(Duration::from_secs(5), server.get("/health")).await.expect("/health answers after the flood");
    assert_eq!(code, 200);
    eprintln!("flood: {counts:?}, RSS {} -> peak {} MiB, /health in {:?}", before >> 20, peak >> 20, t0.elapsed());
}

/// Killed mid-stream (SIGKILL, nothing to clean up with): the client sees the stream end
/// without its `[DONE]` (an error from its HTTP library, never a response that looks whole),
/// and a new server starts at once on the same port and serves the same request. `serve`
/// holds no file open for writing (checked mid-stream), so a kill leaves nothing on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_stream_the_client_sees_a_cut_and_a_restart_is_clean() {
    let first = Server::start(&[]);
    let port = first.base.rsplit(':').next().unwrap().to_string();
    let body = serde_json::json!({"prompt": "Count slowly:", "max_tokens": 200, "temperature": 0, "stream": true, "ignore_eos": true});
    let mut resp = first.client().post(first.url("/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut seen = String::new();
    while !seen.contains("\"text\"") {
        seen.push_str(&String::from_utf8_lossy(&resp.chunk().await.unwrap().unwrap()));
    }
    assert_eq!(files_open_for_writing(first.pid()), Vec::<String>::new());
    first.signal(libc::SIGKILL);
    assert!(first.wait_exit(Duration::from_secs(10)).is_some(), "SIGKILL did not end the server");
    let mut cut = false;
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => seen.push_str(&String::from_utf8_lossy(&c)),
            Ok(None) => break,
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    assert!(!seen.contains("[DONE]"), "a killed stream looked complete");
    assert!(cut, "the client was not told the stream was cut");
    // Same port, at once: the listener is gone with the process and nothing was left on disk.
    let second = Server::start(&["--port", &port]);
    assert_eq!(second.base, first.base);
    let v = second.complete(serde_json::json!({"prompt": "Count slowly:", "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

/// Regular files (not sockets, pipes, devices) a process holds open with write access.
fn files_open_for_writing(pid: u32) -> Vec<String> {
    let mut out = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else { continue };
        let target = target.to_string_lossy().into_owned();
        if !target.starts_with('/') || target.starts_with("/dev/") {
            continue;
        }
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy())).unwrap_or_default();
        let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).map(|f| i32::from_str_radix(f.trim(), 8).unwrap()).unwrap_or(0);
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            out.push(target);
        }
    }
    out
}
