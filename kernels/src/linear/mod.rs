//! Linear layers `y = x · Wᵀ`: one folder per weight storage format, behind two traits.
//!
//! - [`WeightMatrix`]: a weight matrix in its storage format. It knows its shape, how to
//!   describe itself in a plan, its scalar dequantization (the reference its kernels are tested
//!   against), where a tensor-parallel cut may fall and how to make one without
//!   re-quantizing, which activations it runs with ([`WeightMatrix::op`], the layer's
//!   activation policy) and how it goes to a GPU ([`WeightMatrix::upload`]).
//! - [`LinearOp`]: the matrix with its kernel chosen (ISA level, activation handling). Layers
//!   that read one input (fused Q/K/V, gate/up) run together through [`forward_fused`], which
//!   groups them by their concrete op type and hands each group to that type's own fused path
//!   (one activation quantization, one parallel region).
//!
//! Formats, one folder each: [`ggml`] (GGUF block types and plain floats), [`int4`] (W4A16,
//! W4A8), [`int8`] (W8A8 int8), [`fp8`] (W8A8 FP8). The last three share [`rowwise`], the
//! driver for formats whose kernel multiplies a range of weight rows with activations prepared
//! once per call ([`act`]): such a format implements [`rowwise::RowKernel`] and is a
//! [`WeightMatrix`] through it; those with per-token int8 activations also implement
//! [`int8_rows::Int8Rows`] (the level dispatch around their scalar and SIMD kernels). A format
//! with a GPU kernel keeps it in its folder too: the CUDA C source (`linear_<format>.cu`) and a
//! `cuda.rs` declaring it and implementing [`cuda::CudaFormat`], which the shared launcher
//! ([`cuda`]) talks to; its source is one row of [`CUDA_SOURCES`]. The recipe for a new format is in `docs/architecture.md`
//! ("Adding a weight format"); `kernels/tests/it/toy_format.rs` follows it.
//!
//! Every op computes each output element independently of the other tokens in the batch, so
//! a sequence's results are bit-identical whatever it is batched with.

pub mod act;
pub mod cuda;
pub mod fp8;
pub mod ggml;
pub mod int4;
pub mod int8;
pub mod int8_rows;
pub(crate) mod int_dot_avx2;
pub mod rowwise;

pub use act::ActQuant;
pub use fp8::{Fp8Kernel, Fp8Matrix};
pub use int4::Int4Matrix;
pub use int8::Int8Matrix;
pub use int8_rows::Int8Rows;
pub use rowwise::{Prepared, RowKernel, RowwiseLinear};

use crate::cpu::caps::CpuCaps;
use crate::cuda::device::CudaDevice;
use crate::cuda::source::KernelSource;
use crate::cuda::CudaError;
use cuda::DeviceWeight;
use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// The CUDA kernel sources of the weight formats, one row per format (each declared in its
/// folder's `cuda.rs`), and the activation quantization they share. The NVRTC compile gate
/// compiles every one in every specialization, beside `cuda::source::all()`.
pub const CUDA_SOURCES: &[&KernelSource] =
    &[&ggml::cuda::LINEAR_GGML, &int4::cuda::LINEAR_INT4, &int8::cuda::LINEAR_INT8, &fp8::cuda::LINEAR_FP8, &cuda::ACT_QUANT];

/// A weight matrix in its storage format: `rows` output features of `cols` inputs.
pub trait WeightMatrix: Send + Sync + fmt::Debug {
    /// Output features (N).
    fn rows(&self) -> usize;
    /// Input features (K).
    fn cols(&self) -> usize;
    /// Bytes held (values and scales).
    fn bytes(&self) -> usize;
    /// Storage for plans, e.g. `Q4_1`, `int4 g128 asym`, `fp8 block 128x128`.
    fn storage(&self) -> String;
    /// Row `r` as f32: the scalar reference of every kernel over this format.
    fn dequantize_row(&self, r: usize, out: &mut [f32]);
    /// The granularity of the input columns: a tensor-parallel column cut must fall on a
    /// multiple of it (a GGUF block, a scale group or block, the kernels' 32-column runs).
    fn col_align(&self) -> usize;
    /// The granularity of the output rows (a scale block's height; 1 otherwise).
    fn row_align(&self) -> usize {
        1
    }
    /// The part `rows × cols` (a tensor-parallel shard), its values and scales copied or
    /// shared, never re-quantized; refused, with the reason, when the cut would split a block
    /// or scale group.
    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Arc<dyn WeightMatrix>, String>;
    /// The layer's op: the kernel for this CPU with the activations this format runs with,
    /// given the ones the checkpoint prescribes (`act`) and the run's `policy` (a weight-only
    /// int4 layer may take int8 or bf16 activations). `perm` gathers input column `perm[c]`
    /// into position `c` first (act-order checkpoints); formats without it refuse one.
    fn op(self: Arc<Self>, act: ActQuant, perm: Option<Vec<u32>>, caps: &CpuCaps, policy: LinearPolicy) -> Result<Box<dyn LinearOp>, String>;
    /// The matrix on a GPU with its CUDA kernel, for activations `act`: the format lays out its
    /// planes and describes its kernel ([`cuda::CudaFormat`], implemented in its folder's
    /// `cuda.rs`) for [`DeviceWeight::from_planes`]; refused with an error naming the format
    /// where it has no CUDA kernel.
    fn upload(&self, dev: &CudaDevice, act: ActQuant) -> Result<DeviceWeight, CudaError>;
}

/// What a plan prints for one op.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpPlan {
    /// Storage, e.g. `Q4_1`, `int4 g128 sym`.
    pub storage: String,
    /// Run-time activation handling (`f32`, `int8/token`, `q8 blocks`, ...).
    pub activations: String,
    /// Kernel id, e.g. `cpu.q4_1x8*q8_1.avx512vnni`, `cpu.w4a8.int4xint8.avx2`.
    pub kernel: String,
    /// Where the op runs differently from what the checkpoint prescribes, why.
    pub note: Option<String>,
}

/// A weight matrix with its kernel chosen: `y = x · Wᵀ` over a batch of tokens.
pub trait LinearOp: Send + Sync + fmt::Debug + Any {
    /// Output features (N).
    fn rows(&self) -> usize;
    /// Input features (K).
    fn cols(&self) -> usize;
    /// Row `r` as f32, in the input's column order.
    fn dequantize_row(&self, r: usize, out: &mut [f32]);
    /// Storage, activations and kernel, for plans.
    fn plan(&self) -> OpPlan;
    /// Runs `group`, ops of this op's own concrete type (it may downcast them) that read the
    /// same input `x`, each writing `y[i * ldy + col + j]` for its `(op, col)`, every one of
    /// them (`y` may hold stale values: it is overwritten, never added to). `segments` are
    /// the token counts of the sequences whose rows make up `x`, in order.
    fn forward_group(&self, group: &[(&dyn LinearOp, usize)], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize);
    /// Hands back the pages of weights the op reads in place from a mapped file, when it is
    /// about to be dropped (nothing for weights held in memory of their own).
    fn release_pages(&self) {}
}

/// Runs ops that read the same input `x` and write side by side into `y` (fused Q/K/V or
/// gate/up): `(op, first output column)` each. Ops of one concrete type run as one group
/// through [`LinearOp::forward_group`]; each output is what the op alone computes.
///
/// # Panics
/// If two ops' output columns overlap or reach past `ldy` (the groups write in parallel), or
/// `y` is too short.
pub fn forward_fused(parts: &[(&dyn LinearOp, usize)], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
    check_output_columns(parts.iter().map(|&(op, col)| (col, op.rows())), segments.iter().sum(), ldy, y.len());
    let mut taken = vec![false; parts.len()];
    for i in 0..parts.len() {
        if taken[i] {
            continue;
        }
        let ty = (parts[i].0 as &dyn Any).type_id();
        let mut group = Vec::new();
        for (j, &(op, col)) in parts.iter().enumerate().skip(i) {
            if !taken[j] && (op as &dyn Any).type_id() == ty {
                taken[j] = true;
                group.push((op, col));
            }
        }
        parts[i].0.forward_group(&group, x, segments, y, ldy);
    }
}

/// The ops of `group` as `T`, the type the group was formed by.
///
/// # Panics
/// If an op is not a `T` (a [`LinearOp::forward_group`] called with a mixed group).
pub fn downcast_group<'a, T: LinearOp>(group: &[(&'a dyn LinearOp, usize)]) -> Vec<(&'a T, usize)> {
    group
        .iter()
        .map(|&(op, col)| ((op as &dyn Any).downcast_ref::<T>().expect("forward_group takes ops of one type"), col))
        .collect()
}

/// How layers pick between kernel paths and activation handling: the run's settings
/// (`--compute`), applied by each format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearPolicy {
    /// Types whose small path dequantizes rows (floats): batches of at least
    /// this many tokens use the panel GEMM.
    pub gemm_min_tokens: usize,
    /// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K..Q6_K, whose small path is the integer GEMM:
    /// batches of at least this many tokens leave it for the panel GEMM. Applies where the integer GEMM is vectorized
    /// (AVX2); with the scalar kernel these types switch at `gemm_min_tokens`.
    pub integer_gemm_min_tokens: usize,
    /// Checkpoint layers with weight-only int4 (W4A16) quantize their activations to int8 per
    /// token at run time and take the W4A8 integer kernel, as llama.cpp's integer dots (and
    /// IPEX's low-precision mode for weight-only checkpoints) do: faster, not the checkpoint's
    /// 16-bit activations.
    pub int4_int8_act: bool,
    /// Checkpoint layers with weight-only int4 (W4A16) take 16-bit activations: rounded to
    /// bf16 (what vLLM's Marlin kernels multiply) for the AVX-512 BF16 dot where the CPU has
    /// one, else quantized to int16 per token and weight group for the AVX2 integer kernel;
    /// without either, or when false, they keep f32.
    pub int4_16bit_act: bool,
}

impl LinearPolicy {
    /// Default: the integer GEMM at every batch size for the types that have one, the
    /// dequantizing dot below 32 tokens otherwise. Measured side by side (`benches/linear.rs`,
    /// Q4_1 1536x576, AVX2, 2 threads): the integer GEMM takes 0.12 ms at 8 tokens, 0.78 ms at
    /// 64 and 6.7 ms at 512 against the f32 panel GEMM's 1.3, 1.9 and 8.6 ms.
    pub const DEFAULT: LinearPolicy =
        LinearPolicy { gemm_min_tokens: 32, integer_gemm_min_tokens: usize::MAX, int4_int8_act: false, int4_16bit_act: true };
    /// Always the small path (for integer types: int8 activations as llama.cpp quantizes them),
    /// and W4A16 checkpoint layers with int8 activations too.
    pub const ALWAYS_DOT: LinearPolicy =
        LinearPolicy { gemm_min_tokens: usize::MAX, integer_gemm_min_tokens: usize::MAX, int4_int8_act: true, int4_16bit_act: false };
    /// Always the f32-activation GEMM path, and f32 activations for W4A16 layers.
    pub const ALWAYS_GEMM: LinearPolicy = LinearPolicy { gemm_min_tokens: 1, integer_gemm_min_tokens: 1, int4_int8_act: false, int4_16bit_act: false };
}

impl Default for LinearPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Checks the output of several matrices written side by side, matrix `p` into columns
/// `spans[p].0..spans[p].0 + spans[p].1` of `m` rows `ldy` apart in `y_len` floats: each span
/// inside the row stride, the last row inside the buffer (no arithmetic overflowing), and no
/// two spans overlapping (every parallel task writes its own columns).
///
/// # Panics
/// If any of that fails.
pub(crate) fn check_output_columns(spans: impl IntoIterator<Item = (usize, usize)>, m: usize, ldy: usize, y_len: usize) {
    let mut spans: Vec<(usize, usize)> = spans
        .into_iter()
        .map(|(col, rows)| {
            let end = col.checked_add(rows).filter(|&e| e <= ldy).expect("output columns past the row stride");
            let last = m.checked_sub(1).map(|i| i.checked_mul(ldy).and_then(|o| o.checked_add(end)).expect("output size overflows"));
            assert!(last.is_none_or(|need| y_len >= need), "output shape");
            (col, end)
        })
        .collect();
    spans.sort_unstable();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "fused layers' output columns overlap");
}

/// Parallel tasks over the rows of several matrices (`rows[p]` each), as (matrix, first row,
/// end row) in matrix order, every task a multiple of `align` rows but at a matrix's end.
/// Task sizes shrink toward the end (guided self-scheduling: each takes the remaining rows
/// over twice the calling thread's pool threads), so the threads finish close together: with
/// equal tasks, the last one a thread takes can leave the others waiting for up to its whole
/// length.
pub(crate) fn row_tasks(rows: &[usize], align: usize) -> Vec<(usize, usize, usize)> {
    let share = 2 * crate::cpu::pool::current_threads();
    let mut remaining: usize = rows.iter().sum();
    let mut tasks = Vec::new();
    for (p, &n) in rows.iter().enumerate() {
        let mut r0 = 0;
        while r0 < n {
            let r1 = n.min(r0 + (remaining / share).next_multiple_of(align).max(align));
            tasks.push((p, r0, r1));
            remaining -= r1 - r0;
            r0 = r1;
        }
    }
    tasks
}

#[cfg(test)]
mod tests {
    use super::row_tasks;

    /// The tasks cover every matrix's rows once, in order, in whole `align` runs but at a
    /// matrix's end, and shrink toward the end down to `align` rows.
    #[test]
    fn row_tasks_cover_each_matrix_once_and_shrink() {
        for (rows, align) in [(vec![16384usize], 32usize), (vec![2048, 512, 512], 32), (vec![37, 5], 16), (vec![0, 48], 16), (vec![], 16)] {
            let tasks = row_tasks(&rows, align);
            let mut next = vec![0usize; rows.len()];
            for (i, &(p, r0, r1)) in tasks.iter().enumerate() {
                assert!(tasks[..i].iter().all(|t| t.0 <= p), "{rows:?}: matrices out of order");
                assert_eq!(r0, next[p], "{rows:?}: task {i} does not start where the last ended");
                assert!(r1 > r0 && ((r1 - r0) % align == 0 || r1 == rows[p]), "{rows:?}: task {i} = {r0}..{r1}");
                next[p] = r1;
            }
            assert_eq!(next, rows, "{rows:?}: not every row covered");
            let sizes: Vec<usize> = tasks.iter().map(|t| t.2 - t.1).collect();
            if rows == [16384] {
                assert!(sizes.windows(2).all(|w| w[1] <= w[0]), "{sizes:?}");
                assert_eq!(*sizes.last().unwrap(), align, "{sizes:?}");
                let threads = crate::cpu::pool::current_threads();
                assert!(sizes[0] >= 16384 / (2 * threads) && sizes.len() > 2 * threads, "{sizes:?}");
            }
        }
    }
}
