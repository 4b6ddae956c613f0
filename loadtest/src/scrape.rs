//! The target's Prometheus `/metrics`, scraped before and after a run, and what changed.

use serde::Serialize;
use std::collections::BTreeMap;

/// Sample values by series (`name{labels}` as the server wrote it).
pub type Samples = BTreeMap<String, f64>;

/// Parses Prometheus text exposition: comments skipped, timestamps ignored, label values may
/// hold spaces and escaped quotes. Lines that are not samples are skipped.
pub fn parse(text: &str) -> Samples {
    text.lines().filter_map(|l| sample(l.trim())).collect()
}

fn sample(line: &str) -> Option<(String, f64)> {
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let series_end = match line.find('{') {
        Some(open) if line[..open].find(char::is_whitespace).is_none() => open + labels_end(&line[open..])? + 1,
        _ => line.find(char::is_whitespace)?,
    };
    let value = line[series_end..].split_whitespace().next()?;
    Some((line[..series_end].to_string(), value.parse().ok()?))
}

/// Offset of the `}` closing the label set that `s` starts with.
fn labels_end(s: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// GETs `{base_url}/metrics`; `None` when the server has none (or it is not Prometheus text).
pub async fn scrape(client: &reqwest::Client, base_url: &str) -> Option<Samples> {
    let resp = client.get(format!("{base_url}/metrics")).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let samples = parse(&resp.text().await.ok()?);
    (!samples.is_empty()).then_some(samples)
}

/// How the server's metrics moved over a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MetricsDelta {
    /// After minus before for every series that changed (a new series counts from 0), histogram
    /// buckets left out.
    pub deltas: BTreeMap<String, f64>,
    /// Sum of the changes of series whose name mentions `preempt` (0 when they did not move).
    pub preemptions: Option<f64>,
    /// Δ`*prefix_cache_hits*` / Δ`*prefix_cache_queries*` (vLLM's counters, in tokens).
    pub prefix_cache_hit_rate: Option<f64>,
}

/// The change from `before` to `after`.
pub fn delta(before: &Samples, after: &Samples) -> MetricsDelta {
    let all: BTreeMap<&str, f64> =
        after.iter().map(|(k, v)| (k.as_str(), v - before.get(k).copied().unwrap_or(0.0))).collect();
    let sum_where = |needle: &str| {
        let matching: Vec<f64> = all.iter().filter(|(k, _)| name(k).contains(needle)).map(|(_, d)| *d).collect();
        (!matching.is_empty()).then(|| matching.iter().sum::<f64>())
    };
    let prefix_cache_hit_rate = match (sum_where("prefix_cache_hits"), sum_where("prefix_cache_queries")) {
        (Some(hits), Some(queries)) if queries > 0.0 => Some(hits / queries),
        _ => None,
    };
    let deltas = all
        .iter()
        .filter(|(k, d)| **d != 0.0 && !name(k).ends_with("_bucket"))
        .map(|(k, d)| (k.to_string(), *d))
        .collect();
    MetricsDelta { preemptions: sum_where("preempt"), prefix_cache_hit_rate, deltas }
}

/// The metric name of a series key.
fn name(series: &str) -> &str {
    series.split('{').next().unwrap_or(series)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP vllm:num_preemptions_total Preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="m"} 2
vllm:prefix_cache_queries_total{model_name="m"} 100
vllm:prefix_cache_hits_total{model_name="m"} 10
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 3
weird{path="/a b}c\"d"} 1.5 1700000000000
unchanged 7
"#;
    const AFTER: &str = r#"vllm:num_preemptions_total{model_name="m"} 5
vllm:prefix_cache_queries_total{model_name="m"} 500
vllm:prefix_cache_hits_total{model_name="m"} 310
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 9
weird{path="/a b}c\"d"} 4 1700000000001
unchanged 7
fresh_total +Inf
fresh_counter 3
not a sample line
"#;

    #[test]
    fn parses_labels_with_spaces_braces_and_escaped_quotes() {
        let s = parse(BEFORE);
        assert_eq!(s.len(), 6);
        assert_eq!(s[r#"weird{path="/a b}c\"d"}"#], 1.5);
        assert_eq!(s[r#"vllm:num_preemptions_total{model_name="m"}"#], 2.0);
        assert_eq!(parse(AFTER)["fresh_total"], f64::INFINITY);
    }

    #[test]
    fn deltas_preemptions_and_hit_rate() {
        let d = delta(&parse(BEFORE), &parse(AFTER));
        assert_eq!(d.preemptions, Some(3.0));
        assert_eq!(d.prefix_cache_hit_rate, Some(300.0 / 400.0));
        assert_eq!(d.deltas[r#"weird{path="/a b}c\"d"}"#], 2.5);
        assert_eq!(d.deltas["fresh_counter"], 3.0);
        assert!(!d.deltas.contains_key("unchanged"));
        assert!(d.deltas.keys().all(|k| !k.contains("_bucket")));
        let none = delta(&parse("a 1"), &parse("a 2"));
        assert_eq!((none.preemptions, none.prefix_cache_hit_rate), (None, None));
        // Counters that exist but did not move still give their figures.
        let still = "x_num_preemptions_total 4\nx_prefix_cache_hits_total 0\nx_prefix_cache_queries_total 8";
        let moved = "x_num_preemptions_total 4\nx_prefix_cache_hits_total 0\nx_prefix_cache_queries_total 16";
        let d = delta(&parse(still), &parse(moved));
        assert_eq!((d.preemptions, d.prefix_cache_hit_rate), (Some(0.0), Some(0.0)));
        assert_eq!(d.deltas.len(), 1);
    }
}
