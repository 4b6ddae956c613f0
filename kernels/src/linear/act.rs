//! Run-time activation quantization, one token (row) at a time.
//!
//! - int8: `scale = absmax / 127`, `q = round_half_even(x / scale)` in [-127, 127] (vLLM's
//!   and AITER's dynamic per-token int8; compressed-tensors' own fake-quant uses absmax / 127.5
//!   with [-128, 127], a difference of 0.4% in the scale that we do not reproduce).
//! - FP8 E4M3: per group of `group` values, `scale = absmax / 448`, `q = e4m3(x / scale)`
//!   (round to nearest even), as vLLM's dynamic per-token (or per-token-group) FP8 does.
//!
//! - bf16: each value rounded to nearest even, subnormals taken as zero (what
//!   `vcvtneps2bf16` does), for W4A16's 16-bit activations.
//! - int16 per block (W4A16's 16-bit activations where the CPU has no bf16 dot): per block of
//!   the weights' scale group, `scale = absmax / limit`, `q = round_half_even(x / scale)` in
//!   [-limit, limit] with `limit` 32767 ([`int16_limit`] lowers it for blocks of more than
//!   4369 values so that integer sums stay in i32), and the block's `Σ q`.
//!
//! An all-zero row gets scale 0 and zero codes.

use crate::e4m3::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};

/// How activations enter a linear layer at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActQuant {
    /// Kept in f32 (weight-only schemes: W4A16; GGUF and float layers).
    F32,
    /// Rounded to bf16 (W4A16's 16-bit activations, as vLLM's Marlin kernels take them), for
    /// the AVX-512 BF16 dot.
    Bf16,
    /// Dynamic per-token int8, absmax / 127 (W4A8, W8A8 int8).
    Int8PerToken,
    /// Dynamic per-token (per column block with block scales) E4M3, absmax / 448 (W8A8 FP8).
    Fp8PerToken,
    /// Dynamic int16 per token and weight scale group (W4A16's 16-bit activations for the
    /// AVX2 integer kernel: every product and group sum exact in int32).
    Int16PerGroup,
}

impl ActQuant {
    /// Name for plans (`f32`, `bf16`, `int8/token`, `fp8/token`, `int16/group`).
    pub fn name(self) -> &'static str {
        match self {
            ActQuant::F32 => "f32",
            ActQuant::Bf16 => "bf16",
            ActQuant::Int8PerToken => "int8/token",
            ActQuant::Fp8PerToken => "fp8/token",
            ActQuant::Int16PerGroup => "int16/group",
        }
    }
}

/// Quantizes one row to int8; returns the scale (`x ≈ scale * q`). Runs the AVX2 version
/// where the CPU has it; both give the same bytes ([`quantize_int8_row_scalar`]).
pub fn quantize_int8_row(x: &[f32], q: &mut [i8]) -> f32 {
    assert_eq!(x.len(), q.len());
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::Isa::Avx2.available() {
        // SAFETY: AVX2 checked just above; lengths asserted equal.
        return unsafe { avx2::quantize_int8_row(x, q) };
    }
    quantize_int8_row_scalar(x, q)
}

/// The portable [`quantize_int8_row`]: `absmax` (NaN ignored), `scale = absmax / 127`,
/// `q = round_half_even(x / scale)` clamped to ±127 (NaN to 0).
pub fn quantize_int8_row_scalar(x: &[f32], q: &mut [i8]) -> f32 {
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

/// The largest int16 activation code for blocks of `block` values multiplied by int4 weights
/// (each at most 15 from its zero point): 32767, or less where `15 · block · limit` would
/// pass `i32::MAX`, so a block's integer sum of products always fits in i32.
pub fn int16_limit(block: usize) -> i32 {
    (i32::MAX as usize / (15 * block.max(1))).min(32767) as i32
}

/// Quantizes one row to int16 per block of `block` values (the last block may be short):
/// per block `scales[b] = absmax / limit` (NaN ignored), `q = round_half_even(x / scale)`
/// clamped to ±`limit` (NaN to 0), and `sums[b] = Σ q`; an all-zero block gets scale 0.
/// Runs the AVX2 version where the CPU has it (blocks of a multiple of 8); both give the same
/// codes, scales and sums.
///
/// # Panics
/// If the lengths disagree, `block` is 0, or `limit` is outside `1..=32767`.
pub fn quantize_int16_row(x: &[f32], block: usize, limit: i32, q: &mut [i16], scales: &mut [f32], sums: &mut [i32]) {
    assert!(block > 0 && (1..=32767).contains(&limit), "block {block}, limit {limit}");
    assert_eq!(x.len(), q.len());
    assert_eq!(x.len().div_ceil(block), scales.len());
    assert_eq!(scales.len(), sums.len());
    let blocks = x.chunks(block).zip(q.chunks_mut(block)).zip(scales.iter_mut().zip(sums.iter_mut()));
    #[cfg(target_arch = "x86_64")]
    if block.is_multiple_of(8) && x.len().is_multiple_of(8) && crate::cpu::Isa::Avx2.available() {
        for ((x, q), (s, sum)) in blocks {
            // SAFETY: AVX2 checked just above; `x` and `q` have the same (multiple of 8) length.
            (*s, *sum) = unsafe { avx2::quantize_int16_block(x, limit, q) };
        }
        return;
    }
    for ((x, q), (s, sum)) in blocks {
        (*s, *sum) = quantize_int16_block_scalar(x, limit, q);
    }
}

/// One block of [`quantize_int16_row`], portable: `(scale, Σ q)`.
pub fn quantize_int16_block_scalar(x: &[f32], limit: i32, q: &mut [i16]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / limit as f32;
    if scale == 0.0 {
        q.fill(0);
        return (0.0, 0);
    }
    let lim = limit as f32;
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v / scale).round_ties_even().clamp(-lim, lim) as i16;
        sum += i32::from(*q);
    }
    (scale, sum)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// [`super::quantize_int8_row_scalar`] 32 values at a time, operation for operation: the
    /// same IEEE division and round-half-even, `max` that skips NaN like `f32::max`, and NaN
    /// quotients zeroed like Rust's saturating `as i8`. The tail goes through the scalar code.
    ///
    /// # Safety
    /// AVX2 available; `x.len() == q.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_int8_row(x: &[f32], q: &mut [i8]) -> f32 {
        let scale = absmax(x) / 127.0;
        if scale == 0.0 {
            q.fill(0);
            return 0.0;
        }
        let sv = _mm256_set1_ps(scale);
        let quant = |v| quant(v, sv, 127.0);
        let mut xc = x.chunks_exact(32);
        let mut qc = q.chunks_exact_mut(32);
        for (xs, qs) in (&mut xc).zip(&mut qc) {
            // SAFETY: `xs` holds 32 floats, `qs` 32 bytes.
            unsafe {
                let p = xs.as_ptr();
                let a = quant(_mm256_loadu_ps(p));
                let b = quant(_mm256_loadu_ps(p.add(8)));
                let c = quant(_mm256_loadu_ps(p.add(16)));
                let d = quant(_mm256_loadu_ps(p.add(24)));
                // Packing works per 128-bit lane: restore element order with one permute.
                let ab = _mm256_packs_epi32(a, b);
                let cd = _mm256_packs_epi32(c, d);
                let abcd = _mm256_packs_epi16(ab, cd);
                let ordered = _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(qs.as_mut_ptr().cast(), ordered);
            }
        }
        for (q, &v) in qc.into_remainder().iter_mut().zip(xc.remainder()) {
            *q = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        scale
    }

    /// [`super::quantize_int16_block_scalar`] 16 values at a time, operation for operation
    /// (as [`quantize_int8_row`] mirrors its scalar version).
    ///
    /// # Safety
    /// AVX2 available; `x.len() == q.len()`, a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_int16_block(x: &[f32], limit: i32, q: &mut [i16]) -> (f32, i32) {
        debug_assert!(x.len() == q.len() && x.len().is_multiple_of(8));
        let scale = absmax(x) / limit as f32;
        if scale == 0.0 {
            q.fill(0);
            return (0.0, 0);
        }
        let (sv, lim) = (_mm256_set1_ps(scale), limit as f32);
        let mut sum = _mm256_setzero_si256();
        for (xs, qs) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)) {
            // SAFETY: `xs` holds 16 floats, `qs` 16 i16.
            unsafe {
                let a = quant(_mm256_loadu_ps(xs.as_ptr()), sv, lim);
                let b = quant(_mm256_loadu_ps(xs.as_ptr().add(8)), sv, lim);
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(a, b));
                // Packing works per 128-bit lane: restore element order with one permute.
                let ab = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(a, b));
                _mm256_storeu_si256(qs.as_mut_ptr().cast(), ab);
            }
        }
        // SAFETY: this function runs with AVX2.
        let mut total = unsafe { crate::cpu::simd::hsum_epi32(sum) };
        // A last 8 values (blocks are multiples of 8, not always of 16) the scalar way.
        let done = x.len() / 16 * 16;
        for (q, &v) in q[done..].iter_mut().zip(&x[done..]) {
            *q = (v / scale).round_ties_even().clamp(-lim, lim) as i16;
            total += i32::from(*q);
        }
        (scale, total)
    }

    /// `max |x|` as the scalar quantizers fold it (`f32::max`, NaN skipped), 8 lanes at a
    /// time then the lanes and the tail.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn absmax(x: &[f32]) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut vmax = _mm256_setzero_ps();
        let mut xc = x.chunks_exact(8);
        for c in &mut xc {
            // SAFETY: `c` holds 8 floats.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            // `max_ps(a, b)` returns `b` when either is NaN: NaN inputs leave the max alone.
            vmax = _mm256_max_ps(_mm256_andnot_ps(sign, v), vmax);
        }
        let mut lanes = [0f32; 8];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), vmax) };
        lanes.iter().chain(xc.remainder()).fold(0f32, |m, v| m.max(v.abs()))
    }

    /// `v / scale` rounded half to even, clamped to ±`limit`, NaN to 0, as int32 lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn quant(v: __m256, scale: __m256, limit: f32) -> __m256i {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_div_ps(v, scale));
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
        _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, _mm256_set1_ps(limit)), _mm256_set1_ps(-limit)))
    }
}

/// `out[i]` = the bf16 bits of `x[i]` ([`round_bf16_scalar`]); 16 at a time where the CPU
/// has AVX-512 BF16, with the same bits.
pub fn round_bf16_row(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::caps::bf16_dot_available() {
        // SAFETY: AVX-512 BF16 checked just above; lengths asserted equal.
        unsafe { super::int4::avx512_bf16::round_bf16(x, out) };
        return;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round_bf16_scalar(v);
    }
}

/// The bf16 bits of `v`: round to nearest even, NaN kept (quieted), and subnormal inputs
/// taken as (signed) zero, as `vcvtneps2bf16` rounds.
pub fn round_bf16_scalar(v: f32) -> u16 {
    let b = v.to_bits();
    if b & 0x7f80_0000 == 0 {
        return ((b >> 16) & 0x8000) as u16;
    }
    half::bf16::from_f32(v).to_bits()
}

/// Rounds one row to E4M3 per group of `group` values: `codes` gets the E4M3 values as f32
/// (exactly representable), `scales` one scale per group (`x ≈ scale * code`). On AVX2
/// machines (group a multiple of 8) a SIMD version runs, with bit-identical results.
pub fn quantize_fp8_row(x: &[f32], group: usize, codes: &mut [f32], scales: &mut [f32]) {
    assert_eq!(x.len(), codes.len());
    assert_eq!(x.len().div_ceil(group), scales.len());
    #[cfg(target_arch = "x86_64")]
    if group.is_multiple_of(8) && x.len().is_multiple_of(8) && crate::cpu::Isa::Avx2.available() {
        // SAFETY: AVX2 checked; group is a multiple of 8; lengths asserted above.
        unsafe { super::fp8::avx2::quantize_fp8_row(x, group, codes, scales) };
        return;
    }
    for ((xs, cs), s) in x.chunks(group).zip(codes.chunks_mut(group)).zip(scales.iter_mut()) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        *s = amax / E4M3_MAX;
        for (c, &v) in cs.iter_mut().zip(xs) {
            *c = if *s == 0.0 { 0.0 } else { e4m3_to_f32(f32_to_e4m3(v / *s)) };
        }
    }
}
