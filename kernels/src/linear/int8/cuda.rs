//! The int8 format on the GPU: its kernel source (`linear_int8.cu`: W8A8 int8 matmul) and its
//! [`CudaFormat`] ([`Int8Cuda`]).

use crate::cuda::device::CudaDevice;
use crate::cuda::source::KernelSource;
use crate::cuda::CudaError;
use crate::linear::cuda::{launch_quant_matmul, Activations, CudaAct, CudaFormat, DevicePlanes, Dims, QuantPlanes};
use cudarc::driver::{CudaViewMut, LaunchConfig};

/// Matmul over int8 weights with per-token int8 activations (W8A8 int8).
pub const LINEAR_INT8: KernelSource = KernelSource {
    name: "linear_int8.cu",
    code: concat!(
        "#line 1 \"linear/matmul.cuh\"\n",
        include_str!("../matmul.cuh"),
        "#line 1 \"linear_int8.cu\"\n",
        include_str!("linear_int8.cu")
    ),
    variants: &[&[]],
    entries: &["quant_matmul"],
    needs_sm90a: false,
};

/// Int8 weights' CUDA kernel: row-major int8 values, one f32 scale per row, per-token int8
/// activations, exact int32 dp4a sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Int8Cuda;

impl CudaFormat for Int8Cuda {
    fn source(&self) -> &'static KernelSource {
        &LINEAR_INT8
    }

    fn kernel_id(&self) -> String {
        "cuda.w8a8.int8xint8.dp4a".into()
    }

    fn activations(&self) -> CudaAct {
        CudaAct::Int8PerToken
    }

    /// Codes `rows · cols` bytes, one scale per row, no zero points.
    fn check(&self, p: &QuantPlanes) -> Result<(), CudaError> {
        p.expect_lens(p.rows * p.cols, None, p.rows, None)
    }

    /// `quant_matmul` with one group spanning the row.
    fn launch_matmul(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        x: Activations<'_>,
        y: &mut CudaViewMut<'_, f32>,
        dims: Dims,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        launch_quant_matmul(dev, self, w, x, y, dims, dims.k as usize, 1, cfg)
    }
}
