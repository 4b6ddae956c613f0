//! Linear layers on the GPU: `y[m, n] = x[m, k] · W[n, k]ᵀ` with the weights kept in their
//! storage type (GGML blocks or floats) and dequantized in registers, and the embedding lookup
//! over the same tables.
//!
//! Supported storage: GGML F32, F16, BF16, Q4_0, Q4_1, Q8_0 (the default model is Q4_1 with a
//! Q8_0 embedding); checkpoint int4 with f32 activations (W4A16: compressed-tensors
//! pack-quantized, GPTQ, AWQ, Quark int4 weight-only) or with int8 per-token activations (W4A8,
//! Quark's two-stage recipe); int8 with int8 activations (W8A8 int8). The int8-activation kernels
//! give the CPU kernels' bits. Other GGML types and FP8 are a clear [`CudaError::Unsupported`]
//! at upload, naming what is missing.

use super::device::CudaDevice;
use super::source::{LINEAR_A8, LINEAR_GGML, LINEAR_INT4};
use super::CudaError;
use crate::ggml::GgmlType;
use crate::quant::{ActQuant, Int4Matrix, Int8Matrix, QuantMatrix};
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

/// How a [`DeviceWeight`]'s bytes are laid out, with what its kernel needs besides them.
enum Storage {
    /// GGML blocks or floats of `ty`, compiled with `define`.
    Ggml { ty: GgmlType, define: &'static str },
    /// Tessera's int4 runs with per-(row, group) scales and optional zero points; activations
    /// in f32 (W4A16) or quantized to int8 per token (W4A8).
    Int4 { group: usize, scales: CudaSlice<f32>, zeros: Option<CudaSlice<i8>>, name: String, int8_act: bool },
    /// Row-major int8 with one scale per row; int8 activations per token (W8A8 int8).
    Int8 { scales: CudaSlice<f32>, name: String },
}

/// A `[rows, cols]` weight matrix resident on the device in its storage type.
pub struct DeviceWeight {
    storage: Storage,
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
        Ok(DeviceWeight { storage: Storage::Ggml { ty, define }, rows, cols, data: dev.stream().clone_htod(data)? })
    }

    /// Uploads a checkpoint-quantized matrix run with activations `act`: int4 with f32
    /// activations (W4A16); anything else is [`CudaError::Unsupported`].
    pub fn from_quant(dev: &CudaDevice, m: &QuantMatrix, act: ActQuant) -> Result<Self, CudaError> {
        match (m, act) {
            (QuantMatrix::Int4(w), ActQuant::F32 | ActQuant::Int8PerToken) => Self::from_int4(dev, w, m.storage(), act == ActQuant::Int8PerToken),
            (QuantMatrix::Int8(w), ActQuant::Int8PerToken) => Self::from_int8(dev, w, m.storage()),
            _ => Err(CudaError::Unsupported(format!("{} weights with {} activations are not yet on CUDA (W4A16, W4A8 and W8A8 int8 are)", m.storage(), act.name()))),
        }
    }

    fn from_int8(dev: &CudaDevice, w: &Int8Matrix, name: String) -> Result<Self, CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        i32::try_from(rows.max(cols)).map_err(|_| CudaError::Shape(format!("[{rows}, {cols}] exceeds the kernels' 32-bit dimensions")))?;
        let q: Vec<i8> = (0..rows).flat_map(|r| w.row(r).to_vec()).collect();
        let scales: Vec<f32> = (0..rows).map(|r| w.scale(r)).collect();
        let st = dev.stream();
        let bytes: Vec<u8> = q.iter().map(|&v| v as u8).collect();
        let storage = Storage::Int8 { scales: st.clone_htod(&scales)?, name };
        Ok(DeviceWeight { storage, rows, cols, data: st.clone_htod(&bytes)? })
    }

    fn from_int4(dev: &CudaDevice, w: &Int4Matrix, name: String, int8_act: bool) -> Result<Self, CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        i32::try_from(rows.max(cols)).map_err(|_| CudaError::Shape(format!("[{rows}, {cols}] exceeds the kernels' 32-bit dimensions")))?;
        let packed: Vec<u8> = (0..rows).flat_map(|r| w.packed_row(r).to_vec()).collect();
        let scales: Vec<f32> = (0..rows).flat_map(|r| w.row_scales(r).to_vec()).collect();
        let zeros: Option<Vec<i8>> = w.has_zeros().then(|| (0..rows).flat_map(|r| w.row_zeros(r).map(<[i8]>::to_vec).unwrap_or_default()).collect());
        let st = dev.stream();
        let zeros = zeros.map(|z| st.clone_htod(&z)).transpose()?;
        let storage = Storage::Int4 { group: w.group(), scales: st.clone_htod(&scales)?, zeros, name, int8_act };
        Ok(DeviceWeight { storage, rows, cols, data: st.clone_htod(&packed)? })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage, as the plan prints it (`Q4_1`, `BF16`, `int4 g128 sym`, ...).
    pub fn storage(&self) -> String {
        match &self.storage {
            Storage::Ggml { ty, .. } => ty.name().to_string(),
            Storage::Int4 { name, .. } | Storage::Int8 { name, .. } => name.clone(),
        }
    }

    /// The kernel that runs this weight.
    pub fn kernel_id(&self) -> String {
        match &self.storage {
            Storage::Ggml { ty, .. } => format!("cuda.gemv.warp-per-row.{}", ty.name().to_lowercase()),
            Storage::Int4 { int8_act: false, .. } => "cuda.gemv.warp-per-row.w4a16".into(),
            Storage::Int4 { int8_act: true, .. } => "cuda.gemv.dp4a.w4a8".into(),
            Storage::Int8 { .. } => "cuda.gemv.dp4a.w8a8-int8".into(),
        }
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
    let ctas = u32::try_from(w.rows.div_ceil(ROWS_PER_CTA as usize)).map_err(|_| CudaError::Shape("too many rows".into()))?;
    let cfg = LaunchConfig { grid_dim: (ctas, 1, 1), block_dim: (ROWS_PER_CTA * 32, 1, 1), shared_mem_bytes: 0 };
    let (n, k, m) = (int(w.rows)?, int(w.cols)?, int(m)?);
    match &w.storage {
        Storage::Ggml { define, .. } => {
            let f = dev.function(&LINEAR_GGML, &[define], "ggml_matmul")?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&w.data).arg(x).arg(y).arg(&n).arg(&k).arg(&m);
            // SAFETY: argument types and order match `ggml_matmul`; x, y and the weight bytes
            // were checked against the shape.
            unsafe { b.launch(cfg) }?;
        }
        Storage::Int4 { group, scales, zeros, int8_act: true, .. } => {
            let (xq, xs) = quantize_activations(dev, x, m as usize, w.cols)?;
            let f = dev.function(&LINEAR_A8, &[], "int4_a8_matmul")?;
            let group = int(*group)?;
            let null = 0u64;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&w.data).arg(scales);
            match zeros {
                Some(z) => b.arg(z),
                None => b.arg(&null),
            };
            b.arg(&xq).arg(&xs).arg(y).arg(&n).arg(&k).arg(&m).arg(&group);
            // SAFETY: argument types and order match `int4_a8_matmul`; the weights come from a
            // validated Int4Matrix of this shape (cols a multiple of 32: aligned 4-byte loads).
            unsafe { b.launch(cfg) }?;
        }
        Storage::Int8 { scales, .. } => {
            let (xq, xs) = quantize_activations(dev, x, m as usize, w.cols)?;
            let f = dev.function(&LINEAR_A8, &[], "int8_a8_matmul")?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&w.data).arg(scales).arg(&xq).arg(&xs).arg(y).arg(&n).arg(&k).arg(&m);
            // SAFETY: argument types and order match `int8_a8_matmul`; the weights come from a
            // validated Int8Matrix of this shape (cols a multiple of 32: aligned 4-byte loads).
            unsafe { b.launch(cfg) }?;
        }
        Storage::Int4 { group, scales, zeros, int8_act: false, .. } => {
            let f = dev.function(&LINEAR_INT4, &[], "int4_matmul")?;
            let group = int(*group)?;
            let null = 0u64;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&w.data).arg(scales);
            match zeros {
                Some(z) => b.arg(z),
                None => b.arg(&null),
            };
            b.arg(x).arg(y).arg(&n).arg(&k).arg(&m).arg(&group);
            // SAFETY: argument types and order match `int4_matmul`; the packed rows, scales and
            // zero points come from a validated Int4Matrix of this shape (cols a multiple of 32,
            // so every 16-byte run load is aligned).
            unsafe { b.launch(cfg) }?;
        }
    }
    Ok(())
}

/// Per-token int8 activations of `x` (`m × k`): codes and scales, as the CPU's
/// `quantize_int8_row` gives them (a scratch allocated per call, stream-ordered).
pub fn quantize_activations(dev: &CudaDevice, x: &CudaView<'_, f32>, m: usize, k: usize) -> Result<(CudaSlice<i8>, CudaSlice<f32>), CudaError> {
    if x.len() != m * k {
        return Err(CudaError::Shape(format!("int8 activations: {} values are not {m} rows of {k}", x.len())));
    }
    let st = dev.stream();
    let (mut q, mut scales) = (st.alloc_zeros::<i8>(m * k)?, st.alloc_zeros::<f32>(m)?);
    if m == 0 {
        return Ok((q, scales));
    }
    let f = dev.function(&LINEAR_A8, &[], "quantize_int8_rows")?;
    let rows = u32::try_from(m).map_err(|_| CudaError::Shape("too many rows".into()))?;
    let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let k = int(k)?;
    let mut b = st.launch_builder(&f);
    b.arg(x).arg(&mut q).arg(&mut scales).arg(&k);
    // SAFETY: argument types and order match `quantize_int8_rows` (256 threads, a power of two
    // within its 1024-entry reduction array); lengths checked.
    unsafe { b.launch(cfg) }?;
    Ok((q, scales))
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
    let Storage::Ggml { define, .. } = &table.storage else {
        return Err(CudaError::Unsupported(format!("embedding lookup in {} tables", table.storage())));
    };
    let f = dev.function(&LINEAR_GGML, &[define], "ggml_embedding")?;
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
