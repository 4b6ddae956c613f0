//! Run-time activation quantization, one token (row) at a time.
//!
//! - int8: `scale = absmax / 127`, `q = round_half_even(x / scale)` in [-127, 127] (vLLM's
//!   and AITER's dynamic per-token int8; compressed-tensors' own fake-quant uses absmax / 127.5
//!   with [-128, 127], a difference of 0.4% in the scale that we do not reproduce).
//! - FP8 E4M3: per group of `group` values, `scale = absmax / 448`, `q = e4m3(x / scale)`
//!   (round to nearest even), as vLLM's dynamic per-token (or per-token-group) FP8 does.
//!
//! An all-zero row gets scale 0 and zero codes.

use super::fp8::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};

/// Quantizes one row to int8; returns the scale (`x ≈ scale * q`).
pub fn quantize_int8_row(x: &[f32], q: &mut [i8]) -> f32 {
    assert_eq!(x.len(), q.len());
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    if scale == 0.0 {
        q.fill(0);
        return 0.0;
    }
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// Rounds one row to E4M3 per group of `group` values: `codes` gets the E4M3 values as f32
/// (exactly representable), `scales` one scale per group (`x ≈ scale * code`). On AVX2
/// machines (group a multiple of 8) a SIMD version runs, with bit-identical results.
pub fn quantize_fp8_row(x: &[f32], group: usize, codes: &mut [f32], scales: &mut [f32]) {
    assert_eq!(x.len(), codes.len());
    assert_eq!(x.len(), group * scales.len());
    #[cfg(target_arch = "x86_64")]
    if group.is_multiple_of(8) && crate::cpu::Isa::Avx2.available() {
        // SAFETY: AVX2 checked; group is a multiple of 8; lengths asserted above.
        unsafe { super::avx2_fp8::quantize_fp8_row(x, group, codes, scales) };
        return;
    }
    for ((xs, cs), s) in x.chunks_exact(group).zip(codes.chunks_exact_mut(group)).zip(scales.iter_mut()) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        *s = amax / E4M3_MAX;
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = if *s == 0.0 { 0.0 } else { e4m3_to_f32(f32_to_e4m3(v / *s)) };
        }
    }
}
