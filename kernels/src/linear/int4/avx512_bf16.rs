//! AVX-512 BF16 kernels for W4A16 with bf16 activations (the checkpoint's 16-bit activation
//! type, what vLLM's Marlin kernels multiply): `vdpbf16ps` on 512-bit registers over the
//! interleaved layout, and the f32 → bf16 rounding of the activations.
//!
//! The kernel takes a row group's rows two at a time: run `j` of rows `2p, 2p + 1` is 32
//! contiguous bytes, which widen to 32 words (row `2p` in the low 256 bits). Each word's low
//! nibble (then, after a shift, its high nibble) plus the row's bias `8 - z` indexes a 32-entry
//! table holding `bf16(i - 16)`, so the word becomes `bf16(q - z)`, exact (|q - z| <= 15); one
//! `vdpbf16ps` against the token's 16 activations of those columns (broadcast to both halves)
//! adds two columns per lane, every product exact in f32 and only the sums rounding.
//!
//! Batch invariance: per `(row, token)` eight f32 lanes take, run by run of the current group
//! in column order, the low nibbles' then the high nibbles' pairs; at the group end (the row
//! end for a short last group) `total = fma(s[g], acc, total)`, and [`hsum`] sums the total's
//! lanes in one fixed tree. Row pairs and token blocks only choose how many of these
//! independent chains run side by side.

#![cfg(target_arch = "x86_64")]

use crate::cpu::simd::hsum;
use super::{Int4Matrix, ROW_GROUP, RUN, RUN_STRIDE};
use std::arch::x86_64::*;

/// Most tokens one pass over a row group serves (eight accumulators each).
const TOKENS: usize = 2;

/// Row pairs in a row group.
const PAIRS: usize = ROW_GROUP / 2;

/// How far ahead of the loads the weights are prefetched.
const PREFETCH: usize = 4096;

/// W4A16 rows `r0..r1` for `m` tokens of bf16 activations `xb` (bit patterns, `m × cols`)
/// into `out[(r - r0) * m + i]`.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 available ([`crate::cpu::caps::bf16_dot_available`]);
/// `r0 <= r1 <= w.rows()`, `xb.len() == m * w.cols()`, `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn int4_bf16(w: &Int4Matrix, r0: usize, r1: usize, xb: &[u16], m: usize, out: &mut [f32]) {
    if r0 == r1 {
        return;
    }
    let words: [u16; 32] = std::array::from_fn(|i| ((i as f32 - 16.0).to_bits() >> 16) as u16);
    // SAFETY: 32 words are 64 bytes.
    let table = unsafe { _mm512_loadu_si512(words.as_ptr().cast()) };
    let mut lanes = [0f32; 16];
    for rg in r0 / ROW_GROUP..(r1 - 1) / ROW_GROUP + 1 {
        let mut t0 = 0;
        while t0 < m {
            let t = (m - t0).min(TOKENS);
            // SAFETY: forwarded contract; tokens t0..t0 + t exist; row group rg exists.
            let totals = unsafe {
                match t {
                    1 => pad(group_tokens::<1>(w, &table, rg, xb, t0)),
                    _ => pad(group_tokens::<2>(w, &table, rg, xb, t0)),
                }
            };
            for (tt, pairs) in totals.iter().take(t).enumerate() {
                for (p, v) in pairs.iter().enumerate() {
                    // SAFETY: 16 floats into a 16-float array.
                    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr().cast(), *v) };
                    for (h, half) in lanes.chunks_exact(8).enumerate() {
                        let r = rg * ROW_GROUP + 2 * p + h;
                        if (r0..r1).contains(&r) {
                            // SAFETY: this function runs with AVX-512, which implies AVX.
                            out[(r - r0) * m + t0 + tt] = unsafe { hsum(_mm256_loadu_ps(half.as_ptr())) };
                        }
                    }
                }
            }
            t0 += t;
        }
    }
}

/// `T` results widened to [`TOKENS`] (the rest unused).
fn pad<const T: usize>(v: [[__m512; PAIRS]; T]) -> [[__m512; PAIRS]; TOKENS] {
    // SAFETY: an all-zero __m512 is a valid value.
    let mut out = [[unsafe { std::mem::zeroed::<__m512>() }; PAIRS]; TOKENS];
    out[..T].copy_from_slice(&v);
    out
}

/// Row group `rg` against tokens `t0..t0 + T`: per token and row pair the 8-lane totals
/// `Σ_g s[g] · acc_g` of its two rows (row `2 p` in the low half).
///
/// # Safety
/// As [`int4_bf16`], with tokens `t0..t0 + T` present and `rg` a row group of `w`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::needless_range_loop)] // `p` also addresses the packed rows
unsafe fn group_tokens<const T: usize>(w: &Int4Matrix, table: &__m512i, rg: usize, x: &[u16], t0: usize) -> [[__m512; PAIRS]; T] {
    let (k, group) = (w.cols(), w.group().min(w.cols()));
    let base = w.row_ptr(rg * ROW_GROUP);
    let xp = x.as_ptr();
    let nib = _mm512_set1_epi16(0x0F);
    // Lane l of pair p's vectors belongs to row 2p + l / 8 (scales) or 2p + l / 16 (words).
    let scale_at: [__m512i; PAIRS] = std::array::from_fn(|p| _mm512_add_epi32(_mm512_set1_epi32(2 * p as i32), _mm512_srli_epi32::<3>(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))));
    let mut total = [[_mm512_setzero_ps(); PAIRS]; T];
    for g in 0..w.groups() {
        let (j0, j1) = (g * group / RUN, ((g + 1) * group).min(k) / RUN);
        // SAFETY: 16 scales; 16 zero points widened to 32-bit lanes.
        let (s16, z16) = unsafe {
            (_mm512_loadu_ps(w.group_scales(rg, g).as_ptr()), _mm512_cvtepi8_epi32(_mm_loadu_si128(w.group_zeros(rg, g).as_ptr().cast())))
        };
        // The table index of code n is n + 8 - z (1..=31), table word i being bf16(i - 16).
        let bias16 = _mm512_sub_epi32(_mm512_set1_epi32(8), z16);
        let mut acc = [[_mm512_setzero_ps(); PAIRS]; T];
        for j in j0..j1 {
            // SAFETY: token t0 + t's columns j*32..j*32+32 lie inside x.
            let xa: [(__m512bh, __m512bh); T] = std::array::from_fn(|t| unsafe {
                let xa = xp.add((t0 + t) * k + j * RUN);
                (bh(_mm512_broadcast_i64x4(_mm256_loadu_si256(xa.cast()))), bh(_mm512_broadcast_i64x4(_mm256_loadu_si256(xa.add(16).cast()))))
            });
            for p in 0..PAIRS {
                if p % 2 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(j * RUN_STRIDE + 32 * p + PREFETCH).cast());
                }
                // Pair p's bias per word: the 32-bit lanes 2p, 2p + 1 of `bias16` spread over the halves.
                let bias = _mm512_permutexvar_epi32(scale_at[p], bias16);
                let bias = _mm512_or_si512(bias, _mm512_slli_epi32::<16>(bias));
                // SAFETY: run j of rows 2p, 2p + 1 of the group: 32 bytes inside the packed data.
                let v = _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(base.add(j * RUN_STRIDE + 32 * p).cast()) });
                let lo = bh(_mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_and_si512(v, nib), bias), *table));
                let hi = bh(_mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16::<4>(v), bias), *table));
                for (a, (xl, xh)) in acc.iter_mut().zip(&xa) {
                    a[p] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[p], lo, *xl), hi, *xh);
                }
            }
        }
        for (tot, a) in total.iter_mut().zip(&acc) {
            for p in 0..PAIRS {
                tot[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(scale_at[p], s16), a[p], tot[p]);
            }
        }
    }
    total
}

/// The same 512 bits as 32 bf16 values.
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are plain 512-bit vectors.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// `out[i]` = the bf16 bits of `x[i]`, rounded to nearest even with subnormal inputs taken as
/// zero (`vcvtneps2bf16`, 16 at a time); equal to [`crate::linear::act::round_bf16_scalar`].
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 available; `x.len() == out.len()`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn round_bf16(x: &[f32], out: &mut [u16]) {
    let mut xc = x.chunks_exact(16);
    let mut oc = out.chunks_exact_mut(16);
    for (xs, os) in (&mut xc).zip(&mut oc) {
        // SAFETY: 16 floats in, 16 words out.
        unsafe {
            let v = _mm512_cvtneps_pbh(_mm512_loadu_ps(xs.as_ptr()));
            _mm256_storeu_si256(os.as_mut_ptr().cast(), std::mem::transmute::<__m256bh, __m256i>(v));
        }
    }
    for (o, &v) in oc.into_remainder().iter_mut().zip(xc.remainder()) {
        *o = crate::linear::act::round_bf16_scalar(v);
    }
}
