//! The GGML format: `y = x · Wᵀ` over weights kept in their GGML storage type (GGUF block
//! types and plain floats), as [`GgmlMatrix`] and its op [`GgmlLinear`].
//!
//! Two paths, chosen per sequence segment by its token count (see [`LinearPolicy`]):
//! - **the small path**: for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the k-quants Q2_K..Q6_K, activations are quantized per token to
//!   8-bit blocks of 32 (llama.cpp's activation quantization of the 32-value types; for the
//!   k-quants on the AVX2 level, super-blocks of 256 with power-of-two block scales, [`q8k`])
//!   and multiplied with the weights regrouped eight rows at a time ([`Interleaved`]) by an
//!   integer GEMM, one scale epilogue per eight rows and one or two fmas per block (per
//!   super-block for [`q8k`]); by default on AVX2 these types take this path at every batch
//!   size. Other types dequantize each weight row and use an f32 dot.
//! - **the GEMM path (long segments)**: weight rows are dequantized into packed,
//!   cache-resident f32 slivers and multiplied with a GEMM micro-kernel (`linear::ggml::sgemm` on AVX2,
//!   the `gemm` crate's elsewhere); activations stay f32.
//!
//! A [`LinearKernel`] is selected once per layer at load and prints as a kernel id, so the
//! per-layer plan is data.

pub mod cuda;
mod float_rows;
pub mod interleaved;
pub mod kquant;
mod matrix;
mod out_rows;
pub mod q8k;
#[cfg(target_arch = "x86_64")]
pub mod sgemm;

pub use matrix::{GgmlLinear, GgmlMatrix, WeightBytes};
pub use out_rows::OutRows;

use super::LinearPolicy;
use crate::cpu::caps::{CpuCaps, Isa};
use crate::cpu::{pool, SyncPtr};
use crate::cpu::dot::dot_f32;
use crate::cpu::scratch::{with_f32, with_scratch};
use crate::cpu::GemmLevel;
use interleaved::{Interleaved, GROUP};
use crate::ggml::act_quant::{quantize_q8, quantize_q8k, Q8Block, Q8KBlock, Q8K_BLOCK, Q8_BLOCK};
use crate::ggml::{dequantize_row, GgmlType};
use rayon::prelude::*;
use std::fmt;

/// A borrowed weight matrix: `rows` output features of `cols` inputs, row-major in GGML blocks.
#[derive(Clone, Copy, Debug)]
pub struct WeightView<'a> {
    /// Storage type of every row.
    pub ty: GgmlType,
    /// Output features (N).
    pub rows: usize,
    /// Input features (K).
    pub cols: usize,
    /// `rows * ty.row_bytes(cols)` bytes.
    pub data: &'a [u8],
}

impl<'a> WeightView<'a> {
    /// Checks that `data` matches the type and shape.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, String> {
        let rb = ty
            .row_bytes(cols)
            .ok_or_else(|| format!("{cols} columns is not a multiple of {}'s block size {}", ty, ty.block_size()))?;
        if rows.checked_mul(rb) != Some(data.len()) {
            return Err(format!("{} bytes for {rows}x{cols} {ty} (expected {rows}x{rb})", data.len()));
        }
        Ok(WeightView { ty, rows, cols, data })
    }

    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.data.len() / self.rows;
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// A weight matrix in the layout a kernel reads.
#[derive(Clone, Copy, Debug)]
pub enum Weight<'a> {
    /// GGML rows as stored in the file (every type).
    Rows(WeightView<'a>),
    /// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K..Q6_K rows regrouped for the integer GEMM.
    Interleaved(&'a Interleaved),
}

impl Weight<'_> {
    /// Storage type.
    pub fn ty(&self) -> GgmlType {
        match self {
            Weight::Rows(w) => w.ty,
            Weight::Interleaved(w) => w.ty(),
        }
    }

    /// Output features (N).
    pub fn rows(&self) -> usize {
        match self {
            Weight::Rows(w) => w.rows,
            Weight::Interleaved(w) => w.rows(),
        }
    }

    /// Input features (K).
    pub fn cols(&self) -> usize {
        match self {
            Weight::Rows(w) => w.cols,
            Weight::Interleaved(w) => w.cols(),
        }
    }

    /// Row `r` as f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self {
            Weight::Rows(w) => dequantize_row(w.ty, w.row(r), out),
            Weight::Interleaved(w) => w.dequantize_row(r, out),
        }
    }
}

/// How small batches are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SmallPath {
    /// Integer GEMM of interleaved weights with per-token Q8 activations.
    Integer,
    /// Dequantize the weight row, f32 dot.
    DequantDot,
}

/// The token count from which a small path at an ISA level switches to the panel GEMM.
fn min_tokens(policy: LinearPolicy, small: SmallPath, isa: Isa) -> usize {
    match (small, isa) {
        (SmallPath::Integer, Isa::Avx2) => policy.integer_gemm_min_tokens,
        _ => policy.gemm_min_tokens,
    }
}

/// The activation blocking of the integer small path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActBlocks {
    /// One scale per 32 values ([`Q8Block`], llama.cpp's Q8_0 / Q8_1): every level.
    Of32,
    /// Super-blocks of 256 values, one unit each and every 32 values at a power-of-two
    /// multiple of it ([`Q8KBlock`]): the k-quants on the AVX2 level ([`q8k`]).
    Of256,
}

/// The kernel chosen for one weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearKernel {
    ty: GgmlType,
    isa: Isa,
    small: SmallPath,
    blocks: ActBlocks,
    policy: LinearPolicy,
}

impl LinearKernel {
    /// Picks the kernel for weights of type `ty` on this CPU.
    pub fn select(ty: GgmlType, caps: &CpuCaps, policy: LinearPolicy) -> Self {
        Self::with_isa(ty, caps.best_isa(), policy)
    }

    /// Picks the kernel for an explicit ISA level (tests use this to compare paths). The
    /// k-quants take per-256 activations where the integer level is AVX2 (see [`q8k`]),
    /// per-32 ones on the scalar and AVX-512 levels.
    pub fn with_isa(ty: GgmlType, isa: Isa, policy: LinearPolicy) -> Self {
        let small = if Interleaved::supports(ty) { SmallPath::Integer } else { SmallPath::DequantDot };
        let blocks = if q8k::supports(ty) && GemmLevel::for_isa(isa) == GemmLevel::Avx2 { ActBlocks::Of256 } else { ActBlocks::Of32 };
        LinearKernel { ty, isa, small, blocks, policy }
    }

    /// This kernel with the given activation blocking, where the type has kernels for it (the
    /// k-quants have both; other types keep [`ActBlocks::Of32`]). Benchmarks compare the two.
    pub fn with_blocks(self, blocks: ActBlocks) -> Self {
        let blocks = if q8k::supports(self.ty) { blocks } else { ActBlocks::Of32 };
        LinearKernel { blocks, ..self }
    }

    /// Computes `y[i, j] = Σ_k x[i, k] · W[j, k]` for `m` tokens.
    ///
    /// `x` is `m × cols` row-major; row `i` of the output starts at `y[i * ldy]` and has
    /// `rows` values (so several matrices can write side by side into one buffer).
    ///
    /// # Panics
    /// On shape mismatch, or if a type with an integer kernel comes as [`Weight::Rows`] while
    /// this batch takes the small path (such weights must be [`Interleaved::pack`]ed).
    pub fn forward(&self, w: Weight<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
        forward_group(&[(self, w, 0)], x, &[m], y, ldy);
    }

    /// The integer level that runs this kernel: per-256 activations have no AVX-512 kernels,
    /// so there the AVX2 ones.
    fn level(&self) -> GemmLevel {
        match (self.blocks, GemmLevel::for_isa(self.isa)) {
            (ActBlocks::Of256, GemmLevel::Avx512Vnni) => GemmLevel::Avx2,
            (_, level) => level,
        }
    }

    /// Whether this kernel's small-batch path reads [`Interleaved`] weights.
    pub fn wants_interleaved(&self) -> bool {
        self.small == SmallPath::Integer
    }

    /// The large-batch path: the AVX2 dequantizing micro-kernel, or the portable `gemm` crate.
    fn gemm(&self, w: &Weight<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => sgemm::dequant_sgemm(w, x, m, y, ldy),
            _ => panel_gemm(w, x, m, y, ldy),
        }
    }

    /// What the kernel does with activations: `q8 blocks` (integer GEMM), `f32`, or both
    /// with the switch point.
    pub fn activations(&self) -> String {
        match (self.small, min_tokens(self.policy, self.small, self.isa)) {
            (SmallPath::DequantDot, _) | (SmallPath::Integer, 1) => "f32".into(),
            (SmallPath::Integer, usize::MAX) => self.block_name().into(),
            (SmallPath::Integer, t) => format!("{} (m<{t}) | f32", self.block_name()),
        }
    }

    /// The integer path's activations: `q8 blocks` (per 32 values) or `q8_k blocks`.
    fn block_name(&self) -> &'static str {
        match self.blocks {
            ActBlocks::Of32 => "q8 blocks",
            ActBlocks::Of256 => "q8_k blocks",
        }
    }

    /// Kernel id for plans, e.g. `cpu.q4_1x8*q8_1.avx512vnni` or
    /// `cpu.dequant-dot.bf16.avx2 (m<32) | cpu.dequant-sgemm.6x16.avx2 (m>=32)`.
    pub fn id(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for LinearKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let small = match self.small {
            SmallPath::Integer => {
                let w = self.ty.name().to_lowercase();
                // Types with mins also use the activation blocks' sums.
                let a = if self.blocks == ActBlocks::Of256 {
                    "q8_k"
                } else if matches!(self.ty, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q2K | GgmlType::Q4K | GgmlType::Q5K) {
                    "q8_1"
                } else {
                    "q8_0"
                };
                format!("cpu.{w}x{GROUP}*{a}.{}", self.level().name())
            }
            SmallPath::DequantDot => format!("cpu.dequant-dot.{}.{}", self.ty.name().to_lowercase(), self.isa.name()),
        };
        let large = match self.isa {
            Isa::Avx2 => "cpu.dequant-sgemm.6x16.avx2",
            Isa::Scalar => "cpu.panel-gemm.f32",
        };
        match min_tokens(self.policy, self.small, self.isa) {
            usize::MAX => f.write_str(&small),
            1 => f.write_str(large),
            t => write!(f, "{small} (m<{t}) | {large} (m>={t})"),
        }
    }
}


/// Runs several matrices that read the same input `x` and write side by side into `y`
/// (fused Q/K/V or gate/up): `(kernel, weights, first output column)` each.
///
/// `segments` are the token counts of the sequences whose rows make up `x`, in order. Each
/// segment takes the path its own length selects (the small path below the kernel's switch
/// point, the f32 GEMM from it; under [`LinearPolicy::DEFAULT`] the integer types never
/// switch on AVX2), and both paths compute every output row independently of the others, so
/// a sequence's results are bit-identical whatever it is batched with.
pub fn forward_group(
    parts: &[(&LinearKernel, Weight<'_>, usize)],
    x: &[f32],
    segments: &[usize],
    y: &mut [f32],
    ldy: usize,
) {
    let Some(&(_, first, _)) = parts.first() else { return };
    let k = first.cols();
    let m: usize = segments.iter().sum();
    assert_eq!(x.len(), m * k, "activation shape");
    if m == 0 {
        return;
    }
    for (kern, w, _) in parts {
        assert_eq!(w.ty(), kern.ty, "kernel selected for {} used on {}", kern.ty, w.ty());
        assert_eq!(w.cols(), k, "grouped matrices must share their input width");
    }
    // The tasks write their (matrix, row) columns in place.
    super::check_output_columns(parts.iter().map(|(_, w, col)| (*col, w.rows())), m, ldy, y.len());
    // Matrices of different types may switch paths at different lengths (an integer Q4_1
    // next to a dequantized Q6_K): each switch point runs as its own group.
    let mut switches: Vec<usize> = parts.iter().map(|(kern, _, _)| min_tokens(kern.policy, kern.small, kern.isa)).collect();
    switches.sort_unstable();
    switches.dedup();
    for switch in switches {
        let class: Vec<_> = parts.iter().copied().filter(|(kern, _, _)| min_tokens(kern.policy, kern.small, kern.isa) == switch).collect();
        forward_class(&class, switch, x, segments, y, ldy);
    }
}

/// [`forward_group`] for matrices that share one switch point: segments of at least `switch`
/// tokens take the panel GEMM, the others the small path.
fn forward_class(parts: &[(&LinearKernel, Weight<'_>, usize)], switch: usize, x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
    let k = parts[0].1.cols();
    let m: usize = segments.iter().sum();
    let (mut gemm_rows, mut dot_rows) = (Vec::new(), Vec::new());
    let mut r = 0;
    for &len in segments {
        if len >= switch { &mut gemm_rows } else { &mut dot_rows }.extend(r..r + len);
        r += len;
    }
    if gemm_rows.len() == m {
        for &(kern, w, col) in parts {
            kern.gemm(&w, x, m, &mut y[col..], ldy);
        }
    } else if !gemm_rows.is_empty() {
        let gm = gemm_rows.len();
        let xg: Vec<f32> = gemm_rows.iter().flat_map(|&i| x[i * k..(i + 1) * k].iter().copied()).collect();
        for &(kern, w, col) in parts {
            let n = w.rows();
            let mut yg = vec![0f32; gm * n];
            kern.gemm(&w, &xg, gm, &mut yg, n);
            for (t, &i) in gemm_rows.iter().enumerate() {
                y[i * ldy + col..i * ldy + col + n].copy_from_slice(&yg[t * n..(t + 1) * n]);
            }
        }
    }
    if !dot_rows.is_empty() {
        dot_path(parts, x, &dot_rows, y, ldy);
    }
}

/// Token rows per parallel task of [`quantize_rows`]: a decode step's few rows stay on the
/// calling thread.
const QUANT_ROWS: usize = 16;

/// The given rows of `x` (`k` wide) quantized by `quantize` into `per_row` blocks each of
/// `out`, one run per row in order, the rows spread over the pool (a prefill's quantization
/// was serial work, 2% of a serving run on two cores, the other thread waiting). Each row's
/// blocks are the same wherever it runs.
fn quantize_rows<B: Send>(x: &[f32], k: usize, rows: &[usize], per_row: usize, out: &mut [B], quantize: impl Fn(&[f32], &mut [B]) + Sync) {
    assert_eq!(out.len(), rows.len() * per_row, "activation blocks");
    if per_row > 0 {
        pool::for_each_chunk(out, QUANT_ROWS * per_row, |c, blocks| {
            for (&i, ab) in rows[c * QUANT_ROWS..].iter().zip(blocks.chunks_exact_mut(per_row)) {
                quantize(&x[i * k..(i + 1) * k], ab);
            }
        });
    }
}

/// The small-batch path over the given rows of `x`: one activation quantization (into this
/// thread's reused buffers: a prefill's blocks are megabytes, fresh pages on every call
/// otherwise), one parallel region over every weight row of every part.
fn dot_path(parts: &[(&LinearKernel, Weight<'_>, usize)], x: &[f32], rows: &[usize], y: &mut [f32], ldy: usize) {
    let k = parts[0].1.cols();
    // One quantization per activation blocking the parts use (a Q4_K next to a Q5_0 needs both).
    let uses = |blocks: ActBlocks| parts.iter().any(|(kern, _, _)| kern.small == SmallPath::Integer && kern.blocks == blocks);
    let per_row = |blocks: ActBlocks, n: usize| if uses(blocks) { n } else { 0 };
    let (nb, nsb) = (per_row(ActBlocks::Of32, k / Q8_BLOCK), per_row(ActBlocks::Of256, k / Q8K_BLOCK));
    with_scratch(rows.len() * nb, |acts: &mut [Q8Block]| {
        with_scratch(rows.len() * nsb, |acts_k: &mut [Q8KBlock]| {
            quantize_rows(x, k, rows, nb, acts, quantize_q8);
            quantize_rows(x, k, rows, nsb, acts_k, quantize_q8k);
            dot_tasks(parts, x, rows, acts, acts_k, y, ldy);
        })
    });
}

/// [`dot_path`]'s parallel region, given the rows' activation blocks (those of a blocking no
/// part uses are empty).
fn dot_tasks(parts: &[(&LinearKernel, Weight<'_>, usize)], x: &[f32], rows: &[usize], acts: &[Q8Block], acts_k: &[Q8KBlock], y: &mut [f32], ldy: usize) {
    let k = parts[0].1.cols();
    // Tasks are (part, weight-row range) pairs over all parts, in whole pairs of groups (the
    // AVX-512 kernel takes two at a time).
    let tasks = super::row_tasks(&parts.iter().map(|(_, w, _)| w.rows()).collect::<Vec<_>>(), 2 * GROUP);
    // Adjacent token rows (every segment on this path when none takes the GEMM) let a task
    // whose weight rows are whole groups write its columns of y in place; otherwise it writes
    // a tile and copies it.
    debug_assert!(!rows.is_empty(), "the small path runs for some token rows");
    let adjacent = rows.windows(2).all(|r| r[1] == r[0] + 1);
    let out = SyncPtr::new(y.as_mut_ptr());
    pool::for_each(tasks.len(), |ti| {
        let (p, r0, r1) = tasks[ti];
        let (kern, w, col) = parts[p];
        match (kern.small, w) {
            (SmallPath::Integer, Weight::Interleaved(w)) => {
                let (g0, g1) = (r0 / GROUP, r1.div_ceil(GROUP));
                let width = (g1 - g0) * GROUP;
                let gemm = |out: OutRows<'_>| match kern.blocks {
                    ActBlocks::Of32 => w.gemm_into(kern.level(), g0, g1, acts, rows.len(), out),
                    ActBlocks::Of256 => w.gemm_q8k_into(kern.level(), g0, g1, acts_k, rows.len(), out),
                };
                if adjacent && r1 - r0 == width {
                    // SAFETY: columns col + r0..col + r1 of output rows rows[0].. (adjacent) are
                    // inside y (asserted by the caller) and belong to this task alone.
                    return gemm(unsafe { OutRows::strided(out.get().add(rows[0] * ldy + col + r0), rows.len(), width, ldy) });
                }
                with_f32(rows.len() * width, |tile| {
                    gemm(OutRows::dense(tile, rows.len(), width));
                    for (&i, res) in rows.iter().zip(tile.chunks_exact(width)) {
                        // SAFETY: columns col + r0..col + r1 of output row i are inside y
                        // (asserted by the caller) and belong to this task alone.
                        let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(i * ldy + col + r0), r1 - r0) };
                        dst.copy_from_slice(&res[..r1 - r0]);
                    }
                });
            }
            (SmallPath::Integer, Weight::Rows(_)) => {
                panic!("{} weights reach the integer kernel as GGML rows: pack them with Interleaved::pack", kern.ty)
            }
            #[cfg(target_arch = "x86_64")]
            (SmallPath::DequantDot, Weight::Rows(w)) if kern.isa == Isa::Avx2 && float_rows::supports(w.ty) => {
                let emit = |r: usize, i: usize, v: f32| {
                    // SAFETY: (i, col + r) is inside y (asserted by the caller); each (part,
                    // weight row) belongs to one task.
                    unsafe { *out.get().add(i * ldy + col + r) = v };
                };
                // SAFETY: Isa::Avx2 is AVX2 + FMA + F16C (the kernel was built for it); the
                // rows are w's, the tokens' rows lie inside x (asserted by the caller).
                unsafe { float_rows::dot_rows(&w, r0, r1, x, rows, emit) };
            }
            (SmallPath::DequantDot, w) => {
                let mut buf = vec![0f32; k];
                for r in r0..r1 {
                    w.dequantize_row(r, &mut buf);
                    for &i in rows {
                        // SAFETY: (i, col + r) is inside y (asserted by the caller); each
                        // (part, weight row) belongs to one task.
                        unsafe { *out.get().add(i * ldy + col + r) = dot_f32(kern.isa, &buf, &x[i * k..(i + 1) * k]) };
                    }
                }
            }
        }
    });
}

/// Bytes of f32 weights dequantized per GEMM call: large enough that the GEMM's own cache
/// blocking and threading work on a real matrix, small enough to stay in L3.
const GEMM_CHUNK_BYTES: usize = 8 << 20;

/// Reusable f32 chunk buffers (avoids a multi-MiB allocation and its page faults per call).
/// A pool, not a thread-local: a worker waiting inside one GEMM may steal and run another.
static CHUNKS: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

/// A buffer taken from [`CHUNKS`], returned on drop.
struct Chunk(Vec<f32>);

impl Chunk {
    fn take(len: usize) -> Self {
        let mut v = CHUNKS.lock().map(|mut p| p.pop()).ok().flatten().unwrap_or_default();
        if v.len() < len {
            v.resize(len, 0.0);
        }
        Chunk(v)
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let Ok(mut p) = CHUNKS.lock() {
            p.push(std::mem::take(&mut self.0));
        }
    }
}

/// Dequantizes chunks of weight rows to f32 (in parallel) and multiplies each with one
/// multi-threaded GEMM call.
fn panel_gemm(w: &Weight<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    let (n_rows, k) = (w.rows(), w.cols());
    let chunk_rows = (GEMM_CHUNK_BYTES / (4 * k)).clamp(16, n_rows.max(16));
    let threads = rayon::current_num_threads();
    {
        let mut buf = Chunk::take(chunk_rows.min(n_rows) * k);
        let mut r0 = 0;
        while r0 < n_rows {
            let n = chunk_rows.min(n_rows - r0);
            let panel = &mut buf.0[..n * k];
            panel.par_chunks_mut(16 * k).enumerate().for_each(|(i, dst)| {
                for (j, row) in dst.chunks_exact_mut(k).enumerate() {
                    w.dequantize_row(r0 + i * 16 + j, row);
                }
            });
            // Split the tokens across the pool; each part is a single-threaded GEMM over the
            // shared chunk (rows of x and y are disjoint between parts).
            let parts = if m >= 64 { threads } else { 1 };
            let rows_per = m.div_ceil(parts);
            let out = SyncPtr::new(y.as_mut_ptr());
            let panel: &[f32] = panel;
            (0..parts).into_par_iter().for_each(|p| {
                let i0 = p * rows_per;
                let mi = rows_per.min(m.saturating_sub(i0));
                if mi == 0 {
                    return;
                }
                // SAFETY: dst is the mi x n block at (i0, r0) with row stride ldy, in bounds by the
                // checks in forward and disjoint between parts. lhs is rows i0.. of x (row-major,
                // k wide); rhs is the panel transposed (k x n; element (kk, j) at panel[j * k + kk]).
                unsafe {
                    gemm::gemm(
                        mi,
                        n,
                        k,
                        out.get().add(i0 * ldy + r0),
                        1,
                        ldy as isize,
                        false,
                        x.as_ptr().add(i0 * k),
                        1,
                        k as isize,
                        panel.as_ptr(),
                        k as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        if parts == 1 && threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None },
                    );
                }
            });
            r0 += n;
        }
    }
}
