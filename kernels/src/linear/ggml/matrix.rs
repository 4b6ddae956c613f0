//! The GGML format as a [`WeightMatrix`] ([`GgmlMatrix`]: rows as a GGUF or float tensor
//! stores them) and its op ([`GgmlLinear`]: the rows as stored, or regrouped for the integer
//! GEMM when the kernel's small path is that GEMM).

use super::interleaved::Interleaved;
use super::{forward_group, LinearKernel, Weight, WeightView};
use crate::cpu::caps::CpuCaps;
use crate::cuda::device::CudaDevice;
use crate::linear::cuda::DeviceWeight;
use crate::cuda::CudaError;
use crate::ggml::{dequantize_row, GgmlType};
use crate::linear::{downcast_group, ActQuant, LinearOp, LinearPolicy, OpPlan, WeightMatrix};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// A weight's bytes, owned or mapped from a checkpoint file.
pub trait WeightBytes: Send + Sync + fmt::Debug {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes `range`, sharing the storage where it can.
    fn slice(&self, range: Range<usize>) -> Arc<dyn WeightBytes>;
    /// Hands the pages of mapped bytes back to the OS once a kernel has copied them (they
    /// are read back from the file if touched again); nothing for owned bytes.
    fn release_pages(&self) {}
}

impl WeightBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }

    fn slice(&self, range: Range<usize>) -> Arc<dyn WeightBytes> {
        Arc::new(self[range].to_vec())
    }
}

/// `rows × cols` weights of one GGML type, row-major in GGML blocks.
#[derive(Clone, Debug)]
pub struct GgmlMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    data: Arc<dyn WeightBytes>,
}

impl GgmlMatrix {
    /// Checks that `data` holds `rows` rows of `cols` values of type `ty`.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Arc<dyn WeightBytes>) -> Result<Self, String> {
        WeightView::new(ty, rows, cols, data.bytes())?;
        Ok(GgmlMatrix { ty, rows, cols, data })
    }

    /// Storage type of every row.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// The rows as a kernel reads them.
    pub fn view(&self) -> WeightView<'_> {
        WeightView { ty: self.ty, rows: self.rows, cols: self.cols, data: self.data.bytes() }
    }
}

impl WeightMatrix for GgmlMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        self.data.bytes().len()
    }

    fn storage(&self) -> String {
        self.ty.name().to_string()
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.view().row(r), out)
    }

    fn col_align(&self) -> usize {
        self.ty.block_size()
    }

    /// Whole rows share the bytes (a mapped file stays mapped); a column cut copies whole
    /// blocks, and for types the integer GEMM regroups (which never read the stored rows
    /// again) releases the source's pages.
    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Arc<dyn WeightMatrix>, String> {
        let rb = self.data.bytes().len() / self.rows.max(1);
        let data = if cols == (0..self.cols) {
            if rows.start >= rows.end || rows.end > self.rows {
                return Err(format!("shard rows {rows:?} outside a {}x{} {} matrix", self.rows, self.cols, self.ty));
            }
            self.data.slice(rows.start * rb..rows.end * rb)
        } else {
            let copied = self.ty.slice_matrix(self.cols, self.data.bytes(), rows.clone(), cols.clone())?;
            if Interleaved::supports(self.ty) {
                self.data.release_pages();
            }
            Arc::new(copied)
        };
        Ok(Arc::new(GgmlMatrix::new(self.ty, rows.len(), cols.len(), data)?))
    }

    /// GGML layers take f32 activations from the model; the kernel (and whether it quantizes
    /// them to Q8 blocks) follows the type, the CPU and `policy`.
    fn op(self: Arc<Self>, _act: ActQuant, perm: Option<Vec<u32>>, caps: &CpuCaps, policy: LinearPolicy) -> Result<Box<dyn LinearOp>, String> {
        if perm.is_some() {
            return Err(format!("{} weights take no input permutation", self.ty));
        }
        let kernel = LinearKernel::select(self.ty, caps, policy);
        let w = if kernel.wants_interleaved() {
            let packed = Interleaved::pack(&self.view())?;
            self.data.release_pages();
            GgmlWeights::Interleaved(packed)
        } else {
            GgmlWeights::Rows(self)
        };
        Ok(Box::new(GgmlLinear { w, kernel }))
    }

    fn upload(&self, dev: &CudaDevice, _act: ActQuant) -> Result<DeviceWeight, CudaError> {
        DeviceWeight::from_ggml(dev, self.ty, self.rows, self.cols, self.data.bytes())
    }
}

/// A GGML weight with its two-path kernel.
#[derive(Debug)]
pub struct GgmlLinear {
    w: GgmlWeights,
    kernel: LinearKernel,
}

/// The weights in the layout the kernel's small path reads.
#[derive(Debug)]
enum GgmlWeights {
    /// As stored (floats: the dequantizing dot).
    Rows(Arc<GgmlMatrix>),
    /// Regrouped eight rows at a time for the integer GEMM (the stored rows are not kept).
    Interleaved(Interleaved),
}

impl GgmlLinear {
    fn weight(&self) -> Weight<'_> {
        match &self.w {
            GgmlWeights::Rows(m) => Weight::Rows(m.view()),
            GgmlWeights::Interleaved(w) => Weight::Interleaved(w),
        }
    }
}

impl LinearOp for GgmlLinear {
    fn rows(&self) -> usize {
        self.weight().rows()
    }

    fn cols(&self) -> usize {
        self.weight().cols()
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        self.weight().dequantize_row(r, out)
    }

    fn plan(&self) -> OpPlan {
        OpPlan { storage: self.weight().ty().name().to_string(), activations: self.kernel.activations(), kernel: self.kernel.id(), note: None }
    }

    fn forward_group(&self, group: &[(&dyn LinearOp, usize)], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        let ops = downcast_group::<GgmlLinear>(group);
        let parts: Vec<_> = ops.iter().map(|&(op, col)| (&op.kernel, op.weight(), col)).collect();
        forward_group(&parts, x, segments, y, ldy);
    }

    fn release_pages(&self) {
        if let GgmlWeights::Rows(m) = &self.w {
            m.data.release_pages();
        }
    }
}
