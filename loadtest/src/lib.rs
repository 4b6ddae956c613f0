//! `tessera-bench`, the serving load generator for any OpenAI-compatible server (Tessera,
//! vLLM, SGLang, llama.cpp's llama-server): TTFT, TPOT, ITL and E2E latency distributions,
//! throughput and goodput, as SGLang's `bench_serving` and vLLM's `bench serve` define them.
//!
//! From a test: build a [`Config`] (e.g. `Config::try_parse_from([...])`) and call [`run`].
//! The only Tessera crate it uses is the engine, for the target model's tokenizer.

pub mod arrivals;
pub mod cli;
pub mod client;
pub mod dataset;
pub mod metrics;
pub mod plot;
pub mod report;
pub mod runner;
pub mod scrape;
pub mod sse;
pub mod tokens;

pub use cli::Config;
pub use report::Report;
pub use runner::{run, run_sweep};
