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
//!
//! From [`PANEL_MIN_TOKENS`] tokens (prefill) the row group is decoded once into a panel and
//! multiplied in register tiles ([`panel`]), with the same per-`(row, token)` operations.
//!
//! The panel can form each `vdpbf16ps`'s products as two FMAs on the words widened to f32
//! instead ([`Bf16Products`]), in the same lanes and order with denormals flushed as
//! `vdpbf16ps` flushes them, so bit for bit the same; this CPU's form is chosen for speed.

#![cfg(target_arch = "x86_64")]

mod panel;

use crate::cpu::simd::hsum;
use crate::cpu::Bf16Products;
use super::{Int4Matrix, ROW_GROUP, RUN, RUN_STRIDE};
use std::arch::x86_64::*;

/// Row pairs in a row group.
const PAIRS: usize = ROW_GROUP / 2;

/// How far ahead of the loads the weights are prefetched.
const PREFETCH: usize = 4096;

/// Tokens from which a row group is decoded once into a panel ([`panel`]) rather than once per
/// eight tokens.
const PANEL_MIN_TOKENS: usize = 16;

/// W4A16 rows `r0..r1` for `m` tokens of bf16 activations `xb` (bit patterns, `m × cols`)
/// into `out[(r - r0) * m + i]`, the panel's products formed as `form` says (the same bits
/// either way). Below [`PANEL_MIN_TOKENS`] tokens a pass takes `P` row pairs
/// and `T` tokens: eight pairs for one token at decode (eight accumulators with their totals,
/// where the weights stream from memory), and from two tokens `P · T = 16` (two pairs for
/// eight tokens from eight, where each decoded run serves eight tokens): sixteen independent
/// `vdpbf16ps` chains, as its latency (six cycles at two a cycle on Zen 5) asks, with the
/// totals, touched once per group, spilled; eight chains ran batch-2 to batch-8 decode
/// 1.2x slower. From [`PANEL_MIN_TOKENS`] the row group is decoded once for every token
/// ([`panel`]).
///
/// # Safety
/// AVX-512 F/BW/VL/BF16 available ([`crate::cpu::caps::bf16_dot_available`]);
/// `r0 <= r1 <= w.rows()`, `xb.len() == m * w.cols()`, `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
pub(crate) unsafe fn int4_bf16(form: Bf16Products, w: &Int4Matrix, r0: usize, r1: usize, xb: &[u16], m: usize, out: &mut [f32]) {
    if r0 == r1 {
        return;
    }
    let table = word_table();
    if m >= PANEL_MIN_TOKENS {
        // SAFETY: forwarded contract.
        return unsafe { panel::int4_bf16_panel(form, w, &table, r0, r1, xb, m, out) };
    }
    for rg in r0 / ROW_GROUP..(r1 - 1) / ROW_GROUP + 1 {
        let mut t0 = 0;
        while t0 < m {
            let t = m - t0;
            // SAFETY: forwarded contract; tokens t0.. exist; row group rg exists.
            t0 += unsafe {
                if t >= 8 {
                    passes::<2, 8>(w, &table, rg, xb, t0, r0, r1, m, out)
                } else if t >= 4 {
                    passes::<4, 4>(w, &table, rg, xb, t0, r0, r1, m, out)
                } else if t >= 2 {
                    passes::<8, 2>(w, &table, rg, xb, t0, r0, r1, m, out)
                } else {
                    passes::<8, 1>(w, &table, rg, xb, t0, r0, r1, m, out)
                }
            };
        }
    }
}

/// Every pair of row group `rg` against tokens `t0..t0 + T`, `P` pairs a pass, results into
/// `out` for the rows in `r0..r1`; returns `T`.
///
/// # Safety
/// As [`int4_bf16`], with tokens `t0..t0 + T` present and `rg` a row group of `w`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::too_many_arguments)] // the kernel's inputs plus the row group and token block
unsafe fn passes<const P: usize, const T: usize>(
    w: &Int4Matrix,
    table: &__m512i,
    rg: usize,
    xb: &[u16],
    t0: usize,
    r0: usize,
    r1: usize,
    m: usize,
    out: &mut [f32],
) -> usize {
    for p0 in (0..PAIRS).step_by(P) {
        // SAFETY: forwarded contract; pairs p0..p0 + P of the group exist.
        let totals = unsafe { pair_tokens::<P, T>(w, table, rg, p0, xb, t0) };
        for (tt, pairs) in totals.iter().enumerate() {
            store_pairs(pairs, rg * ROW_GROUP + 2 * p0, t0 + tt, r0, r1, m, out);
        }
    }
    T
}

/// The 32-column runs of scale group `g` (the last group may be short).
fn group_runs(w: &Int4Matrix, g: usize) -> std::ops::Range<usize> {
    let group = w.group().min(w.cols());
    g * group / RUN..((g + 1) * group).min(w.cols()) / RUN
}

/// The 32-word table whose word `i` is `bf16(i - 16)`.
#[target_feature(enable = "avx512f")]
fn word_table() -> __m512i {
    let words: [u16; 32] = std::array::from_fn(|i| ((i as f32 - 16.0).to_bits() >> 16) as u16);
    // SAFETY: 32 words are 64 bytes.
    unsafe { _mm512_loadu_si512(words.as_ptr().cast()) }
}

/// Lane `l` of a pair's scale vectors belongs to row `2p + l / 8` of the pair's two rows:
/// the 32-bit lane indices `2p + l / 8` into a row group's 16 per-row values.
#[target_feature(enable = "avx512f")]
fn pair_lanes(p: usize) -> __m512i {
    let lane = _mm512_srli_epi32::<3>(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    _mm512_add_epi32(_mm512_set1_epi32(2 * p as i32), lane)
}

/// A row group's scales and table biases of group `g`: 16 scales, and per word of a pair's
/// widened run the index bias `8 - z` of its row (the table index of code n is n + 8 - z,
/// 1..=31), for pair `p` ([`pair_lanes`]`(p)` in `at`).
#[target_feature(enable = "avx512f,avx512bw")]
fn group_params<const P: usize>(w: &Int4Matrix, rg: usize, g: usize, at: &[__m512i; P]) -> ([__m512; P], [__m512i; P]) {
    // SAFETY: 16 scales; 16 zero points widened to 32-bit lanes.
    let (s16, z16) = unsafe {
        (_mm512_loadu_ps(w.group_scales(rg, g).as_ptr()), _mm512_cvtepi8_epi32(_mm_loadu_si128(w.group_zeros(rg, g).as_ptr().cast())))
    };
    // Pair p's bias per word spreads 32-bit lanes 2p, 2p + 1 of `bias16` over the halves.
    let bias16 = _mm512_sub_epi32(_mm512_set1_epi32(8), z16);
    let scales = std::array::from_fn(|p| _mm512_permutexvar_ps(at[p], s16));
    let bias = std::array::from_fn(|p| {
        let b = _mm512_permutexvar_epi32(at[p], bias16);
        _mm512_or_si512(b, _mm512_slli_epi32::<16>(b))
    });
    (scales, bias)
}

/// The words `bf16(q - z)` of one run of a row pair from its 32 packed bytes at `src` (row
/// `2p` in the low 256 bits): the low nibbles' 32 columns, then the high nibbles'.
///
/// # Safety
/// `src` points to 32 readable bytes.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
#[inline]
unsafe fn decode_pair(src: *const u8, bias: __m512i, table: __m512i) -> (__m512i, __m512i) {
    let nib = _mm512_set1_epi16(0x0F);
    // SAFETY: caller's contract.
    let v = _mm512_cvtepu8_epi16(unsafe { _mm256_loadu_si256(src.cast()) });
    let lo = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_and_si512(v, nib), bias), table);
    let hi = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16::<4>(v), bias), table);
    (lo, hi)
}

/// Token `t`'s 16 activations at `xa` broadcast to both halves of a 512-bit register, and
/// the next 16.
///
/// # Safety
/// `xa` points to 32 readable words.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
unsafe fn tokens_run(xa: *const u16) -> (__m512i, __m512i) {
    // SAFETY: caller's contract.
    unsafe { (_mm512_broadcast_i64x4(_mm256_loadu_si256(xa.cast())), _mm512_broadcast_i64x4(_mm256_loadu_si256(xa.add(16).cast()))) }
}

/// The 32 bf16 words of `v` as f32, the odd word of each 32-bit lane (its high half) and then
/// the even one: the two FMA operands ([`Bf16Products::Fma`]) of one `vdpbf16ps` operand,
/// in the order `vdpbf16ps` adds their products.
#[target_feature(enable = "avx512f")]
#[inline]
fn widen(v: __m512i) -> [__m512; 2] {
    let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000_u32 as i32));
    [_mm512_castsi512_ps(odd), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))]
}

/// `acc` plus a run's products by two `vdpbf16ps`: the word vectors `lo` and `hi` against a
/// token's activation halves `xl` and `xh`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn dot_run(acc: __m512, lo: __m512i, hi: __m512i, xl: __m512i, xh: __m512i) -> __m512 {
    _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc, bh(lo), bh(xl)), bh(hi), bh(xh))
}

/// Writes one token's pair totals (pairs from row `row0` on, two rows each) as outputs
/// `out[(r - r0) * m + t]` for the rows inside `r0..r1`: each row's eight lanes summed by
/// [`hsum`]'s fixed tree.
#[target_feature(enable = "avx2,avx512f")]
fn store_pairs(pairs: &[__m512], row0: usize, t: usize, r0: usize, r1: usize, m: usize, out: &mut [f32]) {
    let mut lanes = [0f32; 16];
    for (p, v) in pairs.iter().enumerate() {
        // SAFETY: 16 floats into a 16-float array.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr().cast(), *v) };
        for (h, half) in lanes.chunks_exact(8).enumerate() {
            let r = row0 + 2 * p + h;
            if (r0..r1).contains(&r) {
                // SAFETY: this function runs with AVX-512, which implies AVX.
                out[(r - r0) * m + t] = unsafe { hsum(_mm256_loadu_ps(half.as_ptr())) };
            }
        }
    }
}

/// Pairs `p0..p0 + P` of row group `rg` against tokens `t0..t0 + T`: per token and pair the
/// 8-lane totals `Σ_g s[g] · acc_g` of its two rows (row `2 p` in the low half).
///
/// # Safety
/// As [`int4_bf16`], with tokens `t0..t0 + T` present, `rg` a row group of `w` and
/// `p0 + P <= PAIRS`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::needless_range_loop)] // `p` also addresses the packed rows
unsafe fn pair_tokens<const P: usize, const T: usize>(w: &Int4Matrix, table: &__m512i, rg: usize, p0: usize, x: &[u16], t0: usize) -> [[__m512; P]; T] {
    let k = w.cols();
    let base = w.row_ptr(rg * ROW_GROUP).wrapping_add(32 * p0);
    let xp = x.as_ptr();
    let at: [__m512i; P] = std::array::from_fn(|p| pair_lanes(p0 + p));
    let mut total = [[_mm512_setzero_ps(); P]; T];
    for g in 0..w.groups() {
        let (scales, bias) = group_params::<P>(w, rg, g, &at);
        let mut acc = [[_mm512_setzero_ps(); P]; T];
        for j in group_runs(w, g) {
            for p in 0..P {
                if p % 2 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(j * RUN_STRIDE + 32 * p + PREFETCH).cast());
                }
                // SAFETY: run j of rows 2(p0 + p), 2(p0 + p) + 1 of the group: 32 bytes inside
                // the packed data.
                let (lo, hi) = unsafe { decode_pair(base.add(j * RUN_STRIDE + 32 * p), bias[p], *table) };
                for (t, a) in acc.iter_mut().enumerate() {
                    // SAFETY: token t0 + t's columns j*32..j*32+32 lie inside x.
                    let (xl, xh) = unsafe { tokens_run(xp.add((t0 + t) * k + j * RUN)) };
                    a[p] = dot_run(a[p], lo, hi, xl, xh);
                }
            }
        }
        for (tot, a) in total.iter_mut().zip(&acc) {
            for p in 0..P {
                tot[p] = _mm512_fmadd_ps(scales[p], a[p], tot[p]);
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
