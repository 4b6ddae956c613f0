//! Run-time activation quantization: 8-bit blocks of 32 (llama.cpp's Q8_0 / Q8_1) and
//! super-blocks of 256 (llama.cpp's Q8_K).
//!
//! Integer dot products against 4- and 8-bit weight blocks need the activation in
//! the same 32-value blocking. Scales are rounded through f16 exactly as llama.cpp
//! stores them, so results match its kernels number for number. The k-quant kernels of the
//! AVX2 level take super-blocks of 256 with one f32 unit and power-of-two block scales
//! ([`Q8KBlock`]): their 6-bit scales then apply in integers and the float epilogue runs once
//! per super-block.

use crate::cpu::Isa;
use half::f16;

/// Values per activation block.
pub const Q8_BLOCK: usize = 32;

/// One activation block: `x ≈ d * qs`, and `s = d * Σ qs` (used by min-offset weights).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
pub struct Q8Block {
    /// Scale (f16-rounded).
    pub d: f32,
    /// `d * Σ qs` (f16-rounded), the block sum needed by Q4_1/Q5_1 weights.
    pub s: f32,
    /// `Σ qs` exactly (the offset correction of Q4_0 weights; |Σ| <= 32 · 128).
    pub sum: i16,
    /// `Σ qs[..16]` exactly (the offset correction of Q6_K's 16-value sub-blocks).
    pub sum_lo: i16,
    /// `-(d · Σ qs)` in f32, the factor of Q4_K's and Q5_K's min term, made once per block
    /// rather than once per block and row group.
    pub neg_dsum: f32,
    /// Quantized values in [-127, 127].
    pub qs: [i8; Q8_BLOCK],
}

// 48 bytes, 1.5 per activation value: the prefill kernels keep a block of tokens' blocks in
// L1/L2 (see `linear::ggml::interleaved`).
const _: () = assert!(std::mem::size_of::<Q8Block>() == 48);

/// Values per k-quant activation super-block.
pub const Q8K_BLOCK: usize = 256;

/// The most a 32-value block's scale exceeds its super-block's unit, as a power of two.
pub const Q8K_MAX_SHIFT: i32 = 3;

/// One activation super-block of 256 values for the k-quant kernels of the AVX2 level: like
/// llama.cpp's Q8_K, one f32 unit `d` per super-block, but each 32-value block quantized at
/// its own power-of-two multiple of it, `d · 2^shift[s]` with `shift[s]` in 0..=3, the finest
/// at which the block's largest |x| stays within ±127. A block of small values next to an
/// outlier keeps up to 8x the resolution one scale per 256 would give it (the blocks' own
/// 8-bit scales, as in [`Q8Block`], keep all of it), while the kernels still sum a super-block
/// in integers: a block's integer sums are shifted left by its `shift`.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(16))]
pub struct Q8KBlock {
    /// Quantized values in [-127, 127]: value `v` is `d · 2^shift[v / 32] · qs[v]`.
    pub qs: [i8; Q8K_BLOCK],
    /// `sums[k] = Σ qs[16k..16k + 16] · 2^shift[k / 2]` exactly, in units of `d`
    /// (|sums| <= 16 · 127 · 8).
    pub sums: [i16; Q8K_BLOCK / 16],
    /// `sums32[s] = Σ qs[32s..32s + 32] · 2^shift[s]` exactly (Q4_K's and Q5_K's min terms).
    pub sums32: [i16; Q8K_BLOCK / 32],
    /// Each 32-value block's scale is `d · 2^shift[s]`.
    pub shift: [i32; Q8K_BLOCK / 32],
    /// The unit: the super-block's largest |x| / (127 · 8).
    pub d: f32,
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Q8KBlock { qs: [0; Q8K_BLOCK], sums: [0; Q8K_BLOCK / 16], sums32: [0; Q8K_BLOCK / 32], shift: [0; Q8K_BLOCK / 32], d: 0.0 }
    }
}

impl Q8KBlock {
    /// Sets block `s`'s shift and its sums from its values' exact sums (`sum` over 32, `sum_lo`
    /// over the first 16).
    fn set_sums(&mut self, s: usize, shift: i32, sum: i32, sum_lo: i32) {
        self.shift[s] = shift;
        self.sums[2 * s] = (sum_lo << shift) as i16;
        self.sums[2 * s + 1] = ((sum - sum_lo) << shift) as i16;
        self.sums32[s] = (sum << shift) as i16;
    }
}

/// A super-block's unit `d` from its blocks' largest |x| (`amaxes`), and per block its shift
/// and the inverse of its scale `d · 2^shift` (0 where that inverse overflows: the block
/// quantizes to zeros). Every level computes its scales here.
fn superblock_scales(amaxes: &[f32; Q8K_BLOCK / Q8_BLOCK]) -> (f32, [i32; Q8K_BLOCK / Q8_BLOCK], [f32; Q8K_BLOCK / Q8_BLOCK]) {
    let amax = amaxes.iter().fold(0f32, |m, &v| m.max(v));
    let d = amax / 127.0 / (1 << Q8K_MAX_SHIFT) as f32;
    let shift = amaxes.map(|a| (0..Q8K_MAX_SHIFT).find(|&e| a <= 127.0 * (d * (1 << e) as f32)).unwrap_or(Q8K_MAX_SHIFT));
    let id = shift.map(|e| inverse(d * (1 << e) as f32));
    (d, shift, id)
}

/// Quantizes `x` (a multiple of 256 values) into `out` (`x.len() / 256` super-blocks), each
/// 32-value block at the scale [`Q8KBlock`] describes, values rounded half away from zero as
/// [`quantize_q8`] rounds them; the AVX2 version where the CPU has it.
pub fn quantize_q8k(x: &[f32], out: &mut [Q8KBlock]) {
    let isa = if Isa::Avx2.available() { Isa::Avx2 } else { Isa::Scalar };
    quantize_q8k_with(isa, x, out);
}

/// [`quantize_q8k`] at an explicit ISA level; every level gives the same bytes (NaNs become 0).
///
/// # Panics
/// If `isa` is unavailable or the lengths disagree.
pub fn quantize_q8k_with(isa: Isa, x: &[f32], out: &mut [Q8KBlock]) {
    assert_eq!(x.len(), out.len() * Q8K_BLOCK, "activation length is not whole Q8_K super-blocks");
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2");
            // SAFETY: AVX2, FMA and F16C present (checked above); lengths checked.
            unsafe { avx2::quantize_k(x, out) }
        }
        _ => {
            for (blk, xs) in out.iter_mut().zip(x.chunks_exact(Q8K_BLOCK)) {
                let mut amaxes = [0f32; Q8K_BLOCK / Q8_BLOCK];
                for (a, xs) in amaxes.iter_mut().zip(xs.chunks_exact(Q8_BLOCK)) {
                    *a = absmax(xs);
                }
                let (d, shift, id) = superblock_scales(&amaxes);
                for (s, xs) in xs.chunks_exact(Q8_BLOCK).enumerate() {
                    let (sum, sum_lo) = round_block(xs, id[s], &mut blk.qs[Q8_BLOCK * s..Q8_BLOCK * (s + 1)]);
                    blk.set_sums(s, shift[s], sum, sum_lo);
                }
                blk.d = d;
            }
        }
    }
}

/// Quantizes `x` (a multiple of 32 values) into `out` (`x.len() / 32` blocks), absmax / 127
/// per block, values rounded half away from zero; the AVX2 version where the CPU has it.
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    let isa = if Isa::Avx2.available() { Isa::Avx2 } else { Isa::Scalar };
    quantize_q8_with(isa, x, out);
}

/// [`quantize_q8`] at an explicit ISA level (the AVX2 level runs its 512-bit form where the
/// AVX-512 VNNI GEMM level is available); every form gives the same bytes for finite inputs,
/// and for NaNs, which become 0 in every path (so `sum` is always `Σ qs`).
///
/// # Panics
/// If `isa` is unavailable or the lengths disagree.
pub fn quantize_q8_with(isa: Isa, x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), out.len() * Q8_BLOCK, "activation length is not whole Q8 blocks");
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2");
            // The 512-bit form where the integer GEMM runs 512-bit VNNI kernels anyway: on an
            // AVX-512 CPU without VNNI (whose GEMM stays on AVX2) 512-bit work could lower the
            // clock for the kernels that follow, and that was not measured.
            if crate::cpu::GemmLevel::Avx512Vnni.available() {
                // SAFETY: AVX-512F (with the VNNI level) and F16C present (checked); lengths checked.
                unsafe { avx512::quantize(x, out) }
            } else {
                // SAFETY: AVX2, FMA and F16C present (checked above); lengths checked.
                unsafe { avx2::quantize(x, out) }
            }
        }
        _ => {
            for (blk, xs) in out.iter_mut().zip(x.chunks_exact(Q8_BLOCK)) {
                let (d, id) = scales(absmax(xs));
                let (sum, sum_lo) = round_block(xs, id, &mut blk.qs);
                blk.sum = sum as i16;
                blk.sum_lo = sum_lo as i16;
                blk.d = f16::from_f32(d).to_f32();
                blk.neg_dsum = -(blk.d * sum as f32);
                blk.s = f16::from_f32(sum as f32 * d).to_f32();
            }
        }
    }
}

/// A block's scale `d = amax / 127` and its inverse; a scale so small that its inverse
/// overflows quantizes the block to zeros.
#[inline]
fn scales(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, inverse(d))
}

/// `1 / d`, or 0 where `d` is 0 or so small that its inverse overflows (the values then
/// quantize to zeros).
#[inline]
fn inverse(d: f32) -> f32 {
    if d != 0.0 && (1.0 / d).is_finite() { 1.0 / d } else { 0.0 }
}

/// The largest |x| (NaNs skipped), the scalar levels' fold.
fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// `qs[i] = round(x[i] * id)` (half away from zero; NaN to 0 by `as`), the scalar levels'
/// rounding of one 32-value block; returns `Σ qs` and `Σ qs[..16]`.
fn round_block(x: &[f32], id: f32, qs: &mut [i8]) -> (i32, i32) {
    let (mut sum, mut sum_lo) = (0i32, 0i32);
    for (l, (q, &v)) in qs.iter_mut().zip(x).enumerate() {
        let r = (v * id).round() as i32;
        *q = r as i8;
        sum += r;
        if l == Q8_BLOCK / 2 - 1 {
            sum_lo = sum;
        }
    }
    (sum, sum_lo)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{scales, superblock_scales, Q8Block, Q8KBlock, Q8K_BLOCK, Q8_BLOCK};
    use crate::cpu::simd::hsum_epi32;
    use std::arch::x86_64::*;

    /// [`super::quantize_q8_with`] for AVX2: the block maximum of |x| in vector registers
    /// ([`absmax`]), and the f16 rounding of `d` and `s` by F16C (round to nearest even, as
    /// `half` rounds). The scalar fold's chain of dependent `maxss` was most of this
    /// function's time: ~6 us for eight tokens of a decode step's matrix input.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn quantize(x: &[f32], out: &mut [Q8Block]) {
        for (blk, xs) in out.iter_mut().zip(x.chunks_exact(Q8_BLOCK)) {
            let xs: &[f32; Q8_BLOCK] = xs.try_into().expect("32 values");
            let (d, id) = scales(absmax(xs));
            let (sum, sum_lo) = round_block(xs, id, &mut blk.qs);
            set_sums(blk, d, sum, sum_lo);
        }
    }

    /// A block's sums and its scale `d` and `d · Σ` rounded to f16 by F16C (round to nearest
    /// even, as `half` rounds).
    #[target_feature(enable = "f16c")]
    #[inline]
    pub(super) fn set_sums(blk: &mut Q8Block, d: f32, sum: i32, sum_lo: i32) {
        let h = _mm_cvtph_ps(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm_setr_ps(d, sum as f32 * d, 0.0, 0.0)));
        blk.sum = sum as i16;
        blk.sum_lo = sum_lo as i16;
        blk.d = _mm_cvtss_f32(h);
        blk.neg_dsum = -(blk.d * sum as f32);
        blk.s = _mm_cvtss_f32(_mm_shuffle_ps::<1>(h, h));
    }

    /// [`super::quantize_q8k_with`] for AVX2: [`quantize`]'s maximum and rounding, per
    /// 32-value block.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn quantize_k(x: &[f32], out: &mut [Q8KBlock]) {
        for (blk, xs) in out.iter_mut().zip(x.chunks_exact(Q8K_BLOCK)) {
            let mut amaxes = [0f32; Q8K_BLOCK / Q8_BLOCK];
            for (a, xs) in amaxes.iter_mut().zip(xs.chunks_exact(Q8_BLOCK)) {
                *a = absmax(xs);
            }
            let (d, shift, id) = superblock_scales(&amaxes);
            for (s, xs) in xs.chunks_exact(Q8_BLOCK).enumerate() {
                let q = (&mut blk.qs[Q8_BLOCK * s..Q8_BLOCK * (s + 1)]).try_into().expect("32 bytes");
                let (sum, sum_lo) = round_block(xs.try_into().expect("32 values"), id[s], q);
                blk.set_sums(s, shift[s], sum, sum_lo);
            }
            blk.d = d;
        }
    }

    /// The largest |x| of `x` (a multiple of 8 values) in vector registers; `vmaxps` takes
    /// the running maximum second, so a NaN is skipped as the scalar fold skips it.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn absmax(x: &[f32]) -> f32 {
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let mut m = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            let c: &[f32; 8] = c.try_into().expect("8 values");
            // SAFETY: `c` is 8 readable floats.
            m = _mm256_max_ps(_mm256_and_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, abs), m);
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
    }

    /// `qs[i] = round(x[i] * id)` (half away from zero, as `f32::round`); returns `Σ qs` and
    /// `Σ qs[..16]`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn round_block(x: &[f32; 32], id: f32, qs: &mut [i8; 32]) -> (i32, i32) {
        let sign = _mm256_set1_ps(-0.0);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        let mut ints = [_mm256_setzero_si256(); 4];
        for (i, v) in ints.iter_mut().enumerate() {
            let c: &[f32; 8] = x[8 * i..8 * i + 8].try_into().expect("8 values");
            // SAFETY: `c` is 8 readable floats.
            let p = _mm256_mul_ps(unsafe { _mm256_loadu_ps(c.as_ptr()) }, _mm256_set1_ps(id));
            // NaN to 0, as the scalar path's `as i32` makes it (`vcvtps2dq` would give i32::MIN).
            let p = _mm256_and_ps(p, _mm256_cmp_ps::<_CMP_ORD_Q>(p, p));
            // Truncate, then step one away from zero where the dropped fraction is >= 1/2
            // (exact: the fraction of a float below 2^23 is representable).
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
            let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(p, t));
            let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), _mm256_or_ps(_mm256_and_ps(p, sign), one));
            *v = _mm256_cvtps_epi32(_mm256_add_ps(t, step));
        }
        let lo = _mm256_add_epi32(ints[0], ints[1]);
        // SAFETY: this function runs with AVX2.
        let (sum_lo, sum) = unsafe { (hsum_epi32(lo), hsum_epi32(_mm256_add_epi32(lo, _mm256_add_epi32(ints[2], ints[3])))) };
        // i32 -> i16 -> i8 packs interleave the 128-bit halves; one permute restores the order.
        let w01 = _mm256_packs_epi32(ints[0], ints[1]);
        let w23 = _mm256_packs_epi32(ints[2], ints[3]);
        let b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: `qs` is 32 writable bytes.
        unsafe { _mm256_storeu_si256(qs.as_mut_ptr() as *mut __m256i, b) };
        (sum, sum_lo)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::set_sums;
    use super::{scales, Q8Block, Q8_BLOCK};
    use std::arch::x86_64::*;

    /// Blocks whose scales are made together, one lane each.
    const LANES: usize = 16;

    /// [`super::avx2::quantize`] with a block in two 512-bit registers and the scales of
    /// sixteen blocks made at once (their divisions and f16 roundings in one vector each,
    /// rather than a chain of scalar ones per block): the same maximum, the same rounding
    /// steps per value, exact integer sums and the same scalar formulas per lane, so the same
    /// bytes. Activation quantization was 2-2.5% of a prefill-heavy serving run on a Zen 5
    /// host, most of it on the engine thread.
    ///
    /// # Safety
    /// AVX-512F and F16C present.
    #[target_feature(enable = "avx512f,f16c")]
    pub unsafe fn quantize(x: &[f32], out: &mut [Q8Block]) {
        let n = out.len().min(x.len() / Q8_BLOCK);
        let whole = n / LANES * LANES;
        for (blks, xs) in out[..whole].chunks_exact_mut(LANES).zip(x.chunks_exact(LANES * Q8_BLOCK)) {
            // SAFETY: forwarded contract.
            unsafe { lanes(xs, blks) };
        }
        for (blk, xs) in out[whole..n].iter_mut().zip(x[whole * Q8_BLOCK..].chunks_exact(Q8_BLOCK)) {
            let xs: &[f32; Q8_BLOCK] = xs.try_into().expect("32 values");
            let (d, id) = scales(absmax(xs));
            let (sum, sum_lo) = round(xs, id, &mut blk.qs);
            set_sums(blk, d, sum, sum_lo);
        }
    }

    /// Sixteen blocks: maxima, then the scales in one vector, then each block's rounding,
    /// then the f16 scales and block sums in one vector.
    ///
    /// # Safety
    /// AVX-512F and F16C present; `x` holds 16 blocks of 32 values and `out` 16 blocks.
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn lanes(x: &[f32], out: &mut [Q8Block]) {
        let amax: [f32; LANES] = std::array::from_fn(|j| absmax(x[j * Q8_BLOCK..(j + 1) * Q8_BLOCK].try_into().expect("32 values")));
        // SAFETY: 16 floats each.
        let amax = unsafe { _mm512_loadu_ps(amax.as_ptr()) };
        // `scales` per lane: d = amax / 127, its inverse where that is finite and d nonzero.
        let d = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
        let inv = _mm512_div_ps(_mm512_set1_ps(1.0), d);
        let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(inv), _mm512_set1_epi32(0x7FFF_FFFF))), _mm512_set1_ps(f32::INFINITY));
        let id = _mm512_maskz_mov_ps(finite & _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(d, _mm512_setzero_ps()), inv);
        let mut ids = [0f32; LANES];
        // SAFETY: 16 writable floats.
        unsafe { _mm512_storeu_ps(ids.as_mut_ptr(), id) };
        let (mut sums, mut sums_lo) = ([0i32; LANES], [0i32; LANES]);
        for j in 0..LANES {
            let (sum, sum_lo) = round(x[j * Q8_BLOCK..(j + 1) * Q8_BLOCK].try_into().expect("32 values"), ids[j], &mut out[j].qs);
            (sums[j], sums_lo[j]) = (sum, sum_lo);
        }
        // SAFETY: 16 readable i32 each.
        let sum = _mm512_cvtepi32_ps(unsafe { _mm512_loadu_si512(sums.as_ptr() as *const __m512i) });
        let f16 = |v: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(v));
        let (dh, sh) = (f16(d), f16(_mm512_mul_ps(sum, d)));
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dh, sum)), _mm512_set1_epi32(i32::MIN)));
        let (mut dv, mut sv, mut nv) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
        // SAFETY: 16 writable floats each.
        unsafe {
            _mm512_storeu_ps(dv.as_mut_ptr(), dh);
            _mm512_storeu_ps(sv.as_mut_ptr(), sh);
            _mm512_storeu_ps(nv.as_mut_ptr(), neg);
        }
        for (j, blk) in out.iter_mut().enumerate() {
            blk.sum = sums[j] as i16;
            blk.sum_lo = sums_lo[j] as i16;
            blk.d = dv[j];
            blk.s = sv[j];
            blk.neg_dsum = nv[j];
        }
    }

    /// The largest |x| of a block; the running maximum second, as the AVX2 form, so NaNs are
    /// skipped.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn absmax(x: &[f32; Q8_BLOCK]) -> f32 {
        // SAFETY: `x` is 32 readable floats.
        let v = unsafe { [_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))] };
        let a = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFF_FFFF)));
        _mm512_reduce_max_ps(_mm512_max_ps(a(v[1]), _mm512_max_ps(a(v[0]), _mm512_setzero_ps())))
    }

    /// `qs[i] = round(x[i] * id)` (half away from zero, NaN to 0) by the AVX2 form's steps;
    /// returns `Σ qs` and `Σ qs[..16]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn round(x: &[f32; Q8_BLOCK], id: f32, qs: &mut [i8; Q8_BLOCK]) -> (i32, i32) {
        let sign = _mm512_set1_epi32(i32::MIN);
        let one = _mm512_set1_epi32(1f32.to_bits() as i32);
        // SAFETY: `x` is 32 readable floats.
        let v = unsafe { [_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))] };
        let ints = v.map(|v| {
            let p = _mm512_mul_ps(v, _mm512_set1_ps(id));
            // NaN to 0; truncate, then one step away from zero where the dropped fraction is
            // >= 1/2 (exact below 2^23).
            let p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(p, p), p);
            let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(p);
            let frac = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(_mm512_sub_ps(p, t))));
            let away = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(p), sign), one));
            let step = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5)), away);
            _mm512_cvtps_epi32(_mm512_add_ps(t, step))
        });
        let sum_lo = _mm512_reduce_add_epi32(ints[0]);
        // SAFETY: `qs` is 32 writable bytes; the values are within i8 (|q| <= 127).
        unsafe {
            _mm_storeu_si128(qs.as_mut_ptr() as *mut __m128i, _mm512_cvtsepi32_epi8(ints[0]));
            _mm_storeu_si128(qs.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(ints[1]));
        }
        (sum_lo + _mm512_reduce_add_epi32(ints[1]), sum_lo)
    }

    #[cfg(test)]
    mod tests {
        use super::super::{avx2, Q8Block, Q8_BLOCK};
        use rand::{Rng, SeedableRng};

        /// The AVX-512 form against the AVX2 one, byte for byte: random blocks at scales from
        /// tiny to huge, halves that round away from zero, zeros, NaNs, an infinity and a block
        /// whose scale's inverse overflows, both where sixteen blocks' scales are made
        /// together and in the tail. (The integration tests compare whichever form the CPU
        /// runs with the scalar quantizer.)
        #[test]
        fn avx512_form_equals_avx2_form() {
            if !(crate::cpu::Isa::Avx2.available() && crate::cpu::GemmLevel::Avx512Vnni.available()) {
                return;
            }
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(21);
            let special: Vec<f32> = [
                (0..Q8_BLOCK).map(|i| if i == 0 { 127.0 } else { i as f32 - 16.5 }).collect::<Vec<f32>>(),
                vec![0f32; Q8_BLOCK],
                (0..Q8_BLOCK).map(|i| if i % 5 == 2 { f32::NAN } else { i as f32 - 16.0 }).collect(),
                (0..Q8_BLOCK).map(|i| if i == 0 { 1e-38 } else { -1e-39 }).collect(),
                (0..Q8_BLOCK).map(|i| if i == 3 { f32::INFINITY } else { i as f32 }).collect(),
                // Scales f16 flushes to zero and rounds to infinity, with a negative zero.
                (0..Q8_BLOCK).map(|i| match i { 0 => 1e-6, 1 => -0.0, _ => 1e-6 * (i as f32 / 32.0 - 0.5) }).collect(),
                (0..Q8_BLOCK).map(|i| match i { 0 => 1e7, 1 => -0.0, _ => 1e7 * (i as f32 / 32.0 - 0.5) }).collect(),
            ]
            .concat();
            let mut random = |blocks: usize| -> Vec<f32> { (0..blocks * Q8_BLOCK).map(|i| r.gen_range(-1.0f32..1.0) * 10f32.powi((i / Q8_BLOCK) as i32 % 9 - 4)).collect() };
            // The special blocks among the first sixteen (scales made together) and again
            // in the tail past the last whole sixteen (scales made one at a time).
            let x: Vec<f32> = [special.clone(), random(57), special, random(3)].concat();
            assert_eq!(x.len() / Q8_BLOCK % super::LANES, 10);
            let n = x.len() / Q8_BLOCK;
            let (mut a, mut b) = (vec![Q8Block::default(); n], vec![Q8Block::default(); n]);
            // SAFETY: both levels' features present (checked above).
            unsafe {
                avx2::quantize(&x, &mut a);
                super::quantize(&x, &mut b);
            }
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert_eq!(
                    (a.qs, a.sum, a.sum_lo, a.d.to_bits(), a.s.to_bits(), a.neg_dsum.to_bits()),
                    (b.qs, b.sum, b.sum_lo, b.d.to_bits(), b.s.to_bits(), b.neg_dsum.to_bits()),
                    "block {i}"
                );
            }
            assert!(a.iter().any(|b| b.qs.iter().any(|&q| q == 127 || q == -127)), "no block reached the scale's end");
        }
    }
}
