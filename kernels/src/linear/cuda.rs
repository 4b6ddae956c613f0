//! Linear layers on the GPU over weights kept in their storage type: `y[m, N] = x[m, K] · W[N, K]ᵀ`
//! with f32 activations and outputs, plus the embedding gather. The launcher here knows no
//! format: each weight format describes its CUDA side by implementing [`CudaFormat`] in its own
//! folder (`linear/<format>/cuda.rs`, beside its `.cu` source), and its `WeightMatrix::upload`
//! hands its planes over as [`QuantPlanes`] with that description.
//!
//! A [`DeviceWeight`] is uploaded once and never expanded to f32/bf16 in device memory:
//! - GGUF types (`linear::ggml::cuda`, [`DeviceWeight::from_ggml`]): F32, F16 and BF16 as
//!   stored; Q4_0, Q4_1 and Q8_0 split into a code plane and a scale plane (same bytes) so every
//!   block's codes are one or two 16-byte loads. Kernel: `linear_ggml.cu`, dequantization in
//!   registers, f32 accumulation (the GPU reference is f32 math over the dequantized weights; the
//!   CPU's int8-activation dot path for small batches is not reproduced).
//! - checkpoint-quantized matrices (`linear::int4`, `int8`, `fp8`, each with its `cuda.rs` and
//!   `.cu`): W4A16 (f32 math), W4A8 and W8A8 int8 (per-token int8 activations quantized on the
//!   GPU bit-identically to `linear::act`, exact int32 dp4a sums, the CPU's f32 epilogue
//!   operation for operation), W8A8 FP8 (per-token-and-block E4M3 activations bit-identical to
//!   the CPU's, f32 sums). Activation quantization: `linear/act_quant.cu` ([`ACT_QUANT`]).
//!
//! One entry point serves every batch size. Below [`GEMM_MIN_TOKENS`] tokens the format's own
//! kernel runs: CTAs of 8 warps, [`CudaFormat::rows_per_warp`] output rows per warp (four for
//! GGUF blocks and W4A16: each activation value read serves four rows; one for the others),
//! tiles of up to 8 tokens ([`matmul_grid`]). From it on, formats that
//! [`dequantize`](CudaFormat::dequantizes) (GGUF blocks, W4A16) are dequantized to f32 and
//! multiplied by cuBLAS SGEMM ([`matmul_dequant_gemm`]); tensor-core GEMMs are not written yet
//! (docs/cuda-notes.md has the measurements).
//!
//! Launches are asynchronous on the device's stream; [`CudaDevice::synchronize`] surfaces faults.

use crate::cuda::blas::gemm_f32;
use crate::cuda::device::CudaDevice;
use crate::cuda::source::KernelSource;
use crate::cuda::CudaError;
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use std::fmt;
use std::sync::Mutex;

/// Batch size from which [`matmul`] dequantizes the formats that [`CudaFormat::dequantizes`]
/// (GGUF block types, W4A16) to f32 and calls cuBLAS SGEMM instead of the format's kernel
/// (H100, docs/cuda-notes.md: at 32 tokens of a 14336 × 4096 matrix the kernel takes ~0.5 ms,
/// the dequantization plus SGEMM should take a third of that).
pub const GEMM_MIN_TOKENS: usize = 32;
/// Warps per CTA of the matmul kernels (`TS_WARPS` in `linear/matmul.cuh`).
pub const WARPS_PER_CTA: usize = 8;
/// Tokens per CTA of the matmul kernels (`TS_MT` in `linear/matmul.cuh`).
pub const TOKENS_PER_CTA: usize = 8;
/// Threads per CTA of the activation-quantization, dequantization and embedding kernels.
pub const ROW_THREADS: u32 = 256;

/// Dynamic per-token activation quantization (int8, FP8 E4M3), bit-identical to `linear::act`.
pub const ACT_QUANT: KernelSource = KernelSource {
    name: "act_quant.cu",
    code: include_str!("act_quant.cu"),
    variants: &[&[]],
    entries: &["quantize_int8_rows", "quantize_fp8_rows"],
    needs_sm90a: false,
};

/// The activations a format's matmul kernel multiplies; the launcher prepares them from the
/// caller's f32 activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaAct {
    /// The f32 activations as given.
    F32,
    /// Int8 codes with one f32 scale per token ([`quantize_int8_rows`]).
    Int8PerToken,
    /// E4M3 codes with one f32 scale per token and block of `bw` columns ([`quantize_fp8_rows`]).
    Fp8PerBlock {
        /// Columns per activation scale.
        bw: usize,
    },
}

impl CudaAct {
    /// Codes and scales of scratch `m` tokens of `cols` columns need (zero for f32).
    fn scratch_need(self, m: usize, cols: usize) -> (usize, usize) {
        match self {
            CudaAct::F32 => (0, 0),
            CudaAct::Int8PerToken => (m * cols, m),
            CudaAct::Fp8PerBlock { bw } => (m * cols, m * cols.div_ceil(bw)),
        }
    }
}

/// Activations as handed to [`CudaFormat::launch_matmul`], in the form the format's
/// [`CudaFormat::activations`] asked for.
pub enum Activations<'a> {
    /// `[m, k]` f32 values, 16-byte aligned.
    F32(&'a CudaView<'a, f32>),
    /// `[m, k]` int8 or E4M3 codes and their f32 scales (per token, or per token and column block).
    Quantized {
        /// The codes, `m · k` bytes.
        codes: &'a CudaView<'a, u8>,
        /// The scales (at least as many as the activation kind has for `m` tokens).
        scales: &'a CudaSlice<f32>,
    },
}

/// A launch's shape as 32-bit kernel arguments (checked to fit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Output features (N, the weight's rows).
    pub n: i32,
    /// Input features (K, the weight's columns).
    pub k: i32,
    /// Tokens (m).
    pub m: i32,
}

/// The CUDA side of a weight format, implemented in the format's folder
/// (`linear/<format>/cuda.rs`): which kernel source and specialization its weights use, how
/// its kernels are launched, which activations they take, and which planes they read. A
/// format's `WeightMatrix::upload` returns a [`DeviceWeight`] built by
/// [`DeviceWeight::from_planes`] with this description; the launcher here talks to nothing else.
pub trait CudaFormat: Send + Sync + fmt::Debug {
    /// The `.cu` source of the format's kernels (listed in `linear::CUDA_SOURCES` for the
    /// compile gate).
    fn source(&self) -> &'static KernelSource;
    /// The specialization of [`CudaFormat::source`] this weight's kernels are compiled with
    /// (`NAME=value` defines, one of the source's variants; default: none).
    fn defines(&self) -> &'static [&'static str] {
        &[]
    }
    /// Kernel id for plans, e.g. `cuda.ggml.q4_1`, `cuda.w4a8.int4xint8.dp4a`.
    fn kernel_id(&self) -> String;
    /// Output rows per warp of the matmul kernel (its `TS_RW`): the grid is sized by it
    /// ([`matmul_grid`]; default 1).
    fn rows_per_warp(&self) -> usize {
        1
    }
    /// The activations the matmul kernel takes.
    fn activations(&self) -> CudaAct;
    /// Whether [`matmul`] hands batches of [`GEMM_MIN_TOKENS`] tokens or more to
    /// [`CudaFormat::launch_dequant`] and cuBLAS SGEMM (formats whose kernel dequantizes
    /// weights to f32 in registers and multiplies f32 activations).
    fn dequantizes(&self) -> bool {
        false
    }
    /// Checks the planes before any kernel reads them without bounds checks: their lengths for
    /// the shape ([`QuantPlanes::expect_lens`]), group and block sizes. The shape is nonzero and
    /// fits 32-bit kernel arguments (checked before).
    fn check(&self, planes: &QuantPlanes) -> Result<(), CudaError>;
    /// Launches the matmul kernel over `w` for the activations `x` into `y` (`[m, n]` f32), on
    /// the grid `cfg` ([`matmul_grid`] for the format's rows per warp). Lengths and alignment are
    /// checked, `m` is nonzero.
    fn launch_matmul(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        x: Activations<'_>,
        y: &mut CudaViewMut<'_, f32>,
        dims: Dims,
        cfg: LaunchConfig,
    ) -> Result<(), CudaError>;
    /// Launches the dequantization of the whole `[n, k]` matrix into `out` (`n · k` f32), one
    /// thread per 8 values (`chunks` = n·k / 8) on the grid `cfg` of [`ROW_THREADS`]-thread CTAs,
    /// for [`matmul_dequant_gemm`]; `None` (the default) where the format has no such kernel.
    fn launch_dequant(
        &self,
        dev: &CudaDevice,
        w: &DevicePlanes,
        k: i32,
        out: &mut CudaViewMut<'_, f32>,
        chunks: i64,
        cfg: LaunchConfig,
    ) -> Option<Result<(), CudaError>> {
        let _ = (dev, w, k, out, chunks, cfg);
        None
    }
    /// The entry of the format's embedding-gather kernel in its source, if it has one:
    /// `(codes, block scales or null, ids, rows, k, out)`, one CTA of [`ROW_THREADS`] per id.
    fn embedding_entry(&self) -> Option<&'static str> {
        None
    }
}

/// A weight's planes in device memory, as its format's kernels read them.
pub struct DevicePlanes {
    /// Codes: GGUF code plane or float data; int4 packed runs; int8 / E4M3 bytes.
    pub codes: CudaSlice<u8>,
    /// A byte scale plane (GGUF block headers: raw f16 `d`, or `d, m` pairs), if the format has one.
    pub block_scales: Option<CudaSlice<u8>>,
    /// f32 scales (int4 `[rows, groups]`, int8 `[rows]`, fp8 `[row blocks, col blocks]`), if any.
    pub scales: Option<CudaSlice<f32>>,
    /// Int8 zero points (int4 `[rows, groups]`, if asymmetric).
    pub zeros: Option<CudaSlice<i8>>,
}

/// A `[rows, cols]` weight matrix in device memory, in its storage type (never expanded), with
/// its format's CUDA description and the scratch its activation quantization needs (grown on
/// first use, see [`matmul`]).
pub struct DeviceWeight {
    rows: usize,
    cols: usize,
    format: Box<dyn CudaFormat>,
    storage: String,
    planes: DevicePlanes,
    scratch: Mutex<Option<ActScratch>>,
}

/// A weight matrix in host memory, laid out as its format's CUDA kernels read it, with the
/// format's CUDA description.
#[derive(Debug)]
pub struct QuantPlanes {
    /// The format's CUDA side (kernel, launch, activations, plane check).
    pub format: Box<dyn CudaFormat>,
    /// Storage for plans (the matrix's own description).
    pub storage: String,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Codes: GGUF code plane or float bytes, int4 packed runs row by row, int8 or E4M3 bytes.
    pub codes: Vec<u8>,
    /// A byte scale plane (GGUF block headers), if the format has one.
    pub block_scales: Option<Vec<u8>>,
    /// f32 scales: int4 `[rows, groups]`, int8 `[rows]`, fp8 `[row blocks, col blocks]`; empty
    /// for formats without (none is uploaded then).
    pub scales: Vec<f32>,
    /// Int4 zero points `[rows, groups]`, if asymmetric.
    pub zeros: Option<Vec<i8>>,
}

impl QuantPlanes {
    /// Checks what the kernels read without bounds checks: a nonzero shape that fits 32-bit
    /// kernel arguments, then the format's own check ([`CudaFormat::check`]).
    pub fn check(&self) -> Result<(), CudaError> {
        let (rows, cols) = (self.rows, self.cols);
        if rows == 0 || cols == 0 {
            return Err(shape(format!("empty {rows}x{cols} {} weight", self.storage)));
        }
        int(rows)?;
        int(cols)?;
        self.format.check(self)
    }

    /// An error naming the storage unless the planes have exactly these lengths:
    /// `(codes, block scales, scales, zeros)`, `None` for an absent plane.
    pub fn expect_lens(&self, codes: usize, block_scales: Option<usize>, scales: usize, zeros: Option<usize>) -> Result<(), CudaError> {
        let got = (self.codes.len(), self.block_scales.as_ref().map(Vec::len), self.scales.len(), self.zeros.as_ref().map(Vec::len));
        let want = (codes, block_scales, scales, zeros);
        if got != want {
            let (rows, cols) = (self.rows, self.cols);
            return Err(shape(format!(
                "{} planes for a {rows}x{cols} weight: {got:?} (codes, block scales, scales, zeros), expected {want:?}",
                self.storage
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

/// A [`CudaError::Shape`] with `msg`.
pub fn shape(msg: impl Into<String>) -> CudaError {
    CudaError::Shape(msg.into())
}

/// `v` as a 32-bit kernel argument, or an error saying it does not fit.
pub fn int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| shape(format!("{v} does not fit a 32-bit kernel argument")))
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

/// Launches a `quant_matmul` kernel of `fmt`'s source and specialization, the calling convention
/// the int4, int8 and fp8 sources share: `(codes, scales, zeros or null, activations as bytes,
/// activation scales or null, y, n, k, m, group, bh)`. For [`CudaFormat::launch_matmul`].
#[allow(clippy::too_many_arguments)]
pub fn launch_quant_matmul(
    dev: &CudaDevice,
    fmt: &dyn CudaFormat,
    w: &DevicePlanes,
    x: Activations<'_>,
    y: &mut CudaViewMut<'_, f32>,
    dims: Dims,
    group: usize,
    bh: usize,
    cfg: LaunchConfig,
) -> Result<(), CudaError> {
    let (group, bh) = (int(group)?, int(bh)?);
    let f = dev.function(fmt.source(), fmt.defines(), "quant_matmul")?;
    let scales = w.scales.as_ref().expect("quantized weights carry scales");
    let null = 0u64;
    let xf;
    let (xa, xs) = match x {
        Activations::F32(x) => {
            // SAFETY: reinterprets the f32 activations as their bytes (4 per value).
            xf = unsafe { x.transmute::<u8>(x.len() * 4) }.ok_or_else(|| shape("activation view"))?;
            (&xf, None)
        }
        Activations::Quantized { codes, scales } => (codes, Some(scales)),
    };
    let Dims { n, k, m } = dims;
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
    b.arg(y).arg(&n).arg(&k).arg(&m).arg(&group).arg(&bh);
    // SAFETY: argument types and order match `quant_matmul` (activations as raw bytes);
    // lengths and alignment checked by the launcher, weight planes checked at upload, scratch
    // checked by the callers.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

impl DeviceWeight {
    /// Uploads a matrix laid out by its format (each format's `upload` builds the planes and
    /// its [`CudaFormat`]). Refused ([`QuantPlanes::check`]) when the planes do not match the
    /// shape and format, or the shape is empty or too large for the kernels.
    pub fn from_planes(dev: &CudaDevice, p: QuantPlanes) -> Result<Self, CudaError> {
        p.check()?;
        let QuantPlanes { format, storage, rows, cols, codes, block_scales, scales, zeros } = p;
        let stream = dev.stream();
        let planes = DevicePlanes {
            codes: stream.clone_htod(&codes)?,
            block_scales: block_scales.map(|s| stream.clone_htod(&s)).transpose()?,
            scales: (!scales.is_empty()).then(|| stream.clone_htod(&scales)).transpose()?,
            zeros: zeros.map(|z| stream.clone_htod(&z)).transpose()?,
        };
        Ok(DeviceWeight { rows, cols, format, storage, planes, scratch: Mutex::new(None) })
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
        self.format.kernel_id()
    }

    /// The format's CUDA description.
    pub fn format(&self) -> &dyn CudaFormat {
        &*self.format
    }

    /// Codes and scales of scratch a call with `m` tokens needs (zero without activation
    /// quantization).
    fn scratch_need(&self, m: usize) -> (usize, usize) {
        self.format.activations().scratch_need(m, self.cols)
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
/// From [`GEMM_MIN_TOKENS`] tokens on, formats that [`CudaFormat::dequantizes`] (GGUF block
/// types, W4A16) are dequantized to f32 in the device's workspace and multiplied by cuBLAS SGEMM
/// (f32 math, no TF32: the same function, another summation order); [`matmul_direct`] always
/// takes the format's kernel.
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

/// [`matmul`] through the format's kernel at any batch size.
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
/// workspace ([`CudaFormat::launch_dequant`]), then `y = x · wᵀ` by cuBLAS SGEMM. Formats with
/// a dequantization kernel only (GGUF block types, int4; an error for the others).
pub fn matmul_dequant_gemm(dev: &CudaDevice, w: &DeviceWeight, x: &CudaView<'_, f32>, m: usize, y: &mut CudaViewMut<'_, f32>) -> Result<(), CudaError> {
    check_len("matmul x", x.len(), m * w.cols)?;
    check_len("matmul y", y.len(), m * w.rows)?;
    let (n, k) = (w.rows, w.cols);
    // One thread per 8 values (k is a multiple of 32 for the dequantizing formats).
    let chunks = (n * k / 8) as i64;
    let grid = u32::try_from((n * k / 8).div_ceil(ROW_THREADS as usize)).map_err(|_| shape(format!("{n} x {k} exceeds the grid")))?;
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let ki = int(k)?;
    dev.with_workspace(n * k, |ws| {
        let mut out = ws.slice_mut(..n * k);
        match w.format.launch_dequant(dev, &w.planes, ki, &mut out, chunks, cfg) {
            Some(launched) => launched?,
            None => return Err(shape(format!("{} is multiplied by its own kernel, not dequantized", w.storage))),
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
    let dims = Dims { n: int(w.rows)?, k: int(w.cols)?, m: int(m)? };
    let act = w.format.activations();
    if act == CudaAct::F32 {
        return w.format.launch_matmul(dev, &w.planes, Activations::F32(x), y, dims, cfg);
    }
    let s = scratch.expect("callers provide scratch for quantized activations");
    let (nc, ns) = w.scratch_need(m);
    {
        let mut q = s.codes.slice_mut(..nc);
        let mut qs = s.scales.slice_mut(..ns);
        match act {
            CudaAct::Fp8PerBlock { bw } => quantize_fp8_rows(dev, x, m, w.cols, bw, &mut q, &mut qs)?,
            _ => quantize_int8_rows(dev, x, m, w.cols, &mut q, &mut qs)?,
        }
    }
    let codes = s.codes.slice(..nc);
    w.format.launch_matmul(dev, &w.planes, Activations::Quantized { codes: &codes, scales: &s.scales }, y, dims, cfg)
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

/// Gathers rows `ids` of a `table` whose format has a gather kernel
/// ([`CudaFormat::embedding_entry`]: GGUF types) into `out` (`[ids.len(), table.cols()]` f32).
/// Ids are not visible to the launcher: the kernel writes a row of zeros for an id outside
/// `0..table.rows()` and never reads out of bounds; host callers validate ids.
pub fn embedding(
    dev: &CudaDevice,
    table: &DeviceWeight,
    ids: &CudaSlice<i32>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<(), CudaError> {
    let Some(entry) = table.format.embedding_entry() else {
        return Err(shape(format!("embedding: {} tables are not supported (GGUF types only)", table.storage)));
    };
    check_len("embedding out", out.len(), ids.len() * table.cols)?;
    if ids.is_empty() {
        return Ok(());
    }
    let f = dev.function(table.format.source(), table.format.defines(), entry)?;
    let n = u32::try_from(ids.len()).map_err(|_| shape(format!("{} ids exceed the grid", ids.len())))?;
    let cfg = LaunchConfig { grid_dim: (n, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
    let (rows, k) = (int(table.rows)?, int(table.cols)?);
    let null = 0u64;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&table.planes.codes);
    match &table.planes.block_scales {
        Some(s) => b.arg(s),
        None => b.arg(&null),
    };
    b.arg(ids).arg(&rows).arg(&k).arg(out);
    // SAFETY: argument types and order match the gather convention (`embedding_rows`); `out`
    // holds ids × cols values and the kernel bounds-checks each id against `rows`.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::fp8::cuda::Fp8Cuda;
    use crate::linear::int4::cuda::Int4Cuda;
    use crate::linear::int8::cuda::Int8Cuda;

    /// The planes a format hands over are checked before any kernel reads them unchecked.
    #[test]
    fn planes_that_do_not_fit_their_format_are_refused() {
        let planes = |format: Box<dyn CudaFormat>, codes: usize, scales: usize, zeros: Option<usize>| QuantPlanes {
            format,
            storage: "test".into(),
            rows: 3,
            cols: 64,
            codes: vec![0; codes],
            block_scales: None,
            scales: vec![1.0; scales],
            zeros: zeros.map(|n| vec![0; n]),
        };
        let int4 = |group, int8_act| -> Box<dyn CudaFormat> { Box::new(Int4Cuda { group, int8_act }) };
        let fp8 = |bh, bw| -> Box<dyn CudaFormat> { Box::new(Fp8Cuda { bh, bw }) };
        assert!(planes(int4(32, false), 96, 6, Some(6)).check().is_ok());
        assert!(planes(int4(64, true), 96, 3, None).check().is_ok());
        assert!(planes(Box::new(Int8Cuda), 192, 3, None).check().is_ok());
        assert!(planes(fp8(2, 32), 192, 4, None).check().is_ok());
        for bad in [
            planes(int4(32, false), 95, 6, Some(6)),
            planes(int4(32, false), 96, 6, Some(5)),
            planes(int4(0, false), 96, 6, None),
            planes(Box::new(Int8Cuda), 192, 2, None),
            planes(Box::new(Int8Cuda), 192, 3, Some(3)),
            planes(fp8(0, 32), 192, 4, None),
            planes(fp8(2, 32), 192, 3, None),
        ] {
            assert!(bad.check().is_err(), "{:?} accepted", (&bad.format, bad.codes.len(), bad.scales.len()));
        }
        let mut with_block_scales = planes(Box::new(Int8Cuda), 192, 3, None);
        with_block_scales.block_scales = Some(vec![0; 6]);
        assert!(with_block_scales.check().is_err());
        let empty = QuantPlanes { rows: 0, codes: vec![], scales: vec![], ..planes(Box::new(Int8Cuda), 0, 0, None) };
        assert!(empty.check().is_err());
    }

    /// What the launcher asks of each format: the same kernels, launch shapes and activations
    /// the formats had before they described themselves.
    #[test]
    fn formats_describe_their_kernels() {
        let int4 = Int4Cuda { group: 128, int8_act: false };
        assert_eq!((int4.kernel_id(), int4.rows_per_warp(), int4.activations(), int4.dequantizes()), ("cuda.w4a16.int4xf32".into(), 4, CudaAct::F32, true));
        let int4 = Int4Cuda { group: 128, int8_act: true };
        assert_eq!((int4.kernel_id(), int4.rows_per_warp(), int4.activations(), int4.dequantizes()), ("cuda.w4a8.int4xint8.dp4a".into(), 1, CudaAct::Int8PerToken, false));
        assert_eq!((Int8Cuda.kernel_id(), Int8Cuda.rows_per_warp(), Int8Cuda.activations(), Int8Cuda.dequantizes()), ("cuda.w8a8.int8xint8.dp4a".into(), 1, CudaAct::Int8PerToken, false));
        let fp8 = Fp8Cuda { bh: 128, bw: 64 };
        assert_eq!((fp8.kernel_id(), fp8.rows_per_warp(), fp8.activations(), fp8.dequantizes()), ("cuda.w8a8.fp8xfp8".into(), 1, CudaAct::Fp8PerBlock { bw: 64 }, false));
        assert_eq!(CudaAct::Fp8PerBlock { bw: 64 }.scratch_need(3, 100), (300, 6));
        assert_eq!(CudaAct::Int8PerToken.scratch_need(3, 100), (300, 3));
        assert_eq!(CudaAct::F32.scratch_need(3, 100), (0, 0));
        // Every format's specialization is one its source is compiled in by the gate.
        for f in [&int4 as &dyn CudaFormat, &Int4Cuda { group: 32, int8_act: false }, &Int8Cuda, &fp8] {
            assert!(f.source().variants.contains(&f.defines()), "{f:?}");
            assert!(crate::linear::CUDA_SOURCES.iter().any(|s| s.name == f.source().name), "{f:?}");
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
}
