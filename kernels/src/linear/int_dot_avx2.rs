//! AVX2 + FMA kernels for the int4 / int8 linear layers (W4A16, W4A8, W8A8 int8), with an
//! AVX-512 VNNI level of the W8A8 int8 integer sums (chosen by [`crate::cpu::GemmLevel`], as
//! the GGUF integer GEMM's is; W4A8's lives in [`crate::linear::int4::vnni`]).
//!
//! Every kernel fills `out[(r - r0) * m + i]` like the scalar ones in [`super::int4`] and
//! [`super::int8`], walking the tokens in blocks of up to 8 and, per block, every weight row
//! once, so each unpacked weight vector serves all tokens of the block.
//!
//! Batch invariance: the operations that produce one `(row, token)` result, and their order,
//! depend only on the matrix and that token's activations, never on `m`, the block the token
//! lands in, or the row range:
//! - W4A16 keeps one 8-lane f32 accumulator per `(row, token)` for the current group,
//!   fed in a fixed column order (`0..8, 16..24, 8..16, 24..32` of each 32-column run), folded
//!   into an 8-lane total with `total = fma(s[g], acc, total)` at each group end (the row end
//!   for a short last group), and summed across lanes by one fixed tree ([`hsum`]). Tiles
//!   only choose how many of these independent accumulators run side by side; column blocks
//!   save and restore them exactly.
//! - W4A8 and W8A8 sum integer products exactly (int16 partial sums that cannot overflow,
//!   then int32; or, with `vpdpbusd`, int32 directly), so any grouping gives the same
//!   integers, and the f32 epilogue repeats the scalar kernel's operations in its order. The
//!   integer paths are therefore bit-identical to the scalar kernels, not just close.

#![cfg(target_arch = "x86_64")]

use super::int4::{Int4Matrix, ROW_GROUP, RUN, RUN_STRIDE};
use super::int8::Int8Matrix;
use crate::cpu::simd::{hsum, hsum_epi32};
use std::arch::x86_64::*;

/// Most tokens one block serves (the integer epilogues vectorize over 8 tokens).
const TOKENS: usize = 8;

/// Bytes of f32 activations a W4A16 column block may span (all its tokens), so the block
/// stays in L1 while every row of the task streams past it.
const F32_BLOCK_BYTES: usize = 16 * 1024;

/// Lane `j` of the result is the (wrapping) sum of the 8 lanes of `v[j]`.
///
/// A transpose-and-add by unpacks (14 one-cycle shuffles, 7 adds) rather than six `vphaddd`,
/// which Zen 3 issues once per 2 cycles: the int16 W4A16 and the W4A8 kernels' group ends
/// measured 1-5% faster there (docs/benchmarks/quantized-speed.md).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn reduce8(v: &[__m256i]) -> __m256i {
    // Pairs: lanes (a0+a2, b0+b2, a1+a3, b1+b3) per 128-bit half.
    let pair = |a: __m256i, b: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    // Quads: lanes (Σa, Σb, Σc, Σd) per 128-bit half.
    let quad = |ab: __m256i, cd: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    let q03 = quad(pair(v[0], v[1]), pair(v[2], v[3]));
    let q47 = quad(pair(v[4], v[5]), pair(v[6], v[7]));
    let lo = _mm256_permute2x128_si256::<0x20>(q03, q47);
    let hi = _mm256_permute2x128_si256::<0x31>(q03, q47);
    _mm256_add_epi32(lo, hi)
}

/// `sums[i] = Σ lanes of v[i]` (integer, so any order is exact).
#[target_feature(enable = "avx2,fma")]
fn lane_sums(v: &[__m256i], sums: &mut [i32]) {
    debug_assert_eq!(v.len(), sums.len());
    let mut vc = v.chunks_exact(8);
    let mut sc = sums.chunks_exact_mut(8);
    for (v8, s8) in (&mut vc).zip(&mut sc) {
        // SAFETY: `s8` holds 8 i32 (32 bytes); unaligned store.
        unsafe { _mm256_storeu_si256(s8.as_mut_ptr().cast(), reduce8(v8)) };
    }
    for (v, s) in vc.remainder().iter().zip(sc.into_remainder()) {
        // SAFETY: this function runs with AVX2.
        *s = unsafe { hsum_epi32(*v) };
    }
}

// ---------------------------------------------------------------------------------------------
// W4A16: int4 weights x f32 activations.

/// W4A16 rows `r0..r1` for `m` tokens of `x` into `out[(r - r0) * m + i]`.
///
/// # Safety
/// AVX2+FMA available; `r0 <= r1 <= w.rows()`, `x.len() == m * w.cols()`,
/// `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn int4_f32(w: &Int4Matrix, r0: usize, r1: usize, x: &[f32], m: usize, out: &mut [f32]) {
    // Rows go in slices whose state (512 bytes a row) stays small: a large state buffer would
    // be mapped and unmapped by the allocator on every call.
    let mut state = vec![_mm256_setzero_ps(); (r1 - r0).min(STATE_ROWS) * STATE];
    let mut s0 = r0;
    while s0 < r1 {
        let s1 = (s0 + STATE_ROWS).min(r1);
        // SAFETY: forwarded contract; rows s0..s1 lie inside r0..r1, and their outputs start
        // at row s0 - r0 of `out`.
        unsafe { int4_f32_rows(w, s0, s1, x, m, &mut state[..(s1 - s0) * STATE], &mut out[(s0 - r0) * m..]) };
        s0 = s1;
    }
}

/// Rows per [`int4_f32`] slice (32 KiB of state).
const STATE_ROWS: usize = 64;

/// [`int4_f32`] for rows `r0..r1` with `state` holding [`STATE`] vectors per row.
///
/// # Safety
/// As [`int4_f32`].
#[target_feature(enable = "avx2,fma")]
unsafe fn int4_f32_rows(w: &Int4Matrix, r0: usize, r1: usize, x: &[f32], m: usize, state: &mut [__m256], out: &mut [f32]) {
    let mut t0 = 0;
    while t0 < m {
        let t = (m - t0).min(TOKENS);
        // Few tokens: several rows side by side keep enough independent FMA chains in flight.
        // SAFETY: forwarded contract; tokens t0..t0 + t exist.
        unsafe {
            match t {
                1 => f32_block::<4, 1>(w, r0, r1, x, m, t0, state, out),
                2 => f32_block::<4, 2>(w, r0, r1, x, m, t0, state, out),
                3 => f32_block::<2, 3>(w, r0, r1, x, m, t0, state, out),
                4 => f32_block::<2, 4>(w, r0, r1, x, m, t0, state, out),
                5 => f32_block::<1, 5>(w, r0, r1, x, m, t0, state, out),
                6 => f32_block::<1, 6>(w, r0, r1, x, m, t0, state, out),
                7 => f32_block::<1, 7>(w, r0, r1, x, m, t0, state, out),
                _ => f32_block::<1, 8>(w, r0, r1, x, m, t0, state, out),
            }
        }
        t0 += t;
    }
}

/// Vectors of W4A16 state per row: the open group's accumulators (`0..T`) and the totals
/// (`TOKENS..TOKENS + T`) of up to 8 tokens.
const STATE: usize = 2 * TOKENS;

/// Tokens `t0..t0 + T` against rows `r0..r1`, `R` rows per micro-kernel call, columns in
/// blocks that keep the `T` activation rows in L1.
///
/// `state` holds [`STATE`] vectors per row of `r0..r1`.
///
/// # Safety
/// As [`int4_f32`], with `t0 + T <= m`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)] // the row-kernel signature plus the token block and state
unsafe fn f32_block<const R: usize, const T: usize>(
    w: &Int4Matrix,
    r0: usize,
    r1: usize,
    x: &[f32],
    m: usize,
    t0: usize,
    state: &mut [__m256],
    out: &mut [f32],
) {
    let k = w.cols();
    let kb = if T * k * 4 <= F32_BLOCK_BYTES * 3 / 2 { k } else { (F32_BLOCK_BYTES / (4 * T) / RUN * RUN).max(RUN) };
    state.fill(_mm256_setzero_ps());
    let xt = &x[t0 * k..(t0 + T) * k];
    let mut c0 = 0;
    while c0 < k {
        let c1 = (c0 + kb).min(k);
        let mut r = r0;
        while r + R <= r1 {
            // SAFETY: rows r..r + R exist; columns c0..c1 are whole runs inside the row.
            unsafe { f32_micro::<R, T>(w, r, xt, c0, c1, &mut state[(r - r0) * STATE..(r - r0 + R) * STATE]) };
            r += R;
        }
        while r < r1 {
            // SAFETY: as above, one row.
            unsafe { f32_micro::<1, T>(w, r, xt, c0, c1, &mut state[(r - r0) * STATE..(r - r0 + 1) * STATE]) };
            r += 1;
        }
        c0 = c1;
    }
    for (row, st) in state.chunks_exact(STATE).enumerate() {
        for (t, &v) in st[TOKENS..TOKENS + T].iter().enumerate() {
            // SAFETY: this function runs with AVX2.
            out[row * m + t0 + t] = unsafe { hsum(v) };
        }
    }
}

/// Rows `r..r + R`, columns `c0..c1` (whole runs), `T` activation rows of `x` (stride
/// `cols`): `acc += (q - z) · x` per column, and at each group end (`min((g + 1) · group,
/// cols)`, so a short last group closes at the row end) `total = fma(s[g], acc, total)`,
/// `acc = 0`.
///
/// # Safety
/// AVX2+FMA available; `r + R <= w.rows()`; `c0`, `c1` multiples of 32 with
/// `c1 <= w.cols()`; `x.len() == T * w.cols()`; `st.len() == R * STATE`.
#[target_feature(enable = "avx2,fma")]
unsafe fn f32_micro<const R: usize, const T: usize>(
    w: &Int4Matrix,
    r: usize,
    x: &[f32],
    c0: usize,
    c1: usize,
    st: &mut [__m256],
) {
    let (k, group) = (w.cols(), w.group());
    // Only the open groups' accumulators live in registers; totals are touched at group ends.
    let mut acc: [[__m256; T]; R] = std::array::from_fn(|rr| std::array::from_fn(|t| st[rr * STATE + t]));
    let rows: [*const u8; R] = std::array::from_fn(|rr| w.row_ptr(r + rr));
    let block = w.row_ptr(r / ROW_GROUP * ROW_GROUP);
    let lo_mask = _mm256_set1_epi32(0x0F);
    let xp = x.as_ptr();
    let mut col = c0;
    while col < c1 {
        let g = col / group;
        // Group g ends at the row end if it is the short last one; this block may stop earlier.
        let glast = ((g + 1) * group).min(k);
        let gend = glast.min(c1);
        let off: [__m256i; R] = std::array::from_fn(|rr| _mm256_set1_epi32(8 + w.row_zeros(r + rr).map_or(0, |z| z[g]) as i32));
        for c in (col..gend).step_by(RUN) {
            prefetch_runs(block, r, c / RUN);
            for rr in 0..R {
                for half in 0..2 {
                    // SAFETY: row rr's packed bytes c/2..c/2+16 exist (c + 32 <= cols); bytes
                    // half*8..+8 hold columns c+half*8..+8 (low nibbles) and c+16+half*8..+8
                    // (high nibbles).
                    let v = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(rows[rr].add(c / RUN * RUN_STRIDE + half * 8).cast()) });
                    let lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, lo_mask), off[rr]));
                    let hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<4>(v), off[rr]));
                    for (t, a) in acc[rr].iter_mut().enumerate() {
                        // SAFETY: token t's columns c..c+32 lie inside x (t < T, c + 32 <= k).
                        unsafe {
                            let xa = xp.add(t * k + c + half * 8);
                            *a = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xa), *a);
                            *a = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xa.add(16)), *a);
                        }
                    }
                }
            }
        }
        if gend == glast {
            for (rr, s) in st.chunks_exact_mut(STATE).enumerate() {
                let sc = _mm256_set1_ps(w.row_scales(r + rr)[g]);
                for (total, a) in s[TOKENS..TOKENS + T].iter_mut().zip(&mut acc[rr]) {
                    *total = _mm256_fmadd_ps(sc, *a, *total);
                    *a = _mm256_setzero_ps();
                }
            }
        }
        col = gend;
    }
    for (rr, s) in st.chunks_exact_mut(STATE).enumerate() {
        s[..T].copy_from_slice(&acc[rr]);
    }
}

// ---------------------------------------------------------------------------------------------
// W4A8: int4 weights x int8 activations.

/// W4A8 rows `r0..r1` for `m` tokens (`xq` int8, `xs` token scales) into
/// `out[(r - r0) * m + i]`. Bit-identical to [`Int4Matrix::rows_int8_scalar`].
///
/// Per 32-column run the stored nibbles `n = q + 8` (0..=15) are the unsigned operand of
/// `maddubs` against the activations; up to 8 runs (4 where two rows share a register) add
/// up in int16 (each lane at most 16 products of |n·a| <= 15·128), then `madd` widens to
/// int32 per group. The offset is removed exactly afterwards: `Σ (q - z) a = Σ n a - (8 + z)
/// Σ a`.
///
/// # Safety
/// AVX2+FMA available; `r0 <= r1 <= w.rows()`, `xq.len() == m * w.cols()`, `xs.len() == m`,
/// `out.len() >= (r1 - r0) * m`.
///
/// With `VNNI` (the CPU must have AVX-512 F/BW/VNNI) the interleaved sixteen-row kernel
/// [`crate::linear::int4::vnni`] runs instead: the same integers and epilogue, so the same bits.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn int4_int8<const VNNI: bool>(w: &Int4Matrix, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
    let asum = group_sums(xq, w.cols(), w.group());
    if VNNI {
        // SAFETY: forwarded contract (AVX-512 VNNI with VNNI); `asum` holds m * groups sums.
        return unsafe { crate::linear::int4::vnni::int4_int8(w, r0, r1, xq, xs, &asum, m, out) };
    }
    let mut t0 = 0;
    while t0 < m {
        let t = (m - t0).min(TOKENS);
        // SAFETY: forwarded contract; tokens t0..t0 + t exist.
        unsafe {
            match t {
                1 => int4_block::<16, 1>(w, r0, r1, xq, xs, &asum, m, t0, out),
                2 => int4_block::<4, 2>(w, r0, r1, xq, xs, &asum, m, t0, out),
                3 => int4_block::<2, 3>(w, r0, r1, xq, xs, &asum, m, t0, out),
                4 => int4_block::<2, 4>(w, r0, r1, xq, xs, &asum, m, t0, out),
                5 => int4_block::<1, 5>(w, r0, r1, xq, xs, &asum, m, t0, out),
                6 => int4_block::<1, 6>(w, r0, r1, xq, xs, &asum, m, t0, out),
                7 => int4_block::<1, 7>(w, r0, r1, xq, xs, &asum, m, t0, out),
                _ => int4_block::<1, 8>(w, r0, r1, xq, xs, &asum, m, t0, out),
            }
        }
        t0 += t;
    }
}

/// `sums[i * ng + g] = Σ xq[i, c]` over the columns of group `g` (exact, via `sad` of the
/// bytes offset to unsigned), `ng = ceil(k / group)`. `k` and `group` are multiples of 32; the
/// last group may be short.
#[target_feature(enable = "avx2,fma")]
fn group_sums(xq: &[i8], k: usize, group: usize) -> Vec<i32> {
    let ng = k.div_ceil(group);
    let mut sums = vec![0i32; xq.len() / k * ng];
    let flip = _mm256_set1_epi8(i8::MIN);
    for (row, s) in xq.chunks_exact(k).zip(sums.chunks_exact_mut(ng)) {
        for (grp, s) in row.chunks(group).zip(s) {
            let mut acc = _mm256_setzero_si256();
            for run in grp.chunks_exact(RUN) {
                // SAFETY: `run` holds 32 bytes.
                let v = unsafe { _mm256_loadu_si256(run.as_ptr().cast()) };
                acc = _mm256_add_epi64(acc, _mm256_sad_epu8(_mm256_xor_si256(v, flip), _mm256_setzero_si256()));
            }
            let mut lanes = [0i64; 4];
            // SAFETY: 32 bytes into a 4 x i64 array.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc) };
            *s = (lanes.iter().sum::<i64>() - 128 * grp.len() as i64) as i32;
        }
    }
    sums
}

/// Tokens `t0..t0 + T` of W4A8 against rows `r0..r1`: whole row groups in passes of `R` rows,
/// then `R` rows at a time, then single rows where fewer are left (or the row is odd).
///
/// # Safety
/// As [`int4_int8`], with `t0 + T <= m` and `asum` from [`group_sums`].
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)] // the row-kernel signature plus the token block and sums
unsafe fn int4_block<const R: usize, const T: usize>(
    w: &Int4Matrix,
    r0: usize,
    r1: usize,
    xq: &[i8],
    xs: &[f32],
    asum: &[i32],
    m: usize,
    t0: usize,
    out: &mut [f32],
) {
    let (k, ng) = (w.cols(), w.groups());
    let xt = &xq[t0 * k..(t0 + T) * k];
    let at = &asum[t0 * ng..(t0 + T) * ng];
    let xst = &xs[t0..t0 + T];
    let per_row = T * ng;
    // Room for a whole row group: its passes of R rows walk the row side by side.
    let mut lanes = vec![_mm256_setzero_si256(); ROW_GROUP * per_row];
    let mut isum = vec![0i32; ROW_GROUP * per_row];
    // Full blocks of grouped rows finish 8 tokens per vector: Σ a transposed to [g][t].
    let asum_gt: Option<Vec<i32>> = (T == TOKENS && ng > 1).then(|| (0..ng * T).map(|i| at[(i % T) * ng + i / T]).collect());
    let mut r = r0;
    while r < r1 {
        // A whole row group where the range holds one (the passes then share each chunk of
        // runs while it is in L1, and the first pass's prefetches cover them all), else R
        // rows, else one.
        let (rows, passes) = if r.is_multiple_of(ROW_GROUP) && r + ROW_GROUP <= r1 {
            (R, ROW_GROUP / R)
        } else if r + R <= r1 && r.is_multiple_of(2) {
            // (Even rows: the micro-kernel loads rows in adjacent pairs.)
            (R, 1)
        } else {
            (1, 1)
        };
        // SAFETY: rows r..r + rows · passes exist; xt holds T tokens; lanes hold a row group's
        // T * ng vectors per row.
        unsafe {
            if rows == R {
                int4_micro::<R, T>(w, r, passes, xt, &mut lanes[..R * passes * per_row])
            } else {
                int4_micro::<1, T>(w, r, 1, xt, &mut lanes[..per_row])
            }
        }
        for p in 0..passes {
            let (l, i) = (&mut lanes[p * rows * per_row..(p + 1) * rows * per_row], &mut isum[p * rows * per_row..(p + 1) * rows * per_row]);
            int4_pass_epilogue::<R, T>(w, r + p * rows, rows, l, i, at, asum_gt.as_deref(), xst, &mut out[(r + p * rows - r0) * m..], m, t0);
        }
        r += rows * passes;
    }
}

/// The epilogue of [`int4_block`] for rows `r..r + rows` (`rows` is `R` or 1) whose lane sums
/// `l` [`int4_micro`] filled: `out[(r + rr) * m + t0 + t]` relative to `out`'s first row `r`.
/// `asum_gt`, the activation sums by group then token, is given for full 8-token blocks of
/// grouped rows, which finish 8 tokens per vector.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)] // the pass's rows, sums and outputs
fn int4_pass_epilogue<const R: usize, const T: usize>(
    w: &Int4Matrix,
    r: usize,
    rows: usize,
    l: &[__m256i],
    i: &mut [i32],
    at: &[i32],
    asum_gt: Option<&[i32]>,
    xst: &[f32],
    out: &mut [f32],
    m: usize,
    t0: usize,
) {
    let per_row = l.len() / rows;
    if let Some(asum_gt) = asum_gt {
        for (rr, l) in l.chunks_exact(per_row).enumerate() {
            let o = rr * m + t0;
            int4_epilogue_tokens(w.row_scales(r + rr), w.row_zeros(r + rr), l, asum_gt, xst, &mut out[o..o + T]);
        }
        return;
    }
    lane_sums(l, i);
    if T == 1 && rows == R && R.is_multiple_of(8) {
        // One token, eight rows at a time: the epilogue runs over their lanes at once.
        for (b, i) in i.chunks_exact(8 * per_row).enumerate() {
            let vals = int4_epilogue_rows(w, r + 8 * b, i, at, xst[0]);
            for (rr, v) in vals.into_iter().enumerate() {
                out[(8 * b + rr) * m + t0] = v;
            }
        }
        return;
    }
    for (rr, isum) in i.chunks_exact(per_row).enumerate() {
        let o = rr * m + t0;
        int4_epilogue(w.row_scales(r + rr), w.row_zeros(r + rr), isum, at, xst, &mut out[o..o + T]);
    }
}

/// How far ahead of the loads the int4 kernels prefetch the packed weights (as the VNNI
/// kernel does: a decode step streams them from DRAM once).
const PREFETCH: usize = 4096;

/// Asks for the bytes [`PREFETCH`] ahead of run `j` of every row of the row group whose
/// first row starts at `block` (the group's rows lie side by side in a run, 16 bytes each:
/// four cache lines), from the pass whose first row `r` is the group's first only: the
/// kernels take a group's rows in passes (of eight rows, or single rows), that pass walks its
/// runs first, and the later passes find the lines in cache. (Asking for the first pass's two
/// lines only left the second pass waiting on DRAM: W4A8 at one token read 13 GiB/s, against
/// 27 for the int16 W4A16 kernel, which asks for all four.) A hint: an address past the data
/// is never dereferenced.
#[target_feature(enable = "avx2")]
#[inline]
fn prefetch_runs(block: *const u8, r: usize, j: usize) {
    if !r.is_multiple_of(ROW_GROUP) {
        return;
    }
    for line in 0..RUN_STRIDE / 64 {
        _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(j * RUN_STRIDE + 64 * line + PREFETCH).cast());
    }
}

/// The 32 codes `n = q + 8` of the packed run at `p`, in column order: the low 128-bit lane
/// holds the low nibbles (columns 0..16), the high lane the high ones (columns 16..32).
///
/// # Safety
/// AVX2 available; `p` points to 16 readable bytes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn run_nibbles(p: *const u8) -> __m256i {
    // SAFETY: 16 readable bytes (caller's contract).
    let b = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p.cast()) });
    _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F))
}

/// `passes` blocks of `R` rows from `r` against `T` int8 activation rows:
/// `lanes[((p * R + rr) * T + t) * ng + g]` gets 8 int32 partial sums of `Σ n · a` of row
/// `r + p · R + rr` over group `g` (`n = q + 8`; the last group stops at the row end). The
/// passes take each chunk of runs in turn, so a row group's chunk is read from DRAM once, by
/// the first pass, and the rest find it in L1.
///
/// With `R` even (then `r` is even), rows go in adjacent pairs: one 32-byte load holds run
/// `j` of both (16 bytes each), so masking its low nibbles gives columns `0..16` of both rows
/// (one per 128-bit lane) and its high nibbles columns `16..32`, each against those
/// activations broadcast to both lanes: 1.5 instructions per row and run fewer than
/// broadcasting one row's run and shifting its halves apart (a row-pair loop in L1 ran 1.48
/// cycles per row and run against 2.24). A pair's int32 sums are split back into its two
/// rows' lanes (the other half zero), so the lane sums are the same integers. One token takes
/// all sixteen rows of a group in one pass (eight pair accumulators), so each run's 256 bytes
/// are read in order, as the GGUF kernels read their records: on one 8192 x 2048 matrix from
/// DRAM that took the kernel from 0.68-0.70x Q4_1's bandwidth to 0.84-0.90x.
///
/// # Safety
/// AVX2 available; `r + passes · R <= w.rows()`, `r` even when `R` is; `xq.len() == T *
/// w.cols()`; `lanes.len() == passes * R * T * ng`.
#[target_feature(enable = "avx2,fma")]
unsafe fn int4_micro<const R: usize, const T: usize>(w: &Int4Matrix, r: usize, passes: usize, xq: &[i8], lanes: &mut [__m256i]) {
    let (k, ng) = (w.cols(), w.groups());
    let runs = w.group() / RUN;
    let row_runs = k / RUN;
    let block = w.row_ptr(r / ROW_GROUP * ROW_GROUP);
    let ones = _mm256_set1_epi16(1);
    let xp = xq.as_ptr();
    let paired = R.is_multiple_of(2);
    debug_assert!(!paired || r.is_multiple_of(2));
    // Products summed in an i16 lane per run: two (single rows) or four (pairs), each at
    // most 15 · 128 in magnitude, so 8 or 4 runs fit.
    let chunk = if paired { 4 } else { 8 };
    for g in 0..ng {
        let (mut run, end) = (g * runs, ((g + 1) * runs).min(row_runs));
        while run < end {
            let stop = (run + chunk).min(end);
            for p in 0..passes {
                let first = r + p * R;
                let rows: [*const u8; R] = std::array::from_fn(|rr| w.row_ptr(first + rr));
                let mut acc = [[_mm256_setzero_si256(); T]; R];
                for j in run..stop {
                    prefetch_runs(block, first, j);
                    if paired {
                        // SAFETY: token t's columns j*32..j*32+32 lie inside xq.
                        let a: [(__m256i, __m256i); T] = std::array::from_fn(|t| unsafe {
                            let at = xp.add(t * k + j * RUN);
                            (_mm256_broadcastsi128_si256(_mm_loadu_si128(at.cast())), _mm256_broadcastsi128_si256(_mm_loadu_si128(at.add(16).cast())))
                        });
                        for (pr, acc) in acc.iter_mut().take(R / 2).enumerate() {
                            // SAFETY: rows 2pr and 2pr + 1 of the pass sit side by side in run
                            // j (the pair starts at an even row of the group): 32 bytes.
                            let v = unsafe { _mm256_loadu_si256(rows[2 * pr].add(j * RUN_STRIDE).cast()) };
                            let (lo, hi) = nibbles(v);
                            for (acc, (xl, xh)) in acc.iter_mut().zip(&a) {
                                *acc = _mm256_add_epi16(*acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, *xl), _mm256_maddubs_epi16(hi, *xh)));
                            }
                        }
                    } else {
                        // SAFETY: token t's columns j*32..j*32+32 lie inside xq.
                        let a: [__m256i; T] = std::array::from_fn(|t| unsafe { _mm256_loadu_si256(xp.add(t * k + j * RUN).cast()) });
                        for (rr, acc) in acc.iter_mut().enumerate() {
                            // SAFETY: row rr's packed bytes j*16..j*16+16 exist (j < cols / 32).
                            let nib = unsafe { run_nibbles(rows[rr].add(j * RUN_STRIDE)) };
                            for (t, acc) in acc.iter_mut().enumerate() {
                                *acc = _mm256_add_epi16(*acc, _mm256_maddubs_epi16(nib, a[t]));
                            }
                        }
                    }
                }
                let fresh = run == g * runs;
                let mut put = |rr: usize, t: usize, v: __m256i| {
                    let l = &mut lanes[((p * R + rr) * T + t) * ng + g];
                    *l = if fresh { v } else { _mm256_add_epi32(*l, v) };
                };
                if paired {
                    let zero = _mm256_setzero_si256();
                    for (pr, acc) in acc.iter().take(R / 2).enumerate() {
                        for (t, a) in acc.iter().enumerate() {
                            let v = _mm256_madd_epi16(*a, ones);
                            put(2 * pr, t, _mm256_blend_epi32::<0xF0>(v, zero));
                            put(2 * pr + 1, t, _mm256_blend_epi32::<0x0F>(v, zero));
                        }
                    }
                } else {
                    for (rr, acc) in acc.iter().enumerate() {
                        for (t, a) in acc.iter().enumerate() {
                            put(rr, t, _mm256_madd_epi16(*a, ones));
                        }
                    }
                }
            }
            run = stop;
        }
    }
}

/// The codes `n = q + 8` of two rows' runs loaded side by side: low nibbles (each row's
/// columns `0..16` in its 128-bit lane) and high nibbles (columns `16..32`).
#[target_feature(enable = "avx2")]
#[inline]
fn nibbles(v: __m256i) -> (__m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0F);
    (_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask))
}

/// The scalar kernel's epilogue for one row and `T = dst.len()` tokens:
/// `acc = 0; acc += s[g] · f32(Σ n a - (8 + z[g]) Σ a)` in group order, `dst[t] = xs[t] · acc`,
/// with the products computed 8 lanes at a time (over groups, or over tokens when the row has
/// a single group).
/// `isum`, `asum` hold `T * ng` values (`ng = s.len()`), `xs` and `dst` `T`.
#[target_feature(enable = "avx2,fma")]
fn int4_epilogue(s: &[f32], z: Option<&[i8]>, isum: &[i32], asum: &[i32], xs: &[f32], dst: &mut [f32]) {
    let ng = s.len();
    let off = |g: usize| 8 + z.map_or(0, |z| z[g]) as i32;
    let part = |g: usize, i: usize| s[g] * isum[i].wrapping_sub(off(g).wrapping_mul(asum[i])) as f32;
    if ng == 1 {
        let mut tok = dst.chunks_exact_mut(8);
        let mut base = 0;
        let (sv, ov) = (_mm256_set1_ps(s[0]), _mm256_set1_epi32(off(0)));
        for d in &mut tok {
            // SAFETY: tokens base..base + 8 exist in isum, asum, xs and d.
            unsafe {
                let c = _mm256_sub_epi32(
                    _mm256_loadu_si256(isum.as_ptr().add(base).cast()),
                    _mm256_mullo_epi32(ov, _mm256_loadu_si256(asum.as_ptr().add(base).cast())),
                );
                let acc = _mm256_add_ps(_mm256_setzero_ps(), _mm256_mul_ps(sv, _mm256_cvtepi32_ps(c)));
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_mul_ps(_mm256_loadu_ps(xs.as_ptr().add(base)), acc));
            }
            base += 8;
        }
        for (t, d) in tok.into_remainder().iter_mut().enumerate() {
            *d = xs[base + t] * (0f32 + part(0, base + t));
        }
        return;
    }
    let mut offs = [0i32; 8];
    let mut prods = [0f32; 8];
    for (t, d) in dst.iter_mut().enumerate() {
        let mut acc = 0f32;
        let mut g = 0;
        while g + 8 <= ng {
            for (j, o) in offs.iter_mut().enumerate() {
                *o = off(g + j);
            }
            let i = t * ng + g;
            // SAFETY: groups g..g + 8 of token t exist in s, isum and asum.
            unsafe {
                let c = _mm256_sub_epi32(
                    _mm256_loadu_si256(isum.as_ptr().add(i).cast()),
                    _mm256_mullo_epi32(_mm256_loadu_si256(offs.as_ptr().cast()), _mm256_loadu_si256(asum.as_ptr().add(i).cast())),
                );
                _mm256_storeu_ps(prods.as_mut_ptr(), _mm256_mul_ps(_mm256_loadu_ps(s.as_ptr().add(g)), _mm256_cvtepi32_ps(c)));
            }
            for p in prods {
                acc += p;
            }
            g += 8;
        }
        for g in g..ng {
            acc += part(g, t * ng + g);
        }
        *d = xs[t] * acc;
    }
}

/// [`int4_epilogue`] for one token and the 8 rows `r..r + 8` at once, vectorized over the
/// rows: per group in order, `acc += s[g] · f32(isum - (8 + z[g]) Σ a)`, then `xs · acc`.
/// `isum[rr * ng + g]` is row `r + rr`'s integer sum over group `g`, `asum[g]` the token's
/// activation sum over it.
#[target_feature(enable = "avx2,fma")]
fn int4_epilogue_rows(w: &Int4Matrix, r: usize, isum: &[i32], asum: &[i32], xs: f32) -> [f32; 8] {
    let ng = w.groups();
    assert!(isum.len() == 8 * ng && asum.len() == ng && r + 8 <= w.rows());
    let mut acc = _mm256_setzero_ps();
    for (g, &a) in asum.iter().enumerate() {
        let c: [i32; 8] = std::array::from_fn(|rr| isum[rr * ng + g]);
        let off: [i32; 8] = std::array::from_fn(|rr| 8 + w.row_zeros(r + rr).map_or(0, |z| z[g]) as i32);
        let sc: [f32; 8] = std::array::from_fn(|rr| w.row_scales(r + rr)[g]);
        // SAFETY: each array holds 8 values of 4 bytes.
        unsafe {
            let c = _mm256_sub_epi32(_mm256_loadu_si256(c.as_ptr().cast()), _mm256_mullo_epi32(_mm256_loadu_si256(off.as_ptr().cast()), _mm256_set1_epi32(a)));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(sc.as_ptr()), _mm256_cvtepi32_ps(c)));
        }
    }
    let mut vals = [0f32; 8];
    // SAFETY: `vals` holds 8 floats.
    unsafe { _mm256_storeu_ps(vals.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(xs), acc)) };
    vals
}

/// [`int4_epilogue`] for 8 tokens at once, vectorized over the tokens: per group the 8
/// tokens' lane vectors (`lanes[t * ng + g]`) reduce to one vector of sums, then
/// `acc += s[g] · f32(sum - (8 + z[g]) Σ a)` lane-wise in group order, `dst = xs · acc`.
/// `asum_gt[g * 8 + t]` is token t's activation sum over group g.
#[target_feature(enable = "avx2,fma")]
fn int4_epilogue_tokens(s: &[f32], z: Option<&[i8]>, lanes: &[__m256i], asum_gt: &[i32], xs: &[f32], dst: &mut [f32]) {
    let ng = s.len();
    assert!(lanes.len() == TOKENS * ng && asum_gt.len() == TOKENS * ng && xs.len() == TOKENS && dst.len() == TOKENS);
    let mut acc = _mm256_setzero_ps();
    for (g, &sg) in s.iter().enumerate() {
        let v: [__m256i; TOKENS] = std::array::from_fn(|t| lanes[t * ng + g]);
        let a = &asum_gt[g * TOKENS..(g + 1) * TOKENS];
        let off = _mm256_set1_epi32(8 + z.map_or(0, |z| z[g]) as i32);
        // SAFETY: `a` holds 8 i32.
        let c = _mm256_sub_epi32(reduce8(&v), _mm256_mullo_epi32(off, unsafe { _mm256_loadu_si256(a.as_ptr().cast()) }));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(sg), _mm256_cvtepi32_ps(c)));
    }
    // SAFETY: `xs` and `dst` hold 8 floats (asserted).
    unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_mul_ps(_mm256_loadu_ps(xs.as_ptr()), acc)) };
}

// ---------------------------------------------------------------------------------------------
// W8A8 int8: int8 weights x int8 activations.

/// W8A8 rows `r0..r1` for `m` tokens into `out[(r - r0) * m + i]`. Bit-identical to
/// [`Int8Matrix::rows_int8_scalar`].
///
/// Sign trick per 32 columns: `maddubs(|w|, sign(a, w))` (pairs <= 2·127·127, no saturation),
/// `madd` to int32. Activations must avoid -128 (negating it wraps); the dispatcher sends rows
/// with -128 to the scalar kernel.
///
/// # Safety
/// AVX2+FMA available; `r0 <= r1 <= w.rows()`, `xq.len() == m * w.cols()` with no -128,
/// `xs.len() == m`, `out.len() >= (r1 - r0) * m`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn int8_int8<const VNNI: bool>(w: &Int8Matrix, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
    let mut t0 = 0;
    while t0 < m {
        let t = (m - t0).min(TOKENS);
        // SAFETY: forwarded contract; tokens t0..t0 + t exist.
        unsafe {
            match t {
                1 => int8_block::<VNNI, 1>(w, r0, r1, xq, xs, m, t0, out),
                2 => int8_block::<VNNI, 2>(w, r0, r1, xq, xs, m, t0, out),
                3 => int8_block::<VNNI, 3>(w, r0, r1, xq, xs, m, t0, out),
                4 => int8_block::<VNNI, 4>(w, r0, r1, xq, xs, m, t0, out),
                5 => int8_block::<VNNI, 5>(w, r0, r1, xq, xs, m, t0, out),
                6 => int8_block::<VNNI, 6>(w, r0, r1, xq, xs, m, t0, out),
                7 => int8_block::<VNNI, 7>(w, r0, r1, xq, xs, m, t0, out),
                _ => int8_block::<VNNI, 8>(w, r0, r1, xq, xs, m, t0, out),
            }
        }
        t0 += t;
    }
}

/// Tokens `t0..t0 + T` of W8A8 against rows `r0..r1`.
///
/// # Safety
/// As [`int8_int8`], with `t0 + T <= m`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)] // the row-kernel signature plus the token block
unsafe fn int8_block<const VNNI: bool, const T: usize>(
    w: &Int8Matrix,
    r0: usize,
    r1: usize,
    xq: &[i8],
    xs: &[f32],
    m: usize,
    t0: usize,
    out: &mut [f32],
) {
    let k = w.cols();
    let xp = xq[t0 * k..(t0 + T) * k].as_ptr();
    // Lanes past T stay zero; results are only stored for the T real tokens.
    let mut lanes = [_mm256_setzero_si256(); TOKENS];
    let mut xsv = [0f32; TOKENS];
    xsv[..T].copy_from_slice(&xs[t0..t0 + T]);
    let mut r = r0;
    if T == 1 {
        // One token: eight rows' sums reduce together and their epilogue runs at once.
        while r + 8 <= r1 {
            // SAFETY: rows r..r + 8 exist; the token's k columns lie inside xq.
            let rows: [__m256i; 8] = std::array::from_fn(|rr| unsafe { int8_lanes::<VNNI, 1>(w.row(r + rr), xp, k) }[0]);
            let scales: [f32; 8] = std::array::from_fn(|rr| w.scale(r + rr));
            let mut vals = [0f32; 8];
            // SAFETY: both arrays hold 8 floats.
            unsafe {
                let res = _mm256_mul_ps(_mm256_set1_ps(xs[t0]), _mm256_mul_ps(_mm256_loadu_ps(scales.as_ptr()), _mm256_cvtepi32_ps(reduce8(&rows))));
                _mm256_storeu_ps(vals.as_mut_ptr(), res);
            }
            for (rr, v) in vals.into_iter().enumerate() {
                out[(r + rr - r0) * m + t0] = v;
            }
            r += 8;
        }
    }
    for r in r..r1 {
        // SAFETY: row r exists; tokens 0..T of the block lie inside xq.
        lanes[..T].copy_from_slice(&unsafe { int8_lanes::<VNNI, T>(w.row(r), xp, k) });
        // Scalar order: xs · (s · f32(sum)).
        let sums = _mm256_cvtepi32_ps(reduce8(&lanes));
        let mut vals = [0f32; TOKENS];
        // SAFETY: both arrays hold 8 floats.
        unsafe {
            let res = _mm256_mul_ps(_mm256_loadu_ps(xsv.as_ptr()), _mm256_mul_ps(_mm256_set1_ps(w.scale(r)), sums));
            _mm256_storeu_ps(vals.as_mut_ptr(), res);
        }
        out[(r - r0) * m + t0..(r - r0) * m + t0 + T].copy_from_slice(&vals[..T]);
    }
}

/// [`int8_row_lanes`], or with `VNNI` [`int8_row_lanes_vnni`] (the same integers).
///
/// # Safety
/// As [`int8_row_lanes`], and with `VNNI` the CPU has AVX-512 F, BW and VNNI.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn int8_lanes<const VNNI: bool, const T: usize>(row: &[i8], xp: *const i8, k: usize) -> [__m256i; T] {
    // SAFETY: forwarded contract.
    unsafe {
        if VNNI {
            int8_row_lanes_vnni::<T>(row, xp, k)
        } else {
            int8_row_lanes::<T>(row, xp, k, 0..k / RUN)
        }
    }
}

/// [`int8_row_lanes`] with AVX-512 VNNI, 64 columns per step: the activations take the
/// weights' signs by a masked `0 - a` where `w < 0`, and `vpdpbusd(|w|, ±a)` adds four
/// products straight into int32. The 16 lanes fold to 8 at the end, and a last 32-column run
/// takes [`int8_row_lanes`]' instructions: the same integers.
///
/// # Safety
/// As [`int8_row_lanes`], and the CPU has AVX-512 F, BW and VNNI.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni")]
unsafe fn int8_row_lanes_vnni<const T: usize>(row: &[i8], xp: *const i8, k: usize) -> [__m256i; T] {
    let mut acc = [_mm512_setzero_si512(); T];
    let zero = _mm512_setzero_si512();
    let pairs = k / (2 * RUN);
    for p in 0..pairs {
        // SAFETY: columns p*64..p*64+64 lie inside the row (row.len() == k).
        let wv = unsafe { _mm512_loadu_si512(row.as_ptr().add(p * 2 * RUN).cast()) };
        let (wa, neg) = (_mm512_abs_epi8(wv), _mm512_movepi8_mask(wv));
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: token t < T, same columns, inside the caller's T * k bytes.
            let x = unsafe { _mm512_loadu_si512(xp.add(t * k + p * 2 * RUN).cast()) };
            *a = _mm512_dpbusd_epi32(*a, wa, _mm512_mask_sub_epi8(x, neg, zero, x));
        }
    }
    let mut lanes: [__m256i; T] = std::array::from_fn(|t| _mm256_add_epi32(_mm512_castsi512_si256(acc[t]), _mm512_extracti64x4_epi64::<1>(acc[t])));
    if !k.is_multiple_of(2 * RUN) {
        // SAFETY: the last run lies inside the row and each token's k bytes (forwarded contract).
        let tail = unsafe { int8_row_lanes::<T>(row, xp, k, 2 * pairs..k / RUN) };
        for (l, t) in lanes.iter_mut().zip(tail) {
            *l = _mm256_add_epi32(*l, t);
        }
    }
    lanes
}

/// One int8 row against `T` int8 activation rows at `xp` (stride `k`), over the 32-column
/// runs `runs`: 8 int32 lanes of `Σ w · a` per token, by the sign trick (`maddubs(|w|,
/// sign(a, w))`, then `madd` to int32).
///
/// # Safety
/// AVX2 available; `row.len() == k`, a multiple of 32; `runs.end <= k / 32`; `xp` points to
/// `T * k` readable bytes with no -128.
#[target_feature(enable = "avx2,fma")]
unsafe fn int8_row_lanes<const T: usize>(row: &[i8], xp: *const i8, k: usize, runs: std::ops::Range<usize>) -> [__m256i; T] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_si256(); T];
    for run in runs {
        // SAFETY: columns run*32..run*32+32 lie inside the row (row.len() == k).
        let wv = unsafe { _mm256_loadu_si256(row.as_ptr().add(run * RUN).cast()) };
        let wa = _mm256_abs_epi8(wv);
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: token t < T, same columns, inside the caller's T * k bytes.
            let x = unsafe { _mm256_loadu_si256(xp.add(t * k + run * RUN).cast()) };
            let p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x, wv));
            *a = _mm256_add_epi32(*a, _mm256_madd_epi16(p, ones));
        }
    }
    acc
}
