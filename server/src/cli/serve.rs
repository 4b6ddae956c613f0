//! `tessera serve`: the OpenAI-compatible server. Options come from flags and from a TOML
//! file (`--config configs/NAME.toml`, keys named as the flags); a flag given explicitly wins
//! over the file, and an unknown key in the file is an error naming it.

use super::kv_args::kv_dtype;
use super::model_path;
use super::perplexity::ComputePath;
use super::{init_logging, LogFormat};
use crate::http::conn::ConnOptions;
use crate::http::{self, AppState, DrainOptions, ServerOptions, ToolParser};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use tessera_engine::device::Device;
use tessera_engine::kv_cache::KvRequest;
use tessera_engine::serve::{Engine, EngineConfig};
use tessera_engine::parallel::TpOptions;
use tessera_engine::LoadedModel;
use tessera_kernels::linear::LinearPolicy;

/// Arguments of `tessera serve`; every one except `--config` may also be set in the file.
#[derive(Args, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeArgs {
    /// TOML file with any of these options, keys named as the flags (`max-num-seqs = 8`); flags override it.
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// GGUF file or Hugging Face directory (default: $TESSERA_MODEL, else the project's default model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    host: Option<String>,
    /// Port to listen on (0 picks a free one) [default: 8000].
    #[arg(long)]
    port: Option<u16>,
    /// Model name clients pass as `model` [default: the model file's stem].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer <key>` on /v1/* (also $TESSERA_API_KEY).
    #[arg(long, env = "TESSERA_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Most sequences in one engine step [default: 16].
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Most tokens (prefill chunks plus decodes) in one engine step [default: 512].
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Tokens per KV-cache block [default: 16].
    #[arg(long)]
    block_size: Option<usize>,
    /// KV-cache pool size, e.g. `2GiB` or `512MB` (K/M/G and KiB/MiB/GiB are powers of 1024,
    /// KB/MB/GB of 1000) [default: --kv-cache-memory-fraction of the machine's memory].
    #[arg(long)]
    #[serde(default)]
    kv_cache_memory: Option<ByteSize>,
    /// Fraction of total memory (MemTotal) for the KV-cache pool when --kv-cache-memory is not given [default: 0.2].
    #[arg(long)]
    kv_cache_memory_fraction: Option<f64>,
    /// Do not reuse KV blocks of identical prompt prefixes.
    #[arg(long)]
    #[serde(default)]
    no_prefix_caching: bool,
    /// KV-cache format for keys and values: auto (the checkpoint's kv_cache_scheme, else f32,
    /// the compute type), f32, bf16, f16,
    /// fp8_e4m3, int8, tq3_0, hqmq-s{24,48,96,192}-r{3,4,6}[-med3]; qjl1 compresses keys only
    /// (give it with --kv-cache-dtype-k; qjl1-wW-sS keeps the first S and last W keys of each
    /// sequence exact, qjl1 = qjl1-w128-s4; hqmq-...-sinkN keeps the first N keys exact, keys only) [default: auto].
    #[arg(long)]
    kv_cache_dtype: Option<String>,
    /// Key format (overrides --kv-cache-dtype for keys).
    #[arg(long)]
    kv_cache_dtype_k: Option<String>,
    /// Value format (overrides --kv-cache-dtype for values).
    #[arg(long)]
    kv_cache_dtype_v: Option<String>,
    /// Most requests waiting for admission; more are answered 503 [default: 256].
    #[arg(long)]
    max_waiting_requests: Option<usize>,
    /// Cap on prompt + output tokens [default: the model's context, bounded by the KV pool].
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Largest request body, e.g. `4MiB` [default: 8MiB].
    #[arg(long)]
    #[serde(default)]
    max_body_bytes: Option<ByteSize>,
    /// Seconds running requests get to finish after SIGINT/SIGTERM before they are aborted [default: 10].
    #[arg(long)]
    shutdown_grace_secs: Option<f64>,
    /// Least seconds the listener stays open after SIGINT/SIGTERM (health answering 503) so
    /// load balancers notice before connections are refused [default: 0].
    #[arg(long)]
    shutdown_delay_secs: Option<f64>,
    /// Most connections served at once; more are answered 503 (health excepted) and idle ones
    /// closed to make room [default: the open-file limit less 128, at most 8192].
    #[arg(long)]
    max_connections: Option<usize>,
    /// Seconds a connection has to send a request's headers (from its opening or its previous
    /// response), and then its body [default: 30].
    #[arg(long)]
    header_read_timeout_secs: Option<f64>,
    /// Seconds an idle connection (no request in progress, nothing received) stays open [default: 15].
    #[arg(long)]
    keep_alive_timeout_secs: Option<f64>,
    /// Default deadline of a generation request, and the longest one a request's
    /// `request_timeout` may set; past it the request is aborted and answered 408 [default: none].
    #[arg(long)]
    request_timeout_secs: Option<f64>,
    /// Force one arithmetic on every linear layer [default: chosen per batch segment].
    #[arg(long, value_enum)]
    #[serde(default, deserialize_with = "value_enum")]
    compute: Option<ComputePath>,
    /// Where the model runs: cpu, cuda or cuda:N [default: cpu].
    #[arg(long)]
    device: Option<String>,
    /// Tensor-parallel ranks: the model's heads, feed-forwards and output head sharded over
    /// this many ranks, each on its own cores (CPU only) [default: 1].
    #[arg(long, alias = "tp")]
    tensor_parallel_size: Option<usize>,
    /// CPUs of each tensor-parallel rank, ranks separated by `|` (`0-31|32-63`) [default: one
    /// NUMA node per rank when there are enough, else an even split of the usable CPUs].
    #[arg(long)]
    cpu_bind: Option<String>,
    /// Syntax of the model's tool calls: hermes, llama3_json, mistral or qwen3_coder
    /// [default: the one the model's chat template shows, else hermes].
    #[arg(long)]
    tool_call_parser: Option<String>,
    /// Log format (the global `--log-format` flag).
    #[arg(skip)]
    #[serde(default, deserialize_with = "value_enum")]
    log_format: Option<LogFormat>,
}

/// A byte count written with an optional unit suffix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteSize(pub usize);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
        let (num, unit) = (&s[..split], s[split..].trim());
        let mult: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kib" => 1024.0,
            "m" | "mib" => 1024f64.powi(2),
            "g" | "gib" => 1024f64.powi(3),
            "t" | "tib" => 1024f64.powi(4),
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            _ => return Err(format!("unknown size unit {unit:?} in {s:?} (use e.g. 512MiB, 2GiB, 1GB)")),
        };
        let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (use e.g. 512MiB, 2GiB, 1GB)"))?;
        Ok(ByteSize((n * mult).round() as usize))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a byte count or a size string such as \"2GiB\"")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ByteSize, E> {
                s.parse().map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<ByteSize, E> {
                usize::try_from(n).map(ByteSize).map_err(|_| E::custom("a size must not be negative"))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<ByteSize, E> {
                usize::try_from(n).map(ByteSize).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Deserializes a clap value enum by its flag spelling (`int8-act`, `json`).
fn value_enum<'de, D: Deserializer<'de>, T: ValueEnum>(d: D) -> Result<Option<T>, D::Error> {
    let s = String::deserialize(d)?;
    T::from_str(&s, false).map(Some).map_err(de::Error::custom)
}

/// Serializes a clap value enum by its flag spelling.
fn value_enum_name<S: Serializer, T: ValueEnum>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
    match v.as_ref().and_then(ValueEnum::to_possible_value) {
        Some(p) => s.serialize_str(p.get_name()),
        None => s.serialize_none(),
    }
}

fn display<S: Serializer, T: fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&v.to_string())
}

fn redacted<S: Serializer>(key: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(if key.is_some() { "<set>" } else { "<none>" })
}

/// The effective configuration (logged at start).
#[derive(Debug, Serialize)]
pub struct ServeConfig {
    model: PathBuf,
    host: String,
    port: u16,
    served_model_name: String,
    #[serde(serialize_with = "redacted")]
    api_key: Option<String>,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    block_size: usize,
    kv_cache_bytes: usize,
    prefix_caching: bool,
    #[serde(serialize_with = "display")]
    kv_cache_dtype: KvRequest,
    max_waiting_requests: usize,
    max_model_len: Option<usize>,
    max_body_bytes: usize,
    shutdown_grace_secs: f64,
    shutdown_delay_secs: f64,
    max_connections: Option<usize>,
    header_read_timeout_secs: f64,
    keep_alive_timeout_secs: f64,
    request_timeout_secs: Option<f64>,
    #[serde(serialize_with = "value_enum_name")]
    compute: Option<ComputePath>,
    #[serde(serialize_with = "display")]
    device: Device,
    tensor_parallel_size: usize,
    cpu_bind: Option<String>,
    /// `None`: chosen from the chat template once the model is loaded.
    tool_call_parser: Option<ToolParser>,
    #[serde(serialize_with = "value_enum_name")]
    log_format: Option<LogFormat>,
}

const DEFAULT_KV_FRACTION: f64 = 0.2;
const DEFAULT_MAX_BODY: usize = 8 << 20;
const DEFAULT_HEADER_READ_SECS: f64 = 30.0;
const DEFAULT_KEEP_ALIVE_SECS: f64 = 15.0;
/// Longest duration any of the seconds options takes (a year).
const MAX_SECS: f64 = 365.0 * 86400.0;
/// Descriptors kept free of connections by the default `--max-connections` (model files,
/// logs, the runtime, over-limit connections being answered).
const FD_HEADROOM: u64 = 128;
/// Largest default `--max-connections`.
const MAX_DEFAULT_CONNECTIONS: u64 = 8192;

impl ServeArgs {
    /// Reads a configuration file (TOML, the flags' keys).
    fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
    }

    /// Flags given here, else the file's values.
    fn or(self, file: ServeArgs) -> ServeArgs {
        ServeArgs {
            config: self.config,
            model: self.model.or(file.model),
            host: self.host.or(file.host),
            port: self.port.or(file.port),
            served_model_name: self.served_model_name.or(file.served_model_name),
            api_key: self.api_key.or(file.api_key),
            max_num_seqs: self.max_num_seqs.or(file.max_num_seqs),
            max_num_batched_tokens: self.max_num_batched_tokens.or(file.max_num_batched_tokens),
            block_size: self.block_size.or(file.block_size),
            kv_cache_memory: self.kv_cache_memory.or(file.kv_cache_memory),
            kv_cache_memory_fraction: self.kv_cache_memory_fraction.or(file.kv_cache_memory_fraction),
            no_prefix_caching: self.no_prefix_caching || file.no_prefix_caching,
            kv_cache_dtype: self.kv_cache_dtype.or(file.kv_cache_dtype),
            kv_cache_dtype_k: self.kv_cache_dtype_k.or(file.kv_cache_dtype_k),
            kv_cache_dtype_v: self.kv_cache_dtype_v.or(file.kv_cache_dtype_v),
            max_waiting_requests: self.max_waiting_requests.or(file.max_waiting_requests),
            max_model_len: self.max_model_len.or(file.max_model_len),
            max_body_bytes: self.max_body_bytes.or(file.max_body_bytes),
            shutdown_grace_secs: self.shutdown_grace_secs.or(file.shutdown_grace_secs),
            shutdown_delay_secs: self.shutdown_delay_secs.or(file.shutdown_delay_secs),
            max_connections: self.max_connections.or(file.max_connections),
            header_read_timeout_secs: self.header_read_timeout_secs.or(file.header_read_timeout_secs),
            keep_alive_timeout_secs: self.keep_alive_timeout_secs.or(file.keep_alive_timeout_secs),
            request_timeout_secs: self.request_timeout_secs.or(file.request_timeout_secs),
            compute: self.compute.or(file.compute),
            device: self.device.or(file.device),
            tensor_parallel_size: self.tensor_parallel_size.or(file.tensor_parallel_size),
            cpu_bind: self.cpu_bind.or(file.cpu_bind),
            tool_call_parser: self.tool_call_parser.or(file.tool_call_parser),
            log_format: self.log_format.or(file.log_format),
        }
    }

    /// Merges the file and applies defaults (the model path is resolved, which may fetch the
    /// default model; `mem_total` gives the machine's memory for the KV-cache default).
    fn resolve(self, mem_total: impl FnOnce() -> Result<usize>) -> Result<ServeConfig> {
        let a = match &self.config {
            Some(path) => {
                let file = Self::from_file(path)?;
                self.or(file)
            }
            None => self,
        };
        let model = model_path::resolve(a.model.as_deref())?;
        let served_model_name = match a.served_model_name {
            Some(n) => n,
            None => model.file_stem().map(|s| s.to_string_lossy().into_owned()).context("the model path has no file name")?,
        };
        let kv_cache_bytes = match (a.kv_cache_memory, a.kv_cache_memory_fraction.unwrap_or(DEFAULT_KV_FRACTION)) {
            (Some(ByteSize(b)), _) => b,
            (None, f) if f > 0.0 && f <= 1.0 => (mem_total()? as f64 * f) as usize,
            (None, f) => bail!("--kv-cache-memory-fraction must be in (0, 1], got {f}"),
        };
        let grace = a.shutdown_grace_secs.unwrap_or(10.0);
        let delay = a.shutdown_delay_secs.unwrap_or(0.0);
        for (name, secs) in [("--shutdown-grace-secs", grace), ("--shutdown-delay-secs", delay)] {
            if !(secs.is_finite() && (0.0..=MAX_SECS).contains(&secs)) {
                bail!("{name} must be a non-negative number of seconds, got {secs}");
            }
        }
        let header_read = a.header_read_timeout_secs.unwrap_or(DEFAULT_HEADER_READ_SECS);
        let keep_alive = a.keep_alive_timeout_secs.unwrap_or(DEFAULT_KEEP_ALIVE_SECS);
        for (name, secs) in [
            ("--header-read-timeout-secs", Some(header_read)),
            ("--keep-alive-timeout-secs", Some(keep_alive)),
            ("--request-timeout-secs", a.request_timeout_secs),
        ] {
            if secs.is_some_and(|s| !(s > 0.0 && s <= MAX_SECS)) {
                bail!("{name} must be a positive number of seconds, got {}", secs.unwrap_or_default());
            }
        }
        let d = EngineConfig::default();
        let cfg = ServeConfig {
            model,
            host: a.host.unwrap_or_else(|| "127.0.0.1".into()),
            port: a.port.unwrap_or(8000),
            served_model_name,
            api_key: a.api_key.filter(|k| !k.is_empty()),
            max_num_seqs: a.max_num_seqs.unwrap_or(d.max_num_seqs),
            max_num_batched_tokens: a.max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
            block_size: a.block_size.unwrap_or(d.block_size),
            kv_cache_bytes,
            prefix_caching: !a.no_prefix_caching,
            kv_cache_dtype: kv_dtype(a.kv_cache_dtype.as_deref(), a.kv_cache_dtype_k.as_deref(), a.kv_cache_dtype_v.as_deref())?,
            max_waiting_requests: a.max_waiting_requests.unwrap_or(d.max_waiting),
            max_model_len: a.max_model_len,
            max_body_bytes: a.max_body_bytes.map_or(DEFAULT_MAX_BODY, |b| b.0),
            shutdown_grace_secs: grace,
            shutdown_delay_secs: delay,
            max_connections: a.max_connections,
            header_read_timeout_secs: header_read,
            keep_alive_timeout_secs: keep_alive,
            request_timeout_secs: a.request_timeout_secs,
            compute: a.compute,
            device: a.device.as_deref().map_or(Ok(Device::Cpu), str::parse).map_err(|e: String| anyhow!("--device: {e}"))?,
            tensor_parallel_size: a.tensor_parallel_size.unwrap_or(1),
            cpu_bind: a.cpu_bind,
            tool_call_parser: a.tool_call_parser.as_deref().map(str::parse).transpose().map_err(|e: String| anyhow!("--tool-call-parser: {e}"))?,
            log_format: a.log_format,
        };
        if cfg.tensor_parallel_size > 1 && cfg.device != Device::Cpu {
            bail!("--tensor-parallel-size above 1 runs on the CPU only (the CUDA backend runs one GPU per replica)");
        }
        for (name, v) in [
            ("--max-num-seqs", cfg.max_num_seqs),
            ("--max-num-batched-tokens", cfg.max_num_batched_tokens),
            ("--block-size", cfg.block_size),
            ("--kv-cache-memory", cfg.kv_cache_bytes),
            ("--max-body-bytes", cfg.max_body_bytes),
            ("--max-connections", cfg.max_connections.unwrap_or(1)),
            ("--tensor-parallel-size", cfg.tensor_parallel_size),
        ] {
            if v == 0 {
                bail!("{name} must be positive");
            }
        }
        Ok(cfg)
    }
}

impl ServeConfig {
    fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            block_size: self.block_size,
            kv_cache_bytes: self.kv_cache_bytes,
            prefix_caching: self.prefix_caching,
            max_waiting: self.max_waiting_requests,
            max_model_len: self.max_model_len,
            kv_dtype: self.kv_cache_dtype,
            kv_seed: 0,
            device: self.device,
        }
    }
}

/// Total memory from /proc/meminfo.
fn mem_total() -> Result<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo (pass --kv-cache-memory)")?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<usize>().ok())
        .map(|kb| kb * 1024)
        .context("no MemTotal in /proc/meminfo (pass --kv-cache-memory)")
}

/// The default `--max-connections` for an open-file limit: the limit less headroom for the
/// process's other descriptors, at least 1 and at most [`MAX_DEFAULT_CONNECTIONS`].
fn default_max_connections(nofile: u64) -> usize {
    nofile.saturating_sub(FD_HEADROOM).clamp(1, MAX_DEFAULT_CONNECTIONS) as usize
}

/// Resolves when SIGINT or SIGTERM first arrives; a second one exits the process at once
/// (status 128 + the signal's number) without draining.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    async move {
        let first = tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        };
        tracing::info!(signal = first, "signal received: draining (send it again to exit at once)");
        tokio::spawn(async move {
            let (name, code) = tokio::select! {
                _ = int.recv() => ("SIGINT", 128 + libc::SIGINT),
                _ = term.recv() => ("SIGTERM", 128 + libc::SIGTERM),
            };
            tracing::warn!(signal = name, "second signal: exiting now without draining");
            std::process::exit(code);
        });
    }
}

/// Runs the command (`log_format`: the global flag, which overrides the file).
pub fn run(args: ServeArgs, log_format: Option<LogFormat>) -> Result<()> {
    let cfg = ServeArgs { log_format, ..args }.resolve(mem_total)?;
    init_logging(cfg.log_format.unwrap_or_default(), "info");
    tracing::info!(config = %serde_json::to_string(&cfg)?, "effective configuration");
    let nofile = http::conn::raise_fd_limit();
    let max_connections = cfg.max_connections.unwrap_or_else(|| default_max_connections(nofile));
    tracing::info!(max_connections, open_file_limit = nofile, "connection limit");
    let policy = cfg.compute.map_or(LinearPolicy::DEFAULT, ComputePath::policy);
    let tp = TpOptions { size: cfg.tensor_parallel_size, cpu_bind: cfg.cpu_bind.clone() };
    let model = LoadedModel::load_parallel(&cfg.model, policy, &tp).with_context(|| format!("loading {}", cfg.model.display()))?;
    let template = model.weights.checkpoint.special.chat_template.as_deref().unwrap_or_default();
    let tool_parser = ToolParser::resolve(cfg.tool_call_parser, template);
    tracing::info!(tool_call_parser = %tool_parser, syntax = ?tool_parser, from_chat_template = cfg.tool_call_parser.is_none(), "tool-call parser");
    let engine = Engine::start(Arc::new(model), cfg.engine_config()).map_err(|e| anyhow!("starting the engine: {e}"))?;
    let options = ServerOptions {
        served_model_name: cfg.served_model_name.clone(),
        api_key: cfg.api_key.clone(),
        max_body_bytes: cfg.max_body_bytes,
        request_timeout: cfg.request_timeout_secs.map(Duration::from_secs_f64),
        conn: ConnOptions {
            max_connections,
            header_read_timeout: Duration::from_secs_f64(cfg.header_read_timeout_secs),
            keep_alive_timeout: Duration::from_secs_f64(cfg.keep_alive_timeout_secs),
        },
        tool_parser,
    };
    let state = AppState::new(engine, options);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        // Before "listening": a signal from then on drains instead of killing the process.
        let signals = shutdown_signal();
        let listener = http::conn::listen(&cfg.host, cfg.port, max_connections)
            .await
            .with_context(|| format!("listening on {}:{}", cfg.host, cfg.port))?;
        let addr = listener.local_addr()?;
        let info = state.engine().info();
        tracing::info!(
            model = %cfg.served_model_name,
            max_model_len = info.max_model_len,
            kv_blocks = info.num_blocks,
            "listening on http://{addr}"
        );
        let drain = DrainOptions {
            grace: Duration::from_secs_f64(cfg.shutdown_grace_secs),
            delay: Duration::from_secs_f64(cfg.shutdown_delay_secs),
        };
        http::serve(listener, state, signals, drain).await?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use tessera_kernels::kv::KvFormat;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn args(flags: &[&str]) -> ServeArgs {
        Cli::try_parse_from(std::iter::once("serve").chain(flags.iter().copied())).unwrap().args
    }

    fn gib() -> Result<usize> {
        Ok(10 << 30)
    }

    fn configs_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
    }

    #[test]
    fn byte_sizes() {
        let cases = [
            ("123", 123),
            ("2GiB", 2 << 30),
            ("2g", 2 << 30),
            ("512MiB", 512 << 20),
            ("1.5 KiB", 1536),
            ("1GB", 1_000_000_000),
            ("3kb", 3000),
        ];
        for (s, n) in cases {
            assert_eq!(s.parse::<ByteSize>(), Ok(ByteSize(n)), "{s}");
        }
        for bad in ["", "GiB", "2 parsecs", "-1", "1.2.3MB"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults() {
        let c = args(&[]).resolve(gib).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 8000));
        assert_eq!(c.served_model_name, "SmolLM2-135M-Instruct.Q4_1");
        assert_eq!(c.kv_cache_bytes, 2 << 30);
        assert_eq!(c.engine_config(), EngineConfig { kv_cache_bytes: 2 << 30, ..EngineConfig::default() });
        assert_eq!((c.max_body_bytes, c.shutdown_grace_secs, c.compute, c.api_key), (DEFAULT_MAX_BODY, 10.0, None, None));
        assert_eq!((c.shutdown_delay_secs, c.max_connections, c.request_timeout_secs), (0.0, None, None));
        assert_eq!((c.header_read_timeout_secs, c.keep_alive_timeout_secs), (30.0, 15.0));
    }

    #[test]
    fn the_default_connection_limit_leaves_descriptors_free() {
        assert_eq!(default_max_connections(1024), 896);
        assert_eq!(default_max_connections(1 << 20), 8192);
        assert_eq!(default_max_connections(16), 1);
    }

    #[test]
    fn flags_reach_the_config() {
        let c = args(&[
            "--host", "0.0.0.0", "--port", "0", "--served-model-name", "smol", "--api-key", "k",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--block-size", "32",
            "--kv-cache-memory", "64MiB", "--no-prefix-caching", "--max-waiting-requests", "2",
            "--max-model-len", "1024", "--max-body-bytes", "1KiB", "--shutdown-grace-secs", "2.5",
            "--compute", "int8-act", "--kv-cache-dtype", "int8", "--kv-cache-dtype-k", "hqmq-s96-r4", "--device", "cuda:1",
            "--shutdown-delay-secs", "3", "--max-connections", "100", "--header-read-timeout-secs", "4",
            "--keep-alive-timeout-secs", "5", "--request-timeout-secs", "60", "--tool-call-parser", "qwen3_coder",
        ])
        .resolve(gib)
        .unwrap();
        let e = c.engine_config();
        assert_eq!((c.host.as_str(), c.port, c.served_model_name.as_str(), c.api_key.as_deref()), ("0.0.0.0", 0, "smol", Some("k")));
        assert_eq!(
            e,
            EngineConfig {
                max_num_seqs: 4,
                max_num_batched_tokens: 256,
                block_size: 32,
                kv_cache_bytes: 64 << 20,
                prefix_caching: false,
                max_waiting: 2,
                max_model_len: Some(1024),
                kv_dtype: KvRequest { k: Some("hqmq-s96-r4".parse().unwrap()), v: Some(KvFormat::INT8) },
                kv_seed: 0,
                device: Device::Cuda(1),
            }
        );
        assert_eq!((c.max_body_bytes, c.shutdown_grace_secs, c.compute), (1024, 2.5, Some(ComputePath::Int8Act)));
        assert_eq!((c.shutdown_delay_secs, c.max_connections, c.request_timeout_secs), (3.0, Some(100), Some(60.0)));
        assert_eq!((c.header_read_timeout_secs, c.keep_alive_timeout_secs), (4.0, 5.0));
        let logged = serde_json::to_value(&c).unwrap();
        assert_eq!((logged["api_key"].as_str(), logged["compute"].as_str()), (Some("<set>"), Some("int8-act")));
        assert_eq!(logged["kv_cache_dtype"].as_str(), Some("k=hqmq-s96-r4,v=int8"));
        assert_eq!(logged["device"].as_str(), Some("cuda:1"));
        assert_eq!((c.tool_call_parser, logged["tool_call_parser"].as_str()), (Some(ToolParser::Qwen3Coder), Some("qwen3_coder")));
        assert_eq!(args(&[]).resolve(gib).unwrap().tool_call_parser, None, "chosen from the chat template at start");
        let bad = args(&["--tool-call-parser", "qwen3"]).resolve(gib).map(|_| ()).unwrap_err().to_string();
        assert!(bad.contains("--tool-call-parser") && bad.contains("hermes, llama3_json, mistral, qwen3_coder"), "{bad}");
        let bad = args(&["--kv-cache-dtype", "qjl1"]).resolve(gib).map(|_| ()).unwrap_err().to_string();
        assert!(bad.contains("keys only"), "{bad}");
        assert_eq!(args(&["--kv-cache-memory-fraction", "0.5"]).resolve(gib).unwrap().kv_cache_bytes, 5 << 30);
    }

    #[test]
    fn bad_values_are_refused() {
        for flags in [
            &["--kv-cache-memory-fraction", "0"][..],
            &["--kv-cache-memory-fraction", "1.5"],
            &["--max-num-seqs", "0"],
            &["--shutdown-grace-secs=-1"],
            &["--shutdown-delay-secs=-1"],
            &["--max-connections", "0"],
            &["--header-read-timeout-secs", "0"],
            &["--keep-alive-timeout-secs", "inf"],
            &["--request-timeout-secs", "0"],
            &["--model", "/nonexistent/model.gguf"],
            &["--device", "tpu"],
        ] {
            assert!(args(flags).resolve(gib).is_err(), "{flags:?}");
        }
        assert!(Cli::try_parse_from(["serve", "--kv-cache-memory", "lots"]).is_err());
    }

    fn write_config(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("tessera-serve-{}-{name}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn file_values_apply_and_flags_override_them() {
        let path = write_config(
            "override",
            "port = 9000\nmax-num-seqs = 3\nkv-cache-memory = \"1GiB\"\nno-prefix-caching = true\ncompute = \"float\"\nlog-format = \"json\"\nmax-body-bytes = 4096\ntool-call-parser = \"mistral\"\n",
        );
        let file = path.to_str().unwrap();
        let c = args(&["--config", file, "--max-num-seqs", "5"]).resolve(gib).unwrap();
        assert_eq!((c.port, c.max_num_seqs, c.kv_cache_bytes, c.prefix_caching), (9000, 5, 1 << 30, false));
        assert_eq!((c.compute, c.log_format, c.max_body_bytes), (Some(ComputePath::Float), Some(LogFormat::Json), 4096));
        assert_eq!(c.tool_call_parser, Some(ToolParser::Mistral));
        let flag = args(&["--config", file, "--tool-call-parser", "llama3_json"]).resolve(gib).unwrap();
        assert_eq!(flag.tool_call_parser, Some(ToolParser::Llama3Json));
        let global = ServeArgs { log_format: Some(LogFormat::Human), ..args(&["--config", file]) };
        assert_eq!(global.resolve(gib).unwrap().log_format, Some(LogFormat::Human));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn unknown_or_mistyped_keys_are_errors_naming_them() {
        for (text, needle) in [
            ("max-num-seq = 3\n", "max-num-seq"),
            ("port = \"eighty\"\n", "port"),
            ("compute = \"fast\"\n", "fast"),
            ("tool-call-parser = \"pythonic\"\n", "pythonic"),
            ("config = \"other.toml\"\n", "config"),
        ] {
            let path = write_config("bad", text);
            let err = args(&["--config", path.to_str().unwrap()]).resolve(gib).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
            std::fs::remove_file(path).unwrap();
        }
        assert!(args(&["--config", "/nonexistent.toml"]).resolve(gib).is_err());
    }

    #[test]
    fn every_preset_parses() {
        let mut presets = 0;
        for entry in std::fs::read_dir(configs_dir()).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let c = args(&["--config", path.to_str().unwrap()]).resolve(gib);
                assert!(c.is_ok(), "{}: {:#}", path.display(), c.unwrap_err());
                presets += 1;
            }
        }
        assert!(presets >= 2, "expected the presets in configs/");
    }

    #[test]
    fn mem_total_reads_proc_meminfo() {
        assert!(mem_total().unwrap() > 1 << 20);
    }
}
