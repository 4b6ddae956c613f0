//! W4A16 prefill: each row group is decoded once into a panel of `bf16(q - z)` words (the
//! vectors the inline kernel builds per run and pair), then register tiles of four row pairs
//! by up to four tokens multiply the panel with the activations, so each decoded run serves
//! every token of the call and each activation load serves four pairs.
//!
//! Per `(row, token)` the operations are the inline kernel's ([`super`]): the same words
//! against the same activation halves by `vdpbf16ps` into eight lanes in column order, one
//! `fma(s[g], acc, total)` per group and [`super::hsum`]'s tree at the end, so the results
//! are bit-identical to it whatever the batch. In the FMA form ([`crate::cpu::Bf16Products`])
//! the panel holds the words widened to f32, odd and even words apart, and each `vdpbf16ps`
//! becomes two FMAs in its order, run with denormals flushed as it flushes them: the same bits
//! (NaN payloads aside).

use super::{decode_pair, dot_run, group_params, group_runs, pair_lanes, store_pairs, tokens_run, widen, PAIRS};
use crate::cpu::flush::denormals_flushed;
use crate::cpu::Bf16Products;
use crate::linear::int4::{Int4Matrix, ROW_GROUP, RUN, RUN_STRIDE};
use std::arch::x86_64::*;

/// Row pairs a tile takes (out of a row group's eight).
const TILE_PAIRS: usize = 4;

/// Most tokens a tile takes.
const TILE_TOKENS: usize = 4;

/// Vectors the panel holds per run and pair: the low and high nibbles' words, or in the FMA
/// form each of them widened ([`super::widen`]: odd words, then even ones).
const fn run_vectors(fma: bool) -> usize {
    if fma {
        4
    } else {
        2
    }
}

/// W4A16 rows `r0..r1` for `m` tokens, as [`super::int4_bf16`] computes them, the products
/// formed as `form` says.
///
/// # Safety
/// As [`super::int4_bf16`]; `table` is its word table.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)] // the kernel's inputs, its form and word table
pub(super) unsafe fn int4_bf16_panel(form: Bf16Products, w: &Int4Matrix, table: &__m512i, r0: usize, r1: usize, xb: &[u16], m: usize, out: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe {
        match form {
            Bf16Products::Dot => panel_in::<false>(w, table, r0, r1, xb, m, out),
            Bf16Products::Fma => panel_in::<true>(w, table, r0, r1, xb, m, out),
        }
    }
}

/// [`int4_bf16_panel`] in one form: [`Bf16Products::Fma`] when `FMA`.
///
/// # Safety
/// As [`int4_bf16_panel`].
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn panel_in<const FMA: bool>(w: &Int4Matrix, table: &__m512i, r0: usize, r1: usize, xb: &[u16], m: usize, out: &mut [f32]) {
    let mut panel = Panel {
        words: vec![_mm512_setzero_si512(); w.cols() / RUN * run_vectors(FMA) * PAIRS],
        scales: vec![_mm512_setzero_ps(); w.groups() * PAIRS],
        sums: vec![_mm512_setzero_ps(); w.groups() * TILE_PAIRS * TILE_TOKENS],
    };
    for rg in r0 / ROW_GROUP..(r1 - 1) / ROW_GROUP + 1 {
        // SAFETY: rg is a row group of w (r1 <= w.rows()).
        unsafe { panel.decode::<FMA>(w, table, rg) };
        let mut t0 = 0;
        while t0 < m {
            // SAFETY: forwarded contract; tokens t0.. exist.
            t0 += unsafe {
                match m - t0 {
                    1 => panel.tile::<1, FMA>(w, rg, xb, t0, r0, r1, m, out),
                    2 => panel.tile::<2, FMA>(w, rg, xb, t0, r0, r1, m, out),
                    3 => panel.tile::<3, FMA>(w, rg, xb, t0, r0, r1, m, out),
                    _ => panel.tile::<4, FMA>(w, rg, xb, t0, r0, r1, m, out),
                }
            };
        }
    }
}

/// One row group decoded: per run `j` and pair `p`, its [`run_vectors`] at
/// `words[(j * PAIRS + p) * V..][..V]`; per group `g` and pair `p`, the scales of the pair's
/// lanes at `scales[g * PAIRS + p]`; and a tile's group sums ([`group_sums`]).
struct Panel {
    words: Vec<__m512i>,
    scales: Vec<__m512>,
    sums: Vec<__m512>,
}

impl Panel {
    /// Decodes row group `rg` (widened when `FMA`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/BF16 available; `rg` is a row group of `w` (its packed runs are read
    /// unchecked).
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn decode<const FMA: bool>(&mut self, w: &Int4Matrix, table: &__m512i, rg: usize) {
        let base = w.row_ptr(rg * ROW_GROUP);
        let mut at = [_mm512_setzero_si512(); PAIRS];
        for (p, a) in at.iter_mut().enumerate() {
            *a = pair_lanes(p);
        }
        for g in 0..w.groups() {
            let (scales, bias) = group_params::<PAIRS>(w, rg, g, &at);
            self.scales[g * PAIRS..(g + 1) * PAIRS].copy_from_slice(&scales);
            for j in group_runs(w, g) {
                for (p, b) in bias.iter().enumerate() {
                    // SAFETY: run j of the group's pair p: 32 bytes inside the packed data.
                    let (lo, hi) = unsafe { decode_pair(base.add(j * RUN_STRIDE + 32 * p), *b, *table) };
                    let first = (j * PAIRS + p) * run_vectors(FMA);
                    if FMA {
                        let [l, h] = [widen(lo), widen(hi)];
                        for (d, v) in self.words[first..first + 4].iter_mut().zip([l[0], l[1], h[0], h[1]]) {
                            *d = _mm512_castps_si512(v);
                        }
                    } else {
                        self.words[first..first + 2].copy_from_slice(&[lo, hi]);
                    }
                }
            }
        }
    }

    /// Tokens `t0..t0 + T` against the decoded row group `rg`, results into `out` for the rows
    /// in `r0..r1` (products in the FMA form when `FMA`); returns `T`.
    ///
    /// # Safety
    /// As [`super::int4_bf16`], with tokens `t0..t0 + T` present.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    #[allow(clippy::too_many_arguments)] // the decoded group, its place and the token block
    #[allow(clippy::needless_range_loop)] // `p` and `t` address two arrays each
    unsafe fn tile<const T: usize, const FMA: bool>(&mut self, w: &Int4Matrix, rg: usize, xb: &[u16], t0: usize, r0: usize, r1: usize, m: usize, out: &mut [f32]) -> usize {
        for p0 in (0..PAIRS).step_by(TILE_PAIRS) {
            let (words, sums) = (&self.words[..], &mut self.sums[..]);
            // SAFETY (both): forwarded contract.
            if FMA {
                // The FMAs flush denormals as `vdpbf16ps` does; the scales below run outside.
                // SAFETY (flush): `group_sums` is never inlined; it reads the panel and the
                // activations and leaves its sums in `sums`.
                unsafe { denormals_flushed(|| group_sums::<T, true>(words, w, xb, t0, p0, sums)) };
            } else {
                unsafe { group_sums::<T, false>(words, w, xb, t0, p0, sums) };
            }
            let mut total = [[_mm512_setzero_ps(); TILE_PAIRS]; T];
            for g in 0..w.groups() {
                let s = &self.scales[g * PAIRS + p0..g * PAIRS + p0 + TILE_PAIRS];
                let acc = &self.sums[g * TILE_PAIRS * T..(g + 1) * TILE_PAIRS * T];
                for t in 0..T {
                    for p in 0..TILE_PAIRS {
                        total[t][p] = _mm512_fmadd_ps(s[p], acc[t * TILE_PAIRS + p], total[t][p]);
                    }
                }
            }
            for (tt, pairs) in total.iter().enumerate() {
                store_pairs(pairs, rg * ROW_GROUP + 2 * p0, t0 + tt, r0, r1, m, out);
            }
        }
        T
    }
}

/// Per group `g`, token `t` and pair `p` of pairs `p0..p0 + TILE_PAIRS`, the 8-lane sum of the
/// group's products into `sums[(g * T + t) * TILE_PAIRS + p]`: the decoded `words` against
/// tokens `t0..t0 + T`, in the FMA form when `FMA` (two FMAs per `vdpbf16ps`, four per run:
/// the odd words of the low nibbles' run, the even ones, then the high nibbles'). Never inlined, so that no arithmetic of
/// its caller moves into a [`denormals_flushed`] region around it, nor this out.
///
/// # Safety
/// As [`super::int4_bf16`], with tokens `t0..t0 + T` present; `words` is a decoded row group
/// of `w` and `sums` holds `w.groups() * T * TILE_PAIRS` vectors.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline(never)]
#[allow(clippy::needless_range_loop)] // `p` and `t` address two arrays each
unsafe fn group_sums<const T: usize, const FMA: bool>(words: &[__m512i], w: &Int4Matrix, xb: &[u16], t0: usize, p0: usize, sums: &mut [__m512]) {
    let k = w.cols();
    let xp = xb.as_ptr();
    for g in 0..w.groups() {
        let mut acc = [[_mm512_setzero_ps(); TILE_PAIRS]; T];
        for j in group_runs(w, g) {
            let mut x = [(_mm512_setzero_si512(), _mm512_setzero_si512()); T];
            for t in 0..T {
                // SAFETY: token t0 + t's columns j*32..j*32+32 lie inside xb.
                x[t] = unsafe { tokens_run(xp.add((t0 + t) * k + j * RUN)) };
            }
            let v = run_vectors(FMA);
            let wj = &words[(j * PAIRS + p0) * v..(j * PAIRS + p0 + TILE_PAIRS) * v];
            if FMA {
                let xw: [[__m512; 4]; T] = std::array::from_fn(|t| {
                    let [l, h] = [widen(x[t].0), widen(x[t].1)];
                    [l[0], l[1], h[0], h[1]]
                });
                for p in 0..TILE_PAIRS {
                    for t in 0..T {
                        for (wv, xv) in wj[4 * p..4 * p + 4].iter().zip(&xw[t]) {
                            acc[t][p] = _mm512_fmadd_ps(_mm512_castsi512_ps(*wv), *xv, acc[t][p]);
                        }
                    }
                }
            } else {
                for p in 0..TILE_PAIRS {
                    for t in 0..T {
                        acc[t][p] = dot_run(acc[t][p], wj[2 * p], wj[2 * p + 1], x[t].0, x[t].1);
                    }
                }
            }
        }
        for t in 0..T {
            sums[(g * T + t) * TILE_PAIRS..(g * T + t + 1) * TILE_PAIRS].copy_from_slice(&acc[t]);
        }
    }
}
