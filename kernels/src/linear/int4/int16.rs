//! The AVX2 W4A16 kernel with int16 activations (per token and scale group, [`ActQuant`]'s
//! `Int16PerGroup`): 16-bit activations on CPUs without a bf16 dot, with integer products.
//!
//! Each row's run of 32 columns (16 bytes) widens to sixteen 16-bit words with one
//! `vpmovzxbw`; the low nibbles (columns `0..16`) and the words shifted right by four (columns
//! `16..32`, already in `0..=15`) go into two `vpmaddwd` against the token's activation codes
//! of those columns, loaded straight from memory. A micro-kernel keeps eight accumulators,
//! `R` rows by `T` tokens (8 x 1, 4 x 2 or 2 x 4), so every unpacked run serves `T` tokens,
//! and at a group end one transpose-and-add ([`reduce8`]) turns them into eight exact group
//! sums.
//!
//! Numerics, per row and token, group by group in order: `isum = Σ n · a − (8 + z) Σ a` in
//! int32 (`n = q + 8` the stored code, exact: [`crate::linear::act::int16_limit`] bounds every
//! partial sum), then `acc = fma(s · sa, f32(isum), acc)` with `s` the row's group scale and
//! `sa` the token's group scale, and `out = acc`. [`Int4Matrix::rows_int16_scalar`] performs
//! the same operations, so the results are its bits whatever the tile, batch or row range.
//!
//! [`ActQuant`]: crate::linear::ActQuant

#![cfg(target_arch = "x86_64")]

use super::{Int4Matrix, ROW_GROUP, RUN, RUN_STRIDE};
use crate::linear::int_dot_avx2::reduce8;
use std::arch::x86_64::*;

/// How far ahead of the loads the weights are prefetched.
const PREFETCH: usize = 4096;

/// Most passes over a row group (its 16 rows, 2 at a time).
const PASSES: usize = 8;

/// 32 bytes at any alignment.
#[derive(Clone, Copy)]
#[repr(C, packed)]
struct Unaligned(__m256i);

/// The 16 codes at `p`, read afresh at every use (a volatile read): LLVM would otherwise keep
/// each token's activations in registers across the tile's rows, and with eight accumulators
/// they spill; read per use, they fold into `vpmaddwd`'s memory operand (the 2 x 4 tile:
/// 34.2 -> 38.8 G multiply-adds/s in `prefill_2048x2048`, one thread).
///
/// # Safety
/// `p` points to 32 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load_per_use(p: *const i16) -> __m256i {
    // SAFETY: 32 readable bytes (caller's contract); `Unaligned` has alignment 1.
    unsafe { std::ptr::read_volatile(p.cast::<Unaligned>()).0 }
}

/// Int16 activations of `m` tokens, as [`crate::linear::rowwise::Prepared`] holds them.
#[derive(Clone, Copy)]
pub(crate) struct Int16Act<'a> {
    /// Codes, `m × cols`.
    pub q: &'a [i16],
    /// Scales, `m × groups`.
    pub scales: &'a [f32],
    /// Sums of each group's codes, `m × groups`.
    pub sums: &'a [i32],
}

/// W4A16 rows `r0..r1` for `m` tokens of `x` into `out[(r - r0) * m + i]`, bit-identical to
/// [`Int4Matrix::rows_int16_scalar`].
///
/// # Safety
/// AVX2+FMA available; `r0 <= r1 <= w.rows()`, `x.q.len() == m * w.cols()`,
/// `x.scales.len() == x.sums.len() == m * w.groups()`, `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn int4_int16(w: &Int4Matrix, r0: usize, r1: usize, x: Int16Act<'_>, m: usize, out: &mut [f32]) {
    if r0 == r1 {
        return;
    }
    let mut lanes = [0f32; 8];
    for rg in r0 / ROW_GROUP..(r1 - 1) / ROW_GROUP + 1 {
        let mut t0 = 0;
        while t0 < m {
            // Tiles of 8 rows x 1 token, 4 x 2 or 2 x 4: eight accumulators.
            let t = match m - t0 {
                1 => 1,
                2 | 3 => 2,
                _ => 4,
            };
            let mut totals = [_mm256_setzero_ps(); PASSES];
            // SAFETY: forwarded contract; tokens t0..t0 + t exist; row group rg exists.
            unsafe {
                match t {
                    1 => group_rows::<1, 8>(w, rg, x, t0, &mut totals),
                    2 => group_rows::<2, 4>(w, rg, x, t0, &mut totals),
                    _ => group_rows::<4, 2>(w, rg, x, t0, &mut totals),
                }
            }
            let rows_per_pass = 8 / t;
            for (p, v) in totals.iter().take(ROW_GROUP / rows_per_pass).enumerate() {
                // SAFETY: 8 floats into an 8-float array.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *v) };
                for (l, &y) in lanes.iter().enumerate() {
                    let r = rg * ROW_GROUP + p * rows_per_pass + l / t;
                    if (r0..r1).contains(&r) {
                        out[(r - r0) * m + t0 + l % t] = y;
                    }
                }
            }
            t0 += t;
        }
    }
}

/// Row group `rg` against tokens `t0..t0 + T`, in `16 / R` passes of `R` rows (at most
/// [`PASSES`]): `totals[p]` lane `l` gets row `p · R + l / T`, token `t0 + l % T`.
///
/// # Safety
/// As [`int4_int16`], with tokens `t0..t0 + T` present, `rg` a row group of `w`, `R · T = 8`.
#[target_feature(enable = "avx2,fma")]
unsafe fn group_rows<const T: usize, const R: usize>(w: &Int4Matrix, rg: usize, x: Int16Act<'_>, t0: usize, totals: &mut [__m256; PASSES]) {
    debug_assert_eq!(R * T, 8);
    let (k, ng, group) = (w.cols(), w.groups(), w.group().min(w.cols()));
    let base = w.row_ptr(rg * ROW_GROUP);
    let xp = x.q.as_ptr();
    // Hidden from the optimizer: seeing constants, LLVM narrows the nibble mask and shift to
    // bytes before the widening, two more instructions per run than widen-mask-shift.
    let nib = std::hint::black_box(_mm256_set1_epi16(0x0F));
    let four = std::hint::black_box(_mm_cvtsi32_si128(4));
    // Lane l of a pass's vectors belongs to row l / T of the pass and token l % T.
    let row_of: [i32; 8] = std::array::from_fn(|l| (l / T) as i32);
    // SAFETY: 8 ints are 32 bytes.
    let row_idx = unsafe { _mm256_loadu_si256(row_of.as_ptr().cast()) };
    for g in 0..ng {
        let sa: [f32; 8] = std::array::from_fn(|l| x.scales[(t0 + l % T) * ng + g]);
        let sums: [i32; 8] = std::array::from_fn(|l| x.sums[(t0 + l % T) * ng + g]);
        // SAFETY: 8 floats and 8 ints.
        let (sa, asum) = unsafe { (_mm256_loadu_ps(sa.as_ptr()), _mm256_loadu_si256(sums.as_ptr().cast())) };
        let (scales, zeros) = (w.group_scales(rg, g), w.group_zeros(rg, g));
        let (j0, j1) = (g * group / RUN, ((g + 1) * group).min(k) / RUN);
        for (p, total) in totals.iter_mut().take(ROW_GROUP / R).enumerate() {
            let mut acc = [_mm256_setzero_si256(); 8];
            for j in j0..j1 {
                let run = base.wrapping_add(j * RUN_STRIDE);
                if p == 0 {
                    // Decode streams the weights from DRAM: ask for run j's four lines
                    // PREFETCH bytes ahead (a hint; an address past the data is never read).
                    for line in 0..RUN_STRIDE / 64 {
                        _mm_prefetch::<_MM_HINT_T0>(run.wrapping_add(64 * line + PREFETCH).cast());
                    }
                }
                for r in 0..R {
                    // SAFETY: run j of row p·R + r of the group: 16 bytes inside the packed data.
                    let v = unsafe { _mm256_cvtepu8_epi16(_mm_loadu_si128(run.add((p * R + r) * RUN / 2).cast())) };
                    let (lo, hi) = (_mm256_and_si256(v, nib), _mm256_srl_epi16(v, four));
                    for t in 0..T {
                        // SAFETY: token t0 + t's columns j*32..j*32+32 lie inside x.q.
                        let (a, b) = unsafe {
                            let xa = xp.add((t0 + t) * k + j * RUN);
                            (load_per_use(xa), load_per_use(xa.add(16)))
                        };
                        let prod = _mm256_add_epi32(_mm256_madd_epi16(lo, a), _mm256_madd_epi16(hi, b));
                        acc[r * T + t] = _mm256_add_epi32(acc[r * T + t], prod);
                    }
                }
            }
            // The pass's rows' scales and 8 + zero points, lane l taking row p·R + l / T.
            let first = p * R;
            let half = first / 8 * 8;
            let idx = _mm256_add_epi32(row_idx, _mm256_set1_epi32((first - half) as i32));
            // SAFETY: 8 scales and 8 zero points from `half`, inside the group's 16.
            let (s, z) = unsafe {
                let s = _mm256_loadu_ps(scales.as_ptr().add(half));
                let z = _mm256_cvtepi8_epi32(_mm_loadl_epi64(zeros.as_ptr().add(half).cast()));
                (_mm256_permutevar8x32_ps(s, idx), _mm256_permutevar8x32_epi32(_mm256_add_epi32(z, _mm256_set1_epi32(8)), idx))
            };
            let isum = _mm256_sub_epi32(reduce8(&acc), _mm256_mullo_epi32(z, asum));
            *total = _mm256_fmadd_ps(_mm256_mul_ps(s, sa), _mm256_cvtepi32_ps(isum), *total);
        }
    }
}
