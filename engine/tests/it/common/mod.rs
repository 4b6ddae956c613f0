//! Shared helpers: the default model (fetched by the test command) and fixtures.


use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use tessera_engine::kv_cache::LocalKv;
use tessera_engine::model::{LlamaModel, SeqInput};
use tessera_engine::sample::{SamplingParams, Sampler};
use tessera_engine::LoadedModel;
use tessera_kernels::linear::LinearPolicy;

pub use tessera_engine::default_model::for_tests as default_model_path;

/// A fixture file's path.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The default model with the default kernel policy, loaded once per test binary.
pub fn model() -> &'static Arc<LoadedModel> {
    static M: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    M.get_or_init(|| Arc::new(LoadedModel::load(&default_model_path(), LinearPolicy::DEFAULT).unwrap()))
}

/// An independent reference for the engine: `n` greedy tokens after `prompt` for one
/// sequence in a contiguous cache of its own (`kv`), the prompt prefilled in chunks of 512
/// tokens, then one token per forward pass.
pub fn greedy_reference(m: &LlamaModel, mut kv: LocalKv, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut sampler = Sampler::new(SamplingParams::greedy(), prompt);
    let mut logits = Vec::new();
    for chunk in prompt.chunks(512) {
        logits = m.forward(&mut [SeqInput { tokens: chunk, kv: &mut kv, logits_from: Some(chunk.len() - 1) }]).unwrap().swap_remove(0);
    }
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n {
        let id = sampler.sample(&logits).id;
        ids.push(id);
        logits = m.forward(&mut [SeqInput { tokens: &[id], kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0);
    }
    ids
}

/// The default model with a given policy (separate instance).
pub fn model_with(policy: LinearPolicy) -> LoadedModel {
    LoadedModel::load(&default_model_path(), policy).unwrap()
}

/// Largest `max |a - b| / spread(b)` over the logit rows of a sequence.
pub fn max_rel_err(a: &[f32], b: &[f32], vocab: usize) -> f32 {
    a.chunks(vocab)
        .zip(b.chunks(vocab))
        .map(|(ra, rb)| {
            let spread = rb.iter().cloned().fold(f32::MIN, f32::max) - rb.iter().cloned().fold(f32::MAX, f32::min);
            ra.iter().zip(rb).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / spread
        })
        .fold(0.0, f32::max)
}

/// Log-softmax of each `vocab`-wide row of `logits`, in f64.
pub fn log_softmax_rows(logits: &[f32], vocab: usize) -> Vec<Vec<f64>> {
    logits
        .chunks(vocab)
        .map(|row| {
            let max = row.iter().cloned().fold(f32::MIN, f32::max);
            let lse = f64::from(max) + row.iter().map(|&x| f64::from(x - max).exp()).sum::<f64>().ln();
            row.iter().map(|&x| f64::from(x) - lse).collect()
        })
        .collect()
}

/// Mean KL(p || q) per row of log-probabilities.
pub fn mean_kl(p: &[Vec<f64>], q: &[Vec<f64>]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a.iter().zip(b).map(|(x, y)| x.exp() * (x - y)).sum::<f64>()).sum::<f64>() / p.len() as f64
}
