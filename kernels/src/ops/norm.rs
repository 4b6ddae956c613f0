//! RMS normalization.

use crate::cpu::pool;

/// `out = x / sqrt(mean(x²) + eps) * weight`, row by row (`weight.len()` values per row).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert_eq!(x.len(), out.len());
    assert_eq!(x.len() % d, 0, "rms_norm rows");
    // Rows in parallel, NORM_ROWS per task (a prefill's norms were serial work, the pool's
    // other threads waiting); each row's arithmetic is the same wherever it runs.
    pool::for_each_chunk(out, NORM_ROWS * d, |c, o| {
        let x = &x[c * NORM_ROWS * d..];
        for (xr, or) in x.chunks_exact(d).zip(o.chunks_exact_mut(d)) {
            let ss: f32 = xr.iter().map(|v| v * v).sum();
            let scale = 1.0 / (ss / d as f32 + eps).sqrt();
            for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
                *o = v * scale * w;
            }
        }
    });
}

/// Rows per parallel task of [`rms_norm`]: a decode step's few rows stay on the calling thread.
const NORM_ROWS: usize = 16;

#[cfg(test)]
mod tests {
    use super::rms_norm;
    use rand::{Rng, SeedableRng};

    /// Many rows at once (several parallel tasks, the last one short) give each row the bits
    /// it gets alone, and every row is within 1e-5 relative of an f64 evaluation (the f32 sum
    /// of 96 positive squares errs by at most 96 · 2^-24 ≈ 6e-6 relative, halved by the square
    /// root, and the two products add 1.2e-7 each).
    #[test]
    fn rows_in_parallel_match_each_row_alone_and_f64() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (d, rows) = (96, 37);
        let x: Vec<f32> = (0..d * rows).map(|_| r.gen_range(-3.0..3.0)).collect();
        let w: Vec<f32> = (0..d).map(|_| r.gen_range(0.5..1.5)).collect();
        let mut all = vec![0f32; d * rows];
        rms_norm(&x, &w, 1e-6, &mut all);
        for (i, (xr, got)) in x.chunks_exact(d).zip(all.chunks_exact(d)).enumerate() {
            let mut one = vec![0f32; d];
            rms_norm(xr, &w, 1e-6, &mut one);
            assert!(got.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()), "row {i}");
            let ms = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / d as f64;
            for ((&g, &v), &wj) in got.iter().zip(xr).zip(&w) {
                let want = f64::from(v) / (ms + 1e-6).sqrt() * f64::from(wj);
                assert!((f64::from(g) - want).abs() <= 1e-5 * want.abs().max(1.0), "row {i}: {g} vs {want}");
            }
        }
    }
}
