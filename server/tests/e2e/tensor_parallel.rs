//! `tessera serve --tensor-parallel-size 2` (issue 24): the default model over two CPU ranks
//! serves the official openai client's checks, shows each rank's plan in `/v1/models`, counts
//! each rank's collectives in `/metrics`, and refuses what it cannot shard. (The whole e2e suite
//! runs over two ranks with `TESSERA_TEST_SERVE_ARGS="--tensor-parallel-size 2"`.)

use crate::harness::Server;
use crate::python::run_script_on;
use serde_json::json;
use std::process::Command;

#[tokio::test(flavor = "multi_thread")]
async fn two_ranks_serve_the_openai_client() {
    let s = Server::start(&["--tensor-parallel-size", "2"]);
    let (status, models) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    assert!(models.contains("rank 0/2: rows 0..384 of 576") && models.contains("rank 1/2: columns 672..1536 of 1536"), "{models}");
    let v = s.complete(json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})).await;
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    tokio::task::block_in_place(|| run_script_on(&s, "openai_client.py"));
    let m = s.metrics().await;
    let series = |name: &str| m.lines().find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok()).unwrap_or(0.0);
    for rank in ["0", "1"] {
        let steps = series(&format!("tessera_tp_collective_seconds_count{{rank=\"{rank}\"}}"));
        let bytes = series(&format!("tessera_tp_collective_bytes_total{{rank=\"{rank}\"}}"));
        assert!(steps > 0.0 && bytes > 0.0, "rank {rank}: {steps} steps, {bytes} bytes\n{m}");
    }
}

#[test]
fn impossible_tensor_parallel_sizes_are_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(["serve", "--tensor-parallel-size", "4", "--port", "0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("3 KV heads"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(["serve", "--tensor-parallel-size", "2", "--device", "cuda", "--port", "0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("CPU only"), "{err}");
}
