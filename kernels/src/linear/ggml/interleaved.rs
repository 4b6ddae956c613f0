//! GGML Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K..Q6_K weights regrouped eight rows at
//! a time, and the integer GEMM that multiplies them with per-token Q8 activation blocks.
//!
//! Layout: rows are taken in groups of [`GROUP`] (the last group zero-padded). For each group
//! and each 32-value block there is one record: the eight rows' f16 scales, for Q4_1 then their
//! f16 mins, then their code bytes interleaved four at a time (chunk `i`, bytes `4j..4j + 4` are
//! row `j`'s code bytes `4i..4i + 4`), for Q5_0 / Q5_1 then a chunk of their fifth bits. A 256-bit load of a chunk puts one row in each 32-bit
//! lane, so `vpmaddubsw` against four broadcast activation bytes makes partial sums for eight
//! rows at once, and the per-block scale epilogue runs once per eight rows instead of once per
//! row. With AVX-512 VNNI, chunk `i` of two adjacent groups fills one 512-bit register and
//! one `vpdpbusd` against the broadcast dword serves sixteen rows. A group's records are
//! contiguous: while the tokens pass over a group, its weights (18 records, 2.9 KiB of Q4_1
//! at 576 columns) stay in L1. The repacked matrix has the same size as the GGML rows.
//!
//! The record kernels prefetch the bytes each of their record streams reads 4 KiB later
//! (`avx2::ahead_distance`), on the first token tile of a token block (the one that streams
//! the weights from memory): a decode step reads every weight once, and on one Intel Xeon host
//! the prefetch made the 1B models' decode 1.13-1.22x faster than the hardware prefetcher alone
//! (docs/benchmarks/kquants.md).
//!
//! Numerics, per (row, token), block by block in order: `acc = fma(isum as f32, d_w * d_a, acc)`,
//! then for Q4_1 / Q5_1 `acc = fma(m_w, s_a, acc)`, with `isum` the exact integer dot product
//! (of the codes less 8 for Q4_0, 16 for Q5_0). The
//! scalar, AVX2 and AVX-512 VNNI kernels perform exactly these operations, so they agree bit
//! for bit, and a token's result never depends on which other tokens share the call.
//!
//! The k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) have one record per 256-value super-block, laid out and computed
//! as [`super::kquant`] describes. On the scalar and AVX-512 levels their activations are the
//! same per-token blocks of 32 ([`Interleaved::gemm`]); on the AVX2 level they take
//! super-blocks of 256 with power-of-two block scales ([`Interleaved::gemm_q8k`], see
//! [`super::q8k`]), whose float epilogue runs once per 256 values instead of once per 32.

use crate::cpu::caps::GemmLevel;
use super::kquant::{self, Halves};
use crate::ggml::act_quant::{Q8Block, Q8_BLOCK};
use crate::ggml::{GgmlType, QK_K};
use super::out_rows::OutRows;
use super::WeightView;
use half::f16;

/// Weight rows per interleaved group (one per 32-bit lane of a 256-bit register).
pub const GROUP: usize = 8;

/// Most tokens one pass over a group's blocks serves with 16 vector registers (AVX2); more
/// tokens take further passes while the group is still in L1.
const TILE: usize = 4;

/// [`TILE`] with AVX-512's 32 registers: the weight side of a block (loads, nibble masks,
/// f16 scales) is paid once per eight tokens.
const TILE_512: usize = 8;

/// Tokens whose activations (48 bytes per 32 values) are reused across all groups of a call
/// before the next tokens are read: 32 tokens of 576 values are 27 KiB.
const TOKEN_BLOCK: usize = 32;


/// A Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K matrix in the interleaved
/// layout.
#[derive(Clone)]
pub struct Interleaved {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

/// Byte geometry of one record.
#[derive(Clone, Copy)]
struct Record {
    /// Values per row per record (32, or 256 for the k-quants).
    values: usize,
    /// Bytes of one GGML block of this type.
    block: usize,
    /// Bytes of one record (eight rows' blocks).
    bytes: usize,
    /// Offset of the code bytes inside a GGML block (32-value types).
    block_codes: usize,
    /// Code bytes per row per block (16 for 4-bit, 32 for 8-bit; 32-value types).
    codes: usize,
    /// Offset of the interleaved codes inside a record (after scales and mins).
    codes_at: usize,
    /// Whether a 32-byte chunk of fifth bits follows the codes (Q5_0, Q5_1).
    high: bool,
}

impl Record {
    /// A 32-value record: scales (and mins) before `codes` interleaved code bytes per row, then
    /// when `high` the fifth bits: row `j`'s 32-bit lane, byte `b`, bit `i` (0..4) is the top
    /// bit of value `4i + b` and bit `4 + i` that of value `16 + 4i + b`.
    const fn small(block: usize, block_codes: usize, codes: usize, codes_at: usize, high: bool) -> Self {
        let bytes = codes_at + GROUP * codes + if high { 32 } else { 0 };
        Record { values: Q8_BLOCK, block, bytes, block_codes, codes, codes_at, high }
    }

    /// Offset of the fifth bits in a record (Q5_0, Q5_1).
    fn high_at(self) -> usize {
        self.codes_at + GROUP * self.codes
    }

    /// Row `j`'s 32 codes of a 4- or 5-bit record `blk`, in value order (unsigned, before any
    /// offset).
    fn small_codes(self, blk: &[u8], j: usize) -> [u8; 32] {
        std::array::from_fn(|v| {
            let byte = blk[self.code(j, v % 16)];
            let nibble = if v < 16 { byte & 0x0F } else { byte >> 4 };
            if self.high {
                nibble | (((blk[self.high_at() + 4 * j + v % 4] >> ((v / 16) * 4 + (v % 16) / 4)) & 1) << 4)
            } else {
                nibble
            }
        })
    }

    /// A 256-value k-quant record (layouts in [`super::kquant`]).
    const fn k(block: usize, bytes: usize) -> Self {
        Record { values: QK_K, block, bytes, block_codes: 0, codes: 0, codes_at: 0, high: false }
    }

    fn of(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 => Some(Record::small(18, 2, 16, 16, false)),
            GgmlType::Q4_1 => Some(Record::small(20, 4, 16, 32, false)),
            GgmlType::Q5_0 => Some(Record::small(22, 6, 16, 16, true)),
            GgmlType::Q5_1 => Some(Record::small(24, 8, 16, 32, true)),
            GgmlType::Q8_0 => Some(Record::small(34, 2, 32, 16, false)),
            GgmlType::Q4K => Some(Record::k(144, kquant::Q4K_RECORD)),
            GgmlType::Q5K => Some(Record::k(176, kquant::Q5K_RECORD)),
            GgmlType::Q6K => Some(Record::k(210, kquant::Q6K_RECORD)),
            GgmlType::Q3K => Some(Record::k(110, kquant::Q3K_RECORD)),
            GgmlType::Q2K => Some(Record::k(84, kquant::Q2K_RECORD)),
            _ => None,
        }
    }

    /// Offset in a record of row `j`'s code byte `c` (32-value types).
    fn code(self, j: usize, c: usize) -> usize {
        self.codes_at + (c / 4) * 4 * GROUP + 4 * j + c % 4
    }
}

/// Whether a 32-value type stores a min per block (Q4_1, Q5_1).
fn has_min(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1)
}

/// The code offset of a symmetric 4- or 5-bit type (8 for Q4_0, 16 for Q5_0; 0 otherwise).
fn offset(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        _ => 0,
    }
}

impl std::fmt::Debug for Interleaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Interleaved({} {}x{}, {} bytes)", self.ty, self.rows, self.cols, self.data.len())
    }
}

impl Interleaved {
    /// Whether `ty` has an interleaved form and integer kernel.
    pub fn supports(ty: GgmlType) -> bool {
        Record::of(ty).is_some()
    }

    /// Regroups GGML rows; fails for other types.
    pub fn pack(w: &WeightView<'_>) -> Result<Self, String> {
        let rec = Record::of(w.ty)
            .ok_or_else(|| format!("{} has no interleaved integer layout", w.ty))?;
        let nb = w.cols / rec.values;
        let groups = w.rows.div_ceil(GROUP);
        let mut data = vec![0u8; groups * nb * rec.bytes];
        for (g, group) in data.chunks_exact_mut(nb * rec.bytes).enumerate() {
            for (j, r) in (g * GROUP..(g * GROUP + GROUP).min(w.rows)).enumerate() {
                let row = w.row(r);
                for (b, dst) in group.chunks_exact_mut(rec.bytes).enumerate() {
                    let src = &row[b * rec.block..(b + 1) * rec.block];
                    match w.ty {
                        GgmlType::Q4K | GgmlType::Q5K => kquant::put_k4(dst, j, src, w.ty == GgmlType::Q5K),
                        GgmlType::Q6K => kquant::put_q6k(dst, j, src),
                        GgmlType::Q3K => kquant::put_q3k(dst, j, src),
                        GgmlType::Q2K => kquant::put_q2k(dst, j, src),
                        _ => {
                            dst[2 * j..2 * j + 2].copy_from_slice(&src[..2]);
                            if has_min(w.ty) {
                                dst[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&src[2..4]);
                            }
                            for c in 0..rec.codes {
                                dst[rec.code(j, c)] = src[rec.block_codes + c];
                            }
                            if rec.high {
                                let qh = u32::from_le_bytes(src[rec.block_codes - 4..rec.block_codes].try_into().expect("4 bytes"));
                                for b in 0..4 {
                                    let bit = |v: usize, to: usize| (((qh >> v) & 1) << to) as u8;
                                    dst[rec.high_at() + 4 * j + b] = (0..4).map(|i| bit(4 * i + b, i) | bit(16 + 4 * i + b, 4 + i)).fold(0, |x, y| x | y);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Interleaved {
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            data,
        })
    }

    /// Storage type of the rows.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Output features (N).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (K).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn record(&self) -> Record {
        Record::of(self.ty).expect("constructed for a supported type")
    }

    /// The records of group `g`.
    fn group(&self, g: usize) -> &[u8] {
        self.groups(g, 1)
    }

    /// The records of groups `g..g + k`, one group after the other.
    pub(super) fn groups(&self, g: usize, k: usize) -> &[u8] {
        let rec = self.record();
        let len = self.cols / rec.values * rec.bytes;
        &self.data[g * len..(g + k) * len]
    }

    /// Row `r` as f32, exactly as GGML's dequantization of the original row.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(
            r < self.rows && out.len() == self.cols,
            "row {r} of {}x{}",
            self.rows,
            self.cols
        );
        let rec = self.record();
        let j = r % GROUP;
        for (blk, out) in self
            .group(r / GROUP)
            .chunks_exact(rec.bytes)
            .zip(out.chunks_exact_mut(rec.values))
        {
            let d = || f16::from_le_bytes([blk[2 * j], blk[2 * j + 1]]).to_f32();
            match self.ty {
                GgmlType::Q4K | GgmlType::Q5K => kquant::dequant_k4(blk, j, out, self.ty == GgmlType::Q5K),
                GgmlType::Q6K => kquant::dequant_halves(Halves::Q6K, blk, j, out),
                GgmlType::Q3K => kquant::dequant_halves(Halves::Q3K, blk, j, out),
                GgmlType::Q2K => kquant::dequant_halves(Halves::Q2K, blk, j, out),
                GgmlType::Q8_0 => {
                    let d = d();
                    out.iter_mut().enumerate().for_each(|(c, o)| *o = blk[rec.code(j, c)] as i8 as f32 * d);
                }
                _ => {
                    let (d, codes) = (d(), rec.small_codes(blk, j));
                    if has_min(self.ty) {
                        let m = f16::from_le_bytes([blk[16 + 2 * j], blk[17 + 2 * j]]).to_f32();
                        out.iter_mut().zip(codes).for_each(|(o, q)| *o = q as f32 * d + m);
                    } else {
                        let off = offset(self.ty);
                        out.iter_mut().zip(codes).for_each(|(o, q)| *o = (q as i32 - off) as f32 * d);
                    }
                }
            }
        }
    }

    /// Rows of groups `g0..g1` against `tokens` activation rows of `cols / 32` blocks each
    /// (`acts`, token-major): `out[t * w + i]` is row `g0 * 8 + i` for token `t`, with
    /// `w = (g1 - g0) * 8` (padding rows of the last group give zeros). Every level gives the
    /// same bits.
    ///
    /// # Panics
    /// If `level` is unavailable or a length disagrees.
    pub fn gemm(&self, level: GemmLevel, g0: usize, g1: usize, acts: &[Q8Block], tokens: usize, out: &mut [f32]) {
        self.gemm_into(level, g0, g1, acts, tokens, OutRows::dense(out, tokens, g1.saturating_sub(g0) * GROUP));
    }

    /// [`Self::gemm`] into `out`'s rows (one per token, `(g1 - g0) * 8` floats each), which
    /// may lie inside a wider output.
    ///
    /// # Panics
    /// If `level` is unavailable or a length disagrees.
    pub fn gemm_into(&self, level: GemmLevel, g0: usize, g1: usize, acts: &[Q8Block], tokens: usize, out: OutRows<'_>) {
        let nb = self.cols / Q8_BLOCK;
        assert!(g0 <= g1 && g1 <= self.rows.div_ceil(GROUP), "groups {g0}..{g1}");
        assert_eq!(acts.len(), tokens * nb, "activation blocks");
        assert!(out.rows() == tokens && out.cols() == (g1 - g0) * GROUP, "output tile");
        assert!(level.available(), "{} integer GEMM requested on a CPU without it", level.name());
        match level {
            GemmLevel::Scalar => self.gemm_scalar(g0, g1, acts, tokens, out),
            // SAFETY: the level's features are present (checked); lengths checked above.
            #[cfg(target_arch = "x86_64")]
            GemmLevel::Avx2 => unsafe { avx2::gemm::<avx2::Avx2, TILE>(self, g0, g1, acts, tokens, out) },
            #[cfg(target_arch = "x86_64")]
            GemmLevel::Avx512Vnni => unsafe { avx2::gemm::<avx512::Vnni, TILE_512>(self, g0, g1, acts, tokens, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("checked available"),
        }
    }

    /// The scalar kernel: the reference the SIMD kernels must equal bit for bit.
    fn gemm_scalar(&self, g0: usize, g1: usize, acts: &[Q8Block], tokens: usize, mut out: OutRows<'_>) {
        let rec = self.record();
        let nb = self.cols / Q8_BLOCK;
        for g in g0..g1 {
            for t in 0..tokens {
                for j in 0..GROUP {
                    let mut acc = 0f32;
                    if rec.values == QK_K {
                        for (blk, a) in self.group(g).chunks_exact(rec.bytes).zip(acts[t * nb..(t + 1) * nb].chunks_exact(QK_K / Q8_BLOCK)) {
                            acc = match self.ty {
                                GgmlType::Q6K => kquant::dot_halves(Halves::Q6K, blk, j, a, acc),
                                GgmlType::Q3K => kquant::dot_halves(Halves::Q3K, blk, j, a, acc),
                                GgmlType::Q2K => kquant::dot_halves(Halves::Q2K, blk, j, a, acc),
                                ty => kquant::dot_k4(blk, j, a, acc, ty == GgmlType::Q5K),
                            };
                        }
                        out.row(t)[(g - g0) * GROUP + j] = acc;
                        continue;
                    }
                    for (blk, a) in self
                        .group(g)
                        .chunks_exact(rec.bytes)
                        .zip(&acts[t * nb..(t + 1) * nb])
                    {
                        let d = f16::from_le_bytes([blk[2 * j], blk[2 * j + 1]]).to_f32();
                        let byte = |c: usize| blk[rec.code(j, c)];
                        let isum: i32 = match self.ty {
                            GgmlType::Q8_0 => (0..32).map(|c| byte(c) as i8 as i32 * a.qs[c] as i32).sum(),
                            _ => rec.small_codes(blk, j).iter().zip(&a.qs).map(|(&q, &x)| q as i32 * x as i32).sum::<i32>() - offset(self.ty) * i32::from(a.sum),
                        };
                        acc = (isum as f32).mul_add(d * a.d, acc);
                        if has_min(self.ty) {
                            let m = f16::from_le_bytes([blk[16 + 2 * j], blk[17 + 2 * j]]).to_f32();
                            acc = m.mul_add(a.s, acc);
                        }
                    }
                    out.row(t)[(g - g0) * GROUP + j] = acc;
                }
            }
        }
    }
}

/// The `T` token rows of `nb` activation blocks each in `a` (token-major). The AVX-512
/// Q4_0/Q4_1/Q5, Q8_0 and Q4_K/Q5_K kernels and the per-256 AVX2 ones read a token's block
/// through its row (one base per token, kept out of their block loops) rather than as
/// `a[t * nb + b]`, whose multiply and bounds check per token and block cost the AVX-512 Q4_K
/// kernel 10-13% (Q8_0 5%, Q4_1 4%; docs/benchmarks/kquants.md). The others keep the index:
/// there the rows measured no faster (AVX2 per-32) or slower (AVX-512 Q6_K, 11%).
#[inline(always)]
pub(super) fn token_rows<const T: usize, B>(a: &[B], nb: usize) -> [&[B]; T] {
    let mut rows = [&a[..0]; T];
    for (t, r) in rows.iter_mut().enumerate() {
        *r = &a[t * nb..(t + 1) * nb];
    }
    rows
}

/// One call of a record kernel: `groups` adjacent groups' records against `n` tokens from
/// token `t0`, writing output columns `col..col + groups * GROUP`.
pub(super) struct Tile<'a> {
    /// The groups' records, one group after the other.
    pub recs: &'a [u8],
    /// Groups in `recs`.
    pub groups: usize,
    /// First token.
    pub t0: usize,
    /// Tokens.
    pub n: usize,
    /// First output column (relative to the call's first group).
    pub col: usize,
    /// Whether these are the first tokens of a token block, the ones that stream the weights
    /// from memory (the others find them cached), so the kernel should prefetch.
    pub ahead: bool,
}

/// The loops every SIMD level's GEMM shares: blocks of [`TOKEN_BLOCK`] tokens whose
/// activations stay in L1/L2 while every group of `g0..g1` passes over them, groups
/// `per_call` at a time (one at a time for those left at the end), tokens up to `tn` at a time.
pub(super) fn for_each_tile(w: &Interleaved, g0: usize, g1: usize, tokens: usize, per_call: usize, tn: usize, mut kernel: impl FnMut(Tile<'_>)) {
    for tb in (0..tokens).step_by(TOKEN_BLOCK) {
        let tend = tokens.min(tb + TOKEN_BLOCK);
        let mut g = g0;
        while g < g1 {
            let groups = if g + per_call <= g1 { per_call } else { 1 };
            let recs = w.groups(g, groups);
            let mut t0 = tb;
            while t0 < tend {
                let n = tn.min(tend - t0);
                kernel(Tile { recs, groups, t0, n, col: (g - g0) * GROUP, ahead: t0 == tb });
                t0 += n;
            }
            g += groups;
        }
    }
}

/// The 64-byte cache lines, counted from the one holding its first byte, of a `len`-byte
/// record that starts `skew` bytes into a line: those of part `part` of `parts` near-equal
/// runs, which in order cover every line of the record once (`avx2::prefetch_part`).
#[cfg(any(target_arch = "x86_64", test))]
fn part_lines(skew: usize, len: usize, part: usize, parts: usize) -> std::ops::Range<usize> {
    let lines = (skew + len).div_ceil(64);
    part * lines / parts..(part + 1) * lines / parts
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::{kquant, Halves, Interleaved, OutRows, GROUP};
    use crate::ggml::act_quant::{Q8Block, Q8_BLOCK};
    use crate::ggml::{GgmlType, QK_K};
    use std::arch::x86_64::*;

    /// Activation blocks per k-quant super-block.
    pub(in crate::linear::ggml) const SUBS: usize = QK_K / Q8_BLOCK;

    /// One SIMD level's record kernels: the records of `GROUPS` adjacent groups (one after the
    /// other in `recs`) against up to eight tokens, `8 * GROUPS` outputs per token.
    pub(super) trait Records {
        /// Groups per call.
        const GROUPS: usize;

        /// 4-bit records (Q4_1 when `MIN`, else Q4_0), or 5-bit ones when `HIGH` (Q5_1, Q5_0),
        /// against T tokens; `dst` gets T rows of `8 * GROUPS` outputs. With
        /// `ahead`, each record read also prefetches what its stream reads next
        /// ([`prefetch_ahead`]).
        ///
        /// # Safety
        /// The level's CPU features are present; `recs` holds `GROUPS` groups' whole records
        /// of the type and `a` holds T rows of as many blocks as a group has records.
        unsafe fn q4<const T: usize, const MIN: bool, const HIGH: bool>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool);

        /// Q8_0 records against T tokens, as [`Records::q4`].
        ///
        /// # Safety
        /// As [`Records::q4`].
        unsafe fn q8<const T: usize>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool);

        /// Q4_K records (Q5_K when `HIGH`; one super-block of `8 * GROUPS` rows each) against T
        /// tokens, as [`Records::q4`]; `a` holds eight blocks per super-block per token.
        ///
        /// # Safety
        /// As [`Records::q4`].
        unsafe fn q4k<const T: usize, const HIGH: bool>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool);

        /// Q6_K, Q3_K or Q2_K records (`KIND` names the [`Halves`] kind) against T tokens, as
        /// [`Records::q4k`].
        ///
        /// # Safety
        /// As [`Records::q4`].
        unsafe fn halves<const T: usize, const KIND: u8>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool);
    }

    /// Calls `<$k>::$f::<n, ...>` for `n` tokens (1..=8), with const arguments `$c` after `n`.
    macro_rules! by_tokens {
        ($k:ty, $f:ident, $n:expr, [$($c:tt)*], $($arg:expr),*) => {
            match $n {
                8 => <$k>::$f::<8 $($c)*>($($arg),*),
                7 => <$k>::$f::<7 $($c)*>($($arg),*),
                6 => <$k>::$f::<6 $($c)*>($($arg),*),
                5 => <$k>::$f::<5 $($c)*>($($arg),*),
                4 => <$k>::$f::<4 $($c)*>($($arg),*),
                3 => <$k>::$f::<3 $($c)*>($($arg),*),
                2 => <$k>::$f::<2 $($c)*>($($arg),*),
                _ => <$k>::$f::<1 $($c)*>($($arg),*),
            }
        };
    }

    /// Calls kernel set `$k`'s record kernel for type `ty` and `n` tokens (1..=8).
    macro_rules! tile {
        ($k:ty, $ty:expr, $n:expr, $($arg:expr),*) => {
            match $ty {
                GgmlType::Q4_1 => by_tokens!($k, q4, $n, [, true, false], $($arg),*),
                GgmlType::Q4_0 => by_tokens!($k, q4, $n, [, false, false], $($arg),*),
                GgmlType::Q5_1 => by_tokens!($k, q4, $n, [, true, true], $($arg),*),
                GgmlType::Q5_0 => by_tokens!($k, q4, $n, [, false, true], $($arg),*),
                GgmlType::Q4K => by_tokens!($k, q4k, $n, [, false], $($arg),*),
                GgmlType::Q5K => by_tokens!($k, q4k, $n, [, true], $($arg),*),
                GgmlType::Q6K => by_tokens!($k, halves, $n, [, { kquant::Q6K_KIND }], $($arg),*),
                GgmlType::Q3K => by_tokens!($k, halves, $n, [, { kquant::Q3K_KIND }], $($arg),*),
                GgmlType::Q2K => by_tokens!($k, halves, $n, [, { kquant::Q2K_KIND }], $($arg),*),
                _ => by_tokens!($k, q8, $n, [], $($arg),*),
            }
        };
    }

    /// See [`Interleaved::gemm`]: the loops over token blocks, groups and tiles, each tile
    /// handed to `K`'s record kernels `K::GROUPS` groups at a time and up to `TN` (at most 8)
    /// tokens at a time. Groups left over at the end (fewer than `K::GROUPS`) take the AVX2
    /// kernels, which every level includes and which give the same bits.
    ///
    /// # Safety
    /// AVX2, FMA, F16C and `K`'s features available; lengths as [`Interleaved::gemm`] checks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemm<K: Records, const TN: usize>(
        w: &Interleaved,
        g0: usize,
        g1: usize,
        acts: &[Q8Block],
        tokens: usize,
        mut out: OutRows<'_>,
    ) {
        const { assert!(TN >= 1 && TN <= 8, "tile! covers 1..=8 tokens") };
        let nb = w.cols / Q8_BLOCK;
        super::for_each_tile(w, g0, g1, tokens, K::GROUPS, TN, |t| {
            let a = &acts[t.t0 * nb..(t.t0 + t.n) * nb];
            let dst = out.part(t.t0, t.col, t.groups * GROUP);
            // SAFETY: forwarded contract; `a` holds n token rows of nb blocks and `dst` n
            // output rows with `groups * GROUP` columns each.
            unsafe {
                if t.groups == K::GROUPS {
                    tile!(K, w.ty, t.n, t.recs, a, dst, t.ahead)
                } else {
                    tile!(Avx2, w.ty, t.n, t.recs, a, dst, t.ahead)
                }
            }
        });
    }

    /// How far ahead (bytes) of a group's record stream the kernels prefetch it.
    pub(in crate::linear::ggml) const PREFETCH: usize = 4096;

    /// Prefetches the cache lines of the bytes `distance` past `rec` (a record the kernel is
    /// about to read; see [`ahead_distance`]). Only hints: nothing is read.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::linear::ggml) fn prefetch_ahead(rec: &[u8], distance: usize) {
        prefetch_part(rec, 0, 1, distance);
    }

    /// Part `part` of `parts` of [`prefetch_ahead`]: its cache lines split into `parts` runs,
    /// so that a kernel reading a long record in `parts` steps prefetches a few lines per
    /// step. All of a k-quant record's lines at once (18 to 27 per group, twice that on
    /// AVX-512) held the two-thread Q6_K GEMV to 63-81% of the read roofline on Zen 3, where
    /// spread it streams at 88-98% (docs/benchmarks/kquants.md).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::linear::ggml) fn prefetch_part(rec: &[u8], part: usize, parts: usize, distance: usize) {
        let start = rec.as_ptr().wrapping_add(distance);
        let skew = start as usize % 64;
        for l in super::part_lines(skew, rec.len(), part, parts) {
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_sub(skew).wrapping_add(64 * l).cast());
        }
    }

    /// How far past a record at byte `at` of its group (`stream` bytes of records per group)
    /// lie the bytes its stream reads [`PREFETCH`] bytes later, when a call reads `groups`
    /// adjacent groups side by side: in the same group, or past its end in the group `groups`
    /// further on (which the same stream of the next call reads), skipping the groups between.
    #[inline]
    pub(super) fn ahead_distance(at: usize, stream: usize, groups: usize) -> usize {
        if at + PREFETCH >= stream {
            PREFETCH + (groups - 1) * stream
        } else {
            PREFETCH
        }
    }

    /// Four activation bytes `4i..4i + 4` of a block, broadcast to every lane.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn bcast(a: &Q8Block, i: usize) -> __m256i {
        bcast4(&a.qs, i)
    }

    /// Bytes `4i..4i + 4` of `qs`, broadcast to every lane (the activation operand of
    /// `vpmaddubsw`).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::linear::ggml) fn bcast4(qs: &[i8], i: usize) -> __m256i {
        let b: &[i8; 4] = qs[4 * i..4 * i + 4].try_into().expect("4 bytes");
        // SAFETY: `b` is 4 readable bytes.
        _mm256_set1_epi32(unsafe { (b.as_ptr() as *const i32).read_unaligned() })
    }

    /// Eight f16 values at `p` as f32.
    ///
    /// # Safety
    /// `p` points to 16 readable bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(in crate::linear::ggml) unsafe fn f16x8(p: *const u8) -> __m256 {
        // SAFETY: caller's contract.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// The per-block epilogue every level shares: eight rows' exact integer sums `isum`
    /// against token block `ab`, with the rows' scales `d` (and mins `m` when `MIN`):
    /// `acc = fma(isum, d * d_a, acc)`, then `acc = fma(m, s_a, acc)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) fn accumulate<const MIN: bool>(acc: __m256, isum: __m256i, d: __m256, m: __m256, ab: &Q8Block) -> __m256 {
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(ab.d)), acc);
        if MIN {
            _mm256_fmadd_ps(m, _mm256_set1_ps(ab.s), acc)
        } else {
            acc
        }
    }

    /// Writes T accumulators (8 rows each) to the first rows of `dst`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(in crate::linear::ggml) fn store<const T: usize>(acc: &[__m256; T], mut dst: OutRows<'_>) {
        for (t, v) in acc.iter().enumerate() {
            let d: &mut [f32; 8] = (&mut dst.row(t)[..GROUP]).try_into().expect("8 outputs");
            // SAFETY: `d` is 8 writable floats.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr(), *v) };
        }
    }

    /// Record bytes `at..at + 32`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::linear::ggml) fn load32(rec: &[u8], at: usize) -> __m256i {
        let c: &[u8; 32] = rec[at..at + 32].try_into().expect("32 bytes");
        // SAFETY: `c` is 32 readable bytes.
        unsafe { _mm256_loadu_si256(c.as_ptr() as *const __m256i) }
    }

    /// Eight unsigned bytes of a record at `at` as f32 (the Q4_K scales or mins of 8 rows).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn u8x8(rec: &[u8], at: usize) -> __m256 {
        let c: &[u8; 8] = rec[at..at + 8].try_into().expect("8 bytes");
        // SAFETY: `c` is 8 readable bytes.
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(c.as_ptr() as *const __m128i) }))
    }

    /// Eight signed bytes of a record at `at` (the Q6_K scales of 8 rows), each as an i16 in
    /// both halves of its row's 32-bit lane, the multiplier `vpmaddwd` wants.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn i8x8_pairs(rec: &[u8], at: usize) -> __m256i {
        let c: &[u8; 8] = rec[at..at + 8].try_into().expect("8 bytes");
        // SAFETY: `c` is 8 readable bytes.
        let v = _mm256_cvtepi8_epi32(unsafe { _mm_loadl_epi64(c.as_ptr() as *const __m128i) });
        _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(v))
    }

    /// Bits `2i..2i + 2` of every byte of a Q6_K high-bit chunk, moved to bits 4..6.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn high_pair(hb: __m256i, i: usize) -> __m256i {
        let v = match i {
            0 => _mm256_slli_epi16::<4>(hb),
            1 => _mm256_slli_epi16::<2>(hb),
            2 => hb,
            _ => _mm256_srli_epi16::<2>(hb),
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x30))
    }

    /// Bit `i` (0..8) of every byte of a fifth-bit chunk, moved to bit 4.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::linear::ggml) fn fifth_bit(hb: __m256i, i: usize) -> __m256i {
        let v = match i {
            0 => _mm256_slli_epi16::<4>(hb),
            1 => _mm256_slli_epi16::<3>(hb),
            2 => _mm256_slli_epi16::<2>(hb),
            3 => _mm256_slli_epi16::<1>(hb),
            4 => hb,
            5 => _mm256_srli_epi16::<1>(hb),
            6 => _mm256_srli_epi16::<2>(hb),
            _ => _mm256_srli_epi16::<3>(hb),
        };
        _mm256_and_si256(v, _mm256_set1_epi8(0x10))
    }

    /// The AVX2 record kernels.
    pub(super) struct Avx2;

    impl Records for Avx2 {
        const GROUPS: usize = 1;

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn q4<const T: usize, const MIN: bool, const HIGH: bool>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            let codes = if MIN { 32 } else { 16 };
            let rb = codes + 128 + if HIGH { 32 } else { 0 };
            let nb = recs.len() / rb;
            let off = if HIGH { 16 } else { 8 };
            let mask = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let rec = &recs[b * rb..(b + 1) * rb];
                if ahead {
                    prefetch_ahead(rec, PREFETCH);
                }
                // SAFETY: a record holds 16 bytes of scales (and 16 of mins) before its codes.
                let d = unsafe { f16x8(rec.as_ptr()) };
                let m = if MIN { unsafe { f16x8(rec.as_ptr().add(16)) } } else { _mm256_setzero_ps() };
                let hb = if HIGH { load32(rec, codes + 128) } else { _mm256_setzero_si256() };
                let mut lo = [_mm256_setzero_si256(); 4];
                let mut hi = [_mm256_setzero_si256(); 4];
                for i in 0..4 {
                    let p = load32(rec, codes + 32 * i);
                    lo[i] = _mm256_and_si256(p, mask);
                    hi[i] = _mm256_and_si256(_mm256_srli_epi16::<4>(p), mask);
                    if HIGH {
                        lo[i] = _mm256_or_si256(lo[i], fifth_bit(hb, i));
                        hi[i] = _mm256_or_si256(hi[i], fifth_bit(hb, 4 + i));
                    }
                }
                for t in 0..T {
                    let ab = &a[t * nb + b];
                    // Chunks i0..i1 (low and high nibbles) summed in i16: 4 (i1 - i0) products of at
                    // most 15 * 127, or 31 * 127 with the fifth bit, so 4 chunks fit, or 2.
                    let part = |i0: usize, i1: usize| {
                        let s = (i0..i1).fold(_mm256_setzero_si256(), |s, i| {
                            _mm256_add_epi16(_mm256_add_epi16(s, _mm256_maddubs_epi16(lo[i], bcast(ab, i))), _mm256_maddubs_epi16(hi[i], bcast(ab, 4 + i)))
                        });
                        _mm256_madd_epi16(s, ones)
                    };
                    let mut isum = if HIGH { _mm256_add_epi32(part(0, 2), part(2, 4)) } else { part(0, 4) };
                    if !MIN {
                        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(off * i32::from(ab.sum)));
                    }
                    acc[t] = accumulate::<MIN>(acc[t], isum, d, m, ab);
                }
            }
            store::<T>(&acc, dst);
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn q8<const T: usize>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            const RB: usize = 16 + 32 * GROUP;
            let nb = recs.len() / RB;
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                let rec = &recs[b * RB..(b + 1) * RB];
                if ahead {
                    prefetch_ahead(rec, PREFETCH);
                }
                // One 4-byte chunk of the eight rows at a time against every token: holding all
                // eight chunks' codes and magnitudes (sixteen registers) spilled the token sums.
                // |w| * (a with w's sign): pairs <= 2 * 128 * 127, so every chunk widens to i32.
                let mut isum = [_mm256_setzero_si256(); T];
                for i in 0..8 {
                    let w = load32(rec, 16 + 32 * i);
                    let wabs = _mm256_sign_epi8(w, w);
                    for (t, isum) in isum.iter_mut().enumerate() {
                        let p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(bcast(&a[t * nb + b], i), w));
                        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, ones));
                    }
                }
                // SAFETY: a record starts with 16 bytes of scales.
                let d = unsafe { f16x8(rec.as_ptr()) };
                for (t, acc) in acc.iter_mut().enumerate() {
                    *acc = accumulate::<false>(*acc, isum[t], d, d, &a[t * nb + b]);
                }
            }
            store::<T>(&acc, dst);
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn q4k<const T: usize, const HIGH: bool>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            let rb = if HIGH { kquant::Q5K_RECORD } else { kquant::Q4K_RECORD };
            let nsb = recs.len() / rb;
            let nb = nsb * SUBS;
            let mask = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); T];
            for sb in 0..nsb {
                let rec = &recs[sb * rb..(sb + 1) * rb];
                // SAFETY: a record starts with 16 bytes of scales and 16 of mins.
                let (d, dmin) = unsafe { (f16x8(rec.as_ptr()), f16x8(rec.as_ptr().add(16))) };
                for s in 0..SUBS {
                    if ahead {
                        prefetch_part(rec, s, SUBS, PREFETCH);
                    }
                    let dsc = _mm256_mul_ps(d, u8x8(rec, 32 + GROUP * s));
                    let dm = _mm256_mul_ps(dmin, u8x8(rec, 96 + GROUP * s));
                    let hb = if HIGH { load32(rec, kquant::Q5K_HIGH + 32 * s) } else { _mm256_setzero_si256() };
                    let q: [__m256i; 8] = std::array::from_fn(|i| {
                        let c = load32(rec, kquant::Q4K_CODES + (s / 2) * 256 + 32 * i);
                        let n = _mm256_and_si256(if s.is_multiple_of(2) { c } else { _mm256_srli_epi16::<4>(c) }, mask);
                        if HIGH {
                            _mm256_or_si256(n, fifth_bit(hb, i))
                        } else {
                            n
                        }
                    });
                    for t in 0..T {
                        let ab = &a[t * nb + sb * SUBS + s];
                        // Products of at most 15 * 127 (31 * 127 with the fifth bit) per i16 lane:
                        // 16 of them fit (8 with the fifth bit, so then two halves are widened).
                        let half = |r: std::ops::Range<usize>| {
                            r.fold(_mm256_setzero_si256(), |p, i| _mm256_add_epi16(p, _mm256_maddubs_epi16(q[i], bcast(ab, i))))
                        };
                        let isum = if HIGH {
                            _mm256_add_epi32(_mm256_madd_epi16(half(0..4), ones), _mm256_madd_epi16(half(4..8), ones))
                        } else {
                            _mm256_madd_epi16(half(0..8), ones)
                        };
                        let acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dsc, _mm256_set1_ps(ab.d)), acc[t]);
                        acc[t] = _mm256_fmadd_ps(dm, _mm256_set1_ps(ab.neg_dsum), acc1);
                    }
                }
            }
            store::<T>(&acc, dst);
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn halves<const T: usize, const KIND: u8>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            let kind = Halves::of(KIND);
            let rb = kind.record();
            let nsb = recs.len() / rb;
            let nb = nsb * SUBS;
            let mut acc = [_mm256_setzero_ps(); T];
            for sb in 0..nsb {
                let rec = &recs[sb * rb..(sb + 1) * rb];
                // SAFETY: a record starts with 16 bytes of scales (and, with mins, 16 of dmin).
                let d = unsafe { f16x8(rec.as_ptr()) };
                let dmin = if kind.has_min() { unsafe { f16x8(rec.as_ptr().add(16)) } } else { _mm256_setzero_ps() };
                for s in 0..SUBS {
                    if ahead {
                        prefetch_part(rec, s, SUBS, PREFETCH);
                    }
                    let q = halves_codes(kind, rec, s);
                    let sm: [(__m256i, __m256i); 2] = std::array::from_fn(|h| scale_min_pairs(kind, rec, kind.scales_at() + GROUP * (2 * s + h)));
                    for t in 0..T {
                        let ab = &a[t * nb + sb * SUBS + s];
                        let (mut isum, mut msum) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for (h, (qh, &(sc, m))) in q.iter().zip(&sm).enumerate() {
                            // Two chunks per i16 sum: 4 products of at most 63 * 127.
                            let p01 = _mm256_add_epi16(_mm256_maddubs_epi16(qh[0], bcast(ab, 4 * h)), _mm256_maddubs_epi16(qh[1], bcast(ab, 4 * h + 1)));
                            let p23 = _mm256_add_epi16(_mm256_maddubs_epi16(qh[2], bcast(ab, 4 * h + 2)), _mm256_maddubs_epi16(qh[3], bcast(ab, 4 * h + 3)));
                            let asum = if h == 0 { i32::from(ab.sum_lo) } else { i32::from(ab.sum) - i32::from(ab.sum_lo) };
                            isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(p01, sc), _mm256_madd_epi16(p23, sc)));
                            if kind.offset() != 0 {
                                // The codes' offset: sc * (-offset / 2 * Σa) twice; |16 Σa| <= 16 * 16 * 127 fits in i16.
                                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(sc, _mm256_set1_epi16((-kind.offset() / 2 * asum) as i16)));
                            }
                            if kind.has_min() {
                                // m in the low i16 of its lane, 0 in the high one: m * Σa.
                                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, _mm256_set1_epi16(asum as i16)));
                            }
                        }
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(ab.d)), acc[t]);
                        if kind.has_min() {
                            acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, _mm256_set1_ps(ab.d)), _mm256_cvtepi32_ps(msum), acc[t]);
                        }
                    }
                }
            }
            store::<T>(&acc, dst);
        }
    }

    /// Bits `from..` of every byte moved to bit `to` (the caller masks).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn move_bits(v: __m256i, from: i32, to: i32) -> __m256i {
        if from >= to {
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to))
        } else {
            _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from))
        }
    }

    /// The codes of 32-value block `s` of a [`Halves`] record, eight rows: half `h`, chunk `i`
    /// (values `16h + 4i..16h + 4i + 4`, one row per 32-bit lane), unsigned.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::linear::ggml) fn halves_codes(kind: Halves, rec: &[u8], s: usize) -> [[__m256i; 4]; 2] {
        // Q6_K's halves read the same low-nibble bytes: two loads each from L1 unless LLVM
        // merges them (not checked; the per-32 kernels that call this were not re-measured).
        [half_codes(kind, rec, s, 0), half_codes(kind, rec, s, 1)]
    }

    /// Half `h` of [`halves_codes`]: its four chunks alone, so a kernel can hold one half's
    /// codes in registers instead of both.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::linear::ggml) fn half_codes(kind: Halves, rec: &[u8], s: usize, h: usize) -> [__m256i; 4] {
        // Plain loops, no closures: a closure does not inherit the target features, and with
        // two callers (this module's kernels and `q8k`'s) it would stay an out-of-line call.
        let at = kind.codes_at() + s * kind.block();
        let (mask, three) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(3));
        let mut q = [_mm256_setzero_si256(); 4];
        match kind {
            Halves::Q6K => {
                let hb = load32(rec, at + 128 + 32 * h);
                for (i, q) in q.iter_mut().enumerate() {
                    let lo = load32(rec, at + 32 * i);
                    let l = if h == 0 { lo } else { _mm256_srli_epi16::<4>(lo) };
                    *q = _mm256_or_si256(_mm256_and_si256(l, mask), high_pair(hb, i));
                }
            }
            _ => {
                let third = if kind == Halves::Q3K { load32(rec, at + 64) } else { _mm256_setzero_si256() };
                let pairs = load32(rec, at + 32 * h);
                for (i, q) in q.iter_mut().enumerate() {
                    *q = _mm256_and_si256(move_bits(pairs, 2 * i as i32, 0), three);
                    if kind == Halves::Q3K {
                        *q = _mm256_or_si256(*q, _mm256_and_si256(move_bits(third, (4 * h + i) as i32, 2), _mm256_set1_epi8(4)));
                    }
                }
            }
        }
        q
    }

    /// Eight rows' scales of one 16-value sub-block (bytes at `at`) as i16 pairs for
    /// `vpmaddwd` (see [`i8x8_pairs`]), and for Q2_K their mins as i32 lanes (else zeros).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn scale_min_pairs(kind: Halves, rec: &[u8], at: usize) -> (__m256i, __m256i) {
        if !kind.has_min() {
            return (i8x8_pairs(rec, at), _mm256_setzero_si256());
        }
        let c: &[u8; 8] = rec[at..at + 8].try_into().expect("8 bytes");
        // SAFETY: `c` is 8 readable bytes.
        let v = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(c.as_ptr() as *const __m128i) });
        let sc = _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
        (_mm256_or_si256(sc, _mm256_slli_epi32::<16>(sc)), _mm256_srli_epi32::<4>(v))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::{ahead_distance, prefetch_part, Records, SUBS};
    use super::{kquant, Halves, OutRows, GROUP};
    use crate::ggml::act_quant::Q8Block;
    use std::arch::x86_64::*;

    /// The AVX-512 VNNI record kernels over two adjacent groups: code chunk `i` of both
    /// (sixteen rows) in one register against activation dword `i` broadcast, `vpdpbusd`
    /// multiplying unsigned codes by signed activations with four products per lane added
    /// straight into i32. Each row's block sum is the exact `isum` of the scalar kernel and
    /// the epilogue does the same operations per lane, so the bits are the same.
    pub(super) struct Vnni;

    /// [`prefetch_part`] for the two records `r0`, `r1` a call reads side by side, each at
    /// byte `at` of its group's `stream` bytes ([`ahead_distance`]).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn prefetch_pair(r0: &[u8], r1: &[u8], at: usize, stream: usize, part: usize, parts: usize) {
        let distance = ahead_distance(at, stream, 2);
        prefetch_part(r0, part, parts, distance);
        prefetch_part(r1, part, parts, distance);
    }

    /// Sixteen f16 values, eight at `p0` and eight at `p1`, as f32.
    ///
    /// # Safety
    /// `p0` and `p1` point to 16 readable bytes each.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    #[inline]
    unsafe fn f16x16(p0: *const u8, p1: *const u8) -> __m512 {
        // SAFETY: caller's contract.
        unsafe {
            let lo = _mm256_castsi128_si256(_mm_loadu_si128(p0 as *const __m128i));
            _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(lo, _mm_loadu_si128(p1 as *const __m128i)))
        }
    }

    /// Code chunk bytes `at..at + 32` of two records: the first group's eight rows in the low
    /// half, the second group's in the high half.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn join(r0: &[u8], r1: &[u8], at: usize) -> __m512i {
        let (c0, c1): (&[u8; 32], &[u8; 32]) = (r0[at..at + 32].try_into().expect("32 bytes"), r1[at..at + 32].try_into().expect("32 bytes"));
        // SAFETY: `c0` and `c1` are 32 readable bytes each.
        unsafe {
            let lo = _mm512_castsi256_si512(_mm256_loadu_si256(c0.as_ptr() as *const __m256i));
            _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(c1.as_ptr() as *const __m256i))
        }
    }

    /// Four activation bytes `4i..4i + 4` of a block, broadcast to all sixteen lanes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn bcast16(a: &Q8Block, i: usize) -> __m512i {
        assert!(i < 8);
        // SAFETY: bytes 4i..4i + 4 of the 32 activation bytes.
        _mm512_set1_epi32(unsafe { (a.qs.as_ptr().add(4 * i) as *const i32).read_unaligned() })
    }

    /// Writes T accumulators (sixteen rows each) to the first rows of `dst`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn store16<const T: usize>(acc: &[__m512; T], mut dst: OutRows<'_>) {
        for (t, v) in acc.iter().enumerate() {
            let d: &mut [f32; 16] = (&mut dst.row(t)[..2 * GROUP]).try_into().expect("16 outputs");
            // SAFETY: `d` is 16 writable floats.
            unsafe { _mm512_storeu_ps(d.as_mut_ptr(), *v) };
        }
    }

    /// The per-block epilogue of [`accumulate`] on sixteen rows: the same operations per lane.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn accumulate16<const MIN: bool>(acc: __m512, isum: __m512i, d: __m512, m: __m512, ab: &Q8Block) -> __m512 {
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(ab.d)), acc);
        if MIN {
            _mm512_fmadd_ps(m, _mm512_set1_ps(ab.s), acc)
        } else {
            acc
        }
    }

    /// Sixteen rows' scales or mins of two adjacent sub-blocks as i32 lanes (zero- or
    /// sign-extended): 16 bytes at `at` of each record, the first eight bytes of both for the
    /// first sub-block, the next eight for the second.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn bytes16x2<const SIGNED: bool>(r0: &[u8], r1: &[u8], at: usize) -> [__m512i; 2] {
        let (c0, c1): (&[u8; 16], &[u8; 16]) = (r0[at..at + 16].try_into().expect("16 bytes"), r1[at..at + 16].try_into().expect("16 bytes"));
        // SAFETY: `c0` and `c1` are 16 readable bytes each.
        let (v0, v1) = unsafe { (_mm_loadu_si128(c0.as_ptr() as *const __m128i), _mm_loadu_si128(c1.as_ptr() as *const __m128i)) };
        let (lo, hi) = (_mm_unpacklo_epi64(v0, v1), _mm_unpackhi_epi64(v0, v1));
        if SIGNED {
            [_mm512_cvtepi8_epi32(lo), _mm512_cvtepi8_epi32(hi)]
        } else {
            [_mm512_cvtepu8_epi32(lo), _mm512_cvtepu8_epi32(hi)]
        }
    }

    /// Bits `2i..2i + 2` of every byte of a Q6_K high-bit chunk, moved to bits 4..6.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn high_pair16(hb: __m512i, i: usize) -> __m512i {
        let v = match i {
            0 => _mm512_slli_epi16::<4>(hb),
            1 => _mm512_slli_epi16::<2>(hb),
            2 => hb,
            _ => _mm512_srli_epi16::<2>(hb),
        };
        _mm512_and_si512(v, _mm512_set1_epi8(0x30))
    }

    /// Bit `i` (0..8) of every byte of a fifth-bit chunk, moved to bit 4.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn fifth_bit16(hb: __m512i, i: usize) -> __m512i {
        let v = match i {
            0 => _mm512_slli_epi16::<4>(hb),
            1 => _mm512_slli_epi16::<3>(hb),
            2 => _mm512_slli_epi16::<2>(hb),
            3 => _mm512_slli_epi16::<1>(hb),
            4 => hb,
            5 => _mm512_srli_epi16::<1>(hb),
            6 => _mm512_srli_epi16::<2>(hb),
            _ => _mm512_srli_epi16::<3>(hb),
        };
        _mm512_and_si512(v, _mm512_set1_epi8(0x10))
    }

    impl Records for Vnni {
        const GROUPS: usize = 2;

        /// Two groups in one register: code chunk `i` of both (eight rows each) meets
        /// activation dword `i` broadcast to all lanes, so no `vpermd` and no folding of
        /// halves, and the epilogue runs on sixteen rows at once.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
        unsafe fn q4<const T: usize, const MIN: bool, const HIGH: bool>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            let codes = if MIN { 32 } else { 16 };
            let rb = codes + 128 + if HIGH { 32 } else { 0 };
            let nb = recs.len() / (2 * rb);
            let rows = super::token_rows::<T, _>(a, nb);
            let off = if HIGH { 16 } else { 8 };
            let mask = _mm512_set1_epi8(0x0F);
            let mut acc = [_mm512_setzero_ps(); T];
            for b in 0..nb {
                let (r0, r1) = (&recs[b * rb..(b + 1) * rb], &recs[(nb + b) * rb..(nb + b + 1) * rb]);
                if ahead {
                    prefetch_pair(r0, r1, b * rb, nb * rb, 0, 1);
                }
                // SAFETY: a record holds 16 bytes of scales (and 16 of mins) before its codes.
                let d = unsafe { f16x16(r0.as_ptr(), r1.as_ptr()) };
                let m = if MIN { unsafe { f16x16(r0.as_ptr().add(16), r1.as_ptr().add(16)) } } else { _mm512_setzero_ps() };
                let hb = if HIGH { join(r0, r1, codes + 128) } else { _mm512_setzero_si512() };
                let c: [__m512i; 4] = std::array::from_fn(|i| join(r0, r1, codes + 32 * i));
                let lo: [__m512i; 4] = std::array::from_fn(|i| {
                    let n = _mm512_and_si512(c[i], mask);
                    if HIGH { _mm512_or_si512(n, fifth_bit16(hb, i)) } else { n }
                });
                let hi: [__m512i; 4] = std::array::from_fn(|i| {
                    let n = _mm512_and_si512(_mm512_srli_epi16::<4>(c[i]), mask);
                    if HIGH { _mm512_or_si512(n, fifth_bit16(hb, 4 + i)) } else { n }
                });
                for t in 0..T {
                    let ab = &rows[t][b];
                    let mut s = _mm512_setzero_si512();
                    for i in 0..4 {
                        s = _mm512_dpbusd_epi32(s, lo[i], bcast16(ab, i));
                        s = _mm512_dpbusd_epi32(s, hi[i], bcast16(ab, 4 + i));
                    }
                    if !MIN {
                        s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * i32::from(ab.sum)));
                    }
                    acc[t] = accumulate16::<MIN>(acc[t], s, d, m, ab);
                }
            }
            store16::<T>(&acc, dst);
        }

        /// Q8_0 over two groups, as `q4`. `vpdpbusd` multiplies unsigned by signed bytes: the
        /// codes are stored signed, so they go in biased by 128 (xor 0x80) and 128 * Σa comes
        /// off the sum.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
        unsafe fn q8<const T: usize>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            const RB: usize = 16 + 32 * GROUP;
            let nb = recs.len() / (2 * RB);
            let rows = super::token_rows::<T, _>(a, nb);
            let bias = _mm512_set1_epi8(-128);
            let mut acc = [_mm512_setzero_ps(); T];
            for b in 0..nb {
                let (r0, r1) = (&recs[b * RB..(b + 1) * RB], &recs[(nb + b) * RB..(nb + b + 1) * RB]);
                if ahead {
                    prefetch_pair(r0, r1, b * RB, nb * RB, 0, 1);
                }
                // SAFETY: a record starts with 16 bytes of scales.
                let d = unsafe { f16x16(r0.as_ptr(), r1.as_ptr()) };
                let w: [__m512i; 8] = std::array::from_fn(|i| _mm512_xor_si512(join(r0, r1, 16 + 32 * i), bias));
                for t in 0..T {
                    let ab = &rows[t][b];
                    let mut s = _mm512_setzero_si512();
                    for (i, wi) in w.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, *wi, bcast16(ab, i));
                    }
                    let isum = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * i32::from(ab.sum)));
                    acc[t] = accumulate16::<false>(acc[t], isum, d, d, ab);
                }
            }
            store16::<T>(&acc, dst);
        }
        /// Q4_K (Q5_K when `HIGH`) over two groups: a pair of sub-blocks at a time, whose eight
        /// code chunks of both groups (low nibbles: the first sub-block, high: the second) are
        /// loaded once, with the pair's scales and mins; the fifth bits per sub-block.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
        unsafe fn q4k<const T: usize, const HIGH: bool>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            let rb = if HIGH { kquant::Q5K_RECORD } else { kquant::Q4K_RECORD };
            let nsb = recs.len() / (2 * rb);
            let nb = nsb * SUBS;
            let rows = super::token_rows::<T, _>(a, nb);
            let mask = _mm512_set1_epi8(0x0F);
            let mut acc = [_mm512_setzero_ps(); T];
            for sb in 0..nsb {
                let (r0, r1) = (&recs[sb * rb..(sb + 1) * rb], &recs[(nsb + sb) * rb..(nsb + sb + 1) * rb]);
                // SAFETY: a record starts with 16 bytes of scales and 16 of mins.
                let (d, dmin) = unsafe { (f16x16(r0.as_ptr(), r1.as_ptr()), f16x16(r0.as_ptr().add(16), r1.as_ptr().add(16))) };
                for p in 0..SUBS / 2 {
                    if ahead {
                        prefetch_pair(r0, r1, sb * rb, nsb * rb, p, SUBS / 2);
                    }
                    let c: [__m512i; 8] = std::array::from_fn(|i| join(r0, r1, kquant::Q4K_CODES + p * 256 + 32 * i));
                    let (sc, mn) = (bytes16x2::<false>(r0, r1, 32 + GROUP * 2 * p), bytes16x2::<false>(r0, r1, 96 + GROUP * 2 * p));
                    for (k, (sc, mn)) in sc.into_iter().zip(mn).enumerate() {
                        let s = 2 * p + k;
                        let dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
                        let dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
                        let hb = if HIGH { join(r0, r1, kquant::Q5K_HIGH + 32 * s) } else { _mm512_setzero_si512() };
                        let q: [__m512i; 8] = std::array::from_fn(|i| {
                            let n = _mm512_and_si512(if k == 0 { c[i] } else { _mm512_srli_epi16::<4>(c[i]) }, mask);
                            if HIGH {
                                _mm512_or_si512(n, fifth_bit16(hb, i))
                            } else {
                                n
                            }
                        });
                        for t in 0..T {
                            let ab = &rows[t][sb * SUBS + s];
                            let mut isum = _mm512_setzero_si512();
                            for (i, qi) in q.iter().enumerate() {
                                isum = _mm512_dpbusd_epi32(isum, *qi, bcast16(ab, i));
                            }
                            let acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dsc, _mm512_set1_ps(ab.d)), acc[t]);
                            acc[t] = _mm512_fmadd_ps(dm, _mm512_set1_ps(ab.neg_dsum), acc1);
                        }
                    }
                }
            }
            store16::<T>(&acc, dst);
        }

        /// Q6_K, Q3_K or Q2_K over two groups: unsigned codes into `vpdpbusd`, each 16-value
        /// half's sum less its offset times the activation sum, times the half's scale.
        ///
        /// The half sums start from `-offset · Σ a` (no subtraction after), and the scales
        /// (and Q2_K's mins) are applied in floats rather than by `vpmulld` (two uops on the
        /// port every `vpdpbusd` needs). Still exact, so the bits are the reference's: a half's
        /// sum is at most 16 · 32 · 127 < 2^16 in magnitude and a scale at most 128, so each
        /// product is below 2^23 and their sum below 2^24 (Q3_K and Q2_K, and the mins, are
        /// smaller still).
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
        unsafe fn halves<const T: usize, const KIND: u8>(recs: &[u8], a: &[Q8Block], dst: OutRows<'_>, ahead: bool) {
            let kind = Halves::of(KIND);
            let rb = kind.record();
            let nsb = recs.len() / (2 * rb);
            let nb = nsb * SUBS;
            let mut acc = [_mm512_setzero_ps(); T];
            for sb in 0..nsb {
                let (r0, r1) = (&recs[sb * rb..(sb + 1) * rb], &recs[(nsb + sb) * rb..(nsb + sb + 1) * rb]);
                // SAFETY: a record starts with 16 bytes of scales (and, with mins, 16 of dmin).
                let d = unsafe { f16x16(r0.as_ptr(), r1.as_ptr()) };
                let dmin = if kind.has_min() { unsafe { f16x16(r0.as_ptr().add(16), r1.as_ptr().add(16)) } } else { _mm512_setzero_ps() };
                for s in 0..SUBS {
                    if ahead {
                        prefetch_pair(r0, r1, sb * rb, nsb * rb, s, SUBS);
                    }
                    let q = halves_codes16(kind, r0, r1, s);
                    // The scale bytes of the block's two halves are adjacent.
                    let at = kind.scales_at() + GROUP * 2 * s;
                    // Per half: (scale, min) as floats (the min 0 without mins).
                    let mut sm = [(_mm512_setzero_ps(), _mm512_setzero_ps()); 2];
                    if kind.has_min() {
                        for (smh, v) in sm.iter_mut().zip(bytes16x2::<false>(r0, r1, at)) {
                            *smh = (_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F))), _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)));
                        }
                    } else {
                        for (smh, v) in sm.iter_mut().zip(bytes16x2::<true>(r0, r1, at)) {
                            smh.0 = _mm512_cvtepi32_ps(v);
                        }
                    }
                    for t in 0..T {
                        let ab = &a[t * nb + sb * SUBS + s];
                        let asums = [i32::from(ab.sum_lo), i32::from(ab.sum) - i32::from(ab.sum_lo)];
                        let u: [__m512; 2] = std::array::from_fn(|h| {
                            let mut u = _mm512_set1_epi32(-kind.offset() * asums[h]);
                            for (i, qi) in q[h].iter().enumerate() {
                                u = _mm512_dpbusd_epi32(u, *qi, bcast16(ab, 4 * h + i));
                            }
                            _mm512_cvtepi32_ps(u)
                        });
                        // sc_0 u_0 + sc_1 u_1, exact (see above).
                        let isum = _mm512_fmadd_ps(u[1], sm[1].0, _mm512_mul_ps(u[0], sm[0].0));
                        acc[t] = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(ab.d)), acc[t]);
                        if kind.has_min() {
                            let msum = _mm512_fmadd_ps(sm[1].1, _mm512_set1_ps(asums[1] as f32), _mm512_mul_ps(sm[0].1, _mm512_set1_ps(asums[0] as f32)));
                            acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, _mm512_set1_ps(ab.d)), msum, acc[t]);
                        }
                    }
                }
            }
            store16::<T>(&acc, dst);
        }
    }

    /// `(a & mask) | b` in one `vpternlogd`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn or_masked(a: __m512i, mask: __m512i, b: __m512i) -> __m512i {
        // Truth table over (a, b, mask) as bits 7..0 of the immediate: a & mask | b.
        _mm512_ternarylogic_epi32::<0xEC>(a, b, mask)
    }

    /// Bits `from..` of every byte moved to bit `to` (the caller masks).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn move_bits16(v: __m512i, from: i32, to: i32) -> __m512i {
        if from >= to {
            _mm512_srl_epi16(v, _mm_cvtsi32_si128(from - to))
        } else {
            _mm512_sll_epi16(v, _mm_cvtsi32_si128(to - from))
        }
    }

    /// The codes of 32-value block `s` of two groups' [`Halves`] records: half `h`, chunk `i`,
    /// the first group's eight rows in the low half of the register.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn halves_codes16(kind: Halves, r0: &[u8], r1: &[u8], s: usize) -> [[__m512i; 4]; 2] {
        // Plain loops, no closures: a closure would not inherit the target features, and the
        // calls it then needs cost more than the work (measured).
        let at = kind.codes_at() + s * kind.block();
        let (mask, three, four) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3), _mm512_set1_epi8(4));
        let mut q = [[_mm512_setzero_si512(); 4]; 2];
        if kind == Halves::Q6K {
            let lo = [join(r0, r1, at), join(r0, r1, at + 32), join(r0, r1, at + 64), join(r0, r1, at + 96)];
            for (h, qh) in q.iter_mut().enumerate() {
                let hb = join(r0, r1, at + 128 + 32 * h);
                for (i, qi) in qh.iter_mut().enumerate() {
                    let l = if h == 0 { lo[i] } else { _mm512_srli_epi16::<4>(lo[i]) };
                    *qi = or_masked(l, mask, high_pair16(hb, i));
                }
            }
        } else {
            let third = if kind == Halves::Q3K { join(r0, r1, at + 64) } else { _mm512_setzero_si512() };
            for (h, qh) in q.iter_mut().enumerate() {
                let pairs = join(r0, r1, at + 32 * h);
                for (i, qi) in qh.iter_mut().enumerate() {
                    let p = move_bits16(pairs, 2 * i as i32, 0);
                    *qi = if kind == Halves::Q3K {
                        or_masked(p, three, _mm512_and_si512(move_bits16(third, (4 * h + i) as i32, 2), four))
                    } else {
                        _mm512_and_si512(p, three)
                    };
                }
            }
        }
        q
    }
}

#[cfg(test)]
mod tests {
    use super::part_lines;
    use rand::{Rng, SeedableRng};

    /// A record's prefetch runs follow each other without gap or overlap and end at the line
    /// of its last byte: a line left out is one the weight stream then waits for.
    #[test]
    fn prefetch_parts_cover_each_line_once() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(28);
        for _ in 0..5000 {
            let (skew, len, parts) = (r.gen_range(0..64), r.gen_range(1..4000), r.gen_range(1..=16));
            let mut next = 0;
            for p in 0..parts {
                let run = part_lines(skew, len, p, parts);
                assert_eq!(run.start, next, "skew {skew} len {len} part {p} of {parts}");
                assert!(run.len() <= ((skew + len - 1) / 64 + 1).div_ceil(parts), "near-equal runs");
                next = run.end;
            }
            assert_eq!(next, (skew + len - 1) / 64 + 1, "skew {skew} len {len}: the last byte's line");
        }
    }
}
