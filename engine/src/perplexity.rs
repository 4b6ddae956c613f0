//! Perplexity with llama.cpp's `llama-perplexity` method, so figures compare number for number:
//! the token stream is cut into `ctx`-token windows (the first token replaced by BOS when the
//! model adds one), each window is evaluated from an empty cache, and only the second half is
//! scored (logits at position `j` predict token `j + 1`, for `ctx/2 <= j < ctx - 1`).
//! The error estimate is llama.cpp's: `ppl * sqrt((E[nll²] - E[nll]²) / (n - 1))`.
//!
//! The windows run through the serving engine ([`crate::serve::Engine`]) as prompt-scoring
//! requests, so perplexity measures the code path that serves, on any device and rank count.

use crate::device::Device;
use crate::kv_cache::KvRequest;
use crate::serve::{Engine, EngineConfig, Event, GenRequest};
use crate::sample::SamplingParams;
use crate::LoadedModel;
use std::sync::Arc;

/// Evaluation settings.
#[derive(Clone, Debug)]
pub struct PerplexityOptions {
    /// Window length in tokens.
    pub ctx: usize,
    /// Most windows to score (`None`: all that fit).
    pub chunks: Option<usize>,
    /// Windows evaluated together in one batched forward pass.
    pub seqs_per_batch: usize,
    /// Token that replaces each window's first token (the model's BOS when it adds one).
    pub bos: Option<u32>,
    /// KV-cache formats (auto: the checkpoint's scheme, else f32).
    pub kv: KvRequest,
    /// Seed of the KV formats' random state (QJL projections, HQMQ codebooks).
    pub kv_seed: u64,
    /// Where the forward passes run.
    pub device: Device,
}

impl PerplexityOptions {
    /// `ctx`-token windows, `seqs_per_batch` at a time, f32 cache on the CPU, no BOS.
    pub fn new(ctx: usize, seqs_per_batch: usize) -> Self {
        PerplexityOptions { ctx, chunks: None, seqs_per_batch, bos: None, kv: KvRequest::default(), kv_seed: 0, device: Device::Cpu }
    }

    /// The engine these windows run on: `seqs_per_batch` whole windows per step, no prefix
    /// cache (each window starts from an empty cache) and a pool that holds them.
    fn engine_config(&self, model: &LoadedModel, windows: usize) -> EngineConfig {
        let n_seq = self.seqs_per_batch.max(1);
        EngineConfig {
            max_num_seqs: n_seq,
            max_num_batched_tokens: n_seq * self.ctx + n_seq,
            prefix_caching: false,
            max_waiting: windows.max(1),
            max_model_len: Some(self.ctx),
            kv_dtype: self.kv,
            kv_seed: self.kv_seed,
            device: self.device,
            ..EngineConfig::default()
        }
        .with_pool_for(model.model.config(), n_seq, self.ctx)
    }
}

/// Accumulated result.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PerplexityReport {
    /// Windows scored.
    pub chunks: usize,
    /// Tokens scored.
    pub count: usize,
    /// Σ −log p.
    pub nll: f64,
    /// Σ (−log p)².
    pub nll2: f64,
}

impl PerplexityReport {
    /// `exp(mean nll)`.
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// llama.cpp's ± figure.
    pub fn stderr(&self) -> f64 {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        if var > 0.0 && n > 1.0 {
            (var / (n - 1.0)).sqrt() * self.ppl()
        } else {
            0.0
        }
    }
}

/// Windows available in `n_tokens` tokens.
pub fn available_chunks(n_tokens: usize, ctx: usize) -> usize {
    n_tokens / ctx.max(1)
}

/// Scores `tokens` on an engine started for the purpose; `on_chunk` sees the running report
/// after each window, in order.
pub fn perplexity(
    model: Arc<LoadedModel>,
    tokens: &[u32],
    opts: &PerplexityOptions,
    mut on_chunk: impl FnMut(&PerplexityReport),
) -> Result<PerplexityReport, String> {
    let ctx = opts.ctx;
    if ctx < 4 {
        return Err(format!("a perplexity window of {ctx} tokens is too short (at least 4)"));
    }
    let n_chunks = available_chunks(tokens.len(), ctx).min(opts.chunks.unwrap_or(usize::MAX));
    let config = opts.engine_config(&model, n_chunks);
    let engine = Engine::start(model, config)?;
    let result = score_windows(&engine, tokens, opts, n_chunks, &mut on_chunk);
    engine.shutdown(std::time::Duration::ZERO);
    result
}

/// Submits every window as a request that scores its second half, and sums the scores.
fn score_windows(
    engine: &Engine,
    tokens: &[u32],
    opts: &PerplexityOptions,
    n_chunks: usize,
    on_chunk: &mut impl FnMut(&PerplexityReport),
) -> Result<PerplexityReport, String> {
    let ctx = opts.ctx;
    let first = ctx / 2;
    let requests = (0..n_chunks).map(|i| {
        let mut window = tokens[i * ctx..(i + 1) * ctx].to_vec();
        if let Some(b) = opts.bos {
            window[0] = b;
        }
        let mut r = GenRequest::new(format!("ppl-{i}"), window, SamplingParams::greedy(), 0);
        r.prompt_logprobs = Some(0);
        r.score_from = first + 1;
        r
    });
    let streams = engine.submit_all(requests.collect()).map_err(|e| e.to_string())?;
    let mut report = PerplexityReport::default();
    for (i, mut stream) in streams.into_iter().enumerate() {
        let mut scored = None;
        while let Some(event) = stream.blocking_next() {
            match event {
                Event::PromptLogprobs(l) => scored = Some(l),
                Event::Error(e) => return Err(format!("window {i}: {e}")),
                Event::Delta { .. } | Event::Finished { .. } => {}
            }
        }
        let scored = scored.ok_or_else(|| format!("window {i}: the engine reported no prompt logprobs"))?;
        for t in &scored[first + 1..] {
            let nll = -(t.logprob.ok_or_else(|| format!("window {i}: a scored token has no logprob"))? as f64);
            report.nll += nll;
            report.nll2 += nll * nll;
            report.count += 1;
        }
        report.chunks += 1;
        on_chunk(&report);
    }
    Ok(report)
}
