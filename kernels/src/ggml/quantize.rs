//! Round-to-nearest quantization of f32 rows to GGML block types (Q4_0, Q4_1, Q8_0, Q2_K..Q6_K):
//! enough to write synthetic models and test data in the formats llama.cpp ships. The
//! search llama.cpp's `llama-quantize` does for the k-quants' scales (weighted, iterative)
//! is not attempted: scales come straight from each sub-block's range, so the error is that
//! of plain rounding, somewhat above llama.cpp's on real weights.

use super::types::GgmlType;
use half::f16;

/// Types [`quantize_row`] writes.
pub const QUANTIZABLE: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Quantizes `x` (whole blocks of `ty`) into `out` (`ty.row_bytes(x.len())` bytes).
///
/// # Panics
/// If `ty` is not in [`QUANTIZABLE`] or the lengths disagree.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    assert_eq!(Some(out.len()), ty.row_bytes(x.len()), "{ty} row of {} values", x.len());
    let f: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
            return;
        }
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4K => |x, b| k4(x, b, false),
        GgmlType::Q5K => |x, b| k4(x, b, true),
        GgmlType::Q6K => q6_k,
        GgmlType::Q3K => q3_k,
        GgmlType::Q2K => q2_k,
        _ => panic!("no quantizer for {ty}"),
    };
    for (xb, ob) in x.chunks_exact(ty.block_size()).zip(out.chunks_exact_mut(ty.type_size())) {
        f(xb, ob);
    }
}

/// `v` rounded to f16, as stored, and back.
fn h(v: f32) -> (f32, [u8; 2]) {
    let r = f16::from_f32(v);
    (r.to_f32(), r.to_le_bytes())
}

/// `1 / d`, or 0 when `d` is 0 (a block of zeros quantizes to zeros).
fn inv(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

fn q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (d, bytes) = h(amax / 127.0);
    b[0..2].copy_from_slice(&bytes);
    let id = inv(d);
    for (o, v) in b[2..34].iter_mut().zip(x) {
        *o = (v * id).round().clamp(-127.0, 127.0) as i8 as u8;
    }
}

/// As llama.cpp's reference: the value of largest magnitude maps to code 0 (-8 steps), so the
/// scale keeps its sign and the other end of the range gets 7 steps.
fn q4_0(x: &[f32], b: &mut [u8]) {
    let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    let (d, db) = h(max / -8.0);
    b[0..2].copy_from_slice(&db);
    let id = inv(d);
    let q = |v: f32| (v * id + 8.5).clamp(0.0, 15.0) as u8;
    for j in 0..16 {
        b[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

fn q4_1(x: &[f32], b: &mut [u8]) {
    let (lo, hi) = x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(l, u), &v| (l.min(v), u.max(v)));
    let (d, db) = h((hi - lo) / 15.0);
    let (m, mb) = h(lo);
    b[0..2].copy_from_slice(&db);
    b[2..4].copy_from_slice(&mb);
    let id = inv(d);
    let q = |v: f32| ((v - m) * id).round().clamp(0.0, 15.0) as u8;
    for j in 0..16 {
        b[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

/// Q4_K, or Q5_K when `high` (31 steps, the fifth bits in `qh` before the nibbles).
fn k4(x: &[f32], b: &mut [u8], high: bool) {
    let top = if high { 31.0 } else { 15.0 };
    // Per 32-value sub-block: the range [min(0, lo), hi] in `top` steps.
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (s, xs) in x.chunks_exact(32).enumerate() {
        let (lo, hi) = xs.iter().fold((0f32, f32::NEG_INFINITY), |(l, u), &v| (l.min(v), u.max(v)));
        scales[s] = (hi - lo) / top;
        mins[s] = -lo;
    }
    let (d, db) = h(scales.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let (dmin, mb) = h(mins.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    b[0..2].copy_from_slice(&db);
    b[2..4].copy_from_slice(&mb);
    let ls: [u8; 8] = std::array::from_fn(|s| (scales[s] * inv(d)).round().clamp(0.0, 63.0) as u8);
    let lm: [u8; 8] = std::array::from_fn(|s| (mins[s] * inv(dmin)).round().clamp(0.0, 63.0) as u8);
    // The 12-byte 6-bit field: low six bits of sub-blocks 0..4 in bytes 0..8, sub-blocks 4..8
    // split into nibbles (bytes 8..12) and top bits (the spare two bits of bytes 0..8).
    let q = &mut b[4..16];
    for j in 0..4 {
        q[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
        q[j + 4] = lm[j] | ((lm[j + 4] >> 4) << 6);
        q[j + 8] = (ls[j + 4] & 0x0F) | ((lm[j + 4] & 0x0F) << 4);
    }
    let (qh, qs) = if high { b[16..176].split_at_mut(32) } else { b[16..144].split_at_mut(0) };
    qh.fill(0);
    qs.fill(0);
    for (s, xs) in x.chunks_exact(32).enumerate() {
        let (step, off) = (d * ls[s] as f32, dmin * lm[s] as f32);
        let id = inv(step);
        for (l, &v) in xs.iter().enumerate() {
            let c = ((v + off) * id).round().clamp(0.0, top) as u8;
            qs[(s / 2) * 32 + l] |= (c & 0x0F) << (4 * (s % 2));
            if high {
                qh[l] |= (c >> 4) << s;
            }
        }
    }
}

fn q6_k(x: &[f32], b: &mut [u8]) {
    // Per 16-value sub-block: a scale putting the largest |x| at ±31.
    let scales: [f32; 16] = std::array::from_fn(|k| x[16 * k..16 * k + 16].iter().fold(0f32, |m, v| m.max(v.abs())) / 31.0);
    let (d, db) = h(scales.iter().fold(0f32, |m, &v| m.max(v)) / 127.0);
    b[208..210].copy_from_slice(&db);
    let (ql, rest) = b.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    ql.fill(0);
    qh.fill(0);
    for (k, &s) in scales.iter().enumerate() {
        let sc = (s * inv(d)).round().clamp(0.0, 127.0) as i8;
        rest[k] = sc as u8;
        let id = inv(d * sc as f32);
        for (v, &xv) in x.iter().enumerate().skip(16 * k).take(16) {
            let q = ((xv * id).round().clamp(-32.0, 31.0) as i32 + 32) as u8;
            let (n, quarter, l) = (v / 128, (v % 128) / 32, v % 32);
            ql[n * 64 + l + (quarter & 1) * 32] |= (q & 0x0F) << (4 * (quarter / 2));
            qh[n * 32 + l] |= (q >> 4) << (2 * quarter);
        }
    }
}

/// Where value `v` of a super-block keeps its 2-bit code in Q2_K's and Q3_K's `qs`: byte
/// `32 (s / 4) + l` at bit `2 (s % 4)`, for value `l` of 32-value block `s`.
fn two_bit_at(v: usize) -> (usize, usize) {
    let (s, l) = (v / 32, v % 32);
    (32 * (s / 4) + l, 2 * (s % 4))
}

/// Q3_K: per 16-value sub-block a signed scale putting the value of largest magnitude at
/// code -4 (as `q4_0`), the scales in 6 signed bits against one f16 `d`, codes -4..3 as two
/// low bits in `qs` and a third in `hmask` (set for codes >= 0).
fn q3_k(x: &[f32], b: &mut [u8]) {
    let scales: [f32; 16] = std::array::from_fn(|k| x[16 * k..16 * k + 16].iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m }) / -4.0);
    let (d, db) = h(scales.iter().fold(0f32, |m, &v| m.max(v.abs())) / 31.0);
    b.fill(0);
    b[108..110].copy_from_slice(&db);
    for (k, &sk) in scales.iter().enumerate() {
        let sc = (sk * inv(d)).round().clamp(-32.0, 31.0) as i32;
        let u = (sc + 32) as u8;
        b[96 + if k < 8 { k } else { k - 8 }] |= (u & 0x0F) << (4 * (k / 8));
        b[96 + 8 + k % 4] |= (u >> 4) << (2 * (k / 4));
        let id = inv(d * sc as f32);
        for (v, &xv) in x.iter().enumerate().skip(16 * k).take(16) {
            let c = ((xv * id).round().clamp(-4.0, 3.0) as i32 + 4) as u8;
            let (byte, shift) = two_bit_at(v);
            b[32 + byte] |= (c & 3) << shift;
            b[v % 32] |= (c >> 2) << (v / 32);
        }
    }
}

/// Q2_K: per 16-value sub-block the range [min(0, lo), hi] in 3 steps, scales and mins in 4
/// bits against f16 `d` and `dmin`, codes 0..3.
fn q2_k(x: &[f32], b: &mut [u8]) {
    let ranges: [(f32, f32); 16] = std::array::from_fn(|k| {
        let (lo, hi) = x[16 * k..16 * k + 16].iter().fold((0f32, f32::NEG_INFINITY), |(l, u), &v| (l.min(v), u.max(v)));
        ((hi - lo) / 3.0, -lo)
    });
    let (d, db) = h(ranges.iter().fold(0f32, |m, r| m.max(r.0)) / 15.0);
    let (dmin, mb) = h(ranges.iter().fold(0f32, |m, r| m.max(r.1)) / 15.0);
    b.fill(0);
    b[80..82].copy_from_slice(&db);
    b[82..84].copy_from_slice(&mb);
    for (k, &(scale, min)) in ranges.iter().enumerate() {
        let sc = (scale * inv(d)).round().clamp(0.0, 15.0) as u8;
        let m = (min * inv(dmin)).round().clamp(0.0, 15.0) as u8;
        b[k] = sc | (m << 4);
        let (step, off) = (d * sc as f32, dmin * m as f32);
        let id = inv(step);
        for (v, &xv) in x.iter().enumerate().skip(16 * k).take(16) {
            let c = ((xv + off) * id).round().clamp(0.0, 3.0) as u8;
            let (byte, shift) = two_bit_at(v);
            b[16 + byte] |= c << shift;
        }
    }
}
