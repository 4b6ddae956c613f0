//! The quantization arithmetic, on row-major `[rows, cols]` f32 matrices: symmetric and
//! asymmetric (zero-point) integer quantization with per-group (or per-row) scales, per-row
//! FP8 E4M3, and Quark's two-stage FP8 → INT4 "progressive" scheme.
//!
//! Rules shared by every scheme:
//! - a scale is `absmax / divisor`, floored at `f32::EPSILON` (compressed-tensors clamps its
//!   scales the same way, so an all-zero group quantizes to zeros, not NaN), then rounded to the
//!   dtype it is stored in; values are quantized **with the stored scale**, so the file's
//!   integers and scales agree exactly;
//! - integers are `clamp(round_half_even(w / scale), qmin, qmax)` with the division in f32
//!   (asymmetric: `+ zp` before the clamp, see [`quantize_asym_groups`]);
//! - FP8 values are `e4m3(w / scale)`, rounded to nearest even and saturating at ±448.

use crate::float_dtype::FloatDtype;
use rayon::prelude::*;
use tessera_kernels::quant::fp8::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};

/// A symmetric integer grid: `[qmin, qmax]` and the divisor that turns an absmax into a scale.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntGrid {
    /// Smallest integer.
    pub qmin: i32,
    /// Largest integer.
    pub qmax: i32,
    /// `scale = absmax / divisor`.
    pub divisor: f32,
}

/// int4 as compressed-tensors and Quark quantize it: `[-8, 7]`, scale `absmax / 7.5`
/// (the whole range's half-width, so the negative extreme reaches −8).
pub const INT4: IntGrid = IntGrid { qmin: -8, qmax: 7, divisor: 7.5 };

/// int8 weights, vLLM-style symmetric: `[-127, 127]`, scale `absmax / 127` (no −128, so the
/// grid is symmetric and `-w` quantizes to `-q`).
pub const INT8: IntGrid = IntGrid { qmin: -127, qmax: 127, divisor: 127.0 };

/// `absmax / divisor`, floored at `f32::EPSILON`, rounded to `dtype`.
pub fn scale_for(absmax: f32, divisor: f32, dtype: FloatDtype) -> f32 {
    dtype.round((absmax / divisor).max(f32::EPSILON))
}

/// The integer for `x` on `grid` with `scale`.
pub fn quantize_int(x: f32, scale: f32, grid: IntGrid) -> i8 {
    (x / scale).round_ties_even().clamp(grid.qmin as f32, grid.qmax as f32) as i8
}

fn absmax(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// Integer quantization with one scale per `group` consecutive columns of each row
/// (`group >= cols`: per row; the last group of a row may be shorter, as compressed-tensors
/// writes for widths that `group` does not divide). Returns the integers `[rows * cols]` and
/// the scales `[rows * ceil(cols / group)]` (row-major, already rounded to `scale_dtype`).
pub fn quantize_int_groups(w: &[f32], cols: usize, group: usize, grid: IntGrid, scale_dtype: FloatDtype) -> (Vec<i8>, Vec<f32>) {
    let per_row = cols.div_ceil(group);
    let mut q = vec![0i8; w.len()];
    let mut scales = vec![0f32; w.len() / cols * per_row];
    q.par_chunks_mut(cols).zip(scales.par_chunks_mut(per_row)).zip(w.par_chunks(cols)).for_each(|((qr, sr), wr)| {
        for ((qg, s), wg) in qr.chunks_mut(group).zip(sr.iter_mut()).zip(wr.chunks(group)) {
            *s = scale_for(absmax(wg), grid.divisor, scale_dtype);
            for (qv, &x) in qg.iter_mut().zip(wg) {
                *qv = quantize_int(x, *s, grid);
            }
        }
    });
    (q, scales)
}

/// Asymmetric integer quantization on `grid`'s range with the group layout of
/// [`quantize_int_groups`] (compressed-tensors' min/max observer, range widened to include 0):
/// `scale = (max - min) / (qmax - qmin)` (floored and rounded as for symmetric scales),
/// `zp = clamp(round_half_even(-min / scale) + qmin, qmin, qmax)`,
/// `q = clamp(round_half_even(w / scale) + zp, qmin, qmax)`; dequantization `(q - zp) · scale`.
/// Returns the integers, the scales and the zero points (one per scale).
pub fn quantize_asym_groups(w: &[f32], cols: usize, group: usize, grid: IntGrid, scale_dtype: FloatDtype) -> (Vec<i8>, Vec<f32>, Vec<i8>) {
    let per_row = cols.div_ceil(group);
    let n_scales = w.len() / cols * per_row;
    let (mut q, mut scales, mut zeros) = (vec![0i8; w.len()], vec![0f32; n_scales], vec![0i8; n_scales]);
    let (qmin, qmax) = (grid.qmin as f32, grid.qmax as f32);
    q.par_chunks_mut(cols).zip(scales.par_chunks_mut(per_row)).zip(zeros.par_chunks_mut(per_row)).zip(w.par_chunks(cols)).for_each(
        |(((qr, sr), zr), wr)| {
            for (((qg, s), z), wg) in qr.chunks_mut(group).zip(sr.iter_mut()).zip(zr.iter_mut()).zip(wr.chunks(group)) {
                let (lo, hi) = wg.iter().fold((0f32, 0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                *s = scale_for(hi - lo, qmax - qmin, scale_dtype);
                let zp = ((-lo / *s).round_ties_even() + qmin).clamp(qmin, qmax);
                *z = zp as i8;
                for (qv, &x) in qg.iter_mut().zip(wg) {
                    *qv = ((x / *s).round_ties_even() + zp).clamp(qmin, qmax) as i8;
                }
            }
        },
    );
    (q, scales, zeros)
}

/// FP8 E4M3 with one scale per row, `absmax / 448` rounded to `scale_dtype`.
/// Returns the E4M3 bytes `[rows * cols]` and the row scales.
pub fn quantize_fp8_rows(w: &[f32], cols: usize, scale_dtype: FloatDtype) -> (Vec<u8>, Vec<f32>) {
    let mut q = vec![0u8; w.len()];
    let mut scales = vec![0f32; w.len() / cols];
    q.par_chunks_mut(cols).zip(scales.par_iter_mut()).zip(w.par_chunks(cols)).for_each(|((qr, s), wr)| {
        *s = scale_for(absmax(wr), E4M3_MAX, scale_dtype);
        for (qv, &x) in qr.iter_mut().zip(wr) {
            *qv = f32_to_e4m3(x / *s);
        }
    });
    (q, scales)
}

/// Quark's W4A8 `ProgressiveSpec` (FP8 per-tensor, then INT4 per output channel).
#[derive(Clone, Debug)]
pub struct Progressive {
    /// int4 values `[rows * cols]`.
    pub q: Vec<i8>,
    /// Stage-0 FP8 per-tensor scale `absmax(W) / 448`.
    pub fp8_scale: f32,
    /// Stage-1 per-row INT4 scales `absmax_row(V) / 7.5`, in FP8 units.
    pub int4_scales: Vec<f32>,
}

/// Stage 0: `V = e4m3(W / s_fp8)` (values rounded to FP8, as floats) with
/// `s_fp8 = absmax(W) / 448`; stage 1 per row: `s_int4 = absmax_row(V) / 7.5`,
/// `q = clamp(round_half_even(V / s_int4), -8, 7)`. Scales are f32 (Quark's `scale_type`).
/// Dequantization: `W ≈ q · s_int4[row] · s_fp8`.
pub fn quantize_progressive(w: &[f32], cols: usize) -> Progressive {
    let fp8_scale = scale_for(absmax(w), E4M3_MAX, FloatDtype::F32);
    let v: Vec<f32> = w.par_iter().map(|&x| e4m3_to_f32(f32_to_e4m3(x / fp8_scale))).collect();
    let (q, int4_scales) = quantize_int_groups(&v, cols, cols, INT4, FloatDtype::F32);
    Progressive { q, fp8_scale, int4_scales }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_group_extremes_and_bf16_scale() {
        // absmax 3.0 -> scale 0.4 (bf16 0.400390625): -3.0 -> -7.49 -> -7, 3.0 -> 7 after clamp.
        let w = [-3.0, 3.0, 0.2, -0.2, 0.0, 1.0, -1.0, 0.5];
        let (q, s) = quantize_int_groups(&w, 8, 8, INT4, FloatDtype::BF16);
        assert_eq!(s, vec![half::bf16::from_f32(0.4).to_f32()]);
        assert_eq!(q, vec![-7, 7, 0, 0, 0, 2, -2, 1]);
        // The negative extreme reaches -8 when the scale is exact.
        let (q, s) = quantize_int_groups(&[-7.5, 1.0], 2, 2, INT4, FloatDtype::F32);
        assert_eq!((q, s), (vec![-8, 1], vec![1.0]));
        // An all-zero group: scale EPSILON, zeros.
        let (q, s) = quantize_int_groups(&[0.0; 4], 4, 4, INT4, FloatDtype::BF16);
        assert_eq!((q, s), (vec![0; 4], vec![f32::EPSILON]));
    }

    #[test]
    fn int4_asym_zero_point_and_range() {
        // min -1, max 2: scale 3/15 = 0.2, zp = round(5) - 8 = -3; 2.0 -> 10 - 3 = 7, -1.0 -> -8.
        let (q, s, z) = quantize_asym_groups(&[-1.0, 2.0, 0.0, 0.4], 4, 4, INT4, FloatDtype::F32);
        assert_eq!((s, z), (vec![0.2], vec![-3]));
        assert_eq!(q, vec![-8, 7, -3, -1]);
        // All positive: the range includes 0, so zp = -8; an all-zero group: scale EPSILON, zeros.
        let (q, s, z) = quantize_asym_groups(&[1.0, 3.0, 0.0, 0.0], 2, 2, INT4, FloatDtype::F32);
        assert_eq!((q, s, z), (vec![-3, 7, -8, -8], vec![0.2, f32::EPSILON], vec![-8, -8]));
    }

    #[test]
    fn progressive_rows_use_fp8_units() {
        let w = [448.0, -224.0, 1.0, 0.0, 2.0, -1.0, 0.5, 0.25];
        let p = quantize_progressive(&w, 4);
        assert_eq!(p.fp8_scale, 1.0);
        assert_eq!(p.int4_scales, vec![448.0 / 7.5, 2.0 / 7.5]);
        assert_eq!(p.q, vec![7, -4, 0, 0, 7, -4, 2, 1]);
    }
}
