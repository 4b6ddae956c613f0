//! Mixture-of-experts routing: router logits to each token's chosen experts and weights, for
//! the three families Tessera runs (checkpoint-formats.md §1.2):
//!
//! - softmax (Mixtral, Qwen2-MoE, Qwen3-MoE): softmax over all experts, top-k, optional
//!   renormalization of the k weights;
//! - sigmoid (DeepSeek-V3, Kimi-K2 `noaux_tc`): `s = sigmoid(logit)`, choice by `s + bias`
//!   (the correction bias only chooses), group-limited (a group scores the sum of its best two
//!   biased scores; the best `topk_group` groups stay), weights are the unbiased `s`, optionally
//!   renormalized, times `routed_scaling_factor`.
//!
//! Ties go to the lower expert (and group) index, so routing is deterministic. Inference is
//! dropless: every token gets exactly `top_k` experts, whatever the other tokens chose.

use crate::checkpoint::routing::{Routing, Scoring};

impl Routing {
    /// Routes one token: `logits` (`n_experts`), optional correction `bias` (`n_experts`);
    /// writes the chosen experts in descending order of choice score into `ids` and their
    /// weights into `weights` (both `top_k`).
    pub fn route(&self, logits: &[f32], bias: Option<&[f32]>, ids: &mut [u32], weights: &mut [f32]) {
        let n = self.n_experts;
        debug_assert!(logits.len() == n && ids.len() == self.top_k && weights.len() == self.top_k);
        let mut score = vec![0f32; n];
        match self.scoring {
            Scoring::Softmax => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for (s, &l) in score.iter_mut().zip(logits) {
                    *s = (l - max).exp();
                    sum += *s;
                }
                score.iter_mut().for_each(|s| *s /= sum);
            }
            Scoring::Sigmoid => score.iter_mut().zip(logits).for_each(|(s, &l)| *s = 1.0 / (1.0 + (-l).exp())),
        }
        let choice: Vec<f32> = match bias {
            Some(b) => score.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => score.clone(),
        };
        let mut allowed = vec![true; n];
        if self.topk_group < self.n_group {
            let size = n / self.n_group;
            let group_score = |g: usize| {
                let best = top_indices(&choice[g * size..(g + 1) * size], None, 2.min(size));
                best.iter().map(|&i| choice[g * size + i]).sum::<f32>()
            };
            let scores: Vec<f32> = (0..self.n_group).map(group_score).collect();
            let keep = top_indices(&scores, None, self.topk_group);
            for (e, a) in allowed.iter_mut().enumerate() {
                *a = keep.contains(&(e / size));
            }
        }
        let chosen = top_indices(&choice, Some(&allowed), self.top_k);
        let sum: f32 = chosen.iter().map(|&e| score[e]).sum();
        let norm = if self.norm_topk { self.scaling / (sum + 1e-20) } else { self.scaling };
        for ((id, w), &e) in ids.iter_mut().zip(weights.iter_mut()).zip(&chosen) {
            *id = e as u32;
            *w = score[e] * norm;
        }
    }
}

/// Indices of the `k` largest values among the allowed ones, largest first, ties to the lower
/// index. NaN sorts below every number.
fn top_indices(v: &[f32], allowed: Option<&[bool]>, k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).filter(|&i| allowed.is_none_or(|a| a[i])).collect();
    let key = |i: usize| if v[i].is_nan() { f32::NEG_INFINITY } else { v[i] };
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn rule(scoring: Scoring, n: usize, k: usize, groups: (usize, usize), norm: bool, scaling: f32) -> Routing {
        Routing { scoring, n_experts: n, top_k: k, norm_topk: norm, n_group: groups.0, topk_group: groups.1, scaling }
    }

    fn run(r: &Routing, logits: &[f32], bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
        let (mut ids, mut w) = (vec![0; r.top_k], vec![0.0; r.top_k]);
        r.route(logits, bias, &mut ids, &mut w);
        (ids, w)
    }

    /// The rule written out the slow way: exhaustive search over expert subsets for the
    /// allowed set of largest biased score sum, f64 throughout.
    fn reference(r: &Routing, logits: &[f32], bias: Option<&[f32]>) -> (Vec<u32>, Vec<f64>) {
        let n = r.n_experts;
        let s: Vec<f64> = match r.scoring {
            Scoring::Softmax => {
                let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
                logits.iter().map(|&l| (l as f64).exp() / z).collect()
            }
            Scoring::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-(l as f64)).exp())).collect(),
        };
        let c: Vec<f64> = (0..n).map(|e| s[e] + bias.map_or(0.0, |b| b[e] as f64)).collect();
        let size = n / r.n_group;
        // Group score: the two best biased scores of the group (one if the group has one expert).
        let gscore: Vec<f64> = (0..r.n_group)
            .map(|g| {
                let mut v: Vec<f64> = c[g * size..(g + 1) * size].to_vec();
                v.sort_by(|a, b| b.partial_cmp(a).unwrap());
                v.iter().take(2).sum()
            })
            .collect();
        let mut order: Vec<usize> = (0..r.n_group).collect();
        order.sort_by(|&a, &b| gscore[b].partial_cmp(&gscore[a]).unwrap().then(a.cmp(&b)));
        let kept = &order[..r.topk_group];
        let mut cand: Vec<usize> = (0..n).filter(|e| kept.contains(&(e / size))).collect();
        cand.sort_by(|&a, &b| c[b].partial_cmp(&c[a]).unwrap().then(a.cmp(&b)));
        let chosen = &cand[..r.top_k];
        let sum: f64 = chosen.iter().map(|&e| s[e]).sum();
        let w = chosen.iter().map(|&e| s[e] * if r.norm_topk { r.scaling as f64 / sum } else { r.scaling as f64 }).collect();
        (chosen.iter().map(|&e| e as u32).collect(), w)
    }

    #[test]
    fn matches_the_reference_on_random_logits() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let rules = [
            rule(Scoring::Softmax, 8, 2, (1, 1), true, 1.0),
            rule(Scoring::Softmax, 60, 4, (1, 1), false, 1.0),
            rule(Scoring::Softmax, 8, 8, (1, 1), true, 1.0),
            rule(Scoring::Sigmoid, 16, 4, (4, 2), true, 2.5),
            rule(Scoring::Sigmoid, 8, 2, (8, 3), false, 1.0),
            rule(Scoring::Sigmoid, 12, 3, (3, 3), true, 1.0),
        ];
        for r in &rules {
            r.validate().unwrap();
            for _ in 0..500 {
                let logits: Vec<f32> = (0..r.n_experts).map(|_| rng.gen_range(-4.0..4.0)).collect();
                let bias: Vec<f32> = (0..r.n_experts).map(|_| rng.gen_range(-0.3..0.3)).collect();
                let b = (r.scoring == Scoring::Sigmoid).then_some(&bias[..]);
                let (ids, w) = run(r, &logits, b);
                let (rids, rw) = reference(r, &logits, b);
                assert_eq!(ids, rids, "{r:?} {logits:?}");
                for (a, e) in w.iter().zip(&rw) {
                    // f32 softmax/sigmoid and sums against f64: a few ulps of the weight.
                    assert!((*a as f64 - e).abs() <= 1e-6 * e.abs().max(1.0), "{a} vs {e}");
                }
            }
        }
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let r = rule(Scoring::Softmax, 6, 3, (1, 1), true, 1.0);
        let (ids, w) = run(&r, &[0.5; 6], None);
        assert_eq!(ids, [0, 1, 2]);
        assert!(w.iter().all(|&x| (x - 1.0 / 3.0).abs() < 1e-7));
        let (ids, _) = run(&r, &[1.0, 2.0, 2.0, 0.0, 2.0, 1.0], None);
        assert_eq!(ids, [1, 2, 4]);
        // Groups tie too: with equal group scores the lower groups are kept.
        let g = rule(Scoring::Sigmoid, 8, 2, (4, 2), false, 1.0);
        let (ids, _) = run(&g, &[0.0; 8], None);
        assert_eq!(ids, [0, 1]);
    }

    #[test]
    fn group_limit_excludes_a_strong_expert_in_a_weak_group() {
        // Groups of two. Expert 0 is the single best, but its partner is weak, so group 0's
        // top-2 sum loses to groups 1 and 2 and expert 0 cannot be chosen.
        let r = rule(Scoring::Sigmoid, 8, 2, (4, 2), false, 1.0);
        let logits = [4.0, -6.0, 2.0, 2.0, 1.5, 1.5, -6.0, -6.0];
        let (ids, _) = run(&r, &logits, None);
        assert_eq!(ids, [2, 3]);
        // Without the group limit expert 0 wins.
        let free = rule(Scoring::Sigmoid, 8, 2, (1, 1), false, 1.0);
        assert_eq!(run(&free, &logits, None).0, [0, 2]);
    }

    #[test]
    fn bias_chooses_but_does_not_weigh() {
        let r = rule(Scoring::Sigmoid, 4, 1, (1, 1), false, 2.0);
        let logits = [1.0, 0.0, 0.0, 0.0];
        let (ids, w) = run(&r, &logits, Some(&[0.0, 0.0, 0.9, 0.0]));
        assert_eq!(ids, [2]);
        assert!((w[0] - 2.0 * 0.5).abs() < 1e-7, "weight is the unbiased sigmoid(0) times the scaling: {}", w[0]);
    }

    #[test]
    fn renormalized_weights_sum_to_the_scaling() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let r = rule(Scoring::Sigmoid, 16, 4, (4, 2), true, 2.5);
        for _ in 0..100 {
            let logits: Vec<f32> = (0..16).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let (_, w) = run(&r, &logits, None);
            assert!((w.iter().sum::<f32>() - 2.5).abs() < 1e-5);
        }
    }

    #[test]
    fn nan_logits_do_not_panic_and_lose() {
        let r = rule(Scoring::Softmax, 4, 2, (1, 1), false, 1.0);
        let (ids, _) = run(&r, &[f32::NAN, 1.0, 0.0, 2.0], None);
        assert_eq!(ids.len(), 2);
        let s = rule(Scoring::Sigmoid, 4, 2, (1, 1), false, 1.0);
        assert_eq!(run(&s, &[f32::NAN, 1.0, 0.0, 2.0], None).0, [3, 1]);
    }
}
