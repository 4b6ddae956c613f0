//! Single-sequence generation (the `tessera generate` command): chunked prefill, then one
//! token per step with streaming, UTF-8-safe text output and timing.

use crate::model::{ForwardError, LlamaModel, SeqInput};
use crate::sample::{Sampled, Sampler};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use std::time::Instant;

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token (EOS or a requested stop id) was sampled.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The model's context is full.
    Context,
}

/// Limits and stop conditions.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token ids that end generation (not included in the text).
    pub stop_ids: Vec<u32>,
    /// Prompt tokens per prefill forward pass.
    pub prefill_chunk: usize,
    /// KV-cache storage (`None`: the compute type, f32).
    pub kv: Option<std::sync::Arc<crate::kv_cache::KvLayout>>,
}

/// The result of a generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated text (stop token excluded).
    pub text: String,
    /// Every sampled token, the stop token included.
    pub tokens: Vec<Sampled>,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Why it stopped.
    pub finish: FinishReason,
    /// Seconds spent in prefill (prompt forward passes).
    pub prefill_secs: f64,
    /// Seconds spent generating after the first token.
    pub decode_secs: f64,
}

/// Generates from `prompt` with the CPU model, calling `on_text` with each new piece of text.
pub fn generate(
    model: &LlamaModel,
    tok: &Tokenizer,
    prompt: &[u32],
    sampler: Sampler,
    opts: &GenerateOptions,
    on_text: impl FnMut(&str),
) -> Result<Generation, ForwardError> {
    let cfg = model.config();
    let mut kv = match &opts.kv {
        Some(layout) => crate::kv_cache::LocalKv::new(layout.clone(), cfg.max_position_embeddings),
        None => model.local_kv(cfg.max_position_embeddings),
    };
    let step = |tokens: &[u32], logits_from: Option<usize>| {
        let mut batch = [SeqInput { tokens, kv: &mut kv, logits_from }];
        Ok(model.forward(&mut batch)?.swap_remove(0))
    };
    generate_with(step, cfg.max_position_embeddings, tok, prompt, sampler, opts, on_text)
}

/// Generation over any forward pass: `step(tokens, logits_from)` appends `tokens` to the one
/// sequence and returns the logits of tokens `logits_from..` (none for `None`); `context` is
/// the most tokens the sequence may hold.
pub fn generate_with<E>(
    mut step: impl FnMut(&[u32], Option<usize>) -> Result<Vec<f32>, E>,
    context: usize,
    tok: &Tokenizer,
    prompt: &[u32],
    mut sampler: Sampler,
    opts: &GenerateOptions,
    mut on_text: impl FnMut(&str),
) -> Result<Generation, E> {
    let mut decoder = IncrementalDecoder::new();
    let mut out = Generation {
        text: String::new(),
        tokens: Vec::new(),
        prompt_tokens: prompt.len(),
        finish: FinishReason::Length,
        prefill_secs: 0.0,
        decode_secs: 0.0,
    };
    if prompt.is_empty() || opts.max_tokens == 0 {
        return Ok(out);
    }
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let chunks: Vec<&[u32]> = prompt.chunks(opts.prefill_chunk.max(1)).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        logits = step(chunk, last.then(|| chunk.len() - 1))?;
    }
    out.prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    loop {
        let s = sampler.sample(&logits);
        let id = s.id;
        out.tokens.push(s);
        if opts.stop_ids.contains(&id) {
            out.finish = FinishReason::Stop;
            break;
        }
        let piece = decoder.push(tok, id);
        out.text.push_str(&piece);
        on_text(&piece);
        if out.tokens.len() >= opts.max_tokens {
            break;
        }
        if prompt.len() + out.tokens.len() >= context {
            out.finish = FinishReason::Context;
            break;
        }
        logits = step(std::slice::from_ref(&id), Some(0))?;
    }
    let rest = decoder.flush(tok);
    out.text.push_str(&rest);
    on_text(&rest);
    out.decode_secs = t1.elapsed().as_secs_f64();
    Ok(out)
}
