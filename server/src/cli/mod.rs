//! One module per `tessera` subcommand, plus shared argument groups.

pub mod bench;
pub mod convert;
pub mod generate;
pub mod inspect;
pub mod kv_args;
pub mod model_path;
pub mod perplexity;
pub mod quantize;
pub mod serve;

use anyhow::{anyhow, Result};
use clap::{Args, ValueEnum};
use tessera_engine::sample::SamplingParams;
use tracing_subscriber::EnvFilter;

/// How log lines are written (to stderr).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One readable line per event.
    #[default]
    Human,
    /// One JSON object per event (with the request span's fields).
    Json,
}

/// Installs the global subscriber: `$RUST_LOG` when set, else `default_filter` (e.g. `info`).
pub fn init_logging(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).init(),
    }
}

/// Sampling flags shared by commands that generate.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Minimum probability relative to the top token (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty over prompt and output (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Presence penalty over output tokens.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty over output tokens.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// RNG seed (same seed, same output).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// Validated sampling parameters.
    pub fn params(&self) -> Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logprobs: None,
        };
        p.validate().map_err(|(name, msg)| anyhow!("--{}: {msg}", name.replace('_', "-")))?;
        Ok(p)
    }
}
