//! The histogram gate: reconstruction error of every quantized tensor, measured between the
//! input weights `W` (after SmoothQuant's rewrite, when it runs) and `Ŵ` decoded from the
//! bytes actually written.
//!
//! Per tensor: RMSE, MAE, max |W − Ŵ|, relative error `‖W − Ŵ‖₂ / ‖W‖₂`, zero collapse (weights
//! that are nonzero in `W` and exactly 0 in `Ŵ`), and spiky blocks. A **block** is a run of
//! weights sharing the finest scale: one group of `group_size` columns of a row for grouped
//! int4, one row for per-channel schemes (int8, FP8, and Quark W4A8, whose finest scale is the
//! per-row INT4 one). A block is **spiky** when its largest magnitude exceeds 8× the RMS of the
//! block's other weights (in `W`): one outlier then sets the scale and flattens the rest of the
//! block. (Measured against the others, not the whole block's RMS, because a block of `n` values
//! can never have absmax above `√n` × its own RMS: no 64-wide group could qualify.)

use serde::Serialize;
use std::fmt::Write;

/// A block is spiky when `absmax > SPIKE_RATIO × rms(other weights of the block)`.
pub const SPIKE_RATIO: f64 = 8.0;

/// Reconstruction statistics of one quantized tensor.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TensorStats {
    /// Tensor name in the input checkpoint.
    pub name: String,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// Root mean square error.
    pub rmse: f64,
    /// Mean absolute error.
    pub mae: f64,
    /// Largest absolute error.
    pub max_abs_err: f64,
    /// `‖W − Ŵ‖₂ / ‖W‖₂` (0 for an all-zero `W`).
    pub rel_err: f64,
    /// Nonzero weights that dequantize to exactly 0.
    pub zero_collapse: u64,
    /// Blocks whose absmax exceeds [`SPIKE_RATIO`] times the RMS of their other weights.
    pub spiky_blocks: u64,
    /// Blocks in the tensor.
    pub blocks: u64,
    /// Sum of squared errors (for totals).
    pub sq_err: f64,
    /// Sum of squared weights (for totals).
    pub sq_norm: f64,
}

impl TensorStats {
    /// Measures `w_hat` against `w` (`[rows, cols]`), with blocks of `block_cols` columns
    /// within each row (the last block of a row may be shorter).
    pub fn measure(name: &str, w: &[f32], w_hat: &[f32], cols: usize, block_cols: usize) -> Self {
        let (mut sq_err, mut abs_err, mut max_abs_err, mut sq_norm, mut zero_collapse) = (0f64, 0f64, 0f64, 0f64, 0u64);
        for (&a, &b) in w.iter().zip(w_hat) {
            let e = (a as f64 - b as f64).abs();
            sq_err += e * e;
            abs_err += e;
            max_abs_err = max_abs_err.max(e);
            sq_norm += a as f64 * a as f64;
            zero_collapse += u64::from(a != 0.0 && b == 0.0);
        }
        let mut spiky_blocks = 0u64;
        let mut blocks = 0u64;
        for block in w.chunks(cols.max(1)).flat_map(|row| row.chunks(block_cols.max(1))) {
            let sq = block.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
            let amax = block.iter().fold(0f64, |m, &x| m.max((x as f64).abs()));
            let rest_rms = ((sq - amax * amax).max(0.0) / (block.len() - 1).max(1) as f64).sqrt();
            spiky_blocks += u64::from(block.len() > 1 && amax > SPIKE_RATIO * rest_rms);
            blocks += 1;
        }
        let n = w.len().max(1) as f64;
        TensorStats {
            name: name.to_string(),
            shape: [w.len() / cols.max(1), cols],
            rmse: (sq_err / n).sqrt(),
            mae: abs_err / n,
            max_abs_err,
            rel_err: if sq_norm > 0.0 { (sq_err / sq_norm).sqrt() } else { 0.0 },
            zero_collapse,
            spiky_blocks,
            blocks,
            sq_err,
            sq_norm,
        }
    }
}

/// Totals over every quantized tensor.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Totals {
    /// Quantized tensors.
    pub tensors: usize,
    /// Quantized weights.
    pub weights: u64,
    /// RMSE over all quantized weights together.
    pub rmse: f64,
    /// `‖W − Ŵ‖ / ‖W‖` over all quantized weights together.
    pub rel_err: f64,
    /// Largest absolute error of any weight.
    pub max_abs_err: f64,
    /// Total zero collapse.
    pub zero_collapse: u64,
    /// Total spiky blocks.
    pub spiky_blocks: u64,
    /// Total blocks.
    pub blocks: u64,
}

/// The report of one quantization run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Scheme name (`w4a16`, …).
    pub scheme: String,
    /// Output format (`compressed-tensors`, `quark`).
    pub format: String,
    /// Definition of a spiky block, for readers of the file.
    pub spiky_block_rule: String,
    /// Totals.
    pub totals: Totals,
    /// Per-tensor statistics, in the order written.
    pub tensors: Vec<TensorStats>,
}

impl Report {
    /// A report over `tensors`.
    pub fn new(scheme: &str, format: &str, tensors: Vec<TensorStats>) -> Self {
        let weights: u64 = tensors.iter().map(|t| (t.shape[0] * t.shape[1]) as u64).sum();
        let sq_err: f64 = tensors.iter().map(|t| t.sq_err).sum();
        let sq_norm: f64 = tensors.iter().map(|t| t.sq_norm).sum();
        let totals = Totals {
            tensors: tensors.len(),
            weights,
            rmse: (sq_err / weights.max(1) as f64).sqrt(),
            rel_err: if sq_norm > 0.0 { (sq_err / sq_norm).sqrt() } else { 0.0 },
            max_abs_err: tensors.iter().fold(0f64, |m, t| m.max(t.max_abs_err)),
            zero_collapse: tensors.iter().map(|t| t.zero_collapse).sum(),
            spiky_blocks: tensors.iter().map(|t| t.spiky_blocks).sum(),
            blocks: tensors.iter().map(|t| t.blocks).sum(),
        };
        Report {
            scheme: scheme.into(),
            format: format.into(),
            spiky_block_rule: format!(
                "absmax > {SPIKE_RATIO} x rms of the other weights sharing its scale (a group, or a row for per-channel scales)"
            ),
            totals,
            tensors,
        }
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// A human summary: totals and the `worst` tensors by relative error.
    pub fn summary(&self, worst: usize) -> String {
        let t = &self.totals;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} / {}: {} tensors, {} weights: rmse {:.3e}  rel {:.4}  max|err| {:.3e}  zero-collapse {} ({:.3}%)  spiky blocks {}/{}",
            self.scheme,
            self.format,
            t.tensors,
            t.weights,
            t.rmse,
            t.rel_err,
            t.max_abs_err,
            t.zero_collapse,
            100.0 * t.zero_collapse as f64 / t.weights.max(1) as f64,
            t.spiky_blocks,
            t.blocks
        );
        let mut order: Vec<&TensorStats> = self.tensors.iter().collect();
        order.sort_by(|a, b| b.rel_err.total_cmp(&a.rel_err));
        for x in order.into_iter().take(worst) {
            let _ = writeln!(
                s,
                "  {:<48} rel {:.4}  rmse {:.3e}  max|err| {:.3e}  zero-collapse {}  spiky {}/{}",
                x.name, x.rel_err, x.rmse, x.max_abs_err, x.zero_collapse, x.spiky_blocks, x.blocks
            );
        }
        s
    }
}
