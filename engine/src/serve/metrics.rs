//! The engine's Prometheus metrics: vLLM's semantics under a `tessera_` prefix.

use crate::model::PlanEntry;
use prometheus::proto::{LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use std::sync::Mutex;
use tessera_kernels::comm::CommStats;

/// Every metric the engine updates, registered in one registry.
pub struct Metrics {
    /// Where the metrics live (`/metrics` encodes it).
    pub registry: Registry,
    /// Time to first token, from arrival.
    pub ttft: Histogram,
    /// Gap between consecutive output tokens of a request.
    pub inter_token: Histogram,
    /// Per request: (e2e - ttft) / (output tokens - 1).
    pub tpot: Histogram,
    /// Arrival to finish.
    pub e2e: Histogram,
    /// Arrival to first admission.
    pub queue: Histogram,
    /// Requests in the running set.
    pub running: IntGauge,
    /// Requests waiting (new and preempted).
    pub waiting: IntGauge,
    /// Fraction of KV blocks in use.
    pub kv_usage: Gauge,
    /// KV blocks in use.
    pub kv_blocks_used: IntGauge,
    /// KV blocks in the pool.
    pub kv_blocks_total: IntGauge,

    /// Prompt tokens processed (computed or served from the prefix cache).
    pub prompt_tokens: IntCounter,
    /// Tokens generated.
    pub generation_tokens: IntCounter,
    /// Finished requests by finish reason.
    pub success: IntCounterVec,
    /// Sequences preempted for lack of KV blocks.
    pub preemptions: IntCounter,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: IntCounter,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: IntCounter,
    /// Sequences per engine step.
    pub batch_size: Histogram,
    /// Tokens per engine step.
    pub step_tokens: Histogram,
    /// Seconds of each step spent in the forward pass.
    pub step_forward: Histogram,
    /// Seconds of each step outside the forward pass (scheduling, sampling, detokenizing, sending).
    pub step_overhead: Histogram,
    /// Per tensor-parallel rank: seconds of each step spent in collectives.
    pub tp_collective: HistogramVec,
    /// Per tensor-parallel rank: bytes it contributed to collectives.
    pub tp_collective_bytes: IntCounterVec,
    /// Each rank's collective counters at the last step.
    last_comm: Mutex<Vec<CommStats>>,
}

/// Latency buckets (seconds) for TTFT / E2E / queue time.
const LATENCY: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0];
/// Buckets (seconds) for per-token latencies and step times.
const TOKEN: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5];
/// Buckets for counts per step.
const COUNT: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0];

impl Metrics {
    /// Creates and registers every metric; `info` labels become `tessera_model_info`, and the
    /// kernel plan becomes `tessera_quant_plan_layers` (layers per scheme, storage, activation
    /// handling and kernel); `kv_bytes_per_token` is the KV-cache format's cost per token.
    pub fn new(info: &[(&str, &str)], plan: &[PlanEntry], kv_bytes_per_token: f64) -> prometheus::Result<Self> {
        let registry = Registry::new();
        let hist = |name: &str, help: &str, buckets: &[f64]| -> prometheus::Result<Histogram> {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))?;
            registry.register(Box::new(h.clone()))?;
            Ok(h)
        };
        let gauge = |name: &str, help: &str| -> prometheus::Result<IntGauge> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let counter = |name: &str, help: &str| -> prometheus::Result<IntCounter> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let kv_usage = Gauge::new("tessera_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")?;
        registry.register(Box::new(kv_usage.clone()))?;
        let bytes_per_token = Gauge::new("tessera_kv_cache_bytes_per_token", "KV-cache bytes per token (all layers, keys and values) in the configured formats.")?;
        registry.register(Box::new(bytes_per_token.clone()))?;
        bytes_per_token.set(kv_bytes_per_token);
        let success = IntCounterVec::new(
            Opts::new("tessera_request_success_total", "Finished requests by finish reason."),
            &["finished_reason"],
        )?;
        registry.register(Box::new(success.clone()))?;
        // vLLM's swapped gauge, kept for dashboards: preemption recomputes, so it stays 0.
        gauge("tessera_num_requests_swapped", "Requests swapped out to host memory (preemption recomputes, so always 0).")?;
        let names: Vec<&str> = info.iter().map(|(k, _)| *k).collect();
        let model_info = IntGaugeVec::new(Opts::new("tessera_model_info", "The served model (value 1; labels describe it)."), &names)?;
        registry.register(Box::new(model_info.clone()))?;
        model_info.with_label_values(&info.iter().map(|(_, v)| *v).collect::<Vec<_>>()).set(1);
        let plan_layers = IntGaugeVec::new(
            Opts::new("tessera_quant_plan_layers", "Linear layers per weight scheme, storage, activation handling and kernel."),
            &["scheme", "storage", "activations", "kernel"],
        )?;
        registry.register(Box::new(plan_layers.clone()))?;
        for e in plan {
            plan_layers.with_label_values(&[&e.scheme, &e.storage, &e.activations, &e.kernel]).inc();
        }
        let tp_collective = HistogramVec::new(
            HistogramOpts::new("tessera_tp_collective_seconds", "Seconds of an engine step a tensor-parallel rank spent in collectives (all-reduce, logit gather).")
                .buckets(TOKEN.to_vec()),
            &["rank"],
        )?;
        registry.register(Box::new(tp_collective.clone()))?;
        let tp_collective_bytes = IntCounterVec::new(
            Opts::new("tessera_tp_collective_bytes_total", "Bytes a tensor-parallel rank contributed to collectives."),
            &["rank"],
        )?;
        registry.register(Box::new(tp_collective_bytes.clone()))?;
        // Rank 0's series exist from the start (zero without tensor parallelism), so dashboards
        // and alerts find them on every server.
        tp_collective.with_label_values(&["0"]);
        tp_collective_bytes.with_label_values(&["0"]);
        Ok(Metrics {
            ttft: hist("tessera_time_to_first_token_seconds", "Time from arrival to the first output token.", LATENCY)?,
            inter_token: hist("tessera_inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN)?,
            tpot: hist(
                "tessera_request_time_per_output_token_seconds",
                "Per request: (end-to-end - time to first token) / (output tokens - 1).",
                TOKEN,
            )?,
            e2e: hist("tessera_e2e_request_latency_seconds", "Time from arrival to the last output token.", LATENCY)?,
            queue: hist("tessera_request_queue_time_seconds", "Time from arrival to first scheduling.", LATENCY)?,
            running: gauge("tessera_num_requests_running", "Requests being processed (prefill or decode).")?,
            waiting: gauge("tessera_num_requests_waiting", "Requests waiting to be scheduled (new and preempted).")?,
            kv_usage,
            kv_blocks_used: gauge("tessera_kv_cache_blocks_used", "KV-cache blocks referenced by requests.")?,
            kv_blocks_total: gauge("tessera_kv_cache_num_blocks", "KV-cache blocks in the pool.")?,
            prompt_tokens: counter("tessera_prompt_tokens_total", "Prompt tokens processed.")?,
            generation_tokens: counter("tessera_generation_tokens_total", "Tokens generated.")?,
            success,
            preemptions: counter("tessera_num_preemptions_total", "Sequences preempted (to be recomputed) for lack of KV blocks.")?,
            prefix_queries: counter("tessera_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")?,
            prefix_hits: counter("tessera_prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")?,
            batch_size: hist("tessera_iteration_batch_size", "Sequences per engine step.", COUNT)?,
            step_tokens: hist("tessera_iteration_tokens", "Tokens (prefill and decode) per engine step.", COUNT)?,
            step_forward: hist("tessera_step_forward_seconds", "Seconds of an engine step spent in the forward pass.", TOKEN)?,
            step_overhead: hist(
                "tessera_step_overhead_seconds",
                "Seconds of an engine step outside the forward pass (scheduling, sampling, detokenizing, streaming).",
                TOKEN,
            )?,
            tp_collective,
            tp_collective_bytes,
            last_comm: Mutex::new(Vec::new()),
            registry,
        })
    }

    /// Records one step's collectives from each rank's running counters (`stats[r]`, rank
    /// order; empty without tensor parallelism).
    pub fn observe_collectives(&self, stats: &[CommStats]) {
        let mut last = self.last_comm.lock().unwrap_or_else(|e| e.into_inner());
        last.resize(stats.len(), CommStats::default());
        for (r, (now, before)) in stats.iter().zip(last.iter_mut()).enumerate() {
            let rank = r.to_string();
            self.tp_collective.with_label_values(&[&rank]).observe(now.nanos.saturating_sub(before.nanos) as f64 * 1e-9);
            self.tp_collective_bytes.with_label_values(&[&rank]).inc_by(now.bytes.saturating_sub(before.bytes));
            *before = *now;
        }
    }

    /// Sets the KV-cache gauges.
    pub fn set_kv(&self, used: usize, total: usize) {
        self.kv_blocks_used.set(used as i64);
        self.kv_blocks_total.set(total as i64);
        self.kv_usage.set(if total == 0 { 0.0 } else { used as f64 / total as f64 });
    }
}

/// vLLM's metric names for Tessera's own, one to one: the value, type, buckets and
/// `finished_reason` labels are the same series, re-exported under `vllm:` with vLLM's
/// `model_name` label, so routers (GIE's endpoint picker, vllm-router, SGLang's gateway) and
/// dashboards written for vLLM read Tessera unchanged. Tessera's `tessera_` counters and vLLM's
/// `vllm:` counters count the same things (prefix-cache queries and hits are prompt tokens in
/// both; preemption in both recomputes).
pub const VLLM_ALIASES: &[(&str, &str)] = &[
    ("tessera_num_requests_running", "vllm:num_requests_running"),
    ("tessera_num_requests_waiting", "vllm:num_requests_waiting"),
    ("tessera_kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    ("tessera_prompt_tokens_total", "vllm:prompt_tokens_total"),
    ("tessera_generation_tokens_total", "vllm:generation_tokens_total"),
    ("tessera_request_success_total", "vllm:request_success_total"),
    ("tessera_num_preemptions_total", "vllm:num_preemptions_total"),
    ("tessera_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    ("tessera_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    ("tessera_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    ("tessera_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
    ("tessera_request_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds"),
    ("tessera_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    ("tessera_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    ("tessera_iteration_tokens", "vllm:iteration_tokens_total"),
];

/// The `vllm:` families for `families` (Tessera's gathered registry): every family named in
/// [`VLLM_ALIASES`] under its vLLM name with a `model_name` label (the served model name), plus
/// `vllm:cache_config_info` (value 1; labels `block_size` and `num_gpu_blocks`, which GIE's
/// prefix-cache scorer reads) from `block_size` and the pool's block count.
pub fn vllm_families(families: &[MetricFamily], model_name: &str, block_size: usize) -> Vec<MetricFamily> {
    let label = |name: &str, value: &str| {
        let mut l = LabelPair::default();
        l.set_name(name.to_owned());
        l.set_value(value.to_owned());
        l
    };
    let mut out = Vec::new();
    let mut num_blocks = None;
    for family in families {
        if family.get_name() == "tessera_kv_cache_num_blocks" {
            num_blocks = family.get_metric().first().map(|m| m.get_gauge().get_value());
        }
        let Some((_, vllm)) = VLLM_ALIASES.iter().find(|(t, _)| *t == family.get_name()) else { continue };
        let mut f = family.clone();
        f.set_name((*vllm).to_owned());
        f.set_help(format!("{} (vLLM's name for {}).", family.get_help().trim_end_matches('.'), family.get_name()));
        for m in f.mut_metric().iter_mut() {
            let mut labels: Vec<LabelPair> = m.take_label().into_iter().collect();
            labels.push(label("model_name", model_name));
            labels.sort_by(|a, b| a.get_name().cmp(b.get_name()));
            m.set_label(labels);
        }
        out.push(f);
    }
    let mut info = MetricFamily::default();
    info.set_name("vllm:cache_config_info".to_owned());
    info.set_help("Information of the KV-cache configuration (value 1; labels describe it).".to_owned());
    info.set_field_type(MetricType::GAUGE);
    let mut m = Metric::default();
    let mut g = prometheus::proto::Gauge::default();
    g.set_value(1.0);
    m.set_gauge(g);
    let blocks = num_blocks.map(|b| format!("{b}")).unwrap_or_default();
    m.set_label(vec![label("block_size", &block_size.to_string()), label("model_name", model_name), label("num_gpu_blocks", &blocks)]);
    info.mut_metric().push(m);
    out.push(info);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_aliases_carry_values_labels_and_cache_info() {
        let m = Metrics::new(&[("model", "m")], &[], 1.0).unwrap();
        m.set_kv(3, 12);
        m.waiting.set(5);
        m.success.with_label_values(&["stop"]).inc_by(2);
        m.ttft.observe(0.02);
        let fams = m.registry.gather();
        let v = vllm_families(&fams, "served", 16);
        let get = |n: &str| v.iter().find(|f| f.get_name() == n).unwrap_or_else(|| panic!("{n} missing"));
        assert_eq!(v.len(), VLLM_ALIASES.len() + 1, "every alias has a tessera source");
        let w = get("vllm:num_requests_waiting");
        assert_eq!(w.get_metric()[0].get_gauge().get_value(), 5.0);
        assert_eq!(w.get_metric()[0].get_label()[0].get_name(), "model_name");
        assert_eq!(w.get_metric()[0].get_label()[0].get_value(), "served");
        assert_eq!(get("vllm:kv_cache_usage_perc").get_metric()[0].get_gauge().get_value(), 0.25);
        let s = &get("vllm:request_success_total").get_metric()[0];
        assert_eq!(s.get_counter().get_value(), 2.0);
        let names: Vec<&str> = s.get_label().iter().map(|l| l.get_name()).collect();
        assert_eq!(names, ["finished_reason", "model_name"]);
        assert_eq!(get("vllm:time_to_first_token_seconds").get_metric()[0].get_histogram().get_sample_count(), 1);
        let info = &get("vllm:cache_config_info").get_metric()[0];
        let labels: Vec<(&str, &str)> = info.get_label().iter().map(|l| (l.get_name(), l.get_value())).collect();
        assert_eq!(labels, [("block_size", "16"), ("model_name", "served"), ("num_gpu_blocks", "12")]);
        assert_eq!(info.get_gauge().get_value(), 1.0);
        // The text encoder accepts the colon names.
        let mut buf = Vec::new();
        prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &v, &mut buf).unwrap();
        assert!(String::from_utf8(buf).unwrap().contains("vllm:num_requests_waiting{model_name=\"served\"} 5"));
    }
}
