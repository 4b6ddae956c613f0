//! AVX2 + FMA + F16C W8A8 FP8 kernel.
//!
//! E4M3 weight bytes become f32 in registers: for a byte `b`, the f16 with bits
//! `((b & 0x80) << 8) | ((b & 0x7F) << 7)` is `e4m3(b) · 2⁻⁸` exactly, subnormals included
//! (E4M3's exponent bias is 7, f16's 15; the 3 mantissa bits land on f16's top three), so one
//! `vcvtph2ps` converts 8 weights. The `2⁸` is applied to each block sum instead (a power of
//! two: exact, and it commutes with every rounding because no value here nears the f32
//! underflow or overflow range).
//!
//! A panel of [`PR`] weight rows is converted once into an f32 buffer and swept by
//! `PR × T` micro-tiles (`T` ≤ [`PT`] tokens), so each converted weight is reused by every
//! token of the batch. Each (row, token) output owns one 8-lane accumulator, fed in column
//! order by FMAs (E4M3 × E4M3 products are exact in f32), reduced with [`hsum`] per column
//! block and scaled as `acc += s_w · s_x · part`: the same operations whatever the tile
//! shape, so a token's result never depends on the batch it is in. A lone token (decode)
//! skips the panel: [`DR`] rows are converted in registers and meet it directly, with the
//! same per-output operations.
#![cfg(target_arch = "x86_64")]

use super::Fp8Matrix;
use crate::cpu::simd::hsum;
use std::arch::x86_64::*;

/// Weight rows per converted panel.
const PR: usize = 4;
/// Tokens per micro-tile.
const PT: usize = 3;
/// Weight rows per single-token tile.
const DR: usize = 8;

/// Eight E4M3 bytes at `p` as f32 values times 2⁻⁸.
///
/// # Safety
/// AVX2 + F16C available; `p` points at 8 readable bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn e4m3x8_scaled(p: *const u8) -> __m256 {
    // SAFETY: 8 readable bytes at p (caller).
    let b = unsafe { _mm_loadl_epi64(p.cast()) };
    // b << 8 per 16-bit lane, then an arithmetic shift by one: sign in bits 15 and 14,
    // exponent and mantissa in bits 13..7; clearing bit 14 leaves the f16 pattern.
    let h = _mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1);
    _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(0xBF80u16 as i16)))
}

/// `PR` panel rows (f32, `· 2⁻⁸`, stride `k`) times `T` activation rows (stride `k`).
/// Returns `res[j][t] = Σ_b sw[j][b] · xs[t·nb + b] · part(j, t, b)`.
///
/// # Safety
/// AVX2 + FMA available; `w` holds `PR × k` floats, `x` `T × k` floats, `xs` `T × ceil(k / bw)`
/// floats, each `sw[j]` `ceil(k / bw)` floats; `bw` is a multiple of 8 (the last block may be partial).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const T: usize>(w: *const f32, x: *const f32, k: usize, bw: usize, sw: [*const f32; PR], xs: *const f32) -> [[f32; T]; PR] {
    let nb = k.div_ceil(bw);
    let mut res = [[0f32; T]; PR];
    for b in 0..nb {
        let mut acc = [[_mm256_setzero_ps(); T]; PR];
        for c in (b * bw..((b + 1) * bw).min(k)).step_by(8) {
            let mut xv = [_mm256_setzero_ps(); T];
            for (t, v) in xv.iter_mut().enumerate() {
                // SAFETY: t < T rows of k floats, c + 8 <= k.
                *v = unsafe { _mm256_loadu_ps(x.add(t * k + c)) };
            }
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: j < PR rows of k floats, c + 8 <= k.
                let wv = unsafe { _mm256_loadu_ps(w.add(j * k + c)) };
                for (a, &xv) in a.iter_mut().zip(&xv) {
                    *a = _mm256_fmadd_ps(wv, xv, *a);
                }
            }
        }
        for (j, (res, acc)) in res.iter_mut().zip(&acc).enumerate() {
            for (t, (r, &a)) in res.iter_mut().zip(acc).enumerate() {
                // SAFETY: AVX available; b < nb scales per row and per token (caller).
                unsafe {
                    let part = hsum(a) * 256.0;
                    *r += *sw[j].add(b) * *xs.add(t * nb + b) * part;
                }
            }
        }
    }
    res
}

/// One token against [`DR`] weight rows (E4M3 bytes at `q[j]`, converted in registers):
/// the same per-output operations as `tile::<1>`, without the panel round trip (decode).
///
/// # Safety
/// AVX2 + FMA + F16C available; each `q[j]` holds `k` bytes, `x` `k` floats, `xs` and each
/// `sw[j]` `ceil(k / bw)` floats; `bw` is a multiple of 8 (the last block may be partial).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_direct(q: [*const u8; DR], x: *const f32, k: usize, bw: usize, sw: [*const f32; DR], xs: *const f32) -> [f32; DR] {
    let mut res = [0f32; DR];
    for b in 0..k.div_ceil(bw) {
        let mut acc = [_mm256_setzero_ps(); DR];
        for c in (b * bw..((b + 1) * bw).min(k)).step_by(8) {
            // SAFETY: c + 8 <= k floats of x and bytes of each row (caller).
            unsafe {
                let xv = _mm256_loadu_ps(x.add(c));
                for (a, q) in acc.iter_mut().zip(q) {
                    *a = _mm256_fmadd_ps(e4m3x8_scaled(q.add(c)), xv, *a);
                }
            }
        }
        for (j, (r, &a)) in res.iter_mut().zip(&acc).enumerate() {
            // SAFETY: AVX available; b < ceil(k / bw) scales per row and for the token (caller).
            unsafe {
                let part = hsum(a) * 256.0;
                *r += *sw[j].add(b) * *xs.add(b) * part;
            }
        }
    }
    res
}

/// [`Fp8Matrix::rows_fp8`] on AVX2: `out[(r - r0) * m + i]` for rows `r0..r1`, tokens `0..m`.
///
/// # Safety
/// AVX2 + FMA + F16C available; `r0 <= r1 <= w.rows()`, `codes.len() == m * k`,
/// `xs.len() == m * ceil(k / bw)`, `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows_fp8(w: &Fp8Matrix, r0: usize, r1: usize, codes: &[f32], xs: &[f32], m: usize, out: &mut [f32]) {
    let (k, bw) = (w.cols(), w.block()[1]);
    let nb = k.div_ceil(bw);
    if m == 1 {
        for p0 in (r0..r1).step_by(DR) {
            let rows = DR.min(r1 - p0);
            // Rows past r1 in a tail tile repeat the last real row (their results are dropped).
            let r = |j: usize| p0 + j.min(rows - 1);
            let q = std::array::from_fn(|j| w.row(r(j)).as_ptr());
            let sw = std::array::from_fn(|j| w.row_scales(r(j)).as_ptr());
            // SAFETY: k bytes per row, k codes, nb scales per row and for the token; AVX2 +
            // FMA + F16C (caller).
            let res = unsafe { tile_direct(q, codes.as_ptr(), k, bw, sw, xs.as_ptr()) };
            out[p0 - r0..p0 - r0 + rows].copy_from_slice(&res[..rows]);
        }
        return;
    }
    let mut panel = vec![0f32; PR * k];
    for p0 in (r0..r1).step_by(PR) {
        let rows = PR.min(r1 - p0);
        // Rows past r1 in a tail panel stay zero (their results are dropped); they borrow the
        // last real row's scales.
        let mut sw = [std::ptr::null::<f32>(); PR];
        for (j, (dst, s)) in panel.chunks_exact_mut(k).zip(&mut sw).enumerate() {
            let r = p0 + j.min(rows - 1);
            *s = w.row_scales(r).as_ptr();
            if j < rows {
                for (d, q) in dst.chunks_exact_mut(8).zip(w.row(r).chunks_exact(8)) {
                    // SAFETY: 8 bytes in q, 8 floats in d; AVX2 + F16C (caller).
                    unsafe { _mm256_storeu_ps(d.as_mut_ptr(), e4m3x8_scaled(q.as_ptr())) };
                }
            } else {
                dst.fill(0.0);
            }
        }
        let mut i = 0;
        while i < m {
            let t = PT.min(m - i);
            let (x, s) = (codes[i * k..].as_ptr(), xs[i * nb..].as_ptr());
            // SAFETY: PR × k panel floats; t tokens of k codes and nb scales from i (i + t <= m);
            // nb scales per row; AVX2 + FMA (caller).
            unsafe {
                match t {
                    3 => put(&tile::<3>(panel.as_ptr(), x, k, bw, sw, s), rows, m, (p0 - r0) * m + i, out),
                    2 => put(&tile::<2>(panel.as_ptr(), x, k, bw, sw, s), rows, m, (p0 - r0) * m + i, out),
                    _ => put(&tile::<1>(panel.as_ptr(), x, k, bw, sw, s), rows, m, (p0 - r0) * m + i, out),
                }
            }
            i += t;
        }
    }
}

/// Stores the first `rows` rows of a tile at `out[at + j * m + t]`.
fn put<const T: usize>(res: &[[f32; T]; PR], rows: usize, m: usize, at: usize, out: &mut [f32]) {
    for (j, r) in res.iter().take(rows).enumerate() {
        out[at + j * m..at + j * m + T].copy_from_slice(r);
    }
}

/// [`crate::linear::act::quantize_fp8_row`] on AVX2, bit-identical to the scalar version: the same
/// absmax (max is exact and order-free; NaN is skipped as `f32::max` does), the same IEEE
/// division, and the same round-to-nearest-even onto E4M3 values: on the f32 bits for normals
/// (keep 3 mantissa bits), by adding and removing 2¹⁴ (whose f32 spacing is E4M3's subnormal
/// step 2⁻⁹) below 2⁻⁶.
///
/// # Safety
/// AVX2 available; `group` and `x.len()` are multiples of 8, `x.len() == codes.len()`,
/// `scales.len() == ceil(x.len() / group)`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_fp8_row(x: &[f32], group: usize, codes: &mut [f32], scales: &mut [f32]) {
    let signbit = _mm256_set1_ps(-0.0);
    for ((xs, cs), s) in x.chunks(group).zip(codes.chunks_mut(group)).zip(scales.iter_mut()) {
        let mut amax = _mm256_setzero_ps();
        for v in xs.chunks_exact(8) {
            // SAFETY: 8 floats in v.
            let v = unsafe { _mm256_loadu_ps(v.as_ptr()) };
            amax = _mm256_max_ps(_mm256_andnot_ps(signbit, v), amax); // NaN lanes keep amax
        }
        let mut lanes = [0f32; 8];
        // SAFETY: 8 floats in lanes.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), amax) };
        *s = lanes.iter().fold(0f32, |m, &v| m.max(v)) / crate::e4m3::E4M3_MAX;
        if *s == 0.0 {
            cs.fill(0.0);
            continue;
        }
        let sv = _mm256_set1_ps(*s);
        for (v, c) in xs.chunks_exact(8).zip(cs.chunks_exact_mut(8)) {
            // SAFETY: 8 floats in v.
            let v = _mm256_div_ps(unsafe { _mm256_loadu_ps(v.as_ptr()) }, sv);
            let a = _mm256_min_ps(_mm256_andnot_ps(signbit, v), _mm256_set1_ps(crate::e4m3::E4M3_MAX));
            let bits = _mm256_castps_si256(a);
            let odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
            let up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7_FFFF)));
            let normal = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(0xFFF0_0000u32 as i32)));
            let magic = _mm256_set1_ps(16384.0);
            let sub = _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
            let small = _mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(1.0 / 64.0));
            let q = _mm256_or_ps(_mm256_blendv_ps(normal, sub, small), _mm256_and_ps(v, signbit));
            let q = _mm256_blendv_ps(q, _mm256_set1_ps(f32::NAN), _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            // SAFETY: 8 floats in c.
            unsafe { _mm256_storeu_ps(c.as_mut_ptr(), q) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Isa;
    use crate::e4m3::{e4m3_is_nan, e4m3_to_f32, f32_to_e4m3};

    /// The SIMD activation quantizer gives the scalar formula's codes bit for bit, on groups
    /// at many magnitudes (E4M3 subnormals, ties), with NaN, infinities and zero groups.
    #[test]
    fn quantize_matches_scalar_formula() {
        if !Isa::Avx2.available() {
            return;
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for case in 0..400 {
            let group = [8, 32, 128][case % 3];
            let mut x: Vec<f32> = (0..4 * group)
                .map(|_| {
                    let r = next();
                    let mant = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    mant * f32::powi(2.0, (r % 40) as i32 - 20)
                })
                .collect();
            match case % 7 {
                0 => x[5] = f32::NAN,
                1 => x[group + 1] = f32::INFINITY,
                2 => x[2 * group..3 * group].fill(0.0),
                3 => x[3 * group] = f32::NEG_INFINITY,
                _ => {}
            }
            let n = x.len();
            let (mut codes, mut scales) = (vec![0f32; n], vec![0f32; 4]);
            // SAFETY: AVX2 checked above; group is a multiple of 8 and lengths agree.
            unsafe { quantize_fp8_row(&x, group, &mut codes, &mut scales) };
            for ((xs, cs), &s) in x.chunks_exact(group).zip(codes.chunks_exact(group)).zip(&scales) {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(s.to_bits(), (amax / 448.0).to_bits(), "case {case} scale");
                for (&v, &c) in xs.iter().zip(cs) {
                    let want = if s == 0.0 { 0.0 } else { e4m3_to_f32(f32_to_e4m3(v / s)) };
                    assert_eq!(c.to_bits(), want.to_bits(), "case {case}: {v:e} / {s:e}");
                }
            }
        }
    }

    /// The f16 bit trick gives `value · 2⁻⁸` for every non-NaN code (NaN codes are refused
    /// by `Fp8Matrix::new`, so the kernel never meets them).
    #[test]
    fn e4m3_f16_trick_all_codes() {
        if !Isa::Avx2.available() {
            return;
        }
        for b0 in (0..=255u8).step_by(8) {
            let bytes: [u8; 8] = std::array::from_fn(|j| b0 + j as u8);
            let mut got = [0f32; 8];
            // SAFETY: AVX2 + F16C checked above; 8 bytes, 8 floats.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), e4m3x8_scaled(bytes.as_ptr())) };
            for (&b, &g) in bytes.iter().zip(&got) {
                if !e4m3_is_nan(b) {
                    assert_eq!((g * 256.0).to_bits(), e4m3_to_f32(b).to_bits(), "code {b:#04x}");
                }
            }
        }
    }
}
