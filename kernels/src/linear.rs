//! Linear layers `y = x · Wᵀ` over weights kept in their GGML storage type.
//!
//! Two paths, chosen per sequence segment by its token count (see [`LinearPolicy`]):
//! - **short segments (decode)**: activations are quantized per token to 8-bit blocks and
//!   dotted with the weight blocks using integer SIMD (llama.cpp's method), up to four tokens
//!   per pass over a weight row; types without an integer kernel dequantize each weight row
//!   and use an f32 dot.
//! - **long segments (prefill)**: weight rows are dequantized into packed, cache-resident f32
//!   slivers and multiplied with a GEMM micro-kernel (`cpu::sgemm` on AVX2, the `gemm`
//!   crate's elsewhere); activations stay f32.
//!
//! A [`LinearKernel`] is selected once per layer at load and prints as a kernel id, so the
//! per-layer plan is data.

use crate::cpu::caps::{CpuCaps, Isa};
use crate::cpu::SyncPtr;
use crate::cpu::dot::{dot_f32, QuantDot, MULTI_TOKENS};
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
    /// Default: dot path below 32 tokens. Measured (`benches/linear.rs`, Q4_1 1536x576, AVX2,
    /// 2 threads): int8 dots win up to 16 tokens (0.62 vs 0.97 ms), the dequantizing GEMM from
    /// 32 (1.05 vs 1.39 ms), because packing the weights costs ~0.6 ms whatever the batch.
    pub const DEFAULT: LinearPolicy = LinearPolicy { gemm_min_tokens: 32 };
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
        forward_group(&[(self, *w, 0)], x, &[m], y, ldy);
    }

    /// The large-batch path: the AVX2 dequantizing micro-kernel, or the portable `gemm` crate.
    fn gemm(&self, w: &WeightView<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => crate::cpu::sgemm::dequant_sgemm(w, x, m, y, ldy),
            _ => panel_gemm(w, x, m, y, ldy),
        }
    }

    /// Whether a batch of `m` tokens takes the panel-GEMM path.
    fn uses_gemm(&self, m: usize) -> bool {
        m >= self.policy.gemm_min_tokens
    }

    /// Kernel id for plans, e.g. `cpu.q4_1*q8_1.avx2 (m<32) | cpu.dequant-sgemm.6x16.avx2 (m>=32)`.
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
        let large = match self.isa {
            Isa::Avx2 => "cpu.dequant-sgemm.6x16.avx2",
            Isa::Scalar => "cpu.panel-gemm.f32",
        };
        match self.policy.gemm_min_tokens {
            usize::MAX => f.write_str(&small),
            1 => f.write_str(large),
            t => write!(f, "{small} (m<{t}) | {large} (m>={t})"),
        }
    }
}


/// Rows per parallel task: enough tasks to balance the pool, not so many that dispatch dominates.
fn rows_per_task(rows: usize, align: usize) -> usize {
    let tasks = rayon::current_num_threads() * 4;
    rows.div_ceil(tasks).next_multiple_of(align).max(align)
}

/// Runs several matrices that read the same input `x` and write side by side into `y`
/// (fused Q/K/V or gate/up): `(kernel, weights, first output column)` each.
///
/// `segments` are the token counts of the sequences whose rows make up `x`, in order. Each
/// segment takes the path its own length selects (int8 dots for short ones, the GEMM for
/// long ones), and both paths compute every output row independently of the others, so a
/// sequence's results are bit-identical whatever it is batched with.
pub fn forward_group(
    parts: &[(&LinearKernel, WeightView<'_>, usize)],
    x: &[f32],
    segments: &[usize],
    y: &mut [f32],
    ldy: usize,
) {
    let Some(&(first_kern, first, _)) = parts.first() else { return };
    let k = first.cols;
    let m: usize = segments.iter().sum();
    assert_eq!(x.len(), m * k, "activation shape");
    for (kern, w, col) in parts {
        assert_eq!(w.ty, kern.ty, "kernel selected for {} used on {}", kern.ty, w.ty);
        assert_eq!(w.cols, k, "grouped matrices must share their input width");
        assert_eq!(kern.policy, first_kern.policy, "grouped matrices must share their path policy");
        assert!(col + w.rows <= ldy && (m == 0 || y.len() >= (m - 1) * ldy + col + w.rows), "output shape");
    }
    let (mut gemm_rows, mut dot_rows) = (Vec::new(), Vec::new());
    let mut r = 0;
    for &len in segments {
        if first_kern.uses_gemm(len) { &mut gemm_rows } else { &mut dot_rows }.extend(r..r + len);
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
            let mut yg = vec![0f32; gm * w.rows];
            kern.gemm(&w, &xg, gm, &mut yg, w.rows);
            for (t, &i) in gemm_rows.iter().enumerate() {
                y[i * ldy + col..i * ldy + col + w.rows].copy_from_slice(&yg[t * w.rows..(t + 1) * w.rows]);
            }
        }
    }
    if !dot_rows.is_empty() {
        dot_path(parts, x, &dot_rows, y, ldy);
    }
}

/// The small-batch path over the given rows of `x`: one activation quantization, one
/// parallel region over every weight row of every part.
fn dot_path(parts: &[(&LinearKernel, WeightView<'_>, usize)], x: &[f32], rows: &[usize], y: &mut [f32], ldy: usize) {
    let k = parts[0].1.cols;
    let nb = k / Q8_BLOCK;
    let acts = if parts.iter().any(|(kern, _, _)| matches!(kern.small, SmallPath::QuantDot(_))) {
        let mut a = vec![Q8Block::default(); rows.len() * nb];
        for (&i, ab) in rows.iter().zip(a.chunks_exact_mut(nb)) {
            quantize_q8(&x[i * k..(i + 1) * k], ab);
        }
        a
    } else {
        Vec::new()
    };
    // Tasks are (part, weight-row range) pairs over all parts, sized to balance the pool.
    let total: usize = parts.iter().map(|(_, w, _)| w.rows).sum();
    let chunk = rows_per_task(total, 8);
    let tasks: Vec<(usize, usize, usize)> = parts
        .iter()
        .enumerate()
        .flat_map(|(p, (_, w, _))| (0..w.rows).step_by(chunk).map(move |r0| (p, r0, (r0 + chunk).min(w.rows))))
        .collect();
    let out = SyncPtr::new(y.as_mut_ptr());
    tasks.into_par_iter().for_each(|(p, r0, r1)| {
        let (kern, w, col) = parts[p];
        match kern.small {
            SmallPath::QuantDot(q) if rows.len() == 1 => {
                // One token (the common decode step): all of this task's weight rows in one call,
                // straight into their (contiguous) output columns.
                let i = rows[0];
                let rb = w.data.len() / w.rows;
                // SAFETY: columns col + r0..col + r1 of output row i are inside y (asserted by the
                // caller) and belong to this task alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(i * ldy + col + r0), r1 - r0) };
                q.dot_rows(kern.isa, &w.data[r0 * rb..r1 * rb], &acts, dst);
            }
            SmallPath::QuantDot(q) => {
                // Each group of up to MULTI_TOKENS tokens against all of this task's weight
                // rows in one call; results land row-major (weight row, token).
                let rb = w.data.len() / w.rows;
                let mut res = vec![0f32; (r1 - r0) * MULTI_TOKENS];
                for (ids, ab) in rows.chunks(MULTI_TOKENS).zip(acts.chunks(MULTI_TOKENS * nb)) {
                    let a: Vec<&[Q8Block]> = ab.chunks_exact(nb).collect();
                    let res = &mut res[..(r1 - r0) * ids.len()];
                    q.dot_multi_rows(kern.isa, &w.data[r0 * rb..r1 * rb], &a, res);
                    for (r, vals) in (r0..r1).zip(res.chunks_exact(ids.len())) {
                        for (&i, &v) in ids.iter().zip(vals) {
                            // SAFETY: (i, col + r) is inside y (asserted by the caller); each
                            // (part, weight row) belongs to one task.
                            unsafe { *out.get().add(i * ldy + col + r) = v };
                        }
                    }
                }
            }
            SmallPath::DequantDot => {
                let mut buf = vec![0f32; k];
                for r in r0..r1 {
                    dequantize_row(w.ty, w.row(r), &mut buf);
                    for &i in rows {
                        // SAFETY: as above.
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
fn panel_gemm(w: &WeightView<'_>, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    let k = w.cols;
    let chunk_rows = (GEMM_CHUNK_BYTES / (4 * k)).clamp(16, w.rows.max(16));
    let threads = rayon::current_num_threads();
    {
        let mut buf = Chunk::take(chunk_rows.min(w.rows) * k);
        let mut r0 = 0;
        while r0 < w.rows {
            let n = chunk_rows.min(w.rows - r0);
            let panel = &mut buf.0[..n * k];
            panel.par_chunks_mut(16 * k).enumerate().for_each(|(i, dst)| {
                for (j, row) in dst.chunks_exact_mut(k).enumerate() {
                    dequantize_row(w.ty, w.row(r0 + i * 16 + j), row);
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
