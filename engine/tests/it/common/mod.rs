//! Shared helpers: the default model (fetched by the test command) and fixtures.


use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tessera_engine::LoadedModel;
use tessera_kernels::linear::LinearPolicy;

/// Path of the default model (`$TESSERA_TEST_MODEL` when set, e.g. where test binaries run on
/// another machine); the README's test command fetches it first.
pub fn default_model_path() -> PathBuf {
    let p = std::env::var_os("TESSERA_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(p.exists(), "default model missing: run scripts/fetch-default-model.sh (the test command does)");
    p
}

/// A fixture file's path.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The default model with the default kernel policy, loaded once per test binary.
pub fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| LoadedModel::load(&default_model_path(), LinearPolicy::DEFAULT).unwrap())
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
