//! File-to-file weight quantization of a Hugging Face directory into compressed-tensors or
//! AMD Quark checkpoints (the formats of checkpoint-formats.md §2 and §4).
//!
//! One safetensors shard at a time: the input shard is memory-mapped, its linear weights are
//! quantized and every other tensor is copied byte for byte (or, under SmoothQuant, rewritten
//! by its factors), the matching output shard is written, and everything is dropped before the
//! next shard, so memory stays bounded by the largest shard. Calibrated quantization
//! ([`Calibrated`]) runs the model over the calibration text first. SmoothQuant takes its
//! activation maxima from the float model in one pass. GPTQ is sequential: block by block and
//! site by site, each layer is quantized from the Hessian of the inputs it gets once every
//! layer before it is quantized ([`calibrate::calibrate_sequential`]), and its written tensors
//! are kept until its shard is written; each layer rounds the weights that best reproduce the
//! float model's outputs from its quantized inputs ([`gptq::FloatTarget`]). That adds to the
//! shard's memory the model loaded twice for calibration (float, and with its block linears
//! replaced by f32 copies of what was written: 4 bytes per weight), the written tensors, and
//! the calibration tokens' hidden states in both models.
//! config.json gets a `quantization_config` naming the unquantized linear
//! modules concretely; tokenizer, generation and chat-template files are copied.
//!
//! Which tensors are quantized: the 2-D `.weight` of every Linear module (`*_proj`, including
//! MoE experts `mlp.experts.E.*_proj` and Mixtral's `block_sparse_moe.experts.E.w1|w2|w3`) unless excluded. Never quantized: embeddings, norms,
//! routers (`mlp.gate`, `shared_expert_gate`), and `lm_head` unless [`QuantizeOptions::head`]
//! gives it a recipe (llm-compressor's default `ignore=["lm_head"]`). `--exclude` globs (Python's fnmatch: `*` crosses dots, the whole name must match) and `experts_only` exclude
//! more; excluded linears are copied unchanged.
//!
//! Every quantized tensor is decoded back from the bytes written and measured against the input
//! (after smoothing, when SmoothQuant runs) ([`report`]).

pub mod calibrate;
pub mod compressed_tensors;
pub mod gptq;
pub mod math;
pub mod quark;
pub mod report;
pub mod rotate;
pub mod sampled;
pub mod smooth;

use crate::float_dtype::FloatDtype;
use crate::schemes::pattern::fnmatch;
use calibrate::{calibrate, calibrate_sequential, calibration_sequences, CalibrationOptions};
use gptq::Factor;
use math::{column_absmax_into, Grid, INT4, INT8};
use smooth::{module_site, Rescale, Smoothing};
use std::sync::Mutex;
use memmap2::Mmap;
use report::{Report, TensorStats};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Errors while quantizing. Messages name the file, tensor or option at fault.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    /// A meaningless combination of options.
    #[error("{0}")]
    Usage(String),
    /// A file that cannot be read or written.
    #[error("{path}: {msg}")]
    Io {
        /// File at fault.
        path: PathBuf,
        /// What failed.
        msg: String,
    },
    /// A tensor that cannot be quantized.
    #[error("tensor {name}: {msg}")]
    Tensor {
        /// Tensor name in the input checkpoint.
        name: String,
        /// What was wrong.
        msg: String,
    },
}

fn io(path: &Path, e: impl std::fmt::Display) -> QuantizeError {
    QuantizeError::Io { path: path.into(), msg: e.to_string() }
}

/// Quantization schemes (weights and activations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// int4 weights (group scales), 16-bit activations.
    W4A16,
    /// int4 weights per channel, 8-bit dynamic activations.
    W4A8,
    /// FP8 E4M3 weights per channel, FP8 dynamic per-token activations.
    W8A8Fp8,
    /// int8 weights per channel, int8 dynamic per-token activations.
    W8A8Int8,
}

impl Scheme {
    /// The CLI name (`w4a16`, `w4a8`, `w8a8-fp8`, `w8a8-int8`).
    pub fn name(self) -> &'static str {
        match self {
            Scheme::W4A16 => "w4a16",
            Scheme::W4A8 => "w4a8",
            Scheme::W8A8Fp8 => "w8a8-fp8",
            Scheme::W8A8Int8 => "w8a8-int8",
        }
    }

    /// GPTQ's relative damping in this scheme's default recipe ([`Calibrated::damping`]):
    /// [`INT4_DAMPING`] for the int4 schemes, where it was measured
    /// (docs/benchmarks/quantized-quality.md), the paper's 1% for the 8-bit ones, where
    /// more damping helped some texts and hurt others.
    pub fn gptq_damping(self) -> f64 {
        match self {
            Scheme::W4A16 | Scheme::W4A8 => INT4_DAMPING,
            Scheme::W8A8Fp8 | Scheme::W8A8Int8 => gptq::PAPER_DAMPING,
        }
    }
}

/// GPTQ's relative damping for int4 weights (W4A16, W4A8): 30 times the paper's 1%. More
/// damping leans each column's error feedback less on correlations the calibration text
/// measured, which other text does not share (docs/benchmarks/quantized-quality.md, "GPTQ's
/// damping").
pub const INT4_DAMPING: f64 = 0.3;

/// Output checkpoint formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// compressed-tensors (llm-compressor), `quant_method: "compressed-tensors"`.
    CompressedTensors,
    /// AMD Quark, `quant_method: "quark"`.
    Quark,
}

impl Format {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Format::CompressedTensors => "compressed-tensors",
            Format::Quark => "quark",
        }
    }
}

/// Default int4 group size of w4a16 (compressed-tensors' W4A16 preset).
pub const DEFAULT_GROUP_SIZE: usize = 128;

/// The group sizes [`fitted_group_size`] tries, largest first.
const FITTED_GROUP_SIZES: [usize; 3] = [DEFAULT_GROUP_SIZE, 64, 32];

/// The group size `quantize` gives int4 weights when none is asked for:
/// [`DEFAULT_GROUP_SIZE`] where it divides the input width of every linear weight in
/// `input` (a Hugging Face directory), else the largest of 64 and 32 that does, so that no
/// row ends in a short group: vLLM's Marlin kernels and compressed-tensors' decompression
/// refuse one. [`DEFAULT_GROUP_SIZE`] when none divides them all (the last group is then
/// short, which Tessera loads). With the size comes the first weight (name, input width)
/// that [`DEFAULT_GROUP_SIZE`] does not divide, if any.
pub fn fitted_group_size(input: &Path) -> Result<(usize, Option<(String, usize)>), QuantizeError> {
    let mut widths = BTreeMap::new();
    for shard in input_shards(input)? {
        let path = input.join(&shard);
        let map = map_file(&path)?;
        for (name, view) in read_shard(&map, &path)?.tensors() {
            let Some(module) = name.strip_suffix(".weight") else { continue };
            if view.shape().len() == 2 && is_linear(module) && !is_router(module) {
                widths.insert(name, view.shape()[1]);
            }
        }
    }
    let divides = |g: usize| widths.values().all(|w| w.is_multiple_of(g));
    let group = FITTED_GROUP_SIZES.into_iter().find(|&g| divides(g)).unwrap_or(DEFAULT_GROUP_SIZE);
    Ok((group, widths.into_iter().find(|(_, w)| !w.is_multiple_of(DEFAULT_GROUP_SIZE))))
}

/// A resolved scheme in one format: what is written per layer and in config.json.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recipe {
    /// A compressed-tensors scheme.
    CompressedTensors(compressed_tensors::Scheme),
    /// A Quark scheme.
    Quark(quark::Scheme),
}

impl Recipe {
    /// Resolves a scheme, an optional format (default: Quark for w4a8, else compressed-tensors),
    /// an optional group size (w4a16 only; default [`DEFAULT_GROUP_SIZE`]) and whether int4
    /// weights get zero points (compressed-tensors int4 only).
    pub fn resolve(scheme: Scheme, format: Option<Format>, group_size: Option<usize>, asymmetric: bool) -> Result<Self, QuantizeError> {
        let usage = |m: &str| Err(QuantizeError::Usage(m.to_string()));
        let format = format.unwrap_or(if scheme == Scheme::W4A8 { Format::Quark } else { Format::CompressedTensors });
        let ct_int4 = scheme == Scheme::W4A16 || (scheme == Scheme::W4A8 && format == Format::CompressedTensors);
        if group_size.is_some() && !ct_int4 {
            return Err(QuantizeError::Usage(format!(
                "--group-size applies to w4a16, and to w4a8 in compressed-tensors format: {} in {} format uses one scale per output channel",
                scheme.name(),
                format.name()
            )));
        }
        if asymmetric && !ct_int4 {
            return Err(QuantizeError::Usage(format!(
                "--asymmetric applies to int4 weights in compressed-tensors format (w4a16, or w4a8 with --format compressed-tensors): \
                 {} in {} format is written symmetric only",
                scheme.name(),
                format.name()
            )));
        }
        if let Some(g) = group_size {
            if g == 0 || !g.is_multiple_of(8) {
                return Err(QuantizeError::Usage(format!("--group-size {g}: must be a positive multiple of 8")));
            }
        }
        use compressed_tensors::Scheme as Ct;
        Ok(match (scheme, format) {
            (Scheme::W4A16, Format::CompressedTensors) => {
                Recipe::CompressedTensors(Ct::Int4 { group: Some(group_size.unwrap_or(DEFAULT_GROUP_SIZE)), int8_act: false, asymmetric })
            }
            (Scheme::W4A8, Format::CompressedTensors) => Recipe::CompressedTensors(Ct::Int4 { group: group_size, int8_act: true, asymmetric }),
            (Scheme::W8A8Int8, Format::CompressedTensors) => Recipe::CompressedTensors(Ct::Int8),
            (Scheme::W8A8Fp8, Format::CompressedTensors) => Recipe::CompressedTensors(Ct::Fp8),
            (Scheme::W4A8, Format::Quark) => Recipe::Quark(quark::Scheme::W4A8),
            (Scheme::W8A8Fp8, Format::Quark) => Recipe::Quark(quark::Scheme::Fp8),
            (Scheme::W4A16, Format::Quark) => {
                return usage(
                    "w4a16 is not written in Quark format (Quark's per_group int4 layout stores transposed [in, out/8] weights \
                     and [in/group, out] scales, which Tessera does not implement); use --format compressed-tensors",
                )
            }
            (Scheme::W8A8Int8, Format::Quark) => Recipe::Quark(quark::Scheme::Int8),
        })
    }

    /// The recipe of a quantized output head: `scheme` in `body`'s format (one
    /// `quantization_config` holds both). An int4 head in compressed-tensors format takes a
    /// grouped int4 body's group size and zero points; otherwise it gets [`Recipe::resolve`]'s
    /// defaults (W4A16: group 128).
    pub fn head(scheme: Scheme, body: &Recipe) -> Result<Self, QuantizeError> {
        let int4_head = matches!(scheme, Scheme::W4A16 | Scheme::W4A8) && body.format() == Format::CompressedTensors;
        let (group, asymmetric) = match body {
            Recipe::CompressedTensors(compressed_tensors::Scheme::Int4 { group, asymmetric, .. }) if int4_head => (*group, *asymmetric),
            _ => (None, false),
        };
        Self::resolve(scheme, Some(body.format()), group, asymmetric)
    }

    /// The output format.
    pub fn format(&self) -> Format {
        match self {
            Recipe::CompressedTensors(_) => Format::CompressedTensors,
            Recipe::Quark(_) => Format::Quark,
        }
    }

    /// Columns per finest scale (report blocks).
    fn block_cols(&self, cols: usize) -> usize {
        match self {
            Recipe::CompressedTensors(compressed_tensors::Scheme::Int4 { group: Some(g), .. }) => (*g).min(cols),
            _ => cols,
        }
    }

    /// Quantizes one `[rows, cols]` weight of module `prefix` (scales searched when `mse`,
    /// weighting columns by the inputs' energy when the GPTQ `factor` of its inputs is given;
    /// values by GPTQ with that factor, else rounded to nearest); `Err` says why it cannot be.
    fn quantize(&self, prefix: &str, w: &[f32], cols: usize, dtype: FloatDtype, mse: bool, factor: Option<&Factor>) -> Result<Vec<OutTensor<'static>>, String> {
        let rows = w.len() / cols;
        use compressed_tensors::Scheme as Ct;
        let int4 = matches!(self, Recipe::CompressedTensors(Ct::Int4 { .. }) | Recipe::Quark(quark::Scheme::W4A8));
        if int4 && !cols.is_multiple_of(8) {
            return Err(format!("{cols} input columns are not a multiple of 8 (int4 packs 8 values per I32 word)"));
        }
        let block = self.block_cols(cols);
        if !cols.is_multiple_of(block) {
            // compressed-tensors writes the same layout (with a warning), but its 0.20
            // decompression refuses it; Tessera and the format itself are fine with it.
            static RAGGED: std::sync::Once = std::sync::Once::new();
            RAGGED.call_once(|| {
                tracing::warn!(
                    layer = prefix,
                    cols,
                    group = block,
                    "ragged last int4 group: Tessera loads it, compressed-tensors 0.20's decompress (so transformers) refuses it; use a --group-size that divides the input width for interchange"
                )
            });
        }
        let mut grid = match self {
            Recipe::CompressedTensors(Ct::Int4 { asymmetric: true, .. }) => Grid::asymmetric(w, cols, block, INT4, dtype),
            Recipe::CompressedTensors(Ct::Int4 { .. }) => Grid::symmetric(w, cols, block, INT4, dtype),
            Recipe::CompressedTensors(Ct::Int8) => Grid::symmetric(w, cols, cols, INT8, dtype),
            Recipe::CompressedTensors(Ct::Fp8) => Grid::fp8_rows(w, cols, dtype),
            Recipe::Quark(quark::Scheme::W4A8) => Grid::progressive(w, cols),
            Recipe::Quark(quark::Scheme::Fp8) => Grid::fp8_rows(w, cols, FloatDtype::F32),
            Recipe::Quark(quark::Scheme::Int8) => Grid::symmetric(w, cols, cols, INT8, FloatDtype::F32),
        };
        if let Some(f) = factor.filter(|f| f.energy.len() != cols) {
            return Err(format!("calibration inputs are {} wide, the weight has {cols} columns", f.energy.len()));
        }
        if mse {
            grid.search_clipping(w, factor.map(|f| f.energy.as_slice()));
        }
        let codes = match factor {
            Some(f) => gptq::gptq(w, &grid, f)?,
            None => grid.round(w),
        };
        Ok(match self {
            Recipe::CompressedTensors(Ct::Int4 { .. }) => compressed_tensors::int4_tensors(prefix, &grid, &codes, rows, cols, dtype),
            Recipe::CompressedTensors(_) => compressed_tensors::byte_tensors(prefix, &grid, codes, rows, cols, dtype),
            Recipe::Quark(_) => quark::tensors(prefix, &grid, codes, rows, cols),
        })
    }

    /// Decodes a layer's written tensors back to f32.
    fn decode(&self, prefix: &str, tensors: &[OutTensor<'_>], rows: usize, cols: usize) -> Result<Vec<f32>, String> {
        match self {
            Recipe::CompressedTensors(_) => compressed_tensors::decode(prefix, tensors, rows, cols, self.block_cols(cols)),
            Recipe::Quark(_) => quark::decode(prefix, tensors, rows, cols),
        }
    }

    /// `quantization_config` with the unquantized linear modules and, when the output head is
    /// quantized, its recipe, which must be in this recipe's format ([`Recipe::head`] makes it
    /// so; [`quantize_dir`] refuses a mismatch before writing anything).
    ///
    /// # Panics
    /// If `head` is in another format.
    pub fn quantization_config(&self, head: Option<&Recipe>, ignored: &[String]) -> Value {
        match (self, head) {
            (Recipe::CompressedTensors(s), Some(Recipe::CompressedTensors(h))) => compressed_tensors::quantization_config(s, Some(h), ignored),
            (Recipe::CompressedTensors(s), None) => compressed_tensors::quantization_config(s, None, ignored),
            (Recipe::Quark(s), Some(Recipe::Quark(h))) => quark::quantization_config(s, Some(h), ignored),
            (Recipe::Quark(s), None) => quark::quantization_config(s, None, ignored),
            (_, Some(h)) => panic!("the output head's recipe is in {} format, the model's in {}", h.format().name(), self.format().name()),
        }
    }
}

/// One tensor of an output shard: quantized data (owned) or an input tensor (borrowed).
#[derive(Clone, Debug)]
pub struct OutTensor<'a> {
    /// Tensor name.
    pub name: String,
    /// Storage type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Cow<'a, [u8]>,
}

impl OutTensor<'static> {
    /// A tensor owning its bytes.
    pub fn owned(name: String, dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> Self {
        OutTensor { name, dtype, shape, data: Cow::Owned(data) }
    }
}

/// The tensor called `name` among `tensors`.
fn find<'t, 'a>(tensors: &'t [OutTensor<'a>], name: &str) -> Result<&'t OutTensor<'a>, String> {
    tensors.iter().find(|t| t.name == name).ok_or_else(|| format!("{name} was not written"))
}

/// Options of [`quantize_dir`].
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// Input Hugging Face directory (plain float weights).
    pub input: PathBuf,
    /// Output directory (created if missing; must differ from the input).
    pub output: PathBuf,
    /// What to write.
    pub recipe: Recipe,
    /// fnmatch globs of module names (no `.weight`) to leave unquantized.
    pub exclude: Vec<String>,
    /// Leave every linear outside routed experts (`.experts.E.`) unquantized.
    pub experts_only: bool,
    /// Calibrated quantization (SmoothQuant, GPTQ), or rounding to nearest when `None`.
    pub calibrated: Option<Calibrated>,
    /// Choose every scale by the clipping search of [`Grid::search_clipping`] (an MSE
    /// observer) instead of the range's min/max.
    pub mse_observer: bool,
    /// Where the long passes (sampling, GPTQ's blocks, shards) report how far they are.
    pub progress: Progress,
    /// Also quantize the output head (`lm_head`) with this recipe, in `recipe`'s format
    /// ([`Recipe::head`]); `None` leaves it as it is (llm-compressor's default). A head tied to
    /// the embedding is untied: `lm_head.weight` is written quantized from the embedding, which
    /// stays as it is, and config.json gets `tie_word_embeddings: false`.
    pub head: Option<Recipe>,
}

/// A long pass of [`quantize_dir`], as reported to [`Progress`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The model samples its calibration text (tokens).
    Sampling,
    /// GPTQ quantizes the model block by block (blocks).
    Gptq,
    /// Output shards written (shards).
    Shards,
}

/// A callback that sees `(stage, done, total)` as [`quantize_dir`] goes (e.g. a progress bar);
/// the default reports nothing.
#[derive(Clone, Default)]
pub struct Progress(Option<std::sync::Arc<ProgressFn>>);

/// What [`Progress`] calls: `(stage, done, total)`.
type ProgressFn = dyn Fn(Stage, usize, usize) + Send + Sync;

impl Progress {
    /// Reports to `f`.
    pub fn new(f: impl Fn(Stage, usize, usize) + Send + Sync + 'static) -> Self {
        Progress(Some(std::sync::Arc::new(f)))
    }

    /// Tells the callback, if any.
    fn report(&self, stage: Stage, done: usize, total: usize) {
        if let Some(f) = &self.0 {
            f(stage, done, total);
        }
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Progress(callback)" } else { "Progress(none)" })
    }
}

/// Calibrated quantization: what runs on the calibration statistics.
#[derive(Clone, Debug)]
pub struct Calibrated {
    /// The calibration text and how it is cut.
    pub data: CalibrationOptions,
    /// SmoothQuant with this migration strength α (0..1) before quantizing.
    pub smoothquant: Option<f32>,
    /// GPTQ instead of rounding to nearest, sequentially: each block linear from the inputs
    /// it gets once the layers before it (earlier blocks, earlier sites of its block) are
    /// quantized ([`calibrate::calibrate_sequential`]), toward the float model's outputs
    /// ([`gptq::FloatTarget`]).
    pub gptq: bool,
    /// GPTQ's relative damping `λ`: it factors `H + λ·mean(diag H)·I` (positive;
    /// [`Scheme::gptq_damping`] is each scheme's default).
    pub damping: f64,
}

/// Calibration results that shape the quantization of every shard.
struct Prepared {
    smoothing: Option<Smoothing>,
    gptq: bool,
    /// Calibration (sequences, tokens) run.
    ran: (usize, usize),
    /// The written tensors of the block linears GPTQ quantized while calibrating, by module,
    /// taken as their shard is written.
    quantized: Mutex<BTreeMap<String, Vec<OutTensor<'static>>>>,
}

impl Prepared {
    /// Calibrates on `input`: derives the smoothing factors from the float model (reading
    /// every shard's weights), then, for GPTQ, quantizes every selected block linear with the
    /// `recipe` block by block ([`calibrate_sequential`]).
    fn new(input: &Path, shards: &[String], c: &Calibrated, recipe: &Recipe, mse: bool, sel: &Selection<'_>, progress: &Progress) -> Result<Self, QuantizeError> {
        if let Some(a) = c.smoothquant.filter(|a| !(0.0..=1.0).contains(a)) {
            return Err(QuantizeError::Usage(format!("--smoothquant {a}: the migration strength must be in [0, 1]")));
        }
        gptq::check_damping(c.damping).map_err(|e| QuantizeError::Usage(format!("--gptq-damping {}: {e}", c.damping)))?;
        let sequences = calibration_sequences(input, &c.data, &|done, total| progress.report(Stage::Sampling, done, total))?;
        let smoothing = match c.smoothquant {
            Some(alpha) => {
                let cal = calibrate(input, &sequences)?;
                let (maxima, names) = column_absmax(input, shards)?;
                let s = Smoothing::new(&cal, alpha, cal.heads, |name| maxima.get(name).cloned()).map_err(QuantizeError::Usage)?;
                // Smoothing is exact only when both sides of every site are rewritten.
                if let Some(missing) = s.weights().find(|n| !names.contains(*n)) {
                    return Err(QuantizeError::Tensor { name: missing.to_string(), msg: "SmoothQuant must rewrite this tensor, but no shard holds it".into() });
                }
                Some(s)
            }
            None => None,
        };
        let ran = (sequences.len(), sequences.iter().map(Vec::len).sum());
        let mut prep = Prepared { smoothing, gptq: c.gptq, ran, quantized: Mutex::default() };
        if c.gptq {
            prep.quantize_sequentially(input, shards, &sequences, recipe, mse, c.damping, sel, progress)?;
        }
        Ok(prep)
    }

    /// GPTQ on every selected dense block linear of the shards, each from the Hessian of its
    /// (smoothed) inputs in a model whose earlier layers are quantized (relative `damping`),
    /// rounding the weights that best give the float model's outputs from those inputs
    /// ([`gptq::FloatTarget`]); keeps the tensors to write.
    #[allow(clippy::too_many_arguments)]
    fn quantize_sequentially(&mut self, input: &Path, shards: &[String], sequences: &[Vec<u32>], recipe: &Recipe, mse: bool, damping: f64, sel: &Selection<'_>, progress: &Progress) -> Result<(), QuantizeError> {
        let maps = shards.iter().map(|s| map_file(&input.join(s)).map(|m| (input.join(s), m))).collect::<Result<Vec<_>, _>>()?;
        let files = maps.iter().map(|(path, map)| read_shard(map, path)).collect::<Result<Vec<_>, _>>()?;
        let smoothing = self.smoothing.as_ref();
        let quantized = self.quantized.get_mut().expect("quantized tensors");
        calibrate_sequential(input, sequences, &|done, total| progress.report(Stage::Gptq, done, total), |layer, site, m| {
            let (h, cross) = match smoothing.and_then(|s| s.factor(layer, site)) {
                Some(s) => (m.hessian.divided(s), m.cross.divided(s)),
                None => (m.hessian.clone(), m.cross.clone()),
            };
            let site_err = |msg: String| QuantizeError::Usage(format!("GPTQ, block {layer} {site:?} inputs: {msg}"));
            let factor = Factor::new(&h, damping).map_err(site_err)?;
            if factor.damping > damping {
                tracing::warn!(layer, ?site, asked = damping, used = factor.damping, "GPTQ raised the damping: the damped Hessian of these calibration inputs was not positive definite");
            }
            // Built when the site's first selected layer needs it.
            let mut target: Option<gptq::FloatTarget> = None;
            let mut replaced = Vec::new();
            for leaf in site_modules(site) {
                let module = format!("model.layers.{layer}.{leaf}");
                let name = format!("{module}.weight");
                let Some(view) = files.iter().find_map(|f| f.tensor(&name).ok()) else { continue };
                if view.shape().len() != 2 || !sel.selects(&module) {
                    continue;
                }
                let (rows, cols) = (view.shape()[0], view.shape()[1]);
                let rescale = smoothing.and_then(|s| s.rescale(&name));
                let (dtype, w) = module_weights(&name, &view, rescale)?;
                let tensor_err = |msg: String| QuantizeError::Tensor { name: name.clone(), msg };
                // Weight-only layers: what the float layer computes from the float model's
                // inputs, as far as the quantized model's inputs can reach it.
                let w = if recipe.weight_only() {
                    if target.is_none() {
                        target = Some(gptq::FloatTarget::new(&h, &cross, factor.damping).map_err(site_err)?);
                    }
                    target.as_ref().expect("built above").apply(&w).map_err(tensor_err)?
                } else {
                    w
                };
                let tensors = recipe.quantize(&module, &w, cols, dtype, mse, Some(&factor)).map_err(tensor_err)?;
                // The model calibrates unsmoothed: undo the smoothing of what was written.
                let mut w_hat = recipe.decode(&module, &tensors, rows, cols).map_err(|msg| tensor_err(format!("decoding what was written: {msg}")))?;
                if let Some(r) = rescale {
                    r.undo(&mut w_hat, cols);
                }
                quantized.insert(module, tensors);
                replaced.push((name, w_hat));
            }
            Ok(replaced)
        })?;
        Ok(())
    }

    /// The rewrite of tensor `name`, if smoothing changes it.
    fn rescale(&self, name: &str) -> Option<&Rescale> {
        self.smoothing.as_ref().and_then(|s| s.rescale(name))
    }

    /// The tensors GPTQ wrote for `module` while calibrating (once).
    fn take(&self, module: &str) -> Option<Vec<OutTensor<'static>>> {
        self.quantized.lock().expect("quantized tensors").remove(module)
    }
}

/// The modules (after `model.layers.N.`) reading a site's inputs.
fn site_modules(site: crate::model::LinearSite) -> &'static [&'static str] {
    use crate::model::LinearSite as S;
    match site {
        S::Qkv => &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        S::Output => &["self_attn.o_proj"],
        S::GateUp => &["mlp.gate_proj", "mlp.up_proj"],
        S::Down => &["mlp.down_proj"],
    }
}

/// Per-column `max |w|` of weight tensors, by name.
type ColumnMaxima = BTreeMap<String, Vec<f32>>;

/// Per-column `max |w|` of every block linear weight (the ones [`module_site`] knows) in the
/// shards, and the names of all their tensors.
fn column_absmax(input: &Path, shards: &[String]) -> Result<(ColumnMaxima, BTreeSet<String>), QuantizeError> {
    let (mut out, mut names) = (BTreeMap::new(), BTreeSet::new());
    for shard in shards {
        let path = input.join(shard);
        let map = map_file(&path)?;
        for (name, view) in read_shard(&map, &path)?.tensors() {
            names.insert(name.clone());
            if view.shape().len() == 2 && name.strip_suffix(".weight").is_some_and(|m| module_site(m).is_some()) {
                let (_, w) = float_weights(&name, &view)?;
                let mut m = vec![0f32; view.shape()[1]];
                column_absmax_into(&mut m, &w);
                out.insert(name, m);
            }
        }
    }
    Ok((out, names))
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct QuantizeSummary {
    /// Output shard files, in order.
    pub shards: Vec<String>,
    /// Tensors copied unchanged.
    pub copied: usize,
    /// The unquantized linear modules written into config.json.
    pub ignored: Vec<String>,
    /// `--exclude` patterns that matched no module.
    pub unmatched_patterns: Vec<String>,
    /// Non-weight files copied (tokenizer, generation config, chat template).
    pub copied_files: Vec<String>,
    /// Reconstruction statistics of every quantized tensor.
    pub report: Report,
    /// Tensors rewritten by SmoothQuant.
    pub smoothed: usize,
    /// Modules quantized by rounding to nearest although GPTQ was asked for (no calibration
    /// inputs reached them).
    pub uncalibrated: Vec<String>,
    /// Calibration (sequences, tokens) run, when calibrated: fewer tokens than asked where the
    /// text held fewer whole sequences.
    pub calibrated_on: Option<(usize, usize)>,
}

/// Whether a module is a router (never quantized).
fn is_router(module: &str) -> bool {
    matches!(module.rsplit('.').next(), Some("gate" | "shared_expert_gate"))
}

/// Whether a module is a routed expert (`….experts.E.…`, not `shared_experts`).
fn is_expert(module: &str) -> bool {
    module.contains(".experts.")
}

/// Whether a module is a Linear layer whose weight a quantizer targets (Mixtral's experts are
/// `w1`/`w2`/`w3`).
fn is_linear(module: &str) -> bool {
    let leaf = module.rsplit('.').next().unwrap_or("");
    is_head(module)
        || is_router(module)
        || leaf.ends_with("_proj")
        || (is_expert(module) && matches!(leaf, "w1" | "w2" | "w3"))
}

/// Whether a module is the output head.
fn is_head(module: &str) -> bool {
    module == "lm_head" || module.ends_with(".lm_head")
}

/// Which linear modules are quantized.
struct Selection<'a> {
    patterns: &'a [String],
    experts_only: bool,
    /// Whether the output head is quantized.
    head: bool,
    hits: Vec<usize>,
}

impl Selection<'_> {
    /// Whether `module` is quantized, counting the `--exclude` patterns it matches.
    fn quantized(&mut self, module: &str) -> bool {
        for (p, hits) in self.patterns.iter().zip(self.hits.iter_mut()) {
            *hits += usize::from(fnmatch(p.as_bytes(), module.as_bytes()));
        }
        self.selects(module)
    }

    /// Whether `module` is quantized.
    fn selects(&self, module: &str) -> bool {
        let excluded = is_router(module)
            || (is_head(module) && !self.head)
            || (self.experts_only && !is_expert(module))
            || self.patterns.iter().any(|p| fnmatch(p.as_bytes(), module.as_bytes()));
        !excluded
    }
}

/// The shard files of an input directory (from the index, else `model.safetensors`).
fn input_shards(dir: &Path) -> Result<Vec<String>, QuantizeError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v.get("weight_map").and_then(Value::as_object).ok_or_else(|| io(&index, "no weight_map object"))?;
        let files: BTreeSet<String> = map.values().filter_map(Value::as_str).map(str::to_owned).collect();
        return Ok(files.into_iter().collect());
    }
    if dir.join("model.safetensors").exists() {
        return Ok(vec!["model.safetensors".into()]);
    }
    Err(io(dir, "no model.safetensors or model.safetensors.index.json"))
}

fn read_json(path: &Path) -> Result<Value, QuantizeError> {
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    serde_json::from_str(&text).map_err(|e| io(path, format!("invalid JSON: {e}")))
}

fn write_json(path: &Path, v: &Value) -> Result<(), QuantizeError> {
    let text = serde_json::to_string_pretty(v).map_err(|e| io(path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| io(path, e))
}

/// Files copied next to the weights (fnmatch patterns over file names).
const COPIED_FILES: [&str; 7] =
    ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json", "chat_template*"];

/// The f32 values of a float weight; errors name the tensor.
fn float_weights(name: &str, view: &TensorView<'_>) -> Result<(FloatDtype, Vec<f32>), QuantizeError> {
    let bad = |msg: String| QuantizeError::Tensor { name: name.into(), msg };
    let dtype = FloatDtype::from_safetensors(view.dtype())
        .ok_or_else(|| bad(format!("dtype {:?} is not a float type (only F32, F16 and BF16 weights can be quantized)", view.dtype())))?;
    let w = dtype.decode(view.data());
    if let Some(i) = w.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!("value {} at index {i} is not finite", w[i])));
    }
    Ok((dtype, w))
}

/// A read-only map of the input file `path`.
fn map_file(path: &Path) -> Result<Mmap, QuantizeError> {
    let file = std::fs::File::open(path).map_err(|e| io(path, e))?;
    // SAFETY: read-only map of an input file that is not modified while we read it.
    unsafe { Mmap::map(&file) }.map_err(|e| io(path, e))
}

/// The safetensors header and views of a mapped shard.
fn read_shard<'m>(map: &'m Mmap, path: &Path) -> Result<SafeTensors<'m>, QuantizeError> {
    SafeTensors::deserialize(map).map_err(|e| io(path, format!("invalid safetensors: {e}")))
}

/// What [`quantize_shard`] did.
#[derive(Default)]
struct ShardResult {
    names: Vec<String>,
    /// Whether a quantized output head was written (from `lm_head.weight` or the tied embedding).
    head: bool,
    copied: usize,
    stats: Vec<TensorStats>,
    bytes: u64,
    smoothed: usize,
    uncalibrated: Vec<String>,
}

/// The f32 values of a float tensor after SmoothQuant's rewrite `r`; errors name the tensor
/// (a factor count that does not fit its shape, a value its dtype cannot hold).
fn smoothed(name: &str, view: &TensorView<'_>, cols: usize, r: &Rescale) -> Result<(FloatDtype, Vec<f32>), QuantizeError> {
    let bad = |msg: String| QuantizeError::Tensor { name: name.into(), msg };
    let (dtype, mut w) = float_weights(name, view)?;
    let fits = |v: &Option<Vec<f32>>, n: usize| v.as_ref().is_none_or(|v| v.len() == n);
    if !fits(&r.rows, w.len() / cols) || !fits(&r.cols, cols) {
        return Err(bad(format!("shape {:?} does not match the smoothing factors of its calibrated input", view.shape())));
    }
    r.apply(&mut w, cols);
    if let Some(i) = w.iter().position(|&x| !dtype.round(x).is_finite()) {
        return Err(bad(format!("SmoothQuant's factors take value {i} to {}, beyond {dtype:?}; use a smaller --smoothquant", w[i])));
    }
    Ok((dtype, w))
}

/// What every shard is quantized with.
struct ShardPlan<'a> {
    recipe: &'a Recipe,
    /// The output head's recipe, when it is quantized.
    head: Option<&'a Recipe>,
    /// The embedding that is also written, quantized, as the untied `lm_head`.
    tied_embedding: Option<&'a str>,
    prep: Option<&'a Prepared>,
    mse: bool,
}

impl ShardPlan<'_> {
    fn recipe_for(&self, module: &str) -> &Recipe {
        match self.head {
            Some(h) if is_head(module) => h,
            _ => self.recipe,
        }
    }

    /// Quantizes the float tensor `view` (named `name`) as the weight of linear `module`,
    /// after SmoothQuant's `rescale` when given, and records its statistics in `res`.
    fn quantize(&self, name: &str, module: &str, view: &TensorView<'_>, rescale: Option<&Rescale>, res: &mut ShardResult) -> Result<Vec<OutTensor<'static>>, QuantizeError> {
        let (rows, cols) = (view.shape()[0], view.shape()[1]);
        res.smoothed += usize::from(rescale.is_some());
        let (dtype, w) = module_weights(name, view, rescale)?;
        let tensor_err = |msg: String| QuantizeError::Tensor { name: name.to_string(), msg };
        let recipe = self.recipe_for(module);
        let tensors = match self.prep.and_then(|p| p.take(module)) {
            Some(t) => t,
            None => {
                // No calibration inputs are gathered for the output head: it is rounded to nearest.
                if self.prep.is_some_and(|p| p.gptq) && !is_head(module) {
                    tracing::warn!(module, "no calibration inputs reached this layer: rounded to nearest");
                    res.uncalibrated.push(module.to_string());
                }
                recipe.quantize(module, &w, cols, dtype, self.mse, None).map_err(tensor_err)?
            }
        };
        let w_hat = recipe.decode(module, &tensors, rows, cols).map_err(|msg| tensor_err(format!("decoding what was written: {msg}")))?;
        res.stats.push(TensorStats::measure(name, &w, &w_hat, cols, recipe.block_cols(cols)));
        Ok(tensors)
    }
}

/// The f32 values of the float weight `view` (named `name`), after SmoothQuant's `rescale`
/// when given.
fn module_weights(name: &str, view: &TensorView<'_>, rescale: Option<&Rescale>) -> Result<(FloatDtype, Vec<f32>), QuantizeError> {
    match rescale {
        Some(r) => smoothed(name, view, view.shape()[1], r),
        None => float_weights(name, view),
    }
}

/// Quantizes one input shard into `out_path`.
fn quantize_shard(in_path: &Path, out_path: &Path, plan: &ShardPlan<'_>, sel: &mut Selection<'_>, ignored: &mut BTreeSet<String>) -> Result<ShardResult, QuantizeError> {
    let map = map_file(in_path)?;
    let st = read_shard(&map, in_path)?;
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    let mut out: Vec<OutTensor<'_>> = Vec::with_capacity(names.len());
    let mut res = ShardResult::default();
    for name in &names {
        let view = st.tensor(name).map_err(|e| io(in_path, format!("{name}: {e}")))?;
        let rescale = plan.prep.and_then(|p| p.rescale(name));
        let cols = if view.shape().len() == 2 { view.shape()[1] } else { 1 };
        let linear = name.strip_suffix(".weight").filter(|m| view.shape().len() == 2 && is_linear(m));
        if plan.tied_embedding.is_some() && linear.is_some_and(is_head) {
            return Err(QuantizeError::Tensor {
                name: name.clone(),
                msg: "config.json ties the output head to the embedding, yet the checkpoint stores the head too".into(),
            });
        }
        match linear {
            Some(m) if sel.quantized(m) => {
                out.extend(plan.quantize(name, m, &view, rescale, &mut res)?);
                res.head |= is_head(m);
            }
            other => {
                ignored.extend(other.map(str::to_owned));
                let data = match rescale {
                    Some(r) => {
                        let (dtype, w) = smoothed(name, &view, cols, r)?;
                        res.smoothed += 1;
                        Cow::Owned(dtype.encode(&w))
                    }
                    None => Cow::Borrowed(view.data()),
                };
                out.push(OutTensor { name: name.clone(), dtype: view.dtype(), shape: view.shape().to_vec(), data });
                res.copied += 1;
                if plan.tied_embedding == Some(name.as_str()) {
                    out.extend(plan.quantize("lm_head.weight", "lm_head", &view, None, &mut res)?);
                    res.head = true;
                }
            }
        }
    }
    // transformers' (and llm-compressor's) header; Quark writes none.
    write_tensors(out_path, &out, plan.recipe.format() == Format::CompressedTensors)?;
    res.bytes = out.iter().map(|t| t.data.len() as u64).sum();
    res.names = out.into_iter().map(|t| t.name).collect();
    Ok(res)
}

/// Writes `tensors` as the safetensors file `path`, with transformers' `format: pt` header
/// when `pt_header`.
fn write_tensors(path: &Path, tensors: &[OutTensor<'_>], pt_header: bool) -> Result<(), QuantizeError> {
    let views = tensors
        .iter()
        .map(|t| TensorView::new(t.dtype, t.shape.clone(), &t.data).map(|v| (t.name.clone(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| io(path, e))?;
    let metadata = pt_header.then(|| HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::serialize_to_file(views, &metadata, path).map_err(|e| io(path, e))
}

/// Copies the non-weight files of the model directory `input` ([`COPIED_FILES`]) into
/// `output`; their names, sorted.
fn copy_model_files(input: &Path, output: &Path) -> Result<Vec<String>, QuantizeError> {
    let mut copied = Vec::new();
    for entry in std::fs::read_dir(input).map_err(|e| io(input, e))? {
        let entry = entry.map_err(|e| io(input, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_file() && COPIED_FILES.iter().any(|p| fnmatch(p.as_bytes(), name.as_bytes())) {
            std::fs::copy(entry.path(), output.join(&name)).map_err(|e| io(&entry.path(), e))?;
            copied.push(name);
        }
    }
    copied.sort();
    Ok(copied)
}

/// Whether calibrated quantization ([`Calibrated`]) can run on the Hugging Face directory
/// `input`: dense models only for now (read from its config.json).
pub fn calibration_supported(input: &Path) -> Result<bool, QuantizeError> {
    let dir = crate::checkpoint::HfDir::open(input).map_err(|e| io(&input.join("config.json"), e))?;
    Ok(dir.config.moe.is_none())
}

/// The input embedding of Llama-family checkpoints, which a tied output head shares.
const TIED_EMBEDDING: &str = "model.embed_tokens.weight";

/// The `transform_config` of an input model's `quantization_config`, which may hold nothing
/// else (a float model with online rotations, as `--rotate` writes it); an error for any
/// other quantization metadata (the input must hold float weights).
fn input_transforms(qc: Option<&Value>) -> Result<Option<Value>, String> {
    let Some(qc) = qc.filter(|q| !q.is_null()) else { return Ok(None) };
    let transform_only = qc.get("quant_method").and_then(Value::as_str) == Some("compressed-tensors")
        && qc.get("config_groups").and_then(Value::as_object).is_some_and(|g| g.is_empty())
        && qc.get("transform_config").and_then(Value::as_object).is_some_and(|t| !t.is_empty());
    if !transform_only {
        return Err("already has a quantization_config (the input must hold float weights)".into());
    }
    Ok(qc.get("transform_config").cloned())
}

/// Quantizes `opts.input` into `opts.output`, one shard at a time.
pub fn quantize_dir(opts: &QuantizeOptions) -> Result<QuantizeSummary, QuantizeError> {
    let (input, output) = (&opts.input, &opts.output);
    let mut config = read_json(&input.join("config.json"))?;
    let cfg_path = input.join("config.json");
    let cfg = config.as_object_mut().ok_or_else(|| io(&cfg_path, "not a JSON object"))?;
    let transforms = input_transforms(cfg.get("quantization_config")).map_err(|m| io(&cfg_path, m))?;
    if transforms.is_some() && opts.recipe.format() != Format::CompressedTensors {
        return Err(QuantizeError::Usage(format!("the input runs online rotations (a compressed-tensors transform_config), which {} checkpoints cannot carry: use --format compressed-tensors", opts.recipe.format().name())));
    }
    let shards = input_shards(input)?;
    std::fs::create_dir_all(output).map_err(|e| io(output, e))?;
    let same = std::fs::canonicalize(input).ok().zip(std::fs::canonicalize(output).ok()).is_some_and(|(a, b)| a == b);
    if same {
        return Err(QuantizeError::Usage(format!("--output {} is the input directory", output.display())));
    }

    if let Some(h) = opts.head {
        if h.format() != opts.recipe.format() {
            return Err(QuantizeError::Usage(format!("the output head's recipe is in {} format, the model's in {}", h.format().name(), opts.recipe.format().name())));
        }
        if opts.experts_only {
            return Err(QuantizeError::Usage("--lm-head quantizes the output head, --experts-only leaves every non-expert layer as it is: give one".into()));
        }
        if let Some(p) = opts.exclude.iter().find(|p| fnmatch(p.as_bytes(), b"lm_head")) {
            return Err(QuantizeError::Usage(format!("--exclude {p:?} matches lm_head, which --lm-head quantizes")));
        }
    }
    let tied = opts.head.is_some() && cfg.get("tie_word_embeddings").and_then(Value::as_bool) == Some(true);

    let mut sel = Selection { patterns: &opts.exclude, experts_only: opts.experts_only, head: opts.head.is_some(), hits: vec![0; opts.exclude.len()] };
    let prep = opts.calibrated.as_ref().map(|c| Prepared::new(input, &shards, c, &opts.recipe, opts.mse_observer, &sel, &opts.progress)).transpose()?;
    let mut ignored = BTreeSet::new();
    if opts.head.is_none() {
        ignored.insert("lm_head".to_string());
    }
    let plan = ShardPlan {
        recipe: &opts.recipe,
        head: opts.head.as_ref(),
        tied_embedding: tied.then_some(TIED_EMBEDDING),
        prep: prep.as_ref(),
        mse: opts.mse_observer,
    };
    let mut head_written = false;
    let mut weight_map = BTreeMap::new();
    let (mut stats, mut copied, mut total) = (Vec::new(), 0, 0u64);
    let (mut smoothed, mut uncalibrated) = (0, Vec::new());
    for (i, shard) in shards.iter().enumerate() {
        opts.progress.report(Stage::Shards, i, shards.len());
        let r = quantize_shard(&input.join(shard), &output.join(shard), &plan, &mut sel, &mut ignored)?;
        head_written |= r.head;
        tracing::info!(shard, tensors = r.names.len(), quantized = r.stats.len(), "shard written");
        weight_map.extend(r.names.into_iter().map(|n| (n, shard.clone())));
        stats.extend(r.stats);
        copied += r.copied;
        total += r.bytes;
        smoothed += r.smoothed;
        uncalibrated.extend(r.uncalibrated);
    }
    opts.progress.report(Stage::Shards, shards.len(), shards.len());
    // Quark and sharded transformers checkpoints carry an index; write it even for one shard.
    write_json(&output.join("model.safetensors.index.json"), &json!({ "metadata": { "total_size": total }, "weight_map": weight_map }))?;

    if opts.head.is_some() && !head_written {
        let why = if tied { format!("ties the output head to the embedding, but no shard holds {TIED_EMBEDDING}") } else { "has no tie_word_embeddings: true, and no shard holds lm_head.weight".into() };
        return Err(io(&cfg_path, format!("{why} (--lm-head needs an output head)")));
    }
    let ignored: Vec<String> = ignored.into_iter().collect();
    let mut qc = opts.recipe.quantization_config(opts.head.as_ref(), &ignored);
    if opts.recipe.format() == Format::CompressedTensors {
        // How the scales and values were chosen, as llm-compressor records it. GPTQ's
        // activation order over static groups is compressed-tensors' `actorder: "weight"`,
        // which its validation accepts for group strategies only (per channel the order
        // leaves nothing for the format to record).
        // The output head has no calibration inputs, so GPTQ leaves it rounded to nearest.
        for group in ["group_0", "group_1"] {
            let Some(w) = qc["config_groups"].get_mut(group).and_then(|g| g.get_mut("weights")) else { continue };
            w["observer"] = json!(if opts.mse_observer { "mse" } else { "minmax" });
            if group == "group_0" && prep.as_ref().is_some_and(|p| p.gptq) && w["strategy"] == "group" {
                w["actorder"] = json!("weight");
            }
        }
    }
    if let Some(t) = transforms {
        qc["transform_config"] = t;
    }
    cfg.insert("quantization_config".into(), qc);
    if tied {
        cfg.insert("tie_word_embeddings".into(), json!(false));
    }
    write_json(&output.join("config.json"), &config)?;

    let copied_files = copy_model_files(input, output)?;

    let unmatched_patterns = opts.exclude.iter().zip(&sel.hits).filter(|(_, &h)| h == 0).map(|(p, _)| p.clone()).collect();
    let scheme_name = scheme_of(&opts.recipe);
    Ok(QuantizeSummary {
        shards,
        copied,
        ignored,
        unmatched_patterns,
        copied_files,
        report: Report::new(scheme_name, opts.recipe.format().name(), stats),
        smoothed,
        uncalibrated,
        calibrated_on: prep.as_ref().map(|p| p.ran),
    })
}

impl Recipe {
    /// Whether activations stay in 16 bits at run time (weight-only W4A16). GPTQ aims such
    /// layers at the float model's outputs ([`gptq::FloatTarget`]); layers whose activations
    /// are quantized keep their float weights as the target, which measured better for W4A8
    /// (calibration does not simulate the activation rounding the target would chase).
    pub fn weight_only(&self) -> bool {
        matches!(self, Recipe::CompressedTensors(compressed_tensors::Scheme::Int4 { int8_act: false, .. }))
    }
}

/// The scheme a recipe implements (for reports; `-asym` for int4 with zero points).
fn scheme_of(recipe: &Recipe) -> &'static str {
    use compressed_tensors::Scheme as Ct;
    match recipe {
        Recipe::CompressedTensors(Ct::Int4 { int8_act: false, asymmetric: true, .. }) => "w4a16-asym",
        Recipe::CompressedTensors(Ct::Int4 { int8_act: true, asymmetric: true, .. }) => "w4a8-asym",
        Recipe::CompressedTensors(Ct::Int4 { int8_act: false, .. }) => Scheme::W4A16.name(),
        Recipe::CompressedTensors(Ct::Int4 { int8_act: true, .. }) | Recipe::Quark(quark::Scheme::W4A8) => Scheme::W4A8.name(),
        Recipe::CompressedTensors(Ct::Int8) | Recipe::Quark(quark::Scheme::Int8) => Scheme::W8A8Int8.name(),
        Recipe::CompressedTensors(Ct::Fp8) | Recipe::Quark(quark::Scheme::Fp8) => Scheme::W8A8Fp8.name(),
    }
}
