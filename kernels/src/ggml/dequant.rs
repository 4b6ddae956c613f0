//! Scalar dequantization of every supported GGML block type.
//!
//! This is both the production path for dequantizing weight panels and the
//! reference every SIMD kernel is tested against. Layouts follow ggml's
//! `block_*` structs (little-endian, packed).

use super::types::{GgmlType, QK_K};
use half::f16;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `out.len()` values of type `ty` from `src`.
///
/// `out.len()` must be a multiple of the block size and `src` exactly the row's bytes;
/// both are the caller's contract (checked at load time), so a violation panics.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    let bs = ty.block_size();
    let ts = ty.type_size();
    assert!(out.len().is_multiple_of(bs), "{} row of {} values is not whole blocks", ty, out.len());
    assert_eq!(src.len(), out.len() / bs * ts, "{} row byte length", ty);
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            // bf16 is the top half of an f32: a shift, which the compiler vectorizes
            // (`half`'s conversion branches per value to quiet NaNs, ~5x slower here).
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        _ => {
            let f = block_fn(ty);
            for (o, b) in out.chunks_exact_mut(bs).zip(src.chunks_exact(ts)) {
                f(b, o);
            }
        }
    }
}

fn block_fn(ty: GgmlType) -> fn(&[u8], &mut [f32]) {
    match ty {
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q8_1 => q8_1,
        GgmlType::Q2K => q2_k,
        GgmlType::Q3K => q3_k,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
        GgmlType::Q8K => q8_k,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("float types are not blocked"),
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((qs[j] & 0x0F) as u32 | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((qs[j] & 0x0F) as u32 | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in y.iter_mut().zip(&b[2..34]) {
        *o = q as i8 as f32 * d;
    }
}

fn q8_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in y.iter_mut().zip(&b[4..36]) {
        *o = q as i8 as f32 * d;
    }
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    let mut out = 0;
    let mut is = 0;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for l in 0..16 {
                    y[out] = dl * ((q[part * 16 + l] >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// Unpacks the 12-byte, 6-bit scale/min field of Q4_K and Q5_K for sub-block `j` (0..8).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The 16 signed 6-bit scales (-32..32) of a Q3_K block's 12 packed bytes: low 4 bits from
/// `raw[0..8]` (low nibbles, then high), top 2 bits from `raw[8..12]`.
pub(crate) fn q3k_scales(raw: &[u8]) -> [i32; 16] {
    std::array::from_fn(|i| {
        let low = if i < 8 { raw[i] & 0x0F } else { raw[i - 8] >> 4 };
        let high = (raw[8 + i % 4] >> (2 * (i / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    })
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let raw = &b[96..108];
    let d_all = f16_at(b, 108);
    let scales = q3k_scales(raw);
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for part in 0..2 {
                let dl = d_all * scales[is] as f32;
                is += 1;
                for l in 0..16 {
                    let idx = part * 16 + l;
                    let hi = if hmask[idx] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (((q[idx] >> shift) & 3) as i32 - hi) as f32;
                    out += 1;
                }
            }
            m = m.wrapping_shl(1);
        }
    }
}

/// The 8 sub-block `(scale, min)` pairs of a Q4_K / Q5_K super-block (d, dmin, scales at 0..16).
fn k4_sub_blocks(b: &[u8]) -> [(f32, f32); 8] {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    std::array::from_fn(|j| {
        let (s, m) = scale_min_k4(j, &b[4..16]);
        (d * s as f32, dmin * m as f32)
    })
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let sub = k4_sub_blocks(b);
    let qs = &b[16..144];
    for j in 0..4 {
        let ((d1, m1), (d2, m2)) = (sub[2 * j], sub[2 * j + 1]);
        let q = &qs[j * 32..j * 32 + 32];
        let o = &mut y[j * 64..j * 64 + 64];
        for l in 0..32 {
            o[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            o[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let sub = k4_sub_blocks(b);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for j in 0..4 {
        let ((d1, m1), (d2, m2)) = (sub[2 * j], sub[2 * j + 1]);
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let q = &qs[j * 32..j * 32 + 32];
        let o = &mut y[j * 64..j * 64 + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            o[l] = d1 * ((q[l] & 0x0F) + h1) as f32 - m1;
            o[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let sc = &b[192..208];
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &ql[n * 64..n * 64 + 64];
        let qh = &qh[n * 32..n * 32 + 32];
        let sc = &sc[n * 8..n * 8 + 8];
        let o = &mut y[n * 128..n * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (o, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
        *o = q as i8 as f32 * d;
    }
}
