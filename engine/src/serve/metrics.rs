//! The engine's Prometheus metrics: vLLM's semantics under a `tessera_` prefix.

use crate::model::PlanEntry;
use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

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
            registry,
        })
    }

    /// Sets the KV-cache gauges.
    pub fn set_kv(&self, used: usize, total: usize) {
        self.kv_blocks_used.set(used as i64);
        self.kv_blocks_total.set(total as i64);
        self.kv_usage.set(if total == 0 { 0.0 } else { used as f64 / total as f64 });
    }
}
