//! The AVX-512 VNNI W4A8 kernel over the interleaved layout: sixteen rows at a time.
//!
//! A 64-byte load at run `j` of a row group holds that run of four rows (one per 128-bit
//! lane), so its low nibbles (columns `0..16` of each row) and high nibbles (`16..32`) go
//! straight into `vpdpbusd` against the token's 16 activation bytes of those columns broadcast
//! to every lane. Each 32-bit lane then holds a partial sum of four columns of one row; at a
//! group end a 4 x 4 transpose-and-add folds the four 64-byte accumulators into one vector of
//! sixteen row sums, lane `l` holding row `4 (l % 4) + l / 4` of the group ([`lane_row`]).
//!
//! Numerics: the sums are the exact integers `Σ n · a` (`n = q + 8`), made `Σ (q - z) a` by
//! subtracting `(8 + z) Σ a`; then, per group in order, `acc = acc + s · isum` (a product then a
//! sum, as the scalar kernel's `acc += s * dot`) and `out = xs · acc`. These are the scalar
//! kernel's operations on the same values, so the results are its bits.

#![cfg(target_arch = "x86_64")]

use super::{Int4Matrix, ROW_GROUP, RUN, RUN_STRIDE};
use std::arch::x86_64::*;

/// Most tokens one pass over a row group serves (4 accumulators each, plus the decoded run).
const TOKENS: usize = 4;

/// How far ahead of the loads the weights are prefetched.
const PREFETCH: usize = 4096;

/// The row of its group that lane `l` of a folded sum holds.
pub(crate) const fn lane_row(l: usize) -> usize {
    4 * (l % 4) + l / 4
}

/// W4A8 rows `r0..r1` for `m` tokens (`xq` int8, `xs` token scales, `asum` the per-token,
/// per-group activation sums `Σ a`) into `out[(r - r0) * m + i]`, bit-identical to
/// [`Int4Matrix::rows_int8_scalar`](crate::linear::Int8Rows::rows_int8_scalar).
///
/// # Safety
/// AVX-512 F/BW/VNNI available; `r0 <= r1 <= w.rows()`, `xq.len() == m * w.cols()`,
/// `xs.len() == m`, `asum.len() == m * w.groups()`, `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)] // the row-kernel signature plus the activation sums
pub(crate) unsafe fn int4_int8(w: &Int4Matrix, r0: usize, r1: usize, xq: &[i8], xs: &[f32], asum: &[i32], m: usize, out: &mut [f32]) {
    if r0 == r1 {
        return;
    }
    let mut lanes = [0f32; ROW_GROUP];
    for rg in r0 / ROW_GROUP..(r1 - 1) / ROW_GROUP + 1 {
        let mut t0 = 0;
        while t0 < m {
            let t = (m - t0).min(TOKENS);
            // SAFETY: forwarded contract; tokens t0..t0 + t exist; row group rg exists.
            let totals = unsafe {
                match t {
                    1 => pad(group_rows::<1>(w, rg, xq, xs, asum, t0)),
                    2 => pad(group_rows::<2>(w, rg, xq, xs, asum, t0)),
                    3 => pad(group_rows::<3>(w, rg, xq, xs, asum, t0)),
                    _ => pad(group_rows::<4>(w, rg, xq, xs, asum, t0)),
                }
            };
            for (tt, v) in totals.iter().take(t).enumerate() {
                // SAFETY: 16 floats into a 16-float array.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *v) };
                for (l, &y) in lanes.iter().enumerate() {
                    let r = rg * ROW_GROUP + lane_row(l);
                    if (r0..r1).contains(&r) {
                        out[(r - r0) * m + t0 + tt] = y;
                    }
                }
            }
            t0 += t;
        }
    }
}

/// `T` results widened to [`TOKENS`] (the rest unused).
fn pad<const T: usize>(v: [__m512; T]) -> [__m512; TOKENS] {
    // SAFETY: an all-zero __m512 is a valid value.
    let mut out = [unsafe { std::mem::zeroed::<__m512>() }; TOKENS];
    out[..T].copy_from_slice(&v);
    out
}

/// Row group `rg` against tokens `t0..t0 + T`: per token the 16 results `xs · Σ_g s · isum`,
/// in lane order.
///
/// # Safety
/// As [`int4_int8`], with tokens `t0..t0 + T` present and `rg` a row group of `w`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
#[allow(clippy::needless_range_loop)] // `p` also addresses the packed rows
unsafe fn group_rows<const T: usize>(
    w: &Int4Matrix,
    rg: usize,
    xq: &[i8],
    xs: &[f32],
    asum: &[i32],
    t0: usize,
) -> [__m512; T] {
    let (k, ng, group) = (w.cols(), w.groups(), w.group().min(w.cols()));
    let base = w.row_ptr(rg * ROW_GROUP);
    let xp = xq.as_ptr();
    let nib = _mm512_set1_epi8(0x0F);
    // The folded sums' lane order: lane l holds row lane_row(l) of the group.
    let rows: [i32; ROW_GROUP] = std::array::from_fn(|l| lane_row(l) as i32);
    // SAFETY: 16 ints are 64 bytes.
    let order = unsafe { _mm512_loadu_si512(rows.as_ptr().cast()) };
    let mut acc = [_mm512_setzero_ps(); T];
    for g in 0..ng {
        // SAFETY: 16 scales; 16 zero points widened to 32-bit lanes.
        let (scale, zoff) = unsafe {
            let s = _mm512_loadu_ps(w.group_scales(rg, g).as_ptr());
            let z = _mm512_cvtepi8_epi32(_mm_loadu_si128(w.group_zeros(rg, g).as_ptr().cast()));
            (_mm512_permutexvar_ps(order, s), _mm512_permutexvar_epi32(order, _mm512_add_epi32(_mm512_set1_epi32(8), z)))
        };
        let (j0, j1) = (g * group / RUN, ((g + 1) * group).min(k) / RUN);
        let mut sums = [[_mm512_setzero_si512(); 4]; T];
        for j in j0..j1 {
            // SAFETY: token t's columns j*32..j*32+32 lie inside xq (j < cols / 32, t < T).
            let xa: [(__m512i, __m512i); T] = std::array::from_fn(|t| unsafe {
                let a = xp.add((t0 + t) * k + j * RUN);
                (_mm512_broadcast_i32x4(_mm_loadu_si128(a.cast())), _mm512_broadcast_i32x4(_mm_loadu_si128(a.add(16).cast())))
            });
            for p in 0..4 {
                // Decode streams the weights from DRAM: ask for them PREFETCH bytes ahead
                // (a hint; an address past the data is never dereferenced).
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(j * RUN_STRIDE + 64 * p + PREFETCH).cast());
                // SAFETY: run j of rows 4p..4p+4 of the group: 64 bytes inside the packed data.
                let v = unsafe { _mm512_loadu_si512(base.add(j * RUN_STRIDE + 64 * p).cast()) };
                let (lo, hi) = (_mm512_and_si512(v, nib), _mm512_and_si512(_mm512_srli_epi16::<4>(v), nib));
                for (t, (xl, xh)) in xa.iter().enumerate() {
                    sums[t][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[t][p], lo, *xl), hi, *xh);
                }
            }
        }
        for (t, s) in sums.iter().enumerate() {
            let isum = _mm512_sub_epi32(fold(s), _mm512_mullo_epi32(zoff, _mm512_set1_epi32(asum[(t0 + t) * ng + g])));
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(isum)));
        }
    }
    std::array::from_fn(|t| _mm512_mul_ps(_mm512_set1_ps(xs[t0 + t]), acc[t]))
}

/// Four accumulators of four rows each (one row per 128-bit lane, four partial sums per row)
/// to one vector of the sixteen row sums, lane `l` holding row [`lane_row`]`(l)`.
#[target_feature(enable = "avx512f")]
fn fold(s: &[__m512i; 4]) -> __m512i {
    let ab = _mm512_add_epi32(_mm512_unpacklo_epi32(s[0], s[1]), _mm512_unpackhi_epi32(s[0], s[1]));
    let cd = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2], s[3]), _mm512_unpackhi_epi32(s[2], s[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
}
