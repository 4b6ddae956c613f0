//! Calibration text the model writes itself (`--calibration-sampled`), for calibrated
//! quantization without any text (LLM-QAT's data-free calibration, Liu et al. 2023): each
//! sequence opens with one vocabulary token drawn at random (after BOS where the model's
//! inputs start with it), then the model samples the rest at temperature 1 on the serving
//! engine, past EOS, to full length. The text follows the model's own distribution rather
//! than one genre's, for models whose traffic the built-in English prose
//! ([`super::calibrate::BUILTIN_TEXT`], the default) does not resemble. The sampling is not
//! truncated: a small model's temperature-1 text drifts into noise, yet on SmolLM2-135M it
//! calibrated W4A16 better than coherent min-p 0.05 samples did (+14.2-14.6% against +22.7%
//! perplexity on held-out prose, both with GPTQ's usual 1% damping); the built-in text does
//! better again on prose (docs/benchmarks/quantized-quality.md).

use super::QuantizeError;
use crate::sample::SamplingParams;
use crate::serve::{Engine, EngineConfig, Event, GenRequest};
use crate::LoadedModel;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// `count` sequences of `seq_len` tokens sampled by `model` (see the module), reproducible
/// from `seed`; `progress(done, total)` sees the tokens sampled so far.
pub fn sample_sequences(model: Arc<LoadedModel>, count: usize, seq_len: usize, seed: u64, progress: &dyn Fn(usize, usize)) -> Result<Vec<Vec<u32>>, QuantizeError> {
    let failed = |e: String| QuantizeError::Usage(format!("sampling calibration text: {e}"));
    let special = model.tokenizer.special().clone();
    let bos = special.bos.filter(|_| special.add_bos);
    let vocab = model.model.config().vocab_size.min(model.tokenizer.vocab_size()) as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let prompts: Vec<Vec<u32>> = (0..count)
        .map(|_| {
            // A first token that is not one of the model's special tokens.
            let first = loop {
                let t = rng.gen_range(0..vocab);
                if model.tokenizer.is_special(t) {
                    continue;
                }
                break t;
            };
            bos.into_iter().chain([first]).collect()
        })
        .collect();
    let new_tokens = seq_len.checked_sub(prompts.first().map_or(0, Vec::len)).filter(|&n| n > 0).ok_or_else(|| failed(format!("sequences of {seq_len} tokens are too short")))?;
    let config = EngineConfig { max_num_seqs: count, prefix_caching: false, max_waiting: count, max_model_len: Some(seq_len), ..EngineConfig::default() }
        .with_pool_for(model.model.config(), count, seq_len);
    let engine = Engine::start(model, config).map_err(failed)?;
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let sampling = SamplingParams { temperature: 1.0, seed: Some(seed.wrapping_add(i as u64)), ..SamplingParams::default() };
            let mut r = GenRequest::new(format!("calibration-{i}"), p.clone(), sampling, new_tokens);
            r.min_tokens = new_tokens;
            r.ignore_eos = true;
            r
        })
        .collect();
    let result = collect(&engine, requests, count * seq_len, progress);
    engine.shutdown(std::time::Duration::ZERO);
    let generated = result.map_err(failed)?;
    Ok(prompts.into_iter().zip(generated).map(|(p, g)| p.into_iter().chain(g).collect()).collect())
}

/// Every request's sampled tokens, in order.
fn collect(engine: &Engine, requests: Vec<GenRequest>, total: usize, progress: &dyn Fn(usize, usize)) -> Result<Vec<Vec<u32>>, String> {
    let streams = engine.submit_all(requests).map_err(|e| e.to_string())?;
    let mut done = 0;
    let mut out = Vec::with_capacity(streams.len());
    for mut stream in streams {
        let mut tokens = Vec::new();
        while let Some(event) = stream.blocking_next() {
            match event {
                Event::Delta { tokens: t, .. } => {
                    done += t.len();
                    tokens.extend(t.iter().map(|t| t.id));
                    progress(done, total);
                }
                Event::Error(e) => return Err(e),
                Event::PromptLogprobs(_) | Event::Finished { .. } => {}
            }
        }
        out.push(tokens);
    }
    Ok(out)
}
