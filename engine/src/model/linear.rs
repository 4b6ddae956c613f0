//! A linear layer: a weight matrix in its storage type plus the kernel chosen for it.
//!
//! Weights come either as a GGML-typed tensor (GGUF files, plain float checkpoints) or as a
//! [`QuantizedWeight`] a checkpoint scheme decoded (W4A16, W4A8, W8A8); either way the kernel
//! is picked once here, and [`PlanEntry`] records what was picked.

use super::shard::Cut;
use crate::checkpoint::{Checkpoint, LoadError, TensorBytes};
use crate::quant::QuantizedWeight;
use crate::weights::ModelWeights;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::interleaved::Interleaved;
use tessera_kernels::linear::{forward_group, LinearKernel, LinearPolicy, Weight, WeightView};
use tessera_kernels::quant::{forward_fused as quant_forward_fused, ActQuant, QuantLinear, QuantMatrix};

/// One row of the per-layer plan: what a weight is stored as and which kernel runs it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PlanEntry {
    /// Canonical tensor name.
    pub tensor: String,
    /// Scheme that produced the weights (`gguf`, `float`, or e.g. `compressed-tensors W4A16 (...)`).
    pub scheme: String,
    /// Storage, e.g. `Q4_1`, `BF16`, `int4 g128 sym`.
    pub storage: String,
    /// Run-time activation handling (`f32`, `int8/token`, `fp8/token`, `q8 blocks` for the
    /// GGML integer GEMM).
    pub activations: String,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// Kernel id.
    pub kernel: String,
    /// Where the layer runs differently from what its metadata records, why.
    pub note: Option<String>,
    /// The part a tensor-parallel rank holds (`rows 0..768 of 1536`), when not all of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<String>,
}

/// The weights and their kernel.
#[derive(Debug)]
enum Weights {
    /// A GGML-typed tensor (GGUF or float), read in place, with its two-path kernel.
    Ggml { ty: GgmlType, data: TensorBytes, kernel: LinearKernel },
    /// GGUF types with an integer kernel (all but floats, Q2_K, Q3_K) regrouped at load for the integer GEMM (the file's rows are not kept).
    Interleaved { w: Interleaved, kernel: LinearKernel },
    /// A checkpoint-quantized matrix with its kernel.
    Quant { op: QuantLinear, scheme: String, note: Option<String> },
}

/// `y = x · Wᵀ` for one weight matrix.
#[derive(Debug)]
pub struct Linear {
    name: String,
    rows: usize,
    cols: usize,
    w: Weights,
    /// The tensor-parallel part held, with the full `[rows, cols]`.
    cut: Option<(Cut, [usize; 2])>,
}

impl Linear {
    /// Builds the linear layer `name` (`[rows, cols]`) from a checkpoint: its quantized form if
    /// the checkpoint's scheme decoded one, else its tensor.
    pub fn load(ck: &ModelWeights, name: &str, rows: usize, cols: usize, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        Self::load_cut(ck, name, rows, cols, Cut::Whole, caps, policy)
    }

    /// [`Self::load`] for the part `cut` of the `[rows, cols]` weight (a tensor-parallel
    /// shard): blocks, groups and scales are copied, never re-quantized, and a cut that would
    /// split one is refused with the tensor's name and the reason.
    pub fn load_cut(ck: &ModelWeights, name: &str, rows: usize, cols: usize, cut: Cut, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        let mut l = match ck.quantized.get(name) {
            Some(q) => Self::quantized(name, q, rows, cols, &cut, caps, policy)?,
            None => Self::ggml(name, &ck.checkpoint, rows, cols, &cut, caps, policy)?,
        };
        if cut != Cut::Whole {
            l.cut = Some((cut, [rows, cols]));
        }
        Ok(l)
    }

    fn quantized(name: &str, q: &QuantizedWeight, rows: usize, cols: usize, cut: &Cut, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        let err = |msg: String| LoadError::Tensor { name: q.module.clone(), msg };
        if [q.matrix.rows(), q.matrix.cols()] != [rows, cols] {
            return Err(err(format!("quantized shape [{}, {}], expected [{rows}, {cols}]", q.matrix.rows(), q.matrix.cols())));
        }
        let (matrix, perm) = shard_quantized(q, cut).map_err(|e| err(format!("tensor-parallel {}: {e}", describe_cut(cut, [rows, cols]))))?;
        let [rows, cols] = cut.shape(rows, cols);
        let weight_only_int4 = q.act == ActQuant::F32 && matches!(*q.matrix, QuantMatrix::Int4(_));
        let (act, note) = if weight_only_int4 && policy.int4_int8_act {
            (ActQuant::Int8PerToken, Some("16-bit activations in the checkpoint; quantized to int8 per token (--compute int8-act)".to_string()))
        } else if weight_only_int4 && policy.int4_bf16_act && caps.avx512bf16 {
            (ActQuant::Bf16, q.note.clone())
        } else {
            (q.act, q.note.clone())
        };
        let mut op = QuantLinear::new(matrix, act, caps).map_err(err)?;
        if let Some(p) = perm {
            op = op.with_input_permutation(p).map_err(err)?;
        }
        Ok(Linear { name: name.into(), rows, cols, w: Weights::Quant { op, scheme: q.scheme.clone(), note }, cut: None })
    }

    fn ggml(name: &str, ck: &Checkpoint, rows: usize, cols: usize, cut: &Cut, caps: &CpuCaps, policy: LinearPolicy) -> Result<Self, LoadError> {
        let t = ck.tensor(name)?;
        let err = |msg: String| LoadError::Tensor { name: t.source_name.clone(), msg };
        if t.shape != [rows, cols] {
            return Err(err(format!("shape {:?}, expected [{rows}, {cols}]", t.shape)));
        }
        let data = match cut {
            Cut::Whole => t.data.clone(),
            Cut::Rows(r) => {
                let rb = t.ty.row_bytes(cols).ok_or_else(|| err(format!("{cols} columns are not whole {} blocks", t.ty.name())))?;
                t.data.slice(r.start * rb..r.end * rb)
            }
            Cut::Cols(c) => TensorBytes::Owned(
                t.ty.slice_matrix(cols, t.data.bytes(), 0..rows, c.clone())
                    .map_err(|e| err(format!("tensor-parallel {}: {e}", describe_cut(cut, [rows, cols]))))?
                    .into(),
            ),
        };
        let [rows, cols] = cut.shape(rows, cols);
        let view = WeightView::new(t.ty, rows, cols, data.bytes()).map_err(err)?;
        let kernel = LinearKernel::select(t.ty, caps, policy);
        let w = if kernel.wants_interleaved() {
            let w = Interleaved::pack(&view).map_err(|msg| LoadError::Tensor { name: t.source_name.clone(), msg })?;
            data.release_pages();
            if matches!(cut, Cut::Cols(_)) {
                // The columns were copied out of the file's pages; they are not needed either.
                t.data.release_pages();
            }
            Weights::Interleaved { w, kernel }
        } else {
            Weights::Ggml { ty: t.ty, data, kernel }
        };
        Ok(Linear { name: name.into(), rows, cols, w, cut: None })
    }

    /// Replaces the weights by `w` (`[rows, cols]` row-major f32, held in memory), with the
    /// kernel an F32 checkpoint tensor gets; name and shape stay. The file pages of mapped
    /// weights it replaces are released.
    pub fn set_f32(&mut self, w: &[f32], caps: &CpuCaps, policy: LinearPolicy) -> Result<(), String> {
        if w.len() != self.rows * self.cols {
            return Err(format!("{}: {} values for a [{}, {}] weight", self.name, w.len(), self.rows, self.cols));
        }
        if let Weights::Ggml { data, .. } = &self.w {
            data.release_pages();
        }
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.w = Weights::Ggml { ty: GgmlType::F32, data: TensorBytes::Owned(bytes.into()), kernel: LinearKernel::select(GgmlType::F32, caps, policy) };
        Ok(())
    }

    /// The weight's canonical name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `y[i * ldy + j] = Σ_k x[i, k] W[j, k]` for the rows of `x`, which belong to sequences
    /// of `segments` tokens (each segment picks its kernel path by its own length).
    pub fn forward(&self, x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        Self::forward_fused(&[self], x, segments, y, ldy);
    }

    /// Several layers reading the same input, writing side by side (`[a | b | c]` per row of
    /// `y`, row stride `ldy`). GGML layers share one activation quantization and one parallel
    /// region, and so do checkpoint-quantized layers.
    pub fn forward_fused(layers: &[&Linear], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        let m: usize = segments.iter().sum();
        let (mut ggml, mut quant) = (Vec::new(), Vec::new());
        let mut col = 0;
        for l in layers {
            match &l.w {
                Weights::Ggml { ty, data, kernel } => {
                    ggml.push((kernel, Weight::Rows(WeightView { ty: *ty, rows: l.rows, cols: l.cols, data: data.bytes() }), col))
                }
                Weights::Interleaved { w, kernel } => ggml.push((kernel, Weight::Interleaved(w), col)),
                Weights::Quant { op, .. } => quant.push((op, col)),
            }
            col += l.rows;
        }
        if !quant.is_empty() {
            quant_forward_fused(&quant, x, m, y, ldy);
        }
        if !ggml.is_empty() {
            forward_group(&ggml, x, segments, y, ldy);
        }
    }

    /// This layer's plan entry.
    pub fn plan(&self) -> PlanEntry {
        let (scheme, storage, activations, kernel, note) = match &self.w {
            Weights::Ggml { ty, kernel, .. } => {
                let scheme = if ty.is_float() { "float" } else { "gguf" };
                (scheme.to_string(), ty.name().to_string(), kernel.activations(), kernel.id(), None)
            }
            Weights::Interleaved { w, kernel } => ("gguf".to_string(), w.ty().name().to_string(), kernel.activations(), kernel.id(), None),
            Weights::Quant { op, scheme, note } => (scheme.clone(), op.matrix().storage(), op.act().name().to_string(), op.id(), note.clone()),
        };
        let shard = self.cut.as_ref().map(|(cut, full)| describe_cut(cut, *full));
        PlanEntry { tensor: self.name.clone(), scheme, storage, activations, shape: [self.rows, self.cols], kernel, note, shard }
    }
}

/// `rows 0..768 of 1536`, `columns 384..576 of 576`, `all`.
fn describe_cut(cut: &Cut, [rows, cols]: [usize; 2]) -> String {
    match cut {
        Cut::Whole => "all".into(),
        Cut::Rows(r) => format!("rows {r:?} of {rows}"),
        Cut::Cols(c) => format!("columns {c:?} of {cols}"),
    }
}

/// The part `cut` of a checkpoint-quantized weight and its input permutation. An act-order
/// permutation survives a row cut whole; a column cut must select whole stored groups, which
/// holds only when the permutation keeps each rank's inputs in one contiguous stored range.
fn shard_quantized(q: &QuantizedWeight, cut: &Cut) -> Result<(std::sync::Arc<QuantMatrix>, Option<Vec<u32>>), String> {
    let (rows, cols) = (q.matrix.rows(), q.matrix.cols());
    match (cut, &q.perm) {
        (Cut::Whole, p) => Ok((q.matrix.clone(), p.clone())),
        (Cut::Rows(r), p) => Ok((q.matrix.slice(r.clone(), 0..cols)?.into(), p.clone())),
        (Cut::Cols(c), None) => Ok((q.matrix.slice(0..rows, c.clone())?.into(), None)),
        (Cut::Cols(c), Some(p)) => {
            let stored: Vec<usize> = (0..cols).filter(|&j| c.contains(&(p[j] as usize))).collect();
            let (j0, j1) = (stored[0], stored[stored.len() - 1] + 1);
            if j1 - j0 != stored.len() {
                return Err("the act-order (g_idx) permutation scatters this rank's inputs over the stored groups; it cannot be split without re-quantizing".into());
            }
            let perm = p[j0..j1].iter().map(|&i| i - c.start as u32).collect();
            Ok((q.matrix.slice(0..rows, j0..j1)?.into(), Some(perm)))
        }
    }
}
