//! Perplexity with llama.cpp's `llama-perplexity` method, so figures compare number for number:
//! the token stream is cut into `ctx`-token windows (the first token replaced by BOS when the
//! model adds one), each window is evaluated from an empty cache, and only the second half is
//! scored (logits at position `j` predict token `j + 1`, for `ctx/2 <= j < ctx - 1`).
//! The error estimate is llama.cpp's: `ppl * sqrt((E[nll²] - E[nll]²) / (n - 1))`.

use crate::kv_cache::{KvLayout, LocalKv};
use std::sync::Arc;
use crate::model::{ForwardError, LlamaModel, SeqInput};
use crate::sample::logsumexp;

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
    /// KV-cache storage (`None`: the compute type, f32).
    pub kv: Option<Arc<KvLayout>>,
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

/// Scores `tokens`; `on_chunk` sees the running report after each window.
pub fn perplexity(
    model: &LlamaModel,
    tokens: &[u32],
    opts: &PerplexityOptions,
    mut on_chunk: impl FnMut(&PerplexityReport),
) -> Result<PerplexityReport, ForwardError> {
    let ctx = opts.ctx;
    let first = ctx / 2;
    let n_chunks = available_chunks(tokens.len(), ctx).min(opts.chunks.unwrap_or(usize::MAX));
    let cfg = model.config();
    let vocab = cfg.vocab_size;
    let mut report = PerplexityReport::default();
    let per_batch = opts.seqs_per_batch.max(1);
    let mut chunk = 0;
    while chunk < n_chunks {
        let n_seq = per_batch.min(n_chunks - chunk);
        let windows: Vec<Vec<u32>> = (chunk..chunk + n_seq)
            .map(|i| {
                let mut w = tokens[i * ctx..(i + 1) * ctx].to_vec();
                if let Some(b) = opts.bos {
                    w[0] = b;
                }
                w
            })
            .collect();
        let mut caches: Vec<LocalKv> = (0..n_seq)
            .map(|_| match &opts.kv {
                Some(layout) => LocalKv::new(layout.clone(), ctx),
                None => model.local_kv(ctx),
            })
            .collect();
        let mut batch: Vec<SeqInput<'_>> = windows
            .iter()
            .zip(caches.iter_mut())
            .map(|(w, kv)| SeqInput { tokens: w, kv, logits_from: Some(first) })
            .collect();
        let logits = model.forward(&mut batch)?;
        for (k, rows) in logits.iter().enumerate() {
            let start = (chunk + k) * ctx;
            for j in first..ctx - 1 {
                let row = &rows[(j - first) * vocab..(j - first + 1) * vocab];
                let target = tokens[start + j + 1] as usize;
                let nll = -((row[target] as f64 - logsumexp(row)) as f32 as f64);
                report.nll += nll;
                report.nll2 += nll * nll;
                report.count += 1;
            }
            report.chunks += 1;
            on_chunk(&report);
        }
        chunk += n_seq;
    }
    Ok(report)
}
