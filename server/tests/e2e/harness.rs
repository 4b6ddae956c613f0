//! Running `tessera serve` (the built binary, on a free port) and talking to it over HTTP.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};
use tessera_engine::tokenizer::Tokenizer;
use tessera_engine::weights::ModelWeights;

/// Options every test server gets unless the test passes them itself.
const DEFAULTS: &[(&str, &str)] = &[("--port", "0"), ("--kv-cache-memory", "512MiB")];

/// How long a server may take to load the model and listen (the machine is shared).
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// A running server, killed when dropped (and, through PR_SET_PDEATHSIG, when the test process
/// exits, so the shared servers in statics never outlive the tests).
pub struct Server {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    child: Mutex<Child>,
    logs: Arc<Mutex<Vec<String>>>,
    client: reqwest::Client,
}

/// The server most tests share (default options).
pub fn shared() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| Server::start(&[]))
}

/// Path of the model the servers load (the project's default model).
pub fn model_path() -> PathBuf {
    tessera_engine::default_model::for_tests()
}

/// The model's tokenizer, for checking token counts independently of the server.
pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_checkpoint(&ModelWeights::open(&model_path()).unwrap().checkpoint).unwrap())
}

/// Spawns from one thread that lives as long as the process: PR_SET_PDEATHSIG fires when the
/// spawning *thread* exits, and test threads come and go.
fn spawn_tied(cmd: Command) -> Child {
    type Job = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        thread::spawn(move || {
            for (mut cmd, reply) in rx {
                // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
                unsafe {
                    cmd.pre_exec(|| {
                        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                        Ok(())
                    });
                }
                let _ = reply.send(cmd.spawn());
            }
        });
        Mutex::new(tx)
    });
    let (tx, rx) = mpsc::channel();
    spawner.lock().unwrap().send((cmd, tx)).unwrap();
    rx.recv().unwrap().expect("spawning tessera")
}

/// The address in a "listening on http://ADDR" log line (human or JSON format).
fn listening_addr(line: &str) -> Option<String> {
    let rest = &line[line.find("listening on http://")? + "listening on http://".len()..];
    let addr: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || ".:[]".contains(*c)).collect();
    Some(addr)
}

impl Server {
    /// Starts `tessera serve ARGS` and waits until it listens.
    pub fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    /// Same, with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        Self::spawn(Command::new(env!("CARGO_BIN_EXE_tessera")), args, env)
    }

    /// Starts `tessera serve ARGS` with its soft open-file limit lowered to `soft` (the hard
    /// limit unchanged), as under `ulimit -Sn SOFT`.
    pub fn start_with_soft_nofile(args: &[&str], soft: u64) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
        // SAFETY: getrlimit/setrlimit are async-signal-safe and touch only the child.
        unsafe {
            cmd.pre_exec(move || {
                let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                lim.rlim_cur = soft.min(lim.rlim_max);
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Self::spawn(cmd, args, &[])
    }

    fn spawn(mut cmd: Command, args: &[&str], env: &[(&str, &str)]) -> Server {
        cmd.arg("serve").args(args);
        // Extra flags for every server (e.g. `--tensor-parallel-size 2` to run the suite over
        // two ranks), where a test does not set them itself.
        let extra = std::env::var("TESSERA_TEST_SERVE_ARGS").unwrap_or_default();
        let extra: Vec<&str> = extra.split_whitespace().collect();
        for pair in extra.chunks(2) {
            if !args.contains(&pair[0]) {
                cmd.args(pair);
            }
        }
        for (flag, value) in DEFAULTS {
            if !args.contains(flag) {
                cmd.args([flag, value]);
            }
        }
        cmd.env("RUST_LOG", "info").env_remove("TESSERA_API_KEY").envs(env.iter().copied());
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = spawn_tied(cmd);
        let stderr = child.stderr.take().unwrap();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = mpsc::channel();
        let sink = logs.clone();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(addr) = listening_addr(&line) {
                    let _ = addr_tx.send(addr);
                }
                sink.lock().unwrap().push(line);
            }
        });
        let addr = addr_rx.recv_timeout(START_TIMEOUT).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!("tessera serve {args:?} did not start:\n{}", logs.lock().unwrap().join("\n"))
        });
        // No idle connections are kept: each test has its own runtime, and a pooled connection
        // is driven by a task of the runtime that opened it.
        let client = reqwest::Client::builder().timeout(Duration::from_secs(300)).pool_max_idle_per_host(0).build().unwrap();
        Server { base: format!("http://{addr}"), child: Mutex::new(child), logs, client }
    }

    /// Everything the server logged so far.
    pub fn logs(&self) -> Vec<String> {
        self.logs.lock().unwrap().clone()
    }

    /// Polls the log until `check` finds what it looks for (log lines reach the test through a
    /// pipe, so a line written before a response may be read after it).
    pub async fn wait_for_logs<T>(&self, check: impl Fn(&[String]) -> Option<T>) -> T {
        let t0 = Instant::now();
        loop {
            if let Some(found) = check(&self.logs()) {
                return found;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "not in the log:\n{}", self.logs().join("\n"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `host:port` of the server (for raw TCP connections).
    pub fn addr(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.child.lock().unwrap().id()
    }

    /// Waits (up to `timeout`) for the process to exit.
    pub fn wait_exit(&self, timeout: Duration) -> Option<ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Some(status) = self.child.lock().unwrap().try_wait().unwrap() {
                return Some(status);
            }
            thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// Sends a signal to the server.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.pid() as i32, sig) }, 0);
    }

    /// A URL on this server.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The HTTP client.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// POSTs JSON; the status and the parsed JSON answer (every answer must be JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = self.client.post(self.url(path)).json(body).send().await.unwrap();
        json_of(resp).await
    }

    /// GET; the status and the body text.
    pub async fn get(&self, path: &str) -> (u16, String) {
        let resp = self.client.get(self.url(path)).send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    /// A completion that must succeed.
    pub async fn complete(&self, body: Value) -> Value {
        let (status, v) = self.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{body} -> {v}");
        v
    }

    /// A chat completion that must succeed.
    pub async fn chat(&self, body: Value) -> Value {
        let (status, v) = self.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{body} -> {v}");
        v
    }

    /// A streamed request that must succeed: the events' JSON, after checking the SSE framing
    /// (every event `data: <json>\n\n`, `data: [DONE]\n\n` last and only there).
    pub async fn stream(&self, path: &str, body: Value) -> Vec<Value> {
        let resp = self.client.post(self.url(path)).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{body}");
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        sse_events(&resp.text().await.unwrap())
    }

    /// The /metrics text.
    pub async fn metrics(&self) -> String {
        let (status, text) = self.get("/metrics").await;
        assert_eq!(status, 200);
        text
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap();
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Status and JSON body of a response (panics when the body is not JSON).
pub async fn json_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let ctype = resp.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned());
    let text = resp.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("status {status}: body is not JSON ({e}): {text:?}"));
    assert_eq!(ctype.as_deref(), Some("application/json"), "{text}");
    (status, v)
}

/// Parses a complete SSE body, asserting OpenAI's framing.
pub fn sse_events(body: &str) -> Vec<Value> {
    assert!(body.ends_with("data: [DONE]\n\n"), "stream does not end with [DONE]: {body:?}");
    let events: Vec<&str> = body.strip_suffix("\n\n").unwrap().split("\n\n").collect();
    let (done, rest) = events.split_last().unwrap();
    assert_eq!(*done, "data: [DONE]");
    rest.iter()
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or_else(|| panic!("event without `data: `: {e:?}"));
            assert!(!data.contains('\n'), "multi-line event: {e:?}");
            serde_json::from_str(data).unwrap_or_else(|err| panic!("event is not JSON ({err}): {data:?}"))
        })
        .collect()
}

/// The value of the first sample of `name` (labels allowed) in Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let metric_name = series.split('{').next()?;
        (metric_name == name).then(|| value.parse().ok())?
    })
}

/// The text of every choice, by index.
pub fn texts(v: &Value) -> Vec<String> {
    v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_owned()).collect()
}

/// Concatenated streamed text per choice index (`text`, or chat's `delta.content`).
pub fn streamed_texts(events: &[Value], n: usize, chat: bool) -> Vec<String> {
    let mut out = vec![String::new(); n];
    for e in events {
        for c in e["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            let piece = if chat { &c["delta"]["content"] } else { &c["text"] };
            out[i].push_str(piece.as_str().unwrap_or(""));
        }
    }
    out
}

/// A raw TCP connection to the server (loopback).
pub async fn connect(s: &Server) -> tokio::net::TcpStream {
    tokio::net::TcpStream::connect(s.addr()).await.unwrap()
}

/// Reads until the server closes the connection (EOF or reset) or `limit` passes: the bytes
/// read, and whether it closed.
pub async fn read_until_closed(stream: &mut tokio::net::TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return (out, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (out, true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// A raw HTTP/1.1 response: status, lower-cased headers, body (de-chunked).
pub fn parse_response(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let text_end = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("no header end: {:?}", String::from_utf8_lossy(raw)));
    let head = std::str::from_utf8(&raw[..text_end]).unwrap();
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').unwrap();
            (k.trim().to_ascii_lowercase(), v.trim().to_owned())
        })
        .collect();
    let mut body = raw[text_end + 4..].to_vec();
    if headers.iter().any(|(k, v)| k == "transfer-encoding" && v == "chunked") {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let eol = rest.windows(2).position(|w| w == b"\r\n").expect("chunk size line");
            let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16).unwrap();
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 2 + size + 2..];
        }
        body = out;
    }
    (status, headers, body)
}
