//! The figures of a run, defined as bench_serving defines them: per-request TTFT, TPOT, ITL
//! and E2E latency, their distributions, throughputs and goodput.

use crate::client::Outcome;
use crate::dataset::BenchRequest;
use crate::tokens::Tokens;
use anyhow::Result;
use serde::Serialize;

/// Distribution of one latency, in ms.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Stats {
    /// Number of values.
    pub count: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Population standard deviation (numpy's `std`, ddof = 0).
    pub std: f64,
    /// Smallest value.
    pub min: f64,
    /// 50th percentile.
    pub median: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

impl Stats {
    /// The distribution of `values`, or `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Stats> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        Some(Stats {
            count: v.len(),
            mean,
            std,
            min: v[0],
            median: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v[v.len() - 1],
        })
    }
}

/// The `p`th percentile of sorted, non-empty `sorted`, interpolated linearly between the two
/// nearest ranks (numpy's default).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// What was measured for one request.
#[derive(Clone, Debug, Serialize)]
pub struct RequestRecord {
    /// Position in the dataset.
    pub index: usize,
    /// When it was sent, seconds from the start of the run.
    pub start_s: f64,
    /// Prompt tokens by the client's tokenizer.
    pub prompt_len: usize,
    /// `max_tokens` asked for.
    pub max_tokens: usize,
    /// Output tokens: the server's `usage.completion_tokens`, else the re-tokenized text.
    pub output_tokens: u64,
    /// Whether `output_tokens` came from the server's usage.
    pub output_tokens_from_usage: bool,
    /// The server's `usage.prompt_tokens` (may include BOS or a chat template).
    pub server_prompt_tokens: Option<u64>,
    /// Time to first token.
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first: `(e2e - ttft) / (output_tokens - 1)`.
    pub tpot_ms: Option<f64>,
    /// End-to-end latency.
    pub e2e_ms: f64,
    /// Gaps between streamed chunks.
    pub itl_ms: Vec<f64>,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

impl RequestRecord {
    /// Derives the record of request `index` from what the client measured; output tokens are
    /// re-tokenized from the text when the server sent no usage.
    pub fn new(index: usize, start_s: f64, req: &BenchRequest, out: Outcome, tokens: &Tokens) -> Result<Self> {
        let (output_tokens, from_usage) = match out.usage_completion_tokens {
            Some(n) => (n, true),
            None => (tokens.count(&out.text)? as u64, false),
        };
        let ms = |s: f64| s * 1e3;
        let tpot_ms = match out.ttft {
            Some(ttft) if output_tokens > 1 => Some(ms(out.e2e - ttft) / (output_tokens - 1) as f64),
            _ => None,
        };
        Ok(RequestRecord {
            index,
            start_s,
            prompt_len: req.prompt_len,
            max_tokens: req.output_len,
            output_tokens,
            output_tokens_from_usage: from_usage,
            server_prompt_tokens: out.usage_prompt_tokens,
            ttft_ms: out.ttft.map(ms),
            tpot_ms,
            e2e_ms: ms(out.e2e),
            itl_ms: out.itl.into_iter().map(ms).collect(),
            error: out.error,
        })
    }

    /// Whether the request succeeded.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// Service-level objectives for goodput.
#[derive(Clone, Copy, Debug, Default)]
pub struct Slo {
    /// Most TTFT allowed, ms.
    pub ttft_ms: Option<f64>,
    /// Most TPOT allowed, ms (a one-token output has no TPOT and meets it).
    pub tpot_ms: Option<f64>,
}

impl Slo {
    fn met_by(&self, r: &RequestRecord) -> bool {
        let ttft = self.ttft_ms.is_none_or(|slo| r.ttft_ms.is_some_and(|t| t <= slo));
        let tpot = self.tpot_ms.is_none_or(|slo| r.tpot_ms.is_none_or(|t| t <= slo));
        r.ok() && ttft && tpot
    }

    fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some()
    }
}

/// Every aggregate figure of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Wall time of the measured run, seconds.
    pub duration_s: f64,
    /// Requests that succeeded.
    pub completed: usize,
    /// Requests that failed (errors, or still open at `--max-duration`).
    pub failed: usize,
    /// Prompt tokens of the completed requests.
    pub total_input_tokens: u64,
    /// Output tokens of the completed requests.
    pub total_output_tokens: u64,
    /// Completed requests whose output count came from the server's usage.
    pub output_counts_from_usage: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Prompt tokens per second.
    pub input_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Prompt and output tokens per second.
    pub total_token_throughput: f64,
    /// Completed requests that met every SLO (when one is set).
    pub good_requests: Option<usize>,
    /// `good_requests` per second.
    pub goodput: Option<f64>,
    /// Time to first token, ms.
    pub ttft_ms: Option<Stats>,
    /// Time per output token after the first, ms.
    pub tpot_ms: Option<Stats>,
    /// Inter-token (inter-chunk) latency, ms, over all gaps of all requests.
    pub itl_ms: Option<Stats>,
    /// End-to-end latency, ms.
    pub e2e_ms: Option<Stats>,
}

/// Aggregates the records of a run that took `duration_s`; only completed requests count.
pub fn summarize(records: &[RequestRecord], duration_s: f64, slo: Slo) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let total_input_tokens = ok.iter().map(|r| r.prompt_len as u64).sum::<u64>();
    let total_output_tokens = ok.iter().map(|r| r.output_tokens).sum::<u64>();
    let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
    let good_requests = slo.is_set().then(|| ok.iter().filter(|r| slo.met_by(r)).count());
    let collect = |f: fn(&RequestRecord) -> Option<f64>| ok.iter().filter_map(|r| f(r)).collect::<Vec<_>>();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect();
    Summary {
        duration_s,
        completed: ok.len(),
        failed: records.len() - ok.len(),
        total_input_tokens,
        total_output_tokens,
        output_counts_from_usage: ok.iter().filter(|r| r.output_tokens_from_usage).count(),
        request_throughput: per_s(ok.len() as f64),
        input_throughput: per_s(total_input_tokens as f64),
        output_throughput: per_s(total_output_tokens as f64),
        total_token_throughput: per_s((total_input_tokens + total_output_tokens) as f64),
        good_requests,
        goodput: good_requests.map(|g| per_s(g as f64)),
        ttft_ms: Stats::of(&collect(|r| r.ttft_ms)),
        tpot_ms: Stats::of(&collect(|r| r.tpot_ms)),
        itl_ms: Stats::of(&itl),
        e2e_ms: Stats::of(&collect(|r| Some(r.e2e_ms))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    /// Values checked by hand (and equal to numpy.percentile / numpy.std).
    #[test]
    fn percentiles_and_std_match_hand_computed_values() {
        let s = Stats::of(&[10.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0, 5.0]).unwrap();
        // rank = p/100 * 9: p50 -> 4.5 -> 5.5; p90 -> 8.1 -> 9.1; p99 -> 8.91 -> 9.91.
        assert!(close(s.median, 5.5) && close(s.p90, 9.1) && close(s.p99, 9.91), "{s:?}");
        // mean 5.5; squared deviations sum to 82.5; 82.5 / 10 = 8.25.
        assert!(close(s.mean, 5.5) && close(s.std, 8.25f64.sqrt()), "{s:?}");
        assert_eq!((s.min, s.max, s.count), (1.0, 10.0, 10));

        let s = Stats::of(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
        // The textbook example: mean 5, population std exactly 2; p90 rank 6.3 -> 7 + 0.3*2.
        assert!(close(s.mean, 5.0) && close(s.std, 2.0) && close(s.p90, 7.6) && close(s.median, 4.5), "{s:?}");

        let s = Stats::of(&[3.0]).unwrap();
        assert_eq!((s.median, s.p99, s.std), (3.0, 3.0, 0.0));
        assert!(Stats::of(&[]).is_none());
    }

    fn record(ttft_s: f64, e2e_s: f64, usage_tokens: u64, itl_s: Vec<f64>, error: Option<&str>) -> RequestRecord {
        let out = Outcome {
            error: error.map(str::to_string),
            text: String::new(),
            ttft: Some(ttft_s),
            itl: itl_s,
            e2e: e2e_s,
            usage_prompt_tokens: Some(11),
            usage_completion_tokens: Some(usage_tokens),
        };
        let req = BenchRequest { prompt: "p".into(), prompt_len: 10, output_len: 5 };
        // A tokenizer is only needed without usage; an empty BPE stands in.
        let tokens = Tokens::new(tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default()));
        RequestRecord::new(0, 0.0, &req, out, &tokens).unwrap()
    }

    #[test]
    fn tpot_throughput_and_goodput() {
        // TPOT = (e2e - ttft) / (n - 1): (1.0 - 0.2) / 4 = 0.2 s; (2.0 - 0.5) / 3 = 0.5 s.
        let a = record(0.2, 1.0, 5, vec![0.1, 0.3], None);
        let b = record(0.5, 2.0, 4, vec![0.2], None);
        let one = record(0.1, 0.1, 1, vec![], None);
        let failed = record(0.1, 0.3, 9, vec![9.0], Some("HTTP 500"));
        assert!(close(a.tpot_ms.unwrap(), 200.0) && close(b.tpot_ms.unwrap(), 500.0));
        assert_eq!(one.tpot_ms, None);
        let records = [a, b, one, failed];
        let slo = Slo { ttft_ms: Some(300.0), tpot_ms: Some(250.0) };
        let s = summarize(&records, 4.0, slo);
        assert_eq!((s.completed, s.failed), (3, 1));
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (30, 10));
        assert!(close(s.request_throughput, 0.75) && close(s.output_throughput, 2.5));
        assert!(close(s.input_throughput, 7.5) && close(s.total_token_throughput, 10.0));
        // a meets both SLOs, b misses both, the one-token request has no TPOT and meets TTFT.
        assert_eq!(s.good_requests, Some(2));
        assert!(close(s.goodput.unwrap(), 0.5));
        // ITL pools the gaps of completed requests only: 100, 300, 200 ms.
        let itl = s.itl_ms.unwrap();
        assert_eq!(itl.count, 3);
        assert!(close(itl.mean, 200.0) && close(itl.max, 300.0));
        assert_eq!(s.tpot_ms.unwrap().count, 2);
        assert!(summarize(&records, 4.0, Slo::default()).goodput.is_none());
    }
}
