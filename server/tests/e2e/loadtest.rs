//! `tessera-bench` against `tessera serve`: a real load run over HTTP, checked against the
//! server's own counters.

use super::harness::{model_path, Server};
use clap::Parser;
use tessera_loadtest::{run, Config};

#[tokio::test]
async fn tessera_bench_measures_tessera_serve() {
    let s = Server::start(&[]);
    let model = model_path();
    let args = [
        "tessera-bench", "--base-url", &s.base, "--model", model.to_str().unwrap(),
        "--random-input-len", "48", "--random-output-len", "12", "--num-prompts", "6",
        "--max-concurrency", "3", "--seed", "5", "--no-progress", "--max-duration", "240",
    ];
    let report = run(&Config::try_parse_from(args).unwrap()).await.unwrap();
    let sum = &report.summary;
    assert_eq!((sum.completed, sum.failed), (6, 0), "{:?}", report.requests.iter().map(|r| &r.error).collect::<Vec<_>>());
    // Exact lengths: token-exact prompts, ignore_eos honoured, counts from the server's usage.
    assert_eq!((sum.total_input_tokens, sum.total_output_tokens, sum.output_counts_from_usage), (6 * 48, 6 * 12, 6));
    let (ttft, tpot) = (sum.ttft_ms.as_ref().unwrap(), sum.tpot_ms.as_ref().unwrap());
    assert!(ttft.count == 6 && ttft.median > 0.0 && tpot.median > 0.0 && ttft.p99 >= ttft.median);
    // The server saw the same load: its counters moved by exactly the tokens sent and received.
    let d = &report.server_metrics.as_ref().expect("tessera serves /metrics").deltas;
    assert_eq!(d.get("tessera_generation_tokens_total"), Some(&(6.0 * 12.0)));
    assert_eq!(d.get("tessera_prompt_tokens_total"), Some(&(6.0 * 48.0)));
    assert_eq!(report.server_metrics.as_ref().unwrap().prefix_cache_hit_rate, Some(0.0), "random prompts share no prefix");
}
