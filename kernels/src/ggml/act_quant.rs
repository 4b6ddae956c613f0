//! Run-time activation quantization to 8-bit blocks of 32 (llama.cpp's Q8_0 / Q8_1).
//!
//! Integer dot products against 4- and 8-bit weight blocks need the activation in
//! the same 32-value blocking. Scales are rounded through f16 exactly as llama.cpp
//! stores them, so results match its kernels number for number.

use half::f16;

/// Values per activation block.
pub const Q8_BLOCK: usize = 32;

/// One activation block: `x ≈ d * qs`, and `s = d * Σ qs` (used by min-offset weights).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
pub struct Q8Block {
    /// Scale (f16-rounded).
    pub d: f32,
    /// `d * Σ qs` (f16-rounded), the block sum needed by Q4_1/Q5_1 weights.
    pub s: f32,
    /// Quantized values in [-127, 127].
    pub qs: [i8; Q8_BLOCK],
}

/// Quantizes `x` (a multiple of 32 values) into `out` (`x.len() / 32` blocks), absmax / 127 per block.
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    assert_eq!(x.len(), out.len() * Q8_BLOCK, "activation length is not whole Q8 blocks");
    for (blk, xs) in out.iter_mut().zip(x.chunks_exact(Q8_BLOCK)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in blk.qs.iter_mut().zip(xs) {
            let r = (v * id).round() as i32;
            *q = r as i8;
            sum += r;
        }
        blk.d = f16::from_f32(d).to_f32();
        blk.s = f16::from_f32(sum as f32 * d).to_f32();
    }
}
