//! The quantization arithmetic, on row-major `[rows, cols]` f32 matrices: symmetric and
//! asymmetric (zero-point) integer quantization with per-group (or per-row) scales, per-row
//! FP8 E4M3, and Quark's two-stage FP8 → INT4 "progressive" scheme, each a [`Grid`] chosen
//! from the weights and then filled with codes.
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

/// What a matrix's codes stand for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CodeKind {
    /// Integers on a grid, stored as `i8` bytes: `(q − zp) · scale`.
    Int(IntGrid),
    /// FP8 E4M3 bytes: `e4m3(q) · scale`.
    Fp8,
    /// Quark's two stages: the value in units of `fp8_scale` rounded to E4M3, then to an int4
    /// of `scale` (in FP8 units): `q · scale · fp8_scale`.
    Progressive {
        /// The per-tensor FP8 stage's scale.
        fp8_scale: f32,
    },
}

/// A matrix's quantization grid, chosen before any value is rounded: one scale (and zero
/// point) per `group` consecutive columns of each row (`group >= cols`: per row; the last
/// group of a row may be shorter, as compressed-tensors writes for widths that `group` does
/// not divide). Rounding to nearest ([`Grid::round`]) and GPTQ (`super::gptq`) both code
/// values on it, so a writer packs either result the same way.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    /// What the codes stand for.
    pub kind: CodeKind,
    /// Columns of the matrix.
    pub cols: usize,
    /// Columns per scale.
    pub group: usize,
    /// Scales, row-major `[rows, ceil(cols / group)]`, already rounded to their stored type.
    pub scales: Vec<f32>,
    /// Zero points (asymmetric integers only), one per scale.
    pub zeros: Option<Vec<i8>>,
}

impl Grid {
    /// Scales per group of `w` (`[rows, cols]`): `absmax / grid.divisor`, rounded to `scale_dtype`.
    pub fn symmetric(w: &[f32], cols: usize, group: usize, grid: IntGrid, scale_dtype: FloatDtype) -> Self {
        let scales = w.par_chunks(cols).flat_map_iter(|r| r.chunks(group).map(|g| scale_for(absmax(g), grid.divisor, scale_dtype))).collect();
        Grid { kind: CodeKind::Int(grid), cols, group, scales, zeros: None }
    }

    /// Asymmetric scales and zero points on `grid`'s range (compressed-tensors' min/max
    /// observer, range widened to include 0): `scale = (max − min) / (qmax − qmin)` (floored and
    /// rounded as for symmetric scales), `zp = clamp(round_half_even(−min / scale) + qmin, qmin, qmax)`.
    pub fn asymmetric(w: &[f32], cols: usize, group: usize, grid: IntGrid, scale_dtype: FloatDtype) -> Self {
        let (qmin, qmax) = (grid.qmin as f32, grid.qmax as f32);
        let (scales, zeros) = w
            .par_chunks(cols)
            .flat_map_iter(|r| {
                r.chunks(group).map(|g| {
                    let (lo, hi) = g.iter().fold((0f32, 0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                    let s = scale_for(hi - lo, qmax - qmin, scale_dtype);
                    (s, ((-lo / s).round_ties_even() + qmin).clamp(qmin, qmax) as i8)
                })
            })
            .unzip();
        Grid { kind: CodeKind::Int(grid), cols, group, scales, zeros: Some(zeros) }
    }

    /// FP8 E4M3 with one scale per row, `absmax / 448` rounded to `scale_dtype`.
    pub fn fp8_rows(w: &[f32], cols: usize, scale_dtype: FloatDtype) -> Self {
        let scales = w.par_chunks(cols).map(|r| scale_for(absmax(r), E4M3_MAX, scale_dtype)).collect();
        Grid { kind: CodeKind::Fp8, cols, group: cols, scales, zeros: None }
    }

    /// Quark's W4A8 `ProgressiveSpec` (FP8 per-tensor, then INT4 per output channel), f32
    /// scales (Quark's `scale_type`): stage 0 `s_fp8 = absmax(W) / 448` and
    /// `V = e4m3(W / s_fp8)`; stage 1 per row `s_int4 = absmax_row(V) / 7.5`.
    pub fn progressive(w: &[f32], cols: usize) -> Self {
        let fp8_scale = scale_for(absmax(w), E4M3_MAX, FloatDtype::F32);
        let scales = w
            .par_chunks(cols)
            .map(|r| scale_for(r.iter().fold(0f32, |m, &x| m.max(fp8_round(x / fp8_scale).abs())), INT4.divisor, FloatDtype::F32))
            .collect();
        Grid { kind: CodeKind::Progressive { fp8_scale }, cols, group: cols, scales, zeros: None }
    }

    /// Scales per row.
    pub fn per_row(&self) -> usize {
        self.cols.div_ceil(self.group)
    }

    /// The scale index of column `col` of row `row`.
    pub fn index(&self, row: usize, col: usize) -> usize {
        row * self.per_row() + col / self.group
    }

    /// The code of `x` under scale `k`: `clamp(round_half_even(x / scale) + zp, qmin, qmax)`
    /// for integers (as an `i8` byte), `e4m3(x / scale)` for FP8, and for the progressive
    /// scheme the int4 of `e4m3(x / s_fp8)` on the row's scale.
    pub fn code(&self, k: usize, x: f32) -> u8 {
        let s = self.scales[k];
        match self.kind {
            CodeKind::Int(grid) => {
                let zp = self.zeros.as_ref().map_or(0.0, |z| f32::from(z[k]));
                ((x / s).round_ties_even() + zp).clamp(grid.qmin as f32, grid.qmax as f32) as i8 as u8
            }
            CodeKind::Fp8 => f32_to_e4m3(x / s),
            CodeKind::Progressive { fp8_scale } => quantize_int(fp8_round(x / fp8_scale), s, INT4) as u8,
        }
    }

    /// The value `code` stands for under scale `k`, computed as the loaders compute it.
    pub fn value(&self, k: usize, code: u8) -> f32 {
        let s = self.scales[k];
        match self.kind {
            CodeKind::Int(_) => (f32::from(code as i8) - self.zeros.as_ref().map_or(0.0, |z| f32::from(z[k]))) * s,
            CodeKind::Fp8 => e4m3_to_f32(code) * s,
            CodeKind::Progressive { fp8_scale } => f32::from(code as i8) * s * fp8_scale,
        }
    }

    /// Every value of `w` rounded to its nearest code.
    pub fn round(&self, w: &[f32]) -> Vec<u8> {
        let mut q = vec![0u8; w.len()];
        q.par_chunks_mut(self.cols).zip(w.par_chunks(self.cols)).enumerate().for_each(|(r, (qr, wr))| {
            for (c, (qv, &x)) in qr.iter_mut().zip(wr).enumerate() {
                *qv = self.code(self.index(r, c), x);
            }
        });
        q
    }
}

/// `x` rounded to the nearest E4M3 value (saturating at ±448).
fn fp8_round(x: f32) -> f32 {
    e4m3_to_f32(f32_to_e4m3(x))
}

/// Integer codes (`i8` bytes) as `i8`.
pub fn int_codes(codes: &[u8]) -> Vec<i8> {
    codes.iter().map(|&c| c as i8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_group_extremes_and_bf16_scale() {
        // absmax 3.0 -> scale 0.4 (bf16 0.400390625): -3.0 -> -7.49 -> -7, 3.0 -> 7 after clamp.
        let w = [-3.0, 3.0, 0.2, -0.2, 0.0, 1.0, -1.0, 0.5];
        let sym = |w: &[f32], cols, dtype| {
            let g = Grid::symmetric(w, cols, cols, INT4, dtype);
            (int_codes(&g.round(w)), g.scales)
        };
        let (q, s) = sym(&w, 8, FloatDtype::BF16);
        assert_eq!(s, vec![half::bf16::from_f32(0.4).to_f32()]);
        assert_eq!(q, vec![-7, 7, 0, 0, 0, 2, -2, 1]);
        // The negative extreme reaches -8 when the scale is exact.
        assert_eq!(sym(&[-7.5, 1.0], 2, FloatDtype::F32), (vec![-8, 1], vec![1.0]));
        // An all-zero group: scale EPSILON, zeros.
        assert_eq!(sym(&[0.0; 4], 4, FloatDtype::BF16), (vec![0; 4], vec![f32::EPSILON]));
    }

    #[test]
    fn int4_asym_zero_point_and_range() {
        // min -1, max 2: scale 3/15 = 0.2, zp = round(5) - 8 = -3; 2.0 -> 10 - 3 = 7, -1.0 -> -8.
        let asym = |w: &[f32], cols| {
            let g = Grid::asymmetric(w, cols, cols, INT4, FloatDtype::F32);
            (int_codes(&g.round(w)), g.scales, g.zeros.unwrap())
        };
        let (q, s, z) = asym(&[-1.0, 2.0, 0.0, 0.4], 4);
        assert_eq!((s, z), (vec![0.2], vec![-3]));
        assert_eq!(q, vec![-8, 7, -3, -1]);
        // All positive: the range includes 0, so zp = -8; an all-zero group: scale EPSILON, zeros.
        assert_eq!(asym(&[1.0, 3.0, 0.0, 0.0], 2), (vec![-3, 7, -8, -8], vec![0.2, f32::EPSILON], vec![-8, -8]));
    }

    #[test]
    fn progressive_rows_use_fp8_units() {
        let w = [448.0, -224.0, 1.0, 0.0, 2.0, -1.0, 0.5, 0.25];
        let g = Grid::progressive(&w, 4);
        assert_eq!(g.kind, CodeKind::Progressive { fp8_scale: 1.0 });
        assert_eq!(g.scales, vec![448.0 / 7.5, 2.0 / 7.5]);
        assert_eq!(int_codes(&g.round(&w)), vec![7, -4, 0, 0, 7, -4, 2, 1]);
    }
}
