//! The driver shared by formats whose kernel multiplies a range of weight rows with
//! activations prepared once per call (int4, int8, fp8, and any format that implements
//! [`RowKernel`]).
//!
//! A [`RowwiseLinear`] pairs such a matrix with the activation handling its checkpoint
//! prescribes (or the run's policy picks: [`RowKernel::activations`]) and the ISA it runs on.
//! One entry point serves every batch size (decode to prefill), and each output element is
//! computed the same way whatever the batch holds, so batching never changes a token's result.
//!
//! Numerics (each format's kernels are tested against the scalar reference in its folder):
//! - W4A16: int4 values dequantized in registers, f32 products and accumulation; with bf16
//!   activations (rounded once per call) the AVX-512 BF16 dot, whose products are exact too;
//!   with int16 activations (per token and weight group) exact integer group sums, then the
//!   two scales in f32.
//! - W4A8 / W8A8 int8: activations quantized per token to int8 ([`super::act`]), integer
//!   products summed in int32 per scale group (AVX2 `maddubs` or AVX-512 `vpdpbusd`, the same
//!   integers), then `token scale × channel (group) scale` in f32.
//! - W8A8 FP8: activations rounded to E4M3 per token (per token and column block for block
//!   scales), products of E4M3 values (exact in f32) summed in f32, scales applied per block.

use super::act::{self, ActQuant};
use super::{check_output_columns, downcast_group, row_tasks, LinearOp, LinearPolicy, OpPlan, WeightMatrix};
use crate::cpu::aligned::LineAligned;
use crate::cpu::caps::{CpuCaps, Isa};
use crate::cpu::scratch::with_f32;
use crate::cpu::{pool, SyncPtr};
use crate::cuda::device::CudaDevice;
use crate::linear::cuda::DeviceWeight;
use crate::cuda::CudaError;
use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// A weight format whose kernels multiply weight rows `r0..r1` with prepared activations.
/// Implementing it makes the format a [`WeightMatrix`] run by [`RowwiseLinear`].
pub trait RowKernel: Send + Sync + fmt::Debug + Any {
    /// Output features.
    fn rows(&self) -> usize;
    /// Input features (a multiple of 32).
    fn cols(&self) -> usize;
    /// Bytes held (values and scales).
    fn bytes(&self) -> usize;
    /// Storage for plans, e.g. `int4 g128 asym`.
    fn storage(&self) -> String;
    /// Row `r` as f32 (the scalar reference).
    fn dequantize_row(&self, r: usize, out: &mut [f32]);
    /// Granularity of a tensor-parallel column cut (at least the kernels' 32-column runs).
    fn col_align(&self) -> usize {
        32
    }
    /// Granularity of a tensor-parallel row cut.
    fn row_align(&self) -> usize {
        1
    }
    /// Rows `rows` and input columns `cols` (in bounds, on 32-column runs: checked by the
    /// caller), refused when the cut splits a scale group or block.
    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Self, String>
    where
        Self: Sized;
    /// Whether a kernel multiplies this format with `act` activations.
    fn accepts(&self, act: ActQuant) -> bool;
    /// The activations a layer runs with, given the checkpoint's and the run's policy, and a
    /// note when they differ from the checkpoint's. Default: the checkpoint's.
    fn activations(&self, checkpoint: ActQuant, _caps: &CpuCaps, _policy: LinearPolicy) -> (ActQuant, Option<String>) {
        (checkpoint, None)
    }
    /// Columns per activation scale for [`ActQuant::Fp8PerToken`] (FP8 block scales) and
    /// [`ActQuant::Int16PerGroup`]; default the whole row.
    fn act_block(&self) -> usize {
        self.cols()
    }
    /// Weight rows `r0..r1` for all `m` tokens into `tile[(r - r0) * m + i]`: every one of
    /// those floats is written (`tile` holds stale values from earlier calls).
    #[allow(clippy::too_many_arguments)] // matrix, level, activations, row range, tokens, tile
    fn row_range(&self, isa: Isa, act: &Prepared<'_>, r0: usize, r1: usize, m: usize, tile: &mut [f32]);
    /// Kernel id for plans, e.g. `cpu.w4a8.int4xint8.avx2`.
    fn kernel_id(&self, act: ActQuant, isa: Isa) -> String;
    /// The matrix on a GPU for activations `act`.
    fn upload(&self, dev: &CudaDevice, act: ActQuant) -> Result<DeviceWeight, CudaError>;
}

impl<T: RowKernel> WeightMatrix for T {
    fn rows(&self) -> usize {
        RowKernel::rows(self)
    }

    fn cols(&self) -> usize {
        RowKernel::cols(self)
    }

    fn bytes(&self) -> usize {
        RowKernel::bytes(self)
    }

    fn storage(&self) -> String {
        RowKernel::storage(self)
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        RowKernel::dequantize_row(self, r, out)
    }

    fn col_align(&self) -> usize {
        RowKernel::col_align(self)
    }

    fn row_align(&self) -> usize {
        RowKernel::row_align(self)
    }

    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Arc<dyn WeightMatrix>, String> {
        let (n, k) = (RowKernel::rows(self), RowKernel::cols(self));
        if rows.start >= rows.end || rows.end > n || cols.start >= cols.end || cols.end > k {
            return Err(format!("shard rows {rows:?} x cols {cols:?} outside a {n}x{k} matrix"));
        }
        if !cols.start.is_multiple_of(32) || !(cols.end.is_multiple_of(32) || cols.end == k) {
            return Err(format!("input columns {cols:?} do not fall on the kernels' 32-column runs"));
        }
        Ok(Arc::new(RowKernel::slice(self, rows, cols)?))
    }

    fn op(self: Arc<Self>, act: ActQuant, perm: Option<Vec<u32>>, caps: &CpuCaps, policy: LinearPolicy) -> Result<Box<dyn LinearOp>, String> {
        let (act, note) = RowKernel::activations(&*self, act, caps, policy);
        let mut op = RowwiseLinear::new(self as Arc<dyn RowKernel>, act, caps)?;
        op.note = note;
        if let Some(p) = perm {
            op = op.with_input_permutation(p)?;
        }
        Ok(Box::new(op))
    }

    fn upload(&self, dev: &CudaDevice, act: ActQuant) -> Result<DeviceWeight, CudaError> {
        RowKernel::upload(self, dev, act)
    }
}

/// Activations prepared once per call for every row task.
#[derive(Debug)]
pub enum Prepared<'a> {
    /// As given (`m × cols`).
    F32(&'a [f32]),
    /// Rounded to bf16 (bit patterns, `m × cols`).
    Bf16(Vec<u16>),
    /// Per-token int8 codes (`m × cols`) and scales (`m`).
    Int8 {
        /// Codes, from a cache line.
        q: LineAligned<i8>,
        /// One scale per token.
        scales: Vec<f32>,
    },
    /// Int16 codes (`m × cols`) per token and column block, with the blocks' scales and code
    /// sums (`m × blocks`).
    Int16 {
        /// Codes, from a cache line.
        q: LineAligned<i16>,
        /// One scale per token and block.
        scales: Vec<f32>,
        /// `Σ q` per token and block.
        sums: Vec<i32>,
    },
    /// Per-token (and column block) E4M3 codes as f32 (`m × cols`) and scales (`m × blocks`).
    Fp8 {
        /// Codes, widened to f32.
        codes: Vec<f32>,
        /// One scale per token and column block.
        scales: Vec<f32>,
        /// The codes as bf16 words (exact) when the kernel multiplies bf16, else empty.
        words: LineAligned<u16>,
    },
}

/// A row-kernel format's linear layer `y = x · Wᵀ` with its kernel chosen.
#[derive(Clone, Debug)]
pub struct RowwiseLinear {
    w: Arc<dyn RowKernel>,
    act: ActQuant,
    isa: Isa,
    /// Input columns gathered before the product (act-order checkpoints), `x'[c] = x[perm[c]]`.
    perm: Option<Vec<u32>>,
    /// Why the activations differ from the checkpoint's, when they do.
    note: Option<String>,
}

impl RowwiseLinear {
    /// Pairs a matrix with its activation handling, for the best ISA of this CPU. Refuses
    /// pairs without a kernel (e.g. FP8 weights with int8 activations).
    pub fn new(w: Arc<dyn RowKernel>, act: ActQuant, caps: &CpuCaps) -> Result<Self, String> {
        Self::with_isa(w, act, caps.best_isa())
    }

    /// As [`RowwiseLinear::new`] for an explicit ISA (tests compare paths with it).
    pub fn with_isa(w: Arc<dyn RowKernel>, act: ActQuant, isa: Isa) -> Result<Self, String> {
        if !w.accepts(act) {
            return Err(format!("no kernel for {} weights with {} activations", w.storage(), act.name()));
        }
        if act == ActQuant::Bf16 && isa != Isa::Scalar && !crate::cpu::caps::bf16_dot_available() {
            return Err("bf16 activations need AVX-512 BF16 on this CPU (or the scalar kernel)".into());
        }
        Ok(RowwiseLinear { w, act, isa, perm: None, note: None })
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
    pub fn matrix(&self) -> &Arc<dyn RowKernel> {
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
                let mut q = LineAligned::<i8>::zeroed(m * k);
                let scales = x.chunks_exact(k).zip(q.chunks_exact_mut(k)).map(|(x, q)| act::quantize_int8_row(x, q)).collect();
                Prepared::Int8 { q, scales }
            }
            ActQuant::Fp8PerToken => {
                let bw = self.w.act_block();
                let mut codes = vec![0f32; m * k];
                let nb = k.div_ceil(bw);
                let mut scales = vec![0f32; m * nb];
                for ((x, c), s) in x.chunks_exact(k).zip(codes.chunks_exact_mut(k)).zip(scales.chunks_exact_mut(nb)) {
                    act::quantize_fp8_row(x, bw, c, s);
                }
                // The bf16 kernel's words, made once per call rather than once per task.
                let words = match crate::linear::Fp8Kernel::for_isa(self.isa) {
                    crate::linear::Fp8Kernel::Avx512Bf16 => crate::linear::fp8::bf16_words(&codes),
                    _ => LineAligned::zeroed(0),
                };
                Prepared::Fp8 { codes, scales, words }
            }
            ActQuant::Int16PerGroup => {
                let bw = self.w.act_block();
                let nb = k.div_ceil(bw);
                let (mut q, mut scales, mut sums) = (LineAligned::<i16>::zeroed(m * k), vec![0f32; m * nb], vec![0i32; m * nb]);
                let rows = x.chunks_exact(k).zip(q.chunks_exact_mut(k)).zip(scales.chunks_exact_mut(nb).zip(sums.chunks_exact_mut(nb)));
                for ((x, q), (s, sum)) in rows {
                    act::quantize_int16_row(x, bw, act::int16_limit(bw), q, s, sum);
                }
                Prepared::Int16 { q, scales, sums }
            }
        }
    }
}

impl fmt::Display for RowwiseLinear {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.w.kernel_id(self.act, self.isa))?;
        if self.perm.is_some() {
            f.write_str("+perm")?;
        }
        Ok(())
    }
}

impl LinearOp for RowwiseLinear {
    fn rows(&self) -> usize {
        self.w.rows()
    }

    fn cols(&self) -> usize {
        self.w.cols()
    }

    /// Row `r` in the input's column order.
    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
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

    fn plan(&self) -> OpPlan {
        OpPlan { storage: self.w.storage(), activations: self.act.name().into(), kernel: self.id(), note: self.note.clone() }
    }

    fn forward_group(&self, group: &[(&dyn LinearOp, usize)], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        forward_fused(&downcast_group::<RowwiseLinear>(group), x, segments.iter().sum(), y, ldy);
    }
}

/// Several layers reading the same input `x` (`m × cols`), writing side by side into `y`
/// (fused Q/K/V or gate/up): `(layer, first output column)` each, layer `p` giving
/// `y[i * ldy + col_p + j]`. Int8 activations are quantized once for every layer that takes
/// them in the input's column order, and all layers' rows share one parallel region. Each
/// output is computed exactly as [`RowwiseLinear::forward`] alone computes it.
pub fn forward_fused(parts: &[(&RowwiseLinear, usize)], x: &[f32], m: usize, y: &mut [f32], ldy: usize) {
    let Some(&(first, _)) = parts.first() else { return };
    let k = first.cols();
    assert_eq!(Some(x.len()), m.checked_mul(k), "activation shape");
    for &(l, _) in parts {
        assert_eq!(l.cols(), k, "fused layers must share their input width");
    }
    // Every task writes its own (layer, row) columns.
    check_output_columns(parts.iter().map(|&(l, col)| (col, l.rows())), m, ldy, y.len());
    if m == 0 {
        return;
    }
    let gathered: Vec<Option<Vec<f32>>> = parts
        .iter()
        .map(|(l, _)| l.perm.as_ref().map(|p| x.chunks_exact(k).flat_map(|row| p.iter().map(|&c| row[c as usize])).collect()))
        .collect();
    let shares = |l: &RowwiseLinear| l.act == ActQuant::Int8PerToken && l.perm.is_none();
    let shared = parts.iter().find(|(l, _)| shares(l)).map(|(l, _)| l.prepare(x, m));
    let own: Vec<Option<Prepared<'_>>> =
        parts.iter().zip(&gathered).map(|((l, _), g)| (!shares(l)).then(|| l.prepare(g.as_deref().unwrap_or(x), m))).collect();
    let preps: Vec<&Prepared<'_>> = own.iter().map(|p| p.as_ref().or(shared.as_ref()).expect("prepared")).collect();
    // Whole groups of 16 rows per task: the interleaved int4 kernels compute a group at once.
    let tasks = row_tasks(&parts.iter().map(|(l, _)| l.rows()).collect::<Vec<_>>(), crate::linear::int4::ROW_GROUP);
    let out = SyncPtr::new(y.as_mut_ptr());
    pool::for_each(tasks.len(), |ti| {
        let (p, r0, r1) = tasks[ti];
        let (l, col) = parts[p];
        with_f32((r1 - r0) * m, |tile| {
            l.w.row_range(l.isa, preps[p], r0, r1, m, tile);
            // SAFETY: tokens 0..m, columns col + r0..col + r1 lie inside y (asserted above);
            // each (layer, row) belongs to one task.
            unsafe { store_transposed(tile, m, out.get().add(col + r0), ldy) };
        });
    });
}

/// Rows a [`store_transposed`] pass takes: one 64-byte line of a token's outputs.
const STORE_ROWS: usize = 16;

/// Stores `tile` (rows of `m` floats, one per token) as columns of the token-major output at
/// `out`: row `r`'s value for token `i` goes to `out[i * ldy + r]`. Sixteen rows at a time,
/// so each token's line is written whole; writing a row's `m` values down a column instead
/// hit lines `ldy` floats apart, which a power-of-two stride maps to one L1 set (a fifth of
/// the W4A16 prefill kernel's time went there).
///
/// # Safety
/// `out[i * ldy + r]` is valid for writes, and written by no one else, for every token
/// `i < m` and row `r < tile.len() / m`.
unsafe fn store_transposed(tile: &[f32], m: usize, out: *mut f32, ldy: usize) {
    let rows = tile.len() / m;
    for b0 in (0..rows).step_by(STORE_ROWS) {
        let block = &tile[b0 * m..(b0 + STORE_ROWS).min(rows) * m];
        for i in 0..m {
            for (r, vals) in block.chunks_exact(m).enumerate() {
                // SAFETY: the caller's contract (token i, row b0 + r).
                unsafe { *out.add(i * ldy + b0 + r) = vals[i] };
            }
        }
    }
}
