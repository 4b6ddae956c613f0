//! Row passes of attention's softmax besides the exp ([`super::exp`]): the largest score of a
//! row, and a row's weights summed into eight lanes chosen by key position: portable loops
//! over fixed-width lanes, an AVX2 build of the sums and AVX-512 intrinsics for the maximum.
//! Each lane sees its values in the same order in every form, so every form gives the same
//! bits.

/// Lanes of the running maximum (one AVX-512 register).
const MAX_LANES: usize = 16;

/// Lanes a row's weights are summed into, by absolute key position modulo this.
pub const SUM_LANES: usize = 8;

/// The largest of `init` and the values of `r`; NaNs are skipped as `f32::max` skips them.
/// (Only the sign of a zero maximum may depend on the order, which no caller can tell apart:
/// scores are shifted by the maximum before their exp.)
pub fn max_of(r: &[f32], init: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F present (checked just above).
        return unsafe { max_of_avx512(r, init) };
    }
    max_of_portable(r, init)
}

#[inline(always)]
fn max_of_portable(r: &[f32], init: f32) -> f32 {
    // Whole runs of 16, the rest padded with -inf: fixed trip counts the compiler turns into
    // single vector operations (rows are often one 16-key page).
    let mut lanes = [f32::NEG_INFINITY; MAX_LANES];
    let mut runs = r.chunks_exact(MAX_LANES);
    let mut fold = |run: &[f32; MAX_LANES]| lanes.iter_mut().zip(run).for_each(|(m, &x)| *m = m.max(x));
    for run in &mut runs {
        fold(run.try_into().expect("16 values"));
    }
    let mut rest = [f32::NEG_INFINITY; MAX_LANES];
    rest[..runs.remainder().len()].copy_from_slice(runs.remainder());
    fold(&rest);
    // A tree over the lanes (halves against halves), not a chain of dependent maxima.
    let h8: [f32; 8] = std::array::from_fn(|i| lanes[i].max(lanes[i + 8]));
    let h4: [f32; 4] = std::array::from_fn(|i| h8[i].max(h8[i + 4]));
    init.max(h4[0].max(h4[2]).max(h4[1].max(h4[3])))
}

/// [`max_of`] in AVX-512 registers (the compiler does not keep the portable loop's lane tree
/// in vectors). `vmaxps` returns its second operand when either is NaN, so a NaN score is
/// skipped, and the running maximum, starting at -inf, is never NaN.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn max_of_avx512(r: &[f32], init: f32) -> f32 {
    use std::arch::x86_64::*;
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut runs = r.chunks_exact(MAX_LANES);
    for run in &mut runs {
        // SAFETY: `run` is 16 readable floats.
        m = _mm512_max_ps(unsafe { _mm512_loadu_ps(run.as_ptr()) }, m);
    }
    let rest = runs.remainder();
    // SAFETY: the mask covers the `rest.len()` (< 16) readable floats of `rest`.
    let x = unsafe { _mm512_mask_loadu_ps(m, ((1u32 << rest.len()) - 1) as u16, rest.as_ptr()) };
    init.max(_mm512_reduce_max_ps(_mm512_max_ps(x, m)))
}

/// `lanes[(first + j) % 8] += r[j]` for every `j` in order: the weights of keys at absolute
/// positions `first..first + r.len()` summed by position, so the rounding does not depend on
/// how the keys are cut into pages.
pub fn add_by_position(lanes: &mut [f32; SUM_LANES], first: usize, r: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 present (checked just above).
        return unsafe { add_by_position_avx2(lanes, first, r) };
    }
    add_by_position_portable(lanes, first, r);
}

#[inline(always)]
fn add_by_position_portable(lanes: &mut [f32; SUM_LANES], first: usize, r: &[f32]) {
    // Up to the next position that is a multiple of 8, then whole runs of 8 lane by lane.
    let lead = ((SUM_LANES - first % SUM_LANES) % SUM_LANES).min(r.len());
    for (j, &w) in r[..lead].iter().enumerate() {
        lanes[(first + j) % SUM_LANES] += w;
    }
    let mut chunks = r[lead..].chunks_exact(SUM_LANES);
    for c in &mut chunks {
        for (l, &w) in lanes.iter_mut().zip(c) {
            *l += w;
        }
    }
    for (l, &w) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += w;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn add_by_position_avx2(lanes: &mut [f32; SUM_LANES], first: usize, r: &[f32]) {
    add_by_position_portable(lanes, first, r);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Against the one-value-at-a-time definitions, bit for bit, for every start position and
    /// length up to three runs of lanes, with NaNs and -inf among the values.
    #[test]
    fn row_passes_match_their_definitions() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for len in 0..50 {
            let mut row: Vec<f32> = (0..len).map(|_| r.gen_range(-30.0f32..30.0)).collect();
            if len > 5 {
                row[3] = f32::NAN;
                row[len - 1] = f32::NEG_INFINITY;
            }
            let want = row.iter().fold(-100.0f32, |m, &x| m.max(x));
            assert_eq!(max_of(&row, -100.0).to_bits(), want.to_bits(), "max of {len}");
            assert_eq!(max_of_portable(&row, -100.0).to_bits(), want.to_bits(), "portable max of {len}");
            let weights: Vec<f32> = (0..len).map(|_| r.gen::<f32>()).collect();
            for first in 0..20 {
                let mut want = [0.5f32; SUM_LANES];
                for (j, &w) in weights.iter().enumerate() {
                    want[(first + j) % SUM_LANES] += w;
                }
                let (mut got, mut portable) = ([0.5f32; SUM_LANES], [0.5f32; SUM_LANES]);
                add_by_position(&mut got, first, &weights);
                add_by_position_portable(&mut portable, first, &weights);
                assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "sums of {len} from {first}");
                assert_eq!(portable.map(f32::to_bits), want.map(f32::to_bits), "portable sums of {len} from {first}");
            }
        }
    }
}
