//! Int8 weight matrices (W8A8 int8): symmetric per-output-channel scales, row-major values.

/// An int8 matrix: `W[r, c] = q[r, c] * s[r]`.
#[derive(Clone, Debug)]
pub struct Int8Matrix {
    rows: usize,
    cols: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
}

impl Int8Matrix {
    /// `q` is `rows × cols` row-major (the full -128..=127; activations stay in -127..=127, so
    /// `|w| · |x| <= 128 · 127` and pairwise 16-bit sums cannot saturate); `scales` has one
    /// entry per row.
    pub fn new(rows: usize, cols: usize, q: Vec<i8>, scales: Vec<f32>) -> Result<Self, String> {
        if cols % 32 != 0 {
            return Err(format!("int8 kernels need cols divisible by 32 (cols {cols})"));
        }
        if q.len() != rows * cols {
            return Err(format!("{} values for {rows}x{cols}", q.len()));
        }
        if scales.len() != rows {
            return Err(format!("{} scales for {rows} rows", scales.len()));
        }
        if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
            return Err(format!("non-finite scale {bad}"));
        }
        Ok(Int8Matrix { rows, cols, q, scales })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scales.len()
    }

    /// Values of row `r`.
    pub fn row(&self, r: usize) -> &[i8] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }

    /// Scale of row `r`.
    pub fn scale(&self, r: usize) -> f32 {
        self.scales[r]
    }

    /// Dequantizes row `r`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let s = self.scales[r];
        for (o, &v) in out.iter_mut().zip(self.row(r)) {
            *o = v as f32 * s;
        }
    }

    /// Scalar W8A8: `out[(r - r0) * m + i] = xs[i] · s[r] · Σ q · xq` (int32 sum).
    pub fn rows_int8_scalar(&self, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        let k = self.cols;
        for r in r0..r1 {
            let w = self.row(r);
            for i in 0..m {
                let sum: i32 = w.iter().zip(&xq[i * k..(i + 1) * k]).map(|(&a, &b)| a as i32 * b as i32).sum();
                out[(r - r0) * m + i] = xs[i] * (self.scales[r] * sum as f32);
            }
        }
    }

    /// `rows_int8_scalar` on the given ISA (SIMD versions land per ISA; scalar until then).
    pub fn rows_int8(&self, isa: crate::cpu::Isa, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        let _ = isa;
        self.rows_int8_scalar(r0, r1, xq, xs, m, out)
    }
}
