//! The small-batch path of float weight rows (F32, F16, BF16) on AVX2: each weight is
//! converted to f32 in a register (a copy, `vcvtph2ps`, or a 16-bit shift) and multiplied
//! straight away, instead of dequantizing the row into a buffer and reading it back.
//!
//! Numerics: per (row, token) the operations of [`crate::cpu::dot::dot_f32`] over the
//! dequantized row, in its order (four 8-lane FMA chains over 32-column steps, then 8-column
//! steps into the first, the same reduction, a scalar tail), on the same f32 values (every
//! conversion is exact). So the results are the dequantize-then-dot path's bits, whatever the
//! number of rows taken together. Four rows share a pass, so sixteen chains are in flight,
//! and the rows are prefetched ahead of the loads: a Hugging Face checkpoint's BF16 output
//! head is the largest matrix a decode step reads.

#![cfg(target_arch = "x86_64")]

use super::WeightView;
use crate::cpu::simd::hsum;
use crate::ggml::GgmlType;
use std::arch::x86_64::*;

/// Rows per pass.
const ROWS: usize = 4;

/// How far ahead of the loads (bytes) the rows are prefetched.
const PREFETCH: usize = 2048;

/// Whether [`dot_rows`] takes weights of type `ty`.
pub(crate) fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// `emit(r, i, Σ_c W[r, c] · x[i, c])` for rows `r0..r1` and each token `i` of `tokens`
/// (`x` holds the tokens' rows, `k` values each).
///
/// # Safety
/// AVX2, FMA and F16C available; `w`'s type is one [`supports`] takes; `r1 <= w.rows()`; each
/// token's `k` values lie inside `x`, `k == w.cols()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows(w: &WeightView<'_>, r0: usize, r1: usize, x: &[f32], tokens: &[usize], mut emit: impl FnMut(usize, usize, f32)) {
    let k = w.cols;
    let mut r = r0;
    while r < r1 {
        let n = (r1 - r).min(ROWS);
        let rows: [*const u8; ROWS] = std::array::from_fn(|j| w.row(r + j.min(n - 1)).as_ptr());
        for &i in tokens {
            let xi = &x[i * k..(i + 1) * k];
            // SAFETY: forwarded contract: each row holds k values of the type; xi holds k.
            let sums = unsafe {
                match w.ty {
                    GgmlType::F32 => dots::<0>(rows, xi),
                    GgmlType::F16 => dots::<1>(rows, xi),
                    _ => dots::<2>(rows, xi),
                }
            };
            for (j, &s) in sums.iter().take(n).enumerate() {
                emit(r + j, i, s);
            }
        }
        r += n;
    }
}

/// Eight values of a row at value offset `o` as f32: `T` 0 for F32, 1 for F16, 2 for BF16.
///
/// # Safety
/// F16C and AVX2 available; values `o..o + 8` of the row at `p` are readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<const T: u8>(p: *const u8, o: usize) -> __m256 {
    // SAFETY: caller's contract (8 values at o).
    unsafe {
        match T {
            0 => _mm256_loadu_ps(p.add(4 * o).cast()),
            1 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * o).cast())),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * o).cast())))),
        }
    }
}

/// Value `o` of a row as f32 (the scalar tail).
///
/// # Safety
/// Value `o` of the row at `p` is readable.
unsafe fn load1<const T: u8>(p: *const u8, o: usize) -> f32 {
    // SAFETY: caller's contract.
    unsafe {
        match T {
            0 => p.add(4 * o).cast::<f32>().read_unaligned(),
            1 => half::f16::from_bits(p.add(2 * o).cast::<u16>().read_unaligned()).to_f32(),
            _ => f32::from_bits(u32::from(p.add(2 * o).cast::<u16>().read_unaligned()) << 16),
        }
    }
}

/// The dot products of [`ROWS`] rows with `x`, each as `dot_f32` computes it.
///
/// # Safety
/// As [`load8`] for every row, over `x.len()` values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots<const T: u8>(rows: [*const u8; ROWS], x: &[f32]) -> [f32; ROWS] {
    let n = x.len();
    let xp = x.as_ptr();
    let bytes = if T == 0 { 4 } else { 2 };
    let mut acc = [[_mm256_setzero_ps(); 4]; ROWS];
    let mut i = 0;
    // SAFETY: every load is within 0..n (loop bounds); prefetches are hints.
    unsafe {
        while i + 32 <= n {
            for (row, acc) in rows.iter().zip(acc.iter_mut()) {
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(bytes * i + PREFETCH).cast());
                for (u, acc) in acc.iter_mut().enumerate() {
                    let o = i + 8 * u;
                    *acc = _mm256_fmadd_ps(load8::<T>(*row, o), _mm256_loadu_ps(xp.add(o)), *acc);
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            for (row, acc) in rows.iter().zip(acc.iter_mut()) {
                acc[0] = _mm256_fmadd_ps(load8::<T>(*row, i), _mm256_loadu_ps(xp.add(i)), acc[0]);
            }
            i += 8;
        }
        std::array::from_fn(|j| {
            let a = &acc[j];
            let mut total = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
            for c in i..n {
                total += load1::<T>(rows[j], c) * *xp.add(c);
            }
            total
        })
    }
}
