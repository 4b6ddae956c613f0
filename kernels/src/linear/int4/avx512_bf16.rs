//! AVX-512 BF16 kernels for W4A16 with bf16 activations (the checkpoint's 16-bit activation
//! type, what vLLM's Marlin kernels multiply): `vdpbf16ps` on 256-bit registers, and the
//! f32 → bf16 rounding of the activations.
//!
//! Per 32-column run of a row, the 16 packed bytes widen to 16 words; `vpermw` maps each
//! word's low nibble (then, after a shift, its high nibble) through a 16-entry table to
//! `bf16(n - 8 - z)`, which is exact (|n - 8 - z| <= 15), so every product `(q - z) · x` is
//! exact in f32 and only the sums round. A row's table changes only with its zero point, so
//! the sixteen tables (one per zero point) are built once per call.
//!
//! Batch invariance: per `(row, token)` two 8-lane accumulators take the low and high nibbles
//! of each run of the current group in column order; at the group end (the row end for a
//! short last group) `total = fma(s[g], lo + hi, total)`, and [`hsum`] sums the total's
//! lanes in one fixed tree. Row and token tiles only choose how many of these independent
//! chains run side by side.

#![cfg(target_arch = "x86_64")]

use crate::cpu::simd::hsum;
use super::{Int4Matrix, RUN};
use std::arch::x86_64::*;

/// Most tokens one block serves.
const TOKENS: usize = 8;

/// W4A16 rows `r0..r1` for `m` tokens of bf16 activations `xb` (bit patterns, `m × cols`)
/// into `out[(r - r0) * m + i]`.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 available ([`crate::cpu::caps::bf16_dot_available`]);
/// `r0 <= r1 <= w.rows()`, `xb.len() == m * w.cols()`, `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn int4_bf16(w: &Int4Matrix, r0: usize, r1: usize, xb: &[u16], m: usize, out: &mut [f32]) {
    let tables = value_tables();
    let mut t0 = 0;
    while t0 < m {
        let t = (m - t0).min(TOKENS);
        // Few tokens: several rows side by side keep enough independent dot chains in flight.
        // SAFETY: forwarded contract; tokens t0..t0 + t exist.
        unsafe {
            match t {
                1 => bf16_block::<4, 1>(w, &tables, r0, r1, xb, m, t0, out),
                2 => bf16_block::<2, 2>(w, &tables, r0, r1, xb, m, t0, out),
                3 => bf16_block::<2, 3>(w, &tables, r0, r1, xb, m, t0, out),
                4 => bf16_block::<2, 4>(w, &tables, r0, r1, xb, m, t0, out),
                5 => bf16_block::<1, 5>(w, &tables, r0, r1, xb, m, t0, out),
                6 => bf16_block::<1, 6>(w, &tables, r0, r1, xb, m, t0, out),
                7 => bf16_block::<1, 7>(w, &tables, r0, r1, xb, m, t0, out),
                _ => bf16_block::<1, 8>(w, &tables, r0, r1, xb, m, t0, out),
            }
        }
        t0 += t;
    }
}

/// `tables[z + 8]`: word `n` (0..=15, a stored nibble `q + 8`) holds the bf16 bits of
/// `n - 8 - z`, the dequantized integer for zero point `z`.
#[target_feature(enable = "avx2")]
fn value_tables() -> [__m256i; 16] {
    std::array::from_fn(|zi| {
        let words: [u16; 16] = std::array::from_fn(|n| ((n as f32 - zi as f32).to_bits() >> 16) as u16);
        // SAFETY: 16 words are 32 bytes.
        unsafe { _mm256_loadu_si256(words.as_ptr().cast()) }
    })
}

/// Tokens `t0..t0 + T` against rows `r0..r1`, `R` rows per micro-kernel call.
///
/// # Safety
/// As [`int4_bf16`], with `t0 + T <= m`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)] // the row-kernel signature plus the tables and token block
unsafe fn bf16_block<const R: usize, const T: usize>(
    w: &Int4Matrix,
    tables: &[__m256i; 16],
    r0: usize,
    r1: usize,
    xb: &[u16],
    m: usize,
    t0: usize,
    out: &mut [f32],
) {
    let k = w.cols();
    let xt = &xb[t0 * k..(t0 + T) * k];
    let mut r = r0;
    while r + R <= r1 {
        // SAFETY: rows r..r + R exist; `xt` holds T tokens.
        let totals = unsafe { bf16_micro::<R, T>(w, tables, r, xt) };
        for (rr, row) in totals.iter().enumerate() {
            for (t, &v) in row.iter().enumerate() {
                // SAFETY: this function runs with AVX-512, which implies AVX.
                out[(r + rr - r0) * m + t0 + t] = unsafe { hsum(v) };
            }
        }
        r += R;
    }
    while r < r1 {
        // SAFETY: as above, one row.
        let totals = unsafe { bf16_micro::<1, T>(w, tables, r, xt) };
        for (t, &v) in totals[0].iter().enumerate() {
            // SAFETY: as above.
            out[(r - r0) * m + t0 + t] = unsafe { hsum(v) };
        }
        r += 1;
    }
}

/// Rows `r..r + R` against the `T` activation rows of `x` (stride `cols`): the 8-lane totals
/// `Σ_g s[g] · (lo + hi)` per (row, token).
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 available; `r + R <= w.rows()`; `x.len() == T * w.cols()`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn bf16_micro<const R: usize, const T: usize>(w: &Int4Matrix, tables: &[__m256i; 16], r: usize, x: &[u16]) -> [[__m256; T]; R] {
    let (k, group) = (w.cols(), w.group());
    let rows: [*const u8; R] = std::array::from_fn(|rr| w.packed_row(r + rr).as_ptr());
    let xp = x.as_ptr();
    let mut total = [[_mm256_setzero_ps(); T]; R];
    let (mut g, mut g0) = (0, 0);
    while g0 < k {
        let g1 = (g0 + group).min(k);
        let tbl: [__m256i; R] = std::array::from_fn(|rr| tables[(8 + w.row_zeros(r + rr).map_or(0, |z| z[g])) as usize]);
        let mut lo_acc = [[_mm256_setzero_ps(); T]; R];
        let mut hi_acc = [[_mm256_setzero_ps(); T]; R];
        for c in (g0..g1).step_by(RUN) {
            for rr in 0..R {
                // SAFETY: row rr's packed bytes c/2..c/2 + 16 exist (c + 32 <= cols); byte j
                // holds column c + j (low nibble) and c + 16 + j (high nibble). `vpermw` on
                // 256 bits reads only the low 4 bits of each index word.
                let (lo, hi) = unsafe {
                    let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(rows[rr].add(c / 2).cast()));
                    (
                        bh(_mm256_permutexvar_epi16(v, tbl[rr])),
                        bh(_mm256_permutexvar_epi16(_mm256_srli_epi16::<4>(v), tbl[rr])),
                    )
                };
                for t in 0..T {
                    // SAFETY: token t's columns c..c + 32 lie inside x (t < T, c + 32 <= k).
                    unsafe {
                        let xa = xp.add(t * k + c);
                        lo_acc[rr][t] = _mm256_dpbf16_ps(lo_acc[rr][t], lo, bh(_mm256_loadu_si256(xa.cast())));
                        hi_acc[rr][t] = _mm256_dpbf16_ps(hi_acc[rr][t], hi, bh(_mm256_loadu_si256(xa.add(16).cast())));
                    }
                }
            }
        }
        for rr in 0..R {
            let sc = _mm256_set1_ps(w.row_scales(r + rr)[g]);
            for t in 0..T {
                total[rr][t] = _mm256_fmadd_ps(sc, _mm256_add_ps(lo_acc[rr][t], hi_acc[rr][t]), total[rr][t]);
            }
        }
        (g, g0) = (g + 1, g1);
    }
    total
}

/// The same 256 bits as 16 bf16 values.
#[inline(always)]
fn bh(v: __m256i) -> __m256bh {
    // SAFETY: both are plain 256-bit vectors.
    unsafe { std::mem::transmute::<__m256i, __m256bh>(v) }
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
