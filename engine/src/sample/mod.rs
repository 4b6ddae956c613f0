//! Sampling: penalties, temperature, top-k / top-p / min-p filtering, seeded draws and
//! logprobs.
//!
//! Order (as vLLM): penalties on the raw logits, then temperature, then top-k, top-p and
//! min-p, then a draw from the renormalised distribution. Logprobs are reported from the
//! model's raw distribution (before penalties and temperature), the default of vLLM's
//! `--logprobs-mode raw_logprobs`. Each request owns its RNG, seeded from its seed, so a
//! result does not depend on what else is in the batch.

mod params;

pub use params::SamplingParams;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// A chosen token and what was asked about it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// Token id.
    pub id: u32,
    /// Its log-probability under the raw distribution (always computed; cheap).
    pub logprob: f32,
    /// Top alternatives `(id, logprob)`, most likely first, when logprobs were asked for.
    pub top: Vec<(u32, f32)>,
}

/// Per-request sampler state: parameters, RNG and output token counts for penalties.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    seen: HashMap<u32, u32>,
    output_counts: HashMap<u32, u32>,
}

/// `log_softmax(logits)[i]` for every i, in f64 for the normaliser.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// The `n` largest entries `(index, value)`, largest first (ties: lower index first).
pub fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    let n = n.min(values.len());
    if n == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| values[*b as usize].total_cmp(&values[*a as usize]).then(a.cmp(b));
    idx.select_nth_unstable_by(n - 1, cmp);
    idx.truncate(n);
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, values[i as usize])).collect()
}

impl Sampler {
    /// A sampler for one sequence; `prompt` tokens count for the repetition penalty.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let mut seen = HashMap::new();
        for &t in prompt {
            *seen.entry(t).or_insert(0) += 1;
        }
        Sampler { params, rng: ChaCha8Rng::seed_from_u64(seed), seen, output_counts: HashMap::new() }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits` (one vocabulary row) and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let raw = log_softmax(logits);
        let mut l = logits.to_vec();
        self.apply_penalties(&mut l);
        let id = if self.params.temperature == 0.0 { argmax(&l) } else { self.draw(&mut l) };
        let top = self.params.logprobs.map(|n| top_n(&raw, n)).unwrap_or_default();
        *self.seen.entry(id).or_insert(0) += 1;
        *self.output_counts.entry(id).or_insert(0) += 1;
        Sampled { id, logprob: raw[id as usize], top }
    }

    fn apply_penalties(&self, l: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                let v = &mut l[t as usize];
                *v = if *v > 0.0 { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.output_counts {
                l[t as usize] -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }

    /// Temperature, filters, then a draw.
    fn draw(&mut self, l: &mut [f32]) -> u32 {
        let p = &self.params;
        // Candidates sorted by logit, most likely first; top-k bounds the sort.
        let k = if p.top_k > 0 { p.top_k.min(l.len()) } else { l.len() };
        let mut cand = top_n(l, k);
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|&(_, v)| (((v - max) / p.temperature) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &x) in probs.iter().enumerate() {
                cum += x;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&x| x >= floor).count().max(1));
        }
        cand.truncate(keep);
        probs.truncate(keep);
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.gen::<f64>() * total;
        for (&(id, _), &x) in cand.iter().zip(&probs) {
            if u < x {
                return id;
            }
            u -= x;
        }
        cand[keep - 1].0
    }
}

/// Index of the largest logit (lowest index on ties).
pub fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}
