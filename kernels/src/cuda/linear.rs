//! Linear layers on the GPU: `y[m, n] = x[m, k] · W[n, k]ᵀ` with the weights kept in their
//! storage type (GGML blocks or floats) and dequantized in registers, and the embedding lookup
//! over the same tables.
//!
//! Supported storage: F32, F16, BF16, Q4_0, Q4_1, Q8_0 (the default model is Q4_1 with a Q8_0
//! embedding). Other GGML types and checkpoint-quantized matrices (int4 / int8 / FP8) are a
//! clear [`CudaError::Unsupported`] at upload, naming the type.

use super::device::CudaDevice;
use super::source::LINEAR_GGML;
use super::CudaError;
use crate::ggml::GgmlType;
use crate::quant::{ActQuant, QuantMatrix};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

/// Rows one CTA computes (one warp each).
const ROWS_PER_CTA: u32 = 4;

/// The `WTYPE` define of a GGML type, if the CUDA kernels handle it.
fn wtype(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "WTYPE=0",
        GgmlType::F16 => "WTYPE=1",
        GgmlType::BF16 => "WTYPE=2",
        GgmlType::Q4_0 => "WTYPE=3",
        GgmlType::Q4_1 => "WTYPE=4",
        GgmlType::Q8_0 => "WTYPE=5",
        _ => return None,
    })
}

/// A `[rows, cols]` weight matrix resident on the device in its storage type.
pub struct DeviceWeight {
    ty: GgmlType,
    define: &'static str,
    rows: usize,
    cols: usize,
    data: CudaSlice<u8>,
}

impl DeviceWeight {
    /// Uploads a GGML-typed `[rows, cols]` tensor (`data` as stored: `rows` rows of blocks).
    pub fn from_ggml(dev: &CudaDevice, ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<Self, CudaError> {
        let define = wtype(ty).ok_or_else(|| CudaError::Unsupported(format!("{} weights are not yet on CUDA (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0)", ty.name())))?;
        let row_bytes = ty.row_bytes(cols).ok_or_else(|| CudaError::Shape(format!("{} rows of {cols} columns are not whole blocks", ty.name())))?;
        if data.len() != rows * row_bytes {
            return Err(CudaError::Shape(format!("{} [{rows}, {cols}]: {} bytes, expected {}", ty.name(), data.len(), rows * row_bytes)));
        }
        i32::try_from(rows.max(cols)).map_err(|_| CudaError::Shape(format!("[{rows}, {cols}] exceeds the kernels' 32-bit dimensions")))?;
        Ok(DeviceWeight { ty, define, rows, cols, data: dev.stream().clone_htod(data)? })
    }

    /// Checkpoint-quantized matrices (W4A16, W4A8, W8A8) are not on CUDA yet: a clear error.
    pub fn from_quant(_dev: &CudaDevice, m: &QuantMatrix, act: ActQuant) -> Result<Self, CudaError> {
        Err(CudaError::Unsupported(format!("checkpoint-quantized weights ({}, {} activations) are not yet on CUDA", m.storage(), act.name())))
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage, as the plan prints it (`Q4_1`, `BF16`, ...).
    pub fn storage(&self) -> String {
        self.ty.name().to_string()
    }

    /// The kernel that runs this weight.
    pub fn kernel_id(&self) -> String {
        format!("cuda.gemv.warp-per-row.{}", self.ty.name().to_lowercase())
    }
}

fn int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{v} does not fit a 32-bit kernel argument")))
}

/// `y = x · Wᵀ`: `x` is `[m, w.cols()]`, `y` is `[m, w.rows()]`, both contiguous f32.
pub fn matmul(dev: &CudaDevice, w: &DeviceWeight, x: &CudaView<'_, f32>, m: usize, y: &mut CudaViewMut<'_, f32>) -> Result<(), CudaError> {
    if x.len() != m * w.cols || y.len() != m * w.rows {
        return Err(CudaError::Shape(format!("matmul [{m}x{}]·[{}x{}]ᵀ: x has {}, y {} elements", w.cols, w.rows, w.cols, x.len(), y.len())));
    }
    if m == 0 {
        return Ok(());
    }
    let f = dev.function(&LINEAR_GGML, &[w.define], "ggml_matmul")?;
    let ctas = u32::try_from(w.rows.div_ceil(ROWS_PER_CTA as usize)).map_err(|_| CudaError::Shape("too many rows".into()))?;
    let cfg = LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (ROWS_PER_CTA * 32, 1, 1), shared_mem_bytes: 0 };
    let (n, k, m) = (int(w.rows)?, int(w.cols)?, int(m)?);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&w.data).arg(x).arg(y).arg(&n).arg(&k).arg(&m);
    // SAFETY: argument types and order match `ggml_matmul`; x, y and the weight bytes were
    // checked against the shape.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `out[t] = table[ids[t]]` dequantized to f32 (`out` is `[ids.len(), table.cols()]`). Ids
/// outside the table write NaN rows; callers validate ids first.
pub fn embedding(dev: &CudaDevice, table: &DeviceWeight, ids: &CudaSlice<i32>, out: &mut CudaViewMut<'_, f32>) -> Result<(), CudaError> {
    if out.len() != ids.len() * table.cols {
        return Err(CudaError::Shape(format!("embedding: {} ids of {} values into {} elements", ids.len(), table.cols, out.len())));
    }
    if ids.is_empty() {
        return Ok(());
    }
    let f = dev.function(&LINEAR_GGML, &[table.define], "ggml_embedding")?;
    let tokens = u32::try_from(ids.len()).map_err(|_| CudaError::Shape("too many ids".into()))?;
    let cfg = LaunchConfig { grid_dim: (tokens, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    let (k, vocab) = (int(table.cols)?, int(table.rows)?);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&table.data).arg(ids).arg(out).arg(&k).arg(&vocab);
    // SAFETY: argument types and order match `ggml_embedding`; the kernel bounds ids by `vocab`.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_cover_the_supported_types_and_nothing_else() {
        let supported = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];
        let defines: Vec<&str> = supported.iter().map(|&t| wtype(t).unwrap()).collect();
        // One gate variant per supported type, in the same order.
        let gate: Vec<&str> = LINEAR_GGML.variants.iter().map(|v| v[0]).collect();
        assert_eq!(defines, gate);
        assert!(wtype(GgmlType::Q4K).is_none() && wtype(GgmlType::Q8_1).is_none());
    }
}
