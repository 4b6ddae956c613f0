//! Linear layers on the GPU over weights kept in their storage type: `y[m, N] = x[m, K] · W[N, K]ᵀ`
//! with f32 activations and outputs, plus the embedding gather.
//!
//! A [`DeviceWeight`] is uploaded once and never expanded to f32/bf16 in device memory:
//! - GGUF types ([`DeviceWeight::from_ggml`]): F32, F16 and BF16 as stored; Q4_0, Q4_1 and
//!   Q8_0 split into a code plane and a scale plane (same bytes, [`repack_blocks`]) so every
//!   block's codes are one or two 16-byte loads. Kernel: `linear_ggml.cu`, dequantization in
//!   registers, f32 accumulation (the GPU reference is f32 math over the dequantized weights; the
//!   CPU's int8-activation dot path for small batches is not reproduced).
//! - checkpoint-quantized matrices ([`DeviceWeight::from_planes`], laid out by
//!   each format's `upload` in `linear::int4`, `int8`, `fp8`): W4A16 (f32 math), W4A8 and W8A8 int8 (per-token int8 activations
//!   quantized on the GPU bit-identically to `linear::act`, exact int32 dp4a sums, the CPU's f32
//!   epilogue operation for operation), W8A8 FP8 (per-token-and-block E4M3 activations
//!   bit-identical to the CPU's, f32 sums). Kernels: `act_quant.cu`, `linear_quant.cu`.
//!
//! One entry point serves every batch size. Below [`GEMM_MIN_TOKENS`] tokens the per-format
//! kernels run: CTAs of 8 warps, four output rows per warp for GGUF blocks and W4A16 (each
//! activation value read serves four rows), one for the others, tiles of up to 8 tokens
//! ([`matmul_grid`]). From it on, GGUF blocks and W4A16 are dequantized to f32 and multiplied by
//! cuBLAS SGEMM ([`matmul_dequant_gemm`]); tensor-core GEMMs are not written yet
//! (docs/cuda-notes.md has the measurements).
//!
//! Launches are asynchronous on the device's stream; [`CudaDevice::synchronize`] surfaces faults.

use crate::cuda::blas::gemm_f32;
use crate::cuda::device::CudaDevice;
use crate::cuda::source::{ACT_QUANT, LINEAR_GGML, LINEAR_QUANT};
use crate::cuda::CudaError;
use crate::ggml::GgmlType;
use crate::linear::ggml::WeightView;
use crate::linear::ActQuant;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Mutex;

/// Batch size from which [`matmul`] dequantizes GGUF block types and W4A16 to f32 and calls
/// cuBLAS SGEMM instead of the per-format kernel (H100, docs/cuda-notes.md: at 32 tokens of a
/// 14336 × 4096 matrix the kernel takes ~0.5 ms, the dequantization plus SGEMM should take a
/// third of that).
pub const GEMM_MIN_TOKENS: usize = 32;
/// Warps per CTA of the matmul kernels (`TS_WARPS` in the sources).
pub const WARPS_PER_CTA: usize = 8;
/// Tokens per CTA of the matmul kernels (`TS_MT` in the sources).
pub const TOKENS_PER_CTA: usize = 8;
/// Threads per CTA of the activation-quantization and embedding kernels.
const ROW_THREADS: u32 = 256;

/// How a [`DeviceWeight`] is stored and which CUDA kernel multiplies it (a weight format's
/// `upload` picks one; see [`QuantPlanes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// GGUF type, f32 math.
    Ggml(GgmlType),
    /// Int4 with `group` columns per scale (clamped to `cols`), f32 or int8 activations.
    Int4 {
        /// Columns per scale.
        group: usize,
        /// F32 (W4A16) or Int8PerToken (W4A8).
        act: ActQuant,
    },
    /// Int8 with per-row scales, int8 activations.
    Int8,
    /// E4M3 with `[bh, bw]` scale blocks (clamped to the shape), E4M3 activations per `bw` columns.
    Fp8 {
        /// Scale block height.
        bh: usize,
        /// Scale block width (activation scale group).
        bw: usize,
    },
}

impl Format {
    /// Whether the kernel dequantizes weights to f32 in registers and multiplies f32
    /// activations (GGUF block types, W4A16): those take four rows per warp, and the
    /// dequantize-then-SGEMM path at large batches.
    fn dequantizes(self) -> bool {
        match self {
            Format::Ggml(ty) => block_code_bytes(ty).is_some(),
            Format::Int4 { act, .. } => act == ActQuant::F32,
            Format::Int8 | Format::Fp8 { .. } => false,
        }
    }

    /// Output rows per warp of the format's kernel (`TS_RW` in its source): four where the
    /// activation reads dominate ([`Format::dequantizes`]), one for float weights and for the
    /// integer-activation kinds (a quarter of the activation bytes, and batch 1 needs every
    /// warp for parallelism).
    fn rows_per_warp(self) -> usize {
        if self.dequantizes() {
            4
        } else {
            1
        }
    }
}

/// A `[rows, cols]` weight matrix in device memory, in its storage type (never expanded), with
/// the scratch its activation quantization needs (grown on first use, see [`matmul`]).
pub struct DeviceWeight {
    rows: usize,
    cols: usize,
    format: Format,
    storage: String,
    /// Codes: GGUF code plane or float data; int4 packed runs; int8 / E4M3 bytes.
    codes: CudaSlice<u8>,
    /// GGUF block scale plane (raw f16 `d`, or `d, m` pairs); `None` for float types.
    block_scales: Option<CudaSlice<u8>>,
    /// Checkpoint scales (f32): int4 `[rows, groups]`, int8 `[rows]`, fp8 `[row blocks, col blocks]`.
    scales: Option<CudaSlice<f32>>,
    /// Int4 zero points `[rows, groups]`, if asymmetric.
    zeros: Option<CudaSlice<i8>>,
    scratch: Mutex<Option<ActScratch>>,
}

/// A checkpoint-quantized matrix in host memory, laid out as its CUDA kernel reads it.
#[derive(Debug)]
pub struct QuantPlanes {
    /// The kernel family and its parameters.
    pub format: Format,
    /// Storage for plans (the matrix's own description).
    pub storage: String,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Codes: int4 packed runs row by row, int8 or E4M3 bytes.
    pub codes: Vec<u8>,
    /// Scales: int4 `[rows, groups]`, int8 `[rows]`, fp8 `[row blocks, col blocks]`.
    pub scales: Vec<f32>,
    /// Int4 zero points `[rows, groups]`, if asymmetric.
    pub zeros: Option<Vec<i8>>,
}

impl QuantPlanes {
    /// Checks what the kernels read without bounds checks: plane lengths for the shape and
    /// format, nonzero group and block sizes, and activations the format has a kernel for.
    pub fn check(&self) -> Result<(), CudaError> {
        let (rows, cols) = (self.rows, self.cols);
        if rows == 0 || cols == 0 {
            return Err(shape(format!("empty {rows}x{cols} quantized weight")));
        }
        let (codes, scales, zeros) = match self.format {
            Format::Ggml(_) => return Err(shape("GGUF weights upload with DeviceWeight::from_ggml")),
            Format::Int4 { act: ActQuant::Bf16 | ActQuant::Fp8PerToken, .. } => {
                return Err(shape(format!("no CUDA kernel for {} weights with such activations", self.storage)))
            }
            Format::Int4 { group, .. } if group == 0 || !cols.is_multiple_of(32) => {
                return Err(shape(format!("int4 planes: group {group} over {cols} columns (need a group and whole 32-column runs)")))
            }
            Format::Int4 { group, .. } => {
                let g = rows * cols.div_ceil(group);
                (rows * cols / 2, g, self.zeros.as_ref().map(|_| g))
            }
            Format::Int8 => (rows * cols, rows, None),
            Format::Fp8 { bh, bw } if bh == 0 || bw == 0 => return Err(shape(format!("fp8 planes: a {bh}x{bw} scale block"))),
            Format::Fp8 { bh, bw } => (rows * cols, rows.div_ceil(bh) * cols.div_ceil(bw), None),
        };
        let got = (self.codes.len(), self.scales.len(), self.zeros.as_ref().map(Vec::len));
        if got != (codes, scales, zeros) {
            return Err(shape(format!(
                "{} planes for a {rows}x{cols} weight: {got:?} (codes, scales, zeros), expected {:?}",
                self.storage,
                (codes, scales, zeros)
            )));
        }
        Ok(())
    }
}

/// Device buffers for quantized activations (int8 or E4M3 codes, and their scales), shareable
/// by every weight of a model: size it once for the largest batch and widest input.
pub struct ActScratch {
    codes: CudaSlice<u8>,
    scales: CudaSlice<f32>,
}

impl ActScratch {
    /// Room for `max_tokens` rows of up to `max_cols` columns (scales for the finest FP8 column
    /// blocks, 32 wide).
    pub fn new(dev: &CudaDevice, max_tokens: usize, max_cols: usize) -> Result<Self, CudaError> {
        let codes = max_tokens.checked_mul(max_cols).ok_or_else(|| shape("activation scratch size overflows"))?;
        let scales = max_tokens * max_cols.div_ceil(32).max(1);
        Ok(ActScratch { codes: dev.stream().alloc_zeros(codes.max(1))?, scales: dev.stream().alloc_zeros(scales.max(1))? })
    }

    fn fits(&self, codes: usize, scales: usize) -> bool {
        self.codes.len() >= codes && self.scales.len() >= scales
    }
}

fn shape(msg: impl Into<String>) -> CudaError {
    CudaError::Shape(msg.into())
}

fn int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| shape(format!("{v} does not fit a 32-bit kernel argument")))
}

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

/// Grid of the matmul kernels for `rows` outputs, `m` tokens and `rows_per_warp` outputs per
/// warp: `(ceil(rows / (8 · rows_per_warp)), ceil(m / 8))` CTAs of 256 threads.
pub fn matmul_grid(rows: usize, m: usize, rows_per_warp: usize) -> Result<LaunchConfig, CudaError> {
    let gx = u32::try_from(rows.div_ceil(WARPS_PER_CTA * rows_per_warp)).map_err(|_| shape(format!("{rows} rows exceed the grid")))?;
    let gy = m.div_ceil(TOKENS_PER_CTA);
    if gy > 65_535 {
        return Err(shape(format!("{m} tokens exceed the grid (at most {})", 65_535 * TOKENS_PER_CTA)));
    }
    Ok(LaunchConfig { grid_dim: (gx, gy as u32, 1), block_dim: (32 * WARPS_PER_CTA as u32, 1, 1), shared_mem_bytes: 0 })
}

impl DeviceWeight {
    /// Uploads a GGUF tensor of `rows` output features by `cols` inputs (`data` exactly
    /// `rows * ty.row_bytes(cols)` bytes). Supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0; any
    /// other type is refused with an error naming it.
    pub fn from_ggml(dev: &CudaDevice, ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<Self, CudaError> {
        if ggml_defines(ty).is_none() {
            return Err(shape(format!(
                "CUDA has no matmul kernel for GGML type {ty} (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0)"
            )));
        }
        WeightView::new(ty, rows, cols, data).map_err(CudaError::Shape)?;
        if rows == 0 || cols == 0 {
            return Err(shape(format!("empty {rows}x{cols} {ty} weight")));
        }
        let stream = dev.stream();
        let (codes, block_scales) = match repack_blocks(ty, data) {
            Some((codes, heads)) => (stream.clone_htod(&codes)?, Some(stream.clone_htod(&heads)?)),
            None => (stream.clone_htod(data)?, None),
        };
        Ok(DeviceWeight {
            rows,
            cols,
            format: Format::Ggml(ty),
            storage: ty.name().to_string(),
            codes,
            block_scales,
            scales: None,
            zeros: None,
            scratch: Mutex::new(None),
        })
    }

    /// Uploads a checkpoint-quantized matrix laid out by its format (`linear::int4`, `int8`,
    /// `fp8` build the planes). Refused ([`QuantPlanes::check`]) when the planes do not match
    /// the shape and format, or the shape is empty or too large for the kernels.
    pub fn from_planes(dev: &CudaDevice, p: QuantPlanes) -> Result<Self, CudaError> {
        p.check()?;
        let QuantPlanes { format, storage, rows, cols, codes, scales, zeros } = p;
        int(rows)?;
        int(cols)?;
        let stream = dev.stream();
        Ok(DeviceWeight {
            rows,
            cols,
            format,
            storage,
            codes: stream.clone_htod(&codes)?,
            block_scales: None,
            scales: Some(stream.clone_htod(&scales)?),
            zeros: zeros.map(|z| stream.clone_htod(&z)).transpose()?,
            scratch: Mutex::new(None),
        })
    }

    /// Output features (N).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (K).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Storage description: the GGML type name (`Q4_1`) or the format's `WeightMatrix::storage`
    /// (`int4 g128 asym`, `fp8 block 128x128`).
    pub fn storage(&self) -> String {
        self.storage.clone()
    }

    /// Kernel id for plans, e.g. `cuda.ggml.q4_1`, `cuda.w4a8.int4xint8.dp4a`.
    pub fn kernel_id(&self) -> String {
        match self.format {
            Format::Ggml(ty) => format!("cuda.ggml.{}", ty.name().to_lowercase()),
            Format::Int4 { act: ActQuant::F32, .. } => "cuda.w4a16.int4xf32".into(),
            Format::Int4 { .. } => "cuda.w4a8.int4xint8.dp4a".into(),
            Format::Int8 => "cuda.w8a8.int8xint8.dp4a".into(),
            Format::Fp8 { .. } => "cuda.w8a8.fp8xfp8".into(),
        }
    }

    /// Codes and scales of scratch a call with `m` tokens needs (zero without activation
    /// quantization).
    fn scratch_need(&self, m: usize) -> (usize, usize) {
        match self.format {
            Format::Int4 { act: ActQuant::Int8PerToken, .. } | Format::Int8 => (m * self.cols, m),
            Format::Fp8 { bw, .. } => (m * self.cols, m * self.cols.div_ceil(bw)),
            _ => (0, 0),
        }
    }
}

fn check_len(what: &str, len: usize, want: usize) -> Result<(), CudaError> {
    if len == want {
        Ok(())
    } else {
        Err(shape(format!("{what}: {len} elements, expected {want}")))
    }
}

fn check_aligned(dev: &CudaDevice, what: &str, x: &CudaView<'_, f32>) -> Result<(), CudaError> {
    let (ptr, _sync) = x.device_ptr(dev.stream());
    if ptr % 16 == 0 {
        Ok(())
    } else {
        Err(shape(format!("{what} must start on a 16-byte boundary (view offset a multiple of 4 floats)")))
    }
}

/// `y = x · wᵀ` for `m` tokens: `x` is `[m, w.cols()]` and `y` `[m, w.rows()]`, both contiguous
/// row-major; `x` starts on a 16-byte boundary (any `CudaSlice`, or a view at a multiple of
/// 4 floats). Weights that quantize activations (W4A8, W8A8) use scratch owned by `w`,
/// allocated on the first call and reallocated only when `m` exceeds every earlier call (call
/// once with the largest batch before capturing a CUDA graph); [`matmul_with`] takes shared
/// scratch instead.
///
/// From [`GEMM_MIN_TOKENS`] tokens on, GGUF block types and W4A16 are dequantized to f32 in the
/// device's workspace and multiplied by cuBLAS SGEMM (f32 math, no TF32: the same function,
/// another summation order); [`matmul_direct`] always takes the per-format kernel.
pub fn matmul(
    dev: &CudaDevice,
    w: &DeviceWeight,
    x: &CudaView<'_, f32>,
    m: usize,
    y: &mut CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    if takes_gemm(w, m) {
        return matmul_dequant_gemm(dev, w, x, m, y);
    }
    matmul_direct(dev, w, x, m, y)
}

/// Whether [`matmul`] hands `m` tokens of `w` to the dequantize + SGEMM path.
fn takes_gemm(w: &DeviceWeight, m: usize) -> bool {
    m >= GEMM_MIN_TOKENS && w.format.dequantizes()
}

/// [`matmul`] through the per-format kernel at any batch size.
pub fn matmul_direct(
    dev: &CudaDevice,
    w: &DeviceWeight,
    x: &CudaView<'_, f32>,
    m: usize,
    y: &mut CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    let (codes, scales) = w.scratch_need(m);
    if codes == 0 {
        return launch_matmul(dev, w, x, m, y, None);
    }
    let mut guard = w.scratch.lock().unwrap_or_else(|p| p.into_inner());
    if !guard.as_ref().is_some_and(|s| s.fits(codes, scales)) {
        *guard = Some(ActScratch::new(dev, m, w.cols)?);
    }
    launch_matmul(dev, w, x, m, y, guard.as_mut())
}

/// [`matmul`]'s large-batch path at any batch size: `w` dequantized to f32 into the device
/// workspace, then `y = x · wᵀ` by cuBLAS SGEMM. GGUF block types and W4A16 only (an error for
/// the others).
pub fn matmul_dequant_gemm(dev: &CudaDevice, w: &DeviceWeight, x: &CudaView<'_, f32>, m: usize, y: &mut CudaViewMut<'_, f32>) -> Result<(), CudaError> {
    check_len("matmul x", x.len(), m * w.cols)?;
    check_len("matmul y", y.len(), m * w.rows)?;
    let (n, k) = (w.rows, w.cols);
    // One thread per 8 values (k is a multiple of 32 for both formats).
    let chunks = (n * k / 8) as i64;
    let grid = u32::try_from((n * k / 8).div_ceil(ROW_THREADS as usize)).map_err(|_| shape(format!("{n} x {k} exceeds the grid")))?;
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let ki = int(k)?;
    dev.with_workspace(n * k, |ws| {
        let mut out = ws.slice_mut(..n * k);
        match w.format {
            Format::Ggml(ty) => {
                let f = dev.function(&LINEAR_GGML, ggml_defines(ty).expect("checked at upload"), "ggml_dequant_rows")?;
                let sc = w.block_scales.as_ref().expect("block types carry a scale plane");
                let mut b = dev.stream().launch_builder(&f);
                b.arg(&w.codes).arg(sc).arg(&mut out).arg(&chunks);
                // SAFETY: argument types and order match `ggml_dequant_rows`; `out` holds n·k floats.
                unsafe { b.launch(cfg) }?;
            }
            Format::Int4 { group, .. } => {
                let f = dev.function(&LINEAR_QUANT, &["QKIND=0"], "int4_dequant_rows")?;
                let scales = w.scales.as_ref().expect("quantized weights carry scales");
                let (null, gi) = (0u64, int(group)?);
                let mut b = dev.stream().launch_builder(&f);
                b.arg(&w.codes).arg(scales);
                match &w.zeros {
                    Some(z) => b.arg(z),
                    None => b.arg(&null),
                };
                b.arg(&ki).arg(&gi).arg(&mut out).arg(&chunks);
                // SAFETY: argument types and order match `int4_dequant_rows`; `out` holds n·k floats.
                unsafe { b.launch(cfg) }?;
            }
            _ => return Err(shape(format!("{} is multiplied by its own kernel, not dequantized", w.storage))),
        }
        gemm_f32(dev, x, &ws.slice(..n * k), m, n, k, y)
    })
}

/// [`matmul`] with caller-owned activation scratch (ignored by weights that keep f32
/// activations); an error if `scratch` is too small for `m` tokens of `w.cols()` columns.
pub fn matmul_with(
    dev: &CudaDevice,
    w: &DeviceWeight,
    x: &CudaView<'_, f32>,
    m: usize,
    y: &mut CudaViewMut<'_, f32>,
    scratch: &mut ActScratch,
) -> Result<(), CudaError> {
    let (codes, scales) = w.scratch_need(m);
    if !scratch.fits(codes, scales) {
        return Err(shape(format!("activation scratch too small for {m} tokens of {} columns", w.cols)));
    }
    if takes_gemm(w, m) {
        return matmul_dequant_gemm(dev, w, x, m, y);
    }
    launch_matmul(dev, w, x, m, y, Some(scratch))
}

fn launch_matmul(
    dev: &CudaDevice,
    w: &DeviceWeight,
    x: &CudaView<'_, f32>,
    m: usize,
    y: &mut CudaViewMut<'_, f32>,
    scratch: Option<&mut ActScratch>,
) -> Result<(), CudaError> {
    check_len("matmul x", x.len(), m * w.cols)?;
    check_len("matmul y", y.len(), m * w.rows)?;
    if m == 0 {
        return Ok(());
    }
    check_aligned(dev, "matmul x", x)?;
    let cfg = matmul_grid(w.rows, m, w.format.rows_per_warp())?;
    let (n, k, mi) = (int(w.rows)?, int(w.cols)?, int(m)?);
    let null = 0u64;
    let (kind, group, bh) = match w.format {
        Format::Ggml(ty) => {
            let defines = ggml_defines(ty).expect("checked at upload");
            let f = dev.function(&LINEAR_GGML, defines, "ggml_matmul")?;
            let mut b = dev.stream().launch_builder(&f);
            b.arg(&w.codes);
            match &w.block_scales {
                Some(s) => b.arg(s),
                None => b.arg(&null),
            };
            b.arg(x).arg(&mut *y).arg(&n).arg(&k).arg(&mi);
            // SAFETY: argument types and order match `ggml_matmul`; lengths and alignment
            // checked above, the weight planes were sized at upload.
            unsafe { b.launch(cfg) }?;
            return Ok(());
        }
        Format::Int4 { group, act: ActQuant::F32 } => ("QKIND=0", group, 1),
        Format::Int4 { group, .. } => ("QKIND=1", group, 1),
        Format::Int8 => ("QKIND=2", w.cols, 1),
        Format::Fp8 { bh, bw } => ("QKIND=3", bw, bh),
    };
    let (group, bh) = (int(group)?, int(bh)?);
    let f = dev.function(&LINEAR_QUANT, &[kind], "quant_matmul")?;
    let scales = w.scales.as_ref().expect("quantized weights carry scales");
    let launch = |xa: &CudaView<'_, u8>, xs: Option<&CudaSlice<f32>>, y: &mut CudaViewMut<'_, f32>| {
        let mut b = dev.stream().launch_builder(&f);
        b.arg(&w.codes).arg(scales);
        match &w.zeros {
            Some(z) => b.arg(z),
            None => b.arg(&null),
        };
        b.arg(xa);
        match xs {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(y).arg(&n).arg(&k).arg(&mi).arg(&group).arg(&bh);
        // SAFETY: argument types and order match `quant_matmul` (activations as raw bytes);
        // lengths and alignment checked above, weight planes sized at upload, scratch checked
        // by the callers.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(CudaError::from)
    };
    match w.format {
        Format::Int4 { act: ActQuant::F32, .. } => {
            // SAFETY: reinterprets the f32 activations as their bytes (4 per value).
            let xa = unsafe { x.transmute::<u8>(x.len() * 4) }.ok_or_else(|| shape("activation view"))?;
            launch(&xa, None, y)
        }
        _ => {
            let s = scratch.expect("callers provide scratch for quantized activations");
            let (nc, ns) = w.scratch_need(m);
            {
                let mut q = s.codes.slice_mut(..nc);
                let mut qs = s.scales.slice_mut(..ns);
                match w.format {
                    Format::Fp8 { bw, .. } => quantize_fp8_rows(dev, x, m, w.cols, bw, &mut q, &mut qs)?,
                    _ => quantize_int8_rows(dev, x, m, w.cols, &mut q, &mut qs)?,
                }
            }
            launch(&s.codes.slice(..nc), Some(&s.scales), y)
        }
    }
}

/// Per-token int8 quantization of `x` (`[m, k]`) into `q` (`[m, k]` two's-complement bytes)
/// and `scales` (`[m]`), bit-identical to `linear::act::quantize_int8_row`.
pub fn quantize_int8_rows(
    dev: &CudaDevice,
    x: &CudaView<'_, f32>,
    m: usize,
    k: usize,
    q: &mut CudaViewMut<'_, u8>,
    scales: &mut CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    check_len("quantize_int8 x", x.len(), m * k)?;
    check_len("quantize_int8 q", q.len(), m * k)?;
    check_len("quantize_int8 scales", scales.len(), m)?;
    if m == 0 {
        return Ok(());
    }
    let f = dev.function(&ACT_QUANT, &[], "quantize_int8_rows")?;
    let rows = u32::try_from(m).map_err(|_| shape(format!("{m} rows exceed the grid")))?;
    let cfg = LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let k = int(k)?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(x).arg(&k).arg(q).arg(scales);
    // SAFETY: argument types and order match `quantize_int8_rows`; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Per-token, per-`bw`-column-block E4M3 quantization of `x` (`[m, k]`) into `q` (`[m, k]`
/// E4M3 bytes) and `scales` (`[m, ceil(k / bw)]`), bit-identical to
/// `linear::act::quantize_fp8_row` (whose codes are these bytes' values).
pub fn quantize_fp8_rows(
    dev: &CudaDevice,
    x: &CudaView<'_, f32>,
    m: usize,
    k: usize,
    bw: usize,
    q: &mut CudaViewMut<'_, u8>,
    scales: &mut CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    if bw == 0 {
        return Err(shape("quantize_fp8: zero block width"));
    }
    let nb = k.div_ceil(bw);
    check_len("quantize_fp8 x", x.len(), m * k)?;
    check_len("quantize_fp8 q", q.len(), m * k)?;
    check_len("quantize_fp8 scales", scales.len(), m * nb)?;
    if m == 0 || k == 0 {
        return Ok(());
    }
    if m > 65_535 {
        return Err(shape(format!("{m} rows exceed the grid's y dimension")));
    }
    let f = dev.function(&ACT_QUANT, &[], "quantize_fp8_rows")?;
    let cfg = LaunchConfig { grid_dim: (int(nb)? as u32, m as u32, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let (k, bw) = (int(k)?, int(bw)?);
    let mut b = dev.stream().launch_builder(&f);
    b.arg(x).arg(&k).arg(&bw).arg(q).arg(scales);
    // SAFETY: argument types and order match `quantize_fp8_rows`; lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Gathers rows `ids` of a GGUF-typed `table` into `out` (`[ids.len(), table.cols()]` f32).
/// Ids are not visible to the launcher: the kernel writes a row of zeros for an id outside
/// `0..table.rows()` and never reads out of bounds; host callers validate ids.
pub fn embedding(
    dev: &CudaDevice,
    table: &DeviceWeight,
    ids: &CudaSlice<i32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    let Format::Ggml(ty) = table.format else {
        return Err(shape(format!("embedding: {} tables are not supported (GGUF types only)", table.storage)));
    };
    check_len("embedding out", out.len(), ids.len() * table.cols)?;
    if ids.is_empty() {
        return Ok(());
    }
    let defines = ggml_defines(ty).expect("checked at upload");
    let f = dev.function(&LINEAR_GGML, defines, "embedding_rows")?;
    let n = u32::try_from(ids.len()).map_err(|_| shape(format!("{} ids exceed the grid", ids.len())))?;
    let cfg = LaunchConfig { grid_dim: (n, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let (rows, k) = (int(table.rows)?, int(table.cols)?);
    let null = 0u64;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&table.codes);
    match &table.block_scales {
        Some(s) => b.arg(s),
        None => b.arg(&null),
    };
    b.arg(ids).arg(&rows).arg(&k).arg(out);
    // SAFETY: argument types and order match `embedding_rows`; `out` holds ids × cols values and
    // the kernel bounds-checks each id against `rows`.
    unsafe { b.launch(cfg) }?;
    Ok(())
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

    /// The W4A8 kernel's reading of the uploaded int4 planes, transliterated: columns `c..c+4`
    /// are one 32-bit word of the row's packed run, low or high nibbles, minus `8 + z` per byte
    /// (`__vsub4`); the bytes must be the signed `q - z` of `Int4Matrix::row_values`.
    #[test]
    fn int4_words_unpack_like_the_kernel() {
        use crate::linear::int4::Int4Matrix;
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let (rows, cols, group) = (3usize, 160usize, 64usize);
        let q: Vec<i8> = (0..rows * cols).map(|_| r.gen_range(-8..=7)).collect();
        let ng = rows * cols.div_ceil(group);
        let zeros: Vec<i8> = (0..ng).map(|_| r.gen_range(-8..=7)).collect();
        let w = Int4Matrix::new(rows, cols, group, &q, vec![1.0; ng], Some(zeros)).unwrap();
        let plane: Vec<u8> = (0..rows).flat_map(|r| w.packed_row(r).iter().copied()).collect();
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

    /// The planes a format hands over are checked before any kernel reads them unchecked.
    #[test]
    fn planes_that_do_not_fit_their_format_are_refused() {
        let planes = |format, codes: usize, scales: usize, zeros: Option<usize>| QuantPlanes {
            format,
            storage: "test".into(),
            rows: 3,
            cols: 64,
            codes: vec![0; codes],
            scales: vec![1.0; scales],
            zeros: zeros.map(|n| vec![0; n]),
        };
        let int4 = |group, act| Format::Int4 { group, act };
        assert!(planes(int4(32, ActQuant::F32), 96, 6, Some(6)).check().is_ok());
        assert!(planes(int4(64, ActQuant::Int8PerToken), 96, 3, None).check().is_ok());
        assert!(planes(Format::Int8, 192, 3, None).check().is_ok());
        assert!(planes(Format::Fp8 { bh: 2, bw: 32 }, 192, 4, None).check().is_ok());
        for bad in [
            planes(int4(32, ActQuant::F32), 95, 6, Some(6)),
            planes(int4(32, ActQuant::F32), 96, 6, Some(5)),
            planes(int4(0, ActQuant::F32), 96, 6, None),
            planes(int4(32, ActQuant::Bf16), 96, 6, None),
            planes(Format::Int8, 192, 2, None),
            planes(Format::Int8, 192, 3, Some(3)),
            planes(Format::Fp8 { bh: 0, bw: 32 }, 192, 4, None),
            planes(Format::Fp8 { bh: 2, bw: 32 }, 192, 3, None),
            planes(Format::Ggml(GgmlType::Q4_0), 0, 0, None),
        ] {
            assert!(bad.check().is_err(), "{:?} accepted", (bad.format, bad.codes.len(), bad.scales.len()));
        }
    }

    #[test]
    fn grid_covers_rows_and_tokens() {
        for rpw in [1, 4] {
            let per_cta = WARPS_PER_CTA * rpw;
            for (rows, m) in [(1, 1), (8, 8), (9, 17), (33, 3), (1536, 257)] {
                let cfg = matmul_grid(rows, m, rpw).unwrap();
                assert!(cfg.grid_dim.0 as usize * per_cta >= rows && (cfg.grid_dim.0 as usize - 1) * per_cta < rows);
                assert!(cfg.grid_dim.1 as usize * TOKENS_PER_CTA >= m && (cfg.grid_dim.1 as usize - 1) * TOKENS_PER_CTA < m);
                assert_eq!(cfg.block_dim.0 as usize, 32 * WARPS_PER_CTA);
            }
        }
        assert!(matmul_grid(8, 65_536 * TOKENS_PER_CTA, 1).is_err());
    }

    #[test]
    fn unsupported_ggml_types_have_no_kernel() {
        for ty in GgmlType::ALL {
            let supported = ggml_defines(ty).is_some();
            assert_eq!(supported, matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0), "{ty}");
        }
    }
}
