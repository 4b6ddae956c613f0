//! Request arrival times: a Poisson process at the request rate, or all at once.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Offsets in seconds from the start of the run at which each of `n` requests is due.
///
/// Gaps are exponential with mean `1/rate` (drawn as `-ln(U)/rate`, `U` uniform in (0, 1]);
/// an infinite rate makes every offset 0. The first request is due at once, as in
/// bench_serving.
pub fn poisson_offsets(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    if rate.is_infinite() {
        return vec![0.0; n];
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                let u: f64 = 1.0 - rng.gen::<f64>(); // (0, 1]: ln never sees 0
                t += -u.ln() / rate;
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(offsets: &[f64]) -> Vec<f64> {
        assert_eq!(offsets[0], 0.0);
        offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Exponential inter-arrival statistics, with bounds at 5 standard errors of each statistic
    /// for n = 20000 gaps (a correct sampler fails one of them with probability < 1e-5):
    /// - mean = 1/rate; standard error (1/rate)/sqrt(n) = 0.71% relative, so bound 3.6%.
    /// - CV = 1; the sample CV's standard error for an exponential is about sqrt(1/n)
    ///   (delta method: sd of s/m with kurtosis 9) = 0.0071, so bound 0.036.
    /// - P(gap < ln2/rate) = 1/2 (the median); standard error sqrt(0.25/n) = 0.0035, bound 0.018.
    #[test]
    fn gaps_are_exponential_with_the_requested_rate() {
        let n = 20_000;
        for (rate, seed) in [(4.0, 0u64), (250.0, 7)] {
            let g = gaps(&poisson_offsets(n + 1, rate, seed));
            let mean = g.iter().sum::<f64>() / n as f64;
            let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
            let cv = var.sqrt() / mean;
            let below_median = g.iter().filter(|&&x| x < std::f64::consts::LN_2 / rate).count() as f64 / n as f64;
            assert!((mean * rate - 1.0).abs() < 0.036, "rate {rate}: mean gap {mean}");
            assert!((cv - 1.0).abs() < 0.036, "rate {rate}: cv {cv}");
            assert!((below_median - 0.5).abs() < 0.018, "rate {rate}: {below_median} below the median");
            assert!(g.iter().all(|&x| x > 0.0 && x.is_finite()));
        }
    }

    #[test]
    fn seeded_and_infinite_rate() {
        assert_eq!(poisson_offsets(50, 3.0, 1), poisson_offsets(50, 3.0, 1));
        assert_ne!(poisson_offsets(50, 3.0, 1), poisson_offsets(50, 3.0, 2));
        assert_eq!(poisson_offsets(3, f64::INFINITY, 1), vec![0.0; 3]);
    }
}
