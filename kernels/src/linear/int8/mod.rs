//! Int8 weight matrices (W8A8 int8): symmetric per-output-channel scales, row-major values.

pub mod cuda;

use crate::cpu::GemmLevel;
use crate::cpu::Isa;
use crate::cuda::device::CudaDevice;
use crate::linear::cuda::{DeviceWeight, QuantPlanes};
use crate::cuda::CudaError;
use crate::linear::rowwise::{Prepared, RowKernel};
use crate::linear::{ActQuant, Int8Rows};
use std::ops::Range;

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
        if !cols.is_multiple_of(32) {
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

    /// Rows `rows` and input columns `cols` of this matrix (see [`crate::linear::WeightMatrix::slice`]).
    pub fn slice(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Result<Self, String> {
        let q = rows.clone().flat_map(|r| &self.row(r)[cols.clone()]).copied().collect();
        Int8Matrix::new(rows.len(), cols.len(), q, self.scales[rows].to_vec())
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
}

impl Int8Rows for Int8Matrix {
    /// Scalar W8A8: `out[(r - r0) * m + i] = xs[i] · s[r] · Σ q · xq` (int32 sum).
    fn rows_int8_scalar(&self, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        let k = self.cols;
        for r in r0..r1 {
            let w = self.row(r);
            for i in 0..m {
                let sum: i32 = w.iter().zip(&xq[i * k..(i + 1) * k]).map(|(&a, &b)| a as i32 * b as i32).sum();
                out[(r - r0) * m + i] = xs[i] * (self.scales[r] * sum as f32);
            }
        }
    }

    /// Activations holding -128 (never produced by [`super::act::quantize_int8_row`]) take the
    /// scalar kernel: the sign trick would negate them.
    fn simd_accepts(&self, xq: &[i8]) -> bool {
        !xq.contains(&i8::MIN)
    }

    /// Sign trick, `maddubs` with AVX2 or `vpdpbusd` with AVX-512 VNNI, int32 sums, the scalar
    /// epilogue.
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_int8_simd<const VNNI: bool>(&self, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        // SAFETY: forwarded contract (no -128 in xq: simd_accepts).
        unsafe { crate::linear::int_dot_avx2::int8_int8::<VNNI>(self, r0, r1, xq, xs, m, out) }
    }
}

impl RowKernel for Int8Matrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        Int8Matrix::bytes(self)
    }

    fn storage(&self) -> String {
        "int8 channel".into()
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        Int8Matrix::dequantize_row(self, r, out)
    }

    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Self, String> {
        Int8Matrix::slice(self, rows, cols)
    }

    fn accepts(&self, act: ActQuant) -> bool {
        act == ActQuant::Int8PerToken
    }

    fn row_range(&self, isa: Isa, act: &Prepared<'_>, r0: usize, r1: usize, m: usize, tile: &mut [f32]) {
        let Prepared::Int8 { q, scales } = act else { unreachable!("int8 takes int8 activations (checked by accepts)") };
        self.rows_int8(isa, r0, r1, q, scales, m, tile)
    }

    fn kernel_id(&self, _act: ActQuant, isa: Isa) -> String {
        format!("cpu.w8a8.int8xint8.{}", GemmLevel::for_isa(isa).name())
    }

    fn upload(&self, dev: &CudaDevice, act: ActQuant) -> Result<DeviceWeight, CudaError> {
        if act != ActQuant::Int8PerToken {
            return Err(CudaError::Shape(format!("no CUDA kernel for {} weights with {} activations", RowKernel::storage(self), act.name())));
        }
        DeviceWeight::from_planes(
            dev,
            QuantPlanes {
                format: Box::new(cuda::Int8Cuda),
                storage: RowKernel::storage(self),
                rows: self.rows,
                cols: self.cols,
                codes: (0..self.rows).flat_map(|r| self.row(r).iter().map(|&v| v as u8)).collect(),
                block_scales: None,
                scales: (0..self.rows).map(|r| self.scale(r)).collect(),
                zeros: None,
            },
        )
    }
}
