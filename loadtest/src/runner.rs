//! Runs a benchmark: prepares the prompts and the target, warms up, sends the load on its
//! arrival schedule under the concurrency limit and the wall-clock cap, and builds the report.

use crate::arrivals::poisson_offsets;
use crate::cli::Config;
use crate::client::{Outcome, Target};
use crate::dataset::{self, BenchRequest};
use crate::metrics::{summarize, RequestRecord, Slo};
use crate::report::Report;
use crate::scrape::{delta, scrape};
use crate::tokens::Tokens;
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};

/// Runs the benchmark `config` describes at `--max-concurrency`.
pub async fn run(config: &Config) -> Result<Report> {
    let bench = Bench::prepare(config, 1).await?;
    bench.warmup().await?;
    bench.measure(0, config.max_concurrency).await
}

/// Runs the same load at each `--sweep-concurrency` level, one report per level.
///
/// Each level gets its own prompts, drawn the same way, so that a prefix cache filled by one
/// level does not flatter the next (a dataset file with too few prompts is reused, though).
pub async fn run_sweep(config: &Config) -> Result<Vec<Report>> {
    let levels = config.sweep_concurrency.clone().context("--sweep-concurrency is not set")?;
    let bench = Bench::prepare(config, levels.len()).await?;
    bench.warmup().await?;
    let mut reports = Vec::with_capacity(levels.len());
    for (k, level) in levels.into_iter().enumerate() {
        reports.push(bench.measure(k, Some(level)).await?);
    }
    Ok(reports)
}

/// A prepared benchmark: the prompts of each run and of the warmup, the arrival offsets, and
/// the target.
struct Bench {
    config: Config,
    base_url: String,
    client: reqwest::Client,
    target: Arc<Target>,
    tokens: Tokens,
    runs: Vec<Arc<[BenchRequest]>>,
    warmup: Arc<[BenchRequest]>,
    offsets: Vec<f64>,
}

/// What dispatching a list of requests gave.
struct Dispatched {
    /// `(request index, send time from the start in s, outcome)`, in index order.
    results: Vec<(usize, f64, Outcome)>,
    /// Wall time from the first send to the last response, s.
    elapsed_s: f64,
}

impl Bench {
    /// Validates `config`, loads the tokenizer, builds the prompts of `runs` runs and resolves
    /// the model name.
    async fn prepare(config: &Config, runs: usize) -> Result<Self> {
        config.validate()?;
        let tokens = Tokens::load(config.tokenizer.as_deref(), config.model.as_deref())?;
        // Warmup prompts come after the measured ones, so they warm no prefix cache for them.
        let (n, measured) = (config.num_prompts, config.num_prompts * runs);
        let all = dataset::build(config, &tokens, measured + config.warmup_requests)?;
        let runs: Vec<Arc<[BenchRequest]>> = all[..measured].chunks(n).map(Arc::from).collect();
        let warmup: Arc<[BenchRequest]> = all[measured..].into();
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = &config.api_key {
            let value = format!("Bearer {key}").parse().context("--api-key is not a valid header value")?;
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        // A fresh connection per request (a loopback handshake is tens of microseconds): a server
        // may close a pooled keep-alive connection just as a request goes out on it (seen with
        // llama-server), which would fail a good request.
        let client = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .default_headers(headers)
            .build()
            .context("building the HTTP client")?;
        let base_url = config.base_url();
        let model = served_model(config, &client, &base_url).await;
        let target =
            Target::new(client.clone(), &base_url, &config.endpoint, model, !config.no_stream, !config.no_ignore_eos);
        Ok(Bench {
            offsets: poisson_offsets(n, config.request_rate, config.seed),
            config: config.clone(),
            base_url,
            client,
            target: Arc::new(target),
            tokens,
            runs,
            warmup,
        })
    }

    /// Sends the `--warmup-requests` prompts at once (under `--max-concurrency`) and discards
    /// them; fails if any of them fails, since the measured run would too.
    async fn warmup(&self) -> Result<()> {
        if self.warmup.is_empty() {
            return Ok(());
        }
        let offsets = vec![0.0; self.warmup.len()];
        let d = self.dispatch(&self.warmup, &offsets, self.config.max_concurrency, &ProgressBar::hidden()).await?;
        if let Some(err) = d.results.iter().find_map(|(_, _, o)| o.error.as_ref()) {
            bail!("warmup request failed: {err}");
        }
        Ok(())
    }

    /// Measured run `run` (its own prompts) at `concurrency`, with `/metrics` scraped around it.
    async fn measure(&self, run: usize, concurrency: Option<usize>) -> Result<Report> {
        let prompts = &self.runs[run];
        let before = scrape(&self.client, &self.base_url).await;
        let bar = self.progress_bar(prompts.len(), concurrency);
        let d = self.dispatch(prompts, &self.offsets, concurrency, &bar).await?;
        bar.finish_and_clear();
        let server_metrics = match before {
            Some(b) => scrape(&self.client, &self.base_url).await.map(|a| delta(&b, &a)),
            None => None,
        };
        let sent = d.results.len();
        let requests = d
            .results
            .into_iter()
            .map(|(i, start_s, out)| RequestRecord::new(i, start_s, &prompts[i], out, &self.tokens))
            .collect::<Result<Vec<_>>>()?;
        let slo = Slo { ttft_ms: self.config.slo_ttft_ms, tpot_ms: self.config.slo_tpot_ms };
        Ok(Report {
            config: self.config.clone(),
            base_url: self.base_url.clone(),
            model: self.target.model.clone(),
            max_concurrency: concurrency,
            num_requests: prompts.len(),
            sent,
            truncated: sent < prompts.len() || requests.iter().any(|r| r.error.as_deref() == Some(CUT_OFF)),
            summary: summarize(&requests, d.elapsed_s, slo),
            server_metrics,
            requests,
        })
    }

    /// Sends `requests[i]` at `offsets[i]`, at most `concurrency` at a time, and stops sending
    /// (and fails open requests) at `--max-duration`.
    async fn dispatch(
        &self,
        requests: &Arc<[BenchRequest]>,
        offsets: &[f64],
        concurrency: Option<usize>,
        bar: &ProgressBar,
    ) -> Result<Dispatched> {
        let start = Instant::now();
        let deadline = start + Duration::from_secs_f64(self.config.max_duration);
        let limit = concurrency.map(|c| Arc::new(Semaphore::new(c)));
        let mut tasks = JoinSet::new();
        for (i, &offset) in offsets.iter().enumerate() {
            let due = start + Duration::from_secs_f64(offset);
            if due >= deadline {
                break;
            }
            sleep_until(due).await;
            let permit = match &limit {
                Some(sem) => tokio::select! {
                    p = sem.clone().acquire_owned() => Some(p.expect("the semaphore is never closed")),
                    _ = sleep_until(deadline) => break,
                },
                None => None,
            };
            let (target, requests, bar) = (self.target.clone(), requests.clone(), bar.clone());
            tasks.spawn(async move {
                let _permit = permit;
                let sent = Instant::now();
                let out = tokio::select! {
                    out = target.send(&requests[i]) => out,
                    _ = sleep_until(deadline) => Outcome::failed(CUT_OFF.into(), sent.elapsed().as_secs_f64()),
                };
                bar.inc(1);
                (i, (sent - start).as_secs_f64(), out)
            });
        }
        let mut results = Vec::with_capacity(tasks.len());
        while let Some(r) = tasks.join_next().await {
            results.push(r.context("a request task panicked")?);
        }
        let elapsed_s = start.elapsed().as_secs_f64();
        results.sort_by_key(|r| r.0);
        Ok(Dispatched { results, elapsed_s })
    }

    fn progress_bar(&self, len: usize, concurrency: Option<usize>) -> ProgressBar {
        if self.config.no_progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(len as u64);
        let style =
            ProgressStyle::with_template("{prefix} {bar:40} {pos}/{len} requests [{elapsed_precise}<{eta_precise}]")
                .expect("the template is valid");
        bar.set_style(style);
        bar.set_prefix(format!("concurrency {}", concurrency.map_or("unlimited".into(), |c| c.to_string())));
        bar
    }
}

/// The error of a request still open when `--max-duration` ran out.
pub const CUT_OFF: &str = "still running at --max-duration";

/// `--served-model-name`, else the first id of `GET /v1/models`, else the `--model` file
/// name, else `default`.
async fn served_model(config: &Config, client: &reqwest::Client, base_url: &str) -> String {
    if let Some(m) = &config.served_model_name {
        return m.clone();
    }
    let listed = async {
        let v: serde_json::Value = client.get(format!("{base_url}/v1/models")).send().await.ok()?.json().await.ok()?;
        v["data"][0]["id"].as_str().map(str::to_string)
    };
    if let Some(id) = listed.await {
        return id;
    }
    config
        .model
        .as_deref()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "default".into())
}
