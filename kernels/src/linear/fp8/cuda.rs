//! The FP8 format on the GPU: its kernel source (`linear_fp8.cu`: W8A8 FP8 matmul) and its
//! [`CudaFormat`] ([`Fp8Cuda`]).

use crate::cuda::device::CudaDevice;
use crate::cuda::source::KernelSource;
use crate::cuda::CudaError;
use crate::linear::cuda::{launch_quant_matmul, shape, Activations, CudaAct, CudaFormat, DevicePlanes, Dims, QuantPlanes};
use cudarc::driver::{CudaViewMut, LaunchConfig};

/// Matmul over E4M3 weights with per-token, per-column-block E4M3 activations (W8A8 FP8).
pub const LINEAR_FP8: KernelSource = KernelSource {
    name: "linear_fp8.cu",
    code: concat!(
        "#line 1 \"linear/matmul.cuh\"\n",
        include_str!("../matmul.cuh"),
        "#line 1 \"linear_fp8.cu\"\n",
        include_str!("linear_fp8.cu")
    ),
    variants: &[&[]],
    entries: &["quant_matmul"],
    needs_sm90a: false,
};

/// FP8 weights' CUDA kernel: E4M3 values with f32 scales per `[bh, bw]` block, E4M3
/// activations per token and `bw` columns, f32 sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Cuda {
    /// Scale block height (clamped to the matrix's rows).
    pub bh: usize,
    /// Scale block width, also the activations' scale group (clamped to the matrix's columns).
    pub bw: usize,
}

impl CudaFormat for Fp8Cuda {
    fn source(&self) -> &'static KernelSource {
        &LINEAR_FP8
    }

    fn kernel_id(&self) -> String {
        "cuda.w8a8.fp8xfp8".into()
    }

    fn activations(&self) -> CudaAct {
        CudaAct::Fp8PerBlock { bw: self.bw }
    }

    /// Codes `rows · cols` bytes, scales `ceil(rows / bh) · ceil(cols / bw)`, nonzero block sizes.
    fn check(&self, p: &QuantPlanes) -> Result<(), CudaError> {
        let (bh, bw) = (self.bh, self.bw);
        if bh == 0 || bw == 0 {
            return Err(shape(format!("fp8 planes: a {bh}x{bw} scale block")));
        }
        p.expect_lens(p.rows * p.cols, None, p.rows.div_ceil(bh) * p.cols.div_ceil(bw), None)
    }

    /// `quant_matmul` with `bw` as the group and `bh` the block height.
    fn launch_matmul(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        x: Activations<'_>,
        y: &mut CudaViewMut<'_, f32>,
        dims: Dims,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        launch_quant_matmul(dev, self, w, x, y, dims, self.bw, self.bh, cfg)
    }
}
