//! Tessera replicas behind the routers users deploy: vLLM's router (`vllm-router`) and SGLang's
//! model gateway (`smg`), both from PyPI (installed into .venv-test/ by scripts/python-env.sh),
//! with their round-robin and cache-aware policies, driven by the official `openai` Python
//! client and by plain HTTP.

use crate::harness::{metric, Server};
use serde_json::{json, Value};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// How long the router may take to start and see its workers healthy.
const ROUTER_START: Duration = Duration::from_secs(120);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The test venv's python (made by scripts/python-env.sh, which installs the routers).
fn python() -> String {
    let env = Command::new(root().join("scripts/python-env.sh")).stderr(Stdio::inherit()).output().expect("running scripts/python-env.sh");
    assert!(env.status.success(), "the Python test environment could not be made");
    String::from_utf8(env.stdout).unwrap().trim().to_owned()
}

/// The router tests run one at a time: each starts several replicas and a router, and on a
/// small machine three such sets at once starve each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Replicas on loopback, each with its own small KV pool.
fn replicas(n: usize) -> Vec<Server> {
    (0..n).map(|_| Server::start(&["--kv-cache-memory", "128MiB"])).collect()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The routers under test.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// vLLM's router (`vllm-router`).
    Vllm,
    /// SGLang's model gateway (`smg`).
    Smg,
}

impl Kind {
    /// The package's name, for messages and log files.
    fn name(self) -> &'static str {
        match self {
            Kind::Vllm => "vllm-router",
            Kind::Smg => "smg",
        }
    }

    /// The arguments to the venv's python that launch the router (the options both routers
    /// share come after them).
    fn launcher(self) -> &'static [&'static str] {
        match self {
            Kind::Vllm => &["-m", "vllm_router.launch_router", "--log-level", "warning"],
            Kind::Smg => &["-m", "smg", "launch", "--log-level", "warn"],
        }
    }
}

/// A running router, killed when dropped.
struct Router {
    base: String,
    child: Child,
    log: PathBuf,
}

impl Router {
    /// Starts the `kind` router with `policy` in front of `workers` and waits until it answers
    /// `/v1/models` (which it forwards to a healthy worker).
    async fn start(kind: Kind, python: &str, policy: &str, workers: &[Server]) -> Router {
        let port = free_port();
        let mut cmd = Command::new(python);
        cmd.args(kind.launcher());
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--policy", policy]);
        // Their own metrics port on loopback (both default to 0.0.0.0:29000).
        cmd.args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &free_port().to_string()]);
        cmd.args(["--health-check-interval-secs", "1", "--worker-urls"]);
        cmd.args(workers.iter().map(|w| w.base.clone()));
        let log = std::env::temp_dir().join(format!("tessera-e2e-{}-{port}.log", kind.name()));
        let file = std::fs::File::create(&log).unwrap();
        cmd.stdin(Stdio::null()).stdout(file.try_clone().unwrap()).stderr(file);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("starting {}: {e}", kind.name()));
        let router = Router { base: format!("http://127.0.0.1:{port}"), child, log };
        let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().unwrap();
        let deadline = Instant::now() + ROUTER_START;
        loop {
            if let Ok(r) = client.get(format!("{}/v1/models", router.base)).send().await {
                if r.status() == 200 {
                    return router;
                }
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&router.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect();
                panic!("{} ({policy}) did not come up; its log ends:\n{}", kind.name(), tail.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Runs server/tests/python/router_client.py MODE against the router; its stdout.
    fn client(&self, python: &str, args: &[&str]) -> String {
        let out = Command::new(python)
            .arg(root().join("server/tests/python/router_client.py"))
            .arg(args[0])
            .arg(format!("{}/v1", self.base))
            .arg(MODEL)
            .args(&args[1..])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "router_client.py {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Sums a counter over the replicas' /metrics.
async fn total(workers: &[Server], name: &str) -> f64 {
    let mut sum = 0.0;
    for w in workers {
        sum += metric(&w.metrics().await, name).unwrap_or(0.0);
    }
    sum
}

async fn finished_per_replica(workers: &[Server]) -> Vec<f64> {
    let mut out = Vec::new();
    for w in workers {
        let text = w.metrics().await;
        out.push(text.lines().filter(|l| l.starts_with("tessera_request_success_total{")).filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok()).sum());
    }
    out
}

/// The openai client's completions and chats, streaming and not, through `kind` with its
/// round-robin and cache-aware policies; every request reaches a replica once.
async fn the_openai_client_works_through(kind: Kind) {
    let _serial = SERIAL.lock().await;
    let python = python();
    let workers = replicas(2);
    for policy in ["round_robin", "cache_aware"] {
        let before = finished_per_replica(&workers).await;
        let router = Router::start(kind, &python, policy, &workers).await;
        assert_eq!(router.client(&python, &["basic"]).trim(), "ok");
        let after = finished_per_replica(&workers).await;
        let served: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        // 1 + 3 x 2 completions and 2 chats.
        assert_eq!(served.iter().sum::<f64>(), 9.0, "{kind:?} {policy}: {served:?}");
        if policy == "round_robin" {
            assert!(served.iter().all(|&n| n >= 4.0), "{kind:?}: round robin spreads the requests: {served:?}");
        }
    }
}



/// Groups of identical prompts, sent one after another through `kind`: round robin over three
/// replicas sends a group's three requests to three replicas (no prefix-cache hit), the
/// cache-aware policy sends the repeats where the prompt already is.
async fn cache_aware_routing_raises_the_prefix_cache_hit_rate(kind: Kind) {
    let _serial = SERIAL.lock().await;
    let python = python();
    let workers = replicas(3);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let mut rates = Vec::new();
    for policy in ["round_robin", "cache_aware"] {
        let router = Router::start(kind, &python, policy, &workers).await;
        let (q0, h0) = (total(&workers, "tessera_prefix_cache_queries_total").await, total(&workers, "tessera_prefix_cache_hits_total").await);
        for group in 0..4 {
            let prompt = format!(
                "[{policy} group {group}] {}",
                "A long shared system prompt describing the assistant's duties in detail. ".repeat(8)
            );
            for _ in 0..3 {
                let resp = http.post(format!("{}/v1/completions", router.base)).json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2})).send().await.unwrap();
                assert_eq!(resp.status(), 200);
                let v: Value = resp.json().await.unwrap();
                assert_eq!(v["usage"]["completion_tokens"], 2);
            }
        }
        let (q1, h1) = (total(&workers, "tessera_prefix_cache_queries_total").await, total(&workers, "tessera_prefix_cache_hits_total").await);
        assert!(q1 > q0);
        rates.push((policy, (h1 - h0) / (q1 - q0)));
        drop(router);
    }
    eprintln!("{kind:?}: prefix-cache hit rate by policy: {rates:?}");
    let (rr, ca) = (rates[0].1, rates[1].1);
    assert!(rr < 0.1, "{kind:?}: round robin should miss: {rates:?}");
    assert!(ca > 0.5, "{kind:?}: cache-aware should hit on two of three repeats: {rates:?}");
}



/// A replica SIGKILLed mid-run behind `kind` costs only the requests it was serving: the
/// router stops sending to it and every later request succeeds on the others.
async fn a_killed_replica_costs_only_its_in_flight_requests(kind: Kind) {
    let _serial = SERIAL.lock().await;
    let python = python();
    let workers = replicas(3);
    let router = Router::start(kind, &python, "round_robin", &workers).await;
    let n = 36;
    let out = router.client(&python, &["load", &n.to_string(), "6", &workers[2].pid().to_string(), "6"]);
    let r: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    eprintln!("{kind:?}: {r}");
    assert_eq!(r["killed"], true, "{r}");
    let (ok, failed, in_flight) = (r["ok"].as_u64().unwrap(), r["failed"].as_u64().unwrap(), r["in_flight_at_kill"].as_u64().unwrap());
    assert_eq!(ok + failed, n);
    assert!(failed <= in_flight, "{kind:?}: only requests in flight at the kill may fail: {r}");
    assert_eq!(r["failed_started_after_kill"], 0, "{kind:?}: {r}");
    assert!(workers[2].wait_exit(Duration::from_secs(10)).is_some(), "the replica was killed");
    // And the router keeps serving on the two left.
    assert_eq!(router.client(&python, &["basic"]).trim(), "ok");
}

/// The checks above as tests, one module per router: `routers::vllm_router::...` and
/// `routers::smg::...`.
macro_rules! router_tests {
    ($module:ident, $kind:expr) => {
        mod $module {
            #[tokio::test]
            async fn the_openai_client_works() {
                super::the_openai_client_works_through($kind).await;
            }

            #[tokio::test]
            async fn cache_aware_routing_raises_the_prefix_cache_hit_rate() {
                super::cache_aware_routing_raises_the_prefix_cache_hit_rate($kind).await;
            }

            #[tokio::test]
            async fn a_killed_replica_costs_only_its_in_flight_requests() {
                super::a_killed_replica_costs_only_its_in_flight_requests($kind).await;
            }
        }
    };
}

router_tests!(vllm_router, super::Kind::Vllm);
router_tests!(smg, super::Kind::Smg);
