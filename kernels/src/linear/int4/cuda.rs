//! The int4 format on the GPU: its kernel source (`linear_int4.cu`: W4A16 and W4A8 matmul,
//! dequantization for the large-batch SGEMM path) and its [`CudaFormat`] ([`Int4Cuda`]).

use crate::cuda::device::CudaDevice;
use crate::cuda::source::KernelSource;
use crate::cuda::CudaError;
use crate::linear::cuda::{launch_quant_matmul, shape, Activations, CudaAct, CudaFormat, DevicePlanes, Dims, QuantPlanes};
use cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};

/// Matmul over int4 weights (`INT4_ACT_INT8`: 0 W4A16, f32 activations; 1 W4A8, per-token int8).
pub const LINEAR_INT4: KernelSource = KernelSource {
    name: "linear_int4.cu",
    code: concat!(
        "#line 1 \"linear/matmul.cuh\"\n",
        include_str!("../matmul.cuh"),
        "#line 1 \"linear_int4.cu\"\n",
        include_str!("linear_int4.cu")
    ),
    variants: &[W4A16, W4A8],
    entries: &["quant_matmul"],
    needs_sm90a: false,
};

/// The W4A16 specialization (f32 activations; also holds `int4_dequant_rows`).
const W4A16: &[&str] = &["INT4_ACT_INT8=0"];
/// The W4A8 specialization (per-token int8 activations).
const W4A8: &[&str] = &["INT4_ACT_INT8=1"];

/// Int4 weights' CUDA kernels: packed runs of 32 columns, `group` columns per f32 scale (and
/// int8 zero point, if asymmetric), with f32 (W4A16) or per-token int8 (W4A8) activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Int4Cuda {
    /// Columns per scale (clamped to the matrix's columns).
    pub group: usize,
    /// Int8 activations per token (W4A8); f32 otherwise (W4A16).
    pub int8_act: bool,
}

impl CudaFormat for Int4Cuda {
    fn source(&self) -> &'static KernelSource {
        &LINEAR_INT4
    }

    fn defines(&self) -> &'static [&'static str] {
        if self.int8_act {
            W4A8
        } else {
            W4A16
        }
    }

    fn kernel_id(&self) -> String {
        if self.int8_act { "cuda.w4a8.int4xint8.dp4a" } else { "cuda.w4a16.int4xf32" }.into()
    }

    /// Four for W4A16 (each activation value read serves four rows); one for W4A8, whose
    /// activations are a quarter of the bytes and which needs every warp at batch 1.
    fn rows_per_warp(&self) -> usize {
        if self.int8_act {
            1
        } else {
            4
        }
    }

    fn activations(&self) -> CudaAct {
        if self.int8_act {
            CudaAct::Int8PerToken
        } else {
            CudaAct::F32
        }
    }

    fn dequantizes(&self) -> bool {
        !self.int8_act
    }

    /// Codes `rows · cols / 2` bytes, scales (and zero points, if any) `rows · ceil(cols / group)`;
    /// a nonzero group and whole 32-column runs.
    fn check(&self, p: &QuantPlanes) -> Result<(), CudaError> {
        let (rows, cols, group) = (p.rows, p.cols, self.group);
        if group == 0 || !cols.is_multiple_of(32) {
            return Err(shape(format!("int4 planes: group {group} over {cols} columns (need a group and whole 32-column runs)")));
        }
        let g = rows * cols.div_ceil(group);
        p.expect_lens(rows * cols / 2, None, g, p.zeros.as_ref().map(|_| g))
    }

    fn launch_matmul(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        x: Activations<'_>,
        y: &mut CudaViewMut<'_, f32>,
        dims: Dims,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError> {
        launch_quant_matmul(dev, self, w, x, y, dims, self.group, 1, cfg)
    }

    /// `int4_dequant_rows` (in the W4A16 specialization, whatever the weight's activations).
    fn launch_dequant(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        k: i32,
        out: &mut CudaViewMut<'_, f32>,
        chunks: i64,
        cfg: LaunchConfig,
    ) -> Option<Result<(), CudaError>> {
        let launch = || {
            let f = dev.function(&LINEAR_INT4, W4A16, "int4_dequant_rows")?;
            let scales = w.scales.as_ref().expect("quantized weights carry scales");
            let null = 0u64;
            let gi = crate::linear::cuda::int(self.group)?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&w.codes).arg(scales);
            match &w.zeros {
                Some(z) => b.arg(z),
                None => b.arg(&null),
            };
            b.arg(&k).arg(&gi).arg(out).arg(&chunks);
            // SAFETY: argument types and order match `int4_dequant_rows`; `out` holds n·k floats.
            unsafe { b.launch(cfg) }?;
            Ok(())
        };
        Some(launch())
    }
}

#[cfg(test)]
mod tests {
    use crate::linear::int4::Int4Matrix;
    use rand::{Rng, SeedableRng};

    /// The W4A8 kernel's reading of the uploaded int4 planes, transliterated: columns `c..c+4`
    /// are one 32-bit word of the row's packed run, low or high nibbles, minus `8 + z` per byte
    /// (`__vsub4`); the bytes must be the signed `q - z` of `Int4Matrix::row_values`.
    #[test]
    fn int4_words_unpack_like_the_kernel() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let (rows, cols, group) = (3usize, 160usize, 64usize);
        let q: Vec<i8> = (0..rows * cols).map(|_| r.gen_range(-8..=7)).collect();
        let ng = rows * cols.div_ceil(group);
        let zeros: Vec<i8> = (0..ng).map(|_| r.gen_range(-8..=7)).collect();
        let w = Int4Matrix::new(rows, cols, group, &q, vec![1.0; ng], Some(zeros)).unwrap();
        let plane: Vec<u8> = (0..rows).flat_map(|r| w.packed_row(r)).collect();
        let mut vals = vec![0i8; cols];
        for row in 0..rows {
            w.row_values(row, &mut vals);
            let z = w.row_zeros(row).unwrap();
            for c in (0..cols).step_by(4) {
                let off = c % 32;
                let at = row * (cols / 2) + (c / 32) * 16 + (off & 15);
                let word = u32::from_le_bytes(plane[at..at + 4].try_into().unwrap());
                let nib = (if off < 16 { word } else { word >> 4 }) & 0x0f0f_0f0f;
                let zb = (8 + z[c / group] as i32) as u8;
                for (i, b) in nib.to_le_bytes().iter().enumerate() {
                    assert_eq!(b.wrapping_sub(zb) as i8, vals[c + i] - z[c / group], "row {row} col {}", c + i);
                }
            }
        }
    }
}
