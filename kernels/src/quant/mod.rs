//! Linear layers over checkpoint-quantized weights (W4A16, W4A8, W8A8 int8, W8A8 FP8).
//!
//! A [`QuantLinear`] pairs a weight matrix in its storage type ([`Int4Matrix`],
//! [`Int8Matrix`], [`Fp8Matrix`]) with the activation handling its scheme prescribes
//! ([`ActQuant`]) and the ISA it runs on. One entry point serves every batch size (decode to
//! prefill), and each output element is computed the same way whatever the batch holds, so
//! batching never changes a token's result.
//!
//! Numerics (each kernel is tested against the scalar reference in its matrix module):
//! - W4A16: int4 values dequantized in registers, f32 products and accumulation; with bf16
//!   activations (rounded once per call) the AVX-512 BF16 dot, whose products are exact too.
//! - W4A8 / W8A8 int8: activations quantized per token to int8 ([`act`]), integer products
//!   summed in int32 per scale group (AVX2 `maddubs` or AVX-512 `vpdpbusd`, the same
//!   integers), then `token scale × channel (group) scale` in f32.
//! - W8A8 FP8: activations rounded to E4M3 per token (per token and column block for block
//!   scales), products of E4M3 values (exact in f32) summed in f32, scales applied per block.

pub mod act;
mod avx2_int;
mod avx2_fp8;
mod avx512_bf16;
pub mod fp8;
pub mod fp8_matrix;
pub mod int4;
pub mod int8;

pub use fp8_matrix::Fp8Matrix;
pub use int4::Int4Matrix;
pub use int8::Int8Matrix;

use crate::cpu::caps::{CpuCaps, Isa};
use crate::cpu::{pool, SyncPtr};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// How activations enter a quantized linear layer at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActQuant {
    /// Kept in f32 (weight-only schemes: W4A16).
    F32,
    /// Rounded to bf16 (W4A16's 16-bit activations, as vLLM's Marlin kernels take them), for
    /// the AVX-512 BF16 dot.
    Bf16,
    /// Dynamic per-token int8, absmax / 127 (W4A8, W8A8 int8).
    Int8PerToken,
    /// Dynamic per-token (per column block with block scales) E4M3, absmax / 448 (W8A8 FP8).
    Fp8PerToken,
}

impl ActQuant {
    /// Short name for plans (`a16`, `a8-int8`, `a8-fp8`).
    pub fn name(self) -> &'static str {
        match self {
            ActQuant::F32 => "f32",
            ActQuant::Bf16 => "bf16",
            ActQuant::Int8PerToken => "int8/token",
            ActQuant::Fp8PerToken => "fp8/token",
        }
    }
}

/// A quantized weight matrix in one of the kernel storage types.
#[derive(Clone, Debug)]
pub enum QuantMatrix {
    /// 4-bit integers with group (or channel) scales.
    Int4(Int4Matrix),
    /// 8-bit integers with channel scales.
    Int8(Int8Matrix),
    /// E4M3 floats with tensor, channel or block scales.
    Fp8(Fp8Matrix),
}

impl QuantMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            QuantMatrix::Int4(w) => w.rows(),
            QuantMatrix::Int8(w) => w.rows(),
            QuantMatrix::Fp8(w) => w.rows(),
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            QuantMatrix::Int4(w) => w.cols(),
            QuantMatrix::Int8(w) => w.cols(),
            QuantMatrix::Fp8(w) => w.cols(),
        }
    }

    /// Bytes held (values and scales).
    pub fn bytes(&self) -> usize {
        match self {
            QuantMatrix::Int4(w) => w.bytes(),
            QuantMatrix::Int8(w) => w.bytes(),
            QuantMatrix::Fp8(w) => w.bytes(),
        }
    }

    /// Dequantizes row `r` to f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match self {
            QuantMatrix::Int4(w) => w.dequantize_row(r, out),
            QuantMatrix::Int8(w) => w.dequantize_row(r, out),
            QuantMatrix::Fp8(w) => w.dequantize_row(r, out),
        }
    }

    /// The sub-matrix `rows × cols` (a tensor-parallel shard), its values and scales copied,
    /// never re-quantized. Refused (with the reason) when the cut would split a scale group or
    /// block, or the shard breaks the kernels' 32-column runs.
    pub fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<QuantMatrix, String> {
        if rows.start >= rows.end || rows.end > self.rows() || cols.start >= cols.end || cols.end > self.cols() {
            return Err(format!("shard rows {rows:?} x cols {cols:?} outside a {}x{} matrix", self.rows(), self.cols()));
        }
        if !cols.start.is_multiple_of(32) || !(cols.end.is_multiple_of(32) || cols.end == self.cols()) {
            return Err(format!("input columns {cols:?} do not fall on the kernels' 32-column runs"));
        }
        match self {
            QuantMatrix::Int4(w) => w.slice(rows, cols).map(QuantMatrix::Int4),
            QuantMatrix::Int8(w) => w.slice(rows, cols).map(QuantMatrix::Int8),
            QuantMatrix::Fp8(w) => w.slice(rows, cols).map(QuantMatrix::Fp8),
        }
    }

    /// Storage description for plans, e.g. `int4 g128 asym`, `int8 channel`, `fp8 block 128x128`.
    pub fn storage(&self) -> String {
        match self {
            QuantMatrix::Int4(w) => {
                let g = if w.per_channel() { "channel".to_string() } else { format!("g{}", w.group()) };
                format!("int4 {g} {}", if w.has_zeros() { "asym" } else { "sym" })
            }
            QuantMatrix::Int8(_) => "int8 channel".into(),
            QuantMatrix::Fp8(w) => match w.block() {
                [bh, bw] if bh == w.rows() && bw == w.cols() => "fp8 tensor".into(),
                [1, bw] if bw == w.cols() => "fp8 channel".into(),
                [bh, bw] => format!("fp8 block {bh}x{bw}"),
            },
        }
    }
}

/// Activations prepared once per call for every row task.
enum Prepared<'a> {
    F32(&'a [f32]),
    Bf16(Vec<u16>),
    Int8 { q: Vec<i8>, scales: Vec<f32> },
    Fp8 { codes: Vec<f32>, scales: Vec<f32> },
}

/// A quantized linear layer `y = x · Wᵀ` with its kernel chosen.
#[derive(Clone, Debug)]
pub struct QuantLinear {
    w: Arc<QuantMatrix>,
    act: ActQuant,
    isa: Isa,
    /// Input columns gathered before the product (act-order checkpoints), `x'[c] = x[perm[c]]`.
    perm: Option<Vec<u32>>,
}

impl QuantLinear {
    /// Pairs a matrix with its activation handling, for the best ISA of this CPU. Refuses
    /// pairs without a kernel (e.g. FP8 weights with int8 activations).
    pub fn new(w: impl Into<Arc<QuantMatrix>>, act: ActQuant, caps: &CpuCaps) -> Result<Self, String> {
        Self::with_isa(w, act, caps.best_isa())
    }

    /// As [`QuantLinear::new`] for an explicit ISA (tests compare paths with it).
    pub fn with_isa(w: impl Into<Arc<QuantMatrix>>, act: ActQuant, isa: Isa) -> Result<Self, String> {
        let w = w.into();
        let ok = matches!(
            (&*w, act),
            (QuantMatrix::Int4(_), ActQuant::F32 | ActQuant::Bf16 | ActQuant::Int8PerToken)
                | (QuantMatrix::Int8(_), ActQuant::Int8PerToken)
                | (QuantMatrix::Fp8(_), ActQuant::Fp8PerToken)
        );
        if !ok {
            return Err(format!("no kernel for {} weights with {} activations", w.storage(), act.name()));
        }
        if act == ActQuant::Bf16 && isa != Isa::Scalar && !crate::cpu::caps::bf16_dot_available() {
            return Err("bf16 activations need AVX-512 BF16 on this CPU (or the scalar kernel)".into());
        }
        Ok(QuantLinear { w, act, isa, perm: None })
    }

    /// Gathers input column `perm[c]` into position `c` before the product (the weight's
    /// columns were sorted by group at load). `perm` must be a permutation of `0..cols`.
    pub fn with_input_permutation(mut self, perm: Vec<u32>) -> Result<Self, String> {
        let k = self.w.cols();
        let mut seen = vec![false; k];
        if perm.len() != k || perm.iter().any(|&p| (p as usize) >= k || std::mem::replace(&mut seen[p as usize], true)) {
            return Err(format!("input permutation is not a permutation of 0..{k}"));
        }
        self.perm = Some(perm);
        Ok(self)
    }

    /// The weights.
    pub fn matrix(&self) -> &QuantMatrix {
        &self.w
    }

    /// Activation handling.
    pub fn act(&self) -> ActQuant {
        self.act
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.w.rows()
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.w.cols()
    }

    /// Dequantizes row `r` in the input's column order.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match &self.perm {
            None => self.w.dequantize_row(r, out),
            Some(p) => {
                let mut tmp = vec![0f32; out.len()];
                self.w.dequantize_row(r, &mut tmp);
                for (c, &src) in p.iter().enumerate() {
                    out[src as usize] = tmp[c];
                }
            }
        }
    }

    /// Kernel id for plans, e.g. `cpu.w4a8.int4xint8.avx2`.
    pub fn id(&self) -> String {
        self.to_string()
    }

    /// `y[i * ldy + j] = Σ_k x[i, k] W[j, k]` for `m` tokens (`x` is `m × cols`).
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
        forward_fused(&[(self, 0)], x, m, y, ldy);
    }

    fn prepare<'a>(&self, x: &'a [f32], m: usize) -> Prepared<'a> {
        let k = self.cols();
        match self.act {
            ActQuant::F32 => Prepared::F32(x),
            ActQuant::Bf16 => {
                let mut b = vec![0u16; m * k];
                act::round_bf16_row(x, &mut b);
                Prepared::Bf16(b)
            }
            ActQuant::Int8PerToken => {
                let mut q = vec![0i8; m * k];
                let scales = x.chunks_exact(k).zip(q.chunks_exact_mut(k)).map(|(x, q)| act::quantize_int8_row(x, q)).collect();
                Prepared::Int8 { q, scales }
            }
            ActQuant::Fp8PerToken => {
                let QuantMatrix::Fp8(w) = &*self.w else { unreachable!("checked in with_isa") };
                let bw = w.block()[1];
                let mut codes = vec![0f32; m * k];
                let nb = k.div_ceil(bw);
                let mut scales = vec![0f32; m * nb];
                for ((x, c), s) in x.chunks_exact(k).zip(codes.chunks_exact_mut(k)).zip(scales.chunks_exact_mut(nb)) {
                    act::quantize_fp8_row(x, bw, c, s);
                }
                Prepared::Fp8 { codes, scales }
            }
        }
    }

    /// Weight rows `r0..r1` for all tokens into `tile[(r - r0) * m + i]`.
    fn row_range(&self, prep: &Prepared<'_>, r0: usize, r1: usize, m: usize, tile: &mut [f32]) {
        match (&*self.w, prep) {
            (QuantMatrix::Int4(w), Prepared::F32(x)) => w.rows_f32(self.isa, r0, r1, x, m, tile),
            (QuantMatrix::Int4(w), Prepared::Bf16(xb)) => w.rows_bf16(self.isa, r0, r1, xb, m, tile),
            (QuantMatrix::Int4(w), Prepared::Int8 { q, scales }) => w.rows_int8(self.isa, r0, r1, q, scales, m, tile),
            (QuantMatrix::Int8(w), Prepared::Int8 { q, scales }) => w.rows_int8(self.isa, r0, r1, q, scales, m, tile),
            (QuantMatrix::Fp8(w), Prepared::Fp8 { codes, scales }) => w.rows_fp8(self.isa, r0, r1, codes, scales, m, tile),
            _ => unreachable!("pairs checked in with_isa"),
        }
    }
}

impl fmt::Display for QuantLinear {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match (&*self.w, self.act) {
            (QuantMatrix::Int4(_), ActQuant::F32) => "w4a16.int4xf32",
            (QuantMatrix::Int4(_), ActQuant::Bf16) => "w4a16.int4xbf16",
            (QuantMatrix::Int4(_), _) => "w4a8.int4xint8",
            (QuantMatrix::Int8(_), _) => "w8a8.int8xint8",
            (QuantMatrix::Fp8(_), _) => "w8a8.fp8xfp8",
        };
        let level = match (&*self.w, self.act) {
            (QuantMatrix::Int4(_) | QuantMatrix::Int8(_), ActQuant::Int8PerToken) => crate::linear::interleaved::GemmLevel::for_isa(self.isa).name(),
            (_, ActQuant::Bf16) if self.isa != Isa::Scalar => "avx512bf16",
            _ => self.isa.name(),
        };
        write!(f, "cpu.{scheme}.{level}")?;
        if self.perm.is_some() {
            f.write_str("+perm")?;
        }
        Ok(())
    }
}

/// Several layers reading the same input `x` (`m × cols`), writing side by side into `y`
/// (fused Q/K/V or gate/up): `(layer, first output column)` each, layer `p` giving
/// `y[i * ldy + col_p + j]`. Int8 activations are quantized once for every layer that takes
/// them in the input's column order, and all layers' rows share one parallel region. Each
/// output is computed exactly as [`QuantLinear::forward`] alone computes it.
pub fn forward_fused(parts: &[(&QuantLinear, usize)], x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    let Some(&(first, _)) = parts.first() else { return };
    let k = first.cols();
    assert_eq!(Some(x.len()), m.checked_mul(k), "activation shape");
    let mut spans = Vec::with_capacity(parts.len());
    for &(l, col) in parts {
        assert_eq!(l.cols(), k, "fused layers must share their input width");
        let end = col.checked_add(l.rows()).filter(|&e| e <= ldy).expect("output columns past the row stride");
        let last = m.checked_sub(1).map(|i| i.checked_mul(ldy).and_then(|o| o.checked_add(end)).expect("output size overflows"));
        assert!(last.is_none_or(|need| y.len() >= need), "output shape");
        spans.push((col, end));
    }
    // Every task writes its own (layer, row) columns: the layers' column ranges must not overlap.
    spans.sort_unstable();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "fused layers' output columns overlap");
    if m == 0 {
        return;
    }
    let gathered: Vec<Option<Vec<f32>>> = parts
        .iter()
        .map(|(l, _)| l.perm.as_ref().map(|p| x.chunks_exact(k).flat_map(|row| p.iter().map(|&c| row[c as usize])).collect()))
        .collect();
    let shares = |l: &QuantLinear| l.act == ActQuant::Int8PerToken && l.perm.is_none();
    let shared = parts.iter().find(|(l, _)| shares(l)).map(|(l, _)| l.prepare(x, m));
    let own: Vec<Option<Prepared<'_>>> =
        parts.iter().zip(&gathered).map(|((l, _), g)| (!shares(l)).then(|| l.prepare(g.as_deref().unwrap_or(x), m))).collect();
    let preps: Vec<&Prepared<'_>> = own.iter().map(|p| p.as_ref().or(shared.as_ref()).expect("prepared")).collect();
    let total: usize = parts.iter().map(|(l, _)| l.rows()).sum();
    let chunk = rows_per_task(total);
    let tasks: Vec<(usize, usize, usize)> = parts
        .iter()
        .enumerate()
        .flat_map(|(p, (l, _))| (0..l.rows()).step_by(chunk).map(move |r0| (p, r0, (r0 + chunk).min(l.rows()))))
        .collect();
    let out = SyncPtr::new(y.as_mut_ptr());
    pool::for_each(tasks.len(), |ti| {
        let (p, r0, r1) = tasks[ti];
        let (l, col) = parts[p];
        let mut tile = vec![0f32; (r1 - r0) * m];
        l.row_range(preps[p], r0, r1, m, &mut tile);
        for (r, vals) in (r0..r1).zip(tile.chunks_exact(m)) {
            for (i, &v) in vals.iter().enumerate() {
                // SAFETY: (i, col + r) is inside y (asserted above); each (layer, row) belongs
                // to one task.
                unsafe { *out.get().add(i * ldy + col + r) = v };
            }
        }
    });
}

/// Weight rows per parallel task (a multiple of 8, about four tasks per thread).
fn rows_per_task(rows: usize) -> usize {
    let tasks = rayon::current_num_threads() * 4;
    rows.div_ceil(tasks).next_multiple_of(8).max(8)
}
