//! Q4_K, Q5_K and Q6_K super-blocks regrouped eight rows at a time for the integer GEMM of
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
//! **Q6_K** ([`Q6K_RECORD`] bytes, the GGML size): rows' f16 `d` (16), signed scales
//! `sc[k * 8 + row]` for the sixteen 16-value sub-blocks (128), then per 32-value block `s`
//! 192 bytes: four chunks of low nibbles (chunk `i`, row `j`, byte `b`: value `4i + b` in
//! the low nibble, value `16 + 4i + b` in the high one) and two chunks of high bit pairs
//! (chunk `h`, row `j`, byte `b`, bits `2i..2i + 2`: the top two bits of value
//! `16h + 4i + b`).
//!
//! Activations are the per-token Q8 blocks of 32 values the other GGML types use (see
//! [`super::interleaved`] for why). Numerics per (row, token), in this order:
//! - Q4_K and Q5_K, for each 32-value sub-block `s` against activation block `a`:
//!   `acc = fma(isum, (d * sc_s) * a.d, acc)`, then `acc = fma(dmin * m_s, -(a.d * a.sum), acc)`,
//!   with `isum = Σ q · a.qs` exact;
//! - Q6_K, for each 32-value block: the exact integer
//!   `isum = sc_lo · Σ_lo (q - 32) · a.qs + sc_hi · Σ_hi (q - 32) · a.qs` over its two
//!   16-value halves, then `acc = fma(isum, d * a.d, acc)`.
//!
//! Every level performs exactly these operations (the integer parts are exact), so they agree
//! bit for bit.

use super::interleaved::GROUP;
use crate::ggml::act_quant::{Q8Block, Q8_BLOCK};
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
        acc = dm.mul_add(-(ab.d * ab.sum as f32), acc);
    }
    acc
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
        for h in 0..2 {
            for b in 0..4 {
                blk[128 + h * 32 + 4 * j + b] = (0..4).map(|i| (q[16 * h + 4 * i + b] >> 4) << (2 * i)).fold(0, |x, y| x | y);
            }
        }
    }
}

/// Row `j`'s 6-bit code of value `v` (0..32) of 32-value block `s` in a Q6_K record.
fn q6k_code(rec: &[u8], j: usize, s: usize, v: usize) -> u8 {
    let blk = &rec[Q6K_CODES + s * Q6K_BLOCK..];
    let (h, i, b) = (v / 16, (v % 16) / 4, v % 4);
    let lb = blk[i * 32 + 4 * j + b];
    let lo = if h == 0 { lb & 0x0F } else { lb >> 4 };
    lo | (((blk[128 + h * 32 + 4 * j + b] >> (2 * i)) & 3) << 4)
}

/// Row `j`'s 256 values from a Q6_K record, exactly as GGML dequantizes the original block.
pub(crate) fn dequant_q6k(rec: &[u8], j: usize, out: &mut [f32]) {
    let d = f16_at(rec, 2 * j);
    for (v, o) in out.iter_mut().enumerate().take(QK_K) {
        let sc = rec[16 + (v / 16) * GROUP + j] as i8;
        *o = d * sc as f32 * (q6k_code(rec, j, v / 32, v % 32) as i32 - 32) as f32;
    }
}

/// The scalar reference: row `j` of a Q6_K record against the eight activation blocks of its
/// super-block, added to `acc` (see the module's numerics).
pub(crate) fn dot_q6k(rec: &[u8], j: usize, a: &[Q8Block], mut acc: f32) -> f32 {
    let d = f16_at(rec, 2 * j);
    for (s, ab) in a.iter().enumerate().take(QK_K / Q8_BLOCK) {
        let half = |h: usize| -> i32 {
            let sc = rec[16 + (2 * s + h) * GROUP + j] as i8 as i32;
            sc * (16 * h..16 * h + 16).map(|v| (q6k_code(rec, j, s, v) as i32 - 32) * ab.qs[v] as i32).sum::<i32>()
        };
        acc = ((half(0) + half(1)) as f32).mul_add(d * ab.d, acc);
    }
    acc
}
