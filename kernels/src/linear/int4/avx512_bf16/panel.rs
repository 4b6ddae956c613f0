//! W4A16 prefill: each row group is decoded once into a panel of `bf16(q - z)` words (the
//! vectors the inline kernel builds per run and pair), then register tiles of four row pairs
//! by up to four tokens multiply the panel with the activations, so each decoded run serves
//! every token of the call and each activation load serves four pairs.
//!
//! A row group's panel (64 KiB at 2,048 columns) does not fit in L1, so the tiles take it a
//! chunk of whole scale groups (about [`CHUNK_COLS`] columns) at a time: four pairs' part
//! of a chunk stays in L1 while every token passes it, and each (token, pair) carries its
//! running total from chunk to chunk in memory (exact: an f32 stored and loaded).
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
use std::ops::Range;

/// Row pairs a tile takes (out of a row group's eight).
const TILE_PAIRS: usize = 4;

/// Most tokens a tile takes.
const TILE_TOKENS: usize = 4;

/// Columns a chunk of the panel covers at most, unless one scale group is wider: four
/// pairs' words of it are 8 KiB, beside 4 KiB of a tile's activations.
const CHUNK_COLS: usize = 512;

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
    let chunk = (CHUNK_COLS / w.group().min(w.cols())).max(1);
    let mut panel = Panel {
        words: vec![_mm512_setzero_si512(); w.cols() / RUN * run_vectors(FMA) * PAIRS],
        scales: vec![_mm512_setzero_ps(); w.groups() * PAIRS],
        sums: vec![_mm512_setzero_ps(); chunk * TILE_PAIRS * TILE_TOKENS],
        totals: vec![_mm512_setzero_ps(); m * TILE_PAIRS],
    };
    for rg in r0 / ROW_GROUP..(r1 - 1) / ROW_GROUP + 1 {
        // SAFETY: rg is a row group of w (r1 <= w.rows()).
        unsafe { panel.decode::<FMA>(w, table, rg) };
        for p0 in (0..PAIRS).step_by(TILE_PAIRS) {
            panel.totals.fill(_mm512_setzero_ps());
            for g0 in (0..w.groups()).step_by(chunk) {
                let groups = g0..(g0 + chunk).min(w.groups());
                let mut t0 = 0;
                while t0 < m {
                    // SAFETY: forwarded contract; tokens t0.. exist.
                    t0 += unsafe {
                        match m - t0 {
                            1 => panel.tile::<1, FMA>(w, groups.clone(), p0, xb, t0),
                            2 => panel.tile::<2, FMA>(w, groups.clone(), p0, xb, t0),
                            3 => panel.tile::<3, FMA>(w, groups.clone(), p0, xb, t0),
                            _ => panel.tile::<4, FMA>(w, groups.clone(), p0, xb, t0),
                        }
                    };
                }
            }
            for (t, pairs) in panel.totals.chunks_exact(TILE_PAIRS).enumerate() {
                store_pairs(pairs, rg * ROW_GROUP + 2 * p0, t, r0, r1, m, out);
            }
        }
    }
}

/// One row group decoded: per run `j` and pair `p`, its [`run_vectors`] at
/// `words[(j * PAIRS + p) * V..][..V]`; per group `g` and pair `p`, the scales of the pair's
/// lanes at `scales[g * PAIRS + p]`; a tile's group sums over a chunk ([`group_sums`]); and
/// per token `t` and pair `p` of the pairs being computed, the running total
/// `Σ_g s[g] · acc_g` over the chunks so far at `totals[t * TILE_PAIRS + p]`.
struct Panel {
    words: Vec<__m512i>,
    scales: Vec<__m512>,
    sums: Vec<__m512>,
    totals: Vec<__m512>,
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

    /// Tokens `t0..t0 + T` against pairs `p0..p0 + TILE_PAIRS` of the decoded row group over
    /// scale groups `groups`: their sums scaled into the running totals in group order
    /// (products in the FMA form when `FMA`); returns `T`.
    ///
    /// # Safety
    /// As [`super::int4_bf16`], with tokens `t0..t0 + T` present; `groups` lies inside `w`'s
    /// groups and holds at most as many as `sums` was sized for.
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
    #[allow(clippy::needless_range_loop)] // `p` and `t` address two arrays each
    unsafe fn tile<const T: usize, const FMA: bool>(&mut self, w: &Int4Matrix, groups: Range<usize>, p0: usize, xb: &[u16], t0: usize) -> usize {
        let (words, sums) = (&self.words[..], &mut self.sums[..]);
        // SAFETY (both): forwarded contract.
        if FMA {
            // The FMAs flush denormals as `vdpbf16ps` does; the scales below run outside.
            // SAFETY (flush): `group_sums` is never inlined; it reads the panel and the
            // activations and leaves its sums in `sums`.
            unsafe { denormals_flushed(|| group_sums::<T, true>(words, w, groups.clone(), xb, t0, p0, sums)) };
        } else {
            unsafe { group_sums::<T, false>(words, w, groups.clone(), xb, t0, p0, sums) };
        }
        // The totals in registers across the chunk's groups.
        let totals = &mut self.totals[t0 * TILE_PAIRS..(t0 + T) * TILE_PAIRS];
        let mut tot: [__m512; TILE_PAIRS * TILE_TOKENS] = [_mm512_setzero_ps(); TILE_PAIRS * TILE_TOKENS];
        tot[..T * TILE_PAIRS].copy_from_slice(totals);
        for (i, g) in groups.enumerate() {
            let s = &self.scales[g * PAIRS + p0..g * PAIRS + p0 + TILE_PAIRS];
            let acc = &self.sums[i * TILE_PAIRS * T..(i + 1) * TILE_PAIRS * T];
            for t in 0..T {
                for p in 0..TILE_PAIRS {
                    let at = t * TILE_PAIRS + p;
                    tot[at] = _mm512_fmadd_ps(s[p], acc[at], tot[at]);
                }
            }
        }
        totals.copy_from_slice(&tot[..T * TILE_PAIRS]);
        T
    }
}

/// Per group `g` of `groups` (the `i`-th), token `t` and pair `p` of pairs `p0..p0 + TILE_PAIRS`,
/// the 8-lane sum of the group's products into `sums[(i * T + t) * TILE_PAIRS + p]`: the decoded `words` against
/// tokens `t0..t0 + T`, in the FMA form when `FMA` (two FMAs per `vdpbf16ps`, four per run:
/// the odd words of the low nibbles' run, the even ones, then the high nibbles'). Never inlined, so that no arithmetic of
/// its caller moves into a [`denormals_flushed`] region around it, nor this out.
///
/// # Safety
/// As [`super::int4_bf16`], with tokens `t0..t0 + T` present; `words` is a decoded row group
/// of `w`, `groups` lies inside its groups and `sums` holds `groups.len() * T * TILE_PAIRS`
/// vectors.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline(never)]
#[allow(clippy::needless_range_loop)] // `p` and `t` address two arrays each
unsafe fn group_sums<const T: usize, const FMA: bool>(words: &[__m512i], w: &Int4Matrix, groups: Range<usize>, xb: &[u16], t0: usize, p0: usize, sums: &mut [__m512]) {
    let k = w.cols();
    let xp = xb.as_ptr();
    for (i, g) in groups.enumerate() {
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
            sums[(i * T + t) * TILE_PAIRS..(i * T + t + 1) * TILE_PAIRS].copy_from_slice(&acc[t]);
        }
    }
}
