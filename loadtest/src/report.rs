//! A run's report: the bench_serving-style table, the JSON file (every figure, the full
//! configuration and per-request records) and the per-request CSV.

use crate::cli::Config;
use crate::metrics::{RequestRecord, Stats, Summary};
use crate::scrape::MetricsDelta;
use anyhow::{Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// Everything one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The configuration it ran with.
    pub config: Config,
    /// The server URL.
    pub base_url: String,
    /// The `model` field sent.
    pub model: String,
    /// The concurrency limit of this run (a sweep level, or `--max-concurrency`).
    pub max_concurrency: Option<usize>,
    /// Requests planned (`--num-prompts`).
    pub num_requests: usize,
    /// Requests sent before `--max-duration` ran out.
    pub sent: usize,
    /// Whether `--max-duration` cut the run short.
    pub truncated: bool,
    /// Aggregate figures.
    #[serde(flatten)]
    pub summary: Summary,
    /// How the server's `/metrics` moved, when it has them.
    pub server_metrics: Option<MetricsDelta>,
    /// One record per sent request, in dataset order.
    pub requests: Vec<RequestRecord>,
}

/// Width of the table's label column; the table is 50 characters wide like bench_serving's.
const LABEL: usize = 40;
const WIDTH: usize = 50;

impl Report {
    /// The human-readable result table.
    pub fn table(&self) -> String {
        let mut t = String::new();
        let s = &self.summary;
        let rule = |t: &mut String, title: &str| {
            let _ = writeln!(t, "{:-^WIDTH$}", title);
        };
        let row = |t: &mut String, label: &str, value: String| {
            let _ = writeln!(t, "{:<LABEL$}{value}", format!("{label}:"));
        };
        let _ = writeln!(t, "{:=^WIDTH$}", " Serving Benchmark Result ");
        row(&mut t, "Target", format!("{} ({})", self.base_url, self.config.endpoint));
        row(&mut t, "Max request concurrency", self.max_concurrency.map_or("unlimited".into(), |c| c.to_string()));
        row(&mut t, "Request rate (req/s)", fmt_rate(self.config.request_rate));
        row(&mut t, "Successful requests", s.completed.to_string());
        row(&mut t, "Failed requests", s.failed.to_string());
        if self.truncated {
            row(&mut t, "Not sent (--max-duration reached)", (self.num_requests - self.sent).to_string());
        }
        row(&mut t, "Benchmark duration (s)", format!("{:.2}", s.duration_s));
        row(&mut t, "Total input tokens", s.total_input_tokens.to_string());
        row(&mut t, "Total generated tokens", s.total_output_tokens.to_string());
        row(&mut t, "Output counts from server usage", format!("{}/{}", s.output_counts_from_usage, s.completed));
        row(&mut t, "Request throughput (req/s)", format!("{:.2}", s.request_throughput));
        if let Some(g) = s.goodput {
            row(&mut t, "Request goodput (req/s)", format!("{g:.2}"));
        }
        row(&mut t, "Input token throughput (tok/s)", format!("{:.2}", s.input_throughput));
        row(&mut t, "Output token throughput (tok/s)", format!("{:.2}", s.output_throughput));
        row(&mut t, "Total token throughput (tok/s)", format!("{:.2}", s.total_token_throughput));
        for (title, short, stats) in [
            ("Time to First Token", "TTFT", &s.ttft_ms),
            ("Time per Output Token (excl. 1st token)", "TPOT", &s.tpot_ms),
            ("Inter-token Latency", "ITL", &s.itl_ms),
            ("End-to-end Latency", "E2E", &s.e2e_ms),
        ] {
            let Some(st) = stats else { continue };
            rule(&mut t, title);
            for (name, v) in stat_rows(st) {
                row(&mut t, &format!("{name} {short} (ms)"), format!("{v:.2}"));
            }
        }
        if let Some(m) = &self.server_metrics {
            rule(&mut t, "Server /metrics (after - before)");
            if let Some(p) = m.preemptions {
                row(&mut t, "Preemptions", fmt_num(p));
            }
            if let Some(h) = m.prefix_cache_hit_rate {
                row(&mut t, "Prefix cache hit rate", format!("{:.2}%", h * 100.0));
            }
            const SHOWN: usize = 12;
            for (k, v) in m.deltas.iter().take(SHOWN) {
                let _ = writeln!(t, "{k:<LABEL$} {}", fmt_num(*v));
            }
            if m.deltas.len() > SHOWN {
                let _ = writeln!(t, "... {} more series in --output-json", m.deltas.len() - SHOWN);
            }
        }
        let errors = error_counts(&self.requests);
        if !errors.is_empty() {
            rule(&mut t, "Errors");
            for (e, n) in errors.iter().take(5) {
                let _ = writeln!(t, "{n} x {e}");
            }
        }
        let _ = writeln!(t, "{}", "=".repeat(WIDTH));
        t
    }

    /// Writes the JSON report.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        write_json(self, path)
    }

    /// Writes one CSV row per request (ITL as `;`-separated ms in one column).
    pub fn write_csv(&self, path: &Path) -> Result<()> {
        let mut out = String::from(
            "index,start_s,prompt_len,max_tokens,output_tokens,output_tokens_from_usage,server_prompt_tokens,\
             ttft_ms,tpot_ms,e2e_ms,itl_ms,error\n",
        );
        let opt = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_default();
        for r in &self.requests {
            let itl: Vec<String> = r.itl_ms.iter().map(|x| format!("{x:.3}")).collect();
            let _ = writeln!(
                out,
                "{},{:.6},{},{},{},{},{},{},{},{:.3},{},{}",
                r.index,
                r.start_s,
                r.prompt_len,
                r.max_tokens,
                r.output_tokens,
                r.output_tokens_from_usage,
                r.server_prompt_tokens.map(|n| n.to_string()).unwrap_or_default(),
                opt(r.ttft_ms),
                opt(r.tpot_ms),
                r.e2e_ms,
                itl.join(";"),
                csv_field(r.error.as_deref().unwrap_or("")),
            );
        }
        std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
    }
}

/// The table summarizing a concurrency sweep, one row per level.
pub fn sweep_table(reports: &[Report]) -> String {
    let mut t = format!(
        "{:>6} {:>6} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        "conc", "ok", "req/s", "out tok/s", "p50 TTFT", "p99 TTFT", "p50 TPOT", "p99 TPOT", "p99 E2E"
    );
    for r in reports {
        let s = &r.summary;
        let pick =
            |st: &Option<Stats>, f: fn(&Stats) -> f64| st.as_ref().map_or("-".into(), |x| format!("{:.1}", f(x)));
        let _ = writeln!(
            t,
            "{:>6} {:>6} {:>9.2} {:>10.1} {:>9} {:>9} {:>9} {:>9} {:>9}",
            r.max_concurrency.map_or("inf".into(), |c| c.to_string()),
            s.completed,
            s.request_throughput,
            s.output_throughput,
            pick(&s.ttft_ms, |x| x.median),
            pick(&s.ttft_ms, |x| x.p99),
            pick(&s.tpot_ms, |x| x.median),
            pick(&s.tpot_ms, |x| x.p99),
            pick(&s.e2e_ms, |x| x.p99),
        );
    }
    t.push_str("(latencies in ms)\n");
    t
}

/// Writes any report value as pretty JSON.
pub fn write_json<T: Serialize + ?Sized>(value: &T, path: &Path) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn stat_rows(s: &Stats) -> [(&'static str, f64); 5] {
    [("Mean", s.mean), ("Median", s.median), ("P90", s.p90), ("P99", s.p99), ("Std", s.std)]
}

/// Whole numbers as such, others to 4 decimals.
fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

fn fmt_rate(r: f64) -> String {
    if r.is_finite() {
        format!("{r}")
    } else {
        "inf".into()
    }
}

/// Distinct error texts, most frequent first.
fn error_counts(records: &[RequestRecord]) -> Vec<(String, usize)> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for e in records.iter().filter_map(|r| r.error.as_deref()) {
        *counts.entry(e).or_default() += 1;
    }
    let mut v: Vec<(String, usize)> = counts.into_iter().map(|(e, n)| (e.to_string(), n)).collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    v
}

/// A CSV field, quoted when it holds a comma, quote or line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quoting() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("HTTP 500: a, \"b\""), "\"HTTP 500: a, \"\"b\"\"\"");
    }
}
