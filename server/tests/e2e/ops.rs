//! `/health`, `/version`, `/v1/models`, `/metrics` (checked by promtool).

use crate::harness::{metric, shared};
use serde_json::{json, Value};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

#[tokio::test]
async fn health_and_version() {
    let s = shared();
    let (status, body) = s.get("/health").await;
    assert_eq!((status, serde_json::from_str::<Value>(&body).unwrap()), (200, json!({"status": "ok"})));
    let (status, body) = s.get("/version").await;
    assert_eq!((status, serde_json::from_str::<Value>(&body).unwrap()), (200, json!({"version": env!("CARGO_PKG_VERSION")})));
}

#[tokio::test]
async fn models_lists_the_served_model_with_its_plan() {
    let s = shared();
    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    let m = &data[0];
    assert_eq!((m["id"].clone(), m["object"].clone(), m["owned_by"].clone()), (json!("SmolLM2-135M-Instruct.Q4_1"), json!("model"), json!("tessera")));
    assert!(m["created"].as_u64().unwrap() > 0);
    assert_eq!(m["max_model_len"], 8192);
    assert_eq!((m["quantization"].as_str(), m["kv_cache_type"].as_str()), (Some("q4_1,q8_0"), Some("f32")));
    let plan = m["plan"].as_array().unwrap();
    // Each tensor-parallel rank's layers, rank after rank (one rank unless the suite runs with
    // TESSERA_TEST_SERVE_ARGS="--tensor-parallel-size N").
    let tp = m["tensor_parallel_size"].as_u64().unwrap() as usize;
    assert_eq!(plan.len(), (30 * 7 + 1) * tp, "7 linear layers in each of 30 blocks, then the output head");
    assert_eq!(plan[0]["tensor"], "blk.0.attn_q.weight");
    let q_rows = if tp == 1 { 576 } else { plan[0]["shape"][0].as_u64().unwrap() };
    assert_eq!((plan[0]["storage"].as_str(), plan[0]["shape"].clone()), (Some("Q4_1"), json!([q_rows, 576])));
    assert_eq!(plan[210]["storage"], "Q8_0");
    assert!(plan.iter().all(|row| row["kernel"].as_str().is_some_and(|k| k.starts_with("cpu."))));
    let (status, one) = s.get("/v1/models/SmolLM2-135M-Instruct.Q4_1").await;
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&one).unwrap(), *m);
}

fn promtool() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/ensure-promtool.sh");
    let out = Command::new(&script).stderr(Stdio::inherit()).output().expect("running scripts/ensure-promtool.sh");
    assert!(out.status.success(), "promtool is required and could not be installed");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test]
async fn metrics_pass_promtool_and_count_requests() {
    let s = shared();
    s.complete(json!({"prompt": "Hello", "max_tokens": 2})).await;
    let text = s.metrics().await;
    let resp = s.client().get(s.url("/metrics")).send().await.unwrap();
    assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    for name in [
        "tessera_num_requests_running",
        "tessera_num_requests_waiting",
        "tessera_kv_cache_usage_perc",
        "tessera_prompt_tokens_total",
        "tessera_generation_tokens_total",
    ] {
        assert!(metric(&text, name).is_some(), "{name} missing from:\n{text}");
    }
    assert!(metric(&text, "tessera_generation_tokens_total").unwrap() >= 2.0);
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // The text parses (a parse error exits 1) and every lint problem is one vLLM's own names
    // have: `vllm:` contains a colon, and vLLM calls its tokens-per-step histogram
    // `vllm:iteration_tokens_total`. Tessera's own names lint clean.
    let unexpected: Vec<&str> = report
        .lines()
        .filter(|l| {
            !(l.starts_with("vllm:")
                && (l.ends_with("metric names should not contain ':'")
                    || l == &"vllm:iteration_tokens_total non-counter metrics should not have \"_total\" suffix"))
        })
        .collect();
    assert!(out.status.success() || out.status.code() == Some(3), "promtool check metrics failed:\n{report}");
    assert!(unexpected.is_empty(), "promtool check metrics found problems:\n{report}");
}

/// vLLM's names (what routers and vLLM dashboards read) carry the same values as Tessera's,
/// labelled with the served model name, and `vllm:cache_config_info` gives the block size and
/// block count (`--block-size` and the pool's size from `--kv-cache-memory`).
#[tokio::test]
async fn metrics_export_vllm_names_for_routers() {
    let s = shared();
    s.complete(json!({"prompt": "The capital of France is", "max_tokens": 3})).await;
    let text = s.metrics().await;
    let series = |name: &str| -> Vec<&str> { text.lines().filter(|l| l.starts_with(&format!("{name}{{"))).collect() };
    for (tessera, vllm) in [
        ("tessera_num_requests_running", "vllm:num_requests_running"),
        ("tessera_num_requests_waiting", "vllm:num_requests_waiting"),
        ("tessera_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("tessera_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("tessera_generation_tokens_total", "vllm:generation_tokens_total"),
        ("tessera_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
        ("tessera_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("tessera_num_preemptions_total", "vllm:num_preemptions_total"),
        ("tessera_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("tessera_e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"),
        ("tessera_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("tessera_request_queue_time_seconds_count", "vllm:request_queue_time_seconds_count"),
        ("tessera_request_time_per_output_token_seconds_count", "vllm:request_time_per_output_token_seconds_count"),
    ] {
        let lines = series(vllm);
        assert_eq!(lines.len(), 1, "{vllm}: {lines:?}");
        assert!(lines[0].starts_with(&format!("{vllm}{{model_name=\"SmolLM2-135M-Instruct.Q4_1\"}} ")), "{}", lines[0]);
        // One scrape: both names come from the same gather, so the values are equal.
        assert_eq!(metric(&text, vllm), metric(&text, tessera), "{vllm} vs {tessera}");
    }
    assert!(metric(&text, "vllm:generation_tokens_total").unwrap() >= 3.0);
    let usage = metric(&text, "vllm:kv_cache_usage_perc").unwrap();
    assert!((0.0..=1.0).contains(&usage), "a fraction, not a percentage: {usage}");
    assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram"));
    assert!(text.contains("# TYPE vllm:prompt_tokens_total counter"));
    assert!(text.contains("# TYPE vllm:num_requests_waiting gauge"));
    let blocks = metric(&text, "tessera_kv_cache_num_blocks").unwrap();
    let info = series("vllm:cache_config_info");
    assert_eq!(
        info,
        [format!("vllm:cache_config_info{{block_size=\"16\",model_name=\"SmolLM2-135M-Instruct.Q4_1\",num_gpu_blocks=\"{blocks}\"}} 1").as_str()]
    );
}
