//! The k-quant records of [`super::kquant`] against per-256 activation super-blocks
//! ([`Q8KBlock`]: one f32 unit per 256 values as in llama.cpp's Q8_K, each 32-value block at a
//! power-of-two multiple of it): the k-quant kernels of the AVX2 level.
//!
//! Against the per-32 activation blocks of [`super::interleaved`], every 32 values of eight
//! rows end in a float epilogue (convert, scale product, two FMAs): on an AVX2-only Zen 3, a
//! quarter of the Q4_K kernel's time, on the ports `vpmaddubsw` needs. With one activation
//! unit per super-block, the rows' 6-bit scales apply in the `vpmaddwd` that widens each
//! 32 values' sums (against ones in the per-32 kernel), a block's power of two in one
//! `vpsllvd`, a super-block accumulates in integers, and the offset and min terms come once
//! per super-block from the activations' 16- and 32-value sums.
//!
//! Why the block shifts: one scale per 256 values (llama.cpp's Q8_K) raised the perplexity of
//! SmolLM2-135M requantized to Q4_K_M by 0.48% and to Q6_K by 0.50% over per-32 activations
//! (its K-quant matrices, `ffn_down`, read the heavy-tailed SiLU products); with the shifts,
//! by 0.04% and 0.25% (docs/benchmarks/kquants.md).
//!
//! Numerics per (row, token) and super-block against activation super-block `a`, with the
//! integer sums exact and `Σ q · a.qs` over a sub-block's values shifted left by its 32-value
//! block's `a.shift` (in units of `a.d`, like `a.sums` and `a.sums32`):
//! - Q4_K and Q5_K, per 32-value sub-block `s`: `I = Σ_s sc_s · (Σ q · a.qs) << a.shift[s]`
//!   and `M = Σ_s m_s · a.sums32[s]`;
//! - Q6_K, Q3_K and Q2_K, per 16-value sub-block `k`: `I = Σ_k sc_k · ((Σ q · a.qs) <<
//!   a.shift[k / 2] - offset · a.sums[k])` (offset 32, 4, 0) and, for Q2_K,
//!   `M = Σ_k m_k · a.sums[k]`;
//!
//! then `acc = fma(I, d · a.d, acc)` and, for the types with mins, `acc = fma(M, -(dmin ·
//! a.d), acc)`. `I` and `M` fit in i32: the largest, Q6_K's `I`, is at most 16 sub-blocks ·
//! 128 (scale) · 16 · 32 · 127 (codes less 32 against activations) · 8 (shift) < 1.07 · 2^30.
//! The AVX2 kernel adds the offset term last, so its running sums may wrap in between; i32
//! addition is exact modulo 2^32, so the result is the same. The scalar level
//! ([`super::kquant::dot_k4_q8k`], [`super::kquant::dot_halves_q8k`]) and these kernels
//! perform exactly these operations, so they agree bit for bit. AVX-512 hosts keep the per-32
//! kernels (there a per-256 epilogue measured no faster, and a 512-bit VNNI kernel against
//! these activations, the sub-block scales by `vpmulld`, 15-20% slower on a Zen 5;
//! docs/benchmarks/kquants.md) unless asked for these ([`super::LinearKernel::with_blocks`]).

use super::interleaved::{for_each_tile, Interleaved, GROUP};
use super::out_rows::OutRows;
use super::kquant::{self, Halves};
use crate::cpu::caps::GemmLevel;
use crate::ggml::act_quant::{Q8KBlock, Q8K_BLOCK};
use crate::ggml::GgmlType;

/// Tokens per call of the Q4_K and Q5_K record kernels: with eight code registers, four token
/// sums and the scales, AVX2's 16 registers are full (measured on Q4_K: three tokens 7% slower,
/// six 3% slower).
const K4_TILE: usize = 4;

/// Tokens per call of the Q6_K, Q3_K and Q2_K record kernels, which hold half a sub-block's
/// codes (four registers): six share each unpacking (measured 5% faster than four on Q6_K).
const HALVES_TILE: usize = 6;

/// Tokens per call of the record kernel for `ty`.
fn tile_tokens(ty: GgmlType) -> usize {
    if halves_kind(ty).is_some() { HALVES_TILE } else { K4_TILE }
}

/// The [`Halves`] kind of a 16-value-sub-block k-quant, `None` for Q4_K and Q5_K.
fn halves_kind(ty: GgmlType) -> Option<Halves> {
    match ty {
        GgmlType::Q6K => Some(Halves::Q6K),
        GgmlType::Q3K => Some(Halves::Q3K),
        GgmlType::Q2K => Some(Halves::Q2K),
        _ => None,
    }
}

/// Whether `ty` has kernels against [`Q8KBlock`] activations (the k-quants).
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
}

impl Interleaved {
    /// [`Interleaved::gemm`] for a k-quant matrix against per-256 activations (`cols / 256`
    /// super-blocks per token, token-major), with this module's numerics. The AVX-512 level
    /// runs the AVX2 kernels (the same bits).
    ///
    /// # Panics
    /// If the type is not a k-quant, `level` is unavailable or a length disagrees.
    pub fn gemm_q8k(&self, level: GemmLevel, g0: usize, g1: usize, acts: &[Q8KBlock], tokens: usize, out: &mut [f32]) {
        self.gemm_q8k_into(level, g0, g1, acts, tokens, OutRows::dense(out, tokens, g1.saturating_sub(g0) * GROUP));
    }

    /// [`Self::gemm_q8k`] into `out`'s rows (one per token, `(g1 - g0) * 8` floats each), which
    /// may lie inside a wider output.
    ///
    /// # Panics
    /// As [`Self::gemm_q8k`].
    pub fn gemm_q8k_into(&self, level: GemmLevel, g0: usize, g1: usize, acts: &[Q8KBlock], tokens: usize, mut out: OutRows<'_>) {
        assert!(supports(self.ty()), "{} has no kernel against Q8_K activations", self.ty());
        let nsb = self.cols() / Q8K_BLOCK;
        assert!(g0 <= g1 && g1 <= self.rows().div_ceil(GROUP), "groups {g0}..{g1}");
        assert_eq!(acts.len(), tokens * nsb, "activation super-blocks");
        assert!(out.rows() == tokens && out.cols() == (g1 - g0) * GROUP, "output tile");
        assert!(level.available(), "{} integer GEMM requested on a CPU without it", level.name());
        match level {
            GemmLevel::Scalar => {
                let rb = match halves_kind(self.ty()) {
                    Some(kind) => kind.record(),
                    None if self.ty() == GgmlType::Q5K => kquant::Q5K_RECORD,
                    None => kquant::Q4K_RECORD,
                };
                for g in g0..g1 {
                    for t in 0..tokens {
                        for j in 0..GROUP {
                            let a = &acts[t * nsb..(t + 1) * nsb];
                            out.row(t)[(g - g0) * GROUP + j] = self.groups(g, 1).chunks_exact(rb).zip(a).fold(0f32, |acc, (rec, a)| match halves_kind(self.ty()) {
                                Some(kind) => kquant::dot_halves_q8k(kind, rec, j, a, acc),
                                None => kquant::dot_k4_q8k(rec, j, a, acc, self.ty() == GgmlType::Q5K),
                            });
                        }
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            _ => for_each_tile(self, g0, g1, tokens, 1, tile_tokens(self.ty()), |t| {
                let a = &acts[t.t0 * nsb..(t.t0 + t.n) * nsb];
                let dst = out.part(t.t0, t.col, GROUP);
                // SAFETY: AVX2, FMA and F16C are present (every SIMD level has them, checked
                // above); `t.recs` is one group's records, `a` n token rows of its super-blocks.
                unsafe { avx2::tile(self.ty(), t.n, t.recs, a, dst, t.ahead) }
            }),
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("checked available"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::interleaved::avx2::{bcast4, f16x8, fifth_bit, half_codes, halves_codes, load32, prefetch_part, store, PREFETCH, SUBS};
    use super::super::kquant::{self, Halves};
    use super::{halves_kind, OutRows, GROUP, HALVES_TILE, K4_TILE};
    use crate::ggml::act_quant::Q8KBlock;
    use crate::ggml::GgmlType;
    use std::arch::x86_64::*;

    /// Runs the record kernel for type `ty` and `n` tokens (1..=[`super::tile_tokens`]).
    ///
    /// # Safety
    /// AVX2, FMA and F16C present; `recs` holds one group's records of `ty` and `a` holds
    /// `n` token rows of as many super-blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile(ty: GgmlType, n: usize, recs: &[u8], a: &[Q8KBlock], dst: OutRows<'_>, ahead: bool) {
        const { assert!(K4_TILE == 4 && HALVES_TILE == 6, "the matches below cover 1..=4 and 1..=6 tokens") };
        macro_rules! by_tokens {
            ($f:ident, $c:expr, $($n:literal)*) => {
                // SAFETY: forwarded contract.
                unsafe {
                    match n {
                        $($n => $f::<$n, $c>(recs, a, dst, ahead),)*
                        _ => $f::<1, $c>(recs, a, dst, ahead),
                    }
                }
            };
        }
        match (ty, halves_kind(ty)) {
            (GgmlType::Q5K, _) => by_tokens!(k4, true, 4 3 2),
            (_, None) => by_tokens!(k4, false, 4 3 2),
            (_, Some(Halves::Q6K)) => by_tokens!(halves, { kquant::Q6K_KIND }, 6 5 4 3 2),
            (_, Some(Halves::Q3K)) => by_tokens!(halves, { kquant::Q3K_KIND }, 6 5 4 3 2),
            (_, Some(Halves::Q2K)) => by_tokens!(halves, { kquant::Q2K_KIND }, 6 5 4 3 2),
        }
    }

    /// Two adjacent i16 sums `s[i], s[i + 1]`, as the pair `vpmaddwd` multiplies, in every lane.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn bcast_pair(s: &[i16], i: usize) -> __m256i {
        let p: &[i16; 2] = s[i..i + 2].try_into().expect("2 sums");
        // SAFETY: `p` is 4 readable bytes.
        _mm256_set1_epi32(unsafe { (p.as_ptr() as *const i32).read_unaligned() })
    }

    /// `v`'s bytes as i16 pairs `(x_j, y_j)` per row lane `j`, zero- or sign-extended, where
    /// each 128-bit lane of `v` holds the eight rows' `x` in bytes 0..8 and their `y` in bytes
    /// 8..16. One `vpshufb` (and for signed bytes a shift: each byte lands in both halves of
    /// its i16, whose arithmetic shift by 8 sign-extends it).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn pairs<const SIGNED: bool>(v: __m256i) -> __m256i {
        let lane = |r: i8| -> [i8; 4] { if SIGNED { [r, r, 8 + r, 8 + r] } else { [r, -1, 8 + r, -1] } };
        let (a, b, c, d, e, f, g, h) = (lane(0), lane(1), lane(2), lane(3), lane(4), lane(5), lane(6), lane(7));
        let idx = _mm256_setr_epi8(
            a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2], d[3],
            e[0], e[1], e[2], e[3], f[0], f[1], f[2], f[3], g[0], g[1], g[2], g[3], h[0], h[1], h[2], h[3],
        );
        let p = _mm256_shuffle_epi8(v, idx);
        if SIGNED { _mm256_srai_epi16::<8>(p) } else { p }
    }

    /// Eight rows' bytes at `at` as i16 pairs `(x_j, x_j)`: the multiplier `vpmaddwd` wants to
    /// scale a row's 32-bit lane of i16 sums.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn dup_pairs<const SIGNED: bool>(rec: &[u8], at: usize) -> __m256i {
        let b: [u8; 8] = rec[at..at + 8].try_into().expect("8 bytes");
        pairs::<SIGNED>(_mm256_set1_epi64x(i64::from_le_bytes(b)))
    }

    /// Two runs of eight rows' bytes at `at` and `at + 8` as i16 pairs `(x_j, y_j)`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn adjacent<const SIGNED: bool>(rec: &[u8], at: usize) -> __m256i {
        let c: &[u8; 16] = rec[at..at + 16].try_into().expect("16 bytes");
        // SAFETY: `c` is 16 readable bytes.
        pairs::<SIGNED>(_mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(c.as_ptr() as *const __m128i) }))
    }

    /// The final FMAs of a super-block (see the module's numerics): `acc = fma(I, d · a.d,
    /// acc)`, then with `MIN` `acc = fma(M, -(dmin · a.d), acc)`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn finish<const MIN: bool>(acc: __m256, isum: __m256i, msum: __m256i, d: __m256, dmin: __m256, a: &Q8KBlock) -> __m256 {
        let ad = _mm256_set1_ps(a.d);
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, ad), acc);
        if MIN {
            _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, ad), acc)
        } else {
            acc
        }
    }

    /// Q4_K records (Q5_K when `HIGH`) against T tokens.
    ///
    /// # Safety
    /// As [`tile`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k4<const T: usize, const HIGH: bool>(recs: &[u8], a: &[Q8KBlock], dst: OutRows<'_>, ahead: bool) {
        let rb = if HIGH { kquant::Q5K_RECORD } else { kquant::Q4K_RECORD };
        let nsb = recs.len() / rb;
        let rows = super::super::interleaved::token_rows::<T, _>(a, nsb);
        let mask = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); T];
        for sb in 0..nsb {
            let rec = &recs[sb * rb..(sb + 1) * rb];
            let mut isum = [_mm256_setzero_si256(); T];
            let mut raw = [_mm256_setzero_si256(); 8];
            // Sub-blocks in pairs, so that whether a sub-block reads the low or the high
            // nibbles is known at compile time (a loop over all eight tested it each time:
            // 2-4% slower at 128 tokens).
            macro_rules! sub {
                ($s:expr, $odd:expr) => {{
                    let s = $s;
                    if ahead {
                        prefetch_part(rec, s, SUBS, PREFETCH);
                    }
                    let sc = dup_pairs::<false>(rec, 32 + GROUP * s);
                    let hb = if HIGH { load32(rec, kquant::Q5K_HIGH + 32 * s) } else { _mm256_setzero_si256() };
                    // A pair of sub-blocks shares its code bytes (low and high nibbles). One token
                    // keeps them in registers for the second; more tokens need the registers, and
                    // reload them from L1.
                    if !$odd || T > 1 {
                        for (i, r) in raw.iter_mut().enumerate() {
                            *r = load32(rec, kquant::Q4K_CODES + (s / 2) * 256 + 32 * i);
                        }
                    }
                    let q: [__m256i; 8] = std::array::from_fn(|i| {
                        let n = _mm256_and_si256(if !$odd { raw[i] } else { _mm256_srli_epi16::<4>(raw[i]) }, mask);
                        if HIGH { _mm256_or_si256(n, fifth_bit(hb, i)) } else { n }
                    });
                    for (t, isum) in isum.iter_mut().enumerate() {
                        let ab = &rows[t][sb];
                        // Products of at most 15 * 127 (31 * 127 with the fifth bit) per i16 lane:
                        // 16 of them fit (8 with the fifth bit, so then two halves are widened).
                        let half = |r: std::ops::Range<usize>| r.fold(_mm256_setzero_si256(), |p, i| _mm256_add_epi16(p, _mm256_maddubs_epi16(q[i], bcast4(&ab.qs, 8 * s + i))));
                        let p = if HIGH {
                            _mm256_add_epi32(_mm256_madd_epi16(half(0..4), sc), _mm256_madd_epi16(half(4..8), sc))
                        } else {
                            _mm256_madd_epi16(half(0..8), sc)
                        };
                        *isum = _mm256_add_epi32(*isum, _mm256_sllv_epi32(p, _mm256_set1_epi32(ab.shift[s])));
                    }
                }};
            }
            for pair in 0..SUBS / 2 {
                sub!(2 * pair, false);
                sub!(2 * pair + 1, true);
            }
            // SAFETY: a record starts with 16 bytes of scales and 16 of mins.
            let (d, dmin) = unsafe { (f16x8(rec.as_ptr()), f16x8(rec.as_ptr().add(16))) };
            let mins = [0, 1, 2, 3].map(|p| adjacent::<false>(rec, 96 + GROUP * 2 * p));
            for (t, acc) in acc.iter_mut().enumerate() {
                let ab = &rows[t][sb];
                let msum = (0..4).fold(_mm256_setzero_si256(), |m, p| _mm256_add_epi32(m, _mm256_madd_epi16(mins[p], bcast_pair(&ab.sums32, 2 * p))));
                *acc = finish::<true>(*acc, isum[t], msum, d, dmin, ab);
            }
        }
        store::<T>(&acc, dst);
    }

    /// Q6_K, Q3_K or Q2_K records (`KIND` names the [`Halves`] kind) against T tokens.
    ///
    /// # Safety
    /// As [`tile`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn halves<const T: usize, const KIND: u8>(recs: &[u8], a: &[Q8KBlock], dst: OutRows<'_>, ahead: bool) {
        let kind = Halves::of(KIND);
        let rb = kind.record();
        let nsb = recs.len() / rb;
        let rows = super::super::interleaved::token_rows::<T, _>(a, nsb);
        let mut acc = [_mm256_setzero_ps(); T];
        for sb in 0..nsb {
            let rec = &recs[sb * rb..(sb + 1) * rb];
            let mut isum = [_mm256_setzero_si256(); T];
            for s in 0..SUBS {
                if ahead {
                    prefetch_part(rec, s, SUBS, PREFETCH);
                }
                // With several tokens, half by half: one half's codes, its scales and up to
                // six tokens' sub-block sums fit AVX2's sixteen registers (both halves' codes
                // spilled; the super-block sums may spill, read once per sub-block). One token
                // unpacks both halves at once (measured faster at one token).
                let both = (T == 1).then(|| halves_codes(kind, rec, s));
                let mut block = [_mm256_setzero_si256(); T];
                for h in 0..2 {
                    let qh = match &both {
                        Some(q) => q[h],
                        None => half_codes(kind, rec, s, h),
                    };
                    let sc = scale_pairs(kind, rec, 2 * s + h);
                    for (t, block) in block.iter_mut().enumerate() {
                        let ab = &rows[t][sb];
                        // Two chunks per i16 sum: 4 products of at most 63 * 127.
                        let i = 8 * s + 4 * h;
                        let p01 = _mm256_add_epi16(_mm256_maddubs_epi16(qh[0], bcast4(&ab.qs, i)), _mm256_maddubs_epi16(qh[1], bcast4(&ab.qs, i + 1)));
                        let p23 = _mm256_add_epi16(_mm256_maddubs_epi16(qh[2], bcast4(&ab.qs, i + 2)), _mm256_maddubs_epi16(qh[3], bcast4(&ab.qs, i + 3)));
                        *block = _mm256_add_epi32(*block, _mm256_add_epi32(_mm256_madd_epi16(p01, sc), _mm256_madd_epi16(p23, sc)));
                    }
                }
                for (t, isum) in isum.iter_mut().enumerate() {
                    *isum = _mm256_add_epi32(*isum, _mm256_sllv_epi32(block[t], _mm256_set1_epi32(rows[t][sb].shift[s])));
                }
            }
            // The offset (Σ_k sc_k · a.sums[k]) and min (Σ_k m_k · a.sums[k]) terms: per row,
            // sub-blocks 2s and 2s + 1 as one i16 pair against the pair of sums.
            let mut pairs = [(_mm256_setzero_si256(), _mm256_setzero_si256()); SUBS];
            for (s, p) in pairs.iter_mut().enumerate() {
                *p = adjacent_pairs(kind, rec, s);
            }
            // SAFETY: a record starts with 16 bytes of scales (and, with mins, 16 of dmin).
            let d = unsafe { f16x8(rec.as_ptr()) };
            let dmin = if kind.has_min() { unsafe { f16x8(rec.as_ptr().add(16)) } } else { _mm256_setzero_ps() };
            for (t, acc) in acc.iter_mut().enumerate() {
                let ab = &rows[t][sb];
                let (mut offs, mut mins) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for (s, &(sc, m)) in pairs.iter().enumerate() {
                    let sums = bcast_pair(&ab.sums, 2 * s);
                    offs = _mm256_add_epi32(offs, _mm256_madd_epi16(sc, sums));
                    if kind.has_min() {
                        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(m, sums));
                    }
                }
                let mut i = isum[t];
                match kind.offset() {
                    32 => i = _mm256_sub_epi32(i, _mm256_slli_epi32::<5>(offs)),
                    4 => i = _mm256_sub_epi32(i, _mm256_slli_epi32::<2>(offs)),
                    _ => {}
                }
                *acc = if kind.has_min() {
                    finish::<true>(*acc, i, mins, d, dmin, ab)
                } else {
                    finish::<false>(*acc, i, i, d, dmin, ab)
                };
            }
        }
        store::<T>(&acc, dst);
    }

    /// Eight rows' scales of 16-value sub-block `k`, each as an i16 in both halves of its
    /// row's 32-bit lane (the multiplier `vpmaddwd` wants).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn scale_pairs(kind: Halves, rec: &[u8], k: usize) -> __m256i {
        let at = kind.scales_at() + GROUP * k;
        if kind.has_min() {
            _mm256_and_si256(dup_pairs::<false>(rec, at), _mm256_set1_epi16(0x0F))
        } else {
            dup_pairs::<true>(rec, at)
        }
    }

    /// Eight rows' scales, and mins (zeros without), of sub-blocks `2s` and `2s + 1` as i16
    /// pairs `(x_2s, x_2s+1)` per row lane.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn adjacent_pairs(kind: Halves, rec: &[u8], s: usize) -> (__m256i, __m256i) {
        let at = kind.scales_at() + GROUP * 2 * s;
        if kind.has_min() {
            // Q2_K: scale in the low nibble, min in the high one.
            let v = adjacent::<false>(rec, at);
            (_mm256_and_si256(v, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16::<4>(v))
        } else {
            (adjacent::<true>(rec, at), _mm256_setzero_si256())
        }
    }
}
