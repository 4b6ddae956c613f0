//! Linear layers `y = x · Wᵀ` over weights kept in their GGML storage type.
//!
//! Two paths, chosen per call by the batch size:
//! - **small batches (decode)**: activations are quantized per token to 8-bit blocks and
//!   dotted with the weight blocks using integer SIMD (llama.cpp's method); types without
//!   an integer kernel dequantize each weight row and use an f32 dot.
//! - **large batches (prefill)**: weight rows are dequantized panel by panel into a
//!   cache-resident f32 buffer and multiplied with a GEMM micro-kernel (`gemm` crate),
//!   activations stay f32.
//!
//! A [`LinearKernel`] is selected once per layer at load and prints as a kernel id, so the
//! per-layer plan is data.

use crate::cpu::caps::{CpuCaps, Isa};
use crate::cpu::dot::{dot_f32, QuantDot};
use crate::ggml::act_quant::{quantize_q8, Q8Block, Q8_BLOCK};
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

/// How small batches are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SmallPath {
    /// Integer dot against per-token Q8 activations.
    QuantDot(QuantDot),
    /// Dequantize the weight row, f32 dot.
    DequantDot,
}

/// When to switch from the per-token dot path to the panel GEMM path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearPolicy {
    /// Batches of at least this many tokens use the panel GEMM path.
    pub gemm_min_tokens: usize,
}

impl LinearPolicy {
    /// Default: dot path for fewer than 8 tokens.
    pub const DEFAULT: LinearPolicy = LinearPolicy { gemm_min_tokens: 8 };
    /// Always use the quantized-activation dot path (llama.cpp's numerics).
    pub const ALWAYS_DOT: LinearPolicy = LinearPolicy { gemm_min_tokens: usize::MAX };
    /// Always use the f32-activation GEMM path.
    pub const ALWAYS_GEMM: LinearPolicy = LinearPolicy { gemm_min_tokens: 1 };
}

impl Default for LinearPolicy {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The kernel chosen for one weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearKernel {
    ty: GgmlType,
    isa: Isa,
    small: SmallPath,
    policy: LinearPolicy,
}

impl LinearKernel {
    /// Picks the kernel for weights of type `ty` on this CPU.
    pub fn select(ty: GgmlType, caps: &CpuCaps, policy: LinearPolicy) -> Self {
        Self::with_isa(ty, caps.best_isa(), policy)
    }

    /// Picks the kernel for an explicit ISA level (tests use this to compare paths).
    pub fn with_isa(ty: GgmlType, isa: Isa, policy: LinearPolicy) -> Self {
        let small = QuantDot::for_type(ty).map_or(SmallPath::DequantDot, SmallPath::QuantDot);
        LinearKernel { ty, isa, small, policy }
    }

    /// Computes `y[i, j] = Σ_k x[i, k] · W[j, k]` for `m` tokens.
    ///
    /// `x` is `m × w.cols` row-major; row `i` of the output starts at `y[i * ldy]` and has
    /// `w.rows` values (so several matrices can write side by side into one buffer).
    pub fn forward(&self, w: &WeightView<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
        assert_eq!(w.ty, self.ty, "kernel selected for {} used on {}", self.ty, w.ty);
        assert_eq!(x.len(), m * w.cols, "activation shape");
        assert!(ldy >= w.rows && (m == 0 || y.len() >= (m - 1) * ldy + w.rows), "output shape");
        if m >= self.policy.gemm_min_tokens {
            panel_gemm(w, x, m, y, ldy);
        } else {
            match self.small {
                SmallPath::QuantDot(q) => quant_dot(q, self.isa, w, x, m, y, ldy),
                SmallPath::DequantDot => dequant_dot(self.isa, w, x, m, y, ldy),
            }
        }
    }

    /// Kernel id for plans, e.g. `cpu.q4_1*q8_1.avx2 | cpu.panel-gemm.f32 (m>=8)`.
    pub fn id(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for LinearKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let small = match self.small {
            SmallPath::QuantDot(q) => format!("cpu.{}.{}", q.name(), self.isa.name()),
            SmallPath::DequantDot => format!("cpu.dequant-dot.{}.{}", self.ty.name().to_lowercase(), self.isa.name()),
        };
        match self.policy.gemm_min_tokens {
            usize::MAX => f.write_str(&small),
            1 => write!(f, "cpu.panel-gemm.f32"),
            t => write!(f, "{small} (m<{t}) | cpu.panel-gemm.f32 (m>={t})"),
        }
    }
}

/// A raw output pointer shared by workers that write disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: workers write disjoint column ranges of the output; see the callers.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Rows per parallel task: enough tasks to balance the pool, not so many that dispatch dominates.
fn rows_per_task(rows: usize, align: usize) -> usize {
    let tasks = rayon::current_num_threads() * 4;
    rows.div_ceil(tasks).next_multiple_of(align).max(align)
}

fn quant_dot(q: QuantDot, isa: Isa, w: &WeightView<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    let nb = w.cols / Q8_BLOCK;
    let mut acts = vec![Q8Block::default(); m * nb];
    for (xs, a) in x.chunks_exact(w.cols).zip(acts.chunks_exact_mut(nb)) {
        quantize_q8(xs, a);
    }
    let out = OutPtr(y.as_mut_ptr());
    let chunk = rows_per_task(w.rows, 8);
    (0..w.rows.div_ceil(chunk)).into_par_iter().for_each(|t| {
        let out = out;
        for r in t * chunk..((t + 1) * chunk).min(w.rows) {
            let row = w.row(r);
            for (i, a) in acts.chunks_exact(nb).enumerate() {
                // SAFETY: (i, r) is in bounds (checked in forward) and each r belongs to one task.
                unsafe { *out.0.add(i * ldy + r) = q.dot(isa, row, a) };
            }
        }
    });
}

fn dequant_dot(isa: Isa, w: &WeightView<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    let out = OutPtr(y.as_mut_ptr());
    let chunk = rows_per_task(w.rows, 8);
    (0..w.rows.div_ceil(chunk)).into_par_iter().for_each(|t| {
        let out = out;
        let mut buf = vec![0f32; w.cols];
        for r in t * chunk..((t + 1) * chunk).min(w.rows) {
            dequantize_row(w.ty, w.row(r), &mut buf);
            for (i, xs) in x.chunks_exact(w.cols).enumerate().take(m) {
                // SAFETY: as in quant_dot.
                unsafe { *out.0.add(i * ldy + r) = dot_f32(isa, &buf, xs) };
            }
        }
    });
}

/// Dequantizes panels of weight rows to f32 and multiplies them with a GEMM micro-kernel.
fn panel_gemm(w: &WeightView<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    // Panel height: keep the f32 panel (rows x K) around 128 KiB so it stays in L2.
    let cache_rows = ((128 << 10) / (4 * w.cols)).clamp(16, 256);
    let panel = rows_per_task(w.rows, 16).min(cache_rows.next_multiple_of(16));
    let out = OutPtr(y.as_mut_ptr());
    let k = w.cols;
    (0..w.rows.div_ceil(panel)).into_par_iter().for_each_init(
        || vec![0f32; panel * k],
        |buf, t| {
            let out = out;
            let r0 = t * panel;
            let n = panel.min(w.rows - r0);
            for (r, dst) in (r0..r0 + n).zip(buf.chunks_exact_mut(k)) {
                dequantize_row(w.ty, w.row(r), dst);
            }
            // SAFETY: dst is the m x n block at column r0 with row stride ldy, in bounds by the
            // checks in forward; panels are disjoint column ranges. lhs is x (m x k, row-major),
            // rhs is the panel transposed (k x n; element (kk, j) at buf[j * k + kk]).
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    out.0.add(r0),
                    1,
                    ldy as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    buf.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        },
    );
}
