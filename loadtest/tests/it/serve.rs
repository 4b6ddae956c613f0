//! The load tester against a scripted in-test server: measured timings against the server's
//! known delays, concurrency and duration limits, arrival schedule, errors, goodput, /metrics.

use crate::common;

use clap::Parser;
use common::{default_model, prompts_file, TestServer};
use std::sync::atomic::Ordering;
use std::time::Instant;
use tessera_loadtest::arrivals::poisson_offsets;
use tessera_loadtest::runner::CUT_OFF;
use tessera_loadtest::tokens::Tokens;
use tessera_loadtest::{plot, run, run_sweep, Config};

/// How late a measured time may be. Tokio timers fire within ~1 ms of their deadline and a
/// loopback round trip takes well under 1 ms; the rest allows for scheduling stalls on a
/// shared 2-core CI host. Measured times can never be early: the client starts its clock
/// before the server starts its schedule.
const SLACK_MS: f64 = 40.0;

fn config(server: &TestServer, prompts: &tempfile::NamedTempFile, extra: &[&str]) -> Config {
    let model = default_model();
    let mut args = vec![
        "tessera-bench",
        "--base-url",
        &server.url,
        "--model",
        model.to_str().unwrap(),
        "--dataset-name",
        "prompts",
        "--dataset-path",
        prompts.path().to_str().unwrap(),
        "--no-progress",
    ];
    args.extend_from_slice(extra);
    Config::try_parse_from(args).unwrap()
}

fn within(value: f64, lo: f64, hi: f64, what: &str) {
    assert!((lo..=hi).contains(&value), "{what} = {value:.2}, expected [{lo}, {hi}]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_timings_match_the_servers_schedule() {
    let server = TestServer::start().await;
    // Text chunks at 200, 250, ..., 450 ms, then a usage-only chunk saying 11 tokens.
    let prompts = prompts_file(&["ttft=200 gap=50 chunks=6 usage=11"]);
    let report = run(&config(&server, &prompts, &["--num-prompts", "4"])).await.unwrap();
    assert_eq!((report.summary.completed, report.summary.failed), (4, 0));
    for r in &report.requests {
        within(r.ttft_ms.unwrap(), 200.0, 200.0 + SLACK_MS, "TTFT");
        assert_eq!(r.itl_ms.len(), 5, "one gap per text chunk after the first");
        // The mean gap is (last - first) / 5: only the two end reads' lateness moves it.
        let mean_itl = r.itl_ms.iter().sum::<f64>() / 5.0;
        within(mean_itl, 50.0 - SLACK_MS / 5.0, 50.0 + SLACK_MS / 5.0, "mean ITL");
        // TPOT = (e2e - ttft) / (11 - 1) = 250 / 10 ms, give or take the end reads.
        within(r.tpot_ms.unwrap(), 25.0 - SLACK_MS / 10.0, 25.0 + SLACK_MS / 10.0, "TPOT");
        within(r.e2e_ms, 450.0, 450.0 + SLACK_MS, "E2E");
        assert_eq!((r.output_tokens, r.output_tokens_from_usage), (11, true));
    }
    let s = &report.summary;
    within(s.ttft_ms.as_ref().unwrap().mean, 200.0, 200.0 + SLACK_MS, "mean TTFT");
    assert_eq!(s.itl_ms.as_ref().unwrap().count, 20);
    assert_eq!(s.total_output_tokens, 44);
    assert_eq!(report.model, "scripted", "the model name comes from /v1/models");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_ttft_waits_for_text_past_a_role_only_chunk() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["role ttft=150 gap=30 chunks=4 usage=4"]);
    let extra = ["--num-prompts", "2", "--endpoint", "/v1/chat/completions"];
    let report = run(&config(&server, &prompts, &extra)).await.unwrap();
    assert_eq!(report.summary.completed, 2);
    for r in &report.requests {
        within(r.ttft_ms.unwrap(), 150.0, 150.0 + SLACK_MS, "chat TTFT");
        assert_eq!(r.itl_ms.len(), 3);
        assert_eq!(r.output_tokens, 4);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_events_parse_and_outputs_without_usage_are_retokenized() {
    let server = TestServer::start().await;
    // Each event arrives in three reads, one cut inside "é"; no usage chunk is sent.
    let prompts = prompts_file(&["split piece=_h\u{e9}llo_w\u{f6}rld chunks=4 gap=20"]);
    let report = run(&config(&server, &prompts, &["--num-prompts", "2"])).await.unwrap();
    let tokens = Tokens::load(None, Some(&default_model())).unwrap();
    let expected = tokens.count(&" h\u{e9}llo w\u{f6}rld".repeat(4)).unwrap() as u64;
    assert!(expected > 4);
    assert_eq!(report.summary.completed, 2, "{:?}", report.requests[0].error);
    for r in &report.requests {
        assert_eq!((r.output_tokens, r.output_tokens_from_usage), (expected, false));
        assert_eq!(r.itl_ms.len(), 3, "a split event is still one chunk");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_keep_their_error_text() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["fail", "error_after=2 gap=10", "chunks=2 usage=2"]);
    let report = run(&config(&server, &prompts, &["--num-prompts", "3"])).await.unwrap();
    assert_eq!((report.summary.completed, report.summary.failed), (1, 2));
    let http = report.requests[0].error.as_deref().unwrap();
    assert!(http.contains("HTTP 500") && http.contains("boom"), "{http}");
    assert_eq!(report.requests[1].error.as_deref(), Some("engine died"));
    assert!(report.requests[2].ok());
    let table = report.table();
    assert!(table.contains("1 x engine died") && table.contains("Failed requests:"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrency_bounds_requests_in_flight() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["ttft=100 chunks=1 usage=1"]);
    let extra = ["--num-prompts", "8", "--max-concurrency", "2"];
    let report = run(&config(&server, &prompts, &extra)).await.unwrap();
    assert_eq!(report.summary.completed, 8);
    assert_eq!(server.counters.max_in_flight.load(Ordering::SeqCst), 2);
    // Four waves of two 100 ms requests.
    within(report.summary.duration_s * 1e3, 400.0, 400.0 + 4.0 * SLACK_MS, "duration");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_duration_stops_the_run() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["ttft=5000 chunks=1 usage=1"]);
    let started = Instant::now();
    let report = run(&config(&server, &prompts, &["--num-prompts", "3", "--max-duration", "0.3"])).await.unwrap();
    assert!(started.elapsed().as_secs_f64() < 2.0, "the 5 s responses were not awaited");
    assert!(report.truncated);
    assert_eq!(report.summary.failed, 3);
    assert!(report.requests.iter().all(|r| r.error.as_deref() == Some(CUT_OFF)));

    // At 2 requests/s, a 1 s cap leaves most of 50 requests unsent.
    let prompts = prompts_file(&["chunks=1 usage=1"]);
    let extra = ["--num-prompts", "50", "--request-rate", "2", "--max-duration", "1"];
    let report = run(&config(&server, &prompts, &extra)).await.unwrap();
    assert!(report.truncated && report.sent >= 1 && report.sent < 50, "sent {}", report.sent);
    assert_eq!(report.requests.len(), report.sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_leave_on_the_poisson_schedule() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["chunks=1 usage=1"]);
    let extra = ["--num-prompts", "20", "--request-rate", "25", "--seed", "3"];
    let report = run(&config(&server, &prompts, &extra)).await.unwrap();
    let due = poisson_offsets(20, 25.0, 3);
    assert!(due[19] > 0.3, "the schedule spans long enough to see");
    for (r, &t) in report.requests.iter().zip(&due) {
        within(r.start_s * 1e3, t * 1e3, t * 1e3 + SLACK_MS, "send time");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goodput_and_server_metric_deltas() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["ttft=20 gap=10 chunks=2 usage=2 cached", "ttft=300 gap=10 chunks=2 usage=2 preempt"]);
    let extra = ["--num-prompts", "4", "--slo-ttft-ms", "150", "--slo-tpot-ms", "1000"];
    let report = run(&config(&server, &prompts, &extra)).await.unwrap();
    let s = &report.summary;
    assert_eq!(s.good_requests, Some(2), "only the 20 ms-TTFT requests meet the 150 ms SLO");
    assert!((s.goodput.unwrap() - 2.0 / s.duration_s).abs() < 1e-9);
    let m = report.server_metrics.as_ref().expect("the server has /metrics");
    assert_eq!(m.deltas["test:requests_total"], 4.0);
    assert_eq!(m.preemptions, Some(2.0));
    assert_eq!(m.prefix_cache_hit_rate, Some(0.5), "20 hit of 40 queried");
    assert!(!m.deltas.contains_key("test:latency_bucket{le=\"1\"}"));
    assert!(report.table().contains("Prefix cache hit rate:"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_requests_time_end_to_end_only() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["ttft=100 gap=50 chunks=3 usage=3", "chunks=2 piece=_world"]);
    let report = run(&config(&server, &prompts, &["--num-prompts", "2", "--no-stream"])).await.unwrap();
    assert_eq!(report.summary.completed, 2);
    let (a, b) = (&report.requests[0], &report.requests[1]);
    within(a.e2e_ms, 200.0, 200.0 + SLACK_MS, "non-streaming E2E");
    assert_eq!((a.ttft_ms, a.tpot_ms, a.itl_ms.len()), (None, None, 0));
    assert_eq!((a.output_tokens, a.output_tokens_from_usage), (3, true));
    let tokens = Tokens::load(None, Some(&default_model())).unwrap();
    assert_eq!(b.output_tokens, tokens.count(" world world").unwrap() as u64);
    assert!(report.summary.ttft_ms.is_none() && report.summary.e2e_ms.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_sent_but_not_reported() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["chunks=1 usage=1"]);
    let report = run(&config(&server, &prompts, &["--num-prompts", "1", "--api-key", "s3cret"])).await.unwrap();
    assert_eq!(server.counters.authorization.lock().unwrap().as_deref(), Some("Bearer s3cret"));
    let json = serde_json::to_string(&report).unwrap();
    assert!(!json.contains("s3cret"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_is_sent_but_not_measured() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["chunks=1 usage=1"]);
    let report = run(&config(&server, &prompts, &["--num-prompts", "2", "--warmup-requests", "3"])).await.unwrap();
    assert_eq!(server.counters.requests.load(Ordering::SeqCst), 5);
    assert_eq!(report.requests.len(), 2);
    let failing = prompts_file(&["fail"]);
    let err = run(&config(&server, &failing, &["--num-prompts", "1", "--warmup-requests", "1"])).await.unwrap_err();
    assert!(err.to_string().contains("warmup request failed: HTTP 500"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_reports_each_level_and_writes_outputs() {
    let server = TestServer::start().await;
    let prompts = prompts_file(&["ttft=30 gap=10 chunks=3 usage=3"]);
    let cfg = config(&server, &prompts, &["--num-prompts", "4", "--sweep-concurrency", "1,4"]);
    let reports = run_sweep(&cfg).await.unwrap();
    assert_eq!(reports.iter().map(|r| r.max_concurrency).collect::<Vec<_>>(), [Some(1), Some(4)]);
    // One at a time: four 50 ms requests back to back; all at once: one 50 ms wave.
    within(reports[0].summary.duration_s * 1e3, 200.0, 200.0 + 4.0 * SLACK_MS, "serial duration");
    within(reports[1].summary.duration_s * 1e3, 50.0, 50.0 + SLACK_MS, "parallel duration");

    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("sweep.svg");
    plot::sweep_svg(&reports, &svg).unwrap();
    let svg = std::fs::read_to_string(svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("p99 TPOT") && svg.contains("concurrency 4"));

    let json = dir.path().join("r.json");
    reports[0].write_json(&json).unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    assert_eq!(v["config"]["request_rate"], "inf");
    assert_eq!(v["config"]["num_prompts"], 4);
    assert_eq!(v["completed"], 4);
    assert!(v["tpot_ms"]["p99"].as_f64().unwrap() > 0.0);
    assert_eq!(v["requests"].as_array().unwrap().len(), 4);
    let csv = dir.path().join("r.csv");
    reports[0].write_csv(&csv).unwrap();
    let csv = std::fs::read_to_string(csv).unwrap();
    assert_eq!(csv.lines().count(), 5);
    assert!(csv.lines().nth(1).unwrap().starts_with("0,"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_levels_and_warmup_get_prompts_of_their_own() {
    let server = TestServer::start().await;
    let model = default_model();
    let args = [
        "tessera-bench",
        "--base-url",
        &server.url,
        "--model",
        model.to_str().unwrap(),
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--num-prompts",
        "3",
        "--warmup-requests",
        "2",
        "--sweep-concurrency",
        "1,2",
        "--no-progress",
    ];
    let reports = run_sweep(&Config::try_parse_from(args).unwrap()).await.unwrap();
    assert!(reports.iter().all(|r| r.summary.completed == 3));
    let seen = server.counters.prompts.lock().unwrap().clone();
    let distinct: std::collections::HashSet<&String> = seen.iter().collect();
    assert_eq!((seen.len(), distinct.len()), (8, 8), "2 warmup + 2 levels x 3, all different");
}
