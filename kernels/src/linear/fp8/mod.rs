//! FP8 E4M3 weight matrices (W8A8 FP8): scales per tensor, per output channel, or per
//! `[bh, bw]` block (DeepSeek's 128x128 `weight_scale_inv`).

pub(crate) mod avx2;
pub(crate) mod avx512_bf16;
pub mod cuda;
use crate::e4m3::{e4m3_is_nan, e4m3_to_f32};
use crate::cpu::{Bf16Products, Isa};
use crate::cuda::device::CudaDevice;
use crate::linear::cuda::{DeviceWeight, QuantPlanes};
use crate::cuda::CudaError;
use crate::linear::rowwise::{Prepared, RowKernel};
use crate::linear::ActQuant;
use std::ops::Range;

/// The FP8 kernels, each summing in its own fixed order (so results differ between them
/// within rounding, never between batches on one of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Kernel {
    /// Portable Rust, column order within each column block.
    Scalar,
    /// AVX2 + FMA + F16C: 8 lanes of f32 FMAs.
    Avx2,
    /// AVX-512 BF16: `vdpbf16ps` over 16 lanes ([`avx512_bf16`]).
    Avx512Bf16,
}

impl Fp8Kernel {
    /// The kernel an ISA level runs: AVX2's is the AVX-512 BF16 one where the CPU has it and
    /// retires `vdpbf16ps` at full rate (AMD; Intel's quarter rate would make it slower than
    /// the AVX2 kernel's FMAs, see [`Bf16Products`]).
    pub fn for_isa(isa: Isa) -> Self {
        match isa {
            Isa::Scalar => Fp8Kernel::Scalar,
            Isa::Avx2 if crate::cpu::caps::bf16_dot_available() && Bf16Products::detect() == Bf16Products::Dot => Fp8Kernel::Avx512Bf16,
            Isa::Avx2 => Fp8Kernel::Avx2,
        }
    }

    /// Short name used in kernel ids.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Kernel::Scalar => "scalar",
            Fp8Kernel::Avx2 => "avx2",
            Fp8Kernel::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        match self {
            Fp8Kernel::Scalar => true,
            Fp8Kernel::Avx2 => Isa::Avx2.available(),
            Fp8Kernel::Avx512Bf16 => crate::cpu::caps::bf16_dot_available(),
        }
    }
}

/// E4M3 activation codes (held in f32) as bf16 words, exact, from a cache line: what the
/// AVX-512 BF16 kernel multiplies.
pub(crate) fn bf16_words(codes: &[f32]) -> crate::cpu::aligned::LineAligned<u16> {
    let mut words = crate::cpu::aligned::LineAligned::zeroed(codes.len());
    crate::linear::act::round_bf16_row(codes, &mut words);
    words
}

/// An E4M3 matrix: `W[r, c] = e4m3(q[r, c]) * s[r / bh, c / bw]`.
#[derive(Clone, Debug)]
pub struct Fp8Matrix {
    rows: usize,
    cols: usize,
    block: [usize; 2],
    q: Vec<u8>,
    scales: Vec<f32>,
}

impl Fp8Matrix {
    /// `q` is `rows × cols` E4M3 bytes row-major (NaN codes are refused). `block` is
    /// `[rows, cols]` for one per-tensor scale, `[1, cols]` for per-channel scales, or
    /// e.g. `[128, 128]`; `scales` is `ceil(rows / bh) × ceil(cols / bw)` row-major (edge
    /// blocks may be partial). A block width below `cols` must be a multiple of 32
    /// (activations are quantized per token per block of columns).
    pub fn new(rows: usize, cols: usize, block: [usize; 2], q: Vec<u8>, scales: Vec<f32>) -> Result<Self, String> {
        let [bh, bw] = block;
        if bh == 0 || bw == 0 {
            return Err(format!("block {block:?} for {rows}x{cols}"));
        }
        if !cols.is_multiple_of(32) || (bw < cols && !bw.is_multiple_of(32)) {
            return Err(format!("fp8 kernels need 32 | cols and 32 | block width (cols {cols}, block width {bw})"));
        }
        if q.len() != rows * cols {
            return Err(format!("{} values for {rows}x{cols}", q.len()));
        }
        let n = rows.div_ceil(bh) * cols.div_ceil(bw);
        if scales.len() != n {
            return Err(format!("{} scales, expected {}x{}", scales.len(), rows.div_ceil(bh), cols.div_ceil(bw)));
        }
        if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
            return Err(format!("non-finite scale {bad}"));
        }
        if let Some(i) = q.iter().position(|&b| e4m3_is_nan(b)) {
            return Err(format!("NaN code at row {} column {}", i / cols, i % cols));
        }
        Ok(Fp8Matrix { rows, cols, block, q, scales })
    }

    /// Rows `rows` and input columns `cols` of this matrix (see [`crate::linear::WeightMatrix::slice`]):
    /// both must start on a scale-block boundary unless one block spans that whole dimension.
    pub fn slice(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Result<Self, String> {
        let [bh, bw] = self.block;
        let (whole_h, whole_w) = (bh >= self.rows, bw >= self.cols);
        if !whole_h && !rows.start.is_multiple_of(bh) {
            return Err(format!("row {} is inside a {bh}x{bw} scale block", rows.start));
        }
        if !whole_w && !cols.start.is_multiple_of(bw) {
            return Err(format!("input column {} is inside a {bh}x{bw} scale block", cols.start));
        }
        let block = [if whole_h { rows.len() } else { bh }, if whole_w { cols.len() } else { bw }];
        let nb = self.cols.div_ceil(bw);
        let (b0, b1) = if whole_w { (0, 1) } else { (cols.start / bw, cols.end.div_ceil(bw)) };
        let (rb0, rb1) = if whole_h { (0, 1) } else { (rows.start / bh, rows.end.div_ceil(bh)) };
        let scales = (rb0..rb1).flat_map(|rb| &self.scales[rb * nb + b0..rb * nb + b1]).copied().collect();
        let q = rows.clone().flat_map(|r| &self.row(r)[cols.clone()]).copied().collect();
        Fp8Matrix::new(rows.len(), cols.len(), block, q, scales)
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `[bh, bw]` of one scale.
    pub fn block(&self) -> [usize; 2] {
        self.block
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scales.len()
    }

    /// E4M3 bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }

    /// Scales along row `r` (one per column block).
    pub fn row_scales(&self, r: usize) -> &[f32] {
        let nb = self.cols.div_ceil(self.block[1]);
        let rb = r / self.block[0];
        &self.scales[rb * nb..(rb + 1) * nb]
    }

    /// Dequantizes row `r`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bw = self.block[1];
        for ((o, q), &s) in out.chunks_mut(bw).zip(self.row(r).chunks(bw)).zip(self.row_scales(r)) {
            for (o, &b) in o.iter_mut().zip(q) {
                *o = e4m3_to_f32(b) * s;
            }
        }
    }

    /// Scalar W8A8 FP8: activations already rounded to E4M3 (`codes`, f32 values) with one
    /// scale per token and column block (`xs`, `m × ceil(cols / bw)`; the last block may be partial);
    /// `out[(r - r0) * m + i] = Σ_b s_w[r, b] · xs[i, b] · Σ_{c∈b} code · e4m3(q)` in f32.
    pub fn rows_fp8_scalar(&self, r0: usize, r1: usize, codes: &[f32], xs: &[f32], m: usize, out: &mut [f32]) {
        let (k, bw) = (self.cols, self.block[1]);
        let nb = k.div_ceil(bw);
        let mut w = vec![0f32; k];
        for r in r0..r1 {
            for (o, &b) in w.iter_mut().zip(self.row(r)) {
                *o = e4m3_to_f32(b);
            }
            let sw = self.row_scales(r);
            for i in 0..m {
                let xi = &codes[i * k..(i + 1) * k];
                let mut acc = 0f32;
                for (b, (ws, cs)) in w.chunks(bw).zip(xi.chunks(bw)).enumerate() {
                    let part: f32 = ws.iter().zip(cs).map(|(a, c)| a * c).sum();
                    acc += sw[b] * xs[i * nb + b] * part;
                }
                out[(r - r0) * m + i] = acc;
            }
        }
    }

    /// [`Self::rows_fp8_scalar`] on the kernel the given ISA runs ([`Fp8Kernel::for_isa`]).
    ///
    /// # Panics
    /// As [`Self::rows_fp8_with`].
    #[allow(clippy::too_many_arguments)] // row range, activations with scales, output tile
    pub fn rows_fp8(&self, isa: Isa, r0: usize, r1: usize, codes: &[f32], xs: &[f32], m: usize, out: &mut [f32]) {
        self.rows_fp8_with(Fp8Kernel::for_isa(isa), r0, r1, codes, xs, m, out)
    }

    /// [`Self::rows_fp8_scalar`] on `kernel`. `codes` is `m × cols`, `xs` is
    /// `m × ceil(cols / bw)`, `out` holds at least `(r1 - r0) × m` values. AVX2 sums each
    /// column block in 8 lanes and AVX-512 BF16 in 16 (orders other than scalar's, within
    /// `k · eps · Σ|w x|`); on each kernel a token's result does not depend on the other
    /// tokens of the batch.
    ///
    /// # Panics
    /// On shapes other than the above, or if `kernel` is not available on this CPU.
    #[allow(clippy::too_many_arguments)] // row range, activations with scales, output tile
    pub fn rows_fp8_with(&self, kernel: Fp8Kernel, r0: usize, r1: usize, codes: &[f32], xs: &[f32], m: usize, out: &mut [f32]) {
        self.rows_fp8_words(kernel, r0, r1, codes, &[], xs, m, out)
    }

    /// [`Self::rows_fp8_with`] taking the codes' bf16 words too when the caller made them
    /// once for every task (`words`, `m × cols`; empty: made here if the kernel needs them).
    #[allow(clippy::too_many_arguments)] // row range, activations in two forms with scales, output tile
    fn rows_fp8_words(&self, kernel: Fp8Kernel, r0: usize, r1: usize, codes: &[f32], words: &[u16], xs: &[f32], m: usize, out: &mut [f32]) {
        let (k, nb) = (self.cols, self.cols.div_ceil(self.block[1]));
        assert!(r0 <= r1 && r1 <= self.rows, "rows {r0}..{r1} of {}", self.rows);
        assert!(codes.len() == m * k && xs.len() == m * nb, "activations: {} codes, {} scales for {m} tokens", codes.len(), xs.len());
        assert!(out.len() >= (r1 - r0) * m, "output tile too small");
        assert!(kernel.available(), "the {} FP8 kernel was requested on a CPU without it", kernel.name());
        match kernel {
            Fp8Kernel::Scalar => self.rows_fp8_scalar(r0, r1, codes, xs, m, out),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2+FMA+F16C presence and all shapes checked above.
            Fp8Kernel::Avx2 => unsafe { avx2::rows_fp8(self, r0, r1, codes, xs, m, out) },
            #[cfg(target_arch = "x86_64")]
            Fp8Kernel::Avx512Bf16 => {
                let made;
                let words = if words.is_empty() {
                    made = bf16_words(codes);
                    &made[..]
                } else {
                    words
                };
                assert_eq!(words.len(), m * k, "bf16 words for {m} tokens");
                // SAFETY: AVX-512 BF16 presence and all shapes checked above.
                unsafe { avx512_bf16::rows_fp8(self, r0, r1, words, xs, m, out) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("only the scalar kernel is available off x86-64"),
        }
    }
}

impl RowKernel for Fp8Matrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        Fp8Matrix::bytes(self)
    }

    fn storage(&self) -> String {
        match self.block {
            [bh, bw] if bh == self.rows && bw == self.cols => "fp8 tensor".into(),
            [1, bw] if bw == self.cols => "fp8 channel".into(),
            [bh, bw] => format!("fp8 block {bh}x{bw}"),
        }
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        Fp8Matrix::dequantize_row(self, r, out)
    }

    fn col_align(&self) -> usize {
        if self.block[1] < self.cols {
            self.block[1].max(32)
        } else {
            32
        }
    }

    fn row_align(&self) -> usize {
        if self.block[0] < self.rows {
            self.block[0]
        } else {
            1
        }
    }

    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Self, String> {
        Fp8Matrix::slice(self, rows, cols)
    }

    fn accepts(&self, act: ActQuant) -> bool {
        act == ActQuant::Fp8PerToken
    }

    fn act_block(&self) -> usize {
        self.block[1]
    }

    fn row_range(&self, isa: Isa, act: &Prepared<'_>, r0: usize, r1: usize, m: usize, tile: &mut [f32]) {
        let Prepared::Fp8 { codes, scales, words } = act else { unreachable!("fp8 takes fp8 activations (checked by accepts)") };
        self.rows_fp8_words(Fp8Kernel::for_isa(isa), r0, r1, codes, words, scales, m, tile)
    }

    fn kernel_id(&self, _act: ActQuant, isa: Isa) -> String {
        format!("cpu.w8a8.fp8xfp8.{}", Fp8Kernel::for_isa(isa).name())
    }

    fn upload(&self, dev: &CudaDevice, act: ActQuant) -> Result<DeviceWeight, CudaError> {
        if act != ActQuant::Fp8PerToken {
            return Err(CudaError::Shape(format!("no CUDA kernel for {} weights with {} activations", RowKernel::storage(self), act.name())));
        }
        let [bh, bw] = self.block;
        DeviceWeight::from_planes(
            dev,
            QuantPlanes {
                format: Box::new(cuda::Fp8Cuda { bh: bh.min(self.rows), bw: bw.min(self.cols) }),
                storage: RowKernel::storage(self),
                rows: self.rows,
                cols: self.cols,
                codes: (0..self.rows).flat_map(|r| self.row(r).iter().copied()).collect(),
                block_scales: None,
                scales: (0..self.rows.div_ceil(bh)).flat_map(|rb| self.row_scales(rb * bh).iter().copied()).collect(),
                zeros: None,
            },
        )
    }
}
