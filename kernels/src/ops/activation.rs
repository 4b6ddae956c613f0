//! Activation functions.

use crate::cpu::pool;

/// SwiGLU over rows of `[gate | up]` (each `2 * n` wide): `out[i] = silu(gate[i]) * up[i]`.
///
/// Rows run in parallel on the kernel pool, and with AVX2 eight values at a time with a
/// polynomial `exp` (`avx2::exp`, within 2e-7 relative of the exact one): between the
/// gate/up and down projections of a decode step this was serial `expf` work, 6% of a
/// batch-8 step.
pub fn silu_mul(gate_up: &[f32], n: usize, out: &mut [f32]) {
    assert_eq!(gate_up.len(), 2 * out.len());
    assert!(n > 0 && out.len().is_multiple_of(n), "rows of {n}");
    #[cfg(target_arch = "x86_64")]
    let simd = crate::cpu::Isa::Avx2.available();
    pool::for_each_chunk(out, n, |r, o| {
        let (g, u) = gate_up[2 * r * n..2 * (r + 1) * n].split_at(n);
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: AVX2 and FMA present (checked).
            unsafe { avx2::silu_mul_row(g, u, o) };
            return;
        }
        silu_mul_scalar(g, u, o);
    });
}

/// The portable row kernel (and the tail of the SIMD one).
fn silu_mul_scalar(g: &[f32], u: &[f32], o: &mut [f32]) {
    for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `e^x` for eight lanes: `x = k·ln2 + r` with |r| <= ln2/2, `e^r` by a degree-6
    /// polynomial (Cephes' `expf` coefficients, the last one 0.5 in f32), then `2^k` through the exponent bits. Inputs
    /// are clamped to ±87.3, where `e^x` stays a normal f32.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub fn exp(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(87.3));
        let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)));
        // ln2 split in two so that k·ln2 is subtracted without rounding error.
        let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let two_k = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)));
        _mm256_mul_ps(e, _mm256_castsi256_ps(two_k))
    }

    /// One row of [`super::silu_mul`].
    #[target_feature(enable = "avx2,fma")]
    pub fn silu_mul_row(g: &[f32], u: &[f32], o: &mut [f32]) {
        let n = o.len();
        let body = n - n % 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..body).step_by(8) {
            let (gs, us): (&[f32; 8], &[f32; 8]) = (g[i..i + 8].try_into().expect("8"), u[i..i + 8].try_into().expect("8"));
            let os: &mut [f32; 8] = (&mut o[i..i + 8]).try_into().expect("8");
            // SAFETY: eight floats at each pointer.
            unsafe {
                let gv = _mm256_loadu_ps(gs.as_ptr());
                let den = _mm256_add_ps(one, exp(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
                _mm256_storeu_ps(os.as_mut_ptr(), _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(us.as_ptr())));
            }
        }
        super::silu_mul_scalar(&g[body..], &u[body..n], &mut o[body..]);
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use rand::{Rng, SeedableRng};

        /// Against f64 `exp` over the whole clamped range and around zero: the polynomial and
        /// the split ln2 keep the relative error within 2e-7 (about 2 ulp).
        #[test]
        fn exp_is_within_two_ulp() {
            if !crate::cpu::Isa::Avx2.available() {
                eprintln!("note: no AVX2; the SIMD exp is not exercised");
                return;
            }
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(3);
            let mut xs: Vec<f32> = (0..20_000).map(|_| r.gen_range(-87.0f32..87.0)).collect();
            xs.extend((0..4_000).map(|_| r.gen_range(-1.0f32..1.0)));
            xs.extend([0.0, -0.0, 1e-8, -1e-8, 0.346_573_6, -0.346_573_6, 87.0, -87.0]);
            for c in xs.chunks_exact(8) {
                let mut got = [0f32; 8];
                // SAFETY: AVX2 and FMA present (checked); eight floats each.
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), exp(_mm256_loadu_ps(c.as_ptr()))) };
                for (&x, &y) in c.iter().zip(&got) {
                    let want = (x as f64).exp();
                    let rel = ((y as f64 - want) / want).abs();
                    assert!(rel < 2e-7, "exp({x}) = {y}, want {want} (rel {rel:e})");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Rows of random gates (wide enough to reach both tails) and ups, with a row width that
    /// leaves a tail after the eight-wide body: equal to the f64 formula within 1e-6 relative
    /// of each product's magnitude.
    #[test]
    fn silu_mul_matches_f64() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for (rows, n) in [(1, 8), (3, 21), (8, 1536)] {
            let gu: Vec<f32> = (0..rows * 2 * n).map(|_| r.gen_range(-30.0f32..30.0)).collect();
            let mut out = vec![f32::NAN; rows * n];
            silu_mul(&gu, n, &mut out);
            for (row, o) in out.chunks_exact(n).enumerate() {
                let (g, u) = gu[2 * row * n..2 * (row + 1) * n].split_at(n);
                for i in 0..n {
                    let (g, u) = (g[i] as f64, u[i] as f64);
                    let want = g / (1.0 + (-g).exp()) * u;
                    let tol = 1e-6 * (g.abs() * u.abs()).max(1e-30);
                    assert!((o[i] as f64 - want).abs() <= tol, "row {row} col {i}: {} vs {want}", o[i]);
                }
            }
        }
    }
}
