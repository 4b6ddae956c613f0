//! The GGML format on the GPU: its kernel source (`linear_ggml.cu`: matmul, embedding gather and
//! dequantization of GGUF-typed weights), its upload ([`DeviceWeight::from_ggml`]: F32, F16,
//! BF16 as stored; Q4_0, Q4_1, Q8_0 repacked into a code plane and a scale plane by
//! [`repack_blocks`]) and its [`CudaFormat`] ([`GgmlCuda`]).

use crate::cuda::device::CudaDevice;
use crate::cuda::source::KernelSource;
use crate::cuda::CudaError;
use crate::ggml::GgmlType;
use crate::linear::cuda::{shape, Activations, CudaAct, CudaFormat, DevicePlanes, DeviceWeight, Dims, QuantPlanes};
use crate::linear::ggml::WeightView;
use cudarc::driver::{CudaViewMut, LaunchConfig, PushKernelArg};

/// Matmul and embedding gather over GGUF-typed weights (`GGML_TYPE` = the GGUF type id).
pub const LINEAR_GGML: KernelSource = KernelSource {
    name: "linear_ggml.cu",
    code: concat!(
        "#line 1 \"linear/matmul.cuh\"\n",
        include_str!("../matmul.cuh"),
        "#line 1 \"linear_ggml.cu\"\n",
        include_str!("linear_ggml.cu")
    ),
    variants: &[&["GGML_TYPE=0"], &["GGML_TYPE=1"], &["GGML_TYPE=30"], &["GGML_TYPE=2"], &["GGML_TYPE=3"], &["GGML_TYPE=8"]],
    entries: &["ggml_matmul", "embedding_rows"],
    needs_sm90a: false,
};

/// The `-D` set of `linear_ggml.cu` for `ty`, or `None` when no GPU kernel reads it.
fn ggml_defines(ty: GgmlType) -> Option<&'static [&'static str]> {
    Some(match ty {
        GgmlType::F32 => &["GGML_TYPE=0"],
        GgmlType::F16 => &["GGML_TYPE=1"],
        GgmlType::BF16 => &["GGML_TYPE=30"],
        GgmlType::Q4_0 => &["GGML_TYPE=2"],
        GgmlType::Q4_1 => &["GGML_TYPE=3"],
        GgmlType::Q8_0 => &["GGML_TYPE=8"],
        _ => return None,
    })
}

/// Code bytes per 32-value block of a repacked GGUF block type (`None` for other types).
fn block_code_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => Some(16),
        GgmlType::Q8_0 => Some(32),
        _ => None,
    }
}

/// Splits whole GGUF blocks of `ty` (Q4_0, Q4_1 or Q8_0) into the kernel's two planes: the code
/// bytes of every block back to back (16 or 32 per block, 16-byte aligned), and the block headers
/// (f16 `d`, or f16 `d` then f16 `m`) back to back. No value is changed or reordered within a
/// block. Returns `None` for other types or a partial block.
pub fn repack_blocks(ty: GgmlType, data: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let qs = block_code_bytes(ty)?;
    let ts = ty.type_size();
    if !data.len().is_multiple_of(ts) {
        return None;
    }
    let head = ts - qs;
    let blocks = data.len() / ts;
    let (mut codes, mut heads) = (Vec::with_capacity(blocks * qs), Vec::with_capacity(blocks * head));
    for b in data.chunks_exact(ts) {
        heads.extend_from_slice(&b[..head]);
        codes.extend_from_slice(&b[head..]);
    }
    Some((codes, heads))
}

/// A GGUF type's CUDA kernels: `linear_ggml.cu` specialized by its type id, f32 math over
/// values dequantized in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlCuda {
    ty: GgmlType,
    defines: &'static [&'static str],
}

impl GgmlCuda {
    /// The kernels for `ty`, or `None` when no GPU kernel reads it (supported: F32, F16, BF16,
    /// Q4_0, Q4_1, Q8_0).
    pub fn new(ty: GgmlType) -> Option<Self> {
        ggml_defines(ty).map(|defines| GgmlCuda { ty, defines })
    }

    /// Whether the type is a block type (repacked into two planes; four rows per warp).
    fn blocked(&self) -> bool {
        block_code_bytes(self.ty).is_some()
    }
}

impl CudaFormat for GgmlCuda {
    fn source(&self) -> &'static KernelSource {
        &LINEAR_GGML
    }

    fn defines(&self) -> &'static [&'static str] {
        self.defines
    }

    fn kernel_id(&self) -> String {
        format!("cuda.ggml.{}", self.ty.name().to_lowercase())
    }

    /// Four for block types (each activation value read serves four rows), one for floats.
    fn rows_per_warp(&self) -> usize {
        if self.blocked() {
            4
        } else {
            1
        }
    }

    fn activations(&self) -> CudaAct {
        CudaAct::F32
    }

    fn dequantizes(&self) -> bool {
        self.blocked()
    }

    /// Block types: the code plane and the header plane of [`repack_blocks`]; floats: the data
    /// as stored. No f32 scales, no zero points.
    fn check(&self, p: &QuantPlanes) -> Result<(), CudaError> {
        let Some(row_bytes) = self.ty.row_bytes(p.cols) else {
            return Err(shape(format!("{} rows of {} columns are not whole blocks", self.ty, p.cols)));
        };
        let bytes = p.rows * row_bytes;
        match block_code_bytes(self.ty) {
            Some(qs) => {
                let blocks = bytes / self.ty.type_size();
                p.expect_lens(blocks * qs, Some(blocks * (self.ty.type_size() - qs)), 0, None)
            }
            None => p.expect_lens(bytes, None, 0, None),
        }
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
        let Activations::F32(x) = x else { return Err(shape("GGUF kernels take f32 activations")) };
        let f = dev.function(&LINEAR_GGML, self.defines, "ggml_matmul")?;
        let Dims { n, k, m } = dims;
        let null = 0u64;
        let mut b = dev.stream().launch_builder(&f);
        b.arg(&w.codes);
        match &w.block_scales {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(x).arg(&mut *y).arg(&n).arg(&k).arg(&m);
        // SAFETY: argument types and order match `ggml_matmul`; lengths and alignment
        // checked by the launcher, the weight planes checked at upload.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn launch_dequant(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        _k: i32,
        out: &mut CudaViewMut<'_, f32>,
        chunks: i64,
        cfg: LaunchConfig,
    ) -> Option<Result<(), CudaError>> {
        let sc = w.block_scales.as_ref()?;
        let launch = || {
            let f = dev.function(&LINEAR_GGML, self.defines, "ggml_dequant_rows")?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&w.codes).arg(sc).arg(out).arg(&chunks);
            // SAFETY: argument types and order match `ggml_dequant_rows`; `out` holds n·k floats.
            unsafe { b.launch(cfg) }?;
            Ok(())
        };
        Some(launch())
    }

    fn embedding_entry(&self) -> Option<&'static str> {
        Some("embedding_rows")
    }
}

impl DeviceWeight {
    /// Uploads a GGUF tensor of `rows` output features by `cols` inputs (`data` exactly
    /// `rows * ty.row_bytes(cols)` bytes). Supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0; any
    /// other type is refused with an error naming it.
    pub fn from_ggml(dev: &CudaDevice, ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<Self, CudaError> {
        let Some(format) = GgmlCuda::new(ty) else {
            return Err(shape(format!(
                "CUDA has no matmul kernel for GGML type {ty} (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0)"
            )));
        };
        WeightView::new(ty, rows, cols, data).map_err(CudaError::Shape)?;
        if rows == 0 || cols == 0 {
            return Err(shape(format!("empty {rows}x{cols} {ty} weight")));
        }
        let (codes, block_scales) = match repack_blocks(ty, data) {
            Some((codes, heads)) => (codes, Some(heads)),
            None => (data.to_vec(), None),
        };
        let planes = QuantPlanes {
            format: Box::new(format),
            storage: ty.name().to_string(),
            rows,
            cols,
            codes,
            block_scales,
            scales: Vec::new(),
            zeros: None,
        };
        DeviceWeight::from_planes(dev, planes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml::dequantize_row;
    use half::f16;
    use rand::{Rng, SeedableRng};

    /// Dequantizes value `c` of block `blk` from the repacked planes the way the kernels read it.
    fn kernel_value(ty: GgmlType, codes: &[u8], heads: &[u8], blk: usize, j: usize) -> f32 {
        let f16_at = |i: usize| f16::from_le_bytes([heads[i], heads[i + 1]]).to_f32();
        match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let b = codes[blk * 16 + (j & 15)];
                let q = if j < 16 { b & 15 } else { b >> 4 };
                if ty == GgmlType::Q4_0 {
                    (q as i32 - 8) as f32 * f16_at(blk * 2)
                } else {
                    q as f32 * f16_at(blk * 4) + f16_at(blk * 4 + 2)
                }
            }
            _ => codes[blk * 32 + j] as i8 as f32 * f16_at(blk * 2),
        }
    }

    #[test]
    fn repacked_blocks_decode_like_the_cpu() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols) = (3, 96);
            let mut data: Vec<u8> = (0..rows * ty.row_bytes(cols).unwrap()).map(|_| r.gen()).collect();
            // Finite scales (random f16 bits may be NaN/inf).
            let head = ty.type_size() - block_code_bytes(ty).unwrap();
            for b in data.chunks_exact_mut(ty.type_size()) {
                for h in (0..head).step_by(2) {
                    b[h..h + 2].copy_from_slice(&f16::from_f32(r.gen::<f32>() - 0.5).to_le_bytes());
                }
            }
            let (codes, heads) = repack_blocks(ty, &data).unwrap();
            assert_eq!(codes.len() + heads.len(), data.len());
            let rb = ty.row_bytes(cols).unwrap();
            for row in 0..rows {
                let mut want = vec![0f32; cols];
                dequantize_row(ty, &data[row * rb..(row + 1) * rb], &mut want);
                for (c, &w) in want.iter().enumerate() {
                    let got = kernel_value(ty, &codes, &heads, row * cols / 32 + c / 32, c % 32);
                    assert_eq!(got.to_bits(), w.to_bits(), "{ty} row {row} col {c}");
                }
            }
        }
        assert!(repack_blocks(GgmlType::F16, &[0; 4]).is_none());
        assert!(repack_blocks(GgmlType::Q4_0, &[0; 17]).is_none());
    }

    #[test]
    fn unsupported_ggml_types_have_no_kernel() {
        for ty in GgmlType::ALL {
            let supported = ggml_defines(ty).is_some();
            assert_eq!(supported, matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0), "{ty}");
            assert_eq!(GgmlCuda::new(ty).is_some(), supported, "{ty}");
        }
    }

    /// The planes `from_ggml` builds pass the format's check; others do not.
    #[test]
    fn ggml_planes_are_checked() {
        let planes = |ty, codes: usize, heads: Option<usize>, scales: usize| QuantPlanes {
            format: Box::new(GgmlCuda::new(ty).unwrap()),
            storage: "test".into(),
            rows: 3,
            cols: 64,
            codes: vec![0; codes],
            block_scales: heads.map(|n| vec![0; n]),
            scales: vec![1.0; scales],
            zeros: None,
        };
        assert!(planes(GgmlType::Q4_0, 96, Some(12), 0).check().is_ok());
        assert!(planes(GgmlType::Q4_1, 96, Some(24), 0).check().is_ok());
        assert!(planes(GgmlType::Q8_0, 192, Some(12), 0).check().is_ok());
        assert!(planes(GgmlType::F16, 384, None, 0).check().is_ok());
        for bad in [
            planes(GgmlType::Q4_0, 96, None, 0),
            planes(GgmlType::Q4_0, 96, Some(11), 0),
            planes(GgmlType::Q4_0, 96, Some(12), 3),
            planes(GgmlType::F16, 384, Some(0), 0),
            planes(GgmlType::F32, 384, None, 0),
        ] {
            assert!(bad.check().is_err(), "{:?} accepted", (bad.codes.len(), bad.block_scales.as_ref().map(Vec::len)));
        }
    }
}
