//! A linear layer: a weight matrix in its storage type plus the kernel chosen for it.

use crate::checkpoint::{LoadError, TensorBytes, TensorEntry};
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::{forward_group, LinearKernel, LinearPolicy, WeightView};

/// One row of the per-layer plan: what a weight is stored as and which kernel runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanEntry {
    /// Canonical tensor name.
    pub tensor: String,
    /// Storage type.
    pub storage: GgmlType,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// Kernel id.
    pub kernel: String,
}

/// `y = x · Wᵀ` for one weight matrix.
#[derive(Debug)]
pub struct Linear {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: TensorBytes,
    kernel: LinearKernel,
}

impl Linear {
    /// Builds a linear layer from a checkpoint tensor, checking it is `[rows, cols]`.
    pub fn new(
        name: &str,
        t: &TensorEntry,
        rows: usize,
        cols: usize,
        caps: &CpuCaps,
        policy: LinearPolicy,
    ) -> Result<Self, LoadError> {
        if t.shape != [rows, cols] {
            return Err(LoadError::Tensor {
                name: t.source_name.clone(),
                msg: format!("shape {:?}, expected [{rows}, {cols}]", t.shape),
            });
        }
        WeightView::new(t.ty, rows, cols, t.data.bytes())
            .map_err(|msg| LoadError::Tensor { name: t.source_name.clone(), msg })?;
        Ok(Linear {
            name: name.to_string(),
            ty: t.ty,
            rows,
            cols,
            data: t.data.clone(),
            kernel: LinearKernel::select(t.ty, caps, policy),
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn view(&self) -> WeightView<'_> {
        WeightView { ty: self.ty, rows: self.rows, cols: self.cols, data: self.data.bytes() }
    }

    /// `y[i * ldy + j] = Σ_k x[i, k] W[j, k]` for the rows of `x`, which belong to sequences
    /// of `segments` tokens (each segment picks its kernel path by its own length).
    pub fn forward(&self, x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        Self::forward_fused(&[self], x, segments, y, ldy);
    }

    /// Several layers reading the same input, writing side by side (`[a | b | c]` per row of
    /// `y`, row stride `ldy`): one activation quantization and one parallel region.
    pub fn forward_fused(layers: &[&Linear], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        let mut col = 0;
        let parts: Vec<_> = layers
            .iter()
            .map(|l| {
                let p = (&l.kernel, l.view(), col);
                col += l.rows;
                p
            })
            .collect();
        forward_group(&parts, x, segments, y, ldy);
    }

    /// This layer's plan entry.
    pub fn plan(&self) -> PlanEntry {
        PlanEntry { tensor: self.name.clone(), storage: self.ty, shape: [self.rows, self.cols], kernel: self.kernel.id() }
    }
}
