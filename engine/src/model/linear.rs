//! A linear layer: a weight matrix in its storage type plus the kernel chosen for it.
//!
//! Weights come either as a GGML-typed tensor (GGUF files, plain float checkpoints) or as a
//! matrix a checkpoint scheme decoded (W4A16, W4A8, W8A8); either way they reach the layer as a
//! [`WeightMatrix`] ([`checkpoint_weight`]), the matrix picks its op (kernel and activations)
//! once here, and [`PlanEntry`] records what was picked. No layer branches on a storage format
//! (GGUF and float tensors are wrapped as a [`GgmlMatrix`], the one format a checkpoint reader
//! hands over as raw bytes).

use super::shard::Cut;
use crate::checkpoint::{LoadError, TensorBytes};
use crate::schemes::{QuantizedWeight, SharedMatrix};
use crate::weights::ModelWeights;
use std::ops::Range;
use std::sync::Arc;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::ggml::GgmlType;
use tessera_kernels::linear::ggml::{GgmlMatrix, WeightBytes};
use tessera_kernels::linear::{forward_fused, ActQuant, LinearOp, LinearPolicy, WeightMatrix};
use tessera_kernels::ops::BlockTransform;
use tessera_kernels::cpu::scratch::with_f32;

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

/// The weight `name` (`[rows, cols]`) as a layer (or a GPU upload) takes it: the matrix its
/// checkpoint scheme decoded, else its tensor wrapped as GGML rows (scheme `gguf` or `float`,
/// f32 activations).
pub fn checkpoint_weight(ck: &ModelWeights, name: &str, rows: usize, cols: usize) -> Result<QuantizedWeight, LoadError> {
    if let Some(q) = ck.quantized.get(name) {
        if [q.matrix.rows(), q.matrix.cols()] != [rows, cols] {
            let msg = format!("quantized shape [{}, {}], expected [{rows}, {cols}]", q.matrix.rows(), q.matrix.cols());
            return Err(LoadError::Tensor { name: q.module.clone(), msg });
        }
        return Ok(q.clone());
    }
    let t = ck.checkpoint.tensor(name)?;
    let err = |msg: String| LoadError::Tensor { name: t.source_name.clone(), msg };
    if t.shape != [rows, cols] {
        return Err(err(format!("shape {:?}, expected [{rows}, {cols}]", t.shape)));
    }
    let matrix = GgmlMatrix::new(t.ty, rows, cols, Arc::new(t.data.clone())).map_err(err)?;
    let scheme = if t.ty.is_float() { "float" } else { "gguf" };
    Ok(QuantizedWeight { module: t.source_name.clone(), scheme: scheme.into(), matrix: Arc::new(matrix), act: ActQuant::F32, perm: None, note: None })
}

/// The part `cut` of `w` (a tensor-parallel shard) and its input permutation: blocks, groups
/// and scales are copied or shared, never re-quantized. An act-order permutation survives a
/// row cut whole; a column cut must select whole stored groups, which holds only when the
/// permutation keeps the rank's inputs in one contiguous stored range.
fn cut_weight(w: &QuantizedWeight, cut: &Cut) -> Result<(SharedMatrix, Option<Vec<u32>>), String> {
    let (m, rows, cols) = (&w.matrix, w.matrix.rows(), w.matrix.cols());
    match (cut, &w.perm) {
        (Cut::Whole, p) => Ok((m.clone(), p.clone())),
        (Cut::Rows(r), p) => Ok((m.slice(r.clone(), 0..cols)?, p.clone())),
        (Cut::Cols(c), None) => Ok((m.slice(0..rows, c.clone())?, None)),
        (Cut::Cols(c), Some(p)) => {
            let stored: Vec<usize> = (0..cols).filter(|&j| c.contains(&(p[j] as usize))).collect();
            let (j0, j1) = (stored[0], stored[stored.len() - 1] + 1);
            if j1 - j0 != stored.len() {
                return Err("the act-order (g_idx) permutation scatters this rank's inputs over the stored groups; it cannot be split without re-quantizing".into());
            }
            let perm = p[j0..j1].iter().map(|&i| i - c.start as u32).collect();
            Ok((m.slice(0..rows, j0..j1)?, Some(perm)))
        }
    }
}

/// A checkpoint tensor's bytes as a kernel matrix holds them (mapped bytes stay mapped).
impl WeightBytes for TensorBytes {
    fn bytes(&self) -> &[u8] {
        TensorBytes::bytes(self)
    }

    fn slice(&self, range: Range<usize>) -> Arc<dyn WeightBytes> {
        Arc::new(TensorBytes::slice(self, range))
    }

    fn release_pages(&self) {
        TensorBytes::release_pages(self)
    }
}

/// `y = x · Wᵀ` for one weight matrix.
#[derive(Debug)]
pub struct Linear {
    name: String,
    scheme: String,
    /// The checkpoint's note, shown unless the op has one of its own.
    note: Option<String>,
    op: Box<dyn LinearOp>,
    /// The tensor-parallel part held, with the full `[rows, cols]`.
    cut: Option<(Cut, [usize; 2])>,
    /// The checkpoint's online input transform (`x ↦ x · T` before the product; its inverse
    /// is folded into the weights).
    input_transform: Option<Arc<BlockTransform>>,
    /// The checkpoint's online output transform (`y ↦ y · U` after the product; its inverse
    /// is folded into the weights).
    output_transform: Option<Arc<BlockTransform>>,
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
        let w = checkpoint_weight(ck, name, rows, cols)?;
        let err = |msg: String| LoadError::Tensor { name: w.module.clone(), msg };
        let (matrix, perm) = cut_weight(&w, &cut).map_err(|e| err(format!("tensor-parallel {}: {e}", describe_cut(&cut, [rows, cols]))))?;
        let op = matrix.op(w.act, perm, caps, policy).map_err(err)?;
        let input_transform = ck.input_transforms.get(name).cloned();
        let output_transform = ck.output_transforms.get(name).cloned();
        // Each side's transform runs on this part's columns (input) or rows (output): whole blocks.
        let sides = [(&input_transform, "input", "columns", match &cut {
            Cut::Cols(c) => c.clone(),
            _ => 0..cols,
        }), (&output_transform, "output", "rows", match &cut {
            Cut::Rows(r) => r.clone(),
            _ => 0..rows,
        })];
        for (t, side, what, range) in sides {
            let Some(b) = t.as_ref().map(|t| t.block()) else { continue };
            let (full, parted) = if what == "rows" { (rows, matches!(cut, Cut::Rows(_))) } else { (cols, matches!(cut, Cut::Cols(_))) };
            if range.start % b != 0 || range.end % b != 0 {
                let msg = format!("its online {side} transform has blocks of {b}, which do not divide {what} {range:?} of {full}");
                return Err(err(if parted { format!("tensor-parallel {}: {msg}", describe_cut(&cut, [rows, cols])) } else { msg }));
            }
        }
        let cut = (cut != Cut::Whole).then_some((cut, [rows, cols]));
        Ok(Linear { name: name.into(), scheme: w.scheme, note: w.note, op, cut, input_transform, output_transform })
    }

    /// Replaces the weights by `w` (`[rows, cols]` row-major f32, held in memory), with the
    /// kernel an F32 checkpoint tensor gets; name and shape stay. The file pages of mapped
    /// weights it replaces are released.
    pub fn set_f32(&mut self, w: &[f32], caps: &CpuCaps, policy: LinearPolicy) -> Result<(), String> {
        let (rows, cols) = (self.rows(), self.cols());
        if w.len() != rows * cols {
            return Err(format!("{}: {} values for a [{rows}, {cols}] weight", self.name, w.len()));
        }
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let matrix = GgmlMatrix::new(GgmlType::F32, rows, cols, Arc::new(bytes))?;
        let op = Arc::new(matrix).op(ActQuant::F32, None, caps, policy)?;
        std::mem::replace(&mut self.op, op).release_pages();
        (self.scheme, self.note) = ("float".into(), None);
        Ok(())
    }

    /// The online input transform this layer runs before its product, if any.
    pub fn input_transform(&self) -> Option<&BlockTransform> {
        self.input_transform.as_deref()
    }

    /// The online output transform this layer runs after its product, if any.
    pub fn output_transform(&self) -> Option<&BlockTransform> {
        self.output_transform.as_deref()
    }

    /// The weight's canonical name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.op.rows()
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.op.cols()
    }

    /// `y[i * ldy + j] = Σ_k x[i, k] W[j, k]` for the rows of `x`, which belong to sequences
    /// of `segments` tokens (each segment picks its kernel path by its own length).
    pub fn forward(&self, x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        Self::forward_fused(&[self], x, segments, y, ldy);
    }

    /// Applies this layer's online input transform to `x` (rows of its input width) in place;
    /// nothing without one. [`Self::forward_transformed`] then reads it.
    pub fn transform_input(&self, x: &mut [f32]) {
        if let Some(t) = &self.input_transform {
            t.apply(x, self.cols());
        }
    }

    /// [`Self::forward`] for an input [`Self::transform_input`] already transformed.
    pub fn forward_transformed(&self, x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        Self::forward_ops(&[self], x, segments, y, ldy);
    }

    /// Several layers reading the same input, writing side by side (`[a | b | c]` per row of
    /// `y`, row stride `ldy`). Layers of one format share one activation quantization and one
    /// parallel region; layers with online input transforms get their own transformed copy of
    /// `x` (one copy when all share one transform).
    pub fn forward_fused(layers: &[&Linear], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        let Some(t) = layers.iter().find_map(|l| l.input_transform.as_ref()) else {
            return Self::forward_ops(layers, x, segments, y, ldy);
        };
        // The loader shares one value between equal transforms (`schemes::transform::decode`).
        if layers.iter().all(|l| l.input_transform.as_ref().is_some_and(|u| Arc::ptr_eq(t, u))) {
            return with_f32(x.len(), |xt| {
                xt.copy_from_slice(x);
                layers[0].transform_input(xt);
                Self::forward_ops(layers, xt, segments, y, ldy);
            });
        }
        // Different transforms: each layer alone, at its columns of `y`.
        let mut col = 0;
        for l in layers {
            with_f32(x.len(), |xt| {
                xt.copy_from_slice(x);
                l.transform_input(xt);
                Self::forward_ops(&[l], xt, segments, &mut y[col..], ldy);
            });
            col += l.rows();
        }
    }

    /// The layers' products on `x` as given (no input transform), each followed by its
    /// online output transform on its columns of `y`. A row-parallel part's outputs are
    /// partial sums; the transform is linear, so turning each rank's part turns their sum.
    fn forward_ops(layers: &[&Linear], x: &[f32], segments: &[usize], y: &mut [f32], ldy: usize) {
        let mut col = 0;
        let parts: Vec<(&dyn LinearOp, usize)> = layers
            .iter()
            .map(|l| {
                let at = col;
                col += l.rows();
                (&*l.op, at)
            })
            .collect();
        forward_fused(&parts, x, segments, y, ldy);
        let tokens = x.len() / layers.first().map_or(1, |l| l.cols().max(1));
        for (l, &(_, at)) in layers.iter().zip(&parts) {
            let Some(t) = &l.output_transform else { continue };
            let n = l.rows();
            if at == 0 && ldy == n {
                t.apply(&mut y[..tokens * ldy], ldy);
            } else {
                // A part of wider rows: gathered, turned in one (parallel) call, put back.
                with_f32(tokens * n, |part| {
                    for (i, p) in part.chunks_exact_mut(n).enumerate() {
                        p.copy_from_slice(&y[i * ldy + at..i * ldy + at + n]);
                    }
                    t.apply(part, n);
                    for (i, p) in part.chunks_exact(n).enumerate() {
                        y[i * ldy + at..i * ldy + at + n].copy_from_slice(p);
                    }
                });
            }
        }
    }

    /// This layer's plan entry.
    pub fn plan(&self) -> PlanEntry {
        let p = self.op.plan();
        let shard = self.cut.as_ref().map(|(cut, full)| describe_cut(cut, *full));
        PlanEntry {
            tensor: self.name.clone(),
            scheme: self.scheme.clone(),
            storage: p.storage,
            activations: match (&self.input_transform, &self.output_transform) {
                (Some(t), None) => format!("{} then {}", t.describe(), p.activations),
                (Some(t), Some(u)) => format!("{} then {}, outputs {}", t.describe(), p.activations, u.describe()),
                (None, Some(u)) => format!("{}, outputs {}", p.activations, u.describe()),
                (None, None) => p.activations,
            },
            shape: [self.rows(), self.cols()],
            kernel: p.kernel,
            note: p.note.or_else(|| self.note.clone()),
            shard,
        }
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
