//! Int4 weight matrices (W4A16, W4A8): signed 4-bit values in groups along the input
//! dimension, one f32 scale (and optionally one signed zero point) per row and group. A row
//! has `ceil(cols / group)` groups; the last one may be short (compressed-tensors keeps
//! `group_size` 128 on a 576-column input: groups of 128, 128, 128, 128 and 64).
//!
//! Layout (private to the kernels): each run of 32 columns of a row is 16 bytes, byte `j`
//! holding column `j` in its low nibble and column `j + 16` in its high nibble, as `q + 8`
//! (0..=15). So a 16-byte load unpacks to 32 consecutive columns with one mask and one shift.
//! Rows are interleaved [`ROW_GROUP`] at a time (the last group padded with zero rows): for
//! each group, run `j` of its 16 rows is 256 contiguous bytes, row after row. A row's runs are
//! therefore [`RUN_STRIDE`] bytes apart ([`Int4Matrix::row_ptr`]), and one 64-byte load holds
//! the same run of four rows: the AVX-512 VNNI kernel ([`vnni`]) multiplies sixteen rows with
//! four such loads and no shuffles.

pub(crate) mod avx512_bf16;
pub mod cuda;
pub(crate) mod int16;
pub(crate) mod vnni;

use crate::cpu::{Bf16Products, GemmLevel};
use crate::cpu::Isa;
use crate::cpu::caps::CpuCaps;
use crate::cuda::device::CudaDevice;
use crate::linear::cuda::{DeviceWeight, QuantPlanes};
use crate::cuda::CudaError;
use crate::linear::rowwise::{Prepared, RowKernel};
use crate::linear::{ActQuant, Int8Rows, LinearPolicy};
pub(crate) use int16::Int16Act;
use std::ops::Range;

/// Columns per packed run.
pub const RUN: usize = 32;

/// Rows interleaved together (see the module's layout).
pub const ROW_GROUP: usize = 16;

/// Bytes from one run of a row to its next run: a run of every row of its group.
pub const RUN_STRIDE: usize = ROW_GROUP * RUN / 2;

/// An int4 matrix: `W[r, c] = (q[r, c] - z[r, g]) * s[r, g]` with `g = c / group`
/// (`ceil(cols / group)` groups per row, the last one covering the remaining columns).
#[derive(Clone, Debug)]
pub struct Int4Matrix {
    rows: usize,
    cols: usize,
    group: usize,
    packed: Vec<u8>,
    scales: Vec<f32>,
    zeros: Option<Vec<i8>>,
    /// The scales by row group, then group, then the group's 16 rows (padding rows 0): what
    /// the interleaved kernels load, 16 at a time.
    group_scales: Vec<f32>,
    /// The zero points in the same order (0 when symmetric).
    group_zeros: Vec<i8>,
}

impl Int4Matrix {
    /// Packs `q` (`rows × cols` row-major, each in -8..=7) with `scales` and optional `zeros`
    /// (both `rows × ceil(cols / group)`, row-major; zero points in -8..=7). `cols` and
    /// `group` are multiples of 32; `group` need not divide `cols` (the last group of each row
    /// covers the remaining columns), and `group >= cols` means one group per row (per-channel
    /// scales).
    pub fn new(rows: usize, cols: usize, group: usize, q: &[i8], scales: Vec<f32>, zeros: Option<Vec<i8>>) -> Result<Self, String> {
        if !cols.is_multiple_of(RUN) {
            return Err(format!("int4 kernels need a multiple of 32 input columns (cols {cols})"));
        }
        if group == 0 || !group.is_multiple_of(RUN) {
            return Err(format!("int4 kernels need a group size that is a positive multiple of 32 (group {group})"));
        }
        if q.len() != rows * cols {
            return Err(format!("{} values for {rows}x{cols}", q.len()));
        }
        let per_row = cols.div_ceil(group);
        let ng = rows * per_row;
        if scales.len() != ng {
            return Err(format!("{} scales, expected {rows}x{per_row}", scales.len()));
        }
        if let Some(bad) = scales.iter().find(|s| !s.is_finite()) {
            return Err(format!("non-finite scale {bad}"));
        }
        if let Some(z) = &zeros {
            if z.len() != ng {
                return Err(format!("{} zero points, expected {rows}x{per_row}", z.len()));
            }
            if let Some(bad) = z.iter().find(|&&v| !(-8..=7).contains(&v)) {
                return Err(format!("zero point {bad} outside -8..=7"));
            }
        }
        if let Some(bad) = q.iter().find(|&&v| !(-8..=7).contains(&v)) {
            return Err(format!("value {bad} outside -8..=7"));
        }
        // Padding rows hold the code of 0 (nibble 8) with no scale of their own.
        let mut packed = vec![0x88u8; rows.div_ceil(ROW_GROUP) * ROW_GROUP * cols / 2];
        for (r, row) in q.chunks_exact(cols).enumerate() {
            for (j, src) in row.chunks_exact(RUN).enumerate() {
                let at = Self::run_offset(cols, r, j);
                for (b, dst) in packed[at..at + RUN / 2].iter_mut().enumerate() {
                    *dst = ((src[b] + 8) as u8) | (((src[b + 16] + 8) as u8) << 4);
                }
            }
        }
        let (rgs, per_row) = (rows.div_ceil(ROW_GROUP), cols.div_ceil(group));
        let at = |rg: usize, g: usize, l: usize| (rg * ROW_GROUP + l < rows).then(|| (rg * ROW_GROUP + l) * per_row + g);
        let by_group = |rg: usize, g: usize| (0..ROW_GROUP).map(move |l| at(rg, g, l));
        let groups = || (0..rgs).flat_map(move |rg| (0..per_row).flat_map(move |g| by_group(rg, g)));
        let group_scales = groups().map(|i| i.map_or(0.0, |i| scales[i])).collect();
        let group_zeros = groups().map(|i| i.zip(zeros.as_ref()).map_or(0, |(i, z)| z[i])).collect();
        Ok(Int4Matrix { rows, cols, group, packed, scales, zeros, group_scales, group_zeros })
    }

    /// Rows `rows` and input columns `cols` of this matrix (see [`crate::linear::WeightMatrix::slice`]):
    /// the columns must start on a group boundary unless the scales are per channel.
    pub fn slice(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Result<Self, String> {
        if !self.per_channel() && !cols.start.is_multiple_of(self.group) {
            return Err(format!("input column {} is inside a group of {} (groups start at multiples of {})", cols.start, self.group, self.group));
        }
        let (g0, g1) = if self.per_channel() { (0, 1) } else { (cols.start / self.group, cols.end.div_ceil(self.group)) };
        let mut q = Vec::with_capacity(rows.len() * cols.len());
        let (mut scales, mut zeros) = (Vec::new(), self.zeros.as_ref().map(|_| Vec::new()));
        let mut row = vec![0i8; self.cols];
        for r in rows.clone() {
            self.row_values(r, &mut row);
            q.extend_from_slice(&row[cols.clone()]);
            scales.extend_from_slice(&self.row_scales(r)[g0..g1]);
            if let (Some(z), Some(src)) = (zeros.as_mut(), self.row_zeros(r)) {
                z.extend_from_slice(&src[g0..g1]);
            }
        }
        Int4Matrix::new(rows.len(), cols.len(), self.group, &q, scales, zeros)
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Columns per scale group, as given to [`Self::new`] (the last group of a row may be
    /// shorter, and a group of `cols` or more means one group per row).
    pub fn group(&self) -> usize {
        self.group
    }

    /// Scale groups per row: `ceil(cols / group)`.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(self.group)
    }

    /// Whether each row has a single scale group (per-channel scales, `group >= cols`).
    pub fn per_channel(&self) -> bool {
        self.group >= self.cols
    }

    /// Whether zero points are stored (asymmetric).
    pub fn has_zeros(&self) -> bool {
        self.zeros.is_some()
    }

    /// Bytes held: values, scales and zero points (kept both by row and by row group).
    pub fn bytes(&self) -> usize {
        self.packed.len() + 4 * self.scales.len() + self.zeros.as_ref().map_or(0, Vec::len) + 4 * self.group_scales.len() + self.group_zeros.len()
    }

    /// Byte offset of run `j` of row `r` in a matrix of `cols` columns.
    fn run_offset(cols: usize, r: usize, j: usize) -> usize {
        (r / ROW_GROUP) * ROW_GROUP * cols / 2 + j * RUN_STRIDE + (r % ROW_GROUP) * RUN / 2
    }

    /// Packed values of row `r` (`cols / 2` bytes, its runs in order).
    pub fn packed_row(&self, r: usize) -> Vec<u8> {
        (0..self.cols / RUN).flat_map(|j| self.run(r, j).iter().copied()).collect()
    }

    /// Run `j` of row `r`: 16 packed bytes.
    fn run(&self, r: usize, j: usize) -> &[u8] {
        let at = Self::run_offset(self.cols, r, j);
        &self.packed[at..at + RUN / 2]
    }

    /// The scales of group `g` of row group `rg`'s 16 rows (0 for padding rows).
    pub(crate) fn group_scales(&self, rg: usize, g: usize) -> &[f32; ROW_GROUP] {
        let at = (rg * self.groups() + g) * ROW_GROUP;
        self.group_scales[at..at + ROW_GROUP].try_into().expect("16 scales")
    }

    /// The zero points of group `g` of row group `rg`'s 16 rows (0 when symmetric or padding).
    pub(crate) fn group_zeros(&self, rg: usize, g: usize) -> &[i8; ROW_GROUP] {
        let at = (rg * self.groups() + g) * ROW_GROUP;
        self.group_zeros[at..at + ROW_GROUP].try_into().expect("16 zero points")
    }

    /// Row `r`'s first run: its run `j` starts [`RUN_STRIDE`]` * j` bytes further (the kernels'
    /// pointer arithmetic; `r` may be a padding row of the last group, whose codes are 0).
    pub(crate) fn row_ptr(&self, r: usize) -> *const u8 {
        debug_assert!(r < self.rows.div_ceil(ROW_GROUP) * ROW_GROUP);
        self.packed[Self::run_offset(self.cols, r, 0)..].as_ptr()
    }

    /// Scales of row `r` (one per group, [`Self::groups`] of them).
    pub fn row_scales(&self, r: usize) -> &[f32] {
        let ng = self.groups();
        &self.scales[r * ng..(r + 1) * ng]
    }

    /// Zero points of row `r`, if asymmetric.
    pub fn row_zeros(&self, r: usize) -> Option<&[i8]> {
        let ng = self.groups();
        self.zeros.as_ref().map(|z| &z[r * ng..(r + 1) * ng])
    }

    /// The signed values of row `r`.
    pub fn row_values(&self, r: usize, out: &mut [i8]) {
        assert_eq!(out.len(), self.cols);
        for (j, dst) in out.chunks_exact_mut(RUN).enumerate() {
            let src = self.run(r, j);
            for j in 0..RUN / 2 {
                dst[j] = (src[j] & 0xF) as i8 - 8;
                dst[j + 16] = (src[j] >> 4) as i8 - 8;
            }
        }
    }

    /// Dequantizes row `r` to f32.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let mut q = vec![0i8; self.cols];
        self.row_values(r, &mut q);
        let zeros = self.row_zeros(r);
        for (g, (o, qs)) in out.chunks_mut(self.group).zip(q.chunks(self.group)).enumerate() {
            let (s, z) = (self.row_scales(r)[g], zeros.map_or(0, |z| z[g]));
            for (o, &v) in o.iter_mut().zip(qs) {
                *o = (v - z) as f32 * s;
            }
        }
    }

    /// Scalar W4A16: `out[(r - r0) * m + i] = Σ_g s[r,g] Σ_{c∈g} (q - z) x[i, c]` in f32.
    pub fn rows_f32_scalar(&self, r0: usize, r1: usize, x: &[f32], m: usize, out: &mut [f32]) {
        let step = |acc: f32, s: f32, _: (usize, usize), qs: &[i8], zg: i8, xs: &[f32]| acc + s * qs.iter().zip(xs).map(|(&v, &xv)| (v - zg) as f32 * xv).sum::<f32>();
        self.rows_scalar(r0, r1, x, m, out, step, |_, acc| acc);
    }

    /// The scalar kernels' loop (W4A16, W4A8): for each row `r` and token `i`, from `acc = 0`,
    /// group by group in order, `acc = step(acc, s[r,g], (i, g), q, z[r,g], x)` over the
    /// group's values and activations, then `out[(r - r0) * m + i] = finish(i, acc)`.
    #[allow(clippy::too_many_arguments)] // row range, activations, output tile, the two steps
    fn rows_scalar<X>(
        &self,
        r0: usize,
        r1: usize,
        x: &[X],
        m: usize,
        out: &mut [f32],
        step: impl Fn(f32, f32, (usize, usize), &[i8], i8, &[X]) -> f32,
        finish: impl Fn(usize, f32) -> f32,
    ) {
        let k = self.cols;
        let mut q = vec![0i8; k];
        for r in r0..r1 {
            self.row_values(r, &mut q);
            let (s, z) = (self.row_scales(r), self.row_zeros(r));
            for i in 0..m {
                let xi = &x[i * k..(i + 1) * k];
                let mut acc = 0f32;
                for (g, (qs, xg)) in q.chunks(self.group).zip(xi.chunks(self.group)).enumerate() {
                    acc = step(acc, s[g], (i, g), qs, z.map_or(0, |z| z[g]), xg);
                }
                out[(r - r0) * m + i] = finish(i, acc);
            }
        }
    }

    /// [`Self::rows_f32_scalar`] on `isa`: the AVX2 kernel (f32 FMA over weights unpacked in
    /// registers, register-tiled over rows and up to 8 tokens) agrees with the scalar one to
    /// f32 summation order, and gives bit-identical results for a token whatever `m`, the other
    /// tokens or the row range.
    ///
    /// # Panics
    /// If `isa` is not available here, or the shapes disagree.
    pub fn rows_f32(&self, isa: Isa, r0: usize, r1: usize, x: &[f32], m: usize, out: &mut [f32]) {
        assert!(r0 <= r1 && r1 <= self.rows, "rows {r0}..{r1} of {}", self.rows);
        assert_eq!(x.len(), m * self.cols, "activation shape");
        assert!(out.len() >= (r1 - r0) * m, "output tile");
        match isa {
            Isa::Scalar => self.rows_f32_scalar(r0, r1, x, m, out),
            Isa::Avx2 => {
                assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2+FMA checked above; shapes asserted above.
                unsafe {
                    crate::linear::int_dot_avx2::int4_f32(self, r0, r1, x, m, out)
                }
            }
        }
    }

    /// W4A16 with bf16 activations (`xb`: bit patterns, `m × cols`): the scalar kernel is
    /// [`Self::rows_f32_scalar`] on the activations widened back to f32 (every product is
    /// exact either way); at `Isa::Avx2` the AVX-512 BF16 kernel in this CPU's
    /// [`Bf16Products`] form, which agrees with it to f32 summation order and gives
    /// bit-identical results for a token whatever `m`, the other tokens or the row range.
    ///
    /// # Panics
    /// If `isa` is `Avx2` and this CPU lacks AVX-512 BF16, or the shapes disagree.
    pub fn rows_bf16(&self, isa: Isa, r0: usize, r1: usize, xb: &[u16], m: usize, out: &mut [f32]) {
        self.rows_bf16_in(Bf16Products::detect(), isa, r0, r1, xb, m, out)
    }

    /// [`Self::rows_bf16`] with the products formed as `form` says (at `Isa::Avx2`; tests run
    /// both forms on one machine).
    ///
    /// # Panics
    /// As [`Self::rows_bf16`].
    #[allow(clippy::too_many_arguments)] // rows_bf16's inputs and the form
    pub fn rows_bf16_in(&self, form: Bf16Products, isa: Isa, r0: usize, r1: usize, xb: &[u16], m: usize, out: &mut [f32]) {
        assert!(r0 <= r1 && r1 <= self.rows, "rows {r0}..{r1} of {}", self.rows);
        assert_eq!(xb.len(), m * self.cols, "activation shape");
        assert!(out.len() >= (r1 - r0) * m, "output tile");
        match isa {
            Isa::Scalar => {
                let x: Vec<f32> = xb.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect();
                self.rows_f32_scalar(r0, r1, &x, m, out)
            }
            Isa::Avx2 => {
                assert!(crate::cpu::caps::bf16_dot_available(), "AVX-512 BF16 kernel requested on a CPU without it");
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX-512 BF16 checked above; shapes asserted above.
                unsafe {
                    avx512_bf16::int4_bf16(form, self, r0, r1, xb, m, out)
                }
            }
        }
    }
}

impl Int4Matrix {
    /// Scalar W4A16 with int16 activations (`x`: codes `m × cols`, scales and code sums
    /// `m × groups`, from [`crate::linear::act::quantize_int16_row`] with the blocks of this
    /// matrix's groups): per row and token, group by group in order, the exact integer
    /// `isum = Σ (q - z) · a` and `acc = fma(s[r,g] · sa[i,g], isum, acc)` in f32.
    pub fn rows_int16_scalar(&self, r0: usize, r1: usize, x: &[i16], xs: &[f32], m: usize, out: &mut [f32]) {
        let ng = self.groups();
        let step = |acc: f32, s: f32, (i, g): (usize, usize), qs: &[i8], zg: i8, xg: &[i16]| {
            let isum: i32 = qs.iter().zip(xg).map(|(&v, &a)| (i32::from(v) - i32::from(zg)) * i32::from(a)).sum();
            (s * xs[i * ng + g]).mul_add(isum as f32, acc)
        };
        self.rows_scalar(r0, r1, x, m, out, step, |_, acc| acc);
    }

    /// [`Self::rows_int16_scalar`] on `isa` (`sums`: each group's `Σ a`, `m × groups`): the
    /// AVX2 kernel ([`int16`]) gives the scalar kernel's bits.
    ///
    /// # Panics
    /// If `isa` is not available here, or the shapes disagree.
    #[allow(clippy::too_many_arguments)] // row range, the activations' three parts, tokens, tile
    pub fn rows_int16(&self, isa: Isa, r0: usize, r1: usize, x: &[i16], xs: &[f32], sums: &[i32], m: usize, out: &mut [f32]) {
        assert!(r0 <= r1 && r1 <= self.rows, "rows {r0}..{r1} of {}", self.rows);
        assert_eq!(x.len(), m * self.cols, "activation shape");
        assert!(xs.len() == m * self.groups() && sums.len() == xs.len(), "activation scales and sums");
        assert!(out.len() >= (r1 - r0) * m, "output tile");
        match isa {
            Isa::Scalar => self.rows_int16_scalar(r0, r1, x, xs, m, out),
            Isa::Avx2 => {
                assert!(isa.available(), "AVX2 kernel requested on a CPU without AVX2+FMA");
                #[cfg(target_arch = "x86_64")]
                // SAFETY: AVX2+FMA checked above; shapes asserted above.
                unsafe {
                    int16::int4_int16(self, r0, r1, Int16Act { q: x, scales: xs, sums }, m, out)
                }
            }
        }
    }
}

impl Int8Rows for Int4Matrix {
    /// Scalar W4A8: per group an int32 sum `Σ (q - z) · xq`, then `acc += s[r,g] · sum` in
    /// f32, and `out = xs[i] · acc`.
    fn rows_int8_scalar(&self, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        let step = |acc: f32, s: f32, _: (usize, usize), qs: &[i8], zg: i8, xg: &[i8]| {
            acc + s * qs.iter().zip(xg).map(|(&v, &a)| (v as i32 - zg as i32) * a as i32).sum::<i32>() as f32
        };
        self.rows_scalar(r0, r1, xq, m, out, step, |i, acc| xs[i] * acc);
    }

    /// AVX2 `maddubs` or AVX-512 `vpdpbusd` integer products, int32 group sums, the scalar
    /// epilogue.
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_int8_simd<const VNNI: bool>(&self, r0: usize, r1: usize, xq: &[i8], xs: &[f32], m: usize, out: &mut [f32]) {
        // SAFETY: forwarded contract.
        unsafe { crate::linear::int_dot_avx2::int4_int8::<VNNI>(self, r0, r1, xq, xs, m, out) }
    }
}

impl RowKernel for Int4Matrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn bytes(&self) -> usize {
        Int4Matrix::bytes(self)
    }

    fn storage(&self) -> String {
        let g = if self.per_channel() { "channel".to_string() } else { format!("g{}", self.group) };
        format!("int4 {g} {}", if self.has_zeros() { "asym" } else { "sym" })
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        Int4Matrix::dequantize_row(self, r, out)
    }

    fn col_align(&self) -> usize {
        if self.per_channel() {
            RUN
        } else {
            self.group.max(RUN)
        }
    }

    fn slice(&self, rows: Range<usize>, cols: Range<usize>) -> Result<Self, String> {
        Int4Matrix::slice(self, rows, cols)
    }

    fn accepts(&self, act: ActQuant) -> bool {
        matches!(act, ActQuant::F32 | ActQuant::Bf16 | ActQuant::Int8PerToken | ActQuant::Int16PerGroup)
    }

    /// A weight-only (W4A16) layer takes int8 activations under `policy.int4_int8_act`
    /// (noted); under `policy.int4_16bit_act` bf16 ones where the CPU has the AVX-512 BF16
    /// dot, int16 per group where it has AVX2; f32 otherwise.
    fn activations(&self, checkpoint: ActQuant, caps: &CpuCaps, policy: LinearPolicy) -> (ActQuant, Option<String>) {
        match checkpoint {
            ActQuant::F32 if policy.int4_int8_act => {
                (ActQuant::Int8PerToken, Some("16-bit activations in the checkpoint; quantized to int8 per token (--compute int8-act)".into()))
            }
            ActQuant::F32 if policy.int4_16bit_act && caps.avx512bf16 => (ActQuant::Bf16, None),
            ActQuant::F32 if policy.int4_16bit_act && caps.best_isa() == Isa::Avx2 => (ActQuant::Int16PerGroup, None),
            act => (act, None),
        }
    }

    /// Int16 activations take one scale per weight group (per token for per-channel scales).
    fn act_block(&self) -> usize {
        self.group.min(self.cols)
    }

    fn row_range(&self, isa: Isa, act: &Prepared<'_>, r0: usize, r1: usize, m: usize, tile: &mut [f32]) {
        match act {
            Prepared::F32(x) => self.rows_f32(isa, r0, r1, x, m, tile),
            Prepared::Bf16(xb) => self.rows_bf16(isa, r0, r1, xb, m, tile),
            Prepared::Int8 { q, scales } => self.rows_int8(isa, r0, r1, q, scales, m, tile),
            Prepared::Int16 { q, scales, sums } => self.rows_int16(isa, r0, r1, q, scales, sums, m, tile),
            Prepared::Fp8 { .. } => unreachable!("int4 takes no fp8 activations (checked by accepts)"),
        }
    }

    fn kernel_id(&self, act: ActQuant, isa: Isa) -> String {
        match act {
            ActQuant::F32 => format!("cpu.w4a16.int4xf32.{}", isa.name()),
            ActQuant::Bf16 => format!("cpu.w4a16.int4xbf16.{}", if isa == Isa::Scalar { "scalar" } else { Bf16Products::detect().name() }),
            ActQuant::Int16PerGroup => format!("cpu.w4a16.int4xint16.{}", isa.name()),
            _ => format!("cpu.w4a8.int4xint8.{}", GemmLevel::for_isa(isa).name()),
        }
    }

    /// W4A16 (f32 activations) and W4A8 (int8) have CUDA kernels; bf16 and int16 activations
    /// do not.
    fn upload(&self, dev: &CudaDevice, act: ActQuant) -> Result<DeviceWeight, CudaError> {
        if !matches!(act, ActQuant::F32 | ActQuant::Int8PerToken) {
            return Err(CudaError::Shape(format!("no CUDA kernel for {} weights with {} activations", RowKernel::storage(self), act.name())));
        }
        let rows = 0..self.rows;
        DeviceWeight::from_planes(
            dev,
            QuantPlanes {
                format: Box::new(cuda::Int4Cuda { group: self.group.min(self.cols), int8_act: act == ActQuant::Int8PerToken }),
                storage: RowKernel::storage(self),
                rows: self.rows,
                cols: self.cols,
                codes: rows.clone().flat_map(|r| self.packed_row(r)).collect(),
                block_scales: None,
                scales: rows.clone().flat_map(|r| self.row_scales(r).iter().copied()).collect(),
                zeros: self.has_zeros().then(|| rows.flat_map(|r| self.row_zeros(r).unwrap_or(&[]).iter().copied()).collect()),
            },
        )
    }
}
