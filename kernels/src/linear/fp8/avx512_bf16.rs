//! AVX-512 BF16 W8A8 FP8 kernel: every E4M3 value is exact in bf16, so `vdpbf16ps`
//! multiplies weights and activation codes as they are, 32 columns per instruction (twice
//! the products of an f32 FMA on the same 512-bit register, four times the AVX2 kernel's).
//!
//! Weights become bf16 through f16: for a byte `b`, the f16 with bits
//! `((b & 0x80) << 8) | ((b & 0x7F) << 7)` is `e4m3(b) · 2⁻⁸` exactly (as in the AVX2
//! kernel), `vcvtph2ps` widens it and `vcvtne2ps2bf16` narrows it to bf16 unchanged (at most
//! four significant bits, and no value near a bf16 subnormal, which `vdpbf16ps` would read as
//! zero). The `2⁸` is applied to each block sum. Activation codes (E4M3 values held in f32)
//! round to bf16 unchanged too.
//!
//! Per `(row, token)` sixteen f32 lanes take, 32 columns at a time in column order, lane `l`
//! the product of columns `2l + 1` then `2l` (`vdpbf16ps`' order; every product is exact in
//! f32, each addition rounds); at each column block's end the lanes are summed by
//! [`hsum16`]'s fixed tree and `res += s_w · s_x · (sum · 2⁸)`. Row tiles, token tiles and
//! column chunks only choose how many of these chains run side by side and when their lanes
//! wait in memory (stored and loaded as they are), so a token's result does not depend on
//! the batch it is in.
//!
//! A tile of [`TR`] rows is converted once per chunk of [`CHUNK_COLS`] columns into a panel
//! and swept by up to [`TT`] tokens at a time, so each converted weight serves every token of
//! the call and each activation load serves [`TR`] rows. A lone token (decode) skips the panel
//! ([`direct`]).
#![cfg(target_arch = "x86_64")]

use super::Fp8Matrix;
use crate::cpu::simd::hsum;
use std::arch::x86_64::*;

/// Weight rows per tile.
const TR: usize = 4;
/// Most tokens per tile: with [`TR`] rows, sixteen independent `vdpbf16ps` chains.
const TT: usize = 4;
/// Weight rows per single-token pass ([`direct`]).
const DR: usize = 8;
/// Columns one `vdpbf16ps` covers.
const STEP: usize = 32;
/// Columns of a tile's rows converted at a time: 8 KiB of bf16 panel for four rows.
const CHUNK_COLS: usize = 1024;

/// 32 E4M3 bytes at `p` as bf16 words of `value · 2⁻⁸`.
///
/// # Safety
/// AVX-512 F/BW/BF16 available; `p` points at 32 readable bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
unsafe fn e4m3x32_bf16(p: *const u8) -> __m512i {
    // SAFETY: 32 readable bytes at p (caller).
    let b = _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(p.cast()) });
    let sign = _mm512_slli_epi16::<8>(_mm512_and_si512(b, _mm512_set1_epi16(0x80)));
    let h = _mm512_or_si512(sign, _mm512_slli_epi16::<7>(_mm512_and_si512(b, _mm512_set1_epi16(0x7F))));
    let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h));
    // Words 0..16 from `lo`, 16..32 from `hi`.
    // SAFETY: both are plain 512-bit vectors.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
}

/// The sixteen lanes of `v` summed in one fixed tree: lane `i` plus lane `i + 8`, then
/// [`hsum`]'s tree over those eight.
///
/// # Safety
/// AVX-512 F available.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn hsum16(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    // SAFETY: AVX available (implied by AVX-512 F).
    unsafe { hsum(_mm256_add_ps(lo, hi)) }
}

/// [`hsum16`] of sixteen vectors `v[q]`, `q = 4t + j`, as one vector whose lane `4j + t`
/// holds `hsum16(v[4t + j])`: the same additions on the same pairs, four vectors' worth per
/// instruction. Lanes `i` and `i + 8` (then `i` and `i + 4` of the eight, then `0 + 2` and
/// `1 + 3`, then those two) are brought side by side by 128-bit and in-lane shuffles.
///
/// # Safety
/// AVX-512 F available.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn hsum16x16(v: &[__m512; 16]) -> __m512 {
    // s[p]: lanes 0..8 hold v[2p]'s l_i + l_{i+8}, lanes 8..16 v[2p + 1]'s.
    let s: [__m512; 8] = std::array::from_fn(|p| {
        let (a, b) = (v[2 * p], v[2 * p + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b))
    });
    // t[p]: 128-bit quarter i holds v[4p + i]'s four sums of the previous ones, i and i + 4.
    let t: [__m512; 4] = std::array::from_fn(|p| {
        let (a, b) = (s[2 * p], s[2 * p + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
    });
    // u[p]: quarter i holds (0 + 2, 1 + 3) of v[8p + i], then of v[8p + 4 + i].
    let u: [__m512; 2] = std::array::from_fn(|p| {
        let (a, b) = (t[2 * p], t[2 * p + 1]);
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b))
    });
    // Quarter i, lane e: v[4e + i]'s two halves added.
    _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(u[0], u[1]), _mm512_shuffle_ps::<0b11_01_11_01>(u[0], u[1]))
}

/// Where the result of token `t` and tile row `j` is kept: tokens in groups of [`TT`], each
/// group's sixteen results row by row ([`hsum16x16`]'s lanes).
fn res_index(t: usize, j: usize) -> usize {
    (t / TT) * TR * TT + j * TT + t % TT
}

/// Reinterprets 32 bf16 words.
#[inline]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are plain 512-bit vectors.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// [`Fp8Matrix::rows_fp8`] on AVX-512 BF16 with the activation codes as bf16 words `xb`:
/// `out[(r - r0) * m + i]` for rows `r0..r1`, tokens `0..m`.
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 available ([`crate::cpu::caps::bf16_dot_available`]);
/// `r0 <= r1 <= w.rows()`, `xb.len() == m * k` (E4M3 values as bf16), `xs.len() == m * ceil(k / bw)`,
/// `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn rows_fp8(w: &Fp8Matrix, r0: usize, r1: usize, xb: &[u16], xs: &[f32], m: usize, out: &mut [f32]) {
    if r0 == r1 || m == 0 {
        return;
    }
    let k = w.cols();
    if m == 1 {
        for p0 in (r0..r1).step_by(DR) {
            let rows = DR.min(r1 - p0);
            // Rows past r1 in a tail tile repeat the last real row (their results are dropped).
            let row = |j: usize| p0 + j.min(rows - 1);
            let q: [&[u8]; DR] = std::array::from_fn(|j| w.row(row(j)));
            let sw: [&[f32]; DR] = std::array::from_fn(|j| w.row_scales(row(j)));
            // SAFETY: forwarded contract (one token of k words and nb scales).
            let res = unsafe { direct(&q, &sw, xb, xs, k, w.block()[1]) };
            out[p0 - r0..p0 - r0 + rows].copy_from_slice(&res[..rows]);
        }
        return;
    }
    let mut tiles = Tiles {
        panel: vec![_mm512_setzero_si512(); TR * (CHUNK_COLS / STEP)],
        lanes: vec![_mm512_setzero_ps(); m * TR],
        res: vec![0f32; m.next_multiple_of(TT) * TR],
    };
    for p0 in (r0..r1).step_by(TR) {
        let rows = TR.min(r1 - p0);
        // Rows past r1 in a tail tile repeat the last real row (their results are dropped).
        let row = |j: usize| p0 + j.min(rows - 1);
        let sw: [&[f32]; TR] = std::array::from_fn(|j| w.row_scales(row(j)));
        tiles.lanes.fill(_mm512_setzero_ps());
        tiles.res.fill(0.0);
        for c0 in (0..k).step_by(CHUNK_COLS) {
            let c1 = (c0 + CHUNK_COLS).min(k);
            for j in 0..TR {
                let q = w.row(row(j));
                for s in 0..(c1 - c0) / STEP {
                    // SAFETY: columns c0 + 32s .. + 32 lie inside the row (32 | k).
                    tiles.panel[j * (CHUNK_COLS / STEP) + s] = unsafe { e4m3x32_bf16(q.as_ptr().add(c0 + s * STEP)) };
                }
            }
            let mut t0 = 0;
            while t0 < m {
                // SAFETY: forwarded contract; tokens t0.. exist.
                t0 += unsafe {
                    match m - t0 {
                        1 => tiles.tile::<1>(w, c0..c1, &sw, xb, xs, t0),
                        2 => tiles.tile::<2>(w, c0..c1, &sw, xb, xs, t0),
                        3 => tiles.tile::<3>(w, c0..c1, &sw, xb, xs, t0),
                        _ => tiles.tile::<TT>(w, c0..c1, &sw, xb, xs, t0),
                    }
                };
            }
        }
        for j in 0..rows {
            for t in 0..m {
                out[(p0 - r0 + j) * m + t] = tiles.res[res_index(t, j)];
            }
        }
    }
}

/// One token against [`DR`] weight rows converted in registers (decode, where the weights
/// stream from memory and a panel would only add a store and a load per word): per row the
/// same lanes, order and block ends as [`Tiles::tile`].
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 available; each `q[j]` holds `k` bytes and each `sw[j]`
/// `ceil(k / bw)` scales, `xb` `k` words, `xs` `ceil(k / bw)` scales; `32 | k`, `32 | bw`
/// unless `bw >= k`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn direct(q: &[&[u8]; DR], sw: &[&[f32]; DR], xb: &[u16], xs: &[f32], k: usize, bw: usize) -> [f32; DR] {
    let mut res = [0f32; DR];
    for b in 0..k.div_ceil(bw) {
        let mut a = [_mm512_setzero_ps(); DR];
        for c in (b * bw..((b + 1) * bw).min(k)).step_by(STEP) {
            // SAFETY: c + 32 <= k words of the token and bytes of each row (caller).
            unsafe {
                let x = bh(_mm512_loadu_si512(xb.as_ptr().add(c).cast()));
                for (a, q) in a.iter_mut().zip(q) {
                    *a = _mm512_dpbf16_ps(*a, bh(e4m3x32_bf16(q.as_ptr().add(c))), x);
                }
            }
        }
        for (j, (r, a)) in res.iter_mut().zip(a).enumerate() {
            // SAFETY: AVX-512 F (caller).
            let part = unsafe { hsum16(a) } * 256.0;
            *r += sw[j][b] * xs[b] * part;
        }
    }
    res
}

/// One row tile in progress: its converted chunk (`panel[j * CHUNK_COLS / 32 + s]`: row `j`,
/// columns `32s..32s + 32` of the chunk), and per token `t` and row `j` the lanes of the
/// current column block (`lanes[t * TR + j]`) and the result so far (`res[res_index(t, j)]`).
struct Tiles {
    panel: Vec<__m512i>,
    lanes: Vec<__m512>,
    res: Vec<f32>,
}

impl Tiles {
    /// Tokens `t0..t0 + T` over the chunk's columns `cols`: the lanes carried in from the
    /// previous chunk, each column block ending inside the chunk reduced into `res`; returns `T`.
    ///
    /// # Safety
    /// As [`rows_fp8`], with tokens `t0..t0 + T` present; the panel holds the chunk `cols`
    /// (32-aligned, inside the row); `sw` are the tile's rows' scales.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")]
    #[allow(clippy::needless_range_loop)] // `t` and `j` address two arrays each
    unsafe fn tile<const T: usize>(&mut self, w: &Fp8Matrix, cols: std::ops::Range<usize>, sw: &[&[f32]; TR], xb: &[u16], xs: &[f32], t0: usize) -> usize {
        let (k, bw) = (w.cols(), w.block()[1]);
        let nb = k.div_ceil(bw);
        let mut a = [[_mm512_setzero_ps(); TR]; T];
        for t in 0..T {
            a[t].copy_from_slice(&self.lanes[(t0 + t) * TR..(t0 + t + 1) * TR]);
        }
        let xp = xb.as_ptr();
        let mut c = cols.start;
        while c < cols.end {
            let b = c / bw;
            let end = ((b + 1) * bw).min(k);
            let stop = end.min(cols.end);
            while c < stop {
                let s = (c - cols.start) / STEP;
                let mut x = [_mm512_setzero_si512(); T];
                for t in 0..T {
                    // SAFETY: token t0 + t's columns c..c + 32 lie inside xb (c + 32 <= k).
                    x[t] = unsafe { _mm512_loadu_si512(xp.add((t0 + t) * k + c).cast()) };
                }
                for j in 0..TR {
                    let wv = bh(self.panel[j * (CHUNK_COLS / STEP) + s]);
                    for t in 0..T {
                        a[t][j] = _mm512_dpbf16_ps(a[t][j], wv, bh(x[t]));
                    }
                }
                c += STEP;
            }
            if c == end {
                let sx: [f32; T] = std::array::from_fn(|t| xs[(t0 + t) * nb + b]);
                if T == TT {
                    // All sixteen outputs at once, each by the same additions and products.
                    let flat: [__m512; TR * TT] = std::array::from_fn(|q| a[q / TR][q % TR]);
                    // SAFETY: AVX-512 F (caller).
                    let sums = unsafe { hsum16x16(&flat) };
                    let swv = _mm512_set_ps(
                        sw[3][b], sw[3][b], sw[3][b], sw[3][b], sw[2][b], sw[2][b], sw[2][b], sw[2][b],
                        sw[1][b], sw[1][b], sw[1][b], sw[1][b], sw[0][b], sw[0][b], sw[0][b], sw[0][b],
                    );
                    let sxv = _mm512_set_ps(
                        sx[3], sx[2], sx[1], sx[0], sx[3], sx[2], sx[1], sx[0], sx[3], sx[2], sx[1], sx[0], sx[3], sx[2], sx[1], sx[0],
                    );
                    let at = self.res[t0 * TR..].as_mut_ptr();
                    let part = _mm512_mul_ps(sums, _mm512_set1_ps(256.0));
                    // SAFETY: the group of tokens t0..t0 + 4 owns sixteen results from t0 * TR.
                    unsafe { _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), _mm512_mul_ps(_mm512_mul_ps(swv, sxv), part))) };
                } else {
                    for t in 0..T {
                        for j in 0..TR {
                            // SAFETY: AVX-512 F (caller).
                            let part = unsafe { hsum16(a[t][j]) } * 256.0;
                            self.res[res_index(t0 + t, j)] += sw[j][b] * sx[t] * part;
                        }
                    }
                }
                a = [[_mm512_setzero_ps(); TR]; T];
            }
        }
        for t in 0..T {
            self.lanes[(t0 + t) * TR..(t0 + t + 1) * TR].copy_from_slice(&a[t]);
        }
        T
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::e4m3::{e4m3_is_nan, e4m3_to_f32};

    /// The f16 route gives bf16 words of `value · 2⁻⁸` for every non-NaN code.
    #[test]
    fn e4m3_bf16_words_for_all_codes() {
        if !crate::cpu::caps::bf16_dot_available() {
            return;
        }
        for b0 in (0..=255u8).step_by(32) {
            let bytes: [u8; 32] = std::array::from_fn(|j| b0 + j as u8);
            let mut words = [0u16; 32];
            // SAFETY: AVX-512 BF16 checked above; 32 bytes in, 32 words out.
            unsafe { _mm512_storeu_si512(words.as_mut_ptr().cast(), e4m3x32_bf16(bytes.as_ptr())) };
            for (&b, &w) in bytes.iter().zip(&words) {
                if !e4m3_is_nan(b) {
                    let v = f32::from_bits(u32::from(w) << 16);
                    assert_eq!((v * 256.0).to_bits(), e4m3_to_f32(b).to_bits(), "code {b:#04x}");
                }
            }
        }
    }
}
