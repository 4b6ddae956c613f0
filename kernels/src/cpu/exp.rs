//! `exp` over a run of softmax scores, vectorizable and the same bits on every CPU.
//!
//! Attention takes one exp per (query, key) score: at 4k tokens of context libm's scalar
//! `expf` is most of a prefill chunk's attention time. This one is range reduction to
//! `2^n · e^r` with `|r| <= ln2/2` and a degree-7 Taylor polynomial (truncation under 1e-8
//! relative), written with plain multiplies and adds in array loops the compiler vectorizes.
//! Rust never fuses a multiply and an add on its own, so the AVX2 and AVX-512 builds and the
//! portable one give the same bits: a score's weight does not depend on the SIMD level either.

/// Below this, `e^x` is under f32's smallest normal: the result is 0 (masked scores, -inf,
/// land here, so they weigh exactly nothing).
const LOW: f32 = -87.33;
/// Above this the result is infinity (f32's largest finite value is `e^88.72`; softmax never
/// asks for more than `e^0`).
const HIGH: f32 = 88.0;
/// `1.5 · 2^23`: adding and subtracting it rounds an f32 of magnitude < 2^22 to an integer.
const ROUND: f32 = 12_582_912.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split so that `n · LN2_HI` is exact for the `n` that occur (|n| < 2^8).
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// `e^x` for one value (the scalar form of [`exp_shifted`], same bits).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let c = x.clamp(LOW, HIGH);
    let t = c * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (c - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n as an f32's exponent field; n + 127 is in 1..=254 for n in the clamped range. `t`
    // and ROUND share their exponent (ulp 1), so n is the difference of their bits: integer
    // operations that vectorize, where a float-to-int cast would not (its saturation is scalar).
    let n_int = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    let y = p * scale;
    if x < LOW {
        0.0
    } else if x > HIGH {
        f32::INFINITY
    } else {
        y
    }
}

/// `v = e^(v - shift)` for every value of `v`.
pub fn exp_shifted(v: &mut [f32], shift: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F present (checked just above).
        return unsafe { exp_shifted_avx512(v, shift) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 present (checked just above).
        return unsafe { exp_shifted_avx2(v, shift) };
    }
    exp_shifted_portable(v, shift);
}

/// Runs of 16 values, so a whole run is vectorized even in short rows (a 16-key page of
/// scores): the compiler's own loop would leave rows shorter than its unrolled step scalar.
#[inline(always)]
fn exp_shifted_portable(v: &mut [f32], shift: f32) {
    let mut runs = v.chunks_exact_mut(16);
    for run in &mut runs {
        let run: &mut [f32; 16] = run.try_into().expect("16 values");
        run.iter_mut().for_each(|x| *x = exp(*x - shift));
    }
    runs.into_remainder().iter_mut().for_each(|x| *x = exp(*x - shift));
}

/// The same loop compiled for 8-wide vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_avx2(v: &mut [f32], shift: f32) {
    exp_shifted_portable(v, shift);
}

/// The same loop compiled for 16-wide vectors (still no fused multiply-adds, so the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(v: &mut [f32], shift: f32) {
    exp_shifted_portable(v, shift);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Within 2 ulp (2.4e-7 relative) of the f64 exp over the range softmax uses (and some
    /// positive values), exactly 0 below the normal range and for -inf, and the vector loop
    /// equal to the scalar function bit for bit.
    #[test]
    fn exp_is_accurate_and_the_same_in_every_form() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut xs: Vec<f32> = (0..100_000).map(|_| r.gen_range(-87.0f32..10.0)).collect();
        xs.extend([0.0, -0.0, -1e-30, 1e-30, -0.5, 0.5, -86.9, 80.0, -0.346_573_6, 0.346_573_6]);
        for &x in &xs {
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            assert!((got - want).abs() <= 2.4e-7 * want, "exp({x}) = {got}, want {want}");
        }
        let mut v = xs.clone();
        exp_shifted(&mut v, 0.0);
        for (x, y) in xs.iter().zip(&v) {
            assert_eq!(exp(*x).to_bits(), y.to_bits(), "exp({x})");
        }
        // Each SIMD build this CPU runs, not only the one dispatch picks, with a shift.
        #[cfg(target_arch = "x86_64")]
        for (name, ok, f) in [
            ("avx2", std::arch::is_x86_feature_detected!("avx2"), exp_shifted_avx2 as unsafe fn(&mut [f32], f32)),
            ("avx512", std::arch::is_x86_feature_detected!("avx512f"), exp_shifted_avx512),
        ] {
            if !ok {
                continue;
            }
            let mut v = xs.clone();
            // SAFETY: the feature was detected just above.
            unsafe { f(&mut v, 1.25) };
            for (x, y) in xs.iter().zip(&v) {
                assert_eq!(exp(*x - 1.25).to_bits(), y.to_bits(), "{name} exp({x} - 1.25)");
            }
        }
        for x in [f32::NEG_INFINITY, -1e30, -88.0, -100.0] {
            assert_eq!(exp(x), 0.0, "exp({x})");
        }
        assert_eq!(exp(100.0), f32::INFINITY);
        let mut v = vec![3.0f32, f32::NEG_INFINITY, 2.0];
        exp_shifted(&mut v, 3.0);
        assert_eq!(v[0], 1.0);
        assert_eq!(v[1], 0.0);
    }
}
