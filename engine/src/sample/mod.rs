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

use crate::structured::TokenSet;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

/// A chosen token and what was asked about it.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// Token id.
    pub id: u32,
    /// Its log-probability under the raw distribution, when logprobs were asked for (the
    /// normaliser costs a pass over the vocabulary, so it is skipped otherwise).
    pub logprob: Option<f32>,
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

/// `log Σ exp(logits)`, in f64 (one pass, no allocation); `logits[i] - lse` is a logprob.
pub fn logsumexp(logits: &[f32]) -> f64 {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    max as f64 + sum.ln()
}

/// `log_softmax(logits)[i]` for every i.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let lse = logsumexp(logits);
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
        self.sample_within(logits, &[], None)
    }

    /// As [`Sampler::sample`], but never picks a `banned` id (e.g. EOS before `min_tokens`)
    /// and, with `allowed` (a structured output's mask), only an allowed one; logprobs still
    /// come from the unmodified distribution.
    pub fn sample_within(&mut self, logits: &[f32], banned: &[u32], allowed: Option<&TokenSet>) -> Sampled {
        let p = &self.params;
        let plain = p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 && banned.is_empty();
        let greedy = plain && p.temperature == 0.0;
        let id = match allowed {
            // The common greedy case needs no copy, nor does a masked one whose argmax is allowed
            // (the first maximum overall is the first among the allowed).
            None if greedy => argmax(logits),
            Some(mask) if greedy && mask.is_allowed(argmax(logits)) => argmax(logits),
            _ => {
                let mut l = logits.to_vec();
                self.apply_penalties(&mut l);
                for &b in banned {
                    if let Some(v) = l.get_mut(b as usize) {
                        *v = f32::NEG_INFINITY;
                    }
                }
                if let Some(mask) = allowed {
                    apply_mask(&mut l, mask);
                }
                if self.params.temperature == 0.0 {
                    argmax(&l)
                } else {
                    self.draw(&mut l)
                }
            }
        };
        let lse = self.params.logprobs.map(|_| logsumexp(logits));
        let logprob = |l: f32| lse.map(|lse| (l as f64 - lse) as f32);
        // log_softmax is monotonic: the top logits are the top logprobs, in the same order.
        let top = self.params.logprobs.map(|n| top_n(logits, n).into_iter().filter_map(|(i, v)| Some((i, logprob(v)?))).collect()).unwrap_or_default();
        *self.seen.entry(id).or_insert(0) += 1;
        *self.output_counts.entry(id).or_insert(0) += 1;
        Sampled { id, logprob: logprob(logits[id as usize]), top }
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

    /// Temperature, filters, then a draw. Exact, but avoids sorting the vocabulary: with no
    /// filter it draws over all tokens directly; top-p sorts a growing prefix of candidates
    /// until it holds the required mass.
    fn draw(&mut self, l: &mut [f32]) -> u32 {
        let p = &self.params;
        let max = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let t = p.temperature;
        let weight = |x: f32| (((x - max) / t) as f64).exp();
        let v = l.len();
        let k = if p.top_k > 0 { p.top_k.min(v) } else { v };
        if k == v && p.top_p >= 1.0 && p.min_p <= 0.0 {
            let total: f64 = l.iter().map(|&x| weight(x)).sum();
            return self.pick(l.iter().enumerate().map(|(i, &x)| (i as u32, weight(x))), total).unwrap_or_else(|| argmax(l));
        }
        // Candidates by decreasing logit, with their unnormalised weights.
        let (cand, total) = if k < v {
            let c = top_n(l, k);
            let total = c.iter().map(|&(_, x)| weight(x)).sum();
            (c, total)
        } else {
            let total: f64 = l.iter().map(|&x| weight(x)).sum();
            let mut n = 64.min(v);
            loop {
                let c = top_n(l, n);
                let mass: f64 = c.iter().map(|&(_, x)| weight(x)).sum();
                if n == v || mass >= p.top_p as f64 * total {
                    break (c, total);
                }
                n = (n * 4).min(v);
            }
        };
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &(_, x)) in cand.iter().enumerate() {
                cum += weight(x) / total;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            // The top candidate has weight 1 (it is the max), so the floor is min_p itself.
            keep = keep.min(cand.iter().take_while(|&&(_, x)| weight(x) >= p.min_p as f64).count().max(1));
        }
        let kept = &cand[..keep];
        let mass: f64 = kept.iter().map(|&(_, x)| weight(x)).sum();
        self.pick(kept.iter().map(|&(i, x)| (i, weight(x))), mass).unwrap_or(kept[0].0)
    }

    /// Draws one id from `(id, weight)` pairs whose weights sum to `total`.
    fn pick(&mut self, items: impl Iterator<Item = (u32, f64)>, total: f64) -> Option<u32> {
        let mut u = self.rng.gen::<f64>() * total;
        let mut last = None;
        for (id, w) in items {
            if u < w {
                return Some(id);
            }
            u -= w;
            last = Some(id).filter(|_| w > 0.0).or(last);
        }
        last
    }
}

/// Sets every logit outside `mask` to -inf (ids past the mask's end too).
fn apply_mask(l: &mut [f32], mask: &TokenSet) {
    let words = mask.as_slice();
    for (i, chunk) in l.chunks_mut(32).enumerate() {
        let w = words.get(i).copied().unwrap_or(0);
        if w == u32::MAX {
            continue;
        }
        for (b, v) in chunk.iter_mut().enumerate() {
            if w >> b & 1 == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// Index of the largest logit (lowest index on ties; NaNs are skipped, and a leading NaN
/// gives 0, as a scan keeping the first strict maximum does).
///
/// Two passes: the maximum eight lanes at a time (the compiler vectorizes it), then its
/// first index. A one-pass scan compares against the best so far, a dependency chain that
/// cost ~50 µs per 49k-token vocabulary, serial on the engine thread once per sequence per
/// step.
pub fn argmax(l: &[f32]) -> u32 {
    let Some(&first) = l.first() else { return 0 };
    let mut lanes = [first; 8];
    let chunks = l.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            if v > *m {
                *m = v;
            }
        }
    }
    let max = lanes.iter().chain(tail).fold(first, |m, &v| if v > m { v } else { m });
    l.iter().position(|&v| v == max).unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        // Probabilities at T=1 ∝ e^l: a distinct order with a clear head and a long tail.
        let mut l: Vec<f32> = (0..50).map(|i| -0.1 * i as f32).collect();
        l[7] = 3.0;
        l[3] = 2.5;
        l[11] = 2.0;
        l
    }

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams { seed: Some(7), ..SamplingParams::default() };
        f(&mut p);
        p
    }

    fn draws(p: SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p, &[]);
        (0..n).map(|_| s.sample(&logits()).id).collect()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        assert_eq!(draws(SamplingParams::greedy(), 5), vec![7; 5]);
    }

    /// The two-pass argmax equals a one-pass scan keeping the first strict maximum, on random
    /// rows of every length up to 40 with ties, NaNs (leading ones too), infinities and
    /// signed zeros drawn from a small value set.
    #[test]
    fn argmax_equals_the_first_strict_maximum() {
        let scan = |l: &[f32]| (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32;
        let values = [f32::NAN, f32::NEG_INFINITY, -1.5, -0.0, 0.0, 2.0, 3.0, f32::INFINITY];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for n in 0..=40 {
            for _ in 0..200 {
                let l: Vec<f32> = (0..n)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        values[(state % values.len() as u64) as usize]
                    })
                    .collect();
                assert_eq!(argmax(&l), scan(&l), "{l:?}");
            }
        }
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let a = draws(params(|_| {}), 200);
        assert_eq!(a, draws(params(|_| {}), 200));
        assert_ne!(a, draws(params(|p| p.seed = Some(8)), 200));
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let d = draws(params(|p| p.top_k = 3), 3000);
        assert!(d.iter().all(|t| [7, 3, 11].contains(t)));
        assert!([7, 3, 11].iter().all(|t| d.contains(t)), "all three are drawn");
        assert!(draws(params(|p| (p.top_k, p.temperature) = (1, 5.0)), 100).iter().all(|&t| t == 7));
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let probs: Vec<f64> = log_softmax(&logits()).iter().map(|&l| (l as f64).exp()).collect();
        // Smallest head with mass >= top_p: the first two tokens here.
        let top_p = (probs[7] + probs[3] * 0.5) as f32;
        let d = draws(params(|p| p.top_p = top_p), 3000);
        assert!(d.iter().all(|t| [7, 3].contains(t)) && d.contains(&3));
        // min_p: keep tokens with p >= min_p * p_max; 0.5 keeps 7 (1.0) and 3 (e^-0.5 = 0.61), not 11 (0.37).
        let d = draws(params(|p| p.min_p = 0.5), 3000);
        assert!(d.iter().all(|t| [7, 3].contains(t)) && d.contains(&3));
    }

    /// Empirical frequencies follow softmax(l / T): within 4 standard errors per token.
    #[test]
    fn draws_follow_the_tempered_distribution() {
        let t = 0.7f32;
        let n = 20000;
        let scaled: Vec<f32> = logits().iter().map(|l| l / t).collect();
        let probs: Vec<f64> = log_softmax(&scaled).iter().map(|&l| (l as f64).exp()).collect();
        let d = draws(params(|p| p.temperature = t), n);
        for tok in [7u32, 3, 11, 0] {
            let p = probs[tok as usize];
            let f = d.iter().filter(|&&x| x == tok).count() as f64 / n as f64;
            let se = (p * (1.0 - p) / n as f64).sqrt();
            assert!((f - p).abs() < 4.0 * se + 1e-4, "token {tok}: frequency {f} vs probability {p}");
        }
    }

    #[test]
    fn penalties_change_the_choice() {
        // Repetition penalty on a prompt token: 7 (3.0 -> 1.5) falls below 3 (2.5).
        let mut s = Sampler::new(params(|p| (p.temperature, p.repetition_penalty) = (0.0, 2.0)), &[7]);
        assert_eq!(s.sample(&logits()).id, 3);
        // Presence penalty applies to output tokens only: first pick 7, then 3.
        let mut s = Sampler::new(params(|p| (p.temperature, p.presence_penalty) = (0.0, 1.0)), &[7]);
        assert_eq!((s.sample(&logits()).id, s.sample(&logits()).id), (7, 3));
        // Frequency penalty grows with the count: 7, 7 (3.0-0.4), then 3 (2.6 - 0.4 < 2.5).
        let mut s = Sampler::new(params(|p| (p.temperature, p.frequency_penalty) = (0.0, 0.4)), &[]);
        let ids: Vec<u32> = (0..3).map(|_| s.sample(&logits()).id).collect();
        assert_eq!(ids, vec![7, 7, 3]);
    }

    #[test]
    fn logprobs_only_when_asked() {
        let mut s = Sampler::new(params(|p| p.temperature = 0.0), &[]);
        assert_eq!(s.sample(&logits()).logprob, None);
    }

    #[test]
    fn banned_ids_are_never_drawn() {
        let mut s = Sampler::new(params(|p| p.temperature = 0.0), &[]);
        assert_eq!(s.sample_within(&logits(), &[7], None).id, 3);
        let mut s = Sampler::new(params(|p| p.top_k = 1), &[]);
        assert!((0..500).all(|_| s.sample_within(&logits(), &[7], None).id == 3), "the best non-banned token is the only top-1 candidate");
    }

    /// Greedy and random draws pick only allowed ids; logprobs stay raw.
    #[test]
    fn masked_draws_stay_inside_the_mask() {
        let mut mask = TokenSet::alloc(50);
        for id in [0, 11, 33, 49] {
            mask.allow_token(id);
        }
        let raw = log_softmax(&logits());
        let mut s = Sampler::new(params(|p| (p.temperature, p.logprobs) = (0.0, Some(1))), &[]);
        let out = s.sample_within(&logits(), &[], Some(&mask));
        assert_eq!((out.id, out.logprob, out.top[0].0), (11, Some(raw[11]), 7));
        let mut s = Sampler::new(params(|p| p.temperature = 1.5), &[]);
        let d: Vec<u32> = (0..2000).map(|_| s.sample_within(&logits(), &[11], Some(&mask)).id).collect();
        assert!(d.iter().all(|t| [0, 33, 49].contains(t)), "banned and masked ids are never drawn");
        assert!([0, 33, 49].iter().all(|t| d.contains(t)));
        // The unmasked argmax (7) is refused even when greedy.
        let mut all_but_7 = TokenSet::alloc(50);
        all_but_7.set_all(true);
        all_but_7.disallow_token(7);
        let mut s = Sampler::new(params(|p| p.temperature = 0.0), &[]);
        assert_eq!(s.sample_within(&logits(), &[], Some(&all_but_7)).id, 3);
    }

    #[test]
    fn logprobs_are_raw_and_sorted() {
        let raw = log_softmax(&logits());
        let mut s = Sampler::new(params(|p| (p.temperature, p.logprobs, p.repetition_penalty) = (0.0, Some(4), 2.0)), &[7]);
        let out = s.sample(&logits());
        assert_eq!(out.id, 3);
        assert_eq!(out.logprob, Some(raw[3]), "logprob from the raw distribution, before penalties");
        assert_eq!(out.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![7, 3, 11, 0]);
        assert!(out.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let total: f64 = raw.iter().map(|&l| (l as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn validation_names_the_parameter() {
        let bad = [
            params(|p| p.temperature = -1.0),
            params(|p| p.top_p = 0.0),
            params(|p| p.min_p = 1.5),
            params(|p| p.repetition_penalty = 0.0),
            params(|p| p.presence_penalty = 3.0),
            params(|p| p.logprobs = Some(21)),
            params(|p| p.temperature = f32::NAN),
        ];
        let names: Vec<&str> = bad.iter().map(|p| p.validate().unwrap_err().0).collect();
        assert_eq!(names, ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "logprobs", "temperature"]);
        assert!(SamplingParams::default().validate().is_ok());
    }
}
