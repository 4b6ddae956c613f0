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
//!   (asymmetric: `+ zp` before the clamp, see [`Grid::asymmetric`]);
//! - FP8 values are `e4m3(w / scale)`, rounded to nearest even and saturating at ±448.

use crate::float_dtype::FloatDtype;
use rayon::prelude::*;
use tessera_kernels::e4m3::{e4m3_to_f32, f32_to_e4m3, E4M3_MAX};

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

/// Raises `acc[j]` to `max |x_j|` over the rows of `x` (row-major, `acc.len()` wide).
pub fn column_absmax_into(acc: &mut [f32], x: &[f32]) {
    for row in x.chunks_exact(acc.len()) {
        acc.iter_mut().zip(row).for_each(|(m, v)| *m = m.max(v.abs()));
    }
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
    /// The type scales are stored in (and rounded to).
    pub scale_dtype: FloatDtype,
}

/// Ratios by which [`Grid::search_clipping`] shrinks a group's range: 1, 0.975, …, 0.5.
const CLIP_RATIOS: usize = 21;

/// The range `[lo, hi]` of a group, widened to include 0.
fn range(g: &[f32]) -> (f32, f32) {
    g.iter().fold((0f32, 0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

impl Grid {
    /// Scales per group of `w` (`[rows, cols]`): `absmax / grid.divisor`, rounded to `scale_dtype`.
    pub fn symmetric(w: &[f32], cols: usize, group: usize, grid: IntGrid, scale_dtype: FloatDtype) -> Self {
        Self::from_ranges(CodeKind::Int(grid), false, w, cols, group, scale_dtype)
    }

    /// Asymmetric scales and zero points on `grid`'s range (compressed-tensors' min/max
    /// observer, range widened to include 0): `scale = (max − min) / (qmax − qmin)` (floored and
    /// rounded as for symmetric scales), `zp = clamp(round_half_even(−min / scale) + qmin, qmin, qmax)`.
    pub fn asymmetric(w: &[f32], cols: usize, group: usize, grid: IntGrid, scale_dtype: FloatDtype) -> Self {
        Self::from_ranges(CodeKind::Int(grid), true, w, cols, group, scale_dtype)
    }

    /// FP8 E4M3 with one scale per row, `absmax / 448` rounded to `scale_dtype`.
    pub fn fp8_rows(w: &[f32], cols: usize, scale_dtype: FloatDtype) -> Self {
        Self::from_ranges(CodeKind::Fp8, false, w, cols, cols, scale_dtype)
    }

    /// Quark's W4A8 `ProgressiveSpec` (FP8 per-tensor, then INT4 per output channel), f32
    /// scales (Quark's `scale_type`): stage 0 `s_fp8 = absmax(W) / 448` and
    /// `V = e4m3(W / s_fp8)`; stage 1 per row `s_int4 = absmax_row(V) / 7.5`.
    pub fn progressive(w: &[f32], cols: usize) -> Self {
        let fp8_scale = scale_for(absmax(w), E4M3_MAX, FloatDtype::F32);
        Self::from_ranges(CodeKind::Progressive { fp8_scale }, false, w, cols, cols, FloatDtype::F32)
    }

    /// One scale (and zero point) per group from the group's range ([`Self::params`]).
    fn from_ranges(kind: CodeKind, asymmetric: bool, w: &[f32], cols: usize, group: usize, scale_dtype: FloatDtype) -> Self {
        let mut grid = Grid { kind, cols, group, scale_dtype, scales: Vec::new(), zeros: None };
        let (scales, zeros): (Vec<f32>, Vec<i8>) = w.par_chunks(cols).flat_map_iter(|r| r.chunks(group).map(|g| grid.params(range(g), asymmetric))).unzip();
        grid.scales = scales;
        grid.zeros = asymmetric.then_some(zeros);
        grid
    }

    /// The scale and zero point of a group spanning `[lo, hi]` (`lo <= 0 <= hi`): the
    /// rules of the constructors above (a symmetric grid's zero point is 0).
    fn params(&self, (lo, hi): (f32, f32), asymmetric: bool) -> (f32, i8) {
        let absmax = hi.max(-lo);
        match self.kind {
            CodeKind::Int(grid) if asymmetric => {
                let (qmin, qmax) = (grid.qmin as f32, grid.qmax as f32);
                let s = scale_for(hi - lo, qmax - qmin, self.scale_dtype);
                (s, ((-lo / s).round_ties_even() + qmin).clamp(qmin, qmax) as i8)
            }
            CodeKind::Int(grid) => (scale_for(absmax, grid.divisor, self.scale_dtype), 0),
            CodeKind::Fp8 => (scale_for(absmax, E4M3_MAX, self.scale_dtype), 0),
            // The largest stage-0 value of the group, rounded to E4M3 as every value is.
            CodeKind::Progressive { fp8_scale } => (scale_for(fp8_round(absmax / fp8_scale), INT4.divisor, FloatDtype::F32), 0),
        }
    }

    /// Re-chooses every scale (and zero point) as an MSE observer does: the group's range is
    /// shrunk by each ratio 1, 0.975, …, 0.5 and the ratio whose grid gives the smallest
    /// `Σ_j importance_j · (w_j − ŵ_j)²` over the group is kept (`importance`: one weight per
    /// column, e.g. the inputs' mean square; `None`: all 1). Clipping a few large weights can
    /// buy a finer step for all the others.
    pub fn search_clipping(&mut self, w: &[f32], importance: Option<&[f32]>) {
        let (per_row, group, asymmetric) = (self.per_row(), self.group, self.zeros.is_some());
        let best: Vec<(f32, i8)> = w
            .par_chunks(self.cols)
            .enumerate()
            .flat_map_iter(|(r, row)| {
                let this = &*self;
                row.chunks(group).enumerate().map(move |(gi, g)| {
                    let k = r * per_row + gi;
                    let imp = |j: usize| importance.map_or(1.0, |v| v[gi * group + j]);
                    let (lo, hi) = range(g);
                    let mut trial = Grid { scales: vec![0.0], zeros: asymmetric.then(|| vec![0]), ..this.clone_empty() };
                    let mut best = (f64::INFINITY, this.scales[k], this.zeros.as_ref().map_or(0, |z| z[k]));
                    for i in 0..CLIP_RATIOS {
                        let ratio = 1.0 - 0.5 * i as f32 / (CLIP_RATIOS - 1) as f32;
                        let (s, z) = trial.params((lo * ratio, hi * ratio), asymmetric);
                        trial.scales[0] = s;
                        if let Some(zs) = &mut trial.zeros {
                            zs[0] = z;
                        }
                        let err: f64 = g.iter().enumerate().map(|(j, &x)| f64::from(imp(j)) * f64::from(x - trial.value(0, trial.code(0, x))).powi(2)).sum();
                        if err < best.0 {
                            best = (err, s, z);
                        }
                    }
                    (best.1, best.2)
                })
            })
            .collect();
        self.scales = best.iter().map(|b| b.0).collect();
        if let Some(z) = &mut self.zeros {
            *z = best.iter().map(|b| b.1).collect();
        }
    }

    /// This grid's kind and shape with no scales.
    fn clone_empty(&self) -> Grid {
        Grid { kind: self.kind, cols: self.cols, group: self.group, scale_dtype: self.scale_dtype, scales: Vec::new(), zeros: None }
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

    /// `Σ importance · (w − ŵ)²` of `w` rounded on `grid`.
    fn weighted_error(grid: &Grid, w: &[f32], importance: &[f32]) -> f64 {
        let codes = grid.round(w);
        (0..w.len()).map(|i| f64::from(importance[i % grid.cols]) * f64::from(w[i] - grid.value(grid.index(i / grid.cols, i % grid.cols), codes[i])).powi(2)).sum()
    }

    #[test]
    fn clipping_search_lowers_the_weighted_error() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (rows, cols) = (16, 96);
        // Heavy-tailed weights (Laplace): a few large values stretch min/max ranges.
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0f32..1.0).signum() * -(rng.gen_range(1e-6f32..1.0)).ln() * 0.02).collect();
        let uniform = vec![1.0; cols];
        let skewed: Vec<f32> = (0..cols).map(|c| if c % 5 == 0 { 30.0 } else { rng.gen_range(0.1..1.0) }).collect();
        let grids = [
            Grid::symmetric(&w, cols, 32, INT4, FloatDtype::BF16),
            Grid::asymmetric(&w, cols, 32, INT4, FloatDtype::F32),
            Grid::symmetric(&w, cols, cols, INT8, FloatDtype::F32),
            Grid::fp8_rows(&w, cols, FloatDtype::F32),
            Grid::progressive(&w, cols),
        ];
        for minmax in grids {
            for importance in [&uniform, &skewed] {
                let mut searched = minmax.clone();
                searched.search_clipping(&w, Some(importance));
                let (before, after) = (weighted_error(&minmax, &w, importance), weighted_error(&searched, &w, importance));
                // Ratio 1 is a candidate, so no group can get worse. Measured gains (after /
                // before, uniform then skewed importance): int4 g32 0.87 / 0.60, asymmetric
                // 0.95 / 0.76, int8 rows 1.00 / 0.94, FP8 0.94 / 0.79, progressive 0.84 / 0.60:
                // with skewed importance every grid must gain, and the int4 ones without it.
                assert!(after <= before, "{:?}: {after} > {before}", minmax.kind);
                let int4 = minmax.kind == CodeKind::Int(INT4) || matches!(minmax.kind, CodeKind::Progressive { .. });
                if std::ptr::eq(importance, &skewed) || int4 {
                    assert!(after < 0.97 * before, "{:?}: {after} vs {before}", minmax.kind);
                }
            }
            // Scales stay in their stored type.
            let mut searched = minmax.clone();
            searched.search_clipping(&w, None);
            assert!(searched.scales.iter().all(|&s| minmax.scale_dtype.round(s) == s));
        }
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
