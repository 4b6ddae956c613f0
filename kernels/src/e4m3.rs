//! OCP FP8 E4M3 (`float8_e4m3fn`, safetensors `F8_E4M3`): 1 sign, 4 exponent (bias 7) and
//! 3 mantissa bits; max finite ±448; no infinities; `0x7F`/`0xFF` are NaN.
//!
//! Encoding rounds to nearest, ties to even, and saturates to ±448, as
//! `torch.clamp(x, -448, 448).to(torch.float8_e4m3fn)` does (the compressed-tensors / vLLM
//! quantizers clamp before the cast).

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The E4M3 byte for `x`: round to nearest even, saturating at ±448; NaN maps to `0x7F`.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return 0x7F;
    }
    let a = x.abs().min(E4M3_MAX);
    // Below the smallest normal (2^-6) the spacing is a fixed 2^-9.
    if a < 1.0 / 64.0 {
        let m = (a * 512.0).round_ties_even() as u8; // 0..=8; 8 is the smallest normal, 0x08
        return sign | m;
    }
    let bits = a.to_bits();
    let mut exp = ((bits >> 23) & 0xFF) as i32 - 127;
    let mant = bits & 0x7F_FFFF;
    let mut m = mant >> 20;
    let rem = mant & 0xF_FFFF;
    if rem > 0x8_0000 || (rem == 0x8_0000 && m & 1 == 1) {
        m += 1;
    }
    if m == 8 {
        m = 0;
        exp += 1;
    }
    sign | (((exp + 7) as u8) << 3) | m as u8
}

/// The value of an E4M3 byte (NaN for `0x7F`/`0xFF`).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = (b >> 3) & 0xF;
    let m = (b & 7) as f32;
    if e == 0xF && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 512.0
    } else {
        sign * (1.0 + m / 8.0) * f32::powi(2.0, e as i32 - 7)
    }
}

/// Whether an E4M3 byte is NaN.
pub fn e4m3_is_nan(b: u8) -> bool {
    b & 0x7F == 0x7F
}
