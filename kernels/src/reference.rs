//! Plain scalar reference implementations, used by tests and benchmarks to check the
//! optimized kernels. They favour obviousness over speed (f64 accumulation, no tiling).

use crate::attention::AttnShape;
use crate::ggml::{dequantize_row, GgmlType};

/// `y = x · Wᵀ` with W dequantized row by row and f64 accumulation.
pub fn linear(ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32], m: usize) -> Vec<f32> {
    let rb = w.len() / rows;
    let mut wf = vec![0f32; cols];
    let mut y = vec![0f32; m * rows];
    for r in 0..rows {
        dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut wf);
        for i in 0..m {
            let xs = &x[i * cols..(i + 1) * cols];
            y[i * rows + r] = xs.iter().zip(&wf).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
        }
    }
    y
}

/// Causal GQA attention with a full (non-streaming) softmax in f64, over dense `keys` and
/// `values` (`tokens × kv_width` each, token `j` at position `j`).
pub fn attention(shape: AttnShape, q: &[f32], m: usize, pos0: usize, keys: &[f32], values: &[f32]) -> Vec<f32> {
    let (hd, qw, kw) = (shape.head_dim, shape.q_width(), shape.kv_width());
    let group = shape.n_heads / shape.n_kv_heads;
    let keys: Vec<(usize, &[f32], &[f32])> =
        keys.chunks_exact(kw).zip(values.chunks_exact(kw)).enumerate().map(|(j, (k, v))| (j, k, v)).collect();
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0f32; m * qw];
    for i in 0..m {
        for h in 0..shape.n_heads {
            let kvh = h / group;
            let qh = &q[i * qw + h * hd..i * qw + (h + 1) * hd];
            let vis: Vec<_> = keys.iter().filter(|(p, _, _)| *p <= pos0 + i).collect();
            let scores: Vec<f64> = vis
                .iter()
                .map(|(_, k, _)| {
                    qh.iter().zip(&k[kvh * hd..(kvh + 1) * hd]).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let ws: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let total: f64 = ws.iter().sum();
            for d in 0..hd {
                let v: f64 = vis.iter().zip(&ws).map(|((_, _, v), w)| w * v[kvh * hd + d] as f64).sum();
                out[i * qw + h * hd + d] = if total > 0.0 { (v / total) as f32 } else { 0.0 };
            }
        }
    }
    out
}
