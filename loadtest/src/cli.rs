//! The run configuration: every `tessera-bench` flag, parsed by clap and serialized whole into
//! the JSON report.

use clap::{Parser, ValueEnum};
use serde::{Serialize, Serializer};
use std::path::PathBuf;

/// Which prompts to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetName {
    /// Token-exact random prompts (`--random-*` flags).
    Random,
    /// A ShareGPT-format JSON file (`--dataset-path`).
    Sharegpt,
    /// A text file with one prompt per line (`--dataset-path`).
    Prompts,
}

/// A serving benchmark against an OpenAI-compatible server.
#[derive(Clone, Debug, Parser, Serialize)]
#[command(name = "tessera-bench", version, about)]
pub struct Config {
    /// Server URL; overrides --host/--port.
    #[arg(long, conflicts_with_all = ["host", "port"])]
    pub base_url: Option<String>,
    /// Server host (with --port) when --base-url is not given.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Server port (with --host) when --base-url is not given.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// API path: /v1/completions, or /v1/chat/completions (any path ending in chat/completions
    /// is sent chat messages).
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// The "model" field of each request (default: the first id of GET /v1/models, else the
    /// --model file name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Sent as `Authorization: Bearer KEY` (never written to the reports).
    #[arg(long)]
    #[serde(skip_serializing)]
    pub api_key: Option<String>,
    /// GGUF file or Hugging Face directory whose tokenizer builds and counts tokens (default:
    /// $TESSERA_MODEL, else the project's default model).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A tokenizer.json to use instead of --model's tokenizer.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Prompt source.
    #[arg(long, value_enum, default_value_t = DatasetName::Random)]
    pub dataset_name: DatasetName,
    /// File for the sharegpt and prompts datasets.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Random dataset: prompt tokens (before --random-range-ratio).
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Random dataset: output tokens (before --random-range-ratio).
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Random dataset: lengths are drawn uniformly from [len*(1-r), len*(1+r)]; 0 = exact.
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Random dataset: tokens of one prefix shared by every prompt (counted in the prompt length).
    #[arg(long, default_value_t = 0)]
    pub shared_prefix_len: usize,
    /// Sharegpt/prompts datasets: output tokens per request (sharegpt default: the reference
    /// answer's length; prompts default: 128).
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Requests in the measured run.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Most requests in flight at once (default: no limit).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Poisson arrival rate in requests/s; inf sends all at once.
    #[arg(long, default_value_t = f64::INFINITY, value_parser = parse_rate)]
    #[serde(serialize_with = "serialize_rate")]
    pub request_rate: f64,
    /// Requests sent (and discarded) before the measured run.
    #[arg(long, default_value_t = 0)]
    pub warmup_requests: usize,
    /// Seed for the dataset and the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Send non-streaming requests (no TTFT, TPOT or ITL).
    #[arg(long)]
    pub no_stream: bool,
    /// Do not send "ignore_eos": true.
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Goodput SLO on TTFT, in ms.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// Goodput SLO on TPOT, in ms.
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// Wall-clock cap of each run in seconds; requests still open then fail.
    #[arg(long, default_value_t = 600.0)]
    pub max_duration: f64,
    /// Write every figure, the configuration and per-request records as JSON.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Write one CSV row per request.
    #[arg(long)]
    pub output_csv: Option<PathBuf>,
    /// Run the same load at each concurrency level (e.g. 1,2,4,8,16) and plot the results.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub sweep_concurrency: Option<Vec<usize>>,
    /// The sweep's SVG plot.
    #[arg(long, default_value = "tessera-bench-sweep.svg")]
    pub plot: PathBuf,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config::parse_from(["tessera-bench"])
    }
}

impl Config {
    /// The server's base URL, without a trailing slash.
    pub fn base_url(&self) -> String {
        match &self.base_url {
            Some(u) => u.trim_end_matches('/').to_string(),
            None => format!("http://{}:{}", self.host, self.port),
        }
    }

    /// Whether the endpoint takes chat messages.
    pub fn is_chat(&self) -> bool {
        self.endpoint.trim_end_matches('/').ends_with("chat/completions")
    }

    /// Rejects contradictory or unusable settings before anything is sent.
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::bail;
        if self.num_prompts == 0 {
            bail!("--num-prompts must be at least 1");
        }
        if !(0.0..1.0).contains(&self.random_range_ratio) {
            bail!("--random-range-ratio must be in [0, 1)");
        }
        if self.max_concurrency == Some(0) {
            bail!("--max-concurrency must be at least 1");
        }
        if let Some(levels) = &self.sweep_concurrency {
            if levels.is_empty() || levels.contains(&0) {
                bail!("--sweep-concurrency needs levels of at least 1");
            }
        }
        if !(self.max_duration > 0.0 && self.max_duration.is_finite()) {
            bail!("--max-duration must be a positive number of seconds");
        }
        if self.no_stream && (self.slo_ttft_ms.is_some() || self.slo_tpot_ms.is_some()) {
            bail!("--slo-ttft-ms and --slo-tpot-ms need streaming (drop --no-stream)");
        }
        if self.dataset_name != DatasetName::Random && self.dataset_path.is_none() {
            bail!("--dataset-name {:?} needs --dataset-path", self.dataset_name);
        }
        if self.dataset_name == DatasetName::Random && self.shared_prefix_len >= self.min_random_input_len() {
            bail!("--shared-prefix-len must be below the shortest random prompt length");
        }
        Ok(())
    }

    /// The shortest prompt the random dataset may draw.
    pub(crate) fn min_random_input_len(&self) -> usize {
        scaled_range(self.random_input_len, self.random_range_ratio).0
    }
}

/// `[len*(1-r), len*(1+r)]`, at least 1 token.
pub(crate) fn scaled_range(len: usize, ratio: f64) -> (usize, usize) {
    let lo = ((len as f64) * (1.0 - ratio)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + ratio)).floor().max(lo as f64) as usize;
    (lo, hi)
}

fn parse_rate(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|_| format!("{s:?} is not a rate (a number or inf)"))?;
    if r > 0.0 {
        Ok(r)
    } else {
        Err("the request rate must be positive".into())
    }
}

fn serialize_rate<S: Serializer>(rate: &f64, s: S) -> Result<S::Ok, S::Error> {
    if rate.is_finite() {
        s.serialize_f64(*rate)
    } else {
        s.serialize_str("inf")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_from_host_port_or_flag() {
        assert_eq!(Config::default().base_url(), "http://127.0.0.1:8000");
        let c = Config::parse_from(["b", "--host", "localhost", "--port", "9"]);
        assert_eq!(c.base_url(), "http://localhost:9");
        let c = Config::parse_from(["b", "--base-url", "http://127.0.0.1:1234/"]);
        assert_eq!(c.base_url(), "http://127.0.0.1:1234");
        assert!(Config::try_parse_from(["b", "--base-url", "http://x", "--port", "1"]).is_err());
    }

    #[test]
    fn rates_and_sweep_levels_parse() {
        assert!(Config::default().request_rate.is_infinite());
        let c = Config::parse_from(["b", "--request-rate", "2.5", "--sweep-concurrency", "1,2,4"]);
        assert_eq!(c.request_rate, 2.5);
        assert_eq!(c.sweep_concurrency, Some(vec![1, 2, 4]));
        assert!(Config::try_parse_from(["b", "--request-rate", "0"]).is_err());
        let json = serde_json::to_value(Config::default()).unwrap();
        assert_eq!(json["request_rate"], "inf");
    }

    #[test]
    fn validation_rejects_contradictions() {
        assert!(Config::default().validate().is_ok());
        for args in [
            vec!["b", "--random-range-ratio", "1"],
            vec!["b", "--no-stream", "--slo-ttft-ms", "5"],
            vec!["b", "--dataset-name", "sharegpt"],
            vec!["b", "--random-input-len", "8", "--shared-prefix-len", "8"],
            vec!["b", "--sweep-concurrency", "0,1"],
        ] {
            assert!(Config::parse_from(&args).validate().is_err(), "{args:?}");
        }
    }

    #[test]
    fn range_is_symmetric_and_at_least_one() {
        assert_eq!(scaled_range(100, 0.0), (100, 100));
        assert_eq!(scaled_range(100, 0.5), (50, 150));
        assert_eq!(scaled_range(1, 0.9), (1, 1));
    }
}
