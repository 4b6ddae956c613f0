//! Q4_K, Q5_K, Q6_K, Q3_K and Q2_K super-blocks regrouped eight rows at a time for the integer GEMM of
//! [`super::interleaved`], and the scalar reference of that GEMM.
//!
//! One record holds one 256-value super-block of eight rows. Code bytes are interleaved four
//! at a time exactly as for Q4_1 (a 32-bit lane per row), so the SIMD kernels share the Q4_1
//! kernels' structure; scales are unpacked to one byte per (sub-block, row).
//!
//! **Q4_K** ([`Q4K_RECORD`] bytes, 2.8% more than the GGML blocks because the 6-bit
//! scales and mins are stored as bytes): rows' f16 `d` (16 bytes), f16 `dmin` (16), scales
//! `sc[s * 8 + row]` (64), mins `m[s * 8 + row]` (64), then four 256-byte code pairs: pair
//! `p`, chunk `i` (0..8), row `j` holds the row's GGML bytes `qs[32p + 4i .. 32p + 4i + 4]`,
//! whose low nibbles are values `4i..4i + 4` of sub-block `2p` and high nibbles those of
//! sub-block `2p + 1`.
//!
//! **Q5_K** ([`Q5K_RECORD`] bytes, 2.3% more than GGML's): a Q4_K record followed by one
//! 32-byte chunk of fifth bits per sub-block `s`: row `j`, byte `b`, bit `i` is the top bit of
//! value `4i + b` (the value whose low nibble is byte `b` of code chunk `i`).
//!
//! **Q6_K, Q3_K and Q2_K** (32-value blocks of two 16-value halves, each with its own scale):
//! laid out and computed as [`Halves`] describes.
//!
//! Activations are the per-token Q8 blocks of 32 values the other GGML types use, or on the
//! AVX2 level the super-blocks of [`super::q8k`] (numerics there; scalar references
//! [`dot_k4_q8k`], [`dot_halves_q8k`]). Numerics against blocks of 32 per (row, token), in
//! this order:
//! - Q4_K and Q5_K, for each 32-value sub-block `s` against activation block `a`:
//!   `acc = fma(isum, (d * sc_s) * a.d, acc)`, then `acc = fma(dmin * m_s, -(a.d * a.sum), acc)`,
//!   with `isum = Σ q · a.qs` exact;
//! - Q6_K, Q3_K and Q2_K: see [`Halves`].
//!
//! Every level performs exactly these operations (the integer parts are exact), so they agree
//! bit for bit.

use super::interleaved::GROUP;
use crate::ggml::act_quant::{Q8Block, Q8KBlock, Q8_BLOCK};
use crate::ggml::dequant::q3k_scales;
use crate::ggml::QK_K;
use half::f16;

/// Bytes of one interleaved Q4_K record (eight rows, 256 values each).
pub const Q4K_RECORD: usize = 160 + 4 * 256;

/// Bytes of one interleaved Q5_K record: a Q4_K record, then the fifth bits.
pub const Q5K_RECORD: usize = Q4K_RECORD + 8 * 32;

/// Bytes of one interleaved Q6_K record (eight rows, 256 values each).
pub const Q6K_RECORD: usize = 144 + 8 * 192;

/// Offset of the Q4_K code pairs in a record.
pub(crate) const Q4K_CODES: usize = 160;

/// Offset of the Q5_K fifth bits in a record.
pub(crate) const Q5K_HIGH: usize = Q4K_RECORD;

/// Offset of the Q6_K code blocks in a record.
pub(crate) const Q6K_CODES: usize = 144;

/// Bytes of one Q6_K 32-value code block of eight rows.
pub(crate) const Q6K_BLOCK: usize = 192;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Unpacks the 12-byte, 6-bit scale/min field of a Q4_K block: `(scales, mins)`.
fn q4k_scales(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        (sc[j], m[j]) = if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
        };
    }
    (sc, m)
}

/// Writes row `j`'s GGML Q4_K block (144 bytes) or, when `high`, Q5_K block (176 bytes:
/// the fifth bits `qh` before the nibbles) into record `rec`.
pub(crate) fn put_k4(rec: &mut [u8], j: usize, src: &[u8], high: bool) {
    rec[2 * j..2 * j + 2].copy_from_slice(&src[0..2]);
    rec[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&src[2..4]);
    let (sc, m) = q4k_scales(&src[4..16]);
    for s in 0..8 {
        rec[32 + s * GROUP + j] = sc[s];
        rec[96 + s * GROUP + j] = m[s];
    }
    let qs = if high { &src[48..176] } else { &src[16..144] };
    for p in 0..4 {
        for i in 0..8 {
            let at = Q4K_CODES + p * 256 + i * 32 + 4 * j;
            rec[at..at + 4].copy_from_slice(&qs[32 * p + 4 * i..32 * p + 4 * i + 4]);
        }
    }
    if high {
        // Value l of sub-block s has its fifth bit at bit s of qh[l].
        let qh = &src[16..48];
        for s in 0..8 {
            for b in 0..4 {
                rec[Q5K_HIGH + s * 32 + 4 * j + b] = (0..8).map(|i| ((qh[4 * i + b] >> s) & 1) << i).fold(0, |x, y| x | y);
            }
        }
    }
}

/// Row `j`'s code of value `l` (0..32) of sub-block `s` in a Q4_K record, or in a Q5_K
/// record with its fifth bit when `high`.
fn k4_code(rec: &[u8], j: usize, s: usize, l: usize, high: bool) -> u8 {
    let byte = rec[Q4K_CODES + (s / 2) * 256 + (l / 4) * 32 + 4 * j + l % 4];
    let nibble = if s.is_multiple_of(2) { byte & 0x0F } else { byte >> 4 };
    if high {
        nibble | (((rec[Q5K_HIGH + s * 32 + 4 * j + l % 4] >> (l / 4)) & 1) << 4)
    } else {
        nibble
    }
}

/// Row `j`'s 256 values from a Q4_K (or, when `high`, Q5_K) record, exactly as GGML
/// dequantizes the original block.
pub(crate) fn dequant_k4(rec: &[u8], j: usize, out: &mut [f32], high: bool) {
    let (d, dmin) = (f16_at(rec, 2 * j), f16_at(rec, 16 + 2 * j));
    for (s, o) in out.chunks_exact_mut(Q8_BLOCK).enumerate() {
        let (dl, ml) = (d * rec[32 + s * GROUP + j] as f32, dmin * rec[96 + s * GROUP + j] as f32);
        for (l, o) in o.iter_mut().enumerate() {
            *o = dl * k4_code(rec, j, s, l, high) as f32 - ml;
        }
    }
}

/// The scalar reference: row `j` of a Q4_K (or, when `high`, Q5_K) record against the eight
/// activation blocks of its super-block, added to `acc` (see the module's numerics).
pub(crate) fn dot_k4(rec: &[u8], j: usize, a: &[Q8Block], mut acc: f32, high: bool) -> f32 {
    let (d, dmin) = (f16_at(rec, 2 * j), f16_at(rec, 16 + 2 * j));
    for (s, ab) in a.iter().enumerate().take(QK_K / Q8_BLOCK) {
        let isum: i32 = (0..Q8_BLOCK).map(|l| k4_code(rec, j, s, l, high) as i32 * ab.qs[l] as i32).sum();
        let dsc = d * rec[32 + s * GROUP + j] as f32;
        let dm = dmin * rec[96 + s * GROUP + j] as f32;
        acc = (isum as f32).mul_add(dsc * ab.d, acc);
        acc = dm.mul_add(-(ab.d * i32::from(ab.sum) as f32), acc);
    }
    acc
}

/// The scalar reference against a per-256 activation super-block (the numerics of
/// [`super::q8k`]): row `j` of a Q4_K (or, when `high`, Q5_K) record, added to `acc`.
pub(crate) fn dot_k4_q8k(rec: &[u8], j: usize, a: &Q8KBlock, acc: f32, high: bool) -> f32 {
    let (d, dmin) = (f16_at(rec, 2 * j), f16_at(rec, 16 + 2 * j));
    let (mut isum, mut msum) = (0i32, 0i32);
    for s in 0..QK_K / Q8_BLOCK {
        let dot: i32 = (0..Q8_BLOCK).map(|l| k4_code(rec, j, s, l, high) as i32 * a.qs[Q8_BLOCK * s + l] as i32).sum();
        isum += (rec[32 + s * GROUP + j] as i32 * dot) << a.shift[s];
        msum += rec[96 + s * GROUP + j] as i32 * i32::from(a.sums32[s]);
    }
    let acc = (isum as f32).mul_add(d * a.d, acc);
    (msum as f32).mul_add(-(dmin * a.d), acc)
}

/// The 6-bit codes (0..64) of a GGML Q6_K block, in value order.
fn q6k_codes(src: &[u8]) -> [u8; QK_K] {
    let (ql, qh) = (&src[0..128], &src[128..192]);
    std::array::from_fn(|v| {
        let (n, quarter, l) = (v / 128, (v % 128) / 32, v % 32);
        let lb = ql[n * 64 + l + (quarter & 1) * 32];
        let lo = if quarter >= 2 { lb >> 4 } else { lb & 0x0F };
        lo | (((qh[n * 32 + l] >> (2 * quarter)) & 3) << 4)
    })
}

/// The 2-bit codes (0..4) of a Q2_K or Q3_K block's `qs` (64 bytes), in value order: value
/// `l` of 32-value block `s` is bits `2 (s % 4)..` of `qs[32 (s / 4) + l]`.
fn two_bit_codes(qs: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|v| {
        let (s, l) = (v / 32, v % 32);
        (qs[32 * (s / 4) + l] >> (2 * (s % 4))) & 3
    })
}

/// Writes two chunks of bit pairs at `blk`: chunk `h`, row `j`, byte `b`, bits `2i..2i + 2`
/// hold `pair(16h + 4i + b)` (values of one 32-value block).
fn put_pairs(blk: &mut [u8], j: usize, pair: impl Fn(usize) -> u8) {
    for h in 0..2 {
        for b in 0..4 {
            blk[h * 32 + 4 * j + b] = (0..4).map(|i| (pair(16 * h + 4 * i + b) & 3) << (2 * i)).fold(0, |x, y| x | y);
        }
    }
}

/// Row `j`'s bit pair of value `v` (0..32) from chunks written by [`put_pairs`] at `blk`.
fn pair_at(blk: &[u8], j: usize, v: usize) -> u8 {
    (blk[(v / 16) * 32 + 4 * j + v % 4] >> (2 * ((v % 16) / 4))) & 3
}

/// The k-quants whose 32-value blocks are two 16-value halves with an integer scale each
/// (Q6_K, Q3_K, Q2_K): one record layout family and one kernel per SIMD level.
///
/// Records: rows' f16 `d` (16 bytes), for Q2_K rows' f16 `dmin` (16), one byte per
/// (16-value sub-block `k`, row `j`) at `scales_at + 8k + j` (Q6_K and Q3_K: the signed scale;
/// Q2_K: GGML's byte, scale in the low nibble and min in the high one), then per 32-value
/// block `s` a code block of [`Halves::block`] bytes at `codes_at + s * block`:
/// - **Q6_K** (the GGML size): four chunks of low nibbles (chunk `i`, row `j`, byte `b`:
///   value `4i + b` in the low nibble, value `16 + 4i + b` in the high one), then two chunks of
///   the top bit pairs as [`put_pairs`] writes them;
/// - **Q3_K** (3.6% over GGML's, the 6-bit scales unpacked to bytes): the low bit pairs as
///   [`put_pairs`] writes them, then one chunk of third bits (row `j`, byte `b`, bit `i`: value
///   `4i + b`); codes are unsigned 0..8, GGML's value plus 4;
/// - **Q2_K** (the GGML size): the bit pairs as [`put_pairs`] writes them.
///
/// Numerics per (row, token) and 32-value block against activation block `a`, with
/// `u_h = Σ_h q · a.qs - offset · Σ_h a.qs` exact over half `h` (offset 32, 4, 0):
/// `isum = sc_0 u_0 + sc_1 u_1`, then `acc = fma(isum, d * a.d, acc)`; for Q2_K then
/// `acc = fma(dmin * a.d, -(m_0 Σ_0 a.qs + m_1 Σ_1 a.qs), acc)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Halves {
    /// GGML Q6_K.
    Q6K,
    /// GGML Q3_K.
    Q3K,
    /// GGML Q2_K.
    Q2K,
}

/// [`Halves::Q6K`] as a const generic argument ([`Halves::of`]).
pub(crate) const Q6K_KIND: u8 = 0;
/// [`Halves::Q3K`] as a const generic argument.
pub(crate) const Q3K_KIND: u8 = 1;
/// [`Halves::Q2K`] as a const generic argument.
pub(crate) const Q2K_KIND: u8 = 2;

/// Bytes of one interleaved Q3_K record (eight rows, 256 values each).
pub const Q3K_RECORD: usize = 144 + 8 * 96;

/// Bytes of one interleaved Q2_K record (eight rows, 256 values each).
pub const Q2K_RECORD: usize = 160 + 8 * 64;

impl Halves {
    /// The kind a const generic argument names.
    pub(crate) const fn of(kind: u8) -> Halves {
        match kind {
            Q6K_KIND => Halves::Q6K,
            Q3K_KIND => Halves::Q3K,
            _ => Halves::Q2K,
        }
    }

    /// Bytes of one record.
    pub(crate) const fn record(self) -> usize {
        match self {
            Halves::Q6K => Q6K_RECORD,
            Halves::Q3K => Q3K_RECORD,
            Halves::Q2K => Q2K_RECORD,
        }
    }

    /// Whether rows have a `dmin` and per-sub-block mins (Q2_K).
    pub(crate) const fn has_min(self) -> bool {
        matches!(self, Halves::Q2K)
    }

    /// Offset of the per-sub-block scale bytes.
    pub(crate) const fn scales_at(self) -> usize {
        if self.has_min() { 32 } else { 16 }
    }

    /// Offset of the first code block.
    pub(crate) const fn codes_at(self) -> usize {
        self.scales_at() + 16 * GROUP
    }

    /// Bytes of one 32-value code block of eight rows.
    pub(crate) const fn block(self) -> usize {
        match self {
            Halves::Q6K => Q6K_BLOCK,
            Halves::Q3K => 96,
            Halves::Q2K => 64,
        }
    }

    /// What the stored codes exceed GGML's values by.
    pub(crate) const fn offset(self) -> i32 {
        match self {
            Halves::Q6K => 32,
            Halves::Q3K => 4,
            Halves::Q2K => 0,
        }
    }

    /// Row `j`'s stored code of value `v` (0..32) of 32-value block `s`.
    fn code(self, rec: &[u8], j: usize, s: usize, v: usize) -> u8 {
        let blk = &rec[self.codes_at() + s * self.block()..];
        match self {
            Halves::Q6K => {
                let lb = blk[((v % 16) / 4) * 32 + 4 * j + v % 4];
                let lo = if v < 16 { lb & 0x0F } else { lb >> 4 };
                lo | (pair_at(&blk[128..], j, v) << 4)
            }
            Halves::Q3K => pair_at(blk, j, v) | (((blk[64 + 4 * j + v % 4] >> (v / 4)) & 1) << 2),
            Halves::Q2K => pair_at(blk, j, v),
        }
    }

    /// Row `j`'s scale and min (0 without mins) of 16-value sub-block `k`.
    fn scale_min(self, rec: &[u8], j: usize, k: usize) -> (i32, i32) {
        let b = rec[self.scales_at() + k * GROUP + j];
        if self.has_min() {
            ((b & 0x0F) as i32, (b >> 4) as i32)
        } else {
            (b as i8 as i32, 0)
        }
    }
}

/// Writes row `j`'s GGML Q6_K block `src` (210 bytes) into record `rec`.
pub(crate) fn put_q6k(rec: &mut [u8], j: usize, src: &[u8]) {
    rec[2 * j..2 * j + 2].copy_from_slice(&src[208..210]);
    for k in 0..16 {
        rec[16 + k * GROUP + j] = src[192 + k];
    }
    let q = q6k_codes(src);
    for (s, q) in q.chunks_exact(Q8_BLOCK).enumerate() {
        let blk = &mut rec[Q6K_CODES + s * Q6K_BLOCK..Q6K_CODES + (s + 1) * Q6K_BLOCK];
        for i in 0..4 {
            for b in 0..4 {
                let (v0, v1) = (4 * i + b, 16 + 4 * i + b);
                blk[i * 32 + 4 * j + b] = (q[v0] & 0x0F) | (q[v1] << 4);
            }
        }
        put_pairs(&mut blk[128..], j, |v| q[v] >> 4);
    }
}

/// Writes row `j`'s GGML Q3_K block `src` (110 bytes: `hmask` 32, `qs` 64, packed 6-bit
/// scales 12, `d`) into record `rec`.
pub(crate) fn put_q3k(rec: &mut [u8], j: usize, src: &[u8]) {
    rec[2 * j..2 * j + 2].copy_from_slice(&src[108..110]);
    for (k, sc) in q3k_scales(&src[96..108]).into_iter().enumerate() {
        rec[16 + k * GROUP + j] = sc as i8 as u8;
    }
    let (hmask, low) = (&src[0..32], two_bit_codes(&src[32..96]));
    let block = Halves::Q3K.block();
    for s in 0..QK_K / Q8_BLOCK {
        let blk = &mut rec[Halves::Q3K.codes_at() + s * block..][..block];
        put_pairs(blk, j, |v| low[32 * s + v]);
        // Value l of block s has its third bit at bit s of hmask[l].
        for b in 0..4 {
            blk[64 + 4 * j + b] = (0..8).map(|i| ((hmask[4 * i + b] >> s) & 1) << i).fold(0, |x, y| x | y);
        }
    }
}

/// Writes row `j`'s GGML Q2_K block `src` (84 bytes: scale/min bytes 16, `qs` 64, `d`,
/// `dmin`) into record `rec`.
pub(crate) fn put_q2k(rec: &mut [u8], j: usize, src: &[u8]) {
    rec[2 * j..2 * j + 2].copy_from_slice(&src[80..82]);
    rec[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&src[82..84]);
    for k in 0..16 {
        rec[32 + k * GROUP + j] = src[k];
    }
    let q = two_bit_codes(&src[16..80]);
    let block = Halves::Q2K.block();
    for s in 0..QK_K / Q8_BLOCK {
        put_pairs(&mut rec[Halves::Q2K.codes_at() + s * block..][..block], j, |v| q[32 * s + v]);
    }
}

/// Row `j`'s 256 values from a record of `kind`, exactly as GGML dequantizes the original
/// block: `(d * sc) * (code - offset)`, less `dmin * m` for Q2_K.
pub(crate) fn dequant_halves(kind: Halves, rec: &[u8], j: usize, out: &mut [f32]) {
    let (d, dmin) = (f16_at(rec, 2 * j), f16_at(rec, 16 + 2 * j));
    for (v, o) in out.iter_mut().enumerate().take(QK_K) {
        let (sc, m) = kind.scale_min(rec, j, v / 16);
        let x = d * sc as f32 * (kind.code(rec, j, v / 32, v % 32) as i32 - kind.offset()) as f32;
        *o = if kind.has_min() { x - dmin * m as f32 } else { x };
    }
}

/// The scalar reference: row `j` of a record of `kind` against the eight activation blocks of
/// its super-block, added to `acc` (see [`Halves`] for the numerics).
pub(crate) fn dot_halves(kind: Halves, rec: &[u8], j: usize, a: &[Q8Block], mut acc: f32) -> f32 {
    let (d, dmin) = (f16_at(rec, 2 * j), f16_at(rec, 16 + 2 * j));
    for (s, ab) in a.iter().enumerate().take(QK_K / Q8_BLOCK) {
        let (mut isum, mut msum) = (0i32, 0i32);
        for h in 0..2 {
            let asum = if h == 0 { i32::from(ab.sum_lo) } else { i32::from(ab.sum) - i32::from(ab.sum_lo) };
            let (sc, m) = kind.scale_min(rec, j, 2 * s + h);
            let dot: i32 = (16 * h..16 * h + 16).map(|v| kind.code(rec, j, s, v) as i32 * ab.qs[v] as i32).sum();
            isum += sc * (dot - kind.offset() * asum);
            msum += m * asum;
        }
        acc = (isum as f32).mul_add(d * ab.d, acc);
        if kind.has_min() {
            acc = (dmin * ab.d).mul_add(-(msum as f32), acc);
        }
    }
    acc
}

/// The scalar reference against a per-256 activation super-block (the numerics of
/// [`super::q8k`]): row `j` of a record of `kind`, added to `acc`.
pub(crate) fn dot_halves_q8k(kind: Halves, rec: &[u8], j: usize, a: &Q8KBlock, acc: f32) -> f32 {
    let (d, dmin) = (f16_at(rec, 2 * j), f16_at(rec, 16 + 2 * j));
    let (mut isum, mut msum) = (0i64, 0i64);
    for (k, &asum) in a.sums.iter().enumerate() {
        let (sc, m) = kind.scale_min(rec, j, k);
        let dot: i64 = (0..16).map(|l| kind.code(rec, j, k / 2, 16 * (k % 2) + l) as i64 * a.qs[16 * k + l] as i64).sum();
        isum += sc as i64 * ((dot << a.shift[k / 2]) - kind.offset() as i64 * i64::from(asum));
        msum += m as i64 * i64::from(asum);
    }
    // Both fit in i32 (see `super::q8k`'s bound), so the casts are exact.
    let (isum, msum) = (isum as i32, msum as i32);
    let acc = (isum as f32).mul_add(d * a.d, acc);
    if kind.has_min() {
        (msum as f32).mul_add(-(dmin * a.d), acc)
    } else {
        acc
    }
}
